#!/usr/bin/env bash
# Builds the .deb: the release binary, plus the man page and completions generated from the binary's
# own CLI definition (so they cannot drift from it), then lists the package's files.
set -euo pipefail
cd "$(dirname "$0")/../.."

command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked
cargo build --release --locked
bin=target/release/sentinel-guard
mkdir -p target/assets
"$bin" man > target/assets/sentinel-guard.1
"$bin" completions bash > target/assets/sentinel-guard.bash
"$bin" completions zsh > target/assets/_sentinel-guard
"$bin" completions fish > target/assets/sentinel-guard.fish
deb=$(cargo deb --no-build --locked | tail -n 1)
dpkg-deb -c "$deb"
echo "built $deb"
