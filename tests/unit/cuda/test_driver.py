"""The ctypes driver layer against the libcuda TEST DOUBLE (state machine, error names) and
against a library that lacks the checkpoint API."""
from __future__ import annotations

import ctypes.util
import os
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import driver as cuda
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import gpu_pairs_for
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import facts as host_facts
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import DriverError, DriverUnavailable, InvalidTarget


def test_state_machine_is_enforced(fakecuda, cuda_child):
    drv = cuda.CudaDriver()
    pid = cuda_child
    assert drv.cuda_state(pid) == "running"
    with pytest.raises(DriverError) as exc:
        drv.checkpoint(pid)  # must be locked first
    assert exc.value.name == "CUDA_ERROR_ILLEGAL_STATE" and exc.value.pid == pid
    drv.lock(pid, 1000)
    assert drv.cuda_state(pid) == "locked"
    drv.checkpoint(pid)
    assert drv.cuda_state(pid) == "checkpointed"
    with pytest.raises(DriverError):
        drv.unlock(pid)  # must be restored first
    drv.restore(pid)
    drv.unlock(pid)
    assert drv.cuda_state(pid) == "running"
    moves = [c["call"] for c in drv.calls if c["rc"] == 0 and c["call"] != "cuCheckpointProcessGetState"]
    assert moves == ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
    assert all(c["seconds"] >= 0 for c in drv.calls)


def test_unknown_pid_is_not_a_cuda_process(fakecuda):
    drv = cuda.CudaDriver()
    assert drv.cuda_state(os.getpid()) is None
    with pytest.raises(DriverError) as exc:
        drv.lock(os.getpid())
    assert "CUDA_ERROR_NOT_INITIALIZED" in str(exc.value) and str(os.getpid()) in str(exc.value)
    assert drv.cuda_state(4194303) is None  # no such pid (CUDA_ERROR_OPERATING_SYSTEM)


def test_library_without_checkpoint_api_says_driver_too_old():
    libc = ctypes.util.find_library("c")
    with pytest.raises(DriverUnavailable) as exc:
        cuda.CudaDriver(libc)
    assert "older than 570" in str(exc.value) and "cuCheckpointProcessLock" in str(exc.value)


def test_a_driver_older_than_the_checkpoint_api_is_refused(fakecuda, monkeypatch):
    monkeypatch.setenv("FAKECUDA_API_VERSION", "12040")  # CUDA 12.4: driver 550
    drv, problem = cuda.load()
    assert drv is None and "older than 12.8" in problem.msg and "570" in problem.hint


def test_missing_library_is_reported():
    drv, problem = cuda.load("/nonexistent/libcuda.so.1")
    assert drv is None and "cannot load" in problem.msg


def test_gpu_remap_needs_driver_580(fakecuda, cuda_child):
    drv = cuda.CudaDriver()
    drv.api_version = 12080  # as a 570 driver reports
    with pytest.raises(DriverUnavailable) as exc:
        drv.restore(cuda_child, [("GPU-" + "0" * 32, "GPU-" + "1" * 32)])
    assert "580" in str(exc.value)


def test_uuid_round_trip_and_pairs():
    a = "GPU-5a7e0c1b-1111-2222-3333-444455556666"
    b = "GPU-9f3d2e44-1111-2222-3333-444455556666"
    assert cuda.format_uuid(cuda.parse_uuid(a)) == a
    # Moving GPU a onto b on a two-GPU host: the driver wants both GPUs named, so b goes to a.
    assert gpu_pairs_for({a: b}, [a, b]) == [(a, b), (b, a)]
    with pytest.raises(InvalidTarget):
        gpu_pairs_for({a: "GPU-" + "7" * 32}, [a, b])
    assert gpu_pairs_for(None, [a, b]) is None


def test_lock_timeout_is_passed_in_milliseconds(fakecuda, cuda_child):
    drv = cuda.CudaDriver()
    t = time.monotonic()
    drv.lock(cuda_child, 2500)
    drv.unlock(cuda_child)
    assert time.monotonic() - t < 2


def test_facts_report_an_unexpected_driver_answer_instead_of_failing(fakecuda, cuda_child):
    fakecuda.inject("getstate", cuda_child, 999)
    drv = cuda.CudaDriver()
    with pytest.raises(DriverError):
        drv.cuda_state(cuda_child)  # the engine must not take it for a CPU process
    facts = host_facts.facts(pids=[cuda_child], check_criu=False, tree_of=cuda_child)
    assert facts["cuda_processes"][0]["cuda_state"] == "CUDA_ERROR_UNKNOWN"
    assert facts["tree"]["cuda_states"] == {str(cuda_child): "CUDA_ERROR_UNKNOWN"}
