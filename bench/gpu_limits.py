"""What the driver's checkpoint API does not support, tried once on a real GPU: NCCL, CUDA IPC memory,
managed (UVM) memory. Each case starts a small workload, asks the engine to checkpoint it with
leave_running (so a success can be undone), and records what happened: the error (stage, driver error)
and whether the workload still runs afterwards. Run on the GPU machine (tests/gpu/run_on_device.sh).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import processes as gpu_procs  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError  # noqa: E402

PY = os.environ.get("GPUCKPT_WORKLOAD_PYTHON", "python3")

CASES = {
    # Two ranks, one GPU each, an NCCL all-reduce every tick.
    "nccl": r'''
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", NCCL_NVLS_ENABLE="0")
    dist.init_process_group("nccl", rank=r, world_size=2)
    torch.cuda.set_device(r)
    x = torch.ones(1 << 20, device="cuda")
    while True:
        dist.all_reduce(x); torch.cuda.synchronize(); time.sleep(0.05)
if __name__ == "__main__":
    mp.set_start_method("spawn")
    ps = [mp.Process(target=rank, args=(r,)) for r in range(2)]
    [p.start() for p in ps]
    print("READY", flush=True)
    [p.join() for p in ps]
''',
    # A producer shares a GPU tensor with a consumer through CUDA IPC (torch.multiprocessing).
    "ipc": r'''
import time, torch, torch.multiprocessing as mp
def consumer(q):
    t = q.get()
    while True:
        float(t.sum()); time.sleep(0.05)
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q = mp.Queue()
    t = torch.ones(1 << 24, device="cuda")
    p = mp.Process(target=consumer, args=(q,)); p.start(); q.put(t)
    print("READY", flush=True)
    while True:
        t.add_(0); torch.cuda.synchronize(); time.sleep(0.05)
''',
    # Managed (unified) memory through CuPy.
    "uvm": r'''
import time, cupy
cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
x = cupy.ones(1 << 24, dtype=cupy.float32)
print("READY", flush=True)
while True:
    float(x.sum()); time.sleep(0.05)
''',
}


def emit(**data):
    data.update(kind="limit", time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print("RESULT", json.dumps(data), flush=True)
    if os.environ.get("GPUCKPT_RESULTS"):
        with open(os.environ["GPUCKPT_RESULTS"], "a") as fh:
            fh.write(json.dumps(data) + "\n")


def run_case(name, code):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NCCL_NVLS_ENABLE"] = "0"
    # A real file, not -c: spawned workers (torch.multiprocessing) import the main module by path.
    script = tempfile.NamedTemporaryFile("w", suffix="-%s.py" % name, delete=False)
    script.write(code)
    script.close()
    proc = subprocess.Popen([PY, script.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            universal_newlines=True, start_new_session=True)
    line = ""
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if "READY" in line or not line:
            break
    if "READY" not in line:
        os.killpg(proc.pid, signal.SIGKILL)
        emit(case=name, started=False, output=(line + proc.stdout.read())[-1500:])
        os.killpg(proc.pid, signal.SIGKILL)
        return
    time.sleep(5)
    if proc.poll() is not None:
        emit(case=name, started=False, output=proc.stdout.read()[-1500:])
        return
    tree = procfs.process_tree(proc.pid)
    img = tempfile.mkdtemp(prefix="gpuckpt-limit-%s-" % name)
    os.rmdir(img)
    out = {"case": name, "started": True, "pids": tree,
           "unsupported_features": {str(p): gpu_procs.unsupported_features(p) for p in tree},
           "nccl_shm_maps": {str(p): sorted({ln.split()[-1] for ln in open("/proc/%d/maps" % p) if "/dev/shm/" in ln})
                             for p in tree if os.path.exists("/proc/%d/maps" % p)}}
    try:
        res = checkpoint(proc.pid, img, leave_running=True, lock_timeout=20)
        out.update(checkpoint="ok", cuda_pids=res["cuda_pids"], timings=res["timings"])
    except GpuCkptError as exc:
        out.update(checkpoint="failed", stage=exc.stage, error=str(exc)[:600], driver_error=exc.driver_error,
                   rolled_back=exc.rolled_back)
    time.sleep(1)
    out["alive_after"] = [p for p in tree if procfs.alive(p)]
    out["still_running"] = len(out["alive_after"]) == len(tree) and proc.poll() is None
    emit(**out)
    os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["rm", "-rf", img], check=False)


if __name__ == "__main__":
    for name in (sys.argv[1:] or list(CASES)):
        run_case(name, CASES[name])
        time.sleep(2)
