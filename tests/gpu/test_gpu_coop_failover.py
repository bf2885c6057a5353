"""A protected 2-rank DDP job in NCCL's default configuration with the helper (tests/workloads/ddp_job.py,
GPUCKPT_DDP_COOP=1, under the helper's torchrun), failed over (issue 45 part 3). The protect role on ``node`` with
the job's checkpoints in the cooperative mode; the timer's command run once (a periodic checkpoint, the job left
running, its image verified on ``replica``); then the node is lost (the job killed, its sshd gone) and failover.yml
restores that image on ``target``. The same in the configuration mode (NCCL's P2P and cuMem off, no helper, the
protect runner's default quiesce mode). Both ranks go on from the checkpoint's step: every loss either copy logged,
the lost one's and the restored one's, is bit-identical to an uninterrupted run; the restored copy logs each step
after the checkpoint exactly once, to the end; nothing is left frozen.

The loopback hosts share one pid space and one kernel here (the driver's checkpoint API resolves pids in the initial
pid namespace): the lost node's job is killed by the test, and the restore waits until the kernel has let go of the
killed job's TCP ports (its TIME_WAIT), which a node that is really lost takes with it. NVLink multicast stays off."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, gpu_count
from test_gpu_cooperative import NO_MULTICAST, STEPS, Job
from test_gpu_coop_migrate import MODES, RemoteJob, _states
from test_gpu_failover import HOSTS, PASS_ENV

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import LoopbackHosts  # noqa: E402

pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)")
PORTS_FREE_S = 75  # Linux keeps a closed connection in TIME_WAIT for 60 s


class ProtectedJob(RemoteJob):
    """The job on the lost node and then on the target: its logs hold the lost copy's lines, then the restored
    copy's from the checkpoint's step on."""

    def lines(self, name, rank):
        return [(int(s), v) for s, v in self._lines("rank%d.%s" % (rank, name))]

    def steps_done(self):
        return min(len({s for s, unused in self.lines("losses", r)}) for r in range(2))


def _socket_inodes(pids):
    out = set()
    for p in pids:
        try:
            fds = os.listdir("/proc/%d/fd" % p)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%d/fd/%s" % (p, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    return out


def _tcp(inodes=None):
    """[(local port, state hex, inode)] of the kernel's TCP sockets (IPv4 and IPv6), those of ``inodes`` when given."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if inodes is None or f[9] in inodes:
                out.append((int(f[1].rsplit(":", 1)[1], 16), f[3], f[9]))
    return out


def _wait_ports_free(ports, timeout=PORTS_FREE_S):
    """Seconds until no TCP socket of the kernel has one of ``ports`` as its local port (the killed job's connections
    in TIME_WAIT and the like); the sockets still there at the timeout."""
    t0 = time.monotonic()
    left = [s for s in _tcp() if s[0] in ports]
    while left and time.monotonic() - t0 < timeout:
        time.sleep(1)
        left = [s for s in _tcp() if s[0] in ports]
    return round(time.monotonic() - t0, 1), left


def _runs(lines):
    """The runs of consecutive steps in a log: [(first, last)]."""
    runs = []
    for s, unused in lines:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return [tuple(r) for r in runs]


def _rank_stall(cycle):
    """The seconds a rank spent out of training at the periodic checkpoint, as its own cycle record says (release,
    wait for the resume, rejoin). Its times file cannot say it: the lost copy's buffered lines died with it."""
    return round(cycle["release_s"] + cycle["waited_s"] + cycle["rejoin_s"], 3)


