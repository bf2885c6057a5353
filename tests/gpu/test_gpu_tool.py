"""The collection's own cuda-checkpoint tool (roles/cuda_checkpoint/files/cuda_checkpoint.c) against the
real driver: lock/checkpoint/restore/unlock of a PyTorch process, and --device-map onto the other GPU,
with the GPU data checked after each. The binary is the one built on the CI-kind machine (Debian 12,
glibc 2.36) and carried here (Ubuntu 24.04, glibc 2.39): it needs only glibc 2.2.5's symbols."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from gpu_helpers import REPO, gpu_count

TOOL = os.environ.get("GPUCKPT_TOOL") or os.path.join(REPO, ".carry", "gpuckpt-cuda-checkpoint")
pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason="the tool is carried by tests/gpu/prepare_carry.sh")


def _tool(*args):
    t = time.monotonic()
    res = subprocess.run([TOOL] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=600, check=False)
    assert res.returncode == 0, (args, res.returncode, res.stderr)
    return res.stdout.strip(), round(time.monotonic() - t, 4)


def _gpu_of(pid):
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout
    return {int(a.split(",")[0]): a.split(",")[1].strip() for a in out.splitlines() if a.strip()}.get(pid)


def _uuids():
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], stdout=subprocess.PIPE,
                         universal_newlines=True, check=True).stdout
    return [u.strip() for u in out.splitlines() if u.strip()]


def test_own_tool_locks_checkpoints_restores_and_unlocks_a_pytorch_process(torch_workloads, record):
    w = torch_workloads(gib=2)
    pid = w.pid
    assert _tool("--get-state", "--pid", pid)[0] == "running"
    timings = {}
    for action, state in (("lock", "locked"), ("checkpoint", "checkpointed"), ("restore", "locked"),
                          ("unlock", "running")):
        extra = ("--timeout", 30000) if action == "lock" else ()
        _out, timings[action] = _tool("--action", action, "--pid", pid, *extra)
        assert _tool("--get-state", "--pid", pid)[0] == state
        if action == "checkpoint":
            assert _gpu_of(pid) is None, "a checkpointed process holds no GPU memory"
            assert int(_tool("--get-restore-tid", "--pid", pid)[0]) > 0
    before = w.counts()
    w.verified_after(before)
    _out, toggle_off = _tool("--toggle", "--pid", pid)
    assert _tool("--get-state", "--pid", pid)[0] == "checkpointed"
    _out, toggle_on = _tool("--toggle", "--pid", pid)
    w.verified_after(w.counts())
    record("own_tool_cycle", gib=2, seconds=timings, toggle_off_s=toggle_off, toggle_on_s=toggle_on, data_intact=True)


@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
def test_own_tool_restores_onto_the_other_gpu_with_device_map(torch_workloads, record):
    uuids = _uuids()
    w = torch_workloads(gib=2, device=0)
    pid = w.pid
    assert _gpu_of(pid) == uuids[0]
    _tool("--action", "lock", "--pid", pid, "--timeout", 30000)
    _tool("--action", "checkpoint", "--pid", pid)
    # the driver wants every GPU visible to the process named: the two swapped
    _out, secs = _tool("--action", "restore", "--pid", pid, "--device-map",
                       "%s=%s,%s=%s" % (uuids[0], uuids[1], uuids[1], uuids[0]))
    _tool("--action", "unlock", "--pid", pid)
    assert _gpu_of(pid) == uuids[1], "the restored process runs on the other GPU"
    w.verified_after(w.counts())
    record("own_tool_device_map", gib=2, restore_s=secs, from_gpu=uuids[0], to_gpu=uuids[1], data_intact=True)
