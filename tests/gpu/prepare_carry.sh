#!/usr/bin/env bash
# Run HERE (the CI-kind machine) before a GPU run: the GPU machine has no internet and no apt, so
# everything the GPU tests need beyond its image travels along in two git-ignored folders:
#   .carry/criu/  CRIU 4.2.1 built by tests/setup.sh with the collection's parallel page reads patch (what the
#                 criu role installs by default, criu_parallel_page_reads), with the shared libraries it needs
#                 beyond glibc (GPUCKPT_CRIU_CARRY=<path> carries another build instead, e.g. the plain one:
#                 /usr/local/sbin/criu; the multi-GPU runs before session 28 carried that one)
#   .carry/gpuckpt-cuda-checkpoint  the collection's cuda-checkpoint tool, built by tests/setup.sh
#                 (the GPU machine's glibc 2.39 runs binaries built against bookworm's 2.36)
#   .whl/         wheels for Python 3.12: ansible-core 2.21 and pytest, with their dependencies
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
bash tests/setup.sh >/dev/null
rm -rf .carry/criu && mkdir -p .carry/criu/lib
criu_bin=${GPUCKPT_CRIU_CARRY:-$repo/.build/criu-4.2.1-parallel-reads/criu/criu}
cp "$criu_bin" .carry/criu/criu.bin
# (which build travelled: run_on_device.sh writes it into env.txt)
echo "carried from $criu_bin, sha256 $(sha256sum < "$criu_bin" | cut -c1-16)" > .carry/criu/build.txt
ldd "$criu_bin" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" .carry/criu/lib/; done
cat > .carry/criu/criu <<'SH'
#!/bin/sh
# CRIU carried from the CI-kind machine, with its libraries.
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/criu.bin" "$@"
SH
chmod +x .carry/criu/criu
# Another CRIU to compare with in one GPU run (bench/gpu_bench.py --criu-compare), when one is named:
#   GPUCKPT_CRIU_ALT=/path/to/criu bash tests/gpu/prepare_carry.sh   (e.g. 4.1.1 built from Debian's tarball)
if [ -n "${GPUCKPT_CRIU_ALT:-}" ]; then
  cp "$GPUCKPT_CRIU_ALT" .carry/criu/criu-alt.bin
  sed 's/criu\.bin/criu-alt.bin/; s/CRIU carried/Another CRIU carried/' .carry/criu/criu > .carry/criu/criu-alt
  chmod +x .carry/criu/criu-alt
fi
# The collection's own cuda-checkpoint, built here by tests/setup.sh (it needs only glibc 2.2.5's symbols).
cp .build/gpuckpt-cuda-checkpoint .carry/gpuckpt-cuda-checkpoint
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl ansible-core==2.21.5 jinja2==3.1.6 markupsafe==3.0.4 pyyaml==6.0.3 packaging==26.3 \
  resolvelib==1.2.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pytest==9.2.0 pluggy==1.7.0 \
  iniconfig==2.3.1 pygments 2>&1 | grep -v '^WARNING: Location' || true

# ssh, sshd and rsync for the two loopback "hosts" of the GPU migration tests, in case the GPU
# machine's image lacks them: bookworm's binaries with the libraries they need beyond glibc.
rm -rf .carry/ssh && mkdir -p .carry/ssh/bin .carry/ssh/lib
for b in /usr/sbin/sshd /usr/bin/ssh /usr/bin/ssh-keygen /usr/bin/rsync; do
  cp "$b" .carry/ssh/bin/"$(basename "$b")".bin
  ldd "$b" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' \
    | while read -r lib; do cp -Ln "$lib" .carry/ssh/lib/ 2>/dev/null || true; done
  cat > .carry/ssh/bin/"$(basename "$b")" <<SH
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$d/../lib" exec "\$d/$(basename "$b").bin" "\$@"
SH
  chmod +x .carry/ssh/bin/"$(basename "$b")"
done
du -sh .carry/ssh

# runc for the GPU container test (tests/gpu/test_gpu_runc.py): bookworm's runc 1.1.5 and the
# libseccomp it links. runc re-executes itself as the container's init with a clean environment, so
# the library goes where the loader looks (install_tools.sh), not behind LD_LIBRARY_PATH.
rm -rf .carry/runc && mkdir -p .carry/runc
if command -v runc >/dev/null 2>&1; then
  cp "$(command -v runc)" .carry/runc/runc
  cp -L "$(ldd "$(command -v runc)" | awk '$1 ~ /^libseccomp/ {print $3}')" .carry/runc/
fi

# containerd 2.1.9 (tests/setup.sh installs Debian sid's build there) for tests/gpu/test_gpu_containerd.py,
# and grpcio and protobuf for Python 3.12 (the containerd backend's client: its stubs and messages are
# generated code, plugins/module_utils/runtimes/containerd_proto).
rm -rf .carry/containerd && mkdir -p .carry/containerd
cp -a /usr/local/lib/gpuckpt-containerd/bin .carry/containerd/
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl grpcio==1.76.0 protobuf==6.33.6 2>&1 | grep -v '^WARNING: Location' || true

# iptables (bookworm's iptables-nft: the multi-call xtables-nft-multi, its libraries and its extensions), which the
# GPU machines lack: CRIU locks a tree's TCP connections with iptables-restore by default, and a runtime that cannot
# hand CRIU --network-lock=nftables (containerd's runc, a pod's) is refused without it (tree_plan.network_lock_flags),
# as on a fleet node without iptables. install_tools.sh puts it in place only where GPUCKPT_CARRIED_IPTABLES=1, so that
# the other GPU tests keep running as on a machine without it.
rm -rf .carry/iptables && mkdir -p .carry/iptables/lib
cp /usr/sbin/xtables-nft-multi .carry/iptables/xtables-nft-multi
cp -a /usr/lib/x86_64-linux-gnu/xtables .carry/iptables/xtables
ldd /usr/sbin/xtables-nft-multi | awk '$3 ~ /^\// {print $3}' \
  | grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" .carry/iptables/lib/; done
cat > .carry/iptables/iptables-wrapper <<'SH'
#!/bin/bash
# iptables carried from the CI-kind machine: the multi-call binary picks the tool by the name it was called by.
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XTABLES_LIBDIR="$d/xtables" \
  exec -a "$(basename "$0")" "$d/xtables-nft-multi" "$@"
SH
chmod +x .carry/iptables/iptables-wrapper

# The device tool carries at most 64 MiB: everything but the wheels travels as one xz archive, which
# install_tools.sh unpacks.
tar -C .carry -cf - criu ssh runc containerd iptables | xz -T0 -6 > .carry/tools.tar.xz
rm -rf .carry/criu .carry/ssh .carry/runc .carry/containerd .carry/iptables
du -sh .carry .whl
