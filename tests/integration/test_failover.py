"""Protected jobs and failover (issue 30) on three sshd "hosts" on loopback (127.0.0.22-24), each in its own pid
namespace: ``node`` runs the job, ``replica`` keeps its checkpoints, ``target`` takes it over when the node is lost.
Real ssh, real CRIU, the protect role and failover.yml through ansible-playbook; the GPU stage runs against the
libcuda TEST DOUBLE and each host's GPUs come from the nvidia-smi TEST DOUBLE.

systemd does not run in the loopback hosts, so the role installs no units there (it says so), and the test runs the
timer's command itself (the one the unit's ExecStart runs: ``gpuckpt-protect run``), at the moments it chooses.

Each test ends with exactly one copy of the job running, its memory intact.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from loopback import LoopbackHosts, _descendants
from loopback_workloads import RemoteWorkload, fakecuda_host_vars, processes

PROTECT, FAILOVER, IMAGES = "gpuckpt.fleet.protect", "gpuckpt.fleet.failover", "gpuckpt.fleet.images"
HOSTS = (("node", "127.0.0.22"), ("replica", "127.0.0.23"), ("target", "127.0.0.24"))  # apart from other tests' hosts
FENCED_EXIT = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("fleet"))
    host_vars = fakecuda_host_vars(base, names=[n for n, unused in HOSTS])
    for name in host_vars:
        host_vars[name].update({
            "gpuckpt_protect_dir": os.path.join(base, name, "protect"),
            "gpuckpt_protect_lib_dir": os.path.join(base, name, "lib"),
            "gpuckpt_protect_bin": os.path.join(base, name, "bin", "gpuckpt-protect"),
            "gpuckpt_protect_image_root": os.path.join(base, name, "protect-images"),
            "gpuckpt_protect_replica_root": os.path.join(base, name, "replicas")})
    host_vars["node"]["gpuckpt_protect_replicas"] = ["replica"]
    h = LoopbackHosts(base, hosts=HOSTS).start(host_vars)
    h.host_vars = host_vars
    yield h
    time.sleep(1)
    h.stop()


def job_spec(w, name, keep=2):
    return {"name": name, "pid_file": os.path.join(w.dir, "job.pid"), "interval": 60, "keep": keep,
            "progress_file": os.path.join(w.dir, "parent.state"), "progress_key": "count"}


@pytest.fixture
def job(fleet, tmp_path):
    """A counting job started on ``node`` with its pid file; killed wherever it runs at the end."""
    made = []

    def start(host="node"):
        w = RemoteWorkload(fleet, host, str(tmp_path / ("job%d" % len(made))))
        fleet.ssh(host, "echo %d > %s" % (w.pid, os.path.join(w.dir, "job.pid")))
        made.append(w)
        return w

    yield start
    for w in made:
        w.kill()


def run_timer(fleet, name, job_name, check=True):
    """The protect timer's command, on host ``name``: returns (exit status, its last JSON line)."""
    hv = fleet.host_vars[name]
    command = "%s run --protect-dir %s --job %s" % (hv["gpuckpt_protect_bin"], hv["gpuckpt_protect_dir"], job_name)
    res = fleet.ssh(name, command, check=False, timeout=300)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    doc = json.loads(lines[-1]) if lines else {}
    if check:
        assert res.returncode == 0 and doc.get("result") == "ok", res.stdout
    return res.returncode, doc, res.stdout


def replica_images(fleet, job_name):
    root = os.path.join(fleet.host_vars["replica"]["gpuckpt_protect_replica_root"], job_name)
    out = {}
    for d in sorted(os.listdir(root)):
        mark = os.path.join(root, d, ".gpuckpt", "replica.json")
        if os.path.isdir(os.path.join(root, d)) and os.path.exists(mark):
            with open(mark) as fh:
                out[d] = json.load(fh)
    return out


def protect(playbook, fleet, jobs):
    return playbook(PROTECT, {"node": "node", "gpuckpt_protected_jobs": jobs}, inventory=fleet.path("inventory.yml"))


