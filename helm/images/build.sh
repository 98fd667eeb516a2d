#!/usr/bin/env bash
# ./dev images: build the hub, agent, kernel and notebook images of helm/images/Dockerfile with a real
# engine, then run them (tests/helm/test_images_run.py, and the end-to-end test of our chart and a
# z2jh-shaped hub in the Kubernetes emulator, tests/helm/test_z2jh_e2e.py).
#
#   ./dev images [--registry REGISTRY] [--no-check] [--jupyterhub6 VERSION]
#
# The hub image is built twice: on z2jh's JupyterHub (5.4.x) and, with the Dockerfile's
# JUPYTERHUB_VERSION build argument, on JupyterHub 6 (--jupyterhub6, default 6.1.1; '' skips
# it); the end-to-end test runs with each.
#
# The builds run side by side (the stand-ins, then the images after the wheel stage they share;
# mostly downloads and unpacking): each says its seconds as it ends.
#
# Engine: the one DOCKER_HOST names, else a dockerd of Debian's docker.io (apt-get install
# docker.io) started here under its own data root and stopped at the end. It runs without
# networking of its own (no bridge, no iptables): builds and checks use the host's network.
#
# Bases: each upstream base image (z2jh's hub image, manylinux2014, python, CUDA) is used when
# the engine has it or can pull it. Where no registry is reachable, a local stand-in is built
# from a debootstrapped Debian (helm/images/standins/Dockerfile) and the script says so.
#
# Cache (ELASTIC_GPU_IMAGE_CACHE, default ~/.cache/elastic-gpu/images): the engine's data root
# (its layer cache) and the debootstrapped Debian tarball, named by a hash of what made it
# (suite, mirror, packages). Delete the directory for a build from scratch.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
REGISTRY=${REGISTRY:-elastic-gpu.local}
CHECK=1
JUPYTERHUB6=6.1.1
while [ $# -gt 0 ]; do
  case "$1" in
    --registry) REGISTRY=${2:?--registry needs a value}; shift 2 ;;
    --registry=*) REGISTRY=${1#--registry=}; shift ;;
    --no-check) CHECK=0; shift ;;
    --jupyterhub6) JUPYTERHUB6=${2?--jupyterhub6 needs a value}; shift 2 ;;
    --jupyterhub6=*) JUPYTERHUB6=${1#--jupyterhub6=}; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "./dev images: unknown option '$1' (options: --registry REGISTRY, --no-check, --jupyterhub6 VERSION)" >&2; exit 2 ;;
  esac
done

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
Z2JH_VERSION=$(sed -n 's/^ARG Z2JH_VERSION=//p' helm/images/Dockerfile)
DOCKERFILE_ARG() { sed -n "s/^ARG $1=//p" helm/images/Dockerfile | sed "s/\${Z2JH_VERSION}/$Z2JH_VERSION/"; }
HUB_TAG=$REGISTRY/k8s-hub-elastic-gpu:$Z2JH_VERSION-$VERSION
AGENT_TAG=$REGISTRY/jupyterhub-elastic-gpu:$VERSION
KERNEL_TAG=$REGISTRY/elastic-gpu-kernel:$VERSION
NOTEBOOK_TAG=$REGISTRY/elastic-gpu-notebook:$VERSION
HUB6_TAG=$HUB_TAG-jupyterhub$JUPYTERHUB6
CACHE=${ELASTIC_GPU_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elastic-gpu/images}
mkdir -p "$CACHE"
say() { echo "==> $*" >&2; }
die() { echo "./dev images: $*" >&2; exit 1; }
t0=$SECONDS

# ---- the engine -------------------------------------------------------------------------------
RUN_DIR=""
stop_engine() {
  if [ -n "$RUN_DIR" ] && [ -f "$RUN_DIR/dockerd.pid" ]; then
    local pid
    pid=$(cat "$RUN_DIR/dockerd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  if [ -n "$RUN_DIR" ]; then
    # dockerd leaves its default network namespace bind-mounted under its exec root
    awk -v d="$RUN_DIR/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    rm -rf "$RUN_DIR"
  fi
  return 0
}
if [ -z "${DOCKER_HOST:-}" ]; then
  DOCKERD=$(command -v dockerd || true)
  [ -n "$DOCKERD" ] || die "no container engine: install Debian's docker.io (apt-get install docker.io), or set DOCKER_HOST to an engine's socket"
  # one engine per data root: a second run waits for the first
  exec 9>"$CACHE/.lock"
  flock -w 3600 9 || die "another ./dev images holds $CACHE/.lock"
  RUN_DIR=$(mktemp -d /tmp/elastic-gpu-engine.XXXXXX)  # short: the socket path has a length limit
  trap stop_engine EXIT
  trap 'exit 130' INT TERM
  "$DOCKERD" --data-root "$CACHE/engine" --exec-root "$RUN_DIR/exec" --pidfile "$RUN_DIR/dockerd.pid" \
    --host "unix://$RUN_DIR/docker.sock" --iptables=false --ip-masq=false --bridge=none \
    >"$CACHE/dockerd.log" 2>&1 &
  export DOCKER_HOST=unix://$RUN_DIR/docker.sock
fi
# a client that builds with BuildKit (it reads Dockerfile.dockerignore): buildx, or a client
# with BuildKit built in (Debian's docker.io 20.10)
DOCKER=${DOCKER:-}
if [ -z "$DOCKER" ]; then
  for c in docker /usr/bin/docker; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" buildx version >/dev/null 2>&1; then DOCKER=$c; BUILD=("$c" buildx build --load); break; fi
    major=$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
    if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then DOCKER=$c; BUILD=("$c" build); break; fi
  done
  [ -n "$DOCKER" ] || die "no docker client that builds with BuildKit (docker buildx, or Debian's docker.io)"
else
  BUILD=("$DOCKER" build)
fi
export DOCKER_BUILDKIT=1
for _ in $(seq 1 150); do "$DOCKER" version >/dev/null 2>&1 && break; sleep 0.2; done
"$DOCKER" version >/dev/null 2>&1 || die "the engine did not start (log: $CACHE/dockerd.log)"
say "engine: $("$DOCKER" version --format 'docker {{.Server.Version}}, storage {{.Server.Os}}') at $DOCKER_HOST"

# ---- the bases --------------------------------------------------------------------------------
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_PACKAGES=python3,python3-venv,ca-certificates
STANDIN_DIR=helm/images/standins
standin_debian() {
  # the debootstrapped Debian every stand-in starts from, cached as a tarball named by its inputs
  local key tarball image
  key=$(printf '%s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$DEBIAN_PACKAGES" minbase | sha256sum | cut -c1-12)
  image=elastic-gpu-standin/debian:$DEBIAN_SUITE-$key
  if ! "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
    tarball=$CACHE/debian-$DEBIAN_SUITE-$key.tar
    if [ ! -f "$tarball" ]; then
      command -v debootstrap >/dev/null 2>&1 || die "no registry is reachable and debootstrap is missing (apt-get install debootstrap): the stand-in bases are made with it"
      say "debootstrap $DEBIAN_SUITE ($DEBIAN_PACKAGES) from $DEBIAN_MIRROR"
      local tree=$CACHE/rootfs.$$
      rm -rf "$tree"
      debootstrap --variant=minbase --include="$DEBIAN_PACKAGES" "$DEBIAN_SUITE" "$tree" "$DEBIAN_MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1 || die "debootstrap failed (log: $CACHE/debootstrap.log)"
      rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/*
      tar -C "$tree" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
      rm -rf "$tree"
    fi
    "$DOCKER" import "$tarball" "$image" >/dev/null
  fi
  echo "$image"
}
JOBS_DIR=$(mktemp -d)
JOBS_CLEANUP=("$JOBS_DIR")  # removed at exit, whatever the outcome
cleanup() { rm -rf "${JOBS_CLEANUP[@]}"; stop_engine; }
trap cleanup EXIT
# side by side: builds of independent images are mostly downloads and unpacking (pip, apt). The
# engine's BuildKit runs a step that builds running together share once (the stand-ins' python
# stage; in a cold run beside the images, the wheel stage was built in one of their logs only).
JOB_PIDS=()
JOB_NAMES=()
job() {  # job NAME COMMAND...: run it in the background; wait_jobs waits for all of them
  JOB_NAMES+=("$1")
  shift
  "$@" &
  JOB_PIDS+=($!)
}
wait_jobs() {  # wait_jobs WHAT: wait for the jobs started; fail naming those that failed
  local i failed=()
  for i in "${!JOB_PIDS[@]}"; do wait "${JOB_PIDS[$i]}" || failed+=("${JOB_NAMES[$i]}"); done
  JOB_PIDS=()
  JOB_NAMES=()
  [ ${#failed[@]} -eq 0 ] || die "$1 failed: ${failed[*]} (logs above)"
}
STANDIN_CONTEXT=$JOBS_DIR/standin-context
standin() {
  # standin TARGET: build helm/images/standins/Dockerfile's TARGET (on the imported Debian
  # $STANDIN_DEBIAN), write its tag to $JOBS_DIR/base-TARGET
  local target=$1 t=$SECONDS log=$CACHE/standin-$1.log
  "${BUILD[@]}" --network host --build-arg DEBIAN_IMAGE="$STANDIN_DEBIAN" --target "$target" \
    --progress plain -t "elastic-gpu-standin/$target:local" "$STANDIN_CONTEXT" >"$log" 2>&1 \
    || { tail -40 "$log" >&2; echo "./dev images: building the stand-in '$target' failed (log: $log)" >&2; return 1; }
  say "built the stand-in elastic-gpu-standin/$target in $((SECONDS - t)) s"
  echo "elastic-gpu-standin/$target:local" >"$JOBS_DIR/base-$target"
}
STANDINS=()
base() {
  # base UPSTREAM STANDIN_TARGET: the upstream image if the engine has or can pull it (its tag in
  # $JOBS_DIR/base-TARGET), else the stand-in TARGET is to be built (added to STANDINS)
  local upstream=$1 target=$2 why
  if "$DOCKER" image inspect "$upstream" >/dev/null 2>&1 || why=$(timeout 300 "$DOCKER" pull -q "$upstream" 2>&1); then
    echo "$upstream" >"$JOBS_DIR/base-$target"
    return
  fi
  echo "==> $upstream cannot be pulled ($(echo "$why" | tail -1)): building the local stand-in elastic-gpu-standin/$target (helm/images/standins/Dockerfile)" >&2
  STANDINS+=("$target")
}
base "$(DOCKERFILE_ARG HUB_IMAGE)" k8s-hub
base "$(DOCKERFILE_ARG WHEEL_IMAGE)" manylinux2014
base "$(DOCKERFILE_ARG PYTHON_IMAGE)" python
base "$(DOCKERFILE_ARG CUDA_IMAGE)" cuda
if [ ${#STANDINS[@]} -gt 0 ]; then
  t=$SECONDS
  STANDIN_DEBIAN=$(standin_debian)
  say "Debian for the stand-ins: $STANDIN_DEBIAN ($((SECONDS - t)) s)"
  mkdir "$STANDIN_CONTEXT"
  cp "$STANDIN_DIR"/Dockerfile "$STANDIN_DIR"/z2jh-hub-pins.txt "$STANDIN_CONTEXT"/
  cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$STANDIN_CONTEXT"/ca-certificates.crt
  say "building the stand-ins side by side: ${STANDINS[*]}"
  for target in "${STANDINS[@]}"; do job "the stand-in $target" standin "$target"; done
  wait_jobs "building the stand-ins"
fi
HUB_BASE=$(cat "$JOBS_DIR/base-k8s-hub")
WHEEL_BASE=$(cat "$JOBS_DIR/base-manylinux2014")
PYTHON_BASE=$(cat "$JOBS_DIR/base-python")
CUDA_BASE=$(cat "$JOBS_DIR/base-cuda")
WHEEL_ARGS=()
if [ "$WHEEL_BASE" != "$(DOCKERFILE_ARG WHEEL_IMAGE)" ]; then
  WHEEL_ARGS=(--build-arg WHEEL_PYTHON=python)
fi
say "bases ready ($((SECONDS - t0)) s)"

# ---- the images -------------------------------------------------------------------------------
IMAGES="hub=$HUB_TAG agent=$AGENT_TAG kernel=$KERNEL_TAG notebook=$NOTEBOOK_TAG"
[ -z "$JUPYTERHUB6" ] || IMAGES="$IMAGES hub-jupyterhub6=$HUB6_TAG"
build_image() {  # build_image NAME TAG TARGET JUPYTERHUB_VERSION
  local name=$1 tag=$2 target=$3 jupyterhub=$4 t=$SECONDS
  "${BUILD[@]}" --network host -f helm/images/Dockerfile --target "$target" \
    --build-arg JUPYTERHUB_VERSION="$jupyterhub" \
    --build-arg Z2JH_VERSION="$Z2JH_VERSION" --build-arg HUB_IMAGE="$HUB_BASE" \
    --build-arg WHEEL_IMAGE="$WHEEL_BASE" --build-arg PYTHON_IMAGE="$PYTHON_BASE" \
    --build-arg CUDA_IMAGE="$CUDA_BASE" "${WHEEL_ARGS[@]}" \
    --progress plain -t "$tag" . >"$CACHE/build-$name.log" 2>&1 \
    || { tail -40 "$CACHE/build-$name.log" >&2; echo "./dev images: building the $name image failed (log: $CACHE/build-$name.log)" >&2; return 1; }
  say "built $tag in $((SECONDS - t)) s"
}
# The wheel stage first, alone: the shim's glibc 2.17 build computes more than it downloads, and
# every image but the kernel's waits for it (built beside four pip installs on two loaded cores
# it took 244 s; first, in the hub image's build, 39 s for that whole image). Then the images
# side by side, each taking the wheel from the engine's cache.
t=$SECONDS
say "building the wheel stage (libvgpu.so for glibc 2.17, auditwheel repair)"
build_image wheel elastic-gpu-build/wheel:local wheel "" || die "building the wheel stage failed"
for image in $IMAGES; do
  name=${image%%=*} tag=${image#*=} target=${image%%[=-]*} jupyterhub=""
  [ "$name" != hub-jupyterhub6 ] || jupyterhub=$JUPYTERHUB6
  say "building $tag (--target $target${jupyterhub:+, JupyterHub $jupyterhub})"
  job "the $name image" build_image "$name" "$tag" "$target" "$jupyterhub"
done
wait_jobs "building the images"
say "the wheel and the images built in $((SECONDS - t)) s"
say "images (built in $((SECONDS - t0)) s):"
"$DOCKER" image ls --format '    {{.Repository}}:{{.Tag}}  {{.Size}}' \
  | grep -F -e "$HUB_TAG" -e "$AGENT_TAG" -e "$KERNEL_TAG" -e "$NOTEBOOK_TAG" -e "$HUB6_TAG" -e "standin/" || true

# ---- the checks: run each image --------------------------------------------------------------
if [ "$CHECK" = 1 ]; then
  PY=$ROOT/.venv/bin/python
  [ -x "$PY" ] || die "the checks need the test venv: run ./dev install first (or pass --no-check)"
  say "running the images (tests/helm/test_images_run.py, test_z2jh_e2e.py)"
  t=$SECONDS
  CHECK_TMP=$(mktemp -d /var/tmp/elastic-gpu-images-check.XXXXXX)
  # Each image's filesystem is unpacked once for all the tests that run pods of it (the
  # `unpacked` fixture, tests/helm/conftest.py): in memory where /dev/shm has room for them
  # (~2 GB), as deleting them from a disk mounted with `discard` took minutes.
  UNPACK_DIR=""
  if [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 6 ] 2>/dev/null; then
    UNPACK_DIR=$(mktemp -d /dev/shm/elastic-gpu-images.XXXXXX)
    JOBS_CLEANUP+=("$UNPACK_DIR")
    say "unpacking the images for the emulator's pods in $UNPACK_DIR (in memory)"
  fi
  ELASTIC_GPU_IMAGES="$IMAGES" ELASTIC_GPU_DOCKER="$DOCKER" ELASTIC_GPU_UNPACK_DIR="$UNPACK_DIR" \
    "$PY" -m pytest -q -s -p no:cacheprovider tests/helm/test_images_run.py tests/helm/test_z2jh_e2e.py \
      --basetemp="$CHECK_TMP" -rs --durations=20 \
    || die "the image checks failed (their files: $CHECK_TMP)"
  say "image checks passed in $((SECONDS - t)) s"
  t=$SECONDS
  rm -rf "$CHECK_TMP" ${UNPACK_DIR:+"$UNPACK_DIR"}
  say "removed their files in $((SECONDS - t)) s"
fi
say "done in $((SECONDS - t0)) s"
