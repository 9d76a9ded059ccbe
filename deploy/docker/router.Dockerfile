# The router: the cleave-router executable alone (no Python, no torch).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t cleave-router .
# Run with its JSON config at /etc/cleave/router.json and the bundle (for the model's
# signature) at the path the config names (docs/serving.md, "Executables and images"):
#   docker run -v $PWD/router.json:/etc/cleave/router.json:ro -v $PWD/out/bundle:/bundle:ro \
#     -p 8000:8000 cleave-router
# Orchestrators probe GET /ready and /live on the HTTP port; there is no HEALTHCHECK.

FROM rust:1.89-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo build --release --locked --bin cleave-router -p cleave-router

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cleave
COPY --from=build /src/target/release/cleave-router /usr/local/bin/cleave-router
USER cleave
# KServe v2 HTTP, /ready, /live and /metrics.
EXPOSE 8000
ENTRYPOINT ["cleave-router", "--log-format", "json"]
CMD ["/etc/cleave/router.json"]
