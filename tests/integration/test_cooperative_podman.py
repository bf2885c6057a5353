"""The cooperative 2-rank stand-in job (tests/workloads/coop_ddp_job.py under the helper's torchrun, gloo, the libcuda
TEST DOUBLE) as a Podman container's init (issue 45 part 3: the job in another runtime's container than runc):
checkpointed by name through checkpoint.yml with quiesce_mode=cooperative, then restored by restore.yml; real Podman
driving real CRIU. The container has a network namespace of its own (loopback only): the rendezvous and the ranks'
connections are all inside it, so Podman is handed --tcp-established without the user naming it.

It ends with one copy (the launcher and its 2 ranks), both ranks told to resume and counting on from the step they
released at, every step logged once, the stand-in GPU memory intact, nothing locked."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid

import pytest

from helpers import REPO, alive, podman_run_args, podman_skeleton, unmount_podman_storage
from test_cooperative import GLOO, JOB, LAUNCHER, CoopJob
from test_podman import PodmanWorkload

PODMAN = shutil.which("podman")
pytestmark = [pytest.mark.skipif(PODMAN is None, reason="podman is not installed (tests/setup.sh installs it)"),
              pytest.mark.skipif(not GLOO, reason="PyTorch with gloo is not installed (tests/requirements.txt)")]


class PodmanCoopJob(CoopJob):
    """The stand-in job under the helper's torchrun as a Podman container's init, its logs in ``base``/job. The checks
    are CoopJob's; its launcher is the container's init, whose host pid a restore changes."""

    podman, state = PodmanWorkload.podman, PodmanWorkload.state  # (the container's CLI and its State, by name)

    def __init__(self, base, fakecuda, network="host"):  # pylint: disable=super-init-not-called
        self.dir, self.fakecuda, self.tag = os.path.join(base, "job"), fakecuda, "pc-" + uuid.uuid4().hex[:6]
        os.makedirs(self.dir)
        self.runroot = tempfile.mkdtemp(prefix="gpk-", dir="/tmp")  # (Podman wants it under 50 characters)
        self.storage = ["--root", os.path.join(base, "storage"), "--runroot", self.runroot]
        self.name = "gpuckpt-pc-" + uuid.uuid4().hex[:8]
        image = podman_skeleton(self.storage, tmpdir=base)
        cmd = [sys.executable, LAUNCHER, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", JOB,
               self.dir, fakecuda.lib, self.tag, "0.05"]
        # (torchrun's agent makes its log folder with tempfile: in the job's own folder)
        env = ["%s=%s" % kv for kv in sorted(dict(fakecuda.env, TMPDIR=self.dir).items())]
        args = podman_run_args(self.name, image, cmd, env=env, rw=[self.dir, fakecuda.state_dir])
        args[args.index("--network") + 1] = network
        if not os.path.realpath(sys.prefix).startswith(REPO + os.sep):  # (a venv outside the repo: bound too)
            args[args.index(image):args.index(image)] = ["--volume", "%s:%s:ro" % (sys.prefix, sys.prefix)]
        res = self.podman(*args, check=False)
        assert res.returncode == 0, res.stderr
        self.wait(lambda: all(len(self.steps(r)) > 3 for r in range(2)), 120, "the ranks to train")

    @property
    def host_pid(self):
        """The launcher's host pid: the container's init (0 while there is no container)."""
        return int((self.state() or {}).get("Pid") or 0)

    def said(self):
        logs = self.podman("logs", "--tail", "80", self.name, check=False)
        return logs.stdout + logs.stderr

    def stop(self):
        self.podman("container", "rm", "--force", "--time", "0", self.name, check=False)
        self.podman("image", "prune", "--force", check=False)
        unmount_podman_storage(self.storage[1])
        shutil.rmtree(self.runroot, ignore_errors=True)


def test_a_podman_container_of_a_cooperative_job_is_checkpointed_and_restored(tmp_path, playbook, fakecuda):
    job = PodmanCoopJob(str(tmp_path), fakecuda)
    try:
        job.check()
        pids = [job.host_pid] + job.ranks()
        image_dir = str(tmp_path / "img")
        v = {"gpuckpt_image_dir": image_dir, "gpuckpt_podman_root": job.storage[1],
             "gpuckpt_podman_runroot": job.storage[3], "gpuckpt_quiesce_mode": "cooperative",
             "gpuckpt_quiesce_timeout": 30}
        run = playbook("gpuckpt.fleet.checkpoint", dict(v, gpuckpt_container=job.name, gpuckpt_runtime="podman"),
                       env=fakecuda.env)
        assert run.rc == 0, run.stdout[-6000:]
        res = run.task("Checkpoint container")
        q = res.get("quiesce") or {}
        assert res["changed"] is True and q.get("mode") == "cooperative" and len(q.get("ranks") or {}) == 2, res
        step = q["step"]
        assert {r["step"] for r in q["ranks"].values()} == {step}, q
        with open(os.path.join(image_dir, "manifest.json")) as fh:
            manifest = json.load(fh)
        assert "--tcp-established" in manifest["runtime"]["auto_flags"], manifest["runtime"]
        assert job.state() is None and not [p for p in pids if alive(p)], "the exported container is the image now"
        assert job.last() == [step, step], (job.last(), step)

        run = playbook("gpuckpt.fleet.restore", v, env=fakecuda.env)
        assert run.rc == 0, run.stdout[-6000:]
        rs = run.task("Restore from")
        assert rs["changed"] is True and len(rs.get("cooperative_resumed") or []) == 2, rs
        assert job.state()["Status"] == "running"
        job.counting_on([step, step], timeout=60)
        assert all([c["resumed_by"] for c in job.cycles(r)] == ["resume"] for r in range(2)), \
            [job.cycles(r) for r in range(2)]
        job.check()
    finally:
        job.stop()


def test_a_podman_container_of_the_job_on_network_none_is_refused_before_anything(tmp_path, playbook, fakecuda):
    """Podman 4.3.1 restores a container of network mode none into a namespace whose loopback is down, where CRIU
    cannot connect the job's TCP connections again (seen here: "Network is unreachable"): refused at the plan, before
    anything is asked or frozen, and the job counts on."""
    job = PodmanCoopJob(str(tmp_path), fakecuda, network="none")
    try:
        before = job.last()
        run = playbook("gpuckpt.fleet.checkpoint", {
            "gpuckpt_image_dir": str(tmp_path / "img"), "gpuckpt_podman_root": job.storage[1],
            "gpuckpt_podman_runroot": job.storage[3], "gpuckpt_quiesce_mode": "cooperative",
            "gpuckpt_container": job.name, "gpuckpt_runtime": "podman"}, env=fakecuda.env)
        res = run.task("Checkpoint container")
        assert run.rc != 0 and "network mode none" in res["msg"] and "nothing was frozen" in res["msg"], res
        assert not [c for c in fakecuda.calls() if c[0] == "lock"], fakecuda.calls()
        assert not any(job.cycles(r) for r in range(2)), "the ranks were never asked"
        job.counting_on(before, timeout=60)
        job.check()
    finally:
        job.stop()
