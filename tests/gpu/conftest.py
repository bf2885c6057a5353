"""GPU-machine fixtures: a PyTorch workload on the real GPU, results recorded for docs/benchmarks."""
from __future__ import annotations

import json
import os
import time

import pytest

from gpu_helpers import TorchWorkload, gpu_count


@pytest.fixture(autouse=True, scope="session")
def _need_gpu():
    if gpu_count() == 0:
        pytest.skip("no NVIDIA GPU on this machine: the GPU suite runs on the GPU machine (tests/gpu/run_on_device.sh)")


@pytest.fixture
def torch_workloads(tmp_path):
    started = []

    def start(name="tw", **kw):
        w = TorchWorkload(str(tmp_path / name), **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
    time.sleep(1)


@pytest.fixture
def record():
    path = os.environ.get("GPUCKPT_RESULTS")

    def add(kind, **data):
        data["kind"] = kind
        data["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps(data) + "\n")
        print("RESULT", json.dumps(data))
    return add
