"""fleet/placement.py: where each workload of a draining node goes. Host facts in the shape cuda_process_facts
returns; moves and stays, each with its reasons, out. Pure: no host is asked."""
from __future__ import annotations

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import ID_RE as JOURNAL_ID
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import placement

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
ROOT = "/var/lib/gpuckpt/images"
PATHS = {"hostb": ROOT, "hostc": ROOT, "hostd": ROOT}


def gpu(host, index, free_gib, name=H100):
    return {"index": index, "name": name, "uuid": "GPU-%s-%d" % (host, index), "memory_total_mib": 80 * 1024,
            "memory_free_mib": None if free_gib is None else int(free_gib * 1024)}


def host(name, free=(70, 70), disk_gib=500, ram_gib=200, runtimes=("runc", "podman"), drain=None, pids_in_use=()):
    return {"host": {"hostname": name}, "memory": {"total_bytes": 256 * GIB, "available_bytes": ram_gib * GIB},
            "driver": {"available": True, "checkpoint_api": True, "driver_version": "580.159.04", "api_version": "13.0"},
            "gpus": [gpu(name, i, f) for i, f in enumerate(free)], "gpu_source": "nvml",
            "criu": {"installed": True, "version": "4.2.1", "supported": True, "check_ok": True},
            "disk": {ROOT: {"free_bytes": disk_gib * GIB}}, "pids_in_use": list(pids_in_use),
            "runtimes_present": None if runtimes is None else list(runtimes), "drain": drain}


NODE = host("node", free=(10, 10))


def workload(key, by_gpu=None, rss_gib=2, kind=None, runtime=None, pid=4242):
    """A workload of NODE with its GPU memory on the node's GPUs ({index: GiB}); by_gpu None: unknown."""
    runtime = runtime or key.split(":")[0]
    kind = kind or ("process" if runtime == "process" else "container")
    tree = {"root": pid, "exists": True, "pids": [pid], "cuda_pids": [pid], "cuda_states": {str(pid): "running"},
            "rss_bytes": rss_gib * GIB}
    if by_gpu is None:
        tree.update(gpu_bytes=None, gpu_bytes_by_gpu=None, gpu_memory_unknown_reason="neither NVML nor nvidia-smi")
    else:
        per = {"GPU-node-%d" % i: int(n * GIB) for i, n in by_gpu.items()}
        tree.update(gpu_bytes=sum(per.values()), gpu_bytes_by_gpu=per)
    w = {"key": key, "kind": kind, "runtime": runtime, "root_pid": pid, "tree": tree}
    if kind == "container":
        w["container"] = key.split(":", 1)[1]
    else:
        w["pid"] = pid
    return w


def place(workloads, targets, **kw):
    return placement.place(NODE, workloads, targets, ROOT, PATHS, **kw)


def where(moves):
    return {m["workload"]["key"]: m["target"] for m in moves}


def test_a_workload_that_fits_the_only_target_moves_there_onto_the_gpu_of_its_place():
    moves, stays = place([workload("runc:train-7", by_gpu={1: 20})], {"hostb": host("hostb")})
    assert stays == [] and len(moves) == 1
    m = moves[0]
    assert (m["target"], m["gpus"], m["rejected"]) == ("hostb", ["GPU-hostb-1"], {})
    assert m["image_estimate_bytes"] == int(22 * GIB * 1.10)


@pytest.mark.parametrize("case,target,why", [
    ("GPU memory of the GPU it lands on", host("hostb", free=(10, 70)),
     "free GPU memory on target: GPU 0 (GPU-hostb-0) has 10.0 GiB free, the workload needs 20.0 GiB there"),
    ("disk", host("hostb", disk_gib=20), "the image needs 24.2 GiB"),
    ("host RAM", host("hostb", ram_gib=16), "host RAM for the restore (MemAvailable): hostb has 16.0 GiB"),
    ("draining target", host("hostb", drain={"started": "2026-11-25T14:00:00Z"}),
     "target not draining: hostb is draining (since 2026-11-25T14:00:00Z"),
    ("runtime missing", host("hostb", runtimes=("podman",)), "runc on target: hostb has no runc"),
    ("runtime unknown", host("hostb", runtimes=None), "runc on target: hostb does not report its runtimes"),
])
def test_what_does_not_fit_stays_with_the_reason_of_each_target(case, target, why):
    moves, stays = place([workload("runc:train-7", by_gpu={0: 20})], {"hostb": target})
    assert moves == [], case
    assert [s["reason"] for s in stays] == ["fits on no target"]
    assert why in stays[0]["rejected"]["hostb"], stays[0]["rejected"]


