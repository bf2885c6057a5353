#!/usr/bin/env bash
# The demo in one command on a fresh machine: installs what it needs (tests/setup.sh), starts two
# "hosts" on this machine (sshd on 127.0.0.2 and 127.0.0.3, each in its own pid namespace), starts a
# workload on the first, migrates it to the second with playbooks/migrate.yml, checks it there, and
# stops everything it started.
set -euo pipefail
repo=$(cd "$(dirname "$0")" && pwd)
demo=${GPUCKPT_DEMO_DIR:-/tmp/gpuckpt-demo}
bash "$repo/tests/setup.sh"
python3 "$repo/tests/hosts/loopback.py" stop "$demo/hosts" 2>/dev/null || true
rm -rf "$demo" && mkdir -p "$demo"
python3 "$repo/tests/hosts/loopback.py" start "$demo/hosts" >/dev/null
trap 'python3 "$repo/tests/hosts/loopback.py" stop "$demo/hosts"' EXIT
export ANSIBLE_COLLECTIONS_PATH="$repo/.build/collections" ANSIBLE_HOST_KEY_CHECKING=false ANSIBLE_PIPELINING=true \
  ANSIBLE_SSH_CONTROL_PATH_DIR="$demo/cp"
"${GPUCKPT_ANSIBLE_PLAYBOOK:-$repo/.venv/bin/ansible-playbook}" -i "$demo/hosts/inventory.yml" \
  -e gpuckpt_demo_dir="$demo" "$repo/playbooks/demo.yml" "$@"
