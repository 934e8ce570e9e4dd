#!/usr/bin/env bash
# Build the coordinator image from ./Dockerfile and check that its default command serves, on a
# machine without a Docker engine and without access to a container registry.
#
#   sudo scripts/check_container.sh [--install-prereqs] [--keep] [--rebuild-base]
#
# What it does (docs/CONTAINER.md has the details and the last recorded run):
#   1. a Debian bookworm root file system with python3 (debootstrap) is imported as the base image
#      and cached under .container/ (gitignored); bookworm's python3 is 3.11, like the pinned python:3.11-slim-bookworm;
#   2. `podman build --isolation chroot --storage-driver vfs --build-arg BASE=<that base>` builds
#      the Dockerfile unchanged (its own BASE stays python:3.11-slim-bookworm pinned by digest,
#      which is checked), both stages, every package from the locks in container/ with hashes;
#   3. the image's configuration is checked: non-root user, port 29500 exposed, a health check,
#      no torch, and no pip, setuptools or wheel anywhere in the final image;
#   4. `podman run` cannot work here (it fails on setrlimit), so a container is created and
#      mounted, and the image's own ENTRYPOINT + CMD run under chroot, as the image's user, with
#      the image's environment plus AIOCOLL_TOKEN, in a private network namespace (so ports 29500
#      and 29501 are the image's defaults and nothing on the host is disturbed);
#   5. scripts/_container_probe.py runs inside the image against it: handshake + set/get/add with
#      the token, a wrong token refused, a job of two ranks (the image's own aiocoll, two
#      processes) rendezvousing through it and all-reducing, /healthz, /metrics, /jobs,
#      `aiocoll status`; then the image's HEALTHCHECK command runs; then SIGTERM must stop the
#      coordinator cleanly;
#   6. the same token delivered as a mounted file (AIOCOLL_TOKEN_FILE) is checked the same way,
#      and a start without any token must be refused.
#
# Prerequisites (root, Debian/Ubuntu):  apt-get update && apt-get install -y podman debootstrap
# (--install-prereqs runs exactly that). Needs network access to a Debian mirror (taken from this
# machine's apt sources, or AIOCOLL_DEBIAN_MIRROR) and to PyPI (pip inside the build).
# Exit status: 0 when every check passed, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/.container"
SUITE=bookworm
BASE_TAR="$WORK/debian-$SUITE-python3.tar"
BASE_IMAGE="localhost/aiocoll-check-base:$SUITE"
IMAGE="localhost/aiocoll-coordinator:check"
CONTAINER="aiocoll-check-$$"
TOKEN="check-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
PODMAN=(podman --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs)

