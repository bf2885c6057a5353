#!/usr/bin/env bash
# All tests, in two pytest runs side by side (run after tests/setup.sh; README's test command):
#   - tests/unit (the rooms' unit tests, ansible-test sanity twice, ansible-lint, the docs, the EE and AWX checks):
#     CPU-bound, about 7 minutes on the 2-core CI kind of machine, with their own pytest basetemp;
#   - everything else (tests/integration: real CRIU, runtimes and sshd hosts on loopback; tests/gpu, skipped
#     without a GPU): mostly waiting on processes, about 0.75 of a core on average per worker.
# Side by side they fit the goal (40 minutes for this command) where one after the other did not. The unit run's
# output is printed after the others'; the exit status fails when any run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# This VM's pid_max is 32768: a run's thousands of processes wrap it within minutes, and a tree restored on this
# host needs the pids it was dumped with still free. A larger space makes a wrapped pid meet a restore rarely.
if [ "$(cat /proc/sys/kernel/pid_max)" -lt 4194304 ]; then
  sysctl -qw kernel.pid_max=4194304 || echo "tests/run.sh: could not raise kernel.pid_max" >&2
fi
# A mount left under a basetemp by an earlier run (Podman's storage, by a run killed mid-way or a test that missed
# one) would stop that pytest from clearing its basetemp at start (INTERNALERROR): unmounted first, deepest first.
for base in /tmp/gpkit /tmp/gpuckpt-unit-basetemp /tmp/gpuckpt-leftovers-basetemp; do
  findmnt -rn -o TARGET | awk -v b="$base/" 'index($0, b) == 1' | sort -r | while read -r m; do
    umount -l "$m" || echo "tests/run.sh: could not unmount $m" >&2
  done
done
unit_log=$(mktemp /tmp/gpuckpt-unit-tests.XXXXXX.log)
.venv/bin/pytest -q -p no:cacheprovider --basetemp=/tmp/gpuckpt-unit-basetemp tests/unit "$@" >"$unit_log" 2>&1 &
unit_pid=$!
# The others in GPUCKPT_TEST_WORKERS (3) pytest-xdist workers, a whole file to each at a time (a file's tests share
# its module-scoped hosts): each worker's loopback hosts on a net of their own (tests/hosts/loopback.py). The files
# start longest first (tests/conftest.py), so that the last one to end is a short one.
# test_leftovers.py compares this machine's /tmp and the runtimes' state dirs before and after each operation, so it
# runs alone, after them.
# A short basetemp: each worker's tests are under <basetemp>/popen-gwN/<test>/, and ssh's control sockets there must
# stay under the 108 bytes of a unix socket's path.
workers=${GPUCKPT_TEST_WORKERS:-3}
.venv/bin/pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 --basetemp=/tmp/gpkit \
  tests --ignore=tests/unit \
  --ignore=tests/integration/test_leftovers.py "$@"
rest_rc=$?
.venv/bin/pytest -q -p no:cacheprovider --basetemp=/tmp/gpuckpt-leftovers-basetemp tests/integration/test_leftovers.py "$@"
leftovers_rc=$?
[ "$leftovers_rc" -eq 5 ] && leftovers_rc=0  # (-k or -m selected none of its tests)
[ "$rest_rc" -eq 5 ] && rest_rc=0
wait "$unit_pid"
unit_rc=$?
echo
echo "==================== tests/unit (run beside the others) ===================="
cat "$unit_log"
rm -f "$unit_log"
echo "tests/unit: rc=$unit_rc; the others: rc=$rest_rc; test_leftovers: rc=$leftovers_rc"
[ "$unit_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ] && [ "$leftovers_rc" -eq 0 ]
