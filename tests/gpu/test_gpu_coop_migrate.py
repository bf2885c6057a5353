"""migrate.yml moves a deterministic 2-rank DDP job (tests/workloads/ddp_job.py under the helper's torchrun) between
the GPU machine's loopback hosts (sshd on 127.0.0.2 / 127.0.0.3, one pid space, real ssh, rsync and CRIU), issue 45
part 3: in the cooperative mode (NCCL's defaults, the helper, quiesce_mode=cooperative) and in the configuration mode
(NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0 NCCL_CUMEM_HOST_ENABLE=0, no helper); drain.yml in test_gpu_coop_drain.py. Every loss of
both ranks bit-identical to an uninterrupted run of the same configuration, one copy after
it (the source gone), nothing frozen. Records the downtime against its floors (each rank's driver checkpoint,
the transfer, each rank's driver restore). NVLink multicast stays off in every job."""
from __future__ import annotations

import os
import shlex
import sys
import time

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, gpu_count
from test_gpu_cooperative import CONFIG, DDP_JOB, LAUNCHER, NO_MULTICAST, STEPS, Job, _per_rank, _same_losses, _stall
from test_gpu_migrate import PASS_ENV

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import LoopbackHosts  # noqa: E402

pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)")
# GPUCKPT_TEST_THP=1: transparent huge pages "always" while each operation runs (the modules' host_huge_pages)
THP = os.environ.get("GPUCKPT_TEST_THP") == "1"
MODES = {"cooperative": ({"GPUCKPT_DDP_COOP": "1"}, True), "config": (dict(CONFIG, USE_LIBUV="0"), False)}


@pytest.fixture
def gpu_hosts(tmp_path):
    env = dict(PASS_ENV, **NO_MULTICAST)
    hv = {n: {"gpuckpt_environment": env} for n in ("hosta", "hostb")}
    h = LoopbackHosts(str(tmp_path / "hosts"), pid_namespaces=False, python=WORKLOAD_PYTHON).start(hv)
    yield h
    h.stop()
    time.sleep(1)


class RemoteJob(Job):
    """ddp_job.py under the helper's torchrun, started on a loopback host through ssh (its own session there)."""

    def __init__(self, hosts, host, directory, mode, steps=STEPS, pause=0.1):
        self.dir, self.steps = directory, steps
        os.makedirs(directory)
        extra, coop = MODES[mode]
        env = dict(PASS_ENV, **NO_MULTICAST)
        env.update(extra)
        env.setdefault("GPUCKPT_DDP_COOP", "1" if coop else "0")
        self.log_path = os.path.join(directory, "torchrun.log")
        pid_file = os.path.join(directory, "launcher.pid")
        argv = [WORKLOAD_PYTHON, LAUNCHER, "--standalone", "--nproc-per-node", "2", DDP_JOB, directory, str(steps),
                str(pause)]
        cmd = "env %s setsid -f sh -c %s %s %s >%s 2>&1 </dev/null" % (
            " ".join("%s=%s" % (k, shlex.quote(v)) for k, v in sorted(env.items())),
            shlex.quote('echo $$ > "$0"; exec "$@"'), shlex.quote(pid_file), " ".join(shlex.quote(a) for a in argv),
            shlex.quote(self.log_path))
        hosts.ssh(host, cmd, timeout=60)
        deadline = time.monotonic() + 30
        while not (os.path.exists(pid_file) and os.path.getsize(pid_file)) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(pid_file) as fh:
            self.pid = int(fh.read())


def _ancestors(pid):
    out = []
    while pid > 1:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
        out.append(pid)
    return out


def _states(pids):
    out = {}
    for p in pids:
        try:
            with open("/proc/%d/stat" % p) as fh:
                out[p] = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            pass
    return out


