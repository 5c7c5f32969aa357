#!/usr/bin/env bash
# Builds the release binary with the C library linked in (glibc's static archive), so it runs in an
# image without one: scratch, distroless-static, Alpine (musl), busybox. Static glibc keeps its own
# `files` and `dns` name services, so host names still resolve from /etc/hosts and resolv.conf; a
# host whose nsswitch.conf names other services (mdns, systemd-resolved) gets only those two, which
# is why the .deb ships the dynamic build.
#
#   packaging/static-build.sh [OUT]     (default: target/static/sentinel-guard)
#
# `--target` is what keeps the flags off the compiler plugins (proc macros), which cannot be static.
#
# Linked at a fixed address (`relocation-model=static`), not as a position-independent executable:
# a static PIE relocates its tables of pointers (about 300 KiB: vtables, string tables) when it
# starts, which makes them private to every process, the guard and its watchdog alike; at a fixed
# address they stay clean pages of the file, shared by every guard on the host (docs/benchmarks.md,
# "Memory per guarded app"). The price is the executable's own address randomisation (the stack,
# heap and mappings stay randomised; docs/security.md). `RUSTFLAGS='-C relocation-model=pie'`
# builds a static PIE instead.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/static/sentinel-guard}
host=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="-C relocation-model=static ${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --release --locked --target "$host"
install -D -m 0755 "${CARGO_TARGET_DIR:-target}/$host/release/sentinel-guard" "$out"
# A dynamic loader named in the binary would mean the link was not static after all.
if readelf -l "$out" | grep -q 'Requesting program interpreter'; then
    echo "$out is not static: $(readelf -l "$out" | grep interpreter)" >&2
    exit 1
fi
echo "built $out ($(stat -c %s "$out") bytes, static)"
