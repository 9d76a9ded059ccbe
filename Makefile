# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.installed
SOURCES := pyproject.toml Cargo.toml $(shell find crates -name '*.rs' -o -name Cargo.toml)
TORCHREC := torchrec==1.9.2
export PYO3_PYTHON := $(abspath $(PY))

.PHONY: demo test test-fast lint test-rust test-python bench setup tools clean

setup: $(STAMP)

# One install builds the native module (maturin, release) and installs every dependency, with
# uv (it fetches and unpacks torch's 6 GB of wheels in parallel: docs/testing.md); TorchRec follows
# with --no-deps (it declares the CUDA fbgemm-gpu; the `torchrec` extra names the CPU build and
# what TorchRec imports: docs/dependencies.md). --reinstall-package rebuilds the module when a
# Rust source changed; --compile-bytecode does what pip did, since a process under
# PYTHONDONTWRITEBYTECODE=1 would otherwise compile torch at every import. Then the standalone
# executables (cleave-shard, cleave-router, cleave-incast: no Python in them) are built in
# release and installed next to the `cleave` script, where the launcher looks first. That build
# names the native module's package and feature too, so cargo unifies the dependencies'
# features as maturin's build did and reuses every crate it compiled, linking only the
# executables.
$(STAMP): $(SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q 'uv>=0.9,<1'
	$(UV) pip install -q --compile-bytecode --python $(PY) --reinstall-package cleave -e '.[dev,ray,torchrec,stream]'
	$(UV) pip install -q --compile-bytecode --python $(PY) --no-deps $(TORCHREC)
	cargo build --release --bins -p cleave-shard -p cleave-router -p cleave-flow \
		-p cleave-py --features cleave-py/extension-module
	install -m 755 target/release/cleave-shard target/release/cleave-router target/release/cleave-incast \
		$(VENV)/bin/
	touch $@

# Tools built project-locally into .tools/bin from the Go module proxy: helm for the chart
# checks (tests/test_helm.py), vegeta as the independent load generator of `cleave bench serve
# --overload --generator vegeta`; and Apache Kafka's broker jars, resolved by Maven
# (tools/kafka/pom.xml) into .tools/kafka/libs, for the streaming tests (tests/support/kafka.py).
# Each stamp names the version, so a second run builds nothing and a new pin rebuilds. Needs
# `go`, and `mvn` with Java 17 or later, on PATH.
HELM_VERSION   := v3.22.0
HELM_STAMP     := .tools/helm-$(HELM_VERSION).stamp
VEGETA_VERSION := v12.12.0
VEGETA_STAMP   := .tools/vegeta-$(VEGETA_VERSION).stamp
KAFKA_VERSION  := 4.1.1
KAFKA_STAMP    := .tools/kafka-$(KAFKA_VERSION).stamp

tools: $(HELM_STAMP) $(VEGETA_STAMP) $(KAFKA_STAMP)

$(HELM_STAMP):
	@command -v go >/dev/null || { echo "make tools: needs go on PATH to build helm"; exit 2; }
	mkdir -p .tools/bin
	GOBIN=$(abspath .tools/bin) go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)
	touch $@

$(VEGETA_STAMP):
	@command -v go >/dev/null || { echo "make tools: needs go on PATH to build vegeta"; exit 2; }
	mkdir -p .tools/bin
	GOBIN=$(abspath .tools/bin) go install github.com/tsenart/vegeta/v12@$(VEGETA_VERSION)
	touch $@

$(KAFKA_STAMP): tools/kafka/pom.xml
	@command -v mvn >/dev/null || { echo "make tools: needs mvn (and Java 17+) for Kafka"; exit 2; }
	rm -rf .tools/kafka .tools/kafka-*.stamp
	mvn -q -B -f tools/kafka/pom.xml -Dkafka.version=$(KAFKA_VERSION) \
		dependency:copy-dependencies -DincludeScope=runtime \
		-DoutputDirectory=$(abspath .tools/kafka/libs)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/cleave demo

test: lint test-rust test-python

# pytest-xdist: 4 workers (most of a test's time is spent waiting for the processes it
# starts, so more workers than cores pay), each taking whole modules, longest first
# (tests/conftest.py; --no-loadscope-reorder keeps that order). A module with testbed tests
# runs under a lock the workers share. PYTEST_WORKERS=0 runs one process. docs/testing.md.
PYTEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

lint: $(STAMP)
	$(VENV)/bin/ruff check python tests
	$(VENV)/bin/ruff format --check python tests
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

test-rust: $(STAMP)
	cargo test --workspace

test-python: $(STAMP) tools
	$(PYTEST)

# The edit loop: the suite without its testbed, Ray and slow tests (markers in pyproject.toml).
test-fast: $(STAMP) tools
	$(PYTEST) -m "not slow and not testbed and not ray"

bench: $(STAMP)
	$(VENV)/bin/cleave bench lookup --json out/bench-lookup.json
	$(VENV)/bin/cleave bench shard --json out/bench-shard.json

clean:
	rm -rf $(VENV) target out
