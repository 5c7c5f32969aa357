#!/usr/bin/env bash
# Builds the release binary with the C library linked in (glibc's static archive), so it runs in an
# image without one: scratch, distroless-static, Alpine (musl), busybox. Static glibc keeps its own
# `files` and `dns` name services, so host names still resolve from /etc/hosts and resolv.conf; a
# host whose nsswitch.conf names other services (mdns, systemd-resolved) gets only those two, which
# is why the .deb ships the dynamic build.
#
#   packaging/static-build.sh [OUT]     (default: target/static/sentinel-guard)
#
# `--target` is what keeps the flag off the compiler plugins (proc macros), which cannot be static.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/static/sentinel-guard}
host=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --release --locked --target "$host"
install -D -m 0755 "target/$host/release/sentinel-guard" "$out"
# A dynamic loader named in the binary would mean the link was not static after all.
if readelf -l "$out" | grep -q 'Requesting program interpreter'; then
    echo "$out is not static: $(readelf -l "$out" | grep interpreter)" >&2
    exit 1
fi
echo "built $out ($(stat -c %s "$out") bytes, static)"
