# dedupd as a container: a build stage with the Rust release rust-toolchain.toml pins and
# the C libraries the bundled librdkafka needs (OpenSSL for TLS/SASL, Cyrus SASL for
# Kerberos/GSSAPI), and a slim runtime
# stage that runs as an unprivileged user with the data directory on a volume.
#
#   docker build -t dedupd .
#   docker run -v dedupd-data:/var/lib/dedupd -v ./dedupd.toml:/etc/dedupd/dedupd.toml:ro \
#     -e DEDUPD_TOKEN=... -p 8080:8080 dedupd
#
# The config must bind the HTTP API to 0.0.0.0 for the port to be reachable, which dedupd
# only accepts with a bearer token: `token = "${DEDUPD_TOKEN}"` reads it from the
# environment. See docs/operations.md.

FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      build-essential cmake perl pkg-config libssl-dev libsasl2-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked && strip target/release/dedupd

FROM debian:bookworm-slim
# libsasl2-2 is linked; the GSSAPI module and krb5-user (kinit, which librdkafka runs to
# refresh tickets: sasl.kerberos.kinit.cmd) are for Kerberos (sasl.mechanisms = GSSAPI).
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl libssl3 libsasl2-2 libsasl2-modules-gssapi-mit krb5-user \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home-dir /var/lib/dedupd --shell /usr/sbin/nologin dedupd \
    && mkdir -p /var/lib/dedupd /etc/dedupd && chown dedupd:dedupd /var/lib/dedupd
COPY --from=build /src/target/release/dedupd /usr/local/bin/dedupd
COPY dedupd.example.toml /etc/dedupd/dedupd.example.toml
USER dedupd
VOLUME /var/lib/dedupd
EXPOSE 8080
# /readyz answers 503 once the ledger is poisoned (G7) or while it is not ready.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD curl -fsS http://127.0.0.1:8080/readyz >/dev/null || exit 1
# SIGTERM drains in-flight work and commits offsets; give it longer than the drain watchdog
# (2 x kafka.drain_timeout + 10 s): `docker stop -t 90`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/dedupd"]
CMD ["run", "--config", "/etc/dedupd/dedupd.toml", "--data-dir", "/var/lib/dedupd"]
