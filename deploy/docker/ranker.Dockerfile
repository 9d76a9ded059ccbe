# The ranker: Python, the cleave wheel and torch (CPU). Build from the repository root:
#   docker build -f deploy/docker/ranker.Dockerfile -t cleave-ranker .
# torch comes from the default index unless TORCH_INDEX_URL names a CPU-only wheel index
# (smaller image): --build-arg TORCH_INDEX_URL=<your CPU wheel index>.
# Run with a bundle mounted read-only at /bundle (docs/serving.md, "Executables and images"):
#   docker run -v $PWD/out/bundle:/bundle:ro -p 7100:7100 -p 9100:9100 cleave-ranker
# Orchestrators probe GET /ready and /live on the metrics port; there is no HEALTHCHECK.

FROM python:3.11-slim-bookworm AS build
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
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cleave
USER cleave
# The internal frame protocol, then /metrics, /ready, /live.
EXPOSE 7100 9100
ENTRYPOINT ["cleave", "ranker"]
CMD ["--bundle", "/bundle", "--listen", "0.0.0.0:7100", "--metrics-port", "9100", "--device", "cpu"]
