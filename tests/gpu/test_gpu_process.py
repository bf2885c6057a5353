"""On a real GPU: the modules checkpoint and restore a PyTorch process through ansible-playbook,
and its GPU memory is checked (checksums before and after) once it runs again."""
from __future__ import annotations

import os
import subprocess

import pytest

from gpu_helpers import nvidia_smi_pids, raw_driver

GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))


def test_facts_see_the_gpu_and_the_process(playbook, torch_workloads, tmp_path, record):
    w = torch_workloads(gib=1)
    run = playbook(os.path.join(os.path.dirname(__file__), "facts.yml"), {"pids": w.pids})
    assert run.rc == 0, run.stdout
    facts = run.task("facts")["ansible_facts"]["gpuckpt"]
    assert facts["driver"]["checkpoint_api"] is True
    assert facts["gpus"] and facts["cuda_device_uuids"]
    procs = {p["pid"]: p for p in facts["cuda_processes"]}
    assert procs[w.pid]["cuda_state"] == "running"
    assert any(d.startswith("/dev/nvidia") for d in procs[w.pid]["nvidia_devices"])
    assert facts["criu"]["check_ok"] is True and facts["ready"] is True
    record("facts", driver=facts["driver"], gpus=facts["gpus"], criu=facts["criu"]["version"])


def test_checkpoint_restore_pytorch_process(playbook, torch_workloads, tmp_path, record):
    w = torch_workloads(gib=GIB)
    image_dir = str(tmp_path / "img")
    assert w.pid in nvidia_smi_pids()
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir})
    assert run.rc == 0, run.stdout
    ck = run.task("Checkpoint pid")
    assert ck["changed"] is True and ck["cuda_pids"] == [w.pid] and ck["gpu_stage"] == "done"
    assert not w.alive()
    assert w.pid not in nvidia_smi_pids(), "the GPU memory must be released after the checkpoint"
    stopped = w.counts()

    run = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir})
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    assert rs["changed"] is True and rs["cuda_pids"] == [w.pid]
    w.wait_counting(beyond=stopped)
    assert w.verified_after(stopped)
    assert w.pid in nvidia_smi_pids()
    again = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir})
    assert again.rc == 0 and again.task("Restore from")["changed"] is False

    # The floor, in the same run: the driver's calls alone on this same process (no CRIU around them).
    raw = raw_driver([w.pid])[0]
    w.wait_counting(beyond=w.counts())
    assert w.verified_after(w.counts())
    record("checkpoint_restore", gib=GIB, image_bytes=ck["image_bytes"], checkpoint_timings=ck["timings"],
           checkpoint_driver_calls=ck["driver_call_seconds"], restore_timings=rs["timings"],
           restore_driver_calls=rs["driver_call_seconds"], raw_driver=raw, fill_seconds=w.fill_seconds)


def test_quiesced_pytorch_process_with_huge_pages(playbook, torch_workloads, tmp_path, record):
    """The job gives its allocator's cache back on SIGUSR1 (tools/gpuckpt_quiesce.py) before the freeze,
    and THP is always while the checkpoint and the restore run: smaller image, data intact, the host's
    setting put back."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        thp_before = fh.read()
    w = torch_workloads(gib=2, cache_gib=4, quiesce=True)
    image_dir = str(tmp_path / "img")
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir,
                                                "gpuckpt_quiesce_signal": "SIGUSR1", "gpuckpt_host_huge_pages": True})
    assert run.rc == 0, run.stdout
    ck = run.task("Checkpoint pid")
    ack = ck["quiesce"]["acknowledged"][str(w.pid)]
    assert ack["released_bytes"] >= 4 * 2**30, ack
    assert ck["image_bytes"] < 4 * 2**30, "the released cache must not be saved (%d bytes)" % ck["image_bytes"]
    assert ck["huge_pages"]["mode"] == "always"
    stopped = w.counts()
    run = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir, "gpuckpt_host_huge_pages": True})
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    w.wait_counting(beyond=stopped)
    assert w.verified_after(stopped)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
        assert fh.read() == thp_before
    record("quiesce_huge_pages", gib=2, cache_gib=4, image_bytes=ck["image_bytes"], quiesce=ck["quiesce"],
           checkpoint_timings=ck["timings"], restore_timings=rs["timings"], huge_pages=ck["huge_pages"])


def test_leave_running_on_gpu(playbook, torch_workloads, tmp_path, record):
    w = torch_workloads(gib=GIB)
    image_dir = str(tmp_path / "img")
    before = w.counts()
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir,
                                                "gpuckpt_leave_running": True})
    assert run.rc == 0, run.stdout
    ck = run.task("Checkpoint pid")
    assert w.alive() == [w.pid]
    w.wait_counting(beyond=before)
    assert w.verified_after(w.counts())
    record("leave_running", gib=GIB, timings=ck["timings"], driver_calls=ck["driver_call_seconds"])


def test_real_driver_errors_are_named(torch_workloads):
    """A real driver error, not a stand-in: checkpointing a process that is not locked."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".build", "collections"))
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import driver as cuda
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import DriverError
    w = torch_workloads(gib=0.25)
    drv = cuda.CudaDriver()
    try:
        drv.checkpoint(w.pid)
        raise AssertionError("checkpoint of a running (unlocked) process must fail")
    except DriverError as exc:
        assert exc.name.startswith("CUDA_ERROR_") and exc.pid == w.pid
    assert drv.cuda_state(w.pid) == "running"
    assert drv.cuda_state(1) is None  # no CUDA in init: CUDA_ERROR_NOT_INITIALIZED
    assert drv.cuda_state(4194303) is None  # no such pid: CUDA_ERROR_OPERATING_SYSTEM
    # This process called cuInit, so the driver counts it as a CUDA process, with no context at all.
    assert drv.cuda_state(os.getpid()) == "running"
    w.wait_counting(beyond=w.counts())


