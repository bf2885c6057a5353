"""The cooperative checkpoint of a distributed job (issue 45 part 2), end to end on a CPU stand-in: a 2-rank DDP job
under torchrun (tools/gpuckpt_quiesce.py's libuv-less torchrun) with the gloo backend, each rank a CUDA process of
the libcuda TEST DOUBLE mapping NCCL's shared memory while its process group lives (tests/workloads/coop_ddp_job.py),
checkpointed through gpuckpt.fleet.gpu_checkpoint / gpu_restore with real CRIU.

Every test ends with exactly one copy of the job, every rank counting on from its last step (no step logged twice,
none skipped), its stand-in GPU memory intact, nothing locked in the driver."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import ANSIBLE_PLAYBOOK, COLLECTIONS, MANAGED_PYTHON, REPO, FakeCuda, alive

PLAYBOOK = os.path.join(REPO, "tests", "integration", "playbooks", "cooperative.yml")
JOB = os.path.join(REPO, "tests", "workloads", "coop_ddp_job.py")
LAUNCHER = os.path.join(REPO, "tools", "gpuckpt_quiesce.py")

GLOO = subprocess.run([sys.executable, "-c", "import torch.distributed as d; assert d.is_gloo_available()"],
                      capture_output=True, check=False).returncode == 0
pytestmark = pytest.mark.skipif(not GLOO, reason="PyTorch with gloo is not installed (tests/requirements.txt)")


def pattern_digest(rank):  # (as tests/workloads/coop_ddp_job.py writes its stand-in GPU memory)
    return hashlib.sha256(bytes((i * 31 + rank * 7) & 255 for i in range(256)) * ((1 << 20) // 256)).hexdigest()[:16]


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return sorted(out)


def _with(text):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/cmdline" % d, "rb") as fh:
                    if text.encode() in fh.read():
                        out.append(int(d))
            except OSError:
                pass
    return sorted(out)


class CoopJob(object):
    """The stand-in job under the libuv-less torchrun, in a session of its own (reparented to init)."""

    def __init__(self, directory, fakecuda, env=None, pause=0.05, hosts=None, host=None):
        self.dir, self.fakecuda, self.tag = directory, fakecuda, "coop-%s" % uuid.uuid4().hex[:8]
        os.makedirs(directory)
        cmd = [sys.executable, LAUNCHER, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "--monitor-interval", "0.1", JOB, directory, fakecuda.lib, self.tag, str(pause)]
        start = ["setsid", "-f", "sh", "-c", 'exec "$@" >"%s" 2>&1 </dev/null' % os.path.join(directory, "out.log"),
                 "sh"] + cmd
        # (torchrun's agent makes its log folder with tempfile: in the job's own directory, not the machine's /tmp)
        env = dict(env or {}, TMPDIR=directory)
        if hosts is None:
            env = dict(os.environ, **dict(fakecuda.env, **env))
            env.pop("NCCL_P2P_DISABLE", None)
            subprocess.run(start, env=env, check=True)
        else:  # (high in the host's pid space: CRIU restores the same pids on the other host, whose low ones are taken)
            host_env = dict(hosts.host_vars[host]["gpuckpt_environment"], **env)
            hosts.ssh(host, "echo 20000 > /proc/sys/kernel/ns_last_pid; env %s %s" % (
                " ".join("%s=%s" % kv for kv in sorted(host_env.items())), " ".join("'%s'" % a for a in start)))
        self.wait(lambda: all(len(self.steps(r)) > 3 for r in range(2)), 90, "the ranks to train")
        with open(os.path.join(directory, "launcher.pid")) as fh:
            self.pid = int(fh.read())  # (as the launcher's host sees it)
        self.host_pid = self.pid if hosts is None else _by_ns_pid(self.pid, _with(self.tag))

    def wait(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError("timed out waiting for %s; the job said:\n%s" % (what, self.said()))

    def said(self):
        try:
            with open(os.path.join(self.dir, "out.log")) as fh:
                return fh.read()[-3000:]
        except OSError:
            return ""

    def lines(self, r):
        try:
            with open(os.path.join(self.dir, "rank%d.log" % r)) as fh:
                return [ln.split() for ln in fh if ln.endswith("\n")]
        except OSError:
            return []

    def steps(self, r):
        return [int(ln[0]) for ln in self.lines(r)]

    def last(self):
        return [(self.steps(r) or [-1])[-1] for r in range(2)]

    def ranks(self):
        return _children(self.host_pid)

    def cycles(self, r):
        try:
            with open(os.path.join(self.dir, "rank%d.cycles" % r)) as fh:
                return [eval(ln, {}) for ln in fh if ln.strip()]  # noqa: S307 - the job's own repr of a dict
        except OSError:
            return []

    def counting_on(self, beyond=None, timeout=30):
        beyond = beyond or self.last()
        self.wait(lambda: all(s > b + 3 for s, b in zip(self.last(), beyond)), timeout,
                  "the ranks to count on beyond %s (now %s)" % (beyond, self.last()))

    def check(self):
        """One copy (the launcher and 2 ranks), every step logged once in order, memory intact, nothing locked."""
        assert not [f for f in os.listdir(self.dir) if f.endswith(".corrupt")], "stand-in GPU memory changed"
        for r in range(2):
            steps = self.steps(r)
            assert steps == list(range(len(steps))), "rank %d logged %s" % (r, steps[-30:])
            assert {ln[2] for ln in self.lines(r)} == {pattern_digest(r)}, "rank %d's memory digest changed" % r
        assert _with(self.tag) == sorted([self.host_pid] + self.ranks()) and len(self.ranks()) == 2, \
            (_with(self.tag), self.host_pid, self.ranks())
        assert all(self.fakecuda.state(p) == "running" for p in self.ranks()), \
            [self.fakecuda.state(p) for p in self.ranks()]

    def kill(self):
        for p in _with(self.tag):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        for r in range(2):
            try:
                os.unlink("/dev/shm/nccl-%s-r%d" % (self.tag, r))
            except OSError:
                pass
        # what every rank that ever ran left in /tmp (their pids as they saw them: the logs' last column)
        for pid in {ln[3] for r in range(2) for ln in self.lines(r) if len(ln) > 3}:
            for name in ("cooperative", "request", "resume", "quiesced"):
                try:
                    os.unlink("/tmp/gpuckpt-%s.%s" % (name, pid))
                except OSError:
                    pass


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    """One job for the tests that leave it running as they found it (its start is most of a test's time); each
    checks it first."""
    job = CoopJob(str(tmp_path_factory.mktemp("coop") / "job"), FakeCuda(str(tmp_path_factory.mktemp("coop-fc"))))
    yield job
    job.kill()


@pytest.fixture
def coop_job(tmp_path, fakecuda):
    started = []

    def start(**kw):
        job = CoopJob(str(tmp_path / ("job%d" % len(started))), fakecuda, **kw)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()


class Controller(object):
    """ansible-playbook running the cooperative playbook, in a session of its own: the test may kill its whole tree
    (the module and what it started) at a moment of its choosing."""

    def __init__(self, tmp_path, fakecuda, extra_vars, inventory=None, limit=None):
        self.record = str(tmp_path / ("results-%s.jsonl" % uuid.uuid4().hex[:6]))
        env = dict(os.environ, **fakecuda.env)
        env.update({"ANSIBLE_COLLECTIONS_PATH": COLLECTIONS,
                    "ANSIBLE_CALLBACK_PLUGINS": os.path.join(REPO, "tests", "integration", "callback_plugins"),
                    "ANSIBLE_CALLBACKS_ENABLED": "record_results", "ANSIBLE_LOCALHOST_WARNING": "false",
                    "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false", "ANSIBLE_NOCOLOR": "1",
                    "ANSIBLE_PIPELINING": "true", "GPUCKPT_RECORD": self.record})
        local = ["-i", "localhost,", "-e", "ansible_connection=local",
                 "-e", "ansible_python_interpreter=%s" % MANAGED_PYTHON]
        where = ["-i", inventory, "--limit", limit] if inventory else local
        env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(tmp_path / "cp")
        self.proc = subprocess.Popen([ANSIBLE_PLAYBOOK, PLAYBOOK] + where + ["-e", json.dumps(extra_vars)],
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO, universal_newlines=True,
                                     start_new_session=True)

    def finish(self, timeout=300):
        self.stdout = self.proc.communicate(timeout=timeout)[0]
        return self

    @property
    def rc(self):
        return self.proc.returncode

    def task(self, name):
        with open(self.record) as fh:
            hits = [json.loads(ln) for ln in fh if ln.strip()]
        hits = [h for h in hits if name in h["_task"] and h.get("_status") != "skipped"]
        assert hits, self.stdout
        return hits[-1]

    def kill_tree(self):
        """SIGKILL to every process of its tree and session (the module, CRIU, ssh...), until none is left."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            tree = _descendants(self.proc.pid) | _in_session(self.proc.pid)
            if not tree:
                break
            for p in tree:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.poll()  # (reaps the playbook itself)
            time.sleep(0.05)
        assert not _descendants(self.proc.pid) | _in_session(self.proc.pid), "the controller survived"
        self.proc.wait()
        self.proc.stdout.close()


def _stat(pid):
    with open("/proc/%d/stat" % pid) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[3])  # state, ppid, session