# -- the part that runs inside the private namespaces (re-invoked through unshare) ---------------
if [ "${1:-}" = "--inside" ]; then
    shift
    rootfs="$1"; mode="$2"; user="$3"; workdir="$4"; envfile="$5"; cmdfile="$6"; healthfile="$7"
    # Private mounts and network: everything below vanishes when this process exits.
    mount --make-rprivate /
    ip link set lo up 2>/dev/null || { command -v ifconfig >/dev/null && ifconfig lo up; }
    mount --rbind /dev "$rootfs/dev"
    mount -t proc proc "$rootfs/proc"
    mount -t tmpfs tmpfs "$rootfs/tmp"
    mkdir -p "$rootfs/run/secrets"
    mapfile -t image_env < "$envfile"
    mapfile -t command < "$cmdfile"
    extra_env=()
    case "$mode" in
        env) extra_env=("AIOCOLL_TOKEN=$TOKEN_FOR_INSIDE") ;;
        file)
            mount -t tmpfs -o mode=0755 tmpfs "$rootfs/run/secrets"
            printf '%s\n' "$TOKEN_FOR_INSIDE" > "$rootfs/run/secrets/aiocoll_token"
            chmod 0444 "$rootfs/run/secrets/aiocoll_token"
            extra_env=("AIOCOLL_TOKEN_FILE=/run/secrets/aiocoll_token") ;;
        none) ;;
    esac
    in_image() {  # run a command in the image as its user, with its environment
        chroot --userspec="$user" "$rootfs" /usr/bin/env -i -C "$workdir" "${image_env[@]}" "${extra_env[@]}" "$@"
    }
    log="$rootfs/tmp/coordinator.log"
    # A simple command (not the function) in the background, so $! is the process that execs
    # into the coordinator itself (chroot -> env -> entrypoint -> python) and gets our SIGTERM.
    chroot --userspec="$user" "$rootfs" /usr/bin/env -i -C "$workdir" "${image_env[@]}" "${extra_env[@]}" \
        "${command[@]}" > "$log" 2>&1 &
    pid=$!
    if [ "$mode" = none ]; then
        status=0
        wait "$pid" || status=$?
        sed 's/^/    | /' "$log"
        if [ "$status" -ne 0 ] && grep -q "no token given" "$log"; then
            echo "PASS  without any token the default command refuses to start (exit $status)"
            exit 0
        fi
        echo "FAIL  without any token the default command should refuse to start (exit $status)"
        exit 1
    fi
    # Wait (bounded) for the coordinator to accept connections on 29500.
    ready=0
    for _ in $(seq 1 100); do
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
        if in_image /opt/aiocoll/bin/python -c "import socket; socket.create_connection(('127.0.0.1', 29500), 1).close()" 2>/dev/null; then
            ready=1; break
        fi
        sleep 0.2
    done
    failed=0
    if [ "$ready" = 1 ]; then
        echo "PASS  the default command listens on 29500 (token from $mode)"
        cp "$ROOT/scripts/_container_probe.py" "$rootfs/tmp/_container_probe.py"
        chmod 0644 "$rootfs/tmp/_container_probe.py"
        in_image /opt/aiocoll/bin/python /tmp/_container_probe.py --token "$TOKEN_FOR_INSIDE" || failed=1
        if [ -s "$healthfile" ]; then
            mapfile -t health < "$healthfile"
            if in_image "${health[@]}"; then
                echo "PASS  the image's HEALTHCHECK command succeeds"
            else
                echo "FAIL  the image's HEALTHCHECK command fails"; failed=1
            fi
        fi
    else
        echo "FAIL  the default command did not listen on 29500 within 20 s (token from $mode)"
        failed=1
    fi
    kill -TERM "$pid" 2>/dev/null || true
    status=0
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "FAIL  the coordinator did not stop within 10 s of SIGTERM"; failed=1
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" || status=$?
    if [ "$ready" = 1 ] && [ "$status" -ne 0 ]; then
        echo "FAIL  the coordinator exited with status $status after SIGTERM (expected 0)"; failed=1
    elif [ "$ready" = 1 ]; then
        echo "PASS  SIGTERM stops the coordinator with exit status 0"
    fi
    echo "    coordinator log:"
    sed 's/^/    | /' "$log" | tail -n 20
    exit "$failed"
fi

# -- the driver ------------------------------------------------------------------------------
KEEP=0; REBUILD_BASE=0; INSTALL=0
for arg in "$@"; do
    case "$arg" in
        --keep) KEEP=1 ;;
        --rebuild-base) REBUILD_BASE=1 ;;
        --install-prereqs) INSTALL=1 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

step() { printf '\n== %s\n' "$*"; }
die() { echo "check_container: $*" >&2; exit 1; }
FAILED=()
pass() { echo "PASS  $*"; }
fail() { echo "FAIL  $*"; FAILED+=("$*"); }

[ "$(id -u)" = 0 ] || die "run as root: debootstrap, chroot and unshare need it"
if [ "$INSTALL" = 1 ]; then
    step "installing prerequisites"
    apt-get update && apt-get install -y podman debootstrap
fi
for tool in podman debootstrap chroot unshare mount tar; do
    command -v "$tool" >/dev/null || die "$tool is missing: apt-get update && apt-get install -y podman debootstrap (or pass --install-prereqs)"
done

debian_mirror() {
    if [ -n "${AIOCOLL_DEBIAN_MIRROR:-}" ]; then echo "$AIOCOLL_DEBIAN_MIRROR"; return; fi
    local url
    url=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' | grep -v -- '-security' | grep '/debian/\?$' | head -n 1 || true)
    if [ -z "$url" ]; then
        url=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
              | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' | grep '/debian/\?$' | head -n 1 || true)
    fi
    echo "${url:-http://deb.debian.org/debian}"
}

