"""migration/planner.py: can a workload move from this source to this target? Tables of host facts in the
shape cuda_process_facts returns; a plan with a status and a reason per check out. Unknown is never zero."""
from __future__ import annotations

import json
import os

import pytest

from helpers import REPO

from ansible_collections.gpuckpt.fleet.plugins.filter.migration import migration_preflight
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import facts as host_facts
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import planner

GIB = 2**30
MIB = 2**20
H100 = "NVIDIA H100 80GB HBM3"
ROOT = "/var/lib/gpuckpt/images"


def gpu(index, free_gib, name=H100):
    return {"index": index, "name": name, "uuid": "GPU-%s-%d" % (name[-4:], index), "memory_total_mib": 80 * 1024,
            "memory_used_mib": None if free_gib is None else int((80 - free_gib) * 1024),
            "memory_free_mib": None if free_gib is None else int(free_gib * 1024), "driver_version": "580.159.04"}


def host(name, gpus=(), disk_gib=500, ram_gib=200, pids_in_use=()):
    return {"host": {"hostname": name}, "memory": {"total_bytes": 256 * GIB, "available_bytes": ram_gib * GIB},
            "driver": {"available": True, "checkpoint_api": True, "driver_version": "580.159.04",
                       "api_version": "13.0"},
            "gpus": list(gpus), "gpu_source": "nvml",
            "criu": {"installed": True, "version": "4.2.1", "supported": True, "check_ok": True},
            "disk": {ROOT: {"free_bytes": disk_gib * GIB}}, "pids_in_use": list(pids_in_use)}


def workload(rss_gib=2, by_gpu=None, src=None):
    """A running CUDA process 4242 with its GPU memory on the source's GPUs ({index: GiB}); by_gpu None: unknown."""
    src = src or source()
    tree = {"root": 4242, "exists": True, "pids": [4242], "cuda_pids": [4242], "cuda_states": {"4242": "running"},
            "rss_bytes": rss_gib * GIB}
    if by_gpu is None:
        tree.update(gpu_bytes=None, gpu_bytes_by_gpu=None, gpu_memory_source=None,
                    gpu_memory_unknown_reason="neither NVML (the Python module pynvml, package nvidia-ml-py) nor "
                                              "nvidia-smi could be asked on hosta")
    else:
        per = {src["gpus"][i]["uuid"]: int(n * GIB) for i, n in by_gpu.items()}
        tree.update(gpu_bytes=sum(per.values()), gpu_bytes_by_gpu=per, gpu_memory_source="nvml",
                    gpu_memory_unknown_reason=None)
    return dict(src, tree=tree)


def source(**kw):
    kw.setdefault("gpus", [gpu(0, 60), gpu(1, 60)])
    return host("hosta", **kw)


def plan(src, tgt, **opts):
    opts.setdefault("source_path", ROOT)
    opts.setdefault("target_path", ROOT)
    return planner.plan_move(src["tree"], src, tgt, planner.options(**opts))


def status(p, name):
    return [c.status for c in p.checks if c.name == name]


def reason(p, name):
    return " ".join(c.reason or "" for c in p.checks if c.name == name)


def test_a_workload_that_fits_plans_ok_with_its_image_estimate():
    p = plan(workload(rss_gib=2, by_gpu={0: 20}), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)]))
    assert p.ok and not p.failed and not p.unknown
    assert p.image_estimate_bytes == int(22 * GIB * 1.10)
    assert [c.name for c in p.checks] == ["workload", "checkpoint_api", "driver_version", "cuda_api_version",
                                          "cuda_running", "gpu_model", "gpu_count", "gpu_memory", "criu", "criu",
                                          "disk", "host_ram", "pids", "not_draining"]


@pytest.mark.parametrize("case,target,failed,why", [
    ("other model", host("hostb", gpus=[gpu(0, 70, name="NVIDIA H200"), gpu(1, 70, name="NVIDIA H200")]),
     "gpu_model", "hostb has no NVIDIA H100 80GB HBM3"),
    ("fewer GPUs", host("hostb", gpus=[gpu(0, 70)]), "gpu_count", "hostb has 1 GPU(s), the source 2"),
    ("GPU busy", host("hostb", gpus=[gpu(0, 5), gpu(1, 70)]), "gpu_memory", "needs 20.0 GiB there"),
    ("disk", host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=20), "disk", "the image needs 24.2 GiB"),
    ("host RAM", host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], ram_gib=16), "host_ram", "hostb has 16.0 GiB"),
    ("pid taken", host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], pids_in_use=[4242]), "pids", "4242 are in use on hostb"),
])
def test_what_does_not_fit_is_refused_with_its_reason(case, target, failed, why):
    p = plan(workload(rss_gib=2, by_gpu={0: 20}), target)
    assert not p.ok and p.failed == [failed], case
    assert why in reason(p, failed)


