"""On 2 GPUs: a plain containerd container (not a pod's) whose init is the helper's torchrun running a deterministic
2-rank DDP job in NCCL's default configuration with the helper (tests/workloads/ddp_job.py, GPUCKPT_DDP_COOP=1), both
GPUs given to it, moved by migrate.yml in the cooperative mode from hosta's containerd to hostb's (the GPU machine's
loopback hosts, each with a containerd 2.1 of its own started over ssh: test_gpu_containerd.py), issue 45 part 3.
Every loss of both ranks bit-identical to an uninterrupted run of the same job without the helper, both ranks told to
resume, one copy afterwards (the task running on hostb, no container left on hosta), nothing frozen. NVLink multicast
stays off.

containerd's runc cannot be handed CRIU's --network-lock=nftables, so the job's TCP connections need iptables-restore,
which the GPU machines lack: run with GPUCKPT_CARRIED_IPTABLES=1 (tests/gpu/prepare_carry.sh carries bookworm's)."""
from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, gpu_count
from test_gpu_containerd import containerd_hosts  # noqa: F401 pylint: disable=unused-import
from test_gpu_containerd import NAMESPACE, available, container_exists, start_containerds, start_task, stop_containerds, task_status
from test_gpu_coop_migrate import _floors, _states
from test_gpu_cooperative import DDP_JOB, LAUNCHER, NO_MULTICAST, STEPS, Job, _ran_on_intact, _stall, ddp_container_spec
from test_gpu_migrate import PASS_ENV

pytestmark = [pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)"),
              pytest.mark.skipif(not available(), reason="containerd 2.x and grpcio (tests/gpu/install_tools.sh)"),
              pytest.mark.skipif(shutil.which("iptables-restore") is None,
                                 reason="iptables-restore (GPUCKPT_CARRIED_IPTABLES=1 with tests/gpu/run_on_device.sh)")]


class ContainerdDdpJob(Job):
    """The job as the init of containerd task ``id`` on hosta; its processes are found on the host by the job's
    folder (the same on either host: one machine)."""

    def __init__(self, hosts, daemons, directory, pause=0.3):  # pylint: disable=super-init-not-called
        self.dir, self.steps, self.hosts, self.daemons = directory, STEPS, hosts, daemons
        self.id = "gpuckpt-cddp-" + uuid.uuid4().hex[:8]
        self.log_path = os.path.join(directory, "container.log")
        os.makedirs(directory)
        env = dict(PASS_ENV, GPUCKPT_DDP_COOP="1", **NO_MULTICAST)
        args = [WORKLOAD_PYTHON, LAUNCHER, "--standalone", "--nproc-per-node", "2", DDP_JOB, directory, str(STEPS),
                str(pause)]
        start_task(hosts, daemons["hosta"], self.id, args, env, {REPO: "ro", directory: "rw"}, self.log_path,
                   spec_edit=ddp_container_spec)
        # (torchrun's agent has no RANK in its environment: Job.ranks needs no pid of it)
        self.pid = None
        deadline = time.monotonic() + 120
        while len(self.ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(self.ranks()) == 2, (self.procs(), self.tail())

    def status(self, host):
        return task_status(self.daemons[host], self.id)

    def exists(self, host):
        return container_exists(self.daemons[host], self.id)


def test_a_containerd_container_of_a_cooperative_ddp_job_migrates_to_the_other_host(  # noqa: F811
        playbook, containerd_hosts, tmp_path, record):  # pylint: disable=redefined-outer-name
    # The reference runs first, alone: the preflight bounds the job's GPU memory by its GPUs' used memory only where
    # no other process runs there (test_gpu_coop_drain.py).
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0)
    reference.wait_done()
    daemons = start_containerds(containerd_hosts)
    job = None
    try:
        job = ContainerdDdpJob(containerd_hosts, daemons, str(tmp_path / "job"))
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        v = {"source": "hosta", "target": "hostb", "container": job.id, "runtime": "containerd",
             "containerd_namespace": NAMESPACE, "migration_id": "ddp-containerd", "quiesce_mode": "cooperative",
             "gpuckpt_quiesce_timeout": 60, "gpuckpt_runtime_timeout": 300}
        t = time.monotonic()
        run = playbook("gpuckpt.fleet.migrate", v, inventory=containerd_hosts.path("inventory.yml"))
        wall = round(time.monotonic() - t, 3)
        record("coop_containerd_migrate_attempt", rc=run.rc, wall=wall, tail=run.stdout[-6000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        ck, sy, rs = run.task("Stage 1/3"), run.task("Stage 2/3"), run.task("Restore on hostb")
        quiesce = ck.get("quiesce") or {}
        assert quiesce.get("mode") == "cooperative" and len(quiesce.get("ranks") or {}) == 2, quiesce
        assert len(rs.get("cooperative_resumed") or []) == 2, rs
        step = quiesce["step"]
        assert job.status("hostb") == "RUNNING" and not job.exists("hosta"), (job.status("hostb"), job.exists("hosta"))
        assert all(s != "T" for s in _states(job.procs()).values()), _states(job.procs())
        downtime = round(rs["resumed_at"] - ck["frozen_at"], 3)
        record("coop_containerd_migrate_result", wall=wall, quiesce=quiesce, checkpoint=ck.get("timings"),
               restore=rs.get("timings"), image_bytes=ck.get("image_bytes"), cuda_pids=ck.get("cuda_pids"),
               downtime=downtime, floors=_floors(ck, sy, rs, quiesce), processes=len(procs0), ranks_before=ranks0,
               ranks_after=job.ranks(), summary=run.task("Summary").get("msg"))
        cycles = _ran_on_intact(job, reference, step, procs0)
        record("coop_containerd", steps=STEPS, losses_identical=True, dump_step=step, downtime=downtime,
               stall=_stall(job, step), cycles=cycles)
    finally:
        if job is not None:
            job.kill()
        reference.kill()
        stop_containerds(containerd_hosts, daemons)