def test_a_bare_process_needs_no_runtime_but_its_pids_free():
    w = workload("process:4242", by_gpu={0: 20})
    assert place([w], {"hostb": host("hostb", runtimes=None)})[0], "a process needs no runtime"
    moves, stays = place([w], {"hostb": host("hostb", pids_in_use=[4242])})
    assert not moves and "pid(s) 4242 are in use on hostb" in stays[0]["rejected"]["hostb"]


def test_unknown_gpu_memory_is_refused_unless_allowed_by_name():
    w = workload("runc:train-7", by_gpu=None)
    moves, stays = place([w], {"hostb": host("hostb")})
    assert not moves and "the workload's GPU memory is not known" in stays[0]["rejected"]["hostb"]
    moves, stays = place([w], {"hostb": host("hostb")}, allow_unknown=("gpu_memory", "disk", "host_ram"))
    assert where(moves) == {"runc:train-7": "hostb"} and moves[0]["image_estimate_bytes"] is None


def test_the_runtime_check_can_be_allowed_unknown_by_name():
    moves, stays = place([workload("runc:train-7", by_gpu={0: 1})], {"hostb": host("hostb", runtimes=None)},
                         allow_unknown=("runtime",))
    assert where(moves) == {"runc:train-7": "hostb"} and not stays


@pytest.mark.parametrize("case,target,second", [
    ("GPU memory", dict(free=(70, 70)), {0: 50}),
    ("disk", dict(disk_gib=20), {0: 10}),
    ("host RAM", dict(ram_gib=20), {0: 10}),
])
def test_what_one_move_takes_is_reserved_before_the_next_is_placed(case, target, second):
    """Two workloads that each fit a target alone but not together: the second goes elsewhere, or stays."""
    ws = [workload("runc:a", by_gpu=second), workload("runc:b", by_gpu=second)]
    moves, stays = place(ws, {"hostb": host("hostb", **target)})
    assert where(moves) == {"runc:a": "hostb"}, case
    assert [s["workload"]["key"] for s in stays] == ["runc:b"]
    moves, stays = place(ws, {"hostb": host("hostb", **target), "hostc": host("hostc", **target)})
    assert where(moves) == {"runc:a": "hostb", "runc:b": "hostc"} and not stays, case


def test_the_gpu_memory_reserved_is_on_the_gpu_the_memory_lands_on():
    ws = [workload("runc:a", by_gpu={0: 50}), workload("runc:b", by_gpu={1: 50})]
    moves, stays = place(ws, {"hostb": host("hostb", free=(70, 70))})
    assert where(moves) == {"runc:a": "hostb", "runc:b": "hostb"} and not stays


def test_the_hardest_workload_is_placed_first():
    """Placed in the order given, the small one would take hostb (more free memory) and the big one fit nowhere."""
    small, big = workload("runc:a-small", by_gpu={0: 30}), workload("runc:z-big", by_gpu={0: 50})
    moves, stays = place([small, big], {"hostb": host("hostb", free=(70, 70)), "hostc": host("hostc", free=(35, 35))})
    assert [m["workload"]["key"] for m in moves] == ["runc:z-big", "runc:a-small"]
    assert where(moves) == {"runc:z-big": "hostb", "runc:a-small": "hostc"} and not stays


def test_the_target_chosen_has_fewer_moves_planned_then_more_free_gpu_memory():
    ws = [workload("runc:%d" % i, by_gpu={0: 5}) for i in range(3)]
    moves, unused = place(ws, {"hostb": host("hostb", free=(70, 70)), "hostc": host("hostc", free=(60, 60))})
    assert [m["target"] for m in moves] == ["hostb", "hostc", "hostb"]
    assert moves[0]["rejected"] == {
        "hostc": "fits too; hostb was chosen (fewer moves planned there, or more free GPU memory)"}


def test_a_target_without_facts_is_rejected_with_why():
    moves, unused = place([workload("runc:a", by_gpu={0: 5})],
                          {"hostb": host("hostb"), "hostc": "unreachable: ssh: connect timed out"})
    assert where(moves) == {"runc:a": "hostb"}
    assert moves[0]["rejected"] == {"hostc": "no facts: unreachable: ssh: connect timed out"}
    unused, stays = place([workload("runc:a", by_gpu={0: 5})], {"hostc": "not asked"})
    assert stays[0]["rejected"] == {"hostc": "no facts: not asked"}