def test_gpu_memory_is_per_gpu_not_summed():
    """Two target GPUs with 10 GiB free each do not hold one process's 15 GiB (the old check summed them)."""
    p = plan(workload(by_gpu={0: 15}), host("hostb", gpus=[gpu(0, 10), gpu(1, 10)]))
    assert not p.ok and p.failed == ["gpu_memory"]
    assert "GPU 0 (GPU-HBM3-0) has 10.0 GiB free, the workload needs 15.0 GiB there" in reason(p, "gpu_memory")


def test_each_source_gpu_lands_on_the_target_gpu_of_its_place():
    src = source(gpus=[gpu(0, 60), gpu(1, 60)])
    busy_other = host("hostb", gpus=[gpu(0, 70), gpu(1, 1)])  # the workload is on GPU 0 only
    assert plan(workload(by_gpu={0: 15}, src=src), busy_other).ok
    assert not plan(workload(by_gpu={0: 15, 1: 15}, src=src), busy_other).ok


def test_placement_unknown_the_largest_need_must_fit_every_gpu_it_could_land_on():
    src = workload(by_gpu={0: 15})
    src["tree"]["gpu_bytes_by_gpu"] = None  # facts of an older version: only the total
    assert status(plan(src, host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])), "gpu_memory") == ["ok"]
    assert status(plan(src, host("hostb", gpus=[gpu(0, 70), gpu(1, 10)])), "gpu_memory") == ["fails"]


def test_a_gpu_map_decides_where_the_memory_lands():
    src = workload(by_gpu={0: 15})
    tgt = host("hostb", gpus=[gpu(0, 1), gpu(1, 70)])
    assert status(plan(src, tgt), "gpu_memory") == ["fails"]
    assert plan(src, tgt, gpu_map={"GPU-HBM3-0": "GPU-HBM3-1"}).ok


def test_unknown_gpu_memory_is_refused_then_allowed_by_name():
    src, tgt = workload(by_gpu=None), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])
    p = plan(src, tgt)
    assert not p.ok and p.failed == [] and p.image_estimate_bytes is None
    assert p.unknown == ["gpu_memory", "disk", "host_ram"]
    assert "install nvidia-ml-py (NVML) or nvidia-smi on hosta" in reason(p, "gpu_memory")
    assert not plan(src, tgt, allow_unknown=["gpu_memory"]).ok, "disk and host RAM are still unknown"
    allowed = plan(src, tgt, allow_unknown=["gpu_memory", "disk", "host_ram"])
    assert allowed.ok and allowed.allowed == ["gpu_memory", "disk", "host_ram"]


def test_what_is_known_of_an_unknown_image_still_refuses():
    """The host RSS alone (22 GiB, +10%) does not fit 20 GiB: no override makes that fit."""
    p = plan(workload(rss_gib=22, by_gpu=None), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=20),
             allow_unknown=["gpu_memory", "disk", "host_ram"])
    assert not p.ok and p.failed == ["disk"]
    assert "the image needs at least 24.2 GiB" in reason(p, "disk")


def test_a_target_gpu_that_reports_no_free_memory_is_unknown_not_zero_nor_plenty():
    p = plan(workload(by_gpu={0: 15}), host("hostb", gpus=[gpu(0, None), gpu(1, 70)]))
    assert not p.ok and status(p, "gpu_memory") == ["unknown"]
    assert "GPU 0 (GPU-HBM3-0) reports no free memory" in reason(p, "gpu_memory")


def test_gpus_nobody_could_list_are_unknown_not_zero():
    tgt = host("hostb")
    tgt.update(gpus=[], gpu_source=None)
    p = plan(workload(by_gpu={0: 15}), tgt)
    assert p.unknown == ["gpu_model", "gpu_count", "gpu_memory"]
    assert "nothing lists the GPUs of hostb" in reason(p, "gpu_count")


@pytest.mark.parametrize("target_facts,missing", [
    ({"disk": {}}, "disk"), ({"memory": {"total_bytes": None, "available_bytes": None}}, "host_ram")])
