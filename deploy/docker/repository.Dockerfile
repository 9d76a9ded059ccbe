# A model repository, all in one (docs/repository.md): `cleave serve REPO` runs the controller,
# the router and every version's shards and rankers as processes of one container, so it
# needs the cleave wheel (Python, torch CPU, as ranker.Dockerfile) and the cleave-router and
# cleave-shard executables (as router.Dockerfile and shard.Dockerfile build them). The Helm
# chart runs it in repository mode (docs/deploy.md, "Serving a model repository").
# Build from the repository root:
#   docker build -f deploy/docker/repository.Dockerfile -t cleave .
# torch comes from the default index unless TORCH_INDEX_URL names a CPU-only wheel index.
# Run with a repository mounted read-write at /repository (the router writes the rollout
# state to /repository/.cleave/rollout.json):
#   docker run -v $PWD/repo:/repository -p 8000:8000 -p 8001:8001 cleave \
#     serve /repository --host 0.0.0.0 --http-port 8000 --grpc-port 8001
# Orchestrators probe GET /ready and /live on the HTTP port; there is no HEALTHCHECK.

FROM rust:1.89-slim-bookworm AS executables
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo build --release --locked -p cleave-router -p cleave-shard \
        --bin cleave-router --bin cleave-shard

FROM python:3.11-slim-bookworm AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
COPY --from=rust:1.89-slim-bookworm /usr/local/cargo /usr/local/cargo
COPY --from=rust:1.89-slim-bookworm /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup PATH=/usr/local/cargo/bin:$PATH
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir "maturin>=1.7,<2" && maturin build --release --out /wheels

FROM python:3.11-slim-bookworm
ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch>=2.6,<3"; \
    fi
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Beside the interpreter (/usr/local/bin/python): where cleave's find_executable looks after
# $CLEAVE_BIN_DIR (python/cleave/launch/supervisor.py), and on PATH.
COPY --from=executables /src/target/release/cleave-router /usr/local/bin/cleave-router
COPY --from=executables /src/target/release/cleave-shard /usr/local/bin/cleave-shard
# uid 10001 as in the other images; the chart's fsGroup 10001 lets it write the volume.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cleave
USER cleave
# KServe v2 HTTP (with /ready, /live, /metrics, the repository and admin APIs), then gRPC.
EXPOSE 8000 8001
ENTRYPOINT ["cleave"]
CMD ["serve", "/repository", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001"]