def test_with_throughputs_the_target_reached_soonest_is_chosen():
    ws = [workload("runc:a", by_gpu={0: 5})]
    targets = {"hostb": host("hostb", free=(70, 70)), "hostc": host("hostc", free=(60, 60))}
    moves, unused = place(ws, targets, throughput={"hostb": 1e8, "hostc": {"bytes_s": 1e9}})
    assert moves[0]["target"] == "hostc"
    assert "a faster link" in moves[0]["rejected"]["hostb"]


# -- the schedule ----------------------------------------------------------------------------------------

def move(key, target="hostb", size_s=10):
    """A move whose image takes ``size_s`` seconds at 1 GB/s (None: its size is unknown)."""
    return {"workload": {"key": key}, "target": target, "image_estimate_bytes": None if size_s is None else int(size_s * 1e9)}


TP = {"hostb": 1e9, "hostc": {"bytes_s": 1e9, "measured_at": "2026-11-25T14:00:00Z"}}


@pytest.mark.parametrize("parallel,batches", [(1, [0, 1, 2]), (2, [0, 0, 1]), (0, [0, 1, 2]), ("3", [0, 0, 0])])
def test_without_a_deadline_the_moves_run_in_placement_order_in_batches(parallel, batches):
    run, late = placement.schedule([move("c", size_s=50), move("a"), move("b", size_s=20)], parallel, throughput=TP)
    assert late == [] and [m["workload"]["key"] for m in run] == ["c", "a", "b"]
    assert [m["batch"] for m in run] == batches
    assert [m["estimate"]["duration_s"] for m in run] == [80.0, 40.0, 50.0]


@pytest.mark.parametrize("parallel,deadline,ran,finish,late", [
    (1, 1000, ["a", "b", "c"], [40.0, 90.0, 170.0], []),
    (1, 100, ["a", "b"], [40.0, 90.0], ["c"]),
    (2, 100, ["a", "b"], [40.0, 50.0], ["c"]),
    (2, 130, ["a", "b", "c"], [40.0, 50.0, 130.0], []),
    (1, 39, [], [], ["a", "b", "c"]),
])
def test_with_a_deadline_the_shortest_run_first_and_the_late_ones_stay(parallel, deadline, ran, finish, late):
    run, left = placement.schedule([move("c", size_s=50), move("a"), move("b", size_s=20, target="hostc")],
                                   parallel, deadline=deadline, throughput=TP)
    assert [m["workload"]["key"] for m in run] == ran
    assert [m["estimate"]["finish_s"] for m in run] == finish
    assert [m["workload"]["key"] for m in left] == late
    assert all("past the deadline of %d s" % deadline in m["reason"] for m in left)
    batches = [m["batch"] for m in run]
    assert batches == sorted(batches) and (not batches or batches[0] == 0)


def test_a_late_move_is_named_with_when_it_would_end():
    unused, late = placement.schedule([move("a"), move("c", size_s=50)], 1, deadline=100, throughput=TP)
    assert late[0]["reason"] == "estimated to end 120 s after the drain began, past the deadline of 100 s"


def test_an_unknown_duration_is_refused_under_a_deadline_unless_allowed():
    moves = [move("a"), move("b", target="hostd"), move("c", size_s=None)]
    run, late = placement.schedule([dict(m) for m in moves], 1, deadline=1000, throughput=TP)
    assert [m["workload"]["key"] for m in run] == ["a"]
    assert sorted(m["workload"]["key"] for m in late) == ["b", "c"]
    assert "no throughput measured from the node to hostd" in [m for m in late if m["workload"]["key"] == "b"][0]["reason"]
    assert all("gpuckpt_allow_unknown=[deadline]" in m["reason"] for m in late)
    run, late = placement.schedule([dict(m) for m in moves], 1, deadline=1000, throughput=TP, allow_unknown=("deadline",))
    assert [m["workload"]["key"] for m in run] == ["a", "b", "c"] and late == []
    assert [m["estimate"]["finish_s"] for m in run] == [40.0, None, None]


@pytest.mark.parametrize("throughput,size,want", [
    ({"hostb": 1e9}, 20e9, {"transfer_s": 20.0, "duration_s": 50.0, "throughput_bytes_s": 1e9}),
    ({"hostb": {"bytes_s": 4e8, "measured_at": "x"}}, 1e9, {"transfer_s": 2.5, "duration_s": 32.5, "throughput_bytes_s": 4e8}),
    ({"hostc": 1e9}, 1e9, {"transfer_s": None, "duration_s": None, "throughput_bytes_s": None}),
    ({"hostb": 0}, 1e9, {"transfer_s": None, "duration_s": None, "throughput_bytes_s": 0}),
    (None, 1e9, {"transfer_s": None, "duration_s": None, "throughput_bytes_s": None}),
    ({"hostb": 1e9}, None, {"transfer_s": None, "duration_s": None, "throughput_bytes_s": 1e9}),
])
def test_estimate(throughput, size, want):
    m = {"target": "hostb", "image_estimate_bytes": size}
    assert placement.estimate(m, throughput) == want


