#!/usr/bin/env bash
# `make image-check`: build the CPU image with buildah from LOCAL stand-ins for every outside source
# the Dockerfile names, then run `elastic-emb demo` inside it as uid 10001 on a read-only root.
#
# What is substituted (each through the Dockerfile's build arguments, nothing edited):
#   CPU_BASE=debian:12.12-slim   -> localhost/elastic-emb-check/debian:bookworm, a `debootstrap
#                                   --variant=minbase bookworm` root with python3 and ca-certificates,
#                                   plus this machine's extra CAs (/usr/local/share/ca-certificates)
#                                   so uv's native-TLS path trusts a TLS-inspecting egress proxy
#   UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5 -> localhost/elastic-emb-check/uv:0.9.5, an image holding only
#                                   /uv, the binary of PyPI's `uv==0.9.5` wheel (same release)
#   PYTHON_SOURCE=uv (GitHub)    -> PYTHON_SOURCE=base: the base's Debian python3 (3.11), which is
#                                   also what the local torch wheel (cp311) needs
#   TORCH_INDEX (download.pytorch.org/whl/cpu) -> a PEP 503 index served on 127.0.0.1 holding the
#                                   local wheel(s) from $WHEELS (default /opt/wheels)
#   PYPI_INDEX                   -> unchanged (pypi.org is reachable from here)
# The run: the image's root filesystem mounted read-only (unshare + chroot: podman/crun cannot set
# rlimits in this sandbox), what a container runtime adds (tmpfs on /tmp and /dev/shm, /dev/null and
# friends, /proc, an /etc/hosts naming localhost and the container's host name in its own UTS
# namespace), the image's ENV, WORKDIR /app, uid:gid 10001:10001. Exit 0 only when the demo PASSes.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${IMAGE_CHECK_DIR:-/var/tmp/elastic-emb-image}
WHEELS=${WHEELS:-/opt/wheels}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
UV_VERSION=0.9.5
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
BASE_IMG=localhost/elastic-emb-check/debian:bookworm
UV_IMG=localhost/elastic-emb-check/uv:${UV_VERSION}
IMAGE=localhost/elastic-emb:0.1.0-cpu-check
say() { printf '[image-check] %s\n' "$*" >&2; }

for tool in buildah debootstrap unshare chroot python3; do
    command -v "$tool" >/dev/null || { say "missing $tool: apt-get install buildah debootstrap"; exit 2; }
done
[ "$(id -u)" = 0 ] || { say "run as root (buildah, debootstrap and the chroot need it)"; exit 2; }
ls "$WHEELS"/torch-"${TORCH_VERSION}"+cpu-*.whl >/dev/null 2>&1 \
    || { say "no torch-${TORCH_VERSION}+cpu wheel in $WHEELS (set WHEELS=DIR)"; exit 2; }
mkdir -p "$WORK"

# 1. the base: debootstrap (cached), the machine's extra CAs, committed as an image
if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
    say "debootstrap bookworm into $WORK/rootfs (a few minutes)"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,ca-certificates bookworm "$WORK/rootfs" "$MIRROR" >&2
fi
if ! buildah inspect --type image "$BASE_IMG" >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$WORK/rootfs" update-ca-certificates >/dev/null
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    cp -a "$WORK/rootfs/." "$mnt/"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit -q "$ctr" "$BASE_IMG" >/dev/null
    buildah rm "$ctr" >/dev/null
fi

# 2. uv: the binary from PyPI's wheel of the same release, in an image of its own
if ! buildah inspect --type image "$UV_IMG" >/dev/null 2>&1; then
    rm -rf "$WORK/uv" && mkdir -p "$WORK/uv"
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
        --python-version 3.11 -d "$WORK/uv" "uv==${UV_VERSION}"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [x for x in z.namelist() if x.endswith('/scripts/uv')][0]; open(sys.argv[2], 'wb').write(z.read(n))" \
        "$(ls "$WORK"/uv/uv-*.whl)" "$WORK/uv/uv"
    chmod 755 "$WORK/uv/uv"
    ctr=$(buildah from scratch)
    buildah copy -q "$ctr" "$WORK/uv/uv" /uv >/dev/null
    buildah commit -q "$ctr" "$UV_IMG" >/dev/null
    buildah rm "$ctr" >/dev/null
