#!/usr/bin/env bash
# On the GPU machine: put the carried CRIU (and ssh/sshd/rsync where the image lacks them) in place.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
carry="$repo/.carry"
if [ -f "$carry/tools.tar.xz" ]; then  # prepare_carry.sh packs the tools into one archive
  rm -rf /tmp/gpuckpt-carry && mkdir -p /tmp/gpuckpt-carry && tar -C /tmp/gpuckpt-carry -xJf "$carry/tools.tar.xz"
  carry=/tmp/gpuckpt-carry
fi
rm -rf /opt/gpuckpt-criu && cp -r "$carry/criu" /opt/gpuckpt-criu && ln -sf /opt/gpuckpt-criu/criu /usr/local/sbin/criu
if [ -d "$carry/ssh" ]; then
  rm -rf /opt/gpuckpt-ssh && cp -r "$carry/ssh" /opt/gpuckpt-ssh
  for b in sshd ssh ssh-keygen rsync; do
    command -v "$b" >/dev/null 2>&1 || ln -sf "/opt/gpuckpt-ssh/bin/$b" "/usr/local/bin/$b"
  done
fi
if [ -x "$carry/runc/runc" ] && ! command -v runc >/dev/null 2>&1; then
  install -m 0755 "$carry/runc/runc" /usr/local/sbin/runc
  if [[ "$(ldconfig -p)" != *"libseccomp.so.2 "* ]]; then
    cp "$carry"/runc/libseccomp.so.2* /usr/local/lib/ && ldconfig
  fi
fi
if [ -d "$carry/containerd/bin" ]; then  # tests/containerd_daemon.py looks for it there
  mkdir -p /usr/local/lib/gpuckpt-containerd && rm -rf /usr/local/lib/gpuckpt-containerd/bin
  cp -a "$carry/containerd/bin" /usr/local/lib/gpuckpt-containerd/bin
fi
# The containerd backend's grpc client, for the Pythons that run the modules (the tests' managed
# /usr/bin/python3, and the workload's), checked without the carried wheels' PYTHONPATH, which modules
# run over ssh do not get. A wheel is a zip: unpacked into the interpreter's site directory, no pip needed.
for py in /usr/bin/python3 "${GPUCKPT_WORKLOAD_PYTHON:-python3}"; do
  if ! env -u PYTHONPATH "$py" -c 'import grpc, google.protobuf' 2>/dev/null && ls "$repo"/.whl/grpcio-*.whl >/dev/null 2>&1; then
    site=$(env -u PYTHONPATH "$py" -c 'import site; print(site.getsitepackages()[0])')
    mkdir -p "$site"
    for whl in "$repo"/.whl/grpcio-*.whl "$repo"/.whl/protobuf-*.whl "$repo"/.whl/typing_extensions-*.whl; do
      env -u PYTHONPATH "$py" -m zipfile -e "$whl" "$site"
    done
  fi
  env -u PYTHONPATH "$py" -c 'import grpc, sys, google.protobuf as pb; print(sys.executable, "grpc", grpc.__version__, "protobuf", pb.__version__)' || true
done
# iptables, only where asked (GPUCKPT_CARRIED_IPTABLES=1: prepare_carry.sh says why) and the machine has none.
if [ "${GPUCKPT_CARRIED_IPTABLES:-0}" = 1 ] && [ -d "$carry/iptables" ] && ! command -v iptables-restore >/dev/null 2>&1; then
  rm -rf /opt/gpuckpt-iptables && cp -a "$carry/iptables" /opt/gpuckpt-iptables
  for b in iptables iptables-restore iptables-save ip6tables ip6tables-restore ip6tables-save; do
    ln -sf /opt/gpuckpt-iptables/iptables-wrapper "/usr/local/sbin/$b"
  done
  iptables-restore --version || true
fi
# Docker 26 and Podman, where tests/gpu/prepare_docker_carry.sh carried them (a call of their own: see there).
bash "$repo/tests/gpu/install_engines.sh"
id sshd >/dev/null 2>&1 || useradd -r -M -d /run/sshd -s /usr/sbin/nologin sshd 2>/dev/null || \
  echo 'sshd:x:995:65534::/run/sshd:/usr/sbin/nologin' >> /etc/passwd
mkdir -p /run/sshd && chmod 0755 /run/sshd
for b in criu sshd ssh rsync runc podman; do printf '%s=%s ' "$b" "$(command -v $b)"; done; echo