def test_estimate_overhead():
    assert placement.estimate({"target": "hostb", "image_estimate_bytes": 1e9}, {"hostb": 1e9}, overhead=0)["duration_s"] == 1.0


# -- ids and the whole plan ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix,key,want", [
    ("drain-node-1", "runc:train-7", "drain-node-1-runc-train-7"),
    ("d", "process:4242", "d-process-4242"),
    ("d", "containerd:k8s.io/a b//c", "d-containerd-k8s.io-a-b-c"),
    ("d", "podman:x_y.z", "d-podman-x_y.z"),
])
def test_migration_id_is_in_the_journal_s_alphabet(prefix, key, want):
    assert placement.migration_id(prefix, {"key": key}) == want


def test_migration_id_is_at_most_128_characters_and_two_cut_alike_still_differ():
    prefix = "drain-" + "n" * 63 + "-20261125T140000"
    one, two = [placement.migration_id(prefix, {"key": "podman:a-long-training-job-name-of-the-team-replica-%d" % i})
                for i in (1, 2)]
    assert len(one) == len(two) == 128 and one.startswith(prefix + "-podman-a-long") and one != two
    assert all(JOURNAL_ID.match(i) for i in (one, two))
    short = placement.migration_id(prefix[:20], {"key": "runc:x"})
    assert short == prefix[:20] + "-runc-x"


def test_plan_drain_gives_each_move_its_id_and_lists_every_stay():
    ws = [workload("runc:a", by_gpu={0: 20}), workload("runc:b", by_gpu={0: 60}), workload("runc:big", by_gpu={0: 90})]
    plan = placement.plan_drain(NODE, ws, {"hostb": host("hostb", free=(70, 70))}, ROOT, PATHS, "drain-node-1")
    assert [(m["workload"]["key"], m["migration_id"], m["batch"]) for m in plan["moves"]] == [
        ("runc:b", "drain-node-1-runc-b", 0)]
    assert [(s["workload"]["key"], s["reason"]) for s in plan["stays"]] == [
        ("runc:big", "fits on no target"), ("runc:a", "fits on no target")]


def test_plan_drain_with_a_deadline_keeps_late_moves_as_stays_without_an_id():
    ws = [workload("runc:a", by_gpu={0: 1}, rss_gib=1), workload("runc:b", by_gpu={0: 40}, rss_gib=1)]
    targets = {"hostb": host("hostb"), "hostc": host("hostc")}
    plan = placement.plan_drain(NODE, ws, targets, ROOT, PATHS, "d", parallel=2, deadline=60,
                                throughput={"hostb": 1e9, "hostc": 1e9})
    assert [(m["workload"]["key"], m["migration_id"]) for m in plan["moves"]] == [("runc:a", "d-runc-a")]
    assert [s["workload"]["key"] for s in plan["stays"]] == ["runc:b"]
    assert "past the deadline of 60 s" in plan["stays"][0]["reason"] and "migration_id" not in plan["stays"][0]


def test_plan_drain_accepts_an_unknown_deadline_by_name():
    ws = [workload("runc:a", by_gpu={0: 1})]
    plan = placement.plan_drain(NODE, ws, {"hostb": host("hostb")}, ROOT, PATHS, "d", deadline=600,
                                allow_unknown=("deadline",))
    assert [m["migration_id"] for m in plan["moves"]] == ["d-runc-a"] and plan["stays"] == []


def test_one_kernel_and_pid_space_counts_the_workload_s_own_pids_as_freed():
    """The GPU machine's loopback hosts are one kernel and one pid space: the workload's own pids are the ones in use
    on the target, and its checkpoint frees them (as migrate.yml's preflight decides it)."""
    node = dict(NODE, host={"hostname": "vm", "boot_id": "b1", "pid_namespace": "pid:[1]"})
    flat = dict(host("hostb", pids_in_use=[4242]), host={"hostname": "vm", "boot_id": "b1", "pid_namespace": "pid:[1]"})
    w = workload("process:4242", by_gpu={0: 20})
    moves, stays = placement.place(node, [w], {"hostb": flat}, ROOT, PATHS)
    assert len(moves) == 1 and stays == []
    other_ns = dict(flat, host=dict(flat["host"], pid_namespace="pid:[2]"))
    moves, stays = placement.place(node, [w], {"hostb": other_ns}, ROOT, PATHS)
    assert not moves and "pid(s) 4242 are in use" in stays[0]["rejected"]["hostb"]


