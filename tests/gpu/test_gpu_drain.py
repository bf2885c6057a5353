"""On a real GPU: drain.yml empties hosta of two GPU workloads, a bare PyTorch process and a PyTorch job in a
runc container, onto hostb (the GPU machine's loopback "hosts": sshd on 127.0.0.2 and 127.0.0.3, one kernel
and one pid space, real ssh, CRIU and runc). --check first prints the plan and freezes nothing; the drain then
moves both, each runs exactly once on hostb with its GPU memory intact (checksums), and each move is recorded
with the plan's numbers (image estimate, GPU memory) beside what the move measured (image size, downtime).

The plan needs each process's GPU memory (NVML or nvidia-smi on this machine): a plan that shows it as
UNKNOWN fails the test with the plan's lines."""
from __future__ import annotations

import os
import shutil
import sys
import time

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, nvidia_smi_pids
from helpers import workload_processes
from test_gpu_migrate import PASS_ENV, RemoteTorch
from test_gpu_runc import RuncTorch

sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))
from loopback import LoopbackHosts  # noqa: E402

DRAIN = "gpuckpt.fleet.drain"
# Two sizes, so that the plan's order (most GPU memory first) and the records tell the two apart.
PROCESS_GIB = float(os.environ.get("GPUCKPT_DRAIN_PROCESS_GIB", "3"))
CONTAINER_GIB = float(os.environ.get("GPUCKPT_DRAIN_CONTAINER_GIB", "2"))
pytestmark = pytest.mark.skipif(shutil.which("runc") is None,
                                reason="runc is not here (tests/gpu/install_tools.sh puts the carried one in place)")


@pytest.fixture
def drain_hosts(tmp_path):
    """hosta (the node) and hostb (the target), each with its own runc root and bundle, journal and images."""
    base = str(tmp_path / "hosts")
    hv = {n: {"gpuckpt_environment": dict(PASS_ENV),
              "gpuckpt_runc_root": os.path.join(base, n, "runc-root"),
              "gpuckpt_runc_bundle": os.path.join(base, n, "bundle")} for n in ("hosta", "hostb")}
    h = LoopbackHosts(base, pid_namespaces=False, python=WORKLOAD_PYTHON).start(hv)
    yield h
    h.stop()
    time.sleep(1)


def _processes(w):
    return workload_processes("torch_counter.py", w.dir)


def _runs_once_intact(w, before):
    """Exactly one live, unstopped process of the workload, counting on from ``before``, its GPU memory
    as it was filled (checksum), and holding GPU memory; returns its pid."""
    procs = _processes(w)
    assert len(procs) == 1 and procs[0][1] != "T", procs
    w.wait_counting(beyond=before)
    assert w.verified_after(w.counts())
    assert procs[0][0] in nvidia_smi_pids(), "the moved process must hold GPU memory"
    return procs[0][0]


def _nothing_frozen(process, container):
    for w in (process, container):
        procs = _processes(w)
        assert len(procs) == 1 and procs[0][1] != "T", procs
        assert w.is_counting()
    assert container.state("hosta")["status"] == "running" and container.state("hostb") is None


def _plan_line(lines, prefix, what):
    hits = [ln for ln in lines if ln.split(None, 1)[0:1] == [prefix] and ln.split(None, 1)[-1].startswith(what + " ")]
    assert len(hits) == 1, "no single %s line for %s in:\n%s" % (prefix, what, "\n".join(lines))
    return hits[0]


def _move_of(plan, what):
    """The plan's move of a workload: ``("process", pid)`` or ``("container", id)``."""
    kind, ident = what
    hits = [m for m in plan["moves"] if m["workload"]["kind"] == kind
            and str(m["workload"]["root_pid"] if kind == "process" else m["workload"]["container"]) == str(ident)]
    assert len(hits) == 1, (what, plan["moves"])
    return hits[0]


def _result(run, task, host):
    """The result of ``task`` (part of its name) for the inventory host ``host`` (a move's own host)."""
    hits = [r for r in run.results if task in r["_task"] and r["_host"] == host and r.get("_status") != "skipped"]
    assert hits, "no %r result for %s in %s" % (task, host, sorted({(r["_task"], r["_host"]) for r in run.results}))
    return hits[-1]


