#!/usr/bin/env bash
# Installs and builds everything the tests and the demo need on a fresh Debian 12 machine of the
# CI kind (root, no systemd as PID 1). Idempotent: a second run only checks and takes a few seconds.
#
#   bash tests/setup.sh            # apt packages, CRIU 4.2.1, CRIU's zdtm tests, venv (.venv), libcuda stand-in
#
# Why CRIU is built from source: bookworm's criu 3.17 fails on this kernel ("vdso: Unexpected rt vDSO
# area bounds"), and 4.1.1 cannot dump TCP sockets on kernels 6.16 and newer ("Can't get 1:16 opt",
# criu issues #2705, #2718); sid's 4.2.1 source builds against bookworm's libraries. Its zdtm static
# tests are built from the same tarball (tests/zdtm). The apt mirror is read from the machine's own
# sources file, never written here.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
CRIU_VERSION=4.2.1
CRIU_SUITE=sid
CRIU_PREFIX=/usr/local
CRIU_TARBALL=/var/cache/criu_${CRIU_VERSION}.orig.tar.xz
export DEBIAN_FRONTEND=noninteractive
log() { printf '[setup %4ds] %s\n' "$SECONDS" "$*" >&2; }  # seconds since setup began

need_apt=()
apt_pkgs=(build-essential pkgconf libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev
  python3-protobuf iproute2 rsync openssh-server openssh-client xz-utils procps patch
  runc iptables podman docker.io binutils python3-grpcio python3-venv ccache
  systemd)  # runc 1.1.5, Podman 4.3.1, Docker 20.10 (bookworm); CRIU needs iptables for a netns; systemd 252 runs as
            # PID 1 of a test host's namespaces (tests/hosts/systemd_node.py), not as this machine's
for p in "${apt_pkgs[@]}"; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == *"install ok installed"* ]] || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# Controller-side Python: ansible-core 2.19 is the newest that runs on this machine's Python 3.11. The venv is made on
# Debian's own python3 (3.11, built with PGO and LTO), not on the pyenv build first on PATH: ansible-playbook with 15
# module calls took a fifth less CPU on it (4.3 s against 5.4 s user, measured here on 2026-11-27). The whole test
# command, CPU-bound on this 2-core kind, gained less: 35 min 5 s against 35 min 42 s (README.md).
base_python=/usr/bin/python3
"$base_python" -c 'import ensurepip, venv' 2>/dev/null || base_python=python3
base_home=$(dirname "$("$base_python" -c 'import sys; print(sys.executable)')")
venv="$repo/.venv"

# The oldest ansible-core that meta/runtime.yml's requires_ansible claims (its newest patch release),
# in a venv of its own: ansible-test sanity runs on it too (tests/unit/test_sanity.py).
oldest=$(sed -n 's/^requires_ansible: *">=\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' "$repo/meta/runtime.yml")
read -r old_major old_minor <<<"$oldest"
venv_oldest="$repo/.venv-oldest"
want="ansible-core>=${old_major}.${old_minor},<${old_major}.$((old_minor + 1))"

# Both venvs are made in the background while CRIU compiles (pip mostly waits on the network and the disk, the
# compiler computes): waited for below, before anything uses them. Their log is printed then.
make_venvs() {
  make_oldest_venv &
  local oldest_pid=$!
  if [ ! -x "$venv/bin/ansible-playbook" ] || ! "$venv/bin/python" -m pip --disable-pip-version-check -q check >/dev/null 2>&1 \
     || ! cmp -s "$repo/tests/requirements.txt" "$venv/.requirements.txt" \
     || ! grep -qx "home = $base_home" "$venv/pyvenv.cfg" 2>/dev/null; then
    log "creating $venv on $base_python"
    "$base_python" -m venv --clear "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$repo/tests/requirements.txt"
    cp "$repo/tests/requirements.txt" "$venv/.requirements.txt"
  fi
  wait "$oldest_pid"
}
make_oldest_venv() {
  if [ ! -x "$venv_oldest/bin/ansible-test" ] || [ "$(cat "$venv_oldest/.wanted" 2>/dev/null)" != "$want" ]; then
    log "creating $venv_oldest ($want)"
    rm -rf "$venv_oldest"
    python3 -m venv "$venv_oldest"
    "$venv_oldest/bin/python" -m pip install -q --disable-pip-version-check "$want"
    echo "$want" >"$venv_oldest/.wanted"
  fi
}
mkdir -p "$repo/.build"
venv_log="$repo/.build/venv-setup.log"
make_venvs >"$venv_log" 2>&1 &
venv_pid=$!
# (a step below that fails ends setup: the venvs' pip with it)
trap '[ -z "$venv_pid" ] || { pkill -P "$venv_pid"; kill "$venv_pid"; } 2>/dev/null || true' EXIT

