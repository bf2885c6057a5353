"""engine/cooperative.py and tools/gpuckpt_quiesce.py's Cooperative: the cooperative checkpoint's protocol between
the collection and the ranks, against real processes running the real helper over a stand-in of torch.distributed
(one process, one world: no PyTorch needed; the 2-rank agreement over gloo is tests/integration/test_cooperative.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError, InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.journal import Journal, process_identity
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import cooperative, give_back
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.plan import CheckpointOptions
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools")
SIGUSR1 = int(signal.SIGUSR1)

STUB = {  # torch and torch.distributed as far as Cooperative uses them: a world of one
    "torch/__init__.py": """
int64 = "int64"
class device(object):
    def __init__(self, kind, index=None):
        self.type = kind
class _Tensor(object):
    def __init__(self, values):
        self.values = list(values)
    def item(self):
        return self.values[0]
def tensor(values, dtype=None, device=None):  # (the helper's flag is on the CPU)
    assert device is None
    return _Tensor(values)
class cuda(object):
    is_available = staticmethod(lambda: False)
    is_initialized = staticmethod(lambda: False)
""",
    "torch/distributed/__init__.py": """
import os
STATE = {"initialized": True, "inits": []}
class ReduceOp(object):
    MAX = "max"
class PrefixStore(object):
    def __init__(self, prefix, store):
        self.prefix, self.store = prefix, store
def is_initialized():
    return STATE["initialized"]
def get_backend():
    return "gloo"
def get_rank():
    return int(os.environ.get("RANK", "0"))
def get_world_size():
    return 1
class _Work(object):
    def wait(self):
        return True
def all_reduce(tensor, op=None, group=None, async_op=False):
    return _Work() if async_op else None
def new_group(**kw):
    return "a group"
def destroy_process_group():
    STATE["initialized"] = False
def init_process_group(backend, store=None, rank=None, world_size=None, **kw):
    STATE["initialized"] = True
    STATE["inits"].append(store.prefix)
""",
    "torch/distributed/distributed_c10d.py": "def _get_default_store():\n    return 'the rendezvous store'\n",
}

RANK = r"""
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import gpuckpt_quiesce, torch.distributed as dist
odd = sys.argv[3] == "odd"  # (a job that calls the helper every other step, from step 1: 1, 3, 5...)
coop = gpuckpt_quiesce.Cooperative(poll=0.01, **({"every": 2} if odd else {}))
print("up", flush=True)
step = 1 if odd else 0
while True:
    time.sleep(0.01)
    if sys.argv[3] == "stuck":
        continue
    if coop.step_boundary(step):
        print(coop.history[-1]["resumed_by"], coop.history[-1]["step"], dist.STATE["inits"][-1], flush=True)
    step += 2 if odd else 1
