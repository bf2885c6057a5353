"""The engine's checkpoint steps and their undos, and the restore's clean-up, WITHOUT CRIU and without
a driver: a TEST DOUBLE backend (tests/unit/conftest.py's RecordingBackend: it records what it is asked) and a
TEST DOUBLE driver (the checkpoint API's state machine, per pid) share one log of calls. The workload's processes
are real sleeping processes (the plan reads their /proc), which the doubles never touch.

What a user relies on: a checkpoint that fails at any step undoes what it did, newest first, and leaves
the workload running (its GPU state running again); a restore that fails stops what it brought up."""
from __future__ import annotations

import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget, TransactionError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore


pytestmark = pytest.mark.usefixtures("no_host_facts")


def _frozen_and_checkpointed(b, c):
    return [("lock", b), ("lock", c), ("checkpoint", b), ("checkpoint", c)]


def _gpu_given_back(b, c):
    return [("restore", b), ("restore", c), ("unlock", b), ("unlock", c)]


# (step made to fail, how the workload is left, what the doubles are told to fail, the calls expected)
CASES = {
    "quiesce": ("exit", {"probe_rc": 1}, lambda a, b, c: [("quiesce",)]),
    "cuda_lock": ("exit", {"drv_fail": [("lock", "c")]}, lambda a, b, c: [("lock", b), ("lock", c), ("unlock", b)]),
    "cuda_checkpoint": ("exit", {"drv_fail": [("checkpoint", "c")]},
                        lambda a, b, c: _frozen_and_checkpointed(b, c) + [("restore", b), ("unlock", b), ("unlock", c)]),
    "runtime_dump": ("exit", {"backend_fail": ["dump"]},
                     lambda a, b, c: _frozen_and_checkpointed(b, c) + [("dump", "exit")] + _gpu_given_back(b, c)),
    "manifest_after_exit": ("exit", {}, lambda a, b, c: _frozen_and_checkpointed(b, c) + [
        ("dump", "exit"), ("runtime_restore",)] + _gpu_given_back(b, c)),
    "manifest_after_stopped": ("stopped", {}, lambda a, b, c: _frozen_and_checkpointed(b, c) + [
        ("dump", "stopped"), ("resume", sorted([a, b, c]))] + _gpu_given_back(b, c)),
    # leave_running gave the GPU back before the manifest: the undos must not give it back twice
    "manifest_after_running": ("running", {}, lambda a, b, c: _frozen_and_checkpointed(b, c) + [
        ("dump", "running")] + _gpu_given_back(b, c)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_step_undoes_the_steps_done_newest_first_and_the_workload_runs_on(case, workload, tmp_path, monkeypatch, doubles):
    after, fail, expected = CASES[case]
    root, b, c = workload
    named = {"b": b, "c": c}
    if "drv_fail" in fail:
        fail = dict(fail, drv_fail=[(call, named[who]) for call, who in fail["drv_fail"]])
    log, drv, backend = doubles(**fail)
    if case.startswith("manifest"):
        def no_room(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(image, "write_manifest", no_room)
    image_dir = str(tmp_path / "img")
    options = {"quiesce_command": ["release-caches"]} if case == "quiesce" else {}
    with pytest.raises(TransactionError) as err:
        checkpoint(root, image_dir, backend=backend, parallel=False, leave_running=after == "running",
                   leave_stopped=after == "stopped", **options)
    assert log == expected(root, b, c)
    assert err.value.rolled_back is True
    assert "the workload was rolled back and runs on; no image was kept" in err.value.msg, err.value.msg
    assert drv.states == {b: "running", c: "running"}, "every CUDA process runs again"
    assert not os.path.exists(image_dir), "the partial image was removed"


def test_a_failed_undo_is_reported_and_the_other_undos_still_run(workload, tmp_path, doubles):
    """The dump fails, and so does the GPU's restore of a process: the unlocks are still tried, the
    partial image is still removed, and the error says the rollback is incomplete (the workload may be
    frozen), naming the undo that failed."""
    root, b, c = workload
    log, drv, backend = doubles(backend_fail=["dump"])
    drv.fail.add(("restore", b))
    image_dir = str(tmp_path / "img")
    with pytest.raises(TransactionError) as err:
        checkpoint(root, image_dir, backend=backend, parallel=False)
    undos = log[log.index(("dump", "exit")) + 1:]
    assert undos[0] == ("restore", b) and ("unlock", b) in undos, "the unlocks ran after the failed restore"
    assert err.value.rolled_back is False
    assert "ROLLBACK INCOMPLETE, the workload may be frozen: undo of cuda_checkpoint: " \
           "cuCheckpointProcessRestore for pid %d failed: CUDA_ERROR_TEST (999); undo of cuda_lock" % b in err.value.msg
    assert not os.path.exists(image_dir)


def test_parallel_driver_calls_undo_exactly_the_pids_done(workload, tmp_path, doubles):
    """One thread per pid: one checkpoint fails, the other is done; the undo restores only the one done."""
    root, b, c = workload
    log, drv, backend = doubles(drv_fail=[("checkpoint", c)])
    with pytest.raises(TransactionError) as err:
        checkpoint(root, str(tmp_path / "img"), backend=backend, parallel=True)
    assert [e for e in log if e[0] == "restore"] == [("restore", b)]
    assert err.value.stage == "checkpoint" and err.value.pid == c, err.value.msg
    assert drv.states == {b: "running", c: "running"}


def test_a_refusal_in_the_plan_touches_nothing(workload, tmp_path, doubles, recording_backend):
    """leave_stopped on a runtime that cannot hold a workload stopped: refused before anything is done."""
    root, b, c = workload
    log, drv, backend = doubles(capabilities=recording_backend.capabilities._replace(can_hold_stopped=False))
    with pytest.raises(InvalidTarget) as err:
        checkpoint(root, str(tmp_path / "img"), backend=backend, leave_stopped=True)
    assert "cannot hold a workload stopped" in err.value.msg
    assert log == [] and not os.path.exists(str(tmp_path / "img"))


def test_a_restore_gives_the_gpu_back_to_every_process_then_unlocks(workload, tmp_path, doubles, recording_backend, checkpointed_image):
    root, b, c = workload
    image_dir, drv = checkpointed_image()
    log = []
    backend = recording_backend(log, workload, drv)
    drv.log = log
    res = restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0)
    assert log == [("runtime_restore",)] + _gpu_given_back(b, c)
    assert res["pids"] == workload and res["cuda_pids"] == [b, c] and res["validation_notes"] == []
    assert res["gpu_pairs"] is None and res["probe"] is None and res["resumed_at"] > 0
    assert set(res["timings"]) >= {"runtime_restore", "cuda_restore", "cuda_unlock", "validate"}


@pytest.mark.parametrize("where", ["cuda_restore", "probe"])
def test_a_failed_restore_kills_what_it_brought_up(workload, tmp_path, where, doubles, recording_backend, checkpointed_image):
    """The GPU restore of one process fails, or the user's probe does: what the runtime brought up is
    killed, nothing was unlocked (no restored copy ever ran), and the image is kept to try again."""
    root, b, c = workload
    image_dir, drv = checkpointed_image()
    log = []
    backend = recording_backend(log, workload, drv, probe_rc=1 if where == "probe" else 0)
    drv.log = log
    if where == "cuda_restore":
        drv.fail.add(("restore", c))
    with pytest.raises(TransactionError) as err:
        restore(image_dir, backend=backend, parallel=False, validate_wait=0, pid_wait=0,
                probe_command=["healthy?"] if where == "probe" else None)
    assert log[0] == ("runtime_restore",) and log[-1] == ("kill", sorted(workload))
    assert not [e for e in log if e[0] == "unlock"]
    assert err.value.rolled_back is True and "what was brought up was stopped, the image is untouched" in err.value.msg
    assert image.has_manifest(image_dir)


def test_a_restore_of_host_pids_refuses_while_the_original_still_runs(workload, tmp_path, doubles, recording_backend, checkpointed_image):
    """A runtime that restores the dumped pids themselves (a bare process tree) must not start a second
    copy beside the original (a checkpoint with leave_running): refused before anything is restored."""
    image_dir, drv = checkpointed_image()
    log = []
    backend = recording_backend(log, workload, drv,
                                capabilities=recording_backend.capabilities._replace(restores_host_pids=True))
    with pytest.raises(InvalidTarget) as err:
        restore(image_dir, backend=backend, pid_wait=0)
    assert "refusing to start a second copy" in err.value.msg and err.value.pid == workload[0]
    assert log == []