def _live():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                state, ppid, sid = _stat(int(d))
            except (OSError, ValueError, IndexError):
                continue
            if state not in ("Z", "X"):
                out[int(d)] = (ppid, sid)
    return out


def _descendants(root):
    live, found, todo = _live(), set(), [root]
    while todo:
        p = todo.pop()
        if p in live and p not in found:
            found.add(p)
            todo += [c for c, (ppid, unused) in live.items() if ppid == p]
    return found


def _in_session(sid):
    return {p for p, (unused, s) in _live().items() if s == sid}


def _run(tmp_path, fakecuda, inventory=None, limit=None, **extra):
    extra.setdefault("hold_dir", str(tmp_path / "hold"))
    return Controller(tmp_path, fakecuda, extra, inventory, limit).finish()


def _calls(fakecuda, *names):
    return [c for c in fakecuda.calls() if c[0] in names]


def _wait_call(fakecuda, predicate, what, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(fakecuda.calls()):
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting for %s; calls %s" % (what, fakecuda.calls()))


def _cycles(job):
    return [len(job.cycles(r)) for r in range(2)]


def test_refused_without_the_mode_then_checkpointed_leave_running_in_place(tmp_path, fakecuda, shared_job):
    """NCCL's defaults: refused before anything is frozen, naming both ways; cooperatively, checkpointed with
    leave_running (every rank locked before any is checkpointed, all restored before any is unlocked), told to
    resume, and it counts on from the boundary."""
    job = shared_job
    job.check()
    cycles = _cycles(job)
    run = _run(tmp_path, fakecuda, op="checkpoint", pid=job.pid, image_dir=str(tmp_path / "img0"),
               leave_running=True, quiesce_mode="release", tcp_established=True)
    res = run.task("gpu_checkpoint")
    assert run.rc != 0 and "nothing was frozen" in res["msg"], res
    assert "NCCL_P2P_DISABLE=1" in res["msg"] and "quiesce_mode: cooperative" in res["msg"], res["msg"]
    assert not _calls(fakecuda, "lock")
    job.counting_on()

    run = _run(tmp_path, fakecuda, op="checkpoint", pid=job.pid, image_dir=str(tmp_path / "img"), leave_running=True)
    assert run.rc == 0, run.stdout
    res = run.task("gpu_checkpoint")
    q = res["quiesce"]
    assert q["mode"] == "cooperative" and sorted(int(p) for p in q["resumed"]) == job.ranks(), q
    assert {r["step"] for r in q["ranks"].values()} == {q["step"]}, q
    order = [c for c, unused in _calls(fakecuda, "lock", "checkpoint", "restore", "unlock")]
    assert order == ["lock"] * 2 + ["checkpoint"] * 2 + ["restore"] * 2 + ["unlock"] * 2, order
    with open(os.path.join(str(tmp_path / "img"), "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["cooperative"]["step"] == q["step"] and "--tcp-established" in manifest["runtime"]["auto_flags"]
    job.counting_on([q["step"]] * 2)
    for r in range(2):
        assert [c["resumed_by"] for c in job.cycles(r)[cycles[r]:]] == ["resume"], job.cycles(r)
    assert not [f for f in os.listdir(str(tmp_path / "hold")) if f.endswith(".json")], "the record goes at the end"
    job.check()


def test_a_dumped_job_is_restored_in_place_and_told_to_resume(tmp_path, fakecuda, shared_job):
    job = shared_job
    job.check()
    image_dir = str(tmp_path / "img")  # (auto: the ranks announced the helper)
    run = _run(tmp_path, fakecuda, op="checkpoint", pid=job.pid, image_dir=image_dir, quiesce_mode="auto")
    assert run.rc == 0, run.stdout
    step = run.task("gpu_checkpoint")["quiesce"]["step"]
    assert not [p for p in [job.pid] + job.ranks() if alive(p)], "the dumped job exits"
    assert job.last() == [step, step], (job.last(), step)
    run = _run(tmp_path, fakecuda, op="restore", image_dir=image_dir)
    assert run.rc == 0, run.stdout
    assert sorted(run.task("gpu_restore")["cooperative_resumed"]) == job.ranks()
    job.counting_on([step] * 2)
    job.check()


def test_a_rank_that_never_acknowledges_freezes_nothing(tmp_path, fakecuda, shared_job):
    """Rank 1, once asked, is stuck in a long call: the checkpoint fails before anything is frozen naming rank 1,
    every rank is told to resume, and the job runs on (its one boundary cycle done when rank 1 gets there)."""
    job = shared_job
    job.check()
    cycles = _cycles(job)
    with open(os.path.join(job.dir, "stall.r1"), "w") as fh:
        fh.write("4")
    run = _run(tmp_path, fakecuda, op="checkpoint", pid=job.pid, image_dir=str(tmp_path / "img"), leave_running=True,
               quiesce_timeout=1.5, quiesce_lease=30)
    res = run.task("gpu_checkpoint")
    assert run.rc != 0 and res["stage"] == "quiesce", res
    assert "rank 1 (pid %d) did not reach its step boundary" % job.ranks()[1] in res["msg"], res["msg"]
    assert "rank 0" in res["msg"] and "nothing was frozen" in res["msg"] and "told to resume" in res["msg"], res
    assert not _calls(fakecuda, "lock") and not os.path.exists(str(tmp_path / "img" / "manifest.json"))
    job.counting_on(timeout=40)
    for r in range(2):  # (the stuck rank got to its boundary after all: the others with it, and the resume was there)
        assert [c["resumed_by"] for c in job.cycles(r)[cycles[r]:]] == ["resume"], job.cycles(r)
    job.check()


def test_a_rank_killed_between_acknowledge_and_freeze(tmp_path, fakecuda, coop_job):
    """Rank 1 dies once every rank acknowledged, while rank 0 is being locked: the checkpoint fails naming rank 1,
    rank 0 is unlocked and told to resume; torchrun restarts the job, which resumes from the state it saved at the
    boundary."""
    job = coop_job()
    with open(os.path.join(fakecuda.state_dir, "delay"), "w") as fh:
        fh.write("lock 0 1500\n")
    ctl = Controller(tmp_path, fakecuda, {"op": "checkpoint", "pid": job.pid, "image_dir": str(tmp_path / "img"),
                                          "leave_running": True, "hold_dir": str(tmp_path / "hold")})
    _wait_call(fakecuda, lambda calls: any(c == "lock" for c, unused in calls), "the first lock")
    first = int([p for c, p in fakecuda.calls() if c == "lock"][0])
    victim = [p for p in job.ranks() if p != first][0]
    rank = job.ranks().index(victim)
    step = job.last()[rank]
    os.kill(victim, signal.SIGKILL)
    ctl.finish()
    os.unlink(os.path.join(fakecuda.state_dir, "delay"))
    res = ctl.task("gpu_checkpoint")
    assert ctl.rc != 0 and "rank %d (pid %d) exited after it acknowledged" % (rank, victim) in res["msg"], res
    assert "rolled back" in res["msg"], res["msg"]
    # (rank 0 unlocked, unless torchrun, seeing rank 1 die, ended it first: then nothing is left to unlock)
    assert [c for c, unused in _calls(fakecuda, "lock", "checkpoint")] == ["lock"], fakecuda.calls()
    job.wait(lambda: len(job.ranks()) == 2 and victim not in job.ranks(), 60, "torchrun to restart the ranks")
    job.counting_on([step] * 2, timeout=90)
    job.check()


def test_the_resume_never_delivered_the_lease_resumes_the_job(tmp_path, fakecuda, shared_job):
    """The controller dies after the last unlock, before the resume: each rank resumes by itself once it has waited
    its lease (4 s of its own running time)."""
    job = shared_job
    job.check()
    cycles = _cycles(job)
    ctl = Controller(tmp_path, fakecuda, {"op": "checkpoint", "pid": job.pid, "image_dir": str(tmp_path / "img"),
                                          "leave_running": True, "hold_dir": str(tmp_path / "hold"),
                                          "quiesce_timeout": 2, "quiesce_lease": 4})
    _wait_call(fakecuda, lambda calls: [c for c, unused in calls].count("lock") == 2, "both locks")
    second = [p for c, p in fakecuda.calls() if c == "lock"][1]
    with open(os.path.join(fakecuda.state_dir, "delay"), "w") as fh:
        fh.write("unlock %s 30000\n" % second)
    _wait_call(fakecuda, lambda calls: ("unlock", second) in calls, "the last unlock")
    ctl.kill_tree()
    os.unlink(os.path.join(fakecuda.state_dir, "delay"))
    held = job.last()
    job.counting_on(held, timeout=40)
    for r in range(2):
        assert [c["resumed_by"] for c in job.cycles(r)[cycles[r]:]] == ["lease"], job.cycles(r)
    job.check()


def test_the_controller_killed_mid_way_the_next_checkpoint_gives_the_job_back(tmp_path, fakecuda, shared_job):
    """The controller's whole process tree dies with both ranks checkpointed in the driver: the job is frozen. The
    next gpu_checkpoint gives it back first (restore, unlock, resume), then takes its own checkpoint."""
    job = shared_job
    job.check()
    cycles = _cycles(job)
    with open(os.path.join(fakecuda.state_dir, "delay"), "w") as fh:
        fh.write("checkpoint 0 30000\n")
    ctl = Controller(tmp_path, fakecuda, {"op": "checkpoint", "pid": job.pid, "image_dir": str(tmp_path / "img"),
                                          "leave_running": True, "hold_dir": str(tmp_path / "hold")})
    _wait_call(fakecuda, lambda calls: [c for c, unused in calls].count("checkpoint") == 2, "both checkpoints")
    ctl.kill_tree()
    os.unlink(os.path.join(fakecuda.state_dir, "delay"))
    assert [fakecuda.state(p) for p in job.ranks()] == ["checkpointed"] * 2
    held = job.last()
    time.sleep(0.5)
    assert job.last() == held, "a frozen job does not train"
    run = _run(tmp_path, fakecuda, op="checkpoint", pid=job.pid, image_dir=str(tmp_path / "img2"), leave_running=True)
    assert run.rc == 0, run.stdout
    res = run.task("gpu_checkpoint")
    back = res["given_back"]
    assert len(back) == 1 and sorted(back[0]["given_back"]) == sorted([job.pid] + job.ranks()), back
    assert not os.path.exists(str(tmp_path / "img")), "the dead checkpoint's partial image is removed"
    job.counting_on([res["quiesce"]["step"]] * 2)
    for r in range(2):
        assert [c["resumed_by"] for c in job.cycles(r)[cycles[r]:]] == ["resume", "resume"], job.cycles(r)
    job.check()


def test_checkpointed_on_one_loopback_host_and_restored_on_the_other(tmp_path, fakecuda, hosts):
    """A migration by the modules alone: dumped on hosta (its own pid namespace), restored on hostb from the same
    image (the loopback hosts share the filesystem), told to resume there."""
    job = CoopJob(str(tmp_path / "job"), fakecuda, hosts=hosts, host="hosta")
    try:
        image_dir = str(tmp_path / "img")
        inventory = hosts.path("inventory.yml")
        run = _run(tmp_path, fakecuda, inventory, "hosta", op="checkpoint", pid=job.pid, image_dir=image_dir)
        assert run.rc == 0, run.stdout
        step = run.task("gpu_checkpoint")["quiesce"]["step"]
        assert job.last() == [step, step] and not _with(job.tag)
        run = _run(tmp_path, fakecuda, inventory, "hostb", op="restore", image_dir=image_dir)
        assert run.rc == 0, run.stdout
        assert len(run.task("gpu_restore")["cooperative_resumed"]) == 2
        job.host_pid = _by_ns_pid(job.pid, _with(job.tag))
        assert hosts.pids["hostb"] in _ancestors(job.host_pid), "the job runs on hostb"
        job.counting_on([step] * 2)
        job.check()
    finally:
        job.kill()


def _by_ns_pid(ns_pid, pids):
    for p in pids:
        with open("/proc/%d/status" % p) as fh:
            if [ln.split()[-1] for ln in fh if ln.startswith("NSpid:")] == [str(ns_pid)]:
                return p
    raise AssertionError("no process of %s is pid %d in its namespace" % (pids, ns_pid))


def _ancestors(pid):
    out = []
    while pid > 1:
        try:
            pid = _stat(pid)[1]
        except OSError:
            break
        out.append(pid)
    return out


def test_migrated_by_migrate_yml_in_the_cooperative_mode(tmp_path, fakecuda, hosts, playbook):
    """migrate.yml with quiesce_mode=cooperative (issue 45 part 3): the job is asked at a step boundary on hosta,
    dumped there, sent, restored on hostb and told to resume there; one copy, every step once, nothing locked."""
    from loopback_workloads import MIGRATE
    job = CoopJob(str(tmp_path / "job"), fakecuda, hosts=hosts, host="hosta")
    try:
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "pid": job.pid, "migration_id": "coop-move",
                                 "quiesce_mode": "cooperative", "gpuckpt_quiesce_timeout": 60},
                       inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        ck, rs = run.task("Stage 1/3"), run.task("Restore on hostb")
        step = ck["quiesce"]["step"]
        assert ck["quiesce"]["mode"] == "cooperative" and len(ck["quiesce"]["ranks"]) == 2, ck
        assert len(rs["cooperative_resumed"]) == 2, rs
        job.host_pid = _by_ns_pid(job.pid, _with(job.tag))
        assert hosts.pids["hostb"] in _ancestors(job.host_pid), "the job runs on hostb"
        job.counting_on([step] * 2)
        job.check()
    finally:
        job.kill()


def test_drained_off_the_node_in_the_cooperative_mode(tmp_path, fakecuda, hosts, playbook):
    """drain.yml with quiesce_mode=cooperative (issue 45 part 3): the torchrun tree (its agent and both ranks, each
    rank in a session of its own) is one workload, moved whole to hostb with the mode passed to its move; one
    copy runs there, every rank counting on from its boundary, nothing locked, and the node is reported empty."""
    job = CoopJob(str(tmp_path / "job"), fakecuda, hosts=hosts, host="hosta")
    try:
        run = playbook("gpuckpt.fleet.drain", {"node": "hosta", "quiesce_mode": "cooperative",
                                               "gpuckpt_quiesce_timeout": 60},
                       inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        plan = run.task("Place each workload on a target")["ansible_facts"]["gpuckpt_drain_plan"]
        assert len(plan["moves"]) == 1 and plan["moves"][0]["target"] == "hostb", plan["lines"]
        ck, rs = run.task("Stage 1/3"), run.task("Restore on hostb")
        step = ck["quiesce"]["step"]
        assert ck["quiesce"]["mode"] == "cooperative" and len(ck["quiesce"]["ranks"]) == 2, ck
        assert len(rs["cooperative_resumed"]) == 2, rs
        assert "runs no GPU workload any more" in run.task("The node is empty")["msg"]
        job.host_pid = _by_ns_pid(job.pid, _with(job.tag))
        assert hosts.pids["hostb"] in _ancestors(job.host_pid), "the job runs on hostb"
        job.counting_on([step] * 2)
        job.check()
    finally:
        job.kill()
        for name in ("hosta", "hostb"):
            for f in ("drain.json", "throughput.json"):
                try:
                    os.unlink(hosts.path(name, "journal", f))
                except OSError:
                    pass
