"""On 2 GPUs: a pod asking for both (gpu_count 2) whose container runs a deterministic 2-rank DDP job in NCCL's default
configuration with the helper (tests/workloads/ddp_job.py, GPUCKPT_DDP_COOP=1, under the helper's torchrun), held on
its node by checkpoint.yml in the cooperative mode, then restored through the pod path into the target pod's container,
which a KUBELET STAND-IN makes under the runtime handler gpuckpt-restore-runtime (no kubelet runs here; issue 45 part 3,
a pod with gpu_count 2). One machine is both nodes: the target pod gets the same 2 GPUs, and the held source is removed
first (test_gpu_k8s_pod.py says why). Every loss of both ranks bit-identical to an uninterrupted run of the same job
without the helper, both ranks told to resume, one copy, nothing frozen. NVLink multicast stays off.

containerd's runc cannot be handed CRIU's --network-lock=nftables, so the job's TCP connections need iptables-restore,
which the GPU machines lack: run with GPUCKPT_CARRIED_IPTABLES=1 (tests/gpu/prepare_carry.sh carries bookworm's)."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, gpu_count
from test_gpu_cooperative import (DDP_JOB, LAUNCHER, NO_MULTICAST, STEPS, Job, _per_rank, _ran_on_intact, _stall, _with_arg,
                                  ddp_container_spec)
from test_gpu_k8s_pod import NAMESPACE, diagnostics, gpu_inventory, install_handler, make_container, node_restore

sys.path.insert(0, os.path.join(REPO, "tests"))
from containerd_daemon import Containerd, available  # noqa: E402

POD = "default/ddp-pod"
pytestmark = [pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h100-x2)"),
              pytest.mark.skipif(not available(), reason="containerd 2.x and grpcio (tests/gpu/install_tools.sh)"),
              pytest.mark.skipif(shutil.which("iptables-restore") is None,
                                 reason="iptables-restore (GPUCKPT_CARRIED_IPTABLES=1 with tests/gpu/run_on_device.sh)")]


class PodDdpJob(Job):
    """The job as the container ``trainer`` of pod ``pod``, given the GPUs ``minors``; its processes are found on the
    host by the job's folder."""

    def __init__(self, daemon, runc_root, directory, minors, pod=POD, pause=0.2):  # pylint: disable=super-init-not-called
        self.dir, self.steps, self.daemon = directory, STEPS, daemon
        self.log_path = os.path.join(directory, "torchrun.log")
        os.makedirs(directory)
        self.env = dict(NO_MULTICAST, GPUCKPT_DDP_COOP="1")
        self.args = [WORKLOAD_PYTHON, LAUNCHER, "--standalone", "--nproc-per-node", "2", DDP_JOB, directory, str(STEPS),
                     str(pause)]
        self.id, res = make_container(daemon, runc_root, pod, str(uuid.uuid4()), "trainer", directory, self.args,
                                      gpu_minors=minors, env=self.env, spec_edit=ddp_container_spec)
        assert res.returncode == 0, res.stdout
        # (torchrun's agent has no RANK in its environment: Job.ranks needs no pid of it, which the restore changes)
        self.pid = None
        deadline = time.monotonic() + 120
        while len(self.ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(self.ranks()) == 2, (self.procs(), self.tail())
        self.pid = min(set(self.procs()) & set(_with_arg(LAUNCHER)))

    def remove(self, cid=None):
        """The container ``cid`` (default: the source's) killed and deleted, as its kubelet would."""
        cid = cid or self.id
        self.daemon.ctr("tasks", "kill", "--signal", "SIGKILL", cid, namespace=NAMESPACE, check=False)
        for unused in range(100):
            if self.daemon.ctr("tasks", "delete", cid, namespace=NAMESPACE, check=False).returncode == 0:
                break
            time.sleep(0.1)


def test_a_two_gpu_pod_of_a_cooperative_ddp_job_is_held_then_restored_through_the_runtime_handler(
        playbook, tmp_path, record):
    inv = gpu_inventory()
    minors = [g["minor"] for g in inv[:2]]
    daemon = Containerd("/tmp/gpk-gpodd-%d" % os.getpid()).start()
    runc_root, image_root = str(tmp_path / "runc-root"), str(tmp_path / "images")
    os.mkdir(image_root, 0o700)
    image_dir = os.path.join(image_root, "ddp-pod-1")
    reference = Job(str(tmp_path / "reference"), coop=False, pause=0)
    job = None
    try:
        job = PodDdpJob(daemon, runc_root, str(tmp_path / "job"), minors)
        job.wait_steps(20)
        procs0, ranks0 = job.procs(), job.ranks()
        run = playbook("gpuckpt.fleet.checkpoint", {
            "gpuckpt_pod": POD, "gpuckpt_image_dir": image_dir, "gpuckpt_leave_stopped": True,
            "gpuckpt_containerd_address": daemon.address, "gpuckpt_runc_root": runc_root,
            "gpuckpt_quiesce_mode": "cooperative", "gpuckpt_quiesce_timeout": 60})
        record("gpu_k8s_pod_ddp_checkpoint_attempt", rc=run.rc, tail=run.stdout[-6000:] if run.rc else "")
        assert run.rc == 0, run.stdout[-8000:]
        ck = run.task("Checkpoint pod %s" % POD)
        quiesce = ck.get("quiesce") or {}
        assert quiesce.get("mode") == "cooperative" and len(quiesce.get("ranks") or {}) == 2, quiesce
        step = quiesce["step"]
        held = job.steps_done()
        time.sleep(1)
        assert job.steps_done() == held == step + 1, (job.steps_done(), held, step)
        job.remove()  # (the held source's node is another one: here it goes first, test_gpu_k8s_pod.py says why)

        hdir = tmp_path / "handler"
        handler = install_handler(hdir, image_root)
        token, target = uuid.uuid4().hex, POD + "-b"
        node = node_restore(image_dir, daemon, target, token, runc_root)
        request = json.dumps({"image": image_dir, "token": token})
        t0 = time.monotonic()
        cid, res = make_container(daemon, runc_root, target, str(uuid.uuid4()), "trainer", job.dir, job.args,
                                  handler=handler, annotations={"gpuckpt.fleet/restore": request}, gpu_minors=minors,
                                  env=job.env, spec_edit=ddp_container_spec)
        made = round(time.monotonic() - t0, 3)
        try:
            out, unused = node.communicate(timeout=330)
        except Exception:
            node.kill()
            record("gpu_k8s_pod_ddp_restore_hung", node=(node.communicate()[0] or "")[-4000:], **diagnostics(daemon, hdir))
            raise
        if res.returncode != 0 or node.returncode != 0:
            record("gpu_k8s_pod_ddp_restore_diagnostics", **diagnostics(daemon, hdir))
        record("gpu_k8s_pod_ddp_restore_attempt", rc=node.returncode, create_rc=res.returncode,
               create=res.stdout[-2000:], node=out[-4000:])
        assert res.returncode == 0, res.stdout
        assert node.returncode == 0, out
        result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        assert len(result.get("cooperative_resumed") or []) == 2, result
        cycles = _ran_on_intact(job, reference, step, procs0)
        record("gpu_k8s_pod_ddp", steps=STEPS, losses_identical=True, dump_step=step, quiesce=quiesce,
               checkpoint=ck.get("timings"), driver_checkpoint=_per_rank(ck, quiesce), image_bytes=ck.get("image_bytes"),
               restore=result["timings"], handler_create_seconds=made, gpu_pairs=result["gpu_pairs"],
               stall=_stall(job, step), cycles=cycles, ranks_before=ranks0, ranks_after=job.ranks(), target_container=cid)
    finally:
        if job is not None:
            job.kill()
        reference.kill()
        daemon.remove_all()
        daemon.stop()
