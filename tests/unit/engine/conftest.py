"""The engine's TEST DOUBLES, shared by its unit tests as fixtures: a driver double (the checkpoint API's state
machine, per pid), three real sleeping processes as the workload, and the RecordingBackend runtime double of
tests/unit/conftest.py over them, all sharing one log of calls."""
from __future__ import annotations

import subprocess

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import DriverError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import plan
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint


class FakeDriver(object):
    """TEST DOUBLE of the driver's checkpoint API: running -> locked -> checkpointed -> locked -> running.
    ``fail``: {(call, pid)} that raise the driver's error instead."""

    def __init__(self, log, cuda_pids, fail=()):
        self.log, self.fail = log, set(fail)
        self.states = {p: "running" for p in cuda_pids}
        self.calls, self.api_version = [], 12080

    def _call(self, call, pid, want, then):
        self.log.append((call, pid))
        if (call, pid) in self.fail:
            raise DriverError("cuCheckpointProcess" + call.title(), 999, "CUDA_ERROR_TEST", pid=pid, stage=call)
        if self.states[pid] != want:  # as the driver answers a call out of order
            raise DriverError("cuCheckpointProcess" + call.title(), 401, "CUDA_ERROR_ILLEGAL_STATE", pid=pid, stage=call)
        self.states[pid] = then

    def cuda_state(self, pid):
        return self.states.get(pid)

    def device_uuids(self):
        return []

    def lock(self, pid, timeout_ms):
        self._call("lock", pid, "running", "locked")

    def checkpoint(self, pid):
        self._call("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid, gpu_pairs=None):
        self._call("restore", pid, "checkpointed", "locked")

    def unlock(self, pid):
        self._call("unlock", pid, "locked", "running")


@pytest.fixture
def workload():
    """Three real sleeping processes: the root and two CUDA processes (as the driver double says)."""
    procs = [subprocess.Popen(["sleep", "60"]) for unused in range(3)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def no_host_facts(monkeypatch):
    monkeypatch.setattr(plan, "host_facts", lambda drv=None: {"hostname": "test"})


@pytest.fixture
def doubles(workload, recording_backend):
    """Makes the driver and runtime doubles over ``workload``, sharing one log: (log, driver, backend).
    ``backend_class``: a RecordingBackend subclass to make instead."""
    def make(drv_fail=(), backend_fail=(), probe_rc=0, capabilities=None, backend_class=recording_backend):
        log = []
        root, b, c = workload
        drv = FakeDriver(log, [b, c], drv_fail)
        return log, drv, backend_class(log, workload, drv, backend_fail, probe_rc, capabilities)
    return make


@pytest.fixture
def gpu_given_back():
    """The driver calls of a restore that gives both CUDA processes (b, c) their GPU back, then unlocks them."""
    return lambda b, c: [("restore", b), ("restore", c), ("unlock", b), ("unlock", c)]


@pytest.fixture
def checkpointed_image(doubles, workload, tmp_path):
    """Makes an image of ``workload`` through the doubles: (image_dir, driver), both CUDA processes checkpointed."""
    def make():
        root, b, c = workload
        unused_log, drv, backend = doubles()
        image_dir = str(tmp_path / "img")
        res = checkpoint(root, image_dir, backend=backend, parallel=False)
        assert res["changed"] and res["cuda_pids"] == [b, c]
        assert drv.states == {b: "checkpointed", c: "checkpointed"}
        return image_dir, drv
    return make
