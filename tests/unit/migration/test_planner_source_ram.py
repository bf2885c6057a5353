"""migration/planner.py with the source's image in memory (image_in_memory): the source's disk no longer
counts, and its RAM must hold the image, the GPU memory stage 1 brings into host RAM, and a reserve."""
from __future__ import annotations

from test_planner import ROOT, gpu, host, plan, reason, status, workload


def target():
    return host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])


def test_off_by_default_and_the_sources_disk_counts():
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=host("hosta", gpus=[gpu(0, 60), gpu(1, 60)], disk_gib=1)),
             target())
    assert status(p, "source_ram") == [] and p.failed == ["disk"]


def test_in_memory_the_sources_disk_does_not_count_and_its_ram_does():
    src = host("hosta", gpus=[gpu(0, 60), gpu(1, 60)], disk_gib=1, ram_gib=100)
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src), target(), image_in_memory=True)
    assert p.ok, p.checks
    disk = [c for c in p.checks if c.name == "disk"][0]
    assert disk.source == "in memory"
    assert status(p, "source_ram") == ["ok"]


def test_in_memory_a_source_whose_ram_does_not_hold_image_and_stage1_is_refused():
    # image 24.2 GiB + 20 GiB brought in by stage 1 + a 12.8 GiB reserve (5 % of 256 GiB) > 50 GiB
    src = host("hosta", gpus=[gpu(0, 60), gpu(1, 60)], ram_gib=50)
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src), target(), image_in_memory=True)
    assert not p.ok and p.failed == ["source_ram"]
    assert "hosta has 50.0 GiB available, the image in memory needs 57.0 GiB" in reason(p, "source_ram")
    assert "gpuckpt_image_in_memory off" in reason(p, "source_ram")


def test_in_memory_an_unknown_gpu_memory_is_unknown_not_zero():
    allowed = ["gpu_memory", "disk", "host_ram"]
    p = plan(workload(rss_gib=2, by_gpu=None), target(), image_in_memory=True, allow_unknown=allowed)
    assert status(p, "source_ram") == ["unknown"] and not p.ok
    assert "GPU memory is not known" in reason(p, "source_ram")
    assert plan(workload(rss_gib=2, by_gpu=None), target(), image_in_memory=True,
                allow_unknown=["gpu_memory", "disk", "host_ram", "source_ram"]).ok


def test_in_memory_a_source_that_reports_no_memory_is_unknown():
    src = host("hosta", gpus=[gpu(0, 60), gpu(1, 60)])
    src["memory"] = {"total_bytes": None, "available_bytes": None}
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src), target(), image_in_memory=True)
    assert status(p, "source_ram") == ["unknown"] and "not reported by hosta" in reason(p, "source_ram")


def test_the_filter_passes_it_on():
    from ansible_collections.gpuckpt.fleet.plugins.filter.migration import migration_preflight
    src = host("hosta", gpus=[gpu(0, 60), gpu(1, 60)], disk_gib=1, ram_gib=100)
    out = migration_preflight(workload(rss_gib=2, by_gpu={0: 20}, src=src), target(), ROOT, ROOT,
                              image_in_memory=True)
    assert out["ok"] and any(r["check"].startswith("host RAM on the source") for r in out["rows"]), out["rows"]
