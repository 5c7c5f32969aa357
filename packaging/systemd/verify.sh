#!/usr/bin/env bash
# Checks the template unit, with the hardening drop-in's settings all enabled, with
# `systemd-analyze verify` (offline: no running systemd needed). Usage: verify.sh <sentinel-guard binary>
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binary="$(realpath "${1:?usage: verify.sh <path to the sentinel-guard binary>}")"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
unit="$dir/sentinel-guard@ci.service"
# The unit names the installed path; verify checks that the binary exists there.
sed "s#/usr/bin/sentinel-guard#$binary#" "$here/sentinel-guard@.service" > "$unit"
# Every commented setting of the drop-in, enabled, as a second [Service] section.
sed -n 's/^#\([A-Z][A-Za-z]*=\)/\1/p' "$here/sentinel-guard-hardening.conf.example" \
    | sed '1i [Service]' >> "$unit"
out="$(systemd-analyze verify --man=no "$unit" 2>&1)" || { echo "$out" >&2; exit 1; }
# Unknown or misspelt keys are only warnings for systemd; here they fail the check.
if [ -n "$out" ]; then
    echo "$out" >&2
    exit 1
fi
echo "systemd unit ok"