def test_room_a_host_did_not_report_is_unknown(target_facts, missing):
    tgt = host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])
    tgt.update(target_facts)
    p = plan(workload(by_gpu={0: 1}), tgt)
    assert p.unknown == [missing] and not p.ok
    assert plan(workload(by_gpu={0: 1}), tgt, allow_unknown=[missing]).ok


def test_driver_mismatch_is_refused_unless_allowed():
    tgt = host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])
    tgt["driver"].update(driver_version="570.86.10", api_version="12.8")
    p = plan(workload(by_gpu={0: 1}), tgt)
    assert p.failed == ["driver_version", "cuda_api_version"]
    allowed = plan(workload(by_gpu={0: 1}), tgt, allow_driver_mismatch=True)
    assert allowed.ok and [c.label for c in allowed.checks if c.name == "driver_version"] == [
        "driver version (mismatch allowed)"]


def test_pids_in_one_pid_space_and_in_a_container():
    tgt = host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], pids_in_use=[4242])
    assert plan(workload(by_gpu={0: 1}), tgt, same_pid_space=True).ok  # its own pid, freed by the checkpoint
    tgt["pids_in_use"] = [4242, 4243]
    p = plan(dict(workload(by_gpu={0: 1}), tree=dict(workload(by_gpu={0: 1})["tree"], pids=[4242])), tgt,
             same_pid_space=True)
    assert p.failed == ["pids"] and "4243 are in use" in reason(p, "pids")
    assert plan(workload(by_gpu={0: 1}), tgt, container=True).ok


def test_a_cpu_workload_skips_the_gpu_checks():
    src = workload(by_gpu={})
    src["tree"].update(cuda_pids=[], cuda_states={}, gpu_memory_source="none")
    tgt = host("hostb")
    tgt.update(gpus=[], gpu_source=None, driver={"available": False, "checkpoint_api": False})
    p = plan(src, tgt)
    assert p.ok and [c.name for c in p.checks] == ["workload", "criu", "criu", "disk", "host_ram", "pids", "not_draining"]


def test_a_workload_that_is_gone_is_refused():
    src = source()
    src["tree"] = {"root": 4242, "exists": False, "pids": []}
    p = plan(src, host("hostb"))
    assert "workload" in p.failed and "no process 4242 on hosta" in reason(p, "workload")


def test_an_unknown_check_name_is_refused():
    with pytest.raises(ValueError, match="gpu-memory"):
        planner.options(allow_unknown=["gpu-memory"])


# -- the filter (migrate.yml's preflight) over the planner --------------------------------------------------

def test_filter_keeps_its_rows_and_table_and_prints_unknown_with_what_to_do():
    src, tgt = workload(by_gpu=None), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])
    res = migration_preflight(src, tgt, ROOT, ROOT)
    assert res["ok"] is False and res["unknown"] == ["gpu_memory", "disk", "host_ram"]
    assert res["image_estimate_bytes"] is None
    row = [r for r in res["rows"] if r["check"] == "free GPU memory on target"][0]
    assert row["ok"] is False and row["status"] == "unknown"
    assert "UNKNOWN" in res["table"] and "free disk for the image" in res["table"]
    assert ("install nvidia-ml-py (NVML) or nvidia-smi on hosta; or -e gpuckpt_allow_unknown=[gpu_memory]"
            in res["table"])
    assert "to accept every unknown check: -e gpuckpt_allow_unknown=[gpu_memory,disk,host_ram]" in res["table"]
    ok = migration_preflight(src, tgt, ROOT, ROOT, allow_unknown="[gpu_memory, disk, host_ram]")  # as -e gives it
    assert ok["ok"] is True and "UNKNOWN (allowed)" in ok["table"]


def test_filter_prints_differs_for_what_does_not_fit():
    res = migration_preflight(workload(by_gpu={0: 20}), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=1),
                              ROOT, ROOT)
    assert not res["ok"] and res["failed"] == ["free disk for the image (~24.2 GiB)"]
    assert "DIFFERS" in res["table"] and "hostb:%s has 1.0 GiB, the image needs 24.2 GiB" % ROOT in res["table"]


def test_filter_lines_open_with_the_headline_or_what_refuses():
    src, tgt = workload(by_gpu={0: 20}), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=1)
    refused = migration_preflight(src, tgt, ROOT, ROOT, migration_id="m-1", headline="Migration m-1: a -> b")
    assert refused["lines"] == ["Preflight failed for migration m-1: free disk for the image (~24.2 GiB)"
                                ] + refused["table"].split("\n")
    fits = migration_preflight(src, host("hostb", gpus=[gpu(0, 70), gpu(1, 70)]), ROOT, ROOT, migration_id="m-1",
                               headline="Migration m-1: a -> b")
    assert fits["ok"] and fits["lines"] == ["Migration m-1: a -> b"] + fits["table"].split("\n")


