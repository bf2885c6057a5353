#!/usr/bin/env bash
# All tests, in two pytest runs side by side (run after tests/setup.sh; README's test command):
#   - tests/unit (the rooms' unit tests, ansible-test sanity twice, ansible-lint, the docs, the EE and AWX checks):
#     CPU-bound, about 7 minutes on the 2-core CI kind of machine, with their own pytest basetemp;
#   - everything else (tests/integration: real CRIU, runtimes and sshd hosts on loopback; tests/gpu, skipped
#     without a GPU): mostly waiting on processes, about 0.75 of a core on average.
# Side by side they fit the CI's budget (45 minutes for this command) where one after the other did not. The
# unit run's output is printed after the other's; the exit status fails when either run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# This VM's pid_max is 32768: a run's thousands of processes wrap it within minutes, and a tree restored on this
# host needs the pids it was dumped with still free. A larger space makes a wrapped pid meet a restore rarely.
if [ "$(cat /proc/sys/kernel/pid_max)" -lt 4194304 ]; then
  sysctl -qw kernel.pid_max=4194304 || echo "tests/run.sh: could not raise kernel.pid_max" >&2
fi
unit_log=$(mktemp /tmp/gpuckpt-unit-tests.XXXXXX.log)
.venv/bin/pytest -q -p no:cacheprovider --basetemp=/tmp/gpuckpt-unit-basetemp tests/unit "$@" >"$unit_log" 2>&1 &
unit_pid=$!
.venv/bin/pytest -q tests --ignore=tests/unit "$@"
rest_rc=$?
wait "$unit_pid"
unit_rc=$?
echo
echo "==================== tests/unit (run beside the others) ===================="
cat "$unit_log"
rm -f "$unit_log"
echo "tests/unit: rc=$unit_rc; the others: rc=$rest_rc"
[ "$unit_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
