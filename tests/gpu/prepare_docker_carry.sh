#!/usr/bin/env bash
# Run HERE (the CI-kind machine), after tests/gpu/prepare_carry.sh, before a Docker/Podman GPU run
# (tests/gpu/test_gpu_docker.py). The GPU machine has neither engine, no package manager and no network, and the device
# tool carries at most 64 MiB a call, the tracked tree included: .carry and .whl already take about 50 MB. So each engine
# travels as one xz archive in a git-ignored folder of its own, which tests/gpu/install_engines.sh unpacks there
# (install_tools.sh runs it):
#   .carry-docker/docker.tar.xz  Docker 26.1.5 (dockerd, docker, docker-proxy: what tests/setup.sh puts in
#                                /usr/local/lib/gpuckpt-docker26/bin), with what dockerd runs beyond the GPU machine's
#                                image: bookworm's containerd 1.6 and containerd-shim-runc-v2 (the pair CI runs Docker 26
#                                with) and docker-init (tini); runc and CRIU come with .carry
#   .carry-podman/podman.tar.xz  Podman 4.3.1 and conmon, with their configuration (policy.json, registries.conf, a
#                                containers.conf for a machine without systemd's services, crun, CNI or netavark) and
#                                seccomp.json
# Each archive also holds the shared libraries its programs link beyond glibc (bookworm's); install_engines.sh puts only
# those the GPU machine lacks where its loader looks.
#   .carry-lite/carry, .carry-lite/whl   .carry and .whl without what these tests do not use (containerd 2.1, grpcio and
#                                protobuf for the containerd tests; cryptography, which ansible imports only for vault
#                                and ssh-agent keys): with one engine's archive they fit in one call, so that a call needs
#                                nothing an earlier call left on the machine (a warm machine is kept only 30 s)
#
#   bash tests/gpu/prepare_docker_carry.sh [docker] [podman] [lite]    (default: all three)
#
# On the device, each call on its own (the sizes are printed below):
#   carry [".carry-docker", ".carry-lite"]:
#     rm -rf .carry .whl; ln -s .carry-lite/carry .carry; ln -s .carry-lite/whl .whl;
#     GPUCKPT_TESTS_TIMEOUT=540 bash tests/gpu/run_on_device.sh "test_gpu_docker and not podman"; rc=$?; rm -f .carry .whl; exit $rc
#   carry [".carry-podman", ".carry-lite"]: the same with "test_gpu_docker and podman"
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
what=" ${*:-docker podman lite} "
limit=$((64 * 1024 * 1024))
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)

# the libraries ``$@`` link against beyond glibc, copied into $dest (their real files, under their sonames)
copy_libs() {
  local dest=$1; shift
  mkdir -p "$dest"
  for b in "$@"; do
    ldd "$b" | awk '$3 ~ /^\// && $3 !~ /\/(libc|libm|libpthread|libdl|librt|libresolv)\.so/ {print $3}' \
      | while read -r lib; do cp -Ln "$lib" "$dest/" 2>/dev/null || true; done
  done
}

mib() { du -cb "$@" | tail -n1 | awk '{printf "%.1f MiB", $1 / 1048576}'; }