# -- the regression: GPU memory nothing could read once sized a 25.6 GB image at 1.3 GiB ------------------

DOUBLE = os.path.join(REPO, "tests", "doubles", "nvidia-smi")


def tree_of_a_cuda_process(gpu_uuid):
    """The tree facts of one running CUDA process (this test's own pid stands for it), its GPU memory read
    the way cuda_process_facts reads it."""
    pid = os.getpid()
    tree = {"root": pid, "exists": True, "pids": [pid], "cuda_pids": [pid], "cuda_states": {str(pid): "running"},
            "rss_bytes": GIB}
    tree.update(host_facts.tree_gpu_memory([pid], {pid: "running"}))
    src = source(gpus=[dict(gpu(0, 56), uuid=gpu_uuid)])
    return dict(src, tree=tree)


def test_regression_unknown_gpu_memory_without_pynvml_or_nvidia_smi_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", str(tmp_path / "not-installed" / "nvidia-smi"))
    src = tree_of_a_cuda_process("GPU-a")
    assert src["tree"]["gpu_bytes"] is None and "nvidia-ml-py" in src["tree"]["gpu_memory_unknown_reason"]
    res = migration_preflight(src, host("hostb", gpus=[gpu(0, 70)], disk_gib=20), ROOT, ROOT)
    assert res["ok"] is False and res["image_estimate_bytes"] is None
    assert "free disk for the image (~?)" in res["table"] and "UNKNOWN" in res["table"]
    assert "install nvidia-ml-py (NVML) or nvidia-smi on hosta" in res["table"]


def test_regression_with_nvidia_smi_the_24_gib_image_is_refused_for_20_gib_of_disk(monkeypatch, tmp_path):
    spec = tmp_path / "nvidia-smi.json"
    spec.write_text(json.dumps({"compute_apps": [{"pid": os.getpid(), "gpu_uuid": "GPU-a", "used_memory": 24 * 1024}]}))
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", DOUBLE)
    monkeypatch.setenv("GPUCKPT_FAKE_NVIDIA_SMI", str(spec))
    src = tree_of_a_cuda_process("GPU-a")
    assert src["tree"]["gpu_bytes"] == 24 * GIB and src["tree"]["gpu_memory_source"] == "nvidia-smi"
    res = migration_preflight(src, host("hostb", gpus=[gpu(0, 70)], disk_gib=20), ROOT, ROOT)
    assert res["ok"] is False and res["image_estimate_bytes"] == int(25 * GIB * 1.10)
    assert res["failed"] == ["free disk for the image (~27.5 GiB)"] and "DIFFERS" in res["table"]


def test_a_cuda_process_that_nvidia_smi_does_not_list_is_unknown(monkeypatch, tmp_path):
    spec = tmp_path / "nvidia-smi.json"
    # (another process's memory: a pid above the usual pid_max, never this test's, even as pid 1 of a namespace)
    spec.write_text(json.dumps({"compute_apps": [{"pid": 4190099, "gpu_uuid": "GPU-a", "used_memory": 1024}]}))
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", DOUBLE)
    monkeypatch.setenv("GPUCKPT_FAKE_NVIDIA_SMI", str(spec))
    tree = tree_of_a_cuda_process("GPU-a")["tree"]
    assert tree["gpu_bytes"] is None
    assert tree["gpu_memory_unknown_reason"].startswith("nvidia-smi reports no GPU memory for CUDA pid(s) %d; "
                                                        % os.getpid())


# -- torchrun's agent: a CUDA context nvidia-smi lists no memory for (issue 45) ---------------------------------
AGENT, RANK0, RANK1, OTHER = 4190001, 4190002, 4190003, 4190009  # (no such processes: above the usual pid_max)


def smi_gpu(index, used_mib, uuid=None):
    return {"index": index, "name": H100, "uuid": uuid or "GPU-%d" % index, "memory.total": 81559,
            "memory.used": used_mib, "memory.free": None if used_mib is None else 81559 - used_mib,
            "driver_version": "580.159.04"}


