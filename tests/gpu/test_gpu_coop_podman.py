"""On 2 GPUs: the deterministic 2-rank DDP job in NCCL's default configuration with the helper (tests/workloads/ddp_job.py,
GPUCKPT_DDP_COOP=1, under the helper's torchrun) as a Podman container's init, both GPUs given by the collection's CDI
spec (``--device nvidia.com/gpu=0`` and ``=1``), on the host's network: checkpointed by name through checkpoint.yml in
the cooperative mode, then restored by restore.yml (issue 45 part 3: the job in another runtime's container than runc;
tests/integration/test_cooperative_podman.py runs the same flow on the CPU stand-in). Every loss of both ranks
bit-identical to an uninterrupted run of the same job without the helper, both ranks told to resume, one copy,
nothing frozen. NVLink multicast stays off.

Podman hands CRIU --tcp-established but not --network-lock=nftables, so the job's TCP connections need
iptables-restore, which the GPU machines lack: run with GPUCKPT_CARRIED_IPTABLES=1, Podman carried
(tests/gpu/prepare_docker_carry.sh)."""
from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, gpu_count
from helpers import SKELETON_IMAGE
from test_gpu_cooperative import DDP_JOB, LAUNCHER, NO_MULTICAST, STEPS, Job, _per_rank, _ran_on_intact, _stall
from test_gpu_docker import DRY, PODMAN, _host_mounts, _images, _local_engine, _security, _ulimits, node  # noqa: F401 pylint: disable=unused-import

pytestmark = [pytest.mark.skipif(DRY or gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)"),
              pytest.mark.skipif(PODMAN is None, reason="Podman (tests/gpu/prepare_docker_carry.sh)"),
              pytest.mark.skipif(shutil.which("iptables-restore") is None,
                                 reason="iptables-restore (GPUCKPT_CARRIED_IPTABLES=1 with tests/gpu/run_on_device.sh)")]


class PodmanDdpJob(Job):
    """The job as the init of Podman container ``name``, given both GPUs; its processes found on the host by the job's
    folder."""

    def __init__(self, eng, gpu_kind, directory, pause=0.2):  # pylint: disable=super-init-not-called
        self.dir, self.steps, self.eng = directory, STEPS, eng
        self.log_path = os.path.join(directory, "container.log")
        os.makedirs(directory)
        self.name = "gpuckpt-gdp-" + uuid.uuid4().hex[:8]
        cmd = ["run", "--detach", "--name", self.name, "--network", "host", "--shm-size", "4g",
               "--device", gpu_kind + "=0", "--device", gpu_kind + "=1"] + _security()
        cmd += ["--ulimit=%s=%s" % limit for limit in _ulimits()]
        cmd += ["--mount=type=bind,source=%s,destination=%s,ro,bind-nonrecursive" % (p, p) for p in _host_mounts() + [REPO]]
        cmd += ["--mount=type=bind,source=%s,destination=%s" % (directory, directory)]
        cmd += ["--env=%s=%s" % kv for kv in sorted(dict(NO_MULTICAST, GPUCKPT_DDP_COOP="1").items())]
        argv = [WORKLOAD_PYTHON, LAUNCHER, "--standalone", "--nproc-per-node", "2", DDP_JOB, directory, str(STEPS),
                str(pause)]
        res = eng.cli(*(cmd + [SKELETON_IMAGE] + argv), check=False)
        assert res.returncode == 0, res.stdout[-3000:]
        self.pid = None  # (torchrun's agent has no RANK in its environment)
        deadline = time.monotonic() + 180
        while len(self.ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(self.ranks()) == 2, (self.procs(), eng.logs(self.name))
        self.pid = int(eng.state(self.name)["Pid"])

    def tail(self):
        return self.eng.logs(self.name)


# pylint: disable-next=redefined-outer-name
def test_a_podman_container_of_a_cooperative_ddp_job_is_checkpointed_and_restored(node, playbook, tmp_path, record):  # noqa: F811
    eng = _local_engine("podman", node, tmp_path)
    # The reference first, alone: then nothing else runs on the GPUs while the job is checkpointed.
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0)
    reference.wait_done()
    job = None
    try:
        _images([eng], str(tmp_path))
        job = PodmanDdpJob(eng, node.kind, str(tmp_path / "job"))
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        v = dict(eng.playbook_vars(), gpuckpt_image_dir=str(tmp_path / "img"))
        ck = playbook("gpuckpt.fleet.checkpoint", dict(v, gpuckpt_container=job.name, gpuckpt_runtime="podman",
                                                       gpuckpt_quiesce_mode="cooperative", gpuckpt_quiesce_timeout=60),
                      env=node.env)
        record("gpu_podman_ddp_checkpoint_attempt", rc=ck.rc, tail=ck.stdout[-6000:] if ck.rc else "")
        assert ck.rc == 0, ck.stdout[-8000:]
        c = ck.task("Checkpoint container")
        quiesce = c.get("quiesce") or {}
        assert quiesce.get("mode") == "cooperative" and len(quiesce.get("ranks") or {}) == 2, quiesce
        step = quiesce["step"]
        rs = playbook("gpuckpt.fleet.restore", v, env=node.env)
        record("gpu_podman_ddp_restore_attempt", rc=rs.rc, tail=rs.stdout[-6000:] if rs.rc else "")
        assert rs.rc == 0, rs.stdout[-8000:]
        r = rs.task("Restore from")
        assert r["changed"] is True and len(r.get("cooperative_resumed") or []) == 2, r
        cycles = _ran_on_intact(job, reference, step, procs0)
        record("gpu_podman_ddp", steps=STEPS, losses_identical=True, dump_step=step, quiesce=quiesce,
               checkpoint=c.get("timings"), driver_checkpoint=_per_rank(c, quiesce), image_bytes=c.get("image_bytes"),
               restore=r.get("timings"), frozen_to_running=r["resumed_at"] - c["frozen_at"], stall=_stall(job, step),
               cycles=cycles, ranks_before=ranks0, ranks_after=job.ranks())
    finally:
        if job is not None:
            eng.remove(job.name)
        reference.kill()
        eng.stop()