mkdir -p "$WORK"
cleanup() {
    if [ "$KEEP" = 0 ]; then
        "${PODMAN[@]}" umount "$CONTAINER" >/dev/null 2>&1 || true
        "${PODMAN[@]}" rm -f "$CONTAINER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

step "base image: Debian $SUITE with python3 (stands in for the pinned python:3.11-slim-bookworm, which cannot be pulled here)"
if [ "$REBUILD_BASE" = 1 ]; then
    rm -f "$BASE_TAR"
    "${PODMAN[@]}" rmi -f "$BASE_IMAGE" >/dev/null 2>&1 || true
fi
if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
    if [ ! -s "$BASE_TAR" ]; then
        mirror=$(debian_mirror)
        echo "debootstrap $SUITE from $mirror (a few minutes; cached in $BASE_TAR)"
        rm -rf "$WORK/rootfs.tmp"
        debootstrap --variant=minbase --include=python3,python3-venv,passwd "$SUITE" "$WORK/rootfs.tmp" "$mirror" \
            > "$WORK/debootstrap.log" 2>&1 || { tail -n 20 "$WORK/debootstrap.log"; die "debootstrap failed (log: $WORK/debootstrap.log)"; }
        rm -rf "$WORK/rootfs.tmp/var/cache/apt/archives/"*.deb "$WORK/rootfs.tmp/var/lib/apt/lists/"*
        tar -C "$WORK/rootfs.tmp" --numeric-owner -cf "$BASE_TAR.part" .
        mv "$BASE_TAR.part" "$BASE_TAR"
        rm -rf "$WORK/rootfs.tmp"
    fi
    "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$BASE_TAR" "$BASE_IMAGE" >/dev/null
fi
echo "base: $BASE_IMAGE ($("${PODMAN[@]}" image inspect --format '{{.Size}}' "$BASE_IMAGE") bytes)"

step "build the Dockerfile with the stand-in as its BASE (--build-arg)"
base_line=$(grep -m1 -E '^ARG BASE=' "$ROOT/Dockerfile" || true)
if [[ "$base_line" =~ ^ARG\ BASE=python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}$ ]]; then
    pass "the Dockerfile's base is pinned by digest: ${base_line#ARG BASE=}"
else
    fail "the Dockerfile's base is not python:3.11-slim-bookworm pinned by digest: '$base_line'"
fi
if [ "$(grep -cE '^FROM \$\{BASE\}' "$ROOT/Dockerfile")" = 2 ] && [ "$(grep -cE '^FROM ' "$ROOT/Dockerfile")" = 2 ]; then
    pass "both stages start from BASE"
else
    fail "the Dockerfile's stages do not both start from BASE"
fi
for lock in requirements.txt build-requirements.txt; do
    pins=$(grep -cE '^[A-Za-z0-9_.-]+==' "$ROOT/container/$lock")
    unhashed=$(awk '/^[A-Za-z0-9_.-]+==/ {if (pin && !hashed) n++; pin=1; hashed=0} /--hash=sha256:/ {hashed=1} END {if (pin && !hashed) n++; print n+0}' "$ROOT/container/$lock")
    if [ "$pins" -gt 0 ] && [ "$unhashed" = 0 ]; then pass "container/$lock pins $pins packages, each with hashes"; else fail "container/$lock: $pins pins, $unhashed without a hash"; fi
done
# pip inside the build must trust what this machine trusts (here TLS to PyPI passes through a
# proxy with its own CA): this machine's CA bundle and a pip.conf naming it are mounted for the
# build's RUN steps only (-v), so nothing of it ends up in the image.
host_ca="${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}"
[ -s "$host_ca" ] || host_ca=/etc/ssl/certs/ca-certificates.crt
build_mounts=()
if [ -s "$host_ca" ]; then
    mkdir -p "$WORK/build-pip"
    cp "$host_ca" "$WORK/build-pip/ca.pem"
    printf '[global]\ncert = /run/aiocoll-build/ca.pem\n' > "$WORK/build-pip/pip.conf"
    build_mounts=(-v "$WORK/build-pip:/run/aiocoll-build:ro" -v "$WORK/build-pip/pip.conf:/etc/pip.conf:ro")
    echo "pip in the build trusts $host_ca (mounted for the build only)"
fi
build_started=$(date +%s)
if ! "${PODMAN[@]}" build --isolation chroot --format docker --build-arg "BASE=$BASE_IMAGE" "${build_mounts[@]}" \
        -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT" > "$WORK/build.log" 2>&1; then
    tail -n 30 "$WORK/build.log"
    die "podman build failed (log: $WORK/build.log)"
fi
pass "podman build --isolation chroot --build-arg BASE=$BASE_IMAGE ($(( $(date +%s) - build_started )) s, log: .container/build.log)"

step "image configuration"
inspect() { "${PODMAN[@]}" image inspect --format "$1" "$IMAGE"; }
user=$(inspect '{{.Config.User}}')
workdir=$(inspect '{{.Config.WorkingDir}}')
ports=$(inspect '{{range $p, $_ := .Config.ExposedPorts}}{{$p}} {{end}}')
inspect '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d' > "$WORK/image.env"
{ inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}'; inspect '{{range .Config.Cmd}}{{println .}}{{end}}'; } \
    | sed '/^$/d' > "$WORK/image.cmd"
