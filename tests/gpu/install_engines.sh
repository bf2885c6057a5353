#!/usr/bin/env bash
# On the GPU machine: put in place the container engines that tests/gpu/prepare_docker_carry.sh carried, where they
# are present (install_tools.sh runs this too; it can run alone, in the call that carries them):
#   .carry-docker/docker.tar.xz -> /usr/local/lib/gpuckpt-docker26/bin: dockerd, docker, docker-proxy, and the
#        containerd 1.6, containerd-shim-runc-v2 and docker-init that dockerd finds there on its PATH
#        (tests/docker_daemon.py's DOCKER26_DIR and dockerd_command)
#   .carry-podman/podman.tar.xz -> /usr/local/lib/gpuckpt-podman/bin: podman and conmon; podman also on the PATH
#        ($GPUCKPT_ENGINE_BIN_DIR, /usr/local/bin) where none is; its configuration in /etc/containers and
#        /usr/share/containers where the machine has none
# The libraries the archives carry go into $GPUCKPT_ENGINE_LIB_DIR (/usr/local/lib, where the loader looks) only
# where the machine lacks that soname. Prints where everything went and the versions.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
docker_prefix=${GPUCKPT_DOCKER_PREFIX:-/usr/local/lib/gpuckpt-docker26}
podman_prefix=/usr/local/lib/gpuckpt-podman  # (its containers.conf names this conmon)
bin_dir=${GPUCKPT_ENGINE_BIN_DIR:-/usr/local/bin}
lib_dir=${GPUCKPT_ENGINE_LIB_DIR:-/usr/local/lib}
etc_dir=${GPUCKPT_ENGINE_ETC_DIR:-/etc}
share_dir=${GPUCKPT_ENGINE_SHARE_DIR:-/usr/share}

have() {  # an executable of that name on the PATH
  local path; path=$(command -v "$1" 2>/dev/null) && [ -x "$path" ]
}

# the carried libraries whose sonames the machine's loader does not know, copied where it looks
missing_libs() {
  local from=$1 copied=0 known
  known=$(ldconfig -p)
  for lib in "$from"/*; do
    [ -e "$lib" ] || continue
    if [[ "$known" != *"$(basename "$lib") "* ]] && [ ! -e "$lib_dir/$(basename "$lib")" ]; then
      mkdir -p "$lib_dir" && cp "$lib" "$lib_dir/" && copied=$((copied + 1))
      echo "  library $(basename "$lib") -> $lib_dir (the machine has none)"
    fi
  done
  if [ "$copied" -gt 0 ]; then ldconfig; fi
}

unpack() {  # unpack <archive> -> prints the folder it was unpacked into
  local to; to=$(mktemp -d /tmp/gpuckpt-engine.XXXXXX)
  tar -C "$to" -xJf "$1"
  echo "$to"
}

if [ -f "$repo/.carry-docker/docker.tar.xz" ]; then
  src=$(unpack "$repo/.carry-docker/docker.tar.xz")
  mkdir -p "$docker_prefix" && rm -rf "$docker_prefix/bin" && cp -a "$src/gpuckpt-docker/bin" "$docker_prefix/bin"
  echo "Docker: $docker_prefix/bin ($(ls "$docker_prefix/bin" | tr '\n' ' '))"
  missing_libs "$src/gpuckpt-docker/lib"
  rm -rf "$src"
  for b in dockerd docker containerd; do "$docker_prefix/bin/$b" --version; done
else
  echo "Docker: not carried (.carry-docker/docker.tar.xz: bash tests/gpu/prepare_docker_carry.sh docker)"
fi

if [ -f "$repo/.carry-podman/podman.tar.xz" ]; then
  src=$(unpack "$repo/.carry-podman/podman.tar.xz")
  mkdir -p "$podman_prefix" && rm -rf "$podman_prefix/bin" && cp -a "$src/gpuckpt-podman/bin" "$podman_prefix/bin"
  echo "Podman: $podman_prefix/bin ($(ls "$podman_prefix/bin" | tr '\n' ' '))"
  missing_libs "$src/gpuckpt-podman/lib"
  if ! have podman; then
    mkdir -p "$bin_dir" && ln -sfn "$podman_prefix/bin/podman" "$bin_dir/podman" && echo "  podman -> $bin_dir/podman"
  fi
  if ! have conmon; then  # (found on the PATH too where a containers.conf of the machine's names none)
    mkdir -p "$bin_dir" && ln -sfn "$podman_prefix/bin/conmon" "$bin_dir/conmon" && echo "  conmon -> $bin_dir/conmon"
  fi
  for f in policy.json registries.conf containers.conf; do  # the machine's own configuration, where it has one, stays
    if [ ! -e "$etc_dir/containers/$f" ]; then
      mkdir -p "$etc_dir/containers" && cp "$src/gpuckpt-podman/etc/containers/$f" "$etc_dir/containers/$f"
      echo "  $etc_dir/containers/$f (carried)"
    fi
  done
  if [ ! -e "$share_dir/containers/seccomp.json" ]; then
    mkdir -p "$share_dir/containers" && cp "$src/gpuckpt-podman/share/containers/seccomp.json" "$share_dir/containers/"
    echo "  $share_dir/containers/seccomp.json (carried)"
  fi
  rm -rf "$src"
  "$podman_prefix/bin/podman" --version
  "$podman_prefix/bin/conmon" --version | head -n1
else
  echo "Podman: not carried (.carry-podman/podman.tar.xz: bash tests/gpu/prepare_docker_carry.sh podman)"
fi