def test_drain_moves_a_gpu_process_and_a_gpu_container_with_their_memory(playbook, drain_hosts, tmp_path, record):
    process = RemoteTorch(drain_hosts, "hosta", str(tmp_path / "process"), PROCESS_GIB)
    container = None
    try:
        container = RuncTorch(drain_hosts, str(tmp_path / "container"), CONTAINER_GIB)
        smi = nvidia_smi_pids()
        ours = {"process": process.pid, "container": _processes(container)[0][0]}
        # The drain moves every GPU workload of the node, and the loopback hosts are one machine: a GPU process
        # an earlier test left would be moved too.
        assert set(smi) == set(ours.values()), "GPU processes other than this test's: %s (ours: %s)" % (smi, ours)
        gpu_mib = {kind: smi[pid] for kind, pid in ours.items()}
        names = {"process": "pid %d" % process.pid, "container": "container %s (runc)" % container.id}
        # A bounded restore, as in test_gpu_runc.py: a hung one rolls back to the source within the limit.
        v = {"node": "hosta", "targets": "hostb", "gpuckpt_runtime_timeout": 120}
        inventory = drain_hosts.path("inventory.yml")

        check = playbook(DRAIN, v, inventory=inventory, check=True)
        record("gpu_drain_check_attempt", rc=check.rc, tail=check.stdout[-3000:] if check.rc else "")
        assert check.rc == 0, check.stdout
        shown = check.task("The plan")["msg"]
        # (Once, the module's own shell, which loads the driver to ask it, was planned as a workload of unknown
        # size here: the loopback hosts are this machine. The facts now leave the module's lineage out.)
        record("gpu_drain_plan", lines=shown)
        assert "GPU UNKNOWN" not in "\n".join(shown), (
            "the drain could not read a workload's GPU memory on this machine (NVML or nvidia-smi):\n" + "\n".join(shown))
        for name in names.values():
            assert "-> hostb" in _plan_line(shown, "MOVE", name), shown
        assert "Check mode: nothing was frozen, nothing moved" in shown
        _nothing_frozen(process, container)
        assert not os.path.exists(drain_hosts.path("hosta", "journal", "drain.json")), "--check writes no mark"

        before = {"process": process.counts(), "container": container.counts()}
        run = playbook(DRAIN, v, inventory=inventory)
        record("gpu_drain_attempt", rc=run.rc, tail=run.stdout[-3000:] if run.rc else "")
        assert run.rc == 0, run.stdout
        report = run.task("Where each workload runs now")["msg"]
        plan = run.task("Place each workload")["ansible_facts"]["gpuckpt_drain_plan"]
        assert "runs no GPU workload any more" in run.task("The node is empty")["msg"]

        pids = {"process": _runs_once_intact(process, before["process"])}
        assert container.state("hostb")["status"] == "running" and container.state("hosta") is None
        pids["container"] = _runs_once_intact(container, before["container"])

        for kind, w, ident in (("process", process, process.pid), ("container", container, container.id)):
            line = _plan_line(report, "MOVED", names[kind])
            assert "-> hostb" in line, report
            move = _move_of(plan, (kind, ident))
            ck = _result(run, "Stage 1/3", move["migration_id"])
            outcome = _result(run, "Time the move", move["migration_id"])["ansible_facts"]["gpuckpt_move_outcome"]
            assert outcome["status"] == "moved", outcome
            tree = move["workload"]["tree"]
            record("gpu_drain", workload=kind, runtime=move["workload"]["runtime"], gib=w.gib,
                   migration_id=move["migration_id"], target=move["target"],
                   plan_image_estimate_bytes=move["image_estimate_bytes"], plan_gpu_bytes=tree.get("gpu_bytes"),
                   plan_gpu_memory_source=tree.get("gpu_memory_source"), gpu_mib_nvidia_smi=gpu_mib[kind],
                   image_bytes=ck["image_bytes"], leave_stopped=ck.get("leave_stopped"), checkpoint=ck.get("timings"),
                   downtime_s=outcome.get("downtime_s"), took_s=outcome.get("took_s"), pid_after=pids[kind],
                   report_line=line.strip(), plan_line=_plan_line(plan["lines"], "MOVE", names[kind]).strip())
    finally:
        process.kill()
        if container is not None:
            container.kill()
