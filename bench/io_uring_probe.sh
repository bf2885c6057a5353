#!/usr/bin/env bash
# Who holds an io_uring in a torchrun job (issue 45: CRIU cannot dump one)? Starts a 2-rank job that only sleeps,
# with the environment given (and torchrun arguments in PROBE_TORCHRUN_ARGS), and prints each process's io_uring fds and maps, its threads and the libraries that
# call io_uring_setup. Run on the GPU machine: bash bench/io_uring_probe.sh [VAR=value ...]
set -u
py=${GPUCKPT_WORKLOAD_PYTHON:-python3}
d=$(mktemp -d)
cat > "$d/job.py" <<'PY'
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
t = torch.ones(1, device="cuda"); dist.all_reduce(t); time.sleep(30)
PY
env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 "$@" setsid "$py" -m torch.distributed.run \
  ${PROBE_TORCHRUN_ARGS:---standalone} --nproc-per-node 2 "$d/job.py" > "$d/log" 2>&1 &
agent=$!
sleep 15
for p in $agent $(pgrep -P $agent); do
  echo "== pid $p $(cat /proc/$p/comm) threads: $(cat /proc/$p/task/*/comm | sort | uniq -c | tr '\n' ' ')"
  ls -l /proc/$p/fd 2>/dev/null | grep -c io_uring | sed 's/^/io_uring fds: /'
  grep io_uring /proc/$p/maps | head -3
  for lib in $(awk '$6 ~ /\.so/ {print $6}' /proc/$p/maps | sort -u); do
    if grep -aqE "UV_USE_IO_URING|io_uring_queue_init|io_uring_setup" "$lib" 2>/dev/null; then echo "  mentions io_uring: $lib"; fi
  done
done
tail -5 "$d/log"
kill -9 -- -$agent 2>/dev/null; pkill -9 -f "$d/job.py"; rm -rf "$d"
