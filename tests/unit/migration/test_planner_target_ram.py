"""migration/planner.py with the target's image in memory (target_image_in_memory): the target's disk no longer
counts, and its RAM must hold the image, the restored job's memory and a reserve (in_memory.target_plan checks the
same again in gpu_migration's begin, before anything is frozen)."""
from __future__ import annotations

from test_planner import ROOT, gpu, host, plan, reason, status, workload


def src(**kw):
    return host("hosta", gpus=[gpu(0, 60), gpu(1, 60)], **kw)


def test_in_memory_the_targets_disk_does_not_count_and_its_ram_holds_the_image_twice():
    # image 24.2 GiB (22 GiB times 1.10) twice + a 12.8 GiB reserve (5 % of 256 GiB) = 61.2 GiB
    fits = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src()), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)],
                disk_gib=1, ram_gib=62), target_image_in_memory=True)
    assert fits.ok, fits.checks
    disk = [c for c in fits.checks if c.name == "disk"][0]
    assert disk.target == "in memory" and status(fits, "host_ram") == ["ok"]
    short = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src()), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)],
                 ram_gib=60), target_image_in_memory=True)
    assert short.failed == ["host_ram"]
    assert "hostb has 60.0 GiB available, the restore with the image in memory needs 61.2 GiB" in reason(short, "host_ram")
    assert "gpuckpt_target_image_in_memory off" in reason(short, "host_ram")
    # On the disk, the same target fits (its RAM holds the restore alone).
    assert plan(workload(rss_gib=2, by_gpu={0: 20}, src=src()), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)],
                ram_gib=60)).ok


def test_both_in_memory_leaves_no_disk_to_check():
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src(disk_gib=1, ram_gib=100)),
             host("hostb", gpus=[gpu(0, 70), gpu(1, 70)], disk_gib=1, ram_gib=100),
             image_in_memory=True, target_image_in_memory=True)
    assert p.ok, p.checks
    disk = [c for c in p.checks if c.name == "disk"][0]
    assert (disk.source, disk.target, disk.status) == ("in memory", "in memory", "ok")


def test_in_memory_an_unknown_size_or_memory_is_unknown_not_zero():
    allowed = ["gpu_memory", "disk"]
    p = plan(workload(rss_gib=2, by_gpu=None), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)]),
             target_image_in_memory=True, allow_unknown=allowed)
    assert status(p, "host_ram") == ["unknown"] and "GPU memory is not known" in reason(p, "host_ram")
    tgt = host("hostb", gpus=[gpu(0, 70), gpu(1, 70)])
    tgt["memory"] = {"total_bytes": None, "available_bytes": None}
    p = plan(workload(rss_gib=2, by_gpu={0: 20}, src=src()), tgt, target_image_in_memory=True)
    assert status(p, "host_ram") == ["unknown"] and "not reported by hostb" in reason(p, "host_ram")


def test_the_filter_passes_it_on():
    from ansible_collections.gpuckpt.fleet.plugins.filter.migration import migration_preflight
    out = migration_preflight(workload(rss_gib=2, by_gpu={0: 20}, src=src()), host("hostb", gpus=[gpu(0, 70), gpu(1, 70)],
                              disk_gib=1, ram_gib=100), ROOT, ROOT, target_image_in_memory=True)
    assert out["ok"] and any(r["check"].startswith("host RAM on the target") for r in out["rows"]), out["rows"]
