# syntax=docker/dockerfile:1
# settle: build the release binary in the Rust image, run it on Debian slim.
#
#   docker build -t settle .
#   docker run --rm settle --help
#
# RocksDB (C++) and librdkafka (C) are compiled from source by the rocksdb and rdkafka crates:
# the first build takes several minutes; the cache mounts keep later builds incremental.

ARG RUST_VERSION=1
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libclang-dev pkg-config libssl-dev zlib1g-dev perl python3 make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Every target the manifest names must exist for cargo to read it (benches included);
# config/ is there in case the code embeds its documented defaults.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY config ./config
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin settle \
    && install -s -m 0755 target/release/settle /usr/local/bin/settle

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/settle --shell /usr/sbin/nologin settle \
    && mkdir -p /var/lib/settle /etc/settle \
    && chown settle:settle /var/lib/settle
COPY --from=build /usr/local/bin/settle /usr/local/bin/settle
COPY config/ /etc/settle/
USER settle
WORKDIR /var/lib/settle
VOLUME ["/var/lib/settle"]
# Admin HTTP server (/metrics, /healthz, /readyz, /v1/...): `[admin] listen`, loopback by
# default; set SETTLE_ADMIN__LISTEN=0.0.0.0:9464 to reach it from outside the container, and
# then SETTLE_ADMIN_TOKENS=name:TOKEN (or admin.tokens-file) or SETTLE_ADMIN__ACTIONS=false:
# settle refuses operator actions on a public address without a token.
EXPOSE 9464
# tini forwards SIGTERM so settle's graceful shutdown (flush outbox, commit, close RocksDB) runs.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/settle"]
CMD ["run", "--config", "/etc/settle/settle.toml"]
