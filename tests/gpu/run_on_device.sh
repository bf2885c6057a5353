#!/usr/bin/env bash
# Runs the GPU suite on the GPU machine in one call. Prepare here first: bash tests/gpu/prepare_carry.sh
# Then, through the device tool (carry .carry and .whl):
#   bash tests/gpu/run_on_device.sh [pytest -k expression]
# Docker and Podman (tests/gpu/test_gpu_docker.py) travel in a call of their own before it: see
# tests/gpu/prepare_docker_carry.sh.
# Results: $OUT/results.jsonl (one JSON object per measurement), $OUT/pytest.log, $OUT/env.txt.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
OUT=${OUT:-/tmp/gpuckpt-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site GPUCKPT_ANSIBLE_PLAYBOOK=/tmp/site/bin/ansible-playbook
# The GPU machine has no sftp client: an async task (the early restore) copies its module file over
# plain ssh instead.
export ANSIBLE_SSH_TRANSFER_METHOD=piped
export GPUCKPT_RESULTS="$OUT/results.jsonl" GPUCKPT_WORKLOAD_PYTHON=$(command -v python3)
bash tests/gpu/install_tools.sh
mkdir -p .build/collections/ansible_collections/gpuckpt && ln -sfn "$repo" .build/collections/ansible_collections/gpuckpt/fleet
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
  uname -r; python3 --version; /usr/local/sbin/criu --version | head -n1; cat /opt/gpuckpt-criu/build.txt 2>/dev/null
  python3 -c 'import torch; print("torch", torch.__version__)'
  /usr/local/lib/gpuckpt-docker26/bin/dockerd --version; podman --version  # (carried: prepare_docker_carry.sh)
  nproc; free -g | sed -n 2p; df -h /tmp | tail -n1
  echo "cgroup fs: $(stat -fc %T /sys/fs/cgroup)"
} 2>&1 | tee "$OUT/env.txt"
/usr/local/sbin/criu check 2>&1 | tail -n 2
python3 tests/gpu/probe_driver.py 2>&1 | tee -a "$OUT/env.txt"
rc=0
if [ "${GPUCKPT_TESTS:-1}" = 1 ]; then
  timeout "${GPUCKPT_TESTS_TIMEOUT:-1800}" python3 -m pytest -p no:cacheprovider -v -s tests/gpu ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|RESULT|passed|failed|Error|assert"
  rc=${PIPESTATUS[0]}
fi
# Benchmarks (issue 4): GPUCKPT_BENCH_SIZES="4,16" (GiB); GPUCKPT_BENCH_FLOORS=0 skips the floors.
# GPUCKPT_BENCH_SAME_SIZE_FLOORS=1 (issue 32): each size's own floors and ratios; =direct: the cold write with O_DIRECT.
if [ -n "${GPUCKPT_BENCH_SIZES:-}" ]; then
  python3 bench/gpu_bench.py --sizes "$GPUCKPT_BENCH_SIZES" $([ "${GPUCKPT_BENCH_FLOORS:-1}" = 0 ] && echo --no-floors) \
    $([ "${GPUCKPT_BENCH_THP:-0}" = 1 ] && echo --thp) \
    $(case "${GPUCKPT_BENCH_SAME_SIZE_FLOORS:-0}" in 0) ;; direct) echo --same-size-floors direct ;; *) echo --same-size-floors ;; esac) \
    2>&1 | tee "$OUT/bench.log" | grep -E "RESULT|Error|error" || rc=1
fi
# The push alone against the link, between per-host cpusets (issue 32): GPUCKPT_PUSH_BENCH_GB=26
# GPUCKPT_PUSH_BENCH_ARGS="--streams 4,8 --tree base=.carry-baseline --tree head=.build/collections"
if [ -n "${GPUCKPT_PUSH_BENCH_GB:-}" ]; then
  timeout "${GPUCKPT_PUSH_BENCH_TIMEOUT:-300}" python3 bench/push_bench.py --gb "$GPUCKPT_PUSH_BENCH_GB" --cpusets split \
    --port 2200 ${GPUCKPT_PUSH_BENCH_ARGS:-} 2>&1 | tee "$OUT/push_bench.log" | grep -E "RESULT|SUMMARY|Error|error" || rc=1
  grep -h '^RESULT ' "$OUT/push_bench.log" | cut -c8- >> "$OUT/results.jsonl" || true
fi
# Migration downtime against its floor and the plain chain (issue 3): GPUCKPT_MIGRATE_BENCH_GIB=4
if [ -n "${GPUCKPT_MIGRATE_BENCH_GIB:-}" ]; then
  python3 bench/migrate_bench.py --torch-gib "$GPUCKPT_MIGRATE_BENCH_GIB" --pid-namespaces 0 ${GPUCKPT_MIGRATE_BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/migrate_bench.log" | grep -E "RESULT|Error|error|\|" || rc=1
fi
# The speed options in one run (issue 15): GPUCKPT_SPEED_GIB=8 GPUCKPT_SPEED_CACHE_GIB=8
if [ -n "${GPUCKPT_SPEED_GIB:-}" ]; then
  python3 bench/gpu_bench.py --speed "$GPUCKPT_SPEED_GIB" --cache-gib "${GPUCKPT_SPEED_CACHE_GIB:-0}" 2>&1 \
    | tee "$OUT/speed.log" | grep -E "RESULT|Error|error" || rc=1
fi
# The carried CRIU against another carried one (GPUCKPT_CRIU_ALT in prepare_carry.sh), in one run (issue 15):
# GPUCKPT_CRIU_COMPARE_GIB=16
if [ -n "${GPUCKPT_CRIU_COMPARE_GIB:-}" ]; then
  python3 bench/gpu_bench.py --criu-compare /opt/gpuckpt-criu/criu-alt --compare-gib "$GPUCKPT_CRIU_COMPARE_GIB" 2>&1 \
    | tee "$OUT/criu_compare.log" | grep -E "RESULT|Error|error" || rc=1
fi
# Three CUDA processes: driver calls one after another vs in parallel (issue 4): GPUCKPT_MULTI_GIB=4
if [ -n "${GPUCKPT_MULTI_GIB:-}" ]; then
  python3 bench/gpu_bench.py --multi "$GPUCKPT_MULTI_GIB" 2>&1 | tee "$OUT/multi.log" | grep -E "RESULT|Error|error" || rc=1
fi
# What the driver does not support, tried once (issue 4): GPUCKPT_LIMITS=1 (or a list: nccl,ipc,uvm)
if [ "${GPUCKPT_LIMITS:-0}" != 0 ]; then
  python3 bench/gpu_limits.py $([ "$GPUCKPT_LIMITS" != 1 ] && echo "$GPUCKPT_LIMITS" | tr , ' ') 2>&1 | tee "$OUT/limits.log" | grep -E "RESULT|Traceback" || rc=1
fi
# Image on tmpfs instead of the disk (issue 4): GPUCKPT_TMPFS_SIZES=16
if [ -n "${GPUCKPT_TMPFS_SIZES:-}" ]; then
  python3 bench/gpu_bench.py --sizes "$GPUCKPT_TMPFS_SIZES" --no-floors --image-root /dev/shm/gpuckpt-bench 2>&1 \
    | tee "$OUT/tmpfs.log" | grep -E "RESULT|Error|error" || rc=1
fi
exit "$rc"
