"""fleet/protect.py and protect_history.py: a protected job's runner on its node, with the engine's checkpoint, the
transfer and the replicas' calls replaced by stand-ins (no CRIU, no ssh): skip, lock, fence, history, overhead,
expected finish, retention."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import streams, transfer
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget, TransactionError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import checkpoint as engine_checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect, protect_cli, protect_fence
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_history as hist

TIMINGS = {"cuda_lock": 0.01, "cuda_checkpoint": 0.2, "runtime_dump": 0.5, "cuda_resume_source": 0.09,
           "checksum": 0.3, "manifest": 0.01, "push": 1.0}


class Replicas(object):
    """The replicas' receivers: each call recorded; ``fenced`` names the replicas that say the job moved on."""

    def __init__(self):
        self.calls, self.fenced, self.down, self.kept = [], set(), set(), {}
        self.fenced_after_check = set()  # a failover between the fence check and the commit

    def __call__(self, target, config, timeout=60):
        self.calls.append((target.host, dict(config)))
        if target.host in self.down:
            raise streams.TransferError("ssh: connect to host %s port 22: No route to host" % target.host,
                                        stage="transfer")
        if target.host in self.fenced:
            return {"ready": False, "fenced": True, "epoch": config["epoch"] + 1, "owner": "node-b",
                    "error": "job %s was failed over to node-b at epoch %d; the copy on %s (epoch %d) is fenced"
                    % (config["job"], config["epoch"] + 1, config["node"], config["epoch"])}
        if config["replica_op"] == "check":
            return {"ready": True, "epoch": config["epoch"], "owner": config["node"], "fenced": False, "reason": None}
        if target.host in self.fenced_after_check:
            self.fenced.add(target.host)
            return self(target, config, timeout)
        kept = self.kept.setdefault(target.host, [])
        kept.insert(0, config["image_id"])
        removed = kept[config["keep"]:]
        del kept[config["keep"]:]
        return {"verified": True, "image_id": config["image_id"], "kept": list(kept), "removed": removed}

    def ops(self, op):
        return [c for host, c in self.calls if c["replica_op"] == op]


class Engine(object):
    """engine.checkpoint's stand-in: writes a one-file image where it is told, returns what the engine returns."""

    def __init__(self):
        self.calls, self.fail, self.delay, self.pushed = [], None, 0.0, True

    def __call__(self, target, image_dir, backend=None, journal=None, sender=None, **options):
        self.calls.append({"target": target, "image_dir": image_dir, "backend": backend, "sender": sender,
                           "options": options})
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise TransactionError(self.fail, stage="cuda_lock")
        os.makedirs(image_dir)
        with open(os.path.join(image_dir, "pages-1.img"), "w") as fh:
            fh.write("x")
        return {"changed": True, "image_dir": image_dir, "pids": [target], "cuda_pids": [target],
                "manifest_id": options["image_id"], "timings": dict(TIMINGS), "frozen_at": time.time(),
                "image_bytes": 4096, "push": {"pushed": self.pushed, "error": None if self.pushed else "stream broke"}}


@pytest.fixture
def stand_ins(monkeypatch):
    replicas, engine, sent = Replicas(), Engine(), []
    monkeypatch.setattr(transfer, "replica_call", replicas, raising=False)
    monkeypatch.setattr(engine_checkpoint, "checkpoint", engine)
    monkeypatch.setattr(transfer, "send_image", lambda image_dir, target, dest, **kw: sent.append((target.host, dest, kw))
                        or {"bytes_transferred": 1})
    return replicas, engine, sent


