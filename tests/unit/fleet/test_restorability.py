"""Restorability (fleet/restorability.py) and the failover's plan (fleet/failover.py): an image's recorded facts against a host's, through the migration's
planner; the choice of the image and the host of a failover, and what refuses one."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import failover as f, restorability as r

GIB = 2**30
ROOT = "/var/lib/gpuckpt/images"


def host(name, driver="580.65", api="13.0", free_mib=80 * 1024, pids_in_use=(), kernel="6.8.0-45", runtimes=("runc",),
         criu="4.2.1", disk=500 * GIB, ram=200 * GIB, gpus=1, drain=None):
    return {"host": {"hostname": name, "kernel": kernel}, "memory": {"available_bytes": ram},
            "driver": {"available": True, "checkpoint_api": True, "driver_version": driver, "api_version": api},
            "gpus": [{"index": i, "name": "H100", "uuid": "GPU-%s-%d" % (name, i), "memory_free_mib": free_mib}
                     for i in range(gpus)],
            "gpu_source": "nvml", "criu": {"version": criu, "supported": True, "check_ok": True},
            "disk": {ROOT: {"free_bytes": disk}}, "pids_in_use": list(pids_in_use), "runtimes_present": list(runtimes),
            "drain": drain}


def image(ident="img-3", at="2026-11-25T10:00:00+00:00", epoch=1, size=4 * GIB, verified=True, corrupt=None,
          complete=True, backend="process", pids=(4242, 4243), cuda_pids=(4243,), driver="580.65", replica="rep1",
          kernel="6.8.0-45", criu="4.2.1", progress=None):
    return {"id": ident, "path": "/r/job/%s" % ident, "checkpoint_at": at, "created": at, "bytes": size,
            "verified": verified, "corrupt": corrupt, "epoch": epoch, "node": "node1", "progress": progress,
            "stall_s": 0.8, "complete": complete, "replica": replica,
            "facts": {"host": {"hostname": "node1", "kernel": kernel, "driver_version": driver, "cuda_api_version": "13.0",
                               "gpus": [{"index": 0, "name": "H100", "uuid": "GPU-node1-0"},
                                        {"index": 1, "name": "H100", "uuid": "GPU-node1-1"}],
                               "gpu_source": "nvml", "criu_version": criu},
                      "runtime": {"backend": backend, "container": None if backend == "process" else "train-7"},
                      "target": {"pids": list(pids), "cuda_pids": list(cuda_pids), "workload": str(pids[0]),
                                 "gpus": {str(p): [{"uuid": "GPU-node1-0", "minor": 0}] for p in cuda_pids}},
                      "gpu_stage": "done" if cuda_pids else "skipped", "image_bytes": size}}


def checks(verdict):
    return {c["name"]: c for c in verdict["checks"]}


# -- one image on one host ------------------------------------------------------------------------------

def test_an_image_on_a_matching_host_is_restorable_and_every_check_is_named():
    v = r.restorability(image(), host("hostb"), r.options(target_path=ROOT))
    assert v["restorable"], v["reasons"]
    assert [c["name"] for c in v["checks"]] == list(r.CHECK_NAMES)
    assert {c["status"] for c in v["checks"]} == {r.OK}


def test_another_driver_version_is_refused_and_accepted_only_when_allowed_by_name():
    v = r.restorability(image(driver="570.86"), host("hostb", driver="580.65"), r.options(target_path=ROOT))
    assert not v["restorable"] and v["failed"] == ["driver_version"]
    assert checks(v)["driver_version"]["reason"] == "570.86 in the image, 580.65 on the target"
    allowed = r.options(target_path=ROOT, allow_driver_mismatch=True)
    assert r.restorability(image(driver="570.86"), host("hostb"), allowed)["restorable"]


def test_a_driver_version_the_image_does_not_record_is_unknown_never_a_match():
    v = r.restorability(image(driver=None), host("hostb"), r.options(target_path=ROOT))
    assert not v["restorable"] and "driver_version" in v["unknown"] and not v["failed"]
    assert "not known" in checks(v)["driver_version"]["reason"]
    assert r.restorability(image(driver=None), host("hostb"),
                           r.options(target_path=ROOT, allow_unknown=["driver_version"]))["restorable"]


def test_gpu_memory_is_unknown_where_the_host_reports_no_free_memory():
    v = r.restorability(image(), host("hostb", free_mib=None), r.options(target_path=ROOT))
    assert not v["restorable"] and v["unknown"] == ["gpu_memory"] and not v["failed"]
    assert "reports no free memory" in checks(v)["gpu_memory"]["reason"]


def test_gpu_memory_passes_where_the_whole_image_fits_and_is_unknown_where_it_does_not():
    fits = r.restorability(image(size=4 * GIB), host("hostb", free_mib=8 * 1024), r.options(target_path=ROOT))
    assert checks(fits)["gpu_memory"]["status"] == r.OK and "at most" in checks(fits)["gpu_memory"]["image"]
    # 4 GiB free, a 6 GiB image: its GPU memory, a part of it, may fit or not: not known, never taken as fitting
    tight = r.restorability(image(size=6 * GIB), host("hostb", free_mib=4 * 1024), r.options(target_path=ROOT))
    gm = checks(tight)["gpu_memory"]
    assert gm["status"] == r.UNKNOWN and "does not record the workload's GPU memory" in gm["reason"]
    assert "6.0 GiB" in gm["reason"] and not tight["restorable"]


def test_gpu_memory_the_image_records_is_checked_as_it_is():
    img = image(size=20 * GIB)
    img["facts"]["target"]["gpu_bytes_by_gpu"] = {"GPU-node1-0": 2 * GIB}
    img["facts"]["target"]["gpu_bytes"] = 2 * GIB
    assert checks(r.restorability(img, host("hostb", free_mib=4 * 1024), r.options(target_path=ROOT)))["gpu_memory"][
        "status"] == r.OK
    img["facts"]["target"]["gpu_bytes_by_gpu"] = {"GPU-node1-0": 6 * GIB}
    v = r.restorability(img, host("hostb", free_mib=4 * 1024), r.options(target_path=ROOT))
    assert checks(v)["gpu_memory"]["status"] == r.FAILS


def test_only_the_gpus_the_workload_held_count_not_every_gpu_of_the_node():
    # the node had two GPUs, the job held one: a host with one GPU can restore it
    v = r.restorability(image(), host("hostb", gpus=1), r.options(target_path=ROOT))
    assert checks(v)["gpu_count"]["status"] == r.OK


def test_a_cpu_image_needs_no_driver():
    v = r.restorability(image(cuda_pids=()), dict(host("hostb"), driver={"available": False, "checkpoint_api": False}),
                        r.options(target_path=ROOT))
    assert v["restorable"], v["reasons"]
    assert "driver_version" not in checks(v)


def test_a_bare_process_needs_its_pids_free_a_container_does_not():
    v = r.restorability(image(), host("hostb", pids_in_use=[4243]), r.options(target_path=ROOT))
    assert v["failed"] == ["pids"] and "4243" in checks(v)["pids"]["reason"]
    gathered_without = host("hostb")
    del gathered_without["pids_in_use"]
    assert r.restorability(image(), gathered_without, r.options(target_path=ROOT))["unknown"] == ["pids"]
    assert r.restorability(image(backend="runc"), host("hostb", pids_in_use=[4243]),
                           r.options(target_path=ROOT))["restorable"]


def test_the_runtime_must_be_on_the_host():
    v = r.restorability(image(backend="podman"), host("hostb", runtimes=("runc",)), r.options(target_path=ROOT))
    assert v["failed"] == ["runtime"] and "has no podman" in checks(v)["runtime"]["reason"]
    unknown = dict(host("hostb"), runtimes_present=None)
    assert r.restorability(image(backend="podman"), unknown, r.options(target_path=ROOT))["unknown"] == ["runtime"]


def test_criu_older_than_the_one_that_wrote_the_image_is_refused():
    v = r.restorability(image(criu="4.2.1"), host("hostb", criu="4.0"), r.options(target_path=ROOT))
    assert v["failed"] == ["criu"] and "older than the 4.2.1" in checks(v)["criu"]["reason"]
    old = r.restorability(image(), dict(host("hostb"), criu={"version": "3.17", "supported": False}),
                          r.options(target_path=ROOT))
    assert "criu" in old["failed"]


def test_another_kernel_is_for_criu_check_to_decide_unless_the_same_is_asked_for():
    other = host("hostb", kernel="6.11.0-9")
    assert checks(r.restorability(image(), other, r.options(target_path=ROOT)))["kernel"]["status"] == r.OK
    assert r.restorability(image(), other, r.options(target_path=ROOT, same_kernel=True))["failed"] == ["kernel"]
    unchecked = dict(other, criu={"version": "4.2.1", "supported": True})
    assert r.restorability(image(), unchecked, r.options(target_path=ROOT))["unknown"] == ["kernel"]


def test_disk_and_host_ram_take_the_images_recorded_size():
    v = r.restorability(image(size=10 * GIB), host("hostb", disk=5 * GIB, ram=8 * GIB), r.options(target_path=ROOT))
    assert v["failed"] == ["disk", "host_ram"]
    no_root = r.restorability(image(), host("hostb"), r.options())
    assert no_root["unknown"] == ["disk"] and "no image root" in checks(no_root)["disk"]["reason"]


def test_a_draining_host_and_a_corrupt_image_are_refused():
    assert r.restorability(image(), host("hostb", drain={"started": "t"}),
                           r.options(target_path=ROOT))["failed"] == ["not_draining"]
    v = r.restorability(image(verified=False, corrupt="checksum of pages-1.img"), host("hostb"),
                        r.options(target_path=ROOT))
    assert v["failed"] == ["image"] and "corrupt" in checks(v)["image"]["reason"]


def test_options_refuse_names_that_are_no_check():
    with pytest.raises(ValueError, match="names no check"):
        r.options(allow_unknown=["gpu_memry"])
    with pytest.raises(ValueError, match="unknown restorability options"):
        r.options(allow_mismatch=True)
    assert r.options(allow_unknown="[gpu_memory, disk]")["allow_unknown"] == ("gpu_memory", "disk")


def test_timestamps_as_recorded():
    assert r.timestamp("2026-11-25T10:00:00+00:00") == r.timestamp("2026-11-25T10:00:00Z") == 1795600800.0
    assert r.timestamp(1795600800) == 1795600800.0 and r.timestamp("1795600800.5") == 1795600800.5
    assert r.timestamp(None) is None and r.timestamp("yesterday") is None


# -- which image, onto which host ------------------------------------------------------------------------

IMAGES = [image("img-1", at="2026-11-25T09:00:00+00:00"), image("img-2", at="2026-11-25T09:15:00+00:00"),
          image("img-3", at="2026-11-25T09:30:00+00:00")]


def test_the_newest_verified_image_is_chosen():
    c = r.choose(IMAGES, {"hostb": host("hostb")}, target="hostb", opts=r.options(target_path=ROOT))
    assert c["image"]["id"] == "img-3" and c["target"] == "hostb" and c["skipped"] == []
    assert c["candidates"] == ["img-3", "img-2", "img-1"]


def test_a_corrupt_or_unverified_image_is_skipped_for_the_previous_verified_one():
    images = [image("img-1", at="2026-11-25T09:00:00+00:00"),
              image("img-2", at="2026-11-25T09:15:00+00:00", verified=False, corrupt="bad checksum"),
              image("img-3", at="2026-11-25T09:30:00+00:00", verified=False),
              image("img-4", at="2026-11-25T09:45:00+00:00", complete=False, verified=False)]
    c = r.choose(images, {"hostb": host("hostb")}, target="hostb", opts=r.options(target_path=ROOT))
    assert c["image"]["id"] == "img-1" and c["candidates"] == ["img-1"]
    assert [(s["id"], s["reason"].split(" ")[0]) for s in c["skipped"]] == [
        ("img-4", "incomplete"), ("img-3", "not"), ("img-2", "corrupt:")]


def test_an_image_of_an_older_epoch_is_never_taken_for_a_newer_one():
    late_old = image("old", at="2026-11-25T11:00:00+00:00", epoch=1)
    new = image("new", at="2026-11-25T10:00:00+00:00", epoch=2)
    assert [i["id"] for i in r.newest_first([late_old, new])] == ["new", "old"]


def test_an_image_not_restorable_on_the_target_is_skipped_with_why():
    images = [image("img-1", at="2026-11-25T09:00:00+00:00"),
              image("img-2", at="2026-11-25T09:30:00+00:00", driver="570.86")]
    c = r.choose(images, {"hostb": host("hostb")}, target="hostb", opts=r.options(target_path=ROOT))
    assert c["image"]["id"] == "img-1"
    assert c["skipped"][0]["id"] == "img-2" and "hostb: driver version: 570.86 in the image" in c["skipped"][0]["reason"]


def test_a_named_target_that_is_the_lost_node_is_refused():
    c = r.choose(IMAGES, {"node1": host("node1")}, target="node1", lost_node="node1")
    assert c["image"] is None and c["refused"] == "the target node1 is the lost node itself"


def test_without_a_target_the_host_is_chosen_as_a_drain_chooses_never_the_lost_node():
    hosts = {"node1": host("node1", free_mib=90 * 1024), "hostb": host("hostb", free_mib=40 * 1024),
             "hostc": host("hostc", free_mib=70 * 1024), "hostd": host("hostd", driver="570.86"), "hoste": "unreachable: x"}
    c = r.choose(IMAGES, hosts, lost_node="node1", opts=r.options(target_paths={n: ROOT for n in hosts}))
    assert c["target"] == "hostc"  # the most free GPU memory, as drain's placement orders them
    assert c["hosts"]["hostb"].startswith("fits too; hostc was chosen")
    assert c["hosts"]["hostd"].startswith("not restorable: driver version")
    assert c["hosts"]["hoste"] == "no facts: unreachable: x" and "node1" not in c["hosts"]


def test_no_host_that_can_be_asked_refuses():
    c = r.choose(IMAGES, {"hostb": "unreachable: ssh"}, lost_node="node1")
    assert c["image"] is None and "could be asked" in c["refused"]


# -- the failover's plan ---------------------------------------------------------------------------------

def listing(images, owner="node1", epoch=1, history=()):
    return {"record": {"job": "train", "epoch": epoch, "owner": owner, "history": list(history)}, "images": images}


def test_the_plan_names_the_image_the_replica_and_what_the_other_replicas_record():
    rep2 = [dict(i, replica="rep2") for i in IMAGES[:2]]
    plan = f.plan_failover({"rep1": listing(IMAGES), "rep2": listing(rep2)}, {"hostb": host("hostb")}, "train", "node1",
                           target="hostb", opts=r.options(target_path=ROOT))
    assert plan["ok"] and plan["replica"] == "rep1" and plan["image"]["id"] == "img-3"
    assert plan["image"]["checkpoint_ts"] == r.timestamp("2026-11-25T09:30:00+00:00")
    assert plan["epoch"] == 1 and plan["others"] == {"rep2": ["img-2", "img-1"]}
    assert plan["lines"][0].startswith("Failover of job train from node1 onto hostb: image img-3 of replica rep1")


def test_a_job_failed_over_already_is_refused_and_so_is_a_target_that_owns_it():
    history = [{"event": "failover", "epoch": 2, "owner": "hostb", "from": "node1", "at": "2026-11-25T11:00:00Z"}]
    listings = {"rep1": listing(IMAGES, owner="hostb", epoch=2, history=history)}
    twice = f.plan_failover(listings, {"hostc": host("hostc")}, "train", "node1", target="hostc")
    assert not twice["ok"] and "runs on hostb since epoch 2 (failed over from node1" in twice["refused"]
    owns = f.plan_failover(listings, {"hostb": host("hostb")}, "train", "node1", target="hostb")
    assert not owns["ok"] and owns["refused"].startswith("hostb already owns job train since epoch 2")
    assert owns["lines"][0].startswith("Failover of job train from node1: REFUSED")


def test_the_plan_refuses_the_lost_node_as_target_and_replicas_that_cannot_be_read():
    assert f.plan_failover({"rep1": listing(IMAGES)}, {}, "train", "node1", target="node1")["refused"] == \
        "the target node1 is the lost node itself"
    plan = f.plan_failover({"rep1": "unreachable: no route"}, {"hostb": host("hostb")}, "train", "node1")
    assert not plan["ok"] and plan["refused"] == "no replica could be read: rep1: unreachable: no route"


def test_the_newest_record_of_the_replicas_decides():
    rec = f.newest_record({"rep1": {"epoch": 1, "owner": "node1"}, "rep2": {"epoch": 2, "owner": "hostb"}, "rep3": None})
    assert rec == ("rep2", {"epoch": 2, "owner": "hostb"})


def test_registered_results_are_unwrapped_or_say_why_not():
    assert r.facts_of({"ansible_facts": {"gpuckpt": {"host": {}}}}) == {"host": {}}
    assert r.facts_of({"unreachable": True, "msg": "ssh"}) == "unreachable: ssh"
    assert r.facts_of(None) == "not asked"
    assert r.listing_of({"record": {"epoch": 1}, "images": []}) == {"record": {"epoch": 1}, "images": []}
    assert r.listing_of({"failed": True, "msg": "no such job"}) == "its listing failed: no such job"


def test_the_images_report_lists_each_image_with_its_verdict():
    rep = f.report_images({"rep1": listing([image("img-1", progress={"step": 1200}),
                                            image("img-2", at="2026-11-25T09:00:00+00:00", driver="570.86")]),
                           "rep2": "unreachable: x"},
                          host("hostb"), "hostb", r.options(target_path=ROOT), job="train")
    assert rep["lines"][0] == "Images of job train (owner node1, epoch 1): 2 on 1 replica(s)"
    assert [(i["id"], i["restorable"]) for i in rep["images"]] == [("img-1", True), ("img-2", False)]
    assert rep["lines"][1].endswith('verified  epoch 1  progress {"step": 1200}') and "4.0 GiB" in rep["lines"][1]
    assert rep["lines"][2] == "    RESTORABLE on hostb"
    assert rep["lines"][4].startswith("    NOT restorable on hostb: driver version")
    assert rep["lines"][-1] == "  REPLICA rep2 not read: unreachable: x"
    listed = f.report_images({"rep1": listing([image()])})
    assert "restorable" not in listed["images"][0]


def test_reasons_name_the_host_by_its_inventory_name_and_its_hostname():
    v = r.restorability(image(), host("vm", pids_in_use=[4242]), r.options(target_path=ROOT), name="tgt")
    assert checks(v)["pids"]["reason"] == "pid(s) 4242 are in use on tgt (vm)"
    assert checks(v)["disk"]["status"] == r.OK