def torchrun_tree(monkeypatch, tmp_path, gpus, apps, opened=None):
    """The tree of a 2-rank torchrun job whose agent holds a CUDA context nvidia-smi does not list, its GPU memory
    read through the nvidia-smi TEST DOUBLE; ``opened``: the device files the agent holds ({pid: [...]})."""
    spec = tmp_path / "nvidia-smi.json"
    spec.write_text(json.dumps({"gpus": gpus, "compute_apps": apps}))
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", DOUBLE)
    monkeypatch.setenv("GPUCKPT_FAKE_NVIDIA_SMI", str(spec))
    monkeypatch.setattr(host_facts.gpu_usage, "_with_nvml", lambda read: None)  # (nvidia-smi answers, not NVML)
    inventory = [{"uuid": g["uuid"], "minor": g["index"]} for g in gpus]
    monkeypatch.setattr(host_facts.gpu_usage.devices, "inventory", lambda: inventory)
    monkeypatch.setattr(host_facts.gpu_procs, "nvidia_fds", lambda pid: (opened or {}).get(pid, []))
    states = {AGENT: "running", RANK0: "running", RANK1: "running"}
    tree = {"root": AGENT, "exists": True, "pids": [AGENT, RANK0, RANK1], "cuda_pids": [AGENT, RANK0, RANK1],
            "cuda_states": {str(p): s for p, s in states.items()}, "rss_bytes": 2 * GIB}
    tree.update(host_facts.tree_gpu_memory([AGENT, RANK0, RANK1], states))
    return tree


RANKS = [{"pid": RANK0, "gpu_uuid": "GPU-0", "used_memory": 20 * 1024},
         {"pid": RANK1, "gpu_uuid": "GPU-1", "used_memory": 20 * 1024}]


def test_a_torchrun_job_is_sized_by_its_gpus_used_memory_where_every_process_listed_there_is_its_own(
        monkeypatch, tmp_path):
    """Both GPUs list only the job's ranks: each GPU's memory.used (its ranks, the agent's context and the driver's
    own) bounds the job's memory there; the checks it sizes pass, each saying it is a bound."""
    tree = torchrun_tree(monkeypatch, tmp_path, [smi_gpu(0, 21 * 1024), smi_gpu(1, 20 * 1024 + 512)], RANKS)
    assert tree["gpu_bytes_by_gpu"] == {"GPU-0": 21 * GIB, "GPU-1": 20 * GIB + 512 * 2**20}, tree
    assert tree["gpu_bytes"] == 41 * GIB + 512 * 2**20 and tree["gpu_memory_unknown_reason"] is None
    assert tree["gpu_memory_source"] == "nvidia-smi memory.used"
    assert "upper bound from the GPU's used memory" in tree["gpu_memory_bound"]
    assert "no memory for pid(s) %d" % AGENT in tree["gpu_memory_bound"], tree["gpu_memory_bound"]
    src = dict(source(gpus=[dict(gpu(0, 59), uuid="GPU-0"), dict(gpu(1, 60), uuid="GPU-1")]), tree=tree)
    p = planner.plan_move(tree, src, host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=500), planner.options(
        source_path=ROOT, target_path=ROOT))
    assert p.ok and not p.unknown, p
    for name in ("gpu_memory", "disk", "host_ram"):
        assert status(p, name) == [planner.OK] and "upper bound from the GPU's used memory" in reason(p, name), name
    assert p.image_estimate_bytes == int((2 * GIB + tree["gpu_bytes"]) * planner.IMAGE_MARGIN)
    # a bound that does not fit refuses, saying it is a bound
    small = planner.plan_move(tree, src, host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=30),
                              planner.options(source_path=ROOT, target_path=ROOT))
    assert small.failed == ["disk"] and "the GPU memory is an upper bound" in reason(small, "disk")


