# The embedding shard: the cleave-shard executable alone (no Python, no torch).
# Build from the repository root:
#   docker build -f deploy/docker/shard.Dockerfile -t cleave-shard .
# Run with a bundle mounted read-only at /bundle (docs/serving.md, "Executables and images"):
#   docker run -v $PWD/out/bundle:/bundle:ro -p 7000:7000 -p 9100:9100 cleave-shard \
#     --bundle /bundle --listen 0.0.0.0:7000 --metrics-port 9100 --rows 0:1000000
# Orchestrators probe GET /ready and /live on the metrics port; there is no HEALTHCHECK.

FROM rust:1.89-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo build --release --locked --bin cleave-shard -p cleave-shard

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cleave
COPY --from=build /src/target/release/cleave-shard /usr/local/bin/cleave-shard
USER cleave
# Lookups (internal frame protocol), then /metrics, /ready, /live.
EXPOSE 7000 9100
ENTRYPOINT ["cleave-shard", "--log-format", "json"]
CMD ["--bundle", "/bundle", "--listen", "0.0.0.0:7000", "--metrics-port", "9100"]