# The health check is recorded in docker format only; ["CMD", args...] runs args directly.
inspect '{{with .Config.Healthcheck}}{{range .Test}}{{println .}}{{end}}{{end}}' | sed '/^$/d' > "$WORK/image.health.raw" || true
if [ "$(head -n 1 "$WORK/image.health.raw" 2>/dev/null)" = "CMD" ]; then
    tail -n +2 "$WORK/image.health.raw" > "$WORK/image.health"
elif [ "$(head -n 1 "$WORK/image.health.raw" 2>/dev/null)" = "CMD-SHELL" ]; then
    { echo /bin/sh; echo -c; tail -n +2 "$WORK/image.health.raw"; } > "$WORK/image.health"
else
    : > "$WORK/image.health"
fi
echo "user=$user workdir=$workdir ports=$ports"
echo "command: $(tr '\n' ' ' < "$WORK/image.cmd")"
case "$user" in ""|0|root|0:*|root:*) fail "the image runs as root (User '$user')" ;; *) pass "the image runs as non-root user $user" ;; esac
case " $ports " in *" 29500/tcp "*) pass "port 29500 is exposed" ;; *) fail "port 29500 is not exposed ($ports)" ;; esac
if [ -s "$WORK/image.health" ]; then pass "a HEALTHCHECK is configured: $(tr '\n' ' ' < "$WORK/image.health" | cut -c1-90)..."; else fail "no HEALTHCHECK in the image"; fi
grep -qx 'aiocoll' <(sed -n 2p "$WORK/image.cmd") && grep -qx 'coordinator' <(sed -n 3p "$WORK/image.cmd") \
    && pass "the default command is aiocoll coordinator" || fail "the default command is not aiocoll coordinator"

step "a container from the image, mounted (podman run is refused here: setrlimit)"
"${PODMAN[@]}" rm -f "$CONTAINER" >/dev/null 2>&1 || true
"${PODMAN[@]}" create --name "$CONTAINER" "$IMAGE" >/dev/null
rootfs=$("${PODMAN[@]}" mount "$CONTAINER")
echo "rootfs: $rootfs"
site=$(ls -d "$rootfs"/opt/aiocoll/lib/python3*/site-packages)
if ls "$site" | grep -qi '^torch'; then fail "torch is installed in the image"; else pass "torch is not installed"; fi
tools=$(find "$rootfs/opt" "$rootfs/usr" -maxdepth 6 -type d \( -name 'pip' -o -name 'setuptools' -o -name 'wheel' \) -path '*-packages/*' 2>/dev/null | sed "s|^$rootfs||" | tr '\n' ' ')
if [ -z "$tools" ]; then pass "no pip, setuptools or wheel in the final image"; else fail "packaging tools left in the image: $tools"; fi
if [ -e "$rootfs/opt/build" ] || [ -n "$(ls "$rootfs/tmp" 2>/dev/null)" ]; then fail "the build stage's files reached the final image"; else pass "nothing of the build stage but /opt/aiocoll reached the final image"; fi
echo "installed: $(ls "$site" | grep -i 'dist-info$' | sed 's/-[0-9].*//' | sort | tr '\n' ' ')"
echo "image size: $(inspect '{{.Size}}') bytes (Debian $SUITE base: $("${PODMAN[@]}" image inspect --format '{{.Size}}' "$BASE_IMAGE") bytes)"

run_inside() {  # $1: how the token is delivered (env, file, none)
    local status=0
    TOKEN_FOR_INSIDE="$TOKEN" unshare --mount --net --pid --fork --kill-child \
        "$0" --inside "$rootfs" "$1" "$user" "${workdir:-/}" "$WORK/image.env" "$WORK/image.cmd" "$WORK/image.health" \
        || status=$?
    return "$status"
}

step "the default command under chroot, token from AIOCOLL_TOKEN"
run_inside env || FAILED+=("run with the token in AIOCOLL_TOKEN")
step "the default command under chroot, token from a mounted file (AIOCOLL_TOKEN_FILE)"
run_inside file || FAILED+=("run with the token in a mounted file")
step "the default command under chroot, no token at all"
run_inside none || FAILED+=("refusal without a token")

step "summary"
if [ "${#FAILED[@]}" -eq 0 ]; then
    echo "check_container: every check passed"
    exit 0
fi
printf 'check_container: FAILED: %s\n' "${FAILED[@]}"
exit 1