@pytest.mark.parametrize("mode", ["cooperative", "config"])
def test_protected_ddp_job_fails_over_with_bit_identical_losses(playbook, tmp_path, record, mode):
    base = str(tmp_path / "hosts")
    hv = {}
    for name, unused in HOSTS:
        hv[name] = {"gpuckpt_environment": dict(PASS_ENV, **NO_MULTICAST),
                    "gpuckpt_protect_dir": os.path.join(base, name, "protect"),
                    "gpuckpt_protect_lib_dir": os.path.join(base, name, "lib"),
                    "gpuckpt_protect_bin": os.path.join(base, name, "bin", "gpuckpt-protect"),
                    "gpuckpt_protect_image_root": os.path.join(base, name, "protect-images"),
                    "gpuckpt_protect_replica_root": os.path.join(base, name, "replicas")}
    hv["node"]["gpuckpt_protect_replicas"] = ["replica"]
    hosts = LoopbackHosts(base, pid_namespaces=False, python=WORKLOAD_PYTHON, hosts=HOSTS).start(hv)
    extra, coop = MODES[mode]
    env = dict(extra)
    env.pop("GPUCKPT_DDP_COOP", None)
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0, env=env)
    job = None
    try:
        job = ProtectedJob(hosts, "node", str(tmp_path / "job"), mode, pause=0.3)
        jobs = [{"name": "train", "pid_file": os.path.join(job.dir, "launcher.pid"), "interval": 900, "keep": 2}]
        if coop:
            jobs[0]["checkpoint"] = {"quiesce_mode": "cooperative", "quiesce_timeout": 60}
        inv = hosts.path("inventory.yml")
        run = playbook("gpuckpt.fleet.protect", {"node": "node", "gpuckpt_protected_jobs": jobs}, inventory=inv)
        record("coop_protect_role", rc=run.rc, tail=run.stdout[-3000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        timer = "%s run --protect-dir %s --job train" % (hv["node"]["gpuckpt_protect_bin"], hv["node"]["gpuckpt_protect_dir"])
        res = hosts.ssh("node", timer, timeout=600, check=False)
        docs = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        record("coop_protect_checkpoint", mode=mode, rc=res.returncode, run=docs[-1] if docs else None,
               tail="" if docs else res.stdout[-3000:])
        assert docs and docs[-1]["result"] == "ok", res.stdout
        if coop:
            deadline = time.monotonic() + 30  # (each rank records its cycle once it has rejoined)
            while not all(job.cycles(r) for r in range(2)) and time.monotonic() < deadline:
                time.sleep(0.1)
            cycles = {r: job.cycles(r) for r in range(2)}
            assert all(len(c) == 1 and c[0]["resumed_by"] == "resume" for c in cycles.values()), cycles
            step = cycles[0][0]["step"]
            assert cycles[1][0]["step"] == step, cycles
        else:  # (no boundary to name: the restored copy's first step says where the image was taken, below)
            step = job.steps_done()
        job.wait_steps(step + 5)  # the job runs on after its periodic checkpoint
        assert job.procs() == procs0 and job.ranks() == ranks0, (job.procs(), procs0)
        assert job.steps_done() < STEPS, "the job ended before its node was lost: slow it down (pause)"

        # The node is lost: its job with it, then its sshd.
        ports = {port for port, unused, unused2 in _tcp(_socket_inodes(procs0))}
        job.kill()
        hosts.crash("node")
        job.wait_gone(30)
        lost_at = {r: _runs(job.lines("losses", r))[-1][1] for r in range(2)}
        waited, left = _wait_ports_free(ports)
        record("coop_failover_ports", ports=sorted(ports), waited_s=waited, left=left)
        reference.wait_done()
        t = time.monotonic()
        run = playbook("gpuckpt.fleet.failover", {"job": "train", "lost_node": "node", "target": "target",
                                                  "lost_node_confirmed": True, "gpuckpt_protected_jobs": jobs},
                       inventory=inv)
        wall = round(time.monotonic() - t, 3)
        record("coop_failover_attempt", rc=run.rc, wall=wall, tail=run.stdout[-6000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        rs = run.task("Restore from")
        procs1, ranks1 = job.procs(), job.ranks()
        if coop:
            assert sorted(rs.get("cooperative_resumed") or []) == sorted(ranks0.values()), (rs.get("cooperative_resumed"), ranks0)
        assert all(s != "T" for s in _states(procs1).values()), _states(procs1)
        if job.steps_done() < STEPS:  # one copy: the checkpointed processes, with their pids (one pid space)
            assert procs1 == procs0 and ranks1 == ranks0, (procs1, procs0, ranks1, ranks0)
        record("coop_failover_result", mode=mode, steps=STEPS, wall=wall, checkpoint_step=step, lost_at_step=lost_at,
               restore=rs.get("timings"), driver=rs.get("driver_call_seconds"),
               driver_by_pid=rs.get("driver_call_seconds_by_pid"), cooperative_resumed=rs.get("cooperative_resumed"),
               report=[x for x in run.stdout.splitlines() if "rolled" in x.lower()][-3:])
        job.wait_done()
        if not coop:  # the image's step: the one before the restored copy's first (the same on both ranks)
            firsts = {r: _runs(job.lines("losses", r))[-1][0] for r in range(2)}
            assert firsts[0] == firsts[1] and 0 < firsts[0] <= min(lost_at.values()) + 1, (firsts, lost_at)
            step = firsts[0] - 1
        for r in range(2):
            mine, ref = job.lines("losses", r), reference.losses(r)
            assert len(ref) == STEPS, (r, len(ref))
            want = {int(s): v for s, v in ref}
            # the lost copy from step 0 to its last, then the restored copy from the checkpoint's step on, to the end
            assert _runs(mine) == [(0, lost_at[r]), (step + 1, STEPS - 1)], (r, _runs(mine), step)
            differ = [s for s, v in mine if want[s] != v]
            assert not differ, "rank %d: losses differ from the uninterrupted run at steps %s" % (r, differ[:10])
        cycles = {"rank%d" % r: job.cycles(r) for r in range(2)}
        if coop:
            assert all([c["resumed_by"] for c in rank] == ["resume", "resume"] for rank in cycles.values()), cycles
        record("coop_failover", mode=mode, losses_identical=True, checkpoint_step=step, lost_at_step=lost_at,
               steps_rerun={"rank%d" % r: lost_at[r] - step for r in range(2)},
               stall_periodic_checkpoint={r: _rank_stall(c[0]) for r, c in cycles.items() if c} or None,
               cycles=cycles)
    finally:
        if job is not None:
            job.kill()
        reference.kill()
        hosts.stop()
        time.sleep(1)