"""


@pytest.fixture
def rank_procs(tmp_path):
    stub = tmp_path / "stub"
    for rel, text in STUB.items():
        (stub / rel).parent.mkdir(parents=True, exist_ok=True)
        (stub / rel).write_text(text)
    made = []

    def start(rank=0, how="train"):
        p = subprocess.Popen([sys.executable, "-c", RANK, str(stub), TOOLS, how], stdout=subprocess.PIPE,
                             universal_newlines=True, env=dict(os.environ, RANK=str(rank)))
        assert p.stdout.readline().strip() == "up"
        made.append(p)
        return p

    yield start
    for p in made:
        p.kill()
        p.wait()
        for pattern in (cooperative.REQUEST, cooperative.RESUME, cooperative.ACK, cooperative.ANNOUNCE):
            path = "/tmp/" + pattern % p.pid
            if os.path.exists(path):
                os.unlink(path)


def _resume_doc(pid):
    with open("/tmp/" + cooperative.RESUME % pid) as fh:
        return json.load(fh)


def test_asked_acknowledged_resumed_on_a_fresh_prefix(rank_procs):
    p = rank_procs()
    number = cooperative.request_number()
    report = cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 10, 60, number)
    assert report["request"] == number and report["ranks"][str(p.pid)]["rank"] == 0
    assert isinstance(report["step"], int) and report["step"] == report["ranks"][str(p.pid)]["step"]
    assert not os.path.exists("/tmp/" + cooperative.ACK % p.pid), "an acknowledgement is read once, then removed"
    cooperative.check_released(report, lambda pid: False)
    assert cooperative.resume([p.pid], number) == [p.pid]
    how, step, prefix = p.stdout.readline().split()
    assert (how, int(step), prefix) == ("resume", report["step"], "gpuckpt/%d/" % number)
    assert not os.path.exists("/tmp/" + cooperative.RESUME % p.pid), "the rank removes its resume"
    assert cooperative.record_of(report) == {"request": number, "step": report["step"], "lease_s": 60,
                                             "ranks": {str(p.pid): 0}}
    # a second checkpoint: a new number, a new prefix
    second = cooperative.request_number() + 1
    report = cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 10, 60, second)
    cooperative.resume([p.pid], second)
    assert p.stdout.readline().split()[2] == "gpuckpt/%d/" % second


def test_a_job_that_numbers_its_boundaries_oddly_is_still_checked(rank_procs):
    """Checks are counted in calls, not in the step numbers given: odd steps with every=2 are checked too."""
    p = rank_procs(0, how="odd")
    number = cooperative.request_number()
    report = cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 10, 60, number)
    assert report["step"] % 2 == 1, report
    cooperative.resume([p.pid], number)
    assert p.stdout.readline().split()[:2] == ["resume", str(report["step"])]


def test_a_rank_that_does_not_reach_its_boundary_is_named_and_every_rank_told_to_resume(rank_procs):
    ok, stuck = rank_procs(0), rank_procs(1, how="stuck")
    number = cooperative.request_number()
    with pytest.raises(GpuCkptError) as err:
        cooperative.ask([ok.pid, stuck.pid], SIGUSR1, "SIGUSR1", 1.0, 60, number)
    msg = err.value.msg
    assert "rank 1 (pid %d) did not reach its step boundary" % stuck.pid in msg, msg
    assert "nothing was frozen" in msg and err.value.stage == "quiesce" and err.value.pid == stuck.pid
    assert _resume_doc(stuck.pid)["request"] == number  # (the stuck one finds it when it gets there)
    assert ok.stdout.readline().split()[0] == "resume", "the rank that answered was told to resume"


def test_ranks_stopped_at_different_steps_are_refused(rank_procs):
    a, b = rank_procs(0), rank_procs(1)  # (two worlds of one: nothing makes them agree)
    a_steps = None
    number = cooperative.request_number()
    try:
        report = cooperative.ask([a.pid, b.pid], SIGUSR1, "SIGUSR1", 10, 60, number)
        a_steps = {r["step"] for r in report["ranks"].values()}
    except GpuCkptError as exc:
        assert "stopped at different steps" in exc.msg and "told to resume" in exc.msg, exc.msg
    else:  # (both may have been at the same count by chance)
        assert len(a_steps) == 1
        cooperative.resume([a.pid, b.pid], number)
    for p in (a, b):
        assert p.stdout.readline().split()[0] == "resume"


def test_a_rank_still_holding_nccl_memory_or_gone_fails_before_the_freeze(rank_procs):
    p = rank_procs(3)
    number = cooperative.request_number()
    report = cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 10, 60, number)
    with pytest.raises(GpuCkptError) as err:
        cooperative.check_released(report, lambda pid: True)
    assert "rank 3 (pid %d) acknowledged, but still maps NCCL's shared memory" % p.pid in err.value.msg
    assert p.stdout.readline().split()[0] == "resume"
    report["identities"][str(p.pid)] = dict(report["identities"][str(p.pid)], starttime=1)  # (as if another process)
    with pytest.raises(GpuCkptError) as err:
        cooperative.check_alive(report, p.pid)
    assert "rank 3 (pid %d) exited after it acknowledged" % p.pid in err.value.msg


def test_a_process_gone_before_it_is_asked(rank_procs):
    p = rank_procs(0)
    p.kill()
    p.wait()
    with pytest.raises(GpuCkptError) as err:
        cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 1, 60, cooperative.request_number())
    assert "pid %d" % p.pid in err.value.msg and "nothing was frozen" in err.value.msg


def test_the_lease_counts_only_the_ranks_own_running_time(monkeypatch):
    """A rank never told to resume goes on by itself after ``lease`` seconds of waiting; a jump of the clock (it was
    frozen, or restored elsewhere) counts one second at most."""
    sys.path.insert(0, TOOLS)
    import gpuckpt_quiesce
    coop = object.__new__(gpuckpt_quiesce.Cooperative)
    coop._pid, coop.poll = 2 ** 22 + 17, 0  # (no resume file for this pid)
    now = {"t": 0.0, "sleeps": 0}

    def sleep(unused):
        now["sleeps"] += 1
        now["t"] += 1000.0 if now["sleeps"] == 3 else 0.5  # a restore: the clock jumped 1000 s

    monkeypatch.setattr(gpuckpt_quiesce.time, "monotonic", lambda: now["t"])
    monkeypatch.setattr(gpuckpt_quiesce.time, "sleep", sleep)
    assert coop._wait(7, lease=3.0) == "lease"
    assert now["sleeps"] == 5, now  # 0.5 + 0.5 + 1 (the 1000 s jump) + 0.5 + 0.5 = 3.0


def test_a_rank_running_the_helper_announces_itself_for_quiesce_mode_auto(rank_procs):
    p = rank_procs()
    assert cooperative.announced([p.pid, os.getpid()]) == [p.pid]
    opts = CheckpointOptions(quiesce_mode="auto", quiesce_timeout=5)
    assert not opts.cooperative and opts.quiesce_signal is None
    opts.choose_cooperative()
    assert opts.cooperative and opts.quiesce_signal == (SIGUSR1, "SIGUSR1")
    with pytest.raises(InvalidTarget):
        CheckpointOptions(quiesce_mode="auto", quiesce_command=["true"]).choose_cooperative()


def test_options():
    opts = CheckpointOptions(quiesce_mode="cooperative", leave_running=True)
    assert opts.cooperative and opts.quiesce_signal == (SIGUSR1, "SIGUSR1") and opts.quiesce_lease == 600
    assert CheckpointOptions(quiesce_mode="cooperative", quiesce_signal="USR2").quiesce_signal[1] == "SIGUSR2"
    assert not CheckpointOptions().cooperative and CheckpointOptions().quiesce_signal is None
    for bad in ({"quiesce_mode": "cooperative", "quiesce_command": ["true"]},
                {"quiesce_mode": "cooperative", "quiesce_timeout": 30, "quiesce_lease": 40},
                {"quiesce_mode": "eventually"}):
        with pytest.raises(InvalidTarget):
            CheckpointOptions(**bad)


def test_a_dead_holders_cooperative_record_tells_the_ranks_to_resume(tmp_path, rank_procs):
    """give_back of a record a cooperative checkpoint left (its holder died after the ranks acknowledged): nothing
    was locked, so the ranks are only told to resume."""
    p = rank_procs(0)
    number = cooperative.request_number()
    cooperative.ask([p.pid], SIGUSR1, "SIGUSR1", 10, 60, number)
    journal = Journal(str(tmp_path / "hold"), give_back.MODULE_PREFIX + "process-x", "source")
    with journal.hold(wait=1):
        journal.transition("planned", pids=[p.pid], cuda_pids=[], after="running", runtime="process", container=None,
                           identities={str(p.pid): process_identity(p.pid)}, states={str(p.pid): "S"},
                           cooperative={"request": number, "pids": [p.pid]})
    out = give_back.give_back_all(str(tmp_path / "hold"), ProcessBackend,
                                  prefix=give_back.MODULE_PREFIX + "process-")
    assert len(out) == 1 and out[0]["given_back"] == [p.pid], out
    assert p.stdout.readline().split()[0] == "resume"
    assert give_back.records(str(tmp_path / "hold")) == [], "the record goes once given back"


SPACING = r"""
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import gpuckpt_quiesce
coop = gpuckpt_quiesce.Cooperative(poll=0.01, **eval(sys.argv[3]))
seen = []
for step in range(40):
    time.sleep(0.005)
    coop.step_boundary(step)
    seen.append(coop.every)
print(seen[28], seen[29], seen[-1])
"""


@pytest.mark.parametrize("given", [{}, {"every": 3}, {"check_interval": 0}])
def test_the_checks_are_spaced_by_the_steps_time_unless_a_spacing_is_given(tmp_path, given):
    """By default the ranks time their steps over their first 30 boundaries and check about every 50 ms from there:
    a 5 ms step is checked about every 10 steps (fewer where the sleeps overshoot), never less often."""
    stub = tmp_path / "stub"
    for rel, text in STUB.items():
        (stub / rel).parent.mkdir(parents=True, exist_ok=True)
        (stub / rel).write_text(text)
    out = subprocess.run([sys.executable, "-c", SPACING, str(stub), TOOLS, repr(given)], stdout=subprocess.PIPE,
                         universal_newlines=True, check=True, timeout=60).stdout.split()
    before, at, after = out
    if "every" in given:
        assert (before, at, after) == ("3", "3", "3")
    elif given.get("check_interval") == 0:
        assert (before, at, after) == ("None", "1", "1")
    else:
        assert before == "None" and at == after and 1 <= int(at) <= 10, out
