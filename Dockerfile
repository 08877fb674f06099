# syntax=docker/dockerfile:1
#
# Turnstile's container image: build the release binary, then copy it alone into a distroless
# runtime (glibc and libgcc, no shell, no package manager).
#
#   docker build -t turnstile:0.1.0 .
#
# The Helm chart (helm/turnstile) runs this image as uid/gid 10001 with a read-only root
# filesystem; keep USER below and the chart's securityContext in step.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Only what the binary is built from: build.rs compiles proto/ with protox (no system protoc)
# and src/store/postgres.rs embeds migrations/.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY migrations ./migrations
COPY src ./src
RUN cargo build --release --locked --bin turnstile \
 && install -D -m 0755 target/release/turnstile /out/turnstile

# cc-debian12 matches the builder's Debian 12 glibc and carries the libgcc_s the binary links.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/turnstile /usr/local/bin/turnstile
# A numeric uid that exists in no base image; the chart sets runAsUser 10001 to match.
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["/usr/local/bin/turnstile"]
# The server listens on 127.0.0.1:50051 unless told otherwise; in a container set
# TURNSTILE_LISTEN=0.0.0.0:50051 (the chart does).
CMD ["serve"]