# The collection's CRIU patch (roles/criu, criu_parallel_page_reads, on by default there) is built beside
# the plain CRIU, in its own tree; tests/integration/test_criu_parallel_reads.py runs it. The CRIU every
# other test runs is the plain one (its binary does not name the patch's environment variable).
CRIU_PATCH="$repo/roles/criu/files/patches/criu-4.2-parallel-page-reads.patch"
par_tree="$repo/.build/criu-$CRIU_VERSION-parallel-reads"
criu_ok() {
  local v
  v=$("$CRIU_PREFIX/sbin/criu" --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
  [ "$v" = "$CRIU_VERSION" ] && ! grep -q CRIU_RESTORE_READ_THREADS "$CRIU_PREFIX/sbin/criu"
}
fetch_criu_tarball() {
  [ -f "$CRIU_TARBALL" ] && return 0
  log "fetching CRIU $CRIU_VERSION's source tarball from Debian $CRIU_SUITE"
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
  [ -n "$mirror" ] || mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  [ -n "$mirror" ] || { log "cannot read the Debian mirror from this machine's apt sources"; exit 1; }
  src_list=/etc/apt/sources.list.d/gpuckpt-$CRIU_SUITE-src.sources
  if [ ! -f "$src_list" ]; then
    printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" "$CRIU_SUITE" >"$src_list"
    apt-get update -qq
  fi
  local dl
  dl=$(mktemp -d /tmp/criu-src.XXXXXX)
  # The .dsc and .debian parts may 404 (exit 100); the orig tarball is what we need.
  (cd "$dl" && apt-get source --download-only -qq "criu=${CRIU_VERSION}-1" >/dev/null 2>&1) || true
  [ -f "$dl/criu_${CRIU_VERSION}.orig.tar.xz" ] || { log "criu_${CRIU_VERSION}.orig.tar.xz did not download"; exit 1; }
  mv "$dl/criu_${CRIU_VERSION}.orig.tar.xz" "$CRIU_TARBALL"
  rm -rf "$dl"
}

# The C builds go through ccache (its compiler links in /usr/lib/ccache), in one cache of this machine: CRIU is
# compiled three times from one source (plain, patched, and by the criu role's molecule scenario, which
# tests/integration/test_molecule.py points at the same cache), and a clean clone compiles it again. The trees sit
# at different paths, so the cache does not hash the directory (CRIU includes by relative paths).
export PATH="/usr/lib/ccache:$PATH" CCACHE_DIR=/var/cache/gpuckpt-ccache CCACHE_NOHASHDIR=true

# The source tree, kept under .build: CRIU is built there, and so are its zdtm tests.
src_tree="$repo/.build/criu-$CRIU_VERSION"
if ! criu_ok || [ ! -x "$src_tree/test/zdtm/static/env00" ]; then
  fetch_criu_tarball
  if [ ! -f "$src_tree/Makefile" ]; then
    rm -rf "$src_tree" && mkdir -p "$repo/.build"
    tar -C "$repo/.build" -xf "$CRIU_TARBALL"
  fi
fi
if ! criu_ok; then
  if [ -f "$src_tree/.gpuckpt-parallel-page-reads" ]; then  # a tree an earlier setup patched
    patch -d "$src_tree" -p1 -R --batch -i "$CRIU_PATCH" >/dev/null
    rm -f "$src_tree/.gpuckpt-parallel-page-reads"
  fi
  log "building CRIU $CRIU_VERSION"
  make -C "$src_tree" -j"$(nproc)" criu >"$repo/.build/criu-build.log" 2>&1 || { tail -n 40 "$repo/.build/criu-build.log"; exit 1; }
  install -D -m 0755 "$src_tree/criu/criu" "$CRIU_PREFIX/sbin/criu"
fi
if [ ! -x "$src_tree/test/zdtm/static/env00" ]; then
  log "building CRIU's zdtm static tests (the ones this machine's libraries allow)"
  make -C "$src_tree/test/zdtm/lib" -j"$(nproc)" >"$repo/.build/zdtm-build.log" 2>&1 || { tail -n 40 "$repo/.build/zdtm-build.log"; exit 1; }
  # -k: a test whose library is missing here (libaio) is left out; the runner selects what was built
  make -k -C "$src_tree/test/zdtm/static" -j"$(nproc)" >>"$repo/.build/zdtm-build.log" 2>&1 || true
fi
if [ ! -x "$par_tree/criu/criu" ] || [ "$CRIU_PATCH" -nt "$par_tree/criu/criu" ]; then
  fetch_criu_tarball
  log "building CRIU $CRIU_VERSION with $(basename "$CRIU_PATCH") in $par_tree"
  rm -rf "$par_tree" && mkdir -p "$par_tree"
  tar -C "$par_tree" --strip-components=1 -xf "$CRIU_TARBALL"
  patch -d "$par_tree" -p1 --forward --batch -i "$CRIU_PATCH" >/dev/null
  make -C "$par_tree" -j"$(nproc)" criu >"$repo/.build/criu-parallel-reads-build.log" 2>&1 \
    || { tail -n 40 "$repo/.build/criu-parallel-reads-build.log"; exit 1; }
fi
# CRIU's own cuda plugin, from the same source tree: built only, never installed (a CRIU that loaded it would
# drive the GPU behind the engine). tests/integration/test_criu_cuda_plugin.py puts it where this CRIU looks,
# in a private mount namespace, and shows that the collection's CRIU commands never load it.
if [ ! -f "$src_tree/plugins/cuda/cuda_plugin.so" ]; then
  fetch_criu_tarball
  [ -f "$src_tree/Makefile" ] || { mkdir -p "$repo/.build" && tar -C "$repo/.build" -xf "$CRIU_TARBALL"; }
  log "building CRIU's cuda plugin (not installed)"
  make -C "$src_tree" -j"$(nproc)" cuda_plugin >"$repo/.build/criu-cuda-plugin-build.log" 2>&1 \
    || { tail -n 40 "$repo/.build/criu-cuda-plugin-build.log"; exit 1; }
fi
criu_ok || { log "CRIU $CRIU_VERSION is not installed at $CRIU_PREFIX/sbin/criu"; exit 1; }
"$CRIU_PREFIX/sbin/criu" check >/dev/null 2>&1 || { "$CRIU_PREFIX/sbin/criu" check; exit 1; }

# .debs of another Debian suite, fetched with a private apt state (that suite's lists never reach the
# system's apt) and unpacked together into a temporary dir, whose path is printed.
# Usage: fetch_deb SUITE PKG=VERSION* [PKG=VERSION* ...]
fetch_deb() {
  local suite=$1 mirror aptdir deb
  shift
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
  [ -n "$mirror" ] || mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  aptdir=$(mktemp -d /tmp/gpuckpt-apt.XXXXXX)
  mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
  printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" "$suite" >"$aptdir/suite.sources"
  local aptopts=(-o "Dir::Etc::SourceList=$aptdir/suite.sources" -o Dir::Etc::SourceParts=/nonexistent
                 -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache" -o Dir::State::status=/dev/null)
  apt-get "${aptopts[@]}" update -qq >&2
  (cd "$aptdir" && apt-get "${aptopts[@]}" download -qq "$@") >/dev/null 2>&1
  for deb in "$aptdir"/*.deb; do dpkg -x "$deb" "$aptdir/x"; done
  echo "$aptdir"
}

# containerd 2.x: Debian sid's build needs only glibc 2.34 (checked below with objdump), so it runs on
# bookworm's 2.36. It is unpacked into $CTRD_PREFIX, apart from anything installed by packages. The
# containerd backend talks to containerd's API through python3-grpcio on the managed hosts.
CTRD_VERSION=2.1.9
CTRD_PREFIX=/usr/local/lib/gpuckpt-containerd
# (the version is read first, then matched: `cmd | grep -q` under pipefail fails when grep exits
# before cmd has written all it prints, which it kills with SIGPIPE)
ctrd_ok() { local v; v=$("$CTRD_PREFIX/bin/containerd" --version 2>/dev/null) || return 1; [[ "$v" == *" $CTRD_VERSION"* ]]; }
if ! ctrd_ok; then
  log "fetching containerd $CTRD_VERSION from Debian sid"
  aptdir=$(fetch_deb sid "containerd=${CTRD_VERSION}*")
  for b in containerd containerd-shim-runc-v2 ctr; do
    need=$(objdump -T "$aptdir/x/usr/bin/$b" | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n | tail -n1)
    [ "${need#GLIBC_2.}" -le 36 ] || { log "$b needs $need, more than this machine's glibc"; exit 1; }
    install -D -m 0755 "$aptdir/x/usr/bin/$b" "$CTRD_PREFIX/bin/$b"
  done
  rm -rf "$aptdir"
  ctrd_ok || { log "containerd $CTRD_VERSION did not install"; exit 1; }
fi

# Docker 26 (Debian trixie's docker.io and docker-cli): Docker 25+ gives containers devices from CDI specs
# (`--device nvidia.com/gpu=0`), Docker 20.10 (bookworm's, /usr/bin, still tested) does not. trixie's build
# needs only glibc 2.34 (checked below), so it runs here, unpacked into $DOCKER26_PREFIX (tests/docker_daemon.py
# starts it); it uses the system's containerd 1.6, runc and docker-init.
DOCKER26_VERSION=26.1.5+dfsg1-9+deb13u1+b1
DOCKER26_PREFIX=/usr/local/lib/gpuckpt-docker26
docker26_ok() {
  local b v
  for b in dockerd docker; do
    v=$("$DOCKER26_PREFIX/bin/$b" --version 2>/dev/null) || return 1
    [[ "$v" == "Docker version ${DOCKER26_VERSION%%+*}+"* ]] || return 1
  done
  [ -x "$DOCKER26_PREFIX/bin/docker-proxy" ] && [ "$(cat "$DOCKER26_PREFIX/version" 2>/dev/null)" = "$DOCKER26_VERSION" ]
}
if ! docker26_ok; then
  log "fetching Docker $DOCKER26_VERSION from Debian trixie"
  aptdir=$(fetch_deb trixie "docker.io=$DOCKER26_VERSION" "docker-cli=$DOCKER26_VERSION")
  for b in usr/sbin/dockerd usr/sbin/docker-proxy usr/bin/docker; do
    need=$(objdump -T "$aptdir/x/$b" | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n | tail -n1)
    [ "${need#GLIBC_2.}" -le 36 ] || { log "$b needs $need, more than this machine's glibc"; exit 1; }
    install -D -m 0755 "$aptdir/x/$b" "$DOCKER26_PREFIX/bin/${b##*/}"
  done
  echo "$DOCKER26_VERSION" >"$DOCKER26_PREFIX/version"  # --version names the release, not Debian's revision
  rm -rf "$aptdir"
  docker26_ok || { log "Docker $DOCKER26_VERSION did not install"; exit 1; }
fi

# gVisor's runsc, from bookworm-backports: a static binary. Not sid's or trixie's build of the same
# release: those are built with Go 1.24/1.26, newer than gVisor 20240729 supports, and their sandboxes
# panic at times (assertTaskGoroutine: "running on goroutine ...", seen in 1 of 5 starts here);
# backports' is built with Go 1.22, which that release supports. --platform=systrap (its default) works
# here; never --platform=kvm (it hangs in these VMs).
RUNSC_VERSION=0.0~20240729.0-4~bpo12+2
runsc_ok() { local v; v=$(/usr/local/sbin/runsc --version 2>/dev/null) || return 1; [[ "$v" == *20240729* ]] \
  && [ -f /usr/local/lib/gpuckpt-runsc.version ] && [ "$(cat /usr/local/lib/gpuckpt-runsc.version)" = "$RUNSC_VERSION" ]; }
if ! runsc_ok; then
  log "fetching runsc $RUNSC_VERSION from Debian bookworm-backports"
  aptdir=$(fetch_deb bookworm-backports "runsc=$RUNSC_VERSION")
  install -D -m 0755 "$aptdir/x/usr/bin/runsc" /usr/local/sbin/runsc
  echo "$RUNSC_VERSION" >/usr/local/lib/gpuckpt-runsc.version
  rm -rf "$aptdir"
  runsc_ok || { log "runsc $RUNSC_VERSION did not install"; exit 1; }
fi
/usr/bin/python3 -c 'import grpc' 2>/dev/null || apt-get install -y -qq --no-install-recommends python3-grpcio >/dev/null

# CRIU locks a dumped TCP connection with iptables DROP rules (marked 0xc114, CRIU's SOCCR_MARK) until
# its restore unlocks it. A dump killed before its restore (an interrupted test run) leaves them, and a
# later connection that reuses that port pair has its packets dropped: zdtm's socket-tcpbuf-local hung
# so in a CI run on a reused machine. Only those rules are removed.
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null 2>&1 || continue
  rules=$("$ipt" -S 2>/dev/null) || continue
  while IFS= read -r rule; do
    [[ "$rule" == "-A "*"--mark 0xc114"* ]] || continue
    read -ra args <<<"${rule/#-A /-D }"
    "$ipt" "${args[@]}" 2>/dev/null || true
  done <<<"$rules"
done

if ! wait "$venv_pid"; then
  tail -n 40 "$venv_log" >&2
  log "making the venvs failed (the whole log: $venv_log)"
  exit 1
fi
venv_pid=
cat "$venv_log" >&2

# kubernetes.core's connection options (plugins/module_utils/args_common.py of kubernetes.core 6.2.0, from the
# ansible 12.2.0 wheel; one file kept, its checksum pinned): tests/unit/k8s/test_k8s_auth.py compares the
# collection's with them.
k8s_core_args="$repo/.build/kubernetes.core/args_common.py"
k8s_core_args_sha256=09d6ddaf55f0f0a7de2a673f04506ae57bfb438d844c09875b5b23e6e4d38c10
if ! echo "$k8s_core_args_sha256  $k8s_core_args" | sha256sum -c --status 2>/dev/null; then
  log "fetching kubernetes.core's args_common.py (ansible 12.2.0)"
  dl=$(mktemp -d /tmp/gpuckpt-ansible.XXXXXX)
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$dl" ansible==12.2.0
  mkdir -p "$(dirname "$k8s_core_args")"
  "$venv/bin/python" -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
    "$dl"/ansible-12.2.0-py3-none-any.whl ansible_collections/kubernetes/core/plugins/module_utils/args_common.py \
    >"$k8s_core_args.new"
  rm -rf "$dl"
  echo "$k8s_core_args_sha256  $k8s_core_args.new" | sha256sum -c --status \
    || { log "kubernetes.core's args_common.py does not have the pinned checksum"; rm -f "$k8s_core_args.new"; exit 1; }
  mv "$k8s_core_args.new" "$k8s_core_args"
fi

# ansible-test sanity bootstraps pip into its venvs with a script it downloads from a host this
# machine cannot reach. Its cache takes a local stand-in: pip from the interpreter's own bundle.
for v in "$venv" "$venv_oldest"; do
  pipv=$(sed -n "s/.*pip='\([0-9.]*\)'.*/\1/p" "$v"/lib/python3*/site-packages/ansible_test/_internal/python_requirements.py | head -n1)
  if [ -n "$pipv" ] && [ ! -f "$HOME/.ansible/test/cache/get_pip_${pipv//./_}.py" ]; then
    mkdir -p "$HOME/.ansible/test/cache"
    printf '# Offline stand-in for the get-pip bootstrap script (written by tests/setup.sh).\nimport ensurepip\nensurepip.bootstrap(upgrade=True)\n' \
      >"$HOME/.ansible/test/cache/get_pip_${pipv//./_}.py"
  fi
done

# The collection must sit at ansible_collections/gpuckpt/fleet for ansible and for imports.
coll="$repo/.build/collections/ansible_collections/gpuckpt"
mkdir -p "$coll"
ln -sfn "$repo" "$coll/fleet"

# The libcuda stand-in (CI only: no GPU here), and the collection's own cuda-checkpoint tool, built by
# the recipe the cuda_checkpoint role uses on the nodes.
make -s -C "$repo/tests/fakecuda" >/dev/null
sh "$repo/roles/cuda_checkpoint/files/build.sh" "$repo/roles/cuda_checkpoint/files/cuda_checkpoint.c" \
  "$repo/.build/gpuckpt-cuda-checkpoint"

log "ready: criu $CRIU_VERSION, $("$venv/bin/ansible-playbook" --version | sed -n 1p)"
