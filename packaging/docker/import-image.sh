#!/usr/bin/env bash
# Builds a minimal image of sentinel-guard with no registry at all: a root filesystem of the guard
# binary, the shared libraries it links (as ldd names them, the dynamic loader at its own path) and
# busybox (Debian's busybox-static) as the shell, loaded with `docker import`. This is how the test
# suite (tests/container_engine.rs) and an offline machine get an image; with a registry, build
# packaging/docker/Dockerfile instead.
#
#   packaging/docker/import-image.sh TAG GUARD_BINARY [EXTRA_PROGRAM...]
#
# e.g. packaging/docker/import-image.sh sentinel-guard:offline target/release/sentinel-guard
# Each EXTRA_PROGRAM (an absolute path, e.g. /bin/date for `date +%s%N`, which busybox lacks) is
# copied to /usr/bin with its libraries. The image's entrypoint is `sentinel-guard --`.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 TAG GUARD_BINARY [EXTRA_PROGRAM...]" >&2
    exit 2
fi
tag=$1
guard=$2
shift 2

# Debian's busybox-static installs /bin/busybox; a dynamically linked one gets its libraries below.
busybox=/bin/busybox
if [ ! -x "$busybox" ]; then
    echo "$busybox not found: apt-get install busybox-static" >&2
    exit 1
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,usr/bin,usr/local/bin,etc,tmp,shared}
chmod 1777 "$root/tmp"

# The guard, without its debug sections (a debug build is over 100 MB; stripping changes no code).
strip -o "$root/usr/local/bin/sentinel-guard" "$guard" 2>/dev/null \
    || cp "$guard" "$root/usr/local/bin/sentinel-guard"
chmod 0755 "$root/usr/local/bin/sentinel-guard"

# Copies the libraries ldd names for $1, each at the path the loader will look for it.
copy_libs() {
    # A static program has none: ldd then fails, which is no error here.
    { ldd "$1" 2>/dev/null || true; } | awk '/=> \//{print $3} /^[ \t]*\//{print $1}' | while read -r lib; do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
}
copy_libs "$guard"
for program in "$@"; do
    cp -L "$program" "$root/usr/bin/$(basename "$program")"
    copy_libs "$program"
done

cp "$busybox" "$root/bin/busybox"
copy_libs "$busybox"
for applet in $("$busybox" --list); do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done
# A user database so `id` and `ps` show names; the guard itself needs none.
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"

tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    -c 'ENTRYPOINT ["/usr/local/bin/sentinel-guard", "--"]' \
    -c 'CMD ["sh"]' \
    - "$tag" >/dev/null
echo "imported $tag"
