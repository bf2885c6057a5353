"""A Podman container, checkpointed and restored through the playbooks: real Podman 4.3.1 driving
real CRIU 4.1.1, its checkpoint exported into the image dir. Inside the container a parent and a
child count and hold a memory pattern, registered with the libcuda TEST DOUBLE, so the CUDA stage runs
on the container's host pids as it does on a GPU node."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from helpers import (COUNTER, FAKE_LIBCUDA, CountingWorkload, alive, podman_run_args, podman_skeleton, tree,
                     unmount_podman_storage)

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
PODMAN = shutil.which("podman")
pytestmark = pytest.mark.skipif(PODMAN is None, reason="podman is not installed (tests/setup.sh installs it)")


class PodmanWorkload(CountingWorkload):
    roles = ("parent", "child1")

    def __init__(self, base, fakecuda):
        self.base, self.dir = base, os.path.join(base, "w")
        self.runroot = tempfile.mkdtemp(prefix="gpk-", dir="/tmp")  # podman wants it under 50 characters
        self.storage = ["--root", os.path.join(base, "storage"), "--runroot", self.runroot]
        self.name = "gpuckpt-p-" + uuid.uuid4().hex[:8]
        os.makedirs(self.dir, exist_ok=True)
        image = podman_skeleton(self.storage, tmpdir=base)
        self.podman(*podman_run_args(self.name, image, ["/usr/bin/python3", COUNTER, "--dir", self.dir, "--mb", "8",
                                                        "--fakecuda", FAKE_LIBCUDA],
                                     env=["%s=%s" % kv for kv in fakecuda.env.items()],
                                     rw=[self.dir, fakecuda.state_dir]))
        self.wait_counting()

    def podman(self, *args, check=True):
        return subprocess.run([PODMAN] + self.storage + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, check=check)

    def state(self):
        res = self.podman("container", "inspect", "--format", "json", self.name, check=False)
        return json.loads(res.stdout)[0]["State"] if res.returncode == 0 else None

    def host_pids(self):
        return tree(int(self.state()["Pid"]))

    def stop(self):
        self.podman("container", "rm", "--force", self.name, check=False)
        unmount_podman_storage(self.storage[1])
        shutil.rmtree(self.runroot, ignore_errors=True)


@pytest.fixture
def podman_workload(tmp_path, fakecuda):
    made = []

    def make():
        w = PodmanWorkload(str(tmp_path / ("p%d" % len(made))), fakecuda)
        made.append(w)
        return w
    yield make
    for w in made:
        w.stop()


def _vars(w, image_dir, **extra):
    v = {"gpuckpt_image_dir": image_dir, "gpuckpt_podman_root": w.storage[1], "gpuckpt_podman_runroot": w.storage[3]}
    v.update(extra)
    return v


def _ckpt(playbook, fakecuda, w, image_dir, **extra):
    return playbook(CHECKPOINT, _vars(w, image_dir, gpuckpt_container=w.name, gpuckpt_runtime="podman", **extra),
                    env=fakecuda.env)


def _restore(playbook, fakecuda, w, image_dir):
    return playbook(RESTORE, _vars(w, image_dir), env=fakecuda.env)


def test_podman_checkpoint_then_restore_counts_on_with_memory_intact(tmp_path, playbook, podman_workload, fakecuda):
    w = podman_workload()
    host_pids = w.host_pids()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint container")
    assert res["changed"] is True and res["gpu_stage"] == "done"
    assert sorted(res["cuda_pids"]) == sorted(host_pids)  # the driver is called with host pids
    assert os.path.getsize(os.path.join(image_dir, "container.tar")) > 8 * 2**20
    assert w.state() is None, "the exported container is removed: the image is the container now"
    assert not any(alive(p) for p in host_pids)
    stopped_at = w.counts()

    again = _ckpt(playbook, fakecuda, w, image_dir)
    assert again.rc == 0 and again.task("Checkpoint container")["changed"] is False

    run = _restore(playbook, fakecuda, w, image_dir)
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and sorted(rs["cuda_pids"]) == sorted(w.host_pids())
    assert w.state()["Status"] == "running"
    assert all(fakecuda.state(p) == "running" for p in rs["cuda_pids"])
    w.went_on_intact(stopped_at)
    assert not [f for f in os.listdir(w.dir) if f.endswith(".corrupt")]
    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc == 0 and second.task("Restore from")["changed"] is False


def test_podman_leave_running_and_a_restore_beside_it_is_refused(tmp_path, playbook, podman_workload, fakecuda):
    w = podman_workload()
    image_dir = str(tmp_path / "img")
    run = _ckpt(playbook, fakecuda, w, image_dir, gpuckpt_leave_running=True)
    assert run.rc == 0, run.stdout
    assert w.state()["Status"] == "running" and w.is_counting()
    second = _restore(playbook, fakecuda, w, image_dir)
    assert second.rc != 0
    assert "already exists on this host (running); refusing to start a second copy" in \
        second.task("Restore from")["msg"]
    assert w.is_counting()


def test_podman_cannot_be_held_stopped_and_says_so_before_freezing(tmp_path, podman_workload, fakecuda):
    """Podman checkpoints only running containers, so leave_stopped is refused in preflight."""
    w = podman_workload()
    image_dir = str(tmp_path / "img")
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.podman import PodmanBackend
    backend = PodmanBackend(root=w.storage[1], runroot=w.storage[3])
    with pytest.raises(InvalidTarget) as err:
        checkpoint(w.name, image_dir, leave_stopped=True, backend=backend)
    assert err.value.stage == "preflight" and "cannot hold a workload stopped" in err.value.msg
    assert not [c for c, p in fakecuda.calls() if c == "lock"] and not os.path.exists(image_dir)
    assert w.is_counting()


def test_unknown_podman_container_is_refused(tmp_path, playbook, podman_workload, fakecuda):
    w = podman_workload()
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, _vars(w, image_dir, gpuckpt_container="nope", gpuckpt_runtime="podman"),
                   env=fakecuda.env)
    assert run.rc != 0
    res = run.task("Checkpoint container")
    assert res["stage"] == "preflight" and "no podman container 'nope'" in res["msg"]
    assert not os.path.exists(image_dir) and w.is_counting()