# what one call carries: the tracked tree and these folders, against the device tool's 64 MiB
call_size() {
  local bytes; bytes=$(( $(du -cb "$@" | tail -n1 | cut -f1) + tree_bytes ))
  awk -v w="$*" -v b="$bytes" 'BEGIN { printf "a call carrying %s: %.1f of 64 MiB (the tracked tree included)\n", w, b / 1048576 }'
  if [ "$bytes" -ge $((limit - 2 * 1024 * 1024)) ]; then
    echo "that leaves less than 2 MiB of the 64 MiB a call carries" >&2
    return 1
  fi
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

if [[ "$what" == *" docker "* ]]; then
  d26=/usr/local/lib/gpuckpt-docker26/bin
  for b in dockerd docker docker-proxy; do
    [ -x "$d26/$b" ] || { echo "$d26/$b is missing: run bash tests/setup.sh first (it installs Docker 26 there)" >&2; exit 1; }
  done
  for b in containerd containerd-shim-runc-v2 docker-init; do
    command -v "$b" >/dev/null || { echo "$b is missing here (bookworm's containerd and tini-static have it)" >&2; exit 1; }
  done
  top="$stage/gpuckpt-docker"
  mkdir -p "$top/bin"
  cp "$d26/dockerd" "$d26/docker" "$d26/docker-proxy" "$(command -v containerd)" "$(command -v containerd-shim-runc-v2)" "$top/bin/"
  cp -L "$(command -v docker-init)" "$top/bin/docker-init"  # (a link to tini-static here)
  copy_libs "$top/lib" "$top/bin/dockerd" "$top/bin/docker" "$top/bin/containerd" "$top/bin/containerd-shim-runc-v2"
  { "$top/bin/dockerd" --version; "$top/bin/docker" --version; "$top/bin/containerd" --version; "$top/bin/docker-init" --version; } \
    > "$top/VERSIONS" 2>&1
  rm -rf .carry-docker && mkdir -p .carry-docker
  tar -C "$stage" -cf - gpuckpt-docker | xz -T0 -9 > .carry-docker/docker.tar.xz
  echo ".carry-docker/docker.tar.xz: $(stat -c %s .carry-docker/docker.tar.xz) bytes ($(mib .carry-docker))"
fi

if [[ "$what" == *" podman "* ]]; then
  for b in podman conmon; do
    command -v "$b" >/dev/null || { echo "$b is missing here (tests/setup.sh installs bookworm's Podman 4.3.1)" >&2; exit 1; }
  done
  top="$stage/gpuckpt-podman"
  mkdir -p "$top/bin" "$top/etc/containers" "$top/share/containers"
  cp "$(command -v podman)" "$(command -v conmon)" "$top/bin/"
  copy_libs "$top/lib" "$top/bin/podman" "$top/bin/conmon"
  cp /etc/containers/policy.json /etc/containers/registries.conf "$top/etc/containers/"
  cp /usr/share/containers/seccomp.json "$top/share/containers/"
  # Podman's defaults expect systemd's services (its cgroup manager, journald for events), crun, and a network backend
  # (netavark, or CNI's plugins): the GPU machine has none of them. The tests give their containers the host's network
  # (--network host), which needs no backend's plugin; CNI is the backend that starts without one.
  cat > "$top/etc/containers/containers.conf" <<'CONF'
# Podman carried onto the GPU machine by gpuckpt.fleet's tests (tests/gpu/prepare_docker_carry.sh)
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
conmon_path = ["/usr/local/lib/gpuckpt-podman/bin/conmon", "/usr/libexec/podman/conmon", "/usr/bin/conmon"]

[network]
network_backend = "cni"
CONF
  { "$top/bin/podman" --version; "$top/bin/conmon" --version | head -n1; } > "$top/VERSIONS" 2>&1
  rm -rf .carry-podman && mkdir -p .carry-podman
  tar -C "$stage" -cf - gpuckpt-podman | xz -T0 -9 > .carry-podman/podman.tar.xz
  echo ".carry-podman/podman.tar.xz: $(stat -c %s .carry-podman/podman.tar.xz) bytes ($(mib .carry-podman))"
fi

if [[ "$what" == *" lite "* ]]; then
  [ -f .carry/tools.tar.xz ] && ls .whl/ansible_core-*.whl >/dev/null 2>&1 \
    || { echo ".carry/tools.tar.xz or .whl is missing: run bash tests/gpu/prepare_carry.sh first" >&2; exit 1; }
  mkdir -p "$stage/tools"
  tar -C "$stage/tools" -xJf .carry/tools.tar.xz
  rm -rf .carry-lite && mkdir -p .carry-lite/carry .carry-lite/whl
  # (iptables: the Podman test needs it, GPUCKPT_CARRIED_IPTABLES=1)
  tar -C "$stage/tools" -cf - criu ssh runc iptables | xz -T0 -9 > .carry-lite/carry/tools.tar.xz
  cp .carry/gpuckpt-cuda-checkpoint .carry-lite/carry/
  for w in .whl/*.whl; do
    # (grpc for the containerd backend's client; cryptography only for ansible's vault and ssh-agent keys, imported
    # where they are used)
    case "$(basename "$w")" in grpcio-*|protobuf-*|typing_extensions-*|cryptography-*|cffi-*|pycparser-*) ;;
      *) cp "$w" .carry-lite/whl/ ;; esac
  done
  echo ".carry-lite: $(mib .carry-lite)"
fi

[ -f .carry-docker/docker.tar.xz ] && [ -d .carry-lite ] && call_size .carry-docker .carry-lite
[ -f .carry-podman/podman.tar.xz ] && [ -d .carry-lite ] && call_size .carry-podman .carry-lite
[ -f .carry-docker/docker.tar.xz ] && [ -f .carry-podman/podman.tar.xz ] && { call_size .carry-docker .carry-podman || true; }
exit 0
