#!/usr/bin/env bash
# On the GPU machine: put the carried CRIU (and ssh/sshd/rsync where the image lacks them) in place.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf /opt/gpuckpt-criu && cp -r "$repo/.carry/criu" /opt/gpuckpt-criu && ln -sf /opt/gpuckpt-criu/criu /usr/local/sbin/criu
if [ -d "$repo/.carry/ssh" ]; then
  rm -rf /opt/gpuckpt-ssh && cp -r "$repo/.carry/ssh" /opt/gpuckpt-ssh
  for b in sshd ssh ssh-keygen rsync; do
    command -v "$b" >/dev/null 2>&1 || ln -sf "/opt/gpuckpt-ssh/bin/$b" "/usr/local/bin/$b"
  done
fi
if [ -x "$repo/.carry/runc/runc" ] && ! command -v runc >/dev/null 2>&1; then
  install -m 0755 "$repo/.carry/runc/runc" /usr/local/sbin/runc
  if ! ldconfig -p | grep -q 'libseccomp.so.2 '; then
    cp "$repo"/.carry/runc/libseccomp.so.2* /usr/local/lib/ && ldconfig
  fi
fi
id sshd >/dev/null 2>&1 || useradd -r -M -d /run/sshd -s /usr/sbin/nologin sshd 2>/dev/null || \
  echo 'sshd:x:995:65534::/run/sshd:/usr/sbin/nologin' >> /etc/passwd
mkdir -p /run/sshd && chmod 0755 /run/sshd
for b in criu sshd ssh rsync runc; do printf '%s=%s ' "$b" "$(command -v $b)"; done; echo