def test_three_cuda_processes_frozen_together(playbook, torch_workloads, tmp_path, record):
    """A parent and two worker processes, each with its own CUDA context and GPU memory (no NCCL)."""
    w = torch_workloads(gib=2, children=2)
    assert len(w.pids) == 3
    image_dir = str(tmp_path / "img")
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir})
    assert run.rc == 0, run.stdout
    ck = run.task("Checkpoint pid")
    assert sorted(ck["cuda_pids"]) == sorted(w.pids)
    assert not w.alive()
    stopped = w.counts()
    run = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir})
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    w.wait_counting(beyond=stopped)
    assert w.verified_after(stopped)
    record("multi_process", processes=3, gib_each=2, checkpoint_timings=ck["timings"],
           checkpoint_driver_calls=ck["driver_call_seconds"], restore_timings=rs["timings"],
           image_bytes=ck["image_bytes"])


ROLE_CUDA_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration",
                                    "playbooks", "role_cuda_checkpoint.yml")


def test_cuda_checkpoint_role_checks_the_real_driver(playbook, record):
    """The role's driver checks against a real driver: 570+ for the API, 580+ for restoring onto other
    GPUs. (Installing the cuda-checkpoint binary needs NVIDIA's download; it is tested in CI from a
    local file.)"""
    run = playbook(ROLE_CUDA_CHECKPOINT, {"cuda_checkpoint_install": False})
    assert run.rc == 0, run.stdout
    report = run.task("Report what this node can do")["msg"]
    assert "checkpoint API True" in report and "restore onto other GPUs True" in report, report
    persistence = run.task("Read persistence mode")
    assert persistence["rc"] == 0 and persistence["stdout_lines"], persistence
    too_new = playbook(ROLE_CUDA_CHECKPOINT, {"cuda_checkpoint_install": False, "cuda_checkpoint_min_driver": "999"})
    assert too_new.rc != 0
    assert "needs driver 999 or newer" in too_new.task("Require the checkpoint API")["msg"]
    record("cuda_checkpoint_role", report=report, persistence=persistence["stdout_lines"])


def _memory_by_gpu(pid):
    """{GPU UUID: MiB} that ``pid`` holds on each GPU, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                         stdout=subprocess.PIPE, universal_newlines=True, check=False).stdout
    held = {}
    for line in out.splitlines():
        if line.strip():
            p, uuid, mib = [x.strip() for x in line.split(",")]
            if int(p) == pid:
                held[uuid] = int(mib)
    return held


def test_one_process_on_two_gpus_restored_with_them_swapped(playbook, torch_workloads, tmp_path, record):
    """The seed's multi-GPU pod (DataParallel over nvidia.com/gpu: 2) as one process holding memory on both
    GPUs (a third of it on the first, two thirds on the second, each part seeded differently): restored
    with the two GPUs swapped (the driver's one-to-one UUID map), each part must come back whole, on the
    other GPU."""
    listed = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], stdout=subprocess.PIPE,
                            universal_newlines=True, check=True).stdout
    uuids = [u.strip() for u in listed.splitlines() if u.strip()]
    if len(uuids) < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    w = torch_workloads(gib=GIB, device="0,1")
    before = _memory_by_gpu(w.pid)
    assert before[uuids[1]] > before[uuids[0]] > 0, before
    image_dir = str(tmp_path / "img")
    run = playbook("gpuckpt.fleet.checkpoint", {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir})
    assert run.rc == 0, run.stdout
    stopped = w.counts()
    swap = {uuids[0]: uuids[1], uuids[1]: uuids[0]}
    run = playbook("gpuckpt.fleet.restore", {"gpuckpt_image_dir": image_dir, "gpuckpt_gpu_map": swap})
    assert run.rc == 0, run.stdout
    rs = run.task("Restore from")
    w.wait_counting(beyond=stopped)
    assert w.verified_after(stopped), "each part's data, now on the other GPU, is intact"
    after = _memory_by_gpu(w.pid)
    assert after[uuids[0]] > after[uuids[1]] > 0, (before, after)  # the larger part moved to the first GPU
    record("two_gpus_swapped", gib=GIB, gpu_pairs=rs["gpu_pairs"], mib_before=before, mib_after=after,
           restore=rs["timings"], driver_calls=rs["driver_call_seconds"], data_intact=True)
