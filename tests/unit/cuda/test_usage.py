"""cuda/usage.py: the GPUs and each process's GPU memory from nvidia-smi (its TEST DOUBLE, tests/doubles/nvidia-smi;
CI has no GPU and the venv no pynvml), and unknown, never zero, where nothing answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import usage

DOUBLE = os.path.join(REPO, "tests", "doubles", "nvidia-smi")
H100 = "NVIDIA H100 80GB HBM3"
GIB_MIB = 1024


def test_the_venv_has_no_pynvml_so_nvidia_smi_is_what_answers():
    with pytest.raises(ImportError):
        import pynvml  # noqa: F401


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """Point cuda/usage at the nvidia-smi double; returns a function that sets what it answers."""
    spec = tmp_path / "nvidia-smi.json"
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", DOUBLE)
    monkeypatch.setenv("GPUCKPT_FAKE_NVIDIA_SMI", str(spec))
    monkeypatch.setenv("GPUCKPT_NVIDIA_PROC", str(tmp_path / "no-driver-files"))

    def answer(gpus=(), apps=()):
        spec.write_text(json.dumps({"gpus": list(gpus), "compute_apps": list(apps)}))
    return answer


def gpu(index, free_mib, uuid=None, total_mib=80 * GIB_MIB):
    return {"index": index, "name": H100, "uuid": uuid or "GPU-%d" % index, "memory.total": total_mib,
            "memory.used": None if free_mib is None else total_mib - free_mib, "memory.free": free_mib,
            "driver_version": "580.159.04"}


def test_gpus_from_nvidia_smi_with_model_uuid_memory_and_driver(smi):
    smi(gpus=[gpu(0, 70 * GIB_MIB), gpu(1, 10 * GIB_MIB)])
    found, source = usage.gpus()
    assert source == "nvidia-smi"
    assert [(g["index"], g["name"], g["uuid"], g["memory_free_mib"], g["driver_version"]) for g in found] == [
        (0, H100, "GPU-0", 70 * GIB_MIB, "580.159.04"), (1, H100, "GPU-1", 10 * GIB_MIB, "580.159.04")]
    assert found[0]["memory_total_mib"] == 80 * GIB_MIB and found[0]["minor"] is None  # no driver files here


def test_a_gpu_that_reports_no_free_memory_has_none_not_zero(smi):
    smi(gpus=[gpu(0, None)])
    found, unused = usage.gpus()
    assert found[0]["memory_free_mib"] is None and found[0]["memory_used_mib"] is None


def test_gpu_memory_per_process_and_per_gpu_from_nvidia_smi(smi):
    smi(apps=[{"pid": 4242, "gpu_uuid": "GPU-0", "used_memory": 24 * GIB_MIB},
              {"pid": 4242, "gpu_uuid": "GPU-1", "used_memory": 2 * GIB_MIB},
              {"pid": 77, "gpu_uuid": "GPU-1", "used_memory": None}])
    by_pid, source = usage.gpu_memory_by_pid()
    assert source == "nvidia-smi"
    assert by_pid == {4242: 26 * 2**30, 77: None}  # 77 listed without a figure: unknown, not 0
    apps, unused = usage.compute_apps()
    assert {(a["pid"], a["gpu_uuid"]): a["bytes"] for a in apps}[(4242, "GPU-0")] == 24 * 2**30


def test_no_process_on_the_gpus_is_a_known_empty_reading(smi):
    smi(gpus=[gpu(0, 80 * GIB_MIB)])
    assert usage.gpu_memory_by_pid() == ({}, "nvidia-smi")


@pytest.mark.parametrize("why", ["not installed", "no driver"])
def test_unknown_when_neither_nvml_nor_nvidia_smi_answers(monkeypatch, tmp_path, why):
    if why == "not installed":
        monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", str(tmp_path / "absent" / "nvidia-smi"))
    else:  # installed, but the driver is not loaded: it fails and knows nothing
        monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", DOUBLE)
        monkeypatch.delenv("GPUCKPT_FAKE_NVIDIA_SMI", raising=False)
    assert usage.gpu_memory_by_pid() == (None, None)
    assert usage.compute_apps() == (None, None)
    assert usage.gpus() == ([], None)


def test_the_double_lists_the_processes_that_map_the_fake_libcuda(smi, tmp_path):
    """apps_mapping: the libcuda double's workloads, whose pids a test does not know in advance."""
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * 4096)
    child = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
                              "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('ready', flush=True); "
                              "time.sleep(30)", str(lib)], stdout=subprocess.PIPE, universal_newlines=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        (tmp_path / "nvidia-smi.json").write_text(json.dumps(
            {"apps_mapping": {"path": "/elsewhere/libcuda.so.1", "gpu_uuid": "GPU-0", "used_memory": 64}}))
        by_pid, source = usage.gpu_memory_by_pid()
        # other processes on this machine may map the libcuda double too (tests running beside this one)
        assert by_pid[child.pid] == 64 * 2**20 and source == "nvidia-smi"
    finally:
        child.kill()
        child.wait()