def write_config(protect_dir, job="train", **over):
    os.makedirs(protect_dir, exist_ok=True)
    base = os.path.dirname(protect_dir)
    pid_file = os.path.join(base, job + ".pid")
    if not os.path.exists(pid_file):
        with open(pid_file, "w") as fh:
            fh.write("%d\n" % os.getpid())
    with open(os.path.join(base, "progress.json"), "w") as fh:
        json.dump({"step": 41}, fh)
    cfg = {"job": job, "node": "node-a", "pid_file": pid_file, "interval_s": 900, "keep": 2, "epoch": 1,
           "replicas": [{"name": "rep1", "host": "10.0.0.2", "root": "/var/lib/gpuckpt/replicas"}],
           "image_root": os.path.join(base, "images"), "progress_file": os.path.join(base, "progress.json"),
           "progress_key": "step", "environment": {"GPUCKPT_TEST_PROTECT_ENV": "applied"},
           "checkpoint": {"lock_timeout": 7, "runtime_timeout": 30}}
    cfg.update(over)
    path = os.path.join(protect_dir, job + ".json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    os.chmod(path, 0o600)
    return cfg


@pytest.fixture
def pdir(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUCKPT_TEST_PROTECT_ENV", raising=False)
    return str(tmp_path / "protect")


def test_a_run_checkpoints_with_the_job_left_running_and_counts_once_the_replica_verified(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_OK and line["result"] == "ok", line
    call = engine.calls[0]
    assert call["target"] == os.getpid() and call["backend"].name == "process"
    assert call["options"]["leave_running"] is True and call["options"]["lock_timeout"] == 7
    assert call["options"]["image_id"] == line["image_id"]
    assert "runtime_timeout" not in call["options"] and call["backend"].timeout == 30  # the backend's option
    assert os.environ["GPUCKPT_TEST_PROTECT_ENV"] == "applied"  # before the engine loads the driver
    # The push while CRIU writes goes into <root>/<job>/<image id> of the first replica, which checks the id and epoch.
    sender = call["sender"]
    assert sender.dest == "/var/lib/gpuckpt/replicas/train/" + line["image_id"]
    assert sender.config["image_id"] == line["image_id"]
    assert sender.config["replica"] == {"root": "/var/lib/gpuckpt/replicas", "job": "train", "epoch": 1, "node": "node-a"}
    assert not sent  # the push carried it: nothing sent again
    commit = replicas.ops("commit")[0]
    assert commit["keep"] == 2 and commit["meta"]["progress"] == {"before": 41, "after": 41}
    assert commit["meta"]["stall_s"] == pytest.approx(0.8)
    # Stall = lock to unlock: cuda_lock + cuda_checkpoint + runtime_dump + cuda_resume_source, not the checksums or push.
    assert line["stall_s"] == pytest.approx(0.8) and line["replicas"] == {"rep1": "verified"}
    assert line["progress"] == {"before": 41, "after": 41} and line["trigger"] == "timer"
    assert not os.listdir(os.path.join(os.path.dirname(pdir), "images", "train"))  # the local copy went
    assert hist.read_history(hist.state_dir(pdir, "train"))[-1] == json.loads(json.dumps(line, default=str))


def test_the_fence_check_comes_first_and_asks_without_creating_the_record(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    protect.run(pdir, "train")
    check = replicas.calls[0][1]
    assert check["replica_op"] == "check" and check["create"] is False and check["epoch"] == 1


def test_a_run_while_another_runs_is_skipped_not_stacked(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    folder = protect.state_folder(pdir, "train")
    other = protect.JobLock(folder)
    assert other.acquire()
    try:
        line, code = protect.run(pdir, "train")
    finally:
        other.release()
    assert code == protect.EXIT_OK and line["result"] == "skipped" and str(os.getpid()) in line["reason"]
    assert not engine.calls
    assert hist.read_history(folder)[-1]["result"] == "skipped"
    line, code = protect.run(pdir, "train")  # the lock was given back
    assert line["result"] == "ok"


def test_a_failed_checkpoint_leaves_the_replicas_alone(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    protect.run(pdir, "train")
    engine.fail = "checkpoint failed at stage cuda_lock: timeout; the workload was rolled back and runs on"
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_FAILED and line["result"] == "failed" and "runs on" in line["reason"]
    assert len(replicas.ops("commit")) == 1  # nothing more was committed, nothing removed
    assert line["stall_s"] is None and line["progress"]["after"] == 41


def test_an_unreachable_replica_is_no_fence(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir, replicas=[{"name": "rep1", "host": "10.0.0.2", "root": "/r"},
                                 {"name": "rep2", "host": "10.0.0.3", "root": "/r"}])
    replicas.down.add("10.0.0.3")
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_OK and line["result"] == "ok"
    assert line["replicas"]["rep1"] == "verified" and "No route" in line["replicas"]["rep2"]
    assert [s[0] for s in sent] == ["10.0.0.3"]  # the second replica gets the complete image after the dump


def test_a_first_push_that_broke_is_sent_again_whole(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    engine.pushed = False
    line, code = protect.run(pdir, "train")
    assert line["result"] == "ok" and sent[0][0] == "10.0.0.2"
    assert sent[0][2]["receiver"]["replica"]["epoch"] == 1


def test_no_replica_verified_keeps_the_image_on_the_node(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    replicas.down.add("10.0.0.2")
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_FAILED and "kept on this node" in line["reason"]
    assert os.listdir(os.path.join(os.path.dirname(pdir), "images", "train")) == [line["image_id"]]
    replicas.down.clear()
    line, code = protect.run(pdir, "train")
    assert line["result"] == "ok"
    assert not os.listdir(os.path.join(os.path.dirname(pdir), "images", "train"))


def test_retention_is_reported_in_the_history_and_the_status(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    ids = [protect.run(pdir, "train")[0]["image_id"] for unused in range(3)]
    line = hist.read_history(hist.state_dir(pdir, "train"))[-1]
    assert line["retention"]["rep1"] == {"kept": [ids[2], ids[1]], "removed": [ids[0]]}
    status = protect.status_all(pdir, "train")[0]
    assert status["verified_images"]["rep1"]["images"] == [ids[2], ids[1]]


@pytest.fixture
def job_tree(tmp_path):
    """A job of two processes in a session of their own, not a child of this test (init reaps it, as a daemon's),
    and its pid file."""
    out = subprocess.run(["sh", "-c", "setsid sh -c 'sleep 60 & sleep 60; wait' >/dev/null 2>&1 & echo $!"],
                         stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
    job = Daemon(int(out.split()[-1]))
    time.sleep(0.2)
    pid_file = str(tmp_path / "job.pid")
    with open(pid_file, "w") as fh:
        fh.write("%d\n" % job.pid)
    yield job, pid_file
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except OSError:
        pass


class Daemon(object):
    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None if procfs.alive(self.pid) else -9

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            assert time.monotonic() < deadline, "pid %d still runs" % self.pid
            time.sleep(0.05)


def test_a_fenced_copy_is_stopped_and_stays_fenced(pdir, stand_ins, job_tree):
    replicas, engine, sent = stand_ins
    proc, pid_file = job_tree
    write_config(pdir, pid_file=pid_file)
    replicas.fenced.add("10.0.0.2")
    tree = [int(p) for p in subprocess.run(["pgrep", "-s", str(proc.pid)], stdout=subprocess.PIPE,
                                           universal_newlines=True, check=False).stdout.split()]
    assert len(tree) >= 2
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_FENCED and line["result"] == "fenced" and "epoch 2" in line["reason"]
    assert set(line["stopped"]["stopped"]) >= set(tree)
    proc.wait(timeout=5)
    assert not engine.calls
    folder = hist.state_dir(pdir, "train")
    assert hist.read_state(folder, hist.FENCED)["epoch"] == 1
    assert hist.read_history(folder)[-1]["result"] == "fenced"
    replicas.fenced.clear()  # fenced.json answers from now on, whatever the replicas say
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_FENCED and line["already"] and not engine.calls
    assert protect.status_all(pdir, "train")[0]["fenced"]["replica"] == "rep1"
    out = io.StringIO()
    assert protect_cli.main(["fence-check", "--protect-dir", pdir, "--job", "train"], out=out) == protect.EXIT_FENCED
    # Protected here again (the role writes a config of the job's new epoch): the fence is lifted.
    with open(pid_file, "w") as fh:
        fh.write("%d\n" % os.getpid())
    write_config(pdir, pid_file=pid_file, epoch=3)
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_OK and line["epoch"] == 3


def test_a_failover_that_raced_the_checkpoint_fences_it_at_once(pdir, stand_ins, job_tree):
    replicas, engine, sent = stand_ins
    proc, pid_file = job_tree
    write_config(pdir, pid_file=pid_file)
    replicas.fenced_after_check.add("10.0.0.2")
    line, code = protect.run(pdir, "train")
    assert code == protect.EXIT_FENCED and line["result"] == "fenced" and line["image_id"]
    proc.wait(timeout=5)
    assert not os.listdir(os.path.join(os.path.dirname(pdir), "images", "train"))  # a stale copy's image is no use


def test_check_mode_says_what_a_fence_would_stop_and_stops_nothing(pdir, stand_ins, job_tree):
    replicas, engine, sent = stand_ins
    proc, pid_file = job_tree
    write_config(pdir, pid_file=pid_file)
    replicas.fenced.add("10.0.0.2")
    res = protect.fence_check_all(pdir, act=False)
    assert res[0]["fenced"] and res[0]["stopped"] is None and "pid file" in res[0]["would_stop"]
    assert proc.poll() is None and not os.path.exists(hist.state_dir(pdir, "train"))


def test_a_pid_taken_by_a_later_process_is_not_the_job(tmp_path, job_tree):
    proc, pid_file = job_tree
    assert protect_fence.is_the_job(proc.pid, pid_file, None)
    old = time.time() - 3600
    os.utime(pid_file, (old, old))  # the pid file is older than the process that has its pid now
    assert not protect_fence.is_the_job(proc.pid, pid_file, None)
    cfg = {"job": "train", "pid_file": pid_file}
    res = protect_fence.stop_local_copy(cfg, str(tmp_path))
    assert res["stopped"] == [] and "no longer the job's" in res["note"] and proc.poll() is None
    # The identity the last checkpoint recorded decides when it is of this pid.
    ident = {"pid": proc.pid, "starttime": 1, "boot_id": None}
    assert not protect_fence.is_the_job(proc.pid, pid_file, ident)


def test_now_says_at_once_whether_it_is_expected_to_finish(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    said = []
    line, code = protect.run(pdir, "train", trigger="now", within=90, announce=said.append)
    assert said == [{"job": "train", "expected_s": None, "within_s": 90, "expected_to_finish": None}]
    assert line["finished_within"] is True and line["trigger"] == "now"
    folder = hist.state_dir(pdir, "train")
    for duration in (40.0, 70.0, 55.0):
        hist.append_history(folder, {"result": "ok", "duration_s": duration, "stall_s": 1.0})
    hist.append_history(folder, {"result": "failed", "duration_s": 500.0})
    said = []
    engine.delay = 0.3
    line, code = protect.run(pdir, "train", trigger="now", within=60, announce=said.append)
    assert said[0]["expected_s"] == 70.0 and said[0]["expected_to_finish"] is False
    assert line["expected_s"] == 70.0 and line["finished_within"] is True  # it did, this time
    line, code = protect.run(pdir, "train", trigger="now", within=0.1)
    assert line["finished_within"] is False


def test_now_waits_for_a_checkpoint_in_flight_up_to_the_time_given(pdir, stand_ins):
    replicas, engine, sent = stand_ins
    write_config(pdir)
    other = protect.JobLock(protect.state_folder(pdir, "train"))
    assert other.acquire()
    try:
        start = time.monotonic()
        line, code = protect.run(pdir, "train", trigger="now", within=0.5)
        assert line["result"] == "skipped" and time.monotonic() - start >= 0.5
        assert line["finished_within"] is False
    finally:
        other.release()


def test_the_status_shows_stall_and_overhead_at_each_interval(pdir, stand_ins):
    write_config(pdir, interval_s=600)
    folder = protect.state_folder(pdir, "train")
    for stall in (0.5, 1.5, 1.0):
        hist.append_history(folder, {"result": "ok", "duration_s": 10.0, "stall_s": stall})
    st = protect.status_all(pdir)[0]
    assert st["stall_s"] == {"last": 1.0, "max": 1.5, "mean": 1.0, "runs": 3}
    rows = {r["interval_s"]: r for r in st["overhead"]}
    assert sorted(rows) == [300, 600, 900, 3600] and rows[600]["configured"]
    assert rows[600]["fraction"] == pytest.approx(1.0 / 600, rel=1e-4)
    assert rows[300]["worst_fraction"] == pytest.approx(1.5 / 300, rel=1e-4)
    assert rows[3600]["percent"] == pytest.approx(100.0 / 3600, abs=1e-4)
    assert st["running"] is False and st["fenced"] is None and st["workload"].startswith("pid file")


def test_the_stall_is_lock_to_unlock():
    assert hist.stall_seconds(TIMINGS) == pytest.approx(0.8)
    assert hist.stall_seconds({"runtime_dump": 0.25, "checksum": 3, "push": 9}) == 0.25  # a CPU-only job
    assert hist.stall_seconds({}) is None


@pytest.mark.parametrize("text,key,want", [
    ('{"count": 12, "digest": "x"}', "count", 12),
    ('{"train": {"step": 7}}', "train.step", 7),
    ("1234\n", None, 1234),
    ("epoch 3", None, "epoch 3"),
    ("not json", "count", None),
])
def test_the_jobs_progress_as_it_reports_it(tmp_path, text, key, want):
    path = tmp_path / "progress"
    path.write_text(text)
    assert hist.read_progress(str(path), key) == want
    assert hist.read_progress(str(tmp_path / "absent"), key) is None


def test_a_config_that_names_the_node_as_replica_is_refused(pdir):
    write_config(pdir, replicas=[{"name": "node-a", "host": "10.0.0.1", "root": "/r"}])
    with pytest.raises(InvalidTarget, match="must leave it"):
        protect.load_config(pdir, "train")


def test_a_config_others_can_write_is_refused(pdir):
    write_config(pdir)
    os.chmod(os.path.join(pdir, "train.json"), 0o666)
    with pytest.raises(InvalidTarget, match="nobody else can write"):
        protect.load_config(pdir, "train")


def test_the_history_is_cut_back_when_it_grows(tmp_path, monkeypatch):
    monkeypatch.setattr(hist, "KEEP_LINES", 5)
    for i in range(30):
        hist.append_history(str(tmp_path), {"n": i, "pad": "x" * 300})
    lines = hist.read_history(str(tmp_path))
    assert lines[-1]["n"] == 29 and len(lines) <= 10


def test_the_command_line(pdir, stand_ins):
    write_config(pdir)
    out = io.StringIO()
    assert protect_cli.main(["run", "--protect-dir", pdir], out=out) == 0
    assert json.loads(out.getvalue().splitlines()[-1])["result"] == "ok"
    out = io.StringIO()
    assert protect_cli.main(["now", "--protect-dir", pdir, "--job", "train", "--within", "90"], out=out) == 0
    first, last = [json.loads(x) for x in out.getvalue().splitlines()]
    assert first["expected_to_finish"] is True and last["trigger"] == "now"
    out = io.StringIO()
    assert protect_cli.main(["status", "--protect-dir", pdir, "--job", "train"], out=out) == 0
    assert json.loads(out.getvalue())["attempts"] == 2
    out = io.StringIO()
    assert protect_cli.main(["now", "--protect-dir", pdir], out=out) == protect.EXIT_USAGE
    out = io.StringIO()
    assert protect_cli.main(["run", "--protect-dir", pdir, "--job", "absent"], out=out) == protect.EXIT_USAGE
    assert "not protected" in out.getvalue()


@pytest.mark.parametrize("within", ["-5", "0", "nan", "inf", "x"])
def test_now_refuses_a_within_that_is_no_positive_finite_number(within, capsys):
    with pytest.raises(SystemExit) as exc:
        protect_cli.main(["now", "--protect-dir", "/nonexistent", "--job", "j", "--within", within], out=io.StringIO())
    assert exc.value.code == 2 and "positive number of seconds" in capsys.readouterr().err