def test_the_pids_of_the_node_s_other_processes_are_not_this_workload_s_concern():
    a, b = workload("process:4242", by_gpu={0: 2}), workload("process:5151", by_gpu={0: 1}, pid=5151)
    moves, stays = place([a, b], {"hostb": host("hostb", pids_in_use=[5151])})
    assert [m["workload"]["key"] for m in moves] == ["process:4242"]
    assert "pid(s) 5151 are in use on hostb" in stays[0]["rejected"]["hostb"]


@pytest.mark.parametrize("room_gb,deadline,batches", [
    (None, None, [0, 0, 0]),  # the node's free disk unknown: parallel alone (each move was checked alone)
    (1000, None, [0, 0, 0]),
    (75, None, [0, 0, 1]),  # c (50 GB) and a (10 GB) fit together, b (20 GB) does not join them
    (55, None, [0, 1, 1]),
    (25, None, [0, 1, 2]),
    (35, 1000, [0, 0, 1]),  # with a deadline (shortest first: a, b, c): a and b fit 35 GB together, c alone
])
def test_a_batch_holds_only_the_images_that_fit_the_nodes_disk_together(room_gb, deadline, batches):
    """The node writes a batch's images at once into its image root: moves that would not fit together there run
    in the next batch, and the plan's batch sizes (what drain.yml's serial runs) follow."""
    moves = [move("c", size_s=50), move("a"), move("b", size_s=20)]
    run, late = placement.schedule(moves, 3, deadline=deadline, throughput=TP,
                                   room=None if room_gb is None else room_gb * 1e9)
    assert late == [] and [m["batch"] for m in run] == batches


def test_the_plan_says_its_batch_sizes_for_the_play():
    w = [workload("runc:a", {0: 1}), workload("runc:b", {0: 1}, pid=1), workload("runc:c", {1: 1}, pid=2)]
    node = dict(NODE, disk={ROOT: {"free_bytes": 8 * GIB}})  # each ~3.3 GiB image fits alone, two together, not three
    plan = placement.plan_drain(node, w, {"hostb": host("hostb")}, ROOT, PATHS, "d", parallel=3)
    assert plan["batch_sizes"] == [2, 1]
    assert plan["batch_sizes"] == [sum(1 for m in plan["moves"] if m["batch"] == b) for b in range(len(plan["batch_sizes"]))]
    assert sum(plan["batch_sizes"]) == len(plan["moves"]) == 3


def test_a_bare_process_is_mapped_onto_another_gpu_where_its_own_place_has_no_room():
    """The node's GPU 0 holds 30 GiB of the job; the target's GPU 0 has 10 GiB free, its GPU 1 70: the plan maps the
    job's GPU onto GPU 1 (the driver's restore map), reserves it there, and says so. A container is not mapped (its
    runtime maps its device nodes place by place): it stays."""
    node = host("node", free=(10, 10))
    target = host("hostb", free=(10, 70))
    w = workload("process:4242", {0: 30})
    moves, stays = placement.place(node, [w], {"hostb": target}, ROOT, PATHS)
    assert [m["gpu_map"] for m in moves] == [{"GPU-node-0": "GPU-hostb-1"}] and moves[0]["gpus"] == ["GPU-hostb-1"]
    c = workload("runc:train", {0: 30})
    moves, stays = placement.place(node, [c], {"hostb": target}, ROOT, PATHS)
    assert moves == [] and "GPU 0" in stays[0]["rejected"]["hostb"]
    # two 30 GiB jobs both fit GPU 1's 70 GiB; a 50 GiB one takes it first, and the 30 GiB one then fits nowhere
    moves, stays = placement.place(node, [w, workload("process:5000", {0: 30}, pid=5000)], {"hostb": target}, ROOT, PATHS)
    assert [m["gpus"] for m in moves] == [["GPU-hostb-1"], ["GPU-hostb-1"]] and stays == []
    moves, stays = placement.place(node, [w, workload("process:5000", {0: 50}, pid=5000)], {"hostb": target}, ROOT, PATHS)
    assert [m["workload"]["key"] for m in moves] == ["process:5000"] and stays[0]["workload"]["key"] == "process:4242"


def test_no_map_where_the_gpu_at_its_place_has_room():
    moves, unused = placement.place(host("node"), [workload("process:4242", {0: 5})], {"hostb": host("hostb")}, ROOT, PATHS)
    assert moves[0]["gpu_map"] is None