def failover(playbook, fleet, job_name, jobs, **extra):
    v = {"job": job_name, "lost_node": "node", "target": "target", "gpuckpt_protected_jobs": jobs}
    v.update(extra)
    return playbook(FAILOVER, v, inventory=fleet.path("inventory.yml"))


def first_count_after(w, role, since):
    """The first count ``role`` wrote after line ``since`` of its counts log."""
    seen = w.counted(role)
    assert len(seen) > since, "%s wrote nothing after the failover" % role
    return seen[since]


def gone(w, timeout=10):
    """Wait until no process of ``w`` is left (a SIGKILLed process takes a moment to go)."""
    deadline = time.monotonic() + timeout
    while processes(w.dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes(w.dir), processes(w.dir)


def copies_running(w, n, timeout=5):
    """``n`` copies of ``w`` run (one process per role each), each process by its pid namespace in the message."""
    deadline = time.monotonic() + timeout
    while len(processes(w.dir)) != n * len(w.roles) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = []
    for p, state in processes(w.dir):
        try:
            seen.append((p, state, os.readlink("/proc/%d/ns/pid" % p)))
        except OSError:
            seen.append((p, state, None))
    assert len(seen) == n * len(w.roles), "expected %d copies of %s, found %s" % (n, w.dir, seen)


def set_driver(fleet, name, version):
    smi = fleet.host_vars[name]["gpuckpt_environment"]["GPUCKPT_FAKE_NVIDIA_SMI"]
    with open(smi) as fh:
        spec = json.load(fh)
    for gpu in spec["gpus"]:
        gpu["driver_version"] = version
    with open(smi, "w") as fh:
        json.dump(spec, fh)


def test_lost_node_fails_over_from_the_newest_verified_image(playbook, fleet, job):
    """Three timer runs keep the newest two verified images; the node dies with its pid namespace; images.yml
    says where each image can go (refused for another driver version); the newest image is corrupted on the
    replica, so failover restores the one before it on the target, which counts on from that image's count with
    its memory intact; a second failover is refused."""
    w = job()
    jobs = [job_spec(w, "train", keep=2)]
    run = protect(playbook, fleet, jobs)
    assert run.rc == 0, run.stdout
    stalls = []
    for unused in range(3):
        rc, doc, out = run_timer(fleet, "node", "train")
        assert doc["replicas"]["replica"] == "verified", out
        assert doc["stall_s"] > 0, out
        stalls.append(doc["stall_s"])
        w.wait_counting(beyond=w.counts())
    print("STALLS of the test workload's periodic checkpoints (s):", stalls)  # (docs/benchmarks, CI kind)
    images = replica_images(fleet, "train")
    assert len(images) == 2 and all(m["verified"] for m in images.values()), images  # retention: keep 2
    assert w.is_counting()

    # Where can they go? Not to a host whose driver differs from the checkpoint's; yes to a matching one.
    set_driver(fleet, "target", "575.51.03")
    listing = playbook(IMAGES, {"job": "train", "node": "node", "host": "target", "gpuckpt_protected_jobs": jobs},
                       inventory=fleet.path("inventory.yml"))
    assert listing.rc == 0, listing.stdout
    assert "driver" in listing.stdout and "575.51.03" in listing.stdout, listing.stdout
    set_driver(fleet, "target", "580.159.04")
    listing = playbook(IMAGES, {"job": "train", "node": "node", "host": "target", "gpuckpt_protected_jobs": jobs},
                       inventory=fleet.path("inventory.yml"))
    assert listing.rc == 0, listing.stdout

    # The newest image rots on the replica: failover must take the one before it.
    newest, older = sorted(images, key=lambda i: images[i]["checkpoint_at"], reverse=True)
    root = os.path.join(fleet.host_vars["replica"]["gpuckpt_protect_replica_root"], "train", newest)
    pages = sorted((f for f in os.listdir(root) if f.startswith("pages-")), key=lambda f: -os.path.getsize(os.path.join(root, f)))
    with open(os.path.join(root, pages[0]), "r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))

    fleet.crash("node")  # the node dies: its sshd and its whole pid namespace, the job with it
    gone(w)
    logged = len(w.counted("parent"))

    run = failover(playbook, fleet, "train", jobs, lost_node_confirmed=True)
    assert run.rc == 0, run.stdout
    assert newest in run.stdout and older in run.stdout  # the corrupt one named as skipped, the older one restored
    assert w.one_copy_runs_intact()
    resumed = first_count_after(w, "parent", logged)
    progress = images[older].get("progress") or {}
    assert progress.get("before") is not None, images[older]
    assert progress["before"] < resumed <= progress["after"] + 1, (resumed, progress)

    again = failover(playbook, fleet, "train", jobs, lost_node_confirmed=True)
    assert again.rc != 0 and "already" in again.stdout, again.stdout
    assert w.one_copy_runs_intact()
    w.kill()
    fleet.boot("node")


def test_partition_then_the_returning_node_stops_its_stale_copy(playbook, fleet, job):
    """The node is cut off while its job runs on. failover.yml refuses without the operator's word; with it, the
    job runs on the target. The node comes back: its first operation, a migration of the stale copy to another
    host, fences it (the copy stopped, nothing moved); its timer says fenced and stays so; from then on exactly one
    copy runs."""
    w = job()
    jobs = [job_spec(w, "infer", keep=3)]
    assert protect(playbook, fleet, jobs).rc == 0
    for unused in range(2):
        run_timer(fleet, "node", "infer")
        w.wait_counting(beyond=w.counts())  # every process of the job runs on after each checkpoint
    node_pids = {p for p, unused in processes(w.dir)}

    fleet.cut_off("node")
    refused = failover(playbook, fleet, "infer", jobs)
    assert refused.rc != 0 and "lost_node_confirmed" in refused.stdout, refused.stdout
    assert {p for p, unused in processes(w.dir)} == node_pids  # nothing touched: the job runs on, on the node

    run = failover(playbook, fleet, "infer", jobs, lost_node_confirmed=True)
    assert run.rc == 0, run.stdout
    copies_running(w, 2)  # the stale copy runs on behind the partition, the new one on the target

    fleet.reconnect("node")
    # Its first operation is a migration of the stale copy (issue 43, 6): the source's facts fence it first, so the
    # stale copy is stopped, not moved, and the migration fails before anything is frozen.
    moved = playbook("gpuckpt.fleet.migrate", {"source": "node", "target": "replica", "pid": w.pid,
                                               "migration_id": "m-stale-infer"}, inventory=fleet.path("inventory.yml"))
    assert moved.rc != 0, moved.stdout
    rc, doc, out = run_timer(fleet, "node", "infer", check=False)
    assert rc == FENCED_EXIT and doc.get("result") == "fenced", out
    assert "epoch" in out, out
    deadline = time.monotonic() + 10
    while node_pids & {p for p, unused in processes(w.dir)} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not node_pids & {p for p, unused in processes(w.dir)}, "the node's stale copy still runs"
    assert w.one_copy_runs_intact()
    rc, doc, out = run_timer(fleet, "node", "infer", check=False)  # it stays fenced: the timer does nothing else
    assert rc == FENCED_EXIT, out
    assert w.one_copy_runs_intact()


# -- a run that dies while it holds the job frozen (issue 43, 1) -------------------------------------------------

def _runner(fleet, job_name, timeout=20):
    """The host pid of the protect runner of ``job_name`` (``gpuckpt-protect run``), once it runs."""
    binary = fleet.host_vars["node"]["gpuckpt_protect_bin"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in os.listdir("/proc"):
            try:
                with open("/proc/%s/cmdline" % d, "rb") as fh:
                    argv = fh.read().split(b"\0")
            except (OSError, ValueError):
                continue
            if binary.encode() in argv and b"run" in argv and job_name.encode() in argv:
                return int(d)
        time.sleep(0.01)
    raise AssertionError("no protect runner of %s started" % job_name)


def _comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _calls(fakecuda_dir):
    try:
        with open(os.path.join(fakecuda_dir, "calls.log")) as fh:
            return fh.read().splitlines()
    except FileNotFoundError:
        return []


def _wait_for_call(fakecuda_dir, call, since, timeout=20):
    """Wait until the libcuda TEST DOUBLE logged ``call`` after line ``since`` of its calls.log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.split()[0] == call for line in _calls(fakecuda_dir)[since:] if line.strip()):
            return
        time.sleep(0.01)
    raise AssertionError("the runner made no %s call" % call)


def _records(fleet, job_name):
    hold = os.path.join(fleet.host_vars["node"]["gpuckpt_protect_dir"], "state", job_name, "hold")
    return sorted(f for f in os.listdir(hold) if f.endswith(".source.json")) if os.path.isdir(hold) else []


# (the moment, how the runner dies, what runs next on the node). "tree": SIGKILL to the runner and every process
# under it (CRIU too: an AWX job killed, systemd's SIGKILL after TimeoutStopSec); "runner": SIGKILL to the runner
# alone (the OOM killer takes one process: its CRIU dumps on); "term": SIGTERM to the runner alone (systemd's stop
# under KillMode=mixed), after which the run must give the job back itself.
KILLS = (("lock", "tree", "timer"), ("checkpoint", "tree", "give-back"), ("dump", "tree", "facts"),
         ("restore", "tree", "status"), ("dump", "runner", "give-back"), ("checkpoint", "runner", "fence-check"),
         ("lock", "term", None), ("dump", "term", None))


def test_a_run_killed_while_it_holds_the_job_frozen_is_given_back_by_the_next_operation(playbook, fleet, tmp_path):
    """The timer's run killed at every moment from the CUDA lock to the unlock (its tree, the runner alone, or
    stopped by SIGTERM): the job is given back by the next operation on the node, whichever it is (the timer, the
    documented give-back, facts, status, the fence check), or by the run itself after a SIGTERM. Each time exactly
    one copy counts on from its last count, never a count twice, memory intact, nothing left locked, no record left;
    and the next timer run checkpoints it as before."""
    w = RemoteWorkload(fleet, "node", str(tmp_path / "held"), mb=128)
    try:
        fleet.ssh("node", "echo %d > %s" % (w.pid, os.path.join(w.dir, "job.pid")))
        jobs = [job_spec(w, "held", keep=1)]
        assert protect(playbook, fleet, jobs).rc == 0
        hv = fleet.host_vars["node"]
        fakecuda = hv["gpuckpt_environment"]["FAKECUDA_STATE_DIR"]
        command = "%s %%s --protect-dir %s --job held" % (hv["gpuckpt_protect_bin"], hv["gpuckpt_protect_dir"])
        for moment, how, after in KILLS:
            since = len(_calls(fakecuda))
            if moment != "dump":
                with open(os.path.join(fakecuda, "delay"), "w") as fh:
                    fh.write("%s 0 4000\n" % moment)  # the driver's call sleeps 4 s once the state changed
            client = fleet.popen_ssh("node", command % "run")
            try:
                runner = _runner(fleet, "held")
                if moment == "dump":  # CRIU seizes the tree after the driver's checkpoint of every CUDA process
                    _wait_for_call(fakecuda, "checkpoint", since)
                    deadline = time.monotonic() + 20
                    while not [p for p in _descendants(runner) if _comm(p) == "criu"] and time.monotonic() < deadline:
                        time.sleep(0.002)
                    criu = [p for p in _descendants(runner) if _comm(p) == "criu"]
                    assert criu, "CRIU did not run under the runner"
                else:
                    _wait_for_call(fakecuda, moment, since)
                    time.sleep(0.2)
                    criu = []
                victims = {"tree": [runner] + _descendants(runner), "runner": [runner], "term": [runner]}[how]
                os.kill(runner, signal.SIGTERM if how == "term" else signal.SIGKILL)
                for p in victims[1:]:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # a short-lived child of the runner (a probe, an ssh) ended between the listing and the kill
                out = client.communicate(timeout=120)[0]
            finally:
                if client.poll() is None:
                    client.kill()
                try:
                    os.unlink(os.path.join(fakecuda, "delay"))
                except OSError:
                    pass
            where = "%s killed (%s) at %s" % ("runner", how, moment)
            if how == "term":  # it ended the step under way, undid the checkpoint, and exited
                assert "SIGTERM" in out, (where, out)
                assert not _records(fleet, "held"), (where, out)
            else:
                for p in criu:  # (an OOM-style kill leaves its CRIU dumping: it ends by itself)
                    deadline = time.monotonic() + 60
                    while _comm(p) == "criu" and time.monotonic() < deadline:
                        time.sleep(0.05)
                if after == "timer":
                    rc, doc, out = run_timer(fleet, "node", "held")
                    assert doc.get("given_back") and doc["given_back"][0]["changed"], (where, out)
                elif after == "facts":
                    facts = playbook("tests/integration/playbooks/facts_raw.yml",
                                     {"facts_args": {"protect_dir": hv["gpuckpt_protect_dir"], "check_criu": False,
                                                     "journal_dir": fleet.host_dir("node", "journal")}},
                                     inventory=fleet.path("inventory.yml"), limit="node")
                    assert facts.rc == 0, (where, facts.stdout)
                else:
                    res = fleet.ssh("node", command % after, check=False)
                    assert res.returncode == 0, (where, res.stdout)
                    if after == "give-back":
                        assert '"changed": true' in res.stdout, (where, res.stdout)
                assert not _records(fleet, "held"), where
            assert w.one_copy_runs_intact(), where
            w.no_count_twice()
        rc, doc, out = run_timer(fleet, "node", "held")  # protected as before
        assert not doc.get("given_back"), out
        assert w.one_copy_runs_intact()
        w.no_count_twice()
    finally:
        w.kill()


def test_a_migrated_protected_job_takes_its_protection_along(playbook, fleet, tmp_path):
    """A protected job migrated from its node to the target (issue 43, 7): its replica's record names the target at
    the next epoch, its timer and config leave the node, the target protects it (its timer's run is verified there),
    and a failover of the old node is refused (the job runs elsewhere): one copy, counting on, memory intact."""
    w = RemoteWorkload(fleet, "node", str(tmp_path / "moved"))
    try:
        fleet.ssh("node", "echo %d > %s" % (w.pid, os.path.join(w.dir, "job.pid")))
        jobs = [job_spec(w, "moved", keep=2)]
        assert protect(playbook, fleet, jobs).rc == 0
        run_timer(fleet, "node", "moved")
        record = os.path.join(fleet.host_vars["replica"]["gpuckpt_protect_replica_root"], "moved", "job.json")
        with open(record) as fh:
            before = json.load(fh)
        assert before["owner"] == "node", before

        moved = playbook("gpuckpt.fleet.migrate", {"source": "node", "target": "target", "pid": w.pid,
                                                   "migration_id": "m-carry-moved"},
                         inventory=fleet.path("inventory.yml"))
        assert moved.rc == 0, moved.stdout
        assert w.one_copy_runs_intact()
        with open(record) as fh:
            after = json.load(fh)
        assert after["owner"] == "target" and after["epoch"] == before["epoch"] + 1, after
        assert after["history"][-1]["event"] == "moved", after
        node_cfg = os.path.join(fleet.host_vars["node"]["gpuckpt_protect_dir"], "moved.json")
        target_cfg = os.path.join(fleet.host_vars["target"]["gpuckpt_protect_dir"], "moved.json")
        assert not os.path.exists(node_cfg) and os.path.exists(target_cfg)

        rc, doc, out = run_timer(fleet, "target", "moved")  # protected where it runs now
        assert doc["replicas"]["replica"] == "verified", out
        refused = failover(playbook, fleet, "moved", jobs, lost_node_confirmed=True)
        assert refused.rc != 0 and "target already owns job moved" in refused.stdout, refused.stdout
        assert w.one_copy_runs_intact()
        w.no_count_twice()
    finally:
        w.kill()