fi

# 3. the torch index: PEP 503 pages for the local wheels, on 127.0.0.1
INDEX="$WORK/index"
rm -rf "$INDEX" && mkdir -p "$INDEX/simple/torch" "$INDEX/files"
for whl in "$WHEELS"/torch-*.whl; do
    name=$(basename "$whl")
    ln -s "$whl" "$INDEX/files/$name"
    href=$(python3 -c "import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))" "$name")
    echo "<a href=\"../../files/$href\">$name</a><br>" >> "$INDEX/simple/torch/index.html"
done
PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$INDEX" >"$WORK/index.log" 2>&1 &
SERVER=$!
CTR=""
cleanup() {
    kill "$SERVER" 2>/dev/null || true
    if [ -n "$CTR" ]; then buildah umount "$CTR" >/dev/null 2>&1 || true; buildah rm "$CTR" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# 4. the build, through the Dockerfile's own build arguments
say "buildah bud (CPU variant, torch ${TORCH_VERSION} from $WHEELS)"
start=$(date +%s)
buildah bud --isolation chroot --layers -f Dockerfile -t "$IMAGE" \
    --build-arg VARIANT=cpu --build-arg CPU_BASE="$BASE_IMG" --build-arg UV_IMAGE="$UV_IMG" \
    --build-arg PYTHON_SOURCE=base --build-arg TORCH_INDEX="http://127.0.0.1:${PORT}/simple" . >&2
say "built $IMAGE in $(( $(date +%s) - start )) s"

# 5. the demo inside: read-only root, uid 10001, the image's environment and working directory
CTR=$(buildah from "$IMAGE")
ROOT=$(buildah mount "$CTR")
ENVS=$(buildah inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$IMAGE")
USER_SPEC=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")
WORKDIR=$(buildah inspect --type image --format '{{.OCIv1.Config.WorkingDir}}' "$IMAGE")
say "running 'elastic-emb demo' in the image as ${USER_SPEC} in ${WORKDIR}, root read-only"
export ROOT ENVS USER_SPEC WORKDIR
printf '127.0.0.1\tlocalhost elastic-emb-check\n::1\tlocalhost\n' > "$WORK/hosts"
touch "$ROOT/etc/hosts"  # in the container's own layer, as a runtime does, never in the image
export HOSTS="$WORK/hosts"
unshare --mount --pid --uts --fork --kill-child bash -euc '
    mount --make-rprivate /
    hostname elastic-emb-check
    RO=$(mktemp -d)
    mount --bind "$ROOT" "$RO"
    mount -o remount,bind,ro "$RO"
    mount -t proc proc "$RO/proc"
    mount -t tmpfs -o size=64m,mode=755 tmpfs "$RO/dev"
    for d in null zero random urandom; do touch "$RO/dev/$d"; mount --bind "/dev/$d" "$RO/dev/$d"; done
    mkdir -p "$RO/dev/shm" && mount -t tmpfs -o size=4g,mode=1777 tmpfs "$RO/dev/shm"
    mount -t tmpfs -o size=4g,mode=1777 tmpfs "$RO/tmp"
    mount --bind "$HOSTS" "$RO/etc/hosts"
    if touch "$RO/probe" 2>/dev/null; then echo "root is writable: the check would prove nothing" >&2; exit 2; fi
    mapfile -t vars <<< "$ENVS"
    exec chroot --userspec="$USER_SPEC" "$RO" /usr/bin/env -i "${vars[@]}" HOME=/tmp \
        /bin/sh -c "cd \"$WORKDIR\" && id && touch /app/x 2>/dev/null && echo WRITABLE || echo \"/app read-only\"; exec elastic-emb demo --progress lines"
'
