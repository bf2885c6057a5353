"""A 2-rank DDP job, NCCL between two GPUs (issue 45): started as the driver can restore it (docs/multi_gpu.md),
by a launcher of its own, checkpointed whole by the collection (the launcher and both ranks, their store's
connections with them) and restored in place, every later loss of both ranks bit-identical to an uninterrupted
run's; under torchrun, or with NCCL's defaults, refused before anything is frozen, running on. NVLink SHARP stays
off (NCCL_NVLS_ENABLE=0)."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, _clean_env, gpu_count

DDP_JOB = os.path.join(REPO, "tests", "workloads", "ddp_job.py")
STEPS = 150
# (USE_LIBUV=0: rank 0's TCPStore server without libuv, whose io_uring CRIU cannot dump)
RESTORABLE = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0", "USE_LIBUV": "0"}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)")


class DdpJob(object):
    def __init__(self, directory, env, steps=STEPS, pause=0.1, torchrun=False):
        self.dir, self.steps = directory, steps
        os.makedirs(directory)
        e = dict(_clean_env(), **dict(NO_MULTICAST, **env))
        self.log = open(os.path.join(directory, "torchrun.log"), "w")
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", DDP_JOB] if torchrun \
            else [DDP_JOB, "--launch", "2"]
        # its own session (CRIU dumps a session with its leader), stdio on files, and not pytest's child (setsid -f
        # forks): once the checkpoint ended it, no zombie of it keeps the pid its restore needs
        pid_file = os.path.join(directory, "launcher.pid")
        script = 'echo $$ > "$0"; exec "$@"'
        subprocess.run(["setsid", "-f", "sh", "-c", script, pid_file, WORKLOAD_PYTHON] + launcher
                       + [directory, str(steps), str(pause)], env=e, stdin=subprocess.DEVNULL, stdout=self.log,
                       stderr=subprocess.STDOUT, check=True)
        deadline = time.monotonic() + 30
        while not (os.path.exists(pid_file) and os.path.getsize(pid_file)) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(pid_file) as fh:
            self.pid = int(fh.read())

    def losses(self, rank):
        try:
            with open(os.path.join(self.dir, "rank%d.losses" % rank)) as fh:
                return [ln.split() for ln in fh.read().splitlines()]
        except OSError:
            return []

    def steps_done(self):
        return min(len(self.losses(0)), len(self.losses(1)))

    def wait_steps(self, n, timeout=300):
        deadline = time.monotonic() + timeout
        while self.steps_done() < n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.steps_done() >= n, (self.steps_done(), self.tail())

    def tail(self):
        with open(os.path.join(self.dir, "torchrun.log")) as fh:
            return fh.read()[-3000:]

    def kill(self):
        subprocess.run(["pkill", "-9", "-f", DDP_JOB + " " + self.dir], check=False)
        try:
            os.killpg(self.pid, 9)
        except OSError:
            pass
        self.log.close()


@pytest.fixture
def jobs(tmp_path):
    made = []

    def start(name, env, **kw):
        j = DdpJob(str(tmp_path / name), env, **kw)
        made.append(j)
        return j

    yield start
    for j in made:
        j.kill()


def test_a_ddp_job_started_as_the_driver_can_restore_is_checkpointed_and_restored_in_place(playbook, jobs, tmp_path,
                                                                                           record):
    reference = jobs("reference", RESTORABLE)
    reference.wait_steps(STEPS)
    job = jobs("job", RESTORABLE)
    job.wait_steps(30)
    image_dir = str(tmp_path / "img")
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": job.pid, "gpuckpt_image_dir": image_dir})
    ck = run.task("Checkpoint pid") if run.rc == 0 else {}
    record("multigpu_config_checkpoint", rc=run.rc, result=ck or run.stdout[-4000:])
    assert run.rc == 0, run.stdout[-6000:]
    assert len(ck["cuda_pids"]) == 2 and ck["gpu_stage"] == "done", ck
    held = job.steps_done()
    # In place, the store's listening port may still be held by its rendezvous connections in TIME_WAIT (60 s on
    # Linux): CRIU's restore then cannot bind it again (EADDRINUSE, seen here). A restore on another host has none.
    time.sleep(float(os.environ.get("GPUCKPT_MULTIGPU_RESTORE_AFTER", "65")))
    run = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir})
    rs = run.task("Restore from") if run.rc == 0 else {}
    record("multigpu_config_restore", rc=run.rc, result=rs or run.stdout[-4000:])
    assert run.rc == 0, run.stdout[-6000:]
    job.wait_steps(STEPS)
    for r in range(2):
        assert job.losses(r) == reference.losses(r), "rank %d's losses differ from the uninterrupted run's" % r
    record("multigpu_config", steps=STEPS, held_at_step=held, image_bytes=ck["image_bytes"],
           checkpoint=ck["timings"], restore=rs["timings"], checkpoint_driver=ck["driver_call_seconds"],
           restore_driver=rs["driver_call_seconds"], losses_identical=True)


def test_under_torchrun_its_agents_io_uring_refuses_the_job_before_anything_is_frozen(playbook, jobs, tmp_path,
                                                                                      record):
    """torchrun's agent (PyTorch 2.11) holds libuv's io_uring in its TCPStore server whatever its options, which CRIU
    cannot dump: refused in preflight, naming it, and the job runs on."""
    job = jobs("torchrun", RESTORABLE, steps=60, torchrun=True)
    job.wait_steps(10)
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": job.pid, "gpuckpt_image_dir": str(tmp_path / "img")})
    res = run.task("Checkpoint pid")
    record("multigpu_torchrun_refused", rc=run.rc, msg=res.get("msg"))
    assert run.rc != 0 and res["stage"] == "preflight" and "io_uring" in res["msg"], res
    job.wait_steps(60)


def test_a_ddp_job_with_nccls_defaults_is_refused_before_anything_is_frozen(playbook, jobs, tmp_path, record):
    job = jobs("defaults", {}, steps=60)
    job.wait_steps(10)
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": job.pid, "gpuckpt_image_dir": str(tmp_path / "img")})
    res = run.task("Checkpoint pid")
    record("multigpu_defaults_refused", rc=run.rc, msg=res.get("msg"))
    assert run.rc != 0 and res["stage"] == "preflight" and "NCCL_P2P_DISABLE=1" in res["msg"], res
    job.wait_steps(60)  # it ran on to its end