def test_no_bound_where_a_gpu_the_job_may_use_lists_another_process(monkeypatch, tmp_path):
    """The agent names no device file: it may hold its context on any GPU, and GPU-2 runs another job: UNKNOWN
    (never 0), saying why; with the agent's device files naming GPUs 0 and 1 only, the bound holds."""
    gpus = [smi_gpu(0, 21 * 1024), smi_gpu(1, 21 * 1024), smi_gpu(2, 30 * 1024)]
    apps = RANKS + [{"pid": OTHER, "gpu_uuid": "GPU-2", "used_memory": 30 * 1024}]
    tree = torchrun_tree(monkeypatch, tmp_path, gpus, apps)
    assert tree["gpu_bytes"] is None and not tree.get("gpu_memory_bound")
    assert "GPU GPU-2 also runs pid %d" % OTHER in tree["gpu_memory_unknown_reason"], tree["gpu_memory_unknown_reason"]
    src = dict(source(gpus=[gpu(0, 59), gpu(1, 59), gpu(2, 50)]), tree=tree)
    p = planner.plan_move(tree, src, host("hostb", gpus=[gpu(0, 70), gpu(1, 70), gpu(2, 70)]), planner.options(
        source_path=ROOT, target_path=ROOT))
    assert set(p.unknown) >= {"gpu_memory", "disk", "host_ram"}
    opened = {AGENT: ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]}
    tree = torchrun_tree(monkeypatch, tmp_path, gpus, apps, opened)
    assert tree["gpu_bytes_by_gpu"] == {"GPU-0": 21 * GIB, "GPU-1": 21 * GIB}, tree
    # a GPU the agent may use on which the list shows none of the job's processes: it may miss others there too
    lone = torchrun_tree(monkeypatch, tmp_path, gpus, RANKS, {AGENT: ["/dev/nvidia0", "/dev/nvidia2"]})
    assert lone["gpu_bytes"] is None and "shows none of them on GPU GPU-2" in lone["gpu_memory_unknown_reason"], lone
    # another process on a GPU a rank is listed on: no bound
    shared = torchrun_tree(monkeypatch, tmp_path, gpus, RANKS + [{"pid": OTHER, "gpu_uuid": "GPU-1",
                                                                  "used_memory": 1024}], opened)
    assert shared["gpu_bytes"] is None and "GPU GPU-1 also runs pid %d" % OTHER in shared["gpu_memory_unknown_reason"]


def test_no_bound_where_the_gpu_reports_no_used_memory_and_unknown_is_never_zero(monkeypatch, tmp_path):
    tree = torchrun_tree(monkeypatch, tmp_path, [smi_gpu(0, None), smi_gpu(1, 21 * 1024)], RANKS)
    assert tree["gpu_bytes"] is None and "GPU GPU-0 reports no used memory" in tree["gpu_memory_unknown_reason"]
    # the agent listed without a figure ([N/A]) on GPU 0: its GPU is known
    listed = RANKS + [{"pid": AGENT, "gpu_uuid": "GPU-0", "used_memory": None}]
    tree = torchrun_tree(monkeypatch, tmp_path, [smi_gpu(0, 21 * 1024), smi_gpu(1, 20 * 1024)], listed)
    assert tree["gpu_bytes_by_gpu"] == {"GPU-0": 21 * GIB, "GPU-1": 20 * GIB}


def test_the_bound_through_nvml(monkeypatch):
    """The same rule when NVML answers (a fake pynvml): the agent is listed with no figure (NVML_VALUE_NOT_AVAILABLE
    reads as None), every process on both GPUs is the job's."""
    import types
    procs = {0: [(RANK0, 20 * GIB), (AGENT, None)], 1: [(RANK1, 20 * GIB)]}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: "580.159.04",
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: H100,
        nvmlDeviceGetUUID=lambda h: "GPU-%d" % h,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * GIB, used=(21 + h) * GIB,
                                                                free=(59 - h) * GIB),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=p, usedGpuMemory=b)
                                                        for p, b in procs[h]])
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setattr(host_facts.gpu_usage.devices, "inventory", lambda: [])
    monkeypatch.setattr(host_facts.gpu_procs, "nvidia_fds", lambda pid: [])
    states = {AGENT: "running", RANK0: "running", RANK1: "running"}
    mem = host_facts.tree_gpu_memory([AGENT, RANK0, RANK1], states)
    assert mem["gpu_bytes_by_gpu"] == {"GPU-0": 21 * GIB, "GPU-1": 22 * GIB} and mem["gpu_memory_source"] == \
        "nvml memory.used", mem


def test_a_checkpointed_or_cpu_only_tree_holds_no_gpu_memory_without_asking(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUCKPT_NVIDIA_SMI", str(tmp_path / "not-installed" / "nvidia-smi"))
    pid = os.getpid()
    for states in ({pid: "checkpointed"}, {}):
        mem = host_facts.tree_gpu_memory([pid], states)
        assert mem["gpu_bytes"] == 0 and mem["gpu_memory_source"] == "none"


def test_gpu_memory_on_a_target_without_gpus_does_not_fit():
    p = plan(workload(by_gpu={0: 1}), host("hostb", gpus=[]), check_gpus=True)
    assert "gpu_memory" in p.failed and "the target has no GPU for the workload's 1.0 GiB" in reason(p, "gpu_memory")