def _floors(ck, sy, rs, quiesce):
    """The downtime's floors: each rank's driver checkpoint and restore (and lock/unlock), the transfer."""
    by_ck, by_rs = _per_rank(ck, quiesce), _per_rank(rs, quiesce)
    ck_max = max((v.get("checkpoint") or 0) for v in by_ck.values()) if by_ck else None
    rs_max = max((v.get("restore") or 0) for v in by_rs.values()) if by_rs else None
    floor = None
    if ck_max is not None and rs_max is not None and sy.get("seconds") is not None:
        floor = round(ck_max + sy["seconds"] + rs_max, 3)
    return {"driver_checkpoint_by_rank": by_ck, "driver_restore_by_rank": by_rs, "driver_checkpoint_max": ck_max,
            "driver_restore_max": rs_max, "transfer_seconds": sy.get("seconds"),
            "transfer_bytes": sy.get("bytes_transferred"), "floor_sum": floor}


def _ranks_of(job):
    return dict(job.ranks().items())


@pytest.mark.parametrize("mode", ["cooperative", "config"])
def test_ddp_job_migrated_between_the_loopback_hosts(playbook, gpu_hosts, tmp_path, record, mode):
    extra, coop = MODES[mode]
    env = dict(extra)
    env.pop("GPUCKPT_DDP_COOP", None)
    # The reference runs first, alone: the preflight bounds the job's GPU memory by its GPUs' used memory only where
    # no other process runs there (test_gpu_coop_drain.py). The job steps slowly so that it is mid-run when moved.
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0, env=env)
    reference.wait_done()
    job = RemoteJob(gpu_hosts, "hosta", str(tmp_path / "job"), mode, pause=0.3)
    try:
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        # (one pid space: the job, started through hosta's ssh in a session of its own, is init's child like the
        # restored copy; migrate.yml is told where it runs)
        v = {"source": "hosta", "target": "hostb", "pid": job.pid, "migration_id": "ddp-" + mode,
             # (no unknown accepted: the preflight bounds the job's GPU memory by its GPUs' used memory, docs/multi_gpu.md)
             "gpuckpt_quiesce_timeout": 60, "gpuckpt_host_huge_pages": THP}
        if coop:
            v["quiesce_mode"] = "cooperative"
        t = time.monotonic()
        run = playbook("gpuckpt.fleet.migrate", v, inventory=gpu_hosts.path("inventory.yml"))
        wall = round(time.monotonic() - t, 3)
        record("ddp_migrate_attempt", mode=mode, rc=run.rc, wall=wall, tail=run.stdout[-4000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        ck, sy, rs = run.task("Stage 1/3"), run.task("Stage 2/3"), run.task("Restore on hostb")
        quiesce = ck.get("quiesce") or {}
        step = quiesce.get("step")
        procs1, ranks1 = job.procs(), job.ranks()
        assert rs.get("changed") is True, rs
        assert all(s != "T" for s in _states(procs1).values()), _states(procs1)
        downtime = round(rs["resumed_at"] - ck["frozen_at"], 3)
        if job.steps_done() < STEPS:  # (a short job may already have run to its end on hostb: its losses say the rest)
            # one copy: the same processes (one pid space: CRIU gave them their pids back)
            assert len(procs1) == len(procs0) and sorted(ranks1) == [0, 1], (procs1, procs0, ranks1)
        rec = dict(mode=mode, host_huge_pages=THP, steps=STEPS, wall=wall, quiesce=quiesce, checkpoint=ck.get("timings"),
                   restore=rs.get("timings"), image_bytes=ck.get("image_bytes"), cuda_pids=ck.get("cuda_pids"),
                   cooperative_resumed=rs.get("cooperative_resumed"), downtime=downtime,
                   floors=_floors(ck, sy, rs, quiesce), processes=len(procs0), ranks_before=ranks0, ranks_after=ranks1,
                   summary=run.task("Summary").get("msg"))
        record("ddp_migrate_result", **rec)
        if coop:
            assert quiesce.get("mode") == "cooperative" and len(quiesce.get("ranks") or {}) == 2, quiesce
            assert len(rs.get("cooperative_resumed") or []) == 2, rs
        job.wait_done()
        reference.wait_done()
        _same_losses(job, reference)
        record("ddp_migrate", mode=mode, losses_identical=True, dump_step=step, downtime=downtime,
               stall=_stall(job, step) if step is not None else None,
               cycles={"rank%d" % r: job.cycles(r) for r in range(2)})
    finally:
        job.kill()
        reference.kill()
