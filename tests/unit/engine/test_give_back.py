"""engine/give_back.py: the workload of a checkpoint whose holder died, given back, against the libcuda TEST DOUBLE
and real processes (no CRIU): each phase a dead holder can leave, a live holder left alone, a pid reused since
left alone, a migration's record left to recover.yml."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal, process_identity
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import driver as cuda
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import give_back
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend


@pytest.fixture
def cuda_pair(fakecuda):
    """Two processes registered with the test double as CUDA processes (a job's ranks)."""
    code = ("import ctypes,sys,time; l=ctypes.CDLL(sys.argv[1]); l.fakeCudaAttach(); print('up', flush=True); "
            "time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code, fakecuda.lib], stdout=subprocess.PIPE,
                              env=dict(os.environ, **fakecuda.env)) for unused in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == b"up"
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def dead_holder_record(journal_dir, rid, pids, phase, image_dir=None, after="running"):
    """The record a checkpoint leaves when its holder dies at ``phase``: written, its lock released."""
    journal = Journal(journal_dir, rid, "source")
    with journal.hold(wait=1):
        made = {}
        if image_dir:
            os.makedirs(image_dir)
            with open(os.path.join(image_dir, "pages-1.img"), "w") as fh:
                fh.write("partial")
            st = os.stat(image_dir)
            made = {"image_dir": image_dir, "image_dir_identity": [st.st_dev, st.st_ino], "image_dir_created": True}
        journal.transition("planned", pids=pids, cuda_pids=pids, after=after, runtime="process", container=None,
                           identities={str(p): process_identity(p) for p in pids},
                           states={str(p): "S" for p in pids}, **made)
        for step in {"planned": (), "freezing": ("freezing",), "frozen": ("freezing", "frozen")}[phase]:
            journal.transition(step)
    return journal


@pytest.mark.parametrize("moment", ["half_locked", "locked", "checkpointed", "restored_not_unlocked"])
def test_a_dead_holders_frozen_workload_runs_again(tmp_path, fakecuda, cuda_pair, moment):
    drv = cuda.CudaDriver()
    a, b = cuda_pair
    drv.lock(a, 1000)
    if moment != "half_locked":
        drv.lock(b, 1000)
    if moment in ("checkpointed", "restored_not_unlocked"):
        drv.checkpoint(a)
        drv.checkpoint(b)
    if moment == "restored_not_unlocked":
        drv.restore(a)
    image_dir = str(tmp_path / "images" / "one")
    jdir = str(tmp_path / "hold")
    dead_holder_record(jdir, "protect-one", cuda_pair, "freezing" if moment != "restored_not_unlocked" else "frozen",
                       image_dir=image_dir)
    assert give_back.records(jdir, "protect-") == ["protect-one"]

    res = give_back.give_back(jdir, "protect-one", ProcessBackend())
    assert res["changed"] and sorted(res["given_back"]) == sorted(cuda_pair), res
    assert [drv.cuda_state(p) for p in cuda_pair] == ["running", "running"]
    assert not os.path.exists(image_dir)  # the partial image went
    assert give_back.records(jdir) == [] and os.listdir(jdir) in ([], [".reserve"]), os.listdir(jdir)
    calls = [c for c, unused in fakecuda.calls()]
    assert calls.index("restore") < calls.index("unlock") if "restore" in calls else True  # all restored first

    again = give_back.give_back(jdir, "protect-one", ProcessBackend())  # nothing left: a second run changes nothing
    assert not again["changed"], again


def test_a_live_holder_is_left_alone(tmp_path, fakecuda, cuda_pair):
    drv = cuda.CudaDriver()
    for p in cuda_pair:
        drv.lock(p, 1000)
    jdir = str(tmp_path / "hold")
    journal = dead_holder_record(jdir, "protect-live", cuda_pair, "freezing")
    journal.acquire(wait=1, purpose="a checkpoint still running")
    try:
        res = give_back.give_back(jdir, "protect-live", ProcessBackend())
    finally:
        journal.release()
    assert res["held"] and not res["changed"], res
    assert [drv.cuda_state(p) for p in cuda_pair] == ["locked", "locked"]
    for p in cuda_pair:
        drv.unlock(p)


def test_processes_that_are_gone_or_another_are_not_touched(tmp_path, fakecuda, cuda_pair):
    jdir = str(tmp_path / "hold")
    journal = dead_holder_record(jdir, "protect-gone", cuda_pair, "freezing")
    doc = journal.read()
    with journal.hold(wait=1):  # the recorded processes were another's: started earlier than the ones there now
        journal.record(identities={p: dict(i, starttime=i["starttime"] - 1) for p, i in doc["identities"].items()})
    res = give_back.give_back(jdir, "protect-gone", ProcessBackend())
    assert not res["changed"] and res["given_back"] == [] and "none of its processes" in res["msg"], res
    assert give_back.records(jdir) == []


def test_a_migrations_record_is_left_to_its_settlement(tmp_path, fakecuda, cuda_pair):
    jdir = str(tmp_path / "hold")
    dead_holder_record(jdir, "m-1", cuda_pair, "frozen", after="stopped")
    res = give_back.give_back(jdir, "m-1", ProcessBackend())
    assert not res["changed"] and "recover.yml" in res["msg"], res
    assert give_back.records(jdir) == ["m-1"]
