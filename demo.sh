#!/usr/bin/env bash
# The demo in one command on a fresh machine: installs what it needs (tests/setup.sh), then runs
# playbooks/demo.yml with this checkout as the collection gpuckpt.fleet.
set -euo pipefail
repo=$(cd "$(dirname "$0")" && pwd)
bash "$repo/tests/setup.sh"
export ANSIBLE_COLLECTIONS_PATH="$repo/.build/collections" ANSIBLE_LOCALHOST_WARNING=false \
  ANSIBLE_INVENTORY_UNPARSED_WARNING=false
exec "$repo/.venv/bin/ansible-playbook" -i localhost, -e ansible_python_interpreter=/usr/bin/python3 \
  "$repo/playbooks/demo.yml" "$@"
