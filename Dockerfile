# condense: the proxy as a small container image.
#
#   docker build -t condense .
#   docker run --rm -p 127.0.0.1:8080:8080 -e CONDENSE_UPSTREAM__BASE_URL=https://api.openai.com/v1 condense
#
# Configuration: CONDENSE_* environment variables (CONDENSE_<SECTION>__<KEY>),
# and optionally a config file mounted at /app/config/condense.toml (read
# when present; the built-in defaults equal the shipped file).

# --- build -------------------------------------------------------------------
FROM rust:1.95-slim-bookworm AS build
WORKDIR /build
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml names the bench targets, so their files must exist.
COPY benches ./benches
COPY config ./config
# The registry and target caches survive between builds (BuildKit).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked --bin condense \
 && cp target/release/condense /condense

# --- run ---------------------------------------------------------------------
# glibc and libgcc, no shell, no package manager, a non-root user. TLS to
# the upstream uses rustls with the built-in Mozilla roots, so no CA bundle
# is needed; for a private CA (a TLS-inspecting proxy), mount its PEM file
# and name it in CONDENSE_UPSTREAM__CA_FILE or SSL_CERT_FILE.
FROM gcr.io/distroless/cc-debian12:nonroot
WORKDIR /app
COPY --from=build /condense /usr/local/bin/condense
ENV CONDENSE_SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
# distroless's nonroot user, by number: Kubernetes' runAsNonRoot can only
# check a numeric user ("image has non-numeric user" otherwise), and the
# manifests in docker/ name the same numbers.
USER 65532:65532
# The image has no curl: condense checks itself.
HEALTHCHECK --interval=15s --timeout=5s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/condense", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/condense"]
CMD ["serve"]
