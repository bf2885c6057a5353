"""GPU-machine helpers: the PyTorch workload, nvidia-smi, the raw driver floor."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from helpers import CountingWorkload  # noqa: E402
REPO = os.path.dirname(os.path.dirname(HERE))
TORCH_COUNTER = os.path.join(REPO, "tests", "workloads", "torch_counter.py")
RAW_DRIVER = os.path.join(REPO, "bench", "raw_driver.py")
WORKLOAD_PYTHON = os.environ.get("GPUCKPT_WORKLOAD_PYTHON", "python3")


def _clean_env():
    # The carried wheels (PYTHONPATH) are for ansible and pytest, not for the PyTorch workload.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUCKPT_LIBCUDA")}


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout
        return len([ln for ln in out.splitlines() if ln.startswith("GPU ")])
    except OSError:
        return 0


def nvidia_smi_pids():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout
    return {int(a.split(",")[0]): int(a.split(",")[1]) for a in out.splitlines() if a.strip()}


class TorchWorkload(CountingWorkload):
    count_timeout = 120

    def __init__(self, directory, gib, children=0, device=0, verify_every=1.0, cache_gib=0, quiesce=False):
        self.dir = directory
        cmd = [WORKLOAD_PYTHON, TORCH_COUNTER, "--dir", directory, "--gib", str(gib), "--children", str(children),
               "--device", str(device), "--daemon", "--verify-every", str(verify_every), "--cache-gib", str(cache_gib)]
        cmd += ["--quiesce"] if quiesce else []
        t = time.monotonic()
        out = subprocess.run(cmd, stdout=subprocess.PIPE, env=_clean_env(), universal_newlines=True, timeout=900, check=False)
        if not out.stdout.strip():
            log = open(os.path.join(directory, "workload.log")).read() if os.path.exists(
                os.path.join(directory, "workload.log")) else ""
            raise AssertionError("torch workload did not start:\n" + log[-3000:])
        self.fill_seconds = time.monotonic() - t
        self.pid = int(out.stdout.strip())
        self.gib = gib
        self.roles = ["parent"] + ["child%d" % (i + 1) for i in range(children)]
        self.wait_counting()
        self.pids = sorted(p["pid"] for p in (self.read(r) for r in self.roles))

    def verified_after(self, counts, timeout=180):
        """Wait for a GPU checksum taken after ``counts`` and compare it with the one taken at fill time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = {r: self.read(r) for r in self.roles}
            if all(st[r]["digest_count"] > counts[r] for r in self.roles):
                for r in self.roles:
                    assert st[r]["digest"] == self.digest0(r), "GPU memory of %s changed" % r
                assert not [f for f in os.listdir(self.dir) if f.endswith(".corrupt")]
                return True
            time.sleep(0.1)
        raise AssertionError("no GPU checksum after restore within %ss" % timeout)

    def alive(self):
        out = []
        for p in self.pids:
            try:
                with open("/proc/%d/stat" % p) as fh:
                    d = fh.read()
                if d[d.rindex(")") + 2] not in "ZX":
                    out.append(p)
            except OSError:
                pass
        return out

    def kill(self):
        for p in self.pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def raw_driver(pids, cycles=1):
    out = subprocess.run([sys.executable, RAW_DRIVER] + [str(p) for p in pids] + ["--cycles", str(cycles)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
