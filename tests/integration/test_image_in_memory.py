"""migrate.yml with the source's image in memory (gpuckpt_image_in_memory, issue 32): a tmpfs of the
image's own on the source, mounted before the freeze, gone with the settlement. Between two real sshd
"hosts" on loopback, real ssh and CRIU; the GPU stage against the libcuda TEST DOUBLE (its nvidia-smi
TEST DOUBLE lists 1 MiB of GPU memory per CUDA process, so the size is known).

Each test ends with exactly one copy running intact, and no image tmpfs left on either host."""
from __future__ import annotations

import json
import os

from loopback_workloads import changed_tasks, migrate, restore_fails_on

MOUNT_SOURCE = "gpuckpt-image"


def image_mounts(hosts, host):
    """The image tmpfs mounts seen in ``host``'s mount namespace."""
    out = hosts.ssh(host, "cat /proc/self/mountinfo").stdout
    return [line for line in out.splitlines() if " tmpfs %s " % MOUNT_SOURCE in line]


def planned(hosts, mid):
    with open(hosts.path("hosta", "journal", "%s.source.json" % mid)) as fh:
        return json.load(fh)


def test_the_source_image_stays_in_memory_and_goes_with_the_commit(playbook, hosts, remote_workload):
    w = remote_workload(mb=32)
    before = w.counts()
    run = migrate(playbook, hosts, w, "t-mem-move", gpuckpt_image_in_memory=True)
    assert run.rc == 0, run.stdout
    mem = run.task("Stage 1/3")["image_in_memory"]
    image_bytes = run.task("Stage 1/3")["image_bytes"]
    # The whole image was in the tmpfs (its size from the tree's RSS and the double's GPU memory), none on disk.
    assert mem["used_bytes"] >= image_bytes > 32 * 2**20 and mem["size_bytes"] >= mem["used_bytes"]
    assert mem["gpu_bytes"] == 2 * 2**20 and mem["gpu_memory_source"] == "nvidia-smi"
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled"):  # large folios, none past a file's size
        assert mem["tmpfs_huge"] == mem["tmpfs_huge_mounted"] == "within_size"
    preflight = "\n".join(run.task("Show the preflight")["msg"])
    assert "host RAM on the source for the image in memory" in preflight and "in memory" in preflight
    assert w.one_copy_runs_intact() and w.counts()["parent"] > before["parent"]
    assert not image_mounts(hosts, "hosta") and not image_mounts(hosts, "hostb")
    assert not os.path.exists(hosts.path("hosta", "images", "t-mem-move"))
    doc = planned(hosts, "t-mem-move")
    assert doc["phase"] == "committed" and doc["image_in_memory"]["size_bytes"] == mem["size_bytes"]

    again = migrate(playbook, hosts, w, "t-mem-move", gpuckpt_image_in_memory=True)
    assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)
    assert w.one_copy_runs_intact()


def test_a_failed_target_restore_resumes_the_held_source_and_frees_the_memory(playbook, hosts, remote_workload):
    w = remote_workload(mb=32)
    with restore_fails_on(hosts):
        run = migrate(playbook, hosts, w, "t-mem-fail", gpuckpt_image_in_memory=True)
    assert run.rc != 0
    final = run.task("Migration failed and was rolled back")
    assert "runs on hosta" in final["msg"] and "CUDA_ERROR_OUT_OF_MEMORY" in final["msg"]
    assert run.task("Resume the source")["changed"] is True
    assert w.one_copy_runs_intact()
    assert not image_mounts(hosts, "hosta") and not os.path.exists(hosts.path("hosta", "images", "t-mem-fail"))
    again = migrate(playbook, hosts, w, "t-mem-fail", gpuckpt_image_in_memory=True)
    assert again.rc == 0 and changed_tasks(again) == []
    assert w.one_copy_runs_intact()


def test_an_image_that_outgrows_its_tmpfs_is_undone_and_the_source_runs_on(playbook, hosts, remote_workload):
    w = remote_workload(mb=32)
    run = migrate(playbook, hosts, w, "t-mem-full", gpuckpt_image_in_memory=True,
                  gpuckpt_image_memory_bytes=8 * 2**20)
    assert run.rc != 0
    assert "the image's tmpfs is full" in run.stdout and "image_memory_bytes" in run.stdout
    assert w.one_copy_runs_intact()
    assert not image_mounts(hosts, "hosta") and not os.path.exists(hosts.path("hosta", "images", "t-mem-full"))
    assert not os.path.exists(hosts.path("hostb", "images", "t-mem-full"))


def test_a_source_that_cannot_hold_the_image_is_refused_before_the_freeze(playbook, hosts, remote_workload):
    w = remote_workload(mb=8)
    run = migrate(playbook, hosts, w, "t-mem-ram", gpuckpt_image_in_memory=True, gpuckpt_image_memory_bytes=2**50)
    assert run.rc != 0
    assert "for the image in memory" in run.stdout and "nothing was frozen" in run.stdout
    # Refused in the checkpoint's first step: its journal never recorded a plan, let alone a freeze.
    assert not os.path.exists(hosts.path("hosta", "journal", "t-mem-ram.source.json"))
    assert w.one_copy_runs_intact()
    assert not image_mounts(hosts, "hosta") and not os.path.exists(hosts.path("hosta", "images", "t-mem-ram"))


def test_both_images_in_memory_move_and_leave_no_tmpfs_behind(playbook, hosts, remote_workload):
    """gpuckpt_target_image_in_memory: the target's copy lands in a tmpfs of its own as well (no disk on the migration
    path), removed with the commit; a failed restore there rolls back with nothing left on either host."""
    w = remote_workload(mb=32)
    run = migrate(playbook, hosts, w, "t-mem-both", gpuckpt_image_in_memory=True, gpuckpt_target_image_in_memory=True)
    assert run.rc == 0, run.stdout
    assert "(in memory)" in run.task("Start the migration")["msg"]
    preflight = "\n".join(run.task("Show the preflight")["msg"])
    assert "host RAM on the target for the restore and the image in memory" in preflight
    with open(hosts.path("hostb", "journal", "t-mem-both.target.json")) as fh:
        target_doc = json.load(fh)
    assert target_doc["phase"] == "committed" and target_doc["image_in_memory"]["size_bytes"] > 32 * 2**20
    assert w.one_copy_runs_intact()
    assert not image_mounts(hosts, "hosta") and not image_mounts(hosts, "hostb")
    assert not os.path.exists(hosts.path("hostb", "images", "t-mem-both"))
    again = migrate(playbook, hosts, w, "t-mem-both", gpuckpt_image_in_memory=True, gpuckpt_target_image_in_memory=True)
    assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)

    with restore_fails_on(hosts, "hosta"):
        back = migrate(playbook, hosts, w, "t-mem-both-fail", source="hostb", target="hosta",
                       gpuckpt_target_image_in_memory=True)
    assert back.rc != 0 and "runs on hostb" in back.task("Migration failed and was rolled back")["msg"]
    assert w.one_copy_runs_intact()
    assert not image_mounts(hosts, "hosta") and not image_mounts(hosts, "hostb")
    assert not os.path.exists(hosts.path("hosta", "images", "t-mem-both-fail"))

    kept = migrate(playbook, hosts, w, "t-mem-both-keep", source="hostb", target="hosta",
                   gpuckpt_target_image_in_memory=True, gpuckpt_keep_target_image=True)
    assert kept.rc != 0 and "gpuckpt_keep_target_image would hold the image's tmpfs" in kept.stdout
    assert w.one_copy_runs_intact()
