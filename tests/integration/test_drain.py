"""drain.yml on three sshd "hosts" on loopback (127.0.0.12-14), each in its own pid namespace, with real ssh,
rsync-free pushes and CRIU: hosta is the node, hostb and hostc the targets. The GPU stage runs against the
libcuda TEST DOUBLE, and each host's GPU inventory and per-process GPU memory come from the nvidia-smi TEST
DOUBLE (tests/doubles/nvidia-smi), one JSON file per host: hostb has little free GPU memory, hostc a lot.

Every test ends with each workload running exactly once, counting on, its memory intact.
"""
from __future__ import annotations

import json
import os
import shlex
import threading
import time
import uuid

import pytest

from containerd_daemon import CTR, IMAGE, available as containerd_available, start_on_host, stop_on_host
from helpers import COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, RuncOnLoopbackHosts, write_runc_bundle
from loopback import LoopbackHosts
from loopback_workloads import RECOVER, Controller, RemoteWorkload, fakecuda_host_vars, processes

DRAIN = "gpuckpt.fleet.drain"
HOSTS = (("hosta", "127.0.0.12"), ("hostb", "127.0.0.13"), ("hostc", "127.0.0.14"))  # apart from the two-host tests
FREE_MIB = {"hosta": 81920, "hostb": 4096, "hostc": 81920}  # hostb cannot hold an 8 GiB job


@pytest.fixture(scope="module")
def hosts3(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hosts3"))
    host_vars = fakecuda_host_vars(base, names=[n for n, unused in HOSTS])
    for name in host_vars:
        host_vars[name].update({"gpuckpt_runc_root": os.path.join(base, name, "runc-root"),
                                "gpuckpt_runc_bundle": os.path.join(base, name, "bundle")})
    h = LoopbackHosts(base, hosts=HOSTS).start(host_vars)
    h.host_vars = host_vars
    yield h
    time.sleep(1)
    h.stop()


def smi_path(hosts, name):
    return hosts.host_vars[name]["gpuckpt_environment"]["GPUCKPT_FAKE_NVIDIA_SMI"]


def set_gpus(hosts, big=None, mapping=True):
    """Each host's GPU inventory (nvidia-smi TEST DOUBLE): its free memory, 1 MiB per libcuda-double process,
    and on hosta ``big`` ({pid: MiB}) more for those processes."""
    for name, unused in HOSTS:
        with open(smi_path(hosts, name)) as fh:
            spec = json.load(fh)
        spec["gpus"][0]["memory.free"] = FREE_MIB[name]
        spec["compute_apps"] = [{"pid": p, "gpu_uuid": spec["gpus"][0]["uuid"], "used_memory": mib}
                                for p, mib in (big or {}).items()] if name == "hosta" else []
        if mapping:
            spec["apps_mapping"] = {"path": FAKE_LIBCUDA, "gpu_uuid": spec["gpus"][0]["uuid"], "used_memory": 1}
        else:
            spec.pop("apps_mapping", None)
        with open(smi_path(hosts, name), "w") as fh:
            json.dump(spec, fh)


@pytest.fixture
def drain(playbook, hosts3):
    def run(extra=None, **kw):
        v = {"node": "hosta"}
        v.update(extra or {})
        return playbook(DRAIN, v, inventory=hosts3.path("inventory.yml"), **kw)
    return run


@pytest.fixture
def started(hosts3, tmp_path):
    """Workloads started on hosta, killed wherever they run at the end; the node's drain mark removed."""
    made = []

    def start(**kw):
        w = RemoteWorkload(hosts3, "hosta", str(tmp_path / ("w%d" % len(made))), **kw)
        made.append(w)
        return w

    yield start
    for w in made:
        w.kill()
    for name, unused in HOSTS:
        for f in ("drain.json", "throughput.json"):
            try:
                os.unlink(hosts3.path(name, "journal", f))
            except OSError:
                pass
    set_gpus(hosts3)


def where(hosts, w):
    """The host whose pid namespace runs the workload's parent."""
    pid = processes(w.dir)[0][0]
    ns = os.readlink("/proc/%d/ns/pid" % pid)
    for name, unused in HOSTS:
        if hosts.ssh(name, "readlink /proc/self/ns/pid").stdout.strip() == ns:
            return name
    return None


def lines(run, task):
    return run.task(task)["msg"]


def test_check_mode_prints_the_plan_and_the_drain_moves_each_workload_where_it_fits(drain, hosts3, started):
    """An 8 GiB job cannot go to hostb (4 GiB free): the plan puts it on hostc and the small one on hostb.
    --check prints that plan and freezes nothing; the drain then moves both, and the node is empty."""
    big, small = started(), started()
    set_gpus(hosts3, big={big.pid: 8192})
    before = {w: w.counts() for w in (big, small)}

    check = drain(check=True)
    assert check.rc == 0, check.stdout
    plan = "\n".join(lines(check, "The plan"))
    assert "MOVE  pid %d" % big.pid in plan and "-> hostc" in plan.split("pid %d" % big.pid)[1].split("\n")[0], plan
    assert "-> hostb" in plan.split("MOVE  pid %d" % small.pid)[1].split("\n")[0], plan
    assert "not on hostb: free GPU memory on target" in plan, plan
    assert "nothing was frozen" in plan
    assert where(hosts3, big) == where(hosts3, small) == "hosta"
    assert not os.path.exists(hosts3.path("hosta", "journal", "drain.json")), "--check writes no mark"
    for w in (big, small):
        assert w.one_copy_runs_intact()

    run = drain()
    assert run.rc == 0, run.stdout
    report = "\n".join(lines(run, "Where each workload runs now"))
    assert "MOVED   pid %d" % big.pid in report and "MOVED   pid %d" % small.pid in report, report
    assert where(hosts3, big) == "hostc" and where(hosts3, small) == "hostb"
    for w in (big, small):
        assert w.one_copy_runs_intact()
        assert w.counts()["parent"] > before[w]["parent"]
    with open(hosts3.path("hosta", "journal", "drain.json")) as fh:
        mark = json.load(fh)
    assert mark["empty"] is True and mark["pending"] == [], mark

    again = drain()
    assert again.rc == 0, again.stdout
    assert "0 workload(s) to move" in "\n".join(lines(again, "The plan"))


def inventory_with(hosts, path, **host_vars):
    """The loopback inventory with more variables for some hosts ({host: {var: value}})."""
    with open(hosts.path("inventory.yml")) as fh:
        inv = json.load(fh)
    for name, extra in host_vars.items():
        inv["gpu_nodes"]["hosts"][name].update(extra)
    with open(path, "w") as fh:
        json.dump(inv, fh)
    return str(path)


def test_a_job_that_fits_nowhere_stays_and_a_failed_restore_rolls_back_while_the_others_move(
        playbook, hosts3, started, tmp_path):
    """Three jobs, two moves at a time: one needs more GPU memory than any target has (it stays, named before
    any freeze); the small one's restore fails on hostb (its probe fails there: it rolls back and runs on on
    hosta); the 8 GiB one moves to hostc. The play fails (the node is not empty) and says why for each."""
    huge, big, small = started(), started(), started()
    set_gpus(hosts3, big={huge.pid: 200000, big.pid: 8192})
    inventory = inventory_with(hosts3, tmp_path / "inv.json", hostb={"gpuckpt_probe_command": "false"})
    run = playbook(DRAIN, {"node": "hosta", "drain_parallel": 2}, inventory=inventory)
    assert run.rc != 0, run.stdout
    plan = "\n".join(lines(run, "The plan"))
    assert "STAY  pid %d" % huge.pid in plan and "fits on no target" in plan, plan
    report = "\n".join(lines(run, "Where each workload runs now"))
    assert "MOVED   pid %d (python3) -> hostc" % big.pid in report, report
    assert "STAYED  pid %d (python3) on hosta" % small.pid in report and "rolled back" in report, report
    assert "STAYED  pid %d (python3) on hosta: fits on no target" % huge.pid in report, report
    assert "hosta is not empty" in run.task("The node is not empty")["msg"]
    assert where(hosts3, huge) == where(hosts3, small) == "hosta" and where(hosts3, big) == "hostc"
    for w in (huge, big, small):
        assert w.one_copy_runs_intact()
    # Nothing of the failed move is left on hostb's disk.
    assert os.listdir(hosts3.path("hostb", "images")) == []


def test_bad_options_and_unreadable_gpu_memory_are_refused_before_anything_is_frozen(drain, hosts3, started):
    w = started()
    old = source_journals(hosts3)
    set_gpus(hosts3, mapping=False)  # nvidia-smi lists no process: the job's GPU memory cannot be read
    for bad in ({"drain_parallel": 0}, {"gpuckpt_runtime_timeout": -1}, {"deadline": "soon"}):
        run = drain(bad)
        assert run.rc != 0, run.stdout
        assert ("Nothing was frozen: fix these options first" in run.stdout
                or "Validation of arguments failed" in run.stdout), run.stdout
        assert list(bad)[0] in run.stdout and "PLAY [Read the node" not in run.stdout
    single = drain({"pid": w.pid})  # migrate.yml's variable would aim every move at one workload
    assert single.rc != 0 and "belong(s) to migrate.yml" in single.stdout and "PLAY [Read the node" not in single.stdout
    run = drain()
    assert run.rc != 0, run.stdout
    plan = "\n".join(lines(run, "The plan"))
    assert "STAY  pid %d" % w.pid in plan and "GPU UNKNOWN" in plan, plan
    assert "install nvidia-ml-py (NVML) or nvidia-smi on" in plan, plan
    assert where(hosts3, w) == "hosta" and w.one_copy_runs_intact()
    assert source_journals(hosts3) == old, "nothing was frozen"


def test_a_deadline_too_short_for_one_job_leaves_it_running_and_names_it_before_any_freeze(drain, hosts3, started):
    """Measured throughputs (given here) and a 35 s deadline: the small job's move (about 30 s of overhead)
    ends in time, the 8 GiB one's (its image over 1 GB/s, plus the overhead) would not, so it stays."""
    big, small = started(), started()
    set_gpus(hosts3, big={big.pid: 8192})
    run = drain({"deadline": 35, "gpuckpt_drain_throughput": {"hostb": 1e9, "hostc": 1e9}})
    assert run.rc != 0, run.stdout
    plan = "\n".join(lines(run, "The plan"))
    assert "STAY  pid %d" % big.pid in plan and "past the deadline of 35 s" in plan, plan
    assert "MOVE  pid %d" % small.pid in plan and "est. 30 s" in plan, plan
    report = "\n".join(lines(run, "Where each workload runs now"))
    assert "MOVED   pid %d" % small.pid in report and "(estimated 30 s)" in report, report
    assert where(hosts3, big) == "hosta"
    for w in (big, small):
        assert w.one_copy_runs_intact()


def source_journals(hosts):
    d = hosts.path("hosta", "journal")
    return {f for f in (os.listdir(d) if os.path.isdir(d) else []) if f.endswith(".source.json")}


def frozen_moves(hosts, old=()):
    """The drain's moves whose source is frozen or further on (their source journals on hosta, but for ``old``)."""
    d = hosts.path("hosta", "journal")
    found = []
    for f in source_journals(hosts) - set(old):
        if f.startswith("drain-"):
            try:
                with open(os.path.join(d, f)) as fh:
                    if json.load(fh).get("phase") not in (None, "planned"):
                        found.append(f)
            except (OSError, ValueError):
                pass
    return found


def test_a_drain_whose_controller_is_killed_mid_move_is_finished_by_a_rerun(drain, hosts3, started, tmp_path):
    """The whole controller (ansible-playbook and every worker) is killed once a move has frozen its source.
    The re-run settles that move first (from the node's drain mark), then moves what is still on the node:
    each job ends with exactly one copy, counting on, its memory intact."""
    jobs = [started(), started()]
    set_gpus(hosts3)
    before = {w: w.counts() for w in jobs}
    old = source_journals(hosts3)
    ctl = Controller(hosts3, tmp_path, {"node": "hosta", "drain_parallel": 2}, name="gpuckpt.fleet.drain")
    deadline = time.monotonic() + 180
    while not frozen_moves(hosts3, old):
        assert ctl.proc.poll() is None, ctl.output()
        assert time.monotonic() < deadline, ctl.output()
        time.sleep(0.05)
    ctl.kill()
    with open(hosts3.path("hosta", "journal", "drain.json")) as fh:
        assert len(json.load(fh)["pending"]) == 2, "the mark names the moves before any begins"

    run = drain()
    assert run.rc == 0, run.stdout
    assert "node is empty" in run.stdout or "runs no GPU workload any more" in run.stdout, run.stdout
    for w in jobs:
        assert where(hosts3, w) in ("hostb", "hostc")
        assert w.one_copy_runs_intact()
        assert w.counts()["parent"] > before[w]["parent"]
    with open(hosts3.path("hosta", "journal", "drain.json")) as fh:
        assert json.load(fh)["pending"] == []


class RuncJob(RuncOnLoopbackHosts, CountingWorkload):
    """A runc container on hosta running the counter with the libcuda double; each target gets the same
    bundle under its own path (the host's gpuckpt_runc_bundle) and cgroup."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        self.hosts, self.dir = hosts, workdir
        self.id = "gpuckpt-d-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        args = ["/usr/bin/python3", COUNTER, "--dir", workdir, "--mb", "8", "--fakecuda", FAKE_LIBCUDA]
        env = ["GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, "FAKECUDA_STATE_DIR=%s" % hosts.path("hosta", "fakecuda")]
        for name, unused in HOSTS:
            write_runc_bundle(hosts.path(name, "bundle"), args, env, rw=[workdir, hosts.path()],
                              cgroup="/gpuckpt-test-%s-%s" % (name, self.id))
        self.runc("hosta", "run --detach --bundle %s %s" % (hosts.path("hosta", "bundle"), self.id), relay=True)
        self.wait_counting()

    def cleanup(self):
        for name, unused in HOSTS:
            self.runc(name, "delete --force %s" % self.id, check=False)


class ContainerdJob(CountingWorkload):
    """A containerd per host (started over ssh, in that host's pid namespace) with the skeleton image; a
    counting task on hosta in a namespace of its own (k8s.io is the kubelet's: a drain leaves pods' containers be)."""

    roles = ("parent", "child1")

    def __init__(self, hosts, workdir):
        self.hosts, self.dir, self.namespace = hosts, workdir, "gpuckpt-drain"
        self.id = "gpuckpt-dc-" + uuid.uuid4().hex[:8]
        os.makedirs(workdir, exist_ok=True)
        self.daemons = {}
        for name, unused in HOSTS:
            d = start_on_host(hosts, name, ctrd_dir(name))
            d.import_skeleton(self.namespace)
            self.daemons[name] = d
        args = ["run", "--detach", "--runc-root", hosts.host_vars["hosta"]["gpuckpt_runc_root"],
                "--log-uri", "file://" + os.path.join(workdir, "out.log"), "--env", "PATH=/usr/bin:/bin",
                "--env", "GPUCKPT_LIBCUDA=%s" % FAKE_LIBCUDA, "--env", "FAKECUDA_STATE_DIR=%s" % hosts.path("hosta", "fakecuda")]
        for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (workdir, "rw"), (hosts.path(), "rw")]:
            args += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, opt)]
        cmd = "exec /usr/bin/python3 %s --dir %s --mb 8 --fakecuda %s" % (COUNTER, workdir, FAKE_LIBCUDA)
        hosts.ssh("hosta", " ".join(shlex.quote(a) for a in [CTR, "--address", self.daemons["hosta"].address,
                                                             "--namespace", self.namespace] + args
                                    + [IMAGE, self.id, "/bin/sh", "-c", cmd]))
        self.wait_counting()

    def status(self, host):
        for line in self.daemons[host].ctr("tasks", "ls", namespace=self.namespace).stdout.splitlines()[1:]:
            f = line.split()
            if f and f[0] == self.id:
                return f[2]
        return None

    def cleanup(self):
        for d in self.daemons.values():
            d.remove_all()


def ctrd_dir(name):
    return "/tmp/gpk-dctrd-%s-%d" % (name, os.getpid())


@pytest.mark.skipif(not containerd_available(), reason="containerd 2.x (tests/setup.sh) and python3-grpcio")
def test_a_node_with_a_process_a_runc_container_and_a_containerd_task_is_emptied(playbook, hosts3, started, tmp_path):
    """Each runtime's GPU workload is found on the node (no name given), placed and moved with migrate.yml's
    transaction, two at a time; the runc container and the containerd task keep running under their runtimes
    on their targets."""
    set_gpus(hosts3)
    proc = started()
    runc_job = RuncJob(hosts3, str(tmp_path / "runc"))
    ctrd_job = None
    try:
        ctrd_job = ContainerdJob(hosts3, str(tmp_path / "ctrd"))
        inventory = inventory_with(hosts3, tmp_path / "inv.json",
                                   **{name: {"gpuckpt_containerd_address": ctrd_job.daemons[name].address}
                                      for name, unused in HOSTS})
        before = {w: w.counts() for w in (proc, runc_job, ctrd_job)}
        run = playbook(DRAIN, {"node": "hosta", "drain_parallel": 2}, inventory=inventory)
        assert run.rc == 0, run.stdout
        plan = "\n".join(lines(run, "The plan"))
        assert "3 workload(s) to move" in plan, plan
        assert "container %s (runc)" % runc_job.id in plan and "container %s (containerd)" % ctrd_job.id in plan, plan
        report = "\n".join(lines(run, "Where each workload runs now"))
        assert report.count("MOVED") == 3, report
        runc_on = [n for n, unused in HOSTS if (runc_job.state(n) or {}).get("status") == "running"]
        ctrd_on = [n for n, unused in HOSTS if ctrd_job.status(n) == "RUNNING"]
        assert len(runc_on) == 1 and runc_on[0] != "hosta", runc_on
        assert len(ctrd_on) == 1 and ctrd_on[0] != "hosta", ctrd_on
        assert where(hosts3, proc) in ("hostb", "hostc")
        for w in (proc, runc_job, ctrd_job):
            w.went_on_intact(before[w])
            assert w.no_count_twice()
    finally:
        runc_job.cleanup()
        if ctrd_job:
            ctrd_job.cleanup()
        for name, unused in HOSTS:
            stop_on_host(hosts3, name, ctrd_dir(name))


def test_with_a_deadline_a_target_never_measured_is_probed_before_the_plan_and_nothing_is_left(drain, hosts3, started):
    """No throughput recorded or given: the deadline's plan has each target measured first, by scratch data sent
    through the migration's own transfer (under --check too: it freezes nothing), and the estimates come from it.
    The probe's scratch images are gone from both hosts afterwards."""
    w = started()
    set_gpus(hosts3)
    record = hosts3.path("hosta", "journal", "throughput.json")
    if os.path.exists(record):
        os.unlink(record)
    run = drain({"deadline": 600, "gpuckpt_drain_probe_mib": 64}, check=True)
    assert run.rc == 0, run.stdout[-4000:]
    plan = "\n".join(lines(run, "The plan"))
    assert "MOVE  pid %d" % w.pid in plan and "est. " in plan, plan
    for name in ("hosta", "hostb", "hostc"):
        left = [p for root, dirs, files in os.walk(hosts3.path(name)) for p in dirs if p.startswith(".gpuckpt-probe-")]
        assert left == [], (name, left)
    assert w.one_copy_runs_intact()


# ---- issue 43, item 2: a target that dies mid-move is that move's failure, never the drain's ---------------------
def target_journals(hosts, host):
    """{migration id: target journal} of the drain's moves on ``host``."""
    d, out = hosts.path(host, "journal"), {}
    for f in os.listdir(d) if os.path.isdir(d) else []:
        if f.startswith("drain-") and f.endswith(".target.json"):
            try:
                with open(os.path.join(d, f)) as fh:
                    out[f[:-len(".target.json")]] = json.load(fh)
            except (OSError, ValueError):
                pass
    return out


def line_of(report, start):
    """The report's line that begins with ``start`` (the report in the failure otherwise)."""
    found = [x for x in report.split("\n") if x.lstrip().startswith(start.strip())]
    assert found, "no line %r in:\n%s" % (start, report)
    return found[0]


def crash_between_shell_starts(hosts, name):
    """hosts.crash(name) at a moment when none of the host's processes is in pyenv's startup. The loopback hosts
    share this machine's files: a root shell's pyenv rehash (root's .bashrc runs it for every ssh command) killed
    while it held its lock (~/.pyenv/shims/.pyenv-shim) would hold every later shell of every host up for 60 s,
    as the crash of a real host does not."""
    for unused in range(500):
        hosts.freeze(name)  # (every process of the host stopped: none starts or ends while they are looked at)
        busy = []
        for p in hosts.processes(name):
            try:
                with open("/proc/%d/cmdline" % p, "rb") as fh:
                    argv = fh.read().split(b"\0")
                if b"/libexec/pyenv" in b" ".join(argv) or argv[0].endswith(b"pyenv"):  # (pyenv, its rehash)
                    busy.append(p)
            except OSError:
                pass
        if not busy:
            hosts.crash(name)
            return
        hosts.thaw(name)
        time.sleep(0.01)
    raise AssertionError("%s never stopped starting shells" % name)


def states(w):
    return sorted(s for unused, s in processes(w.dir))


def twice(w, role="parent"):
    seen = w.counted(role)
    return sorted({c for i, c in enumerate(seen[1:]) if c <= seen[i]})


def test_a_target_that_dies_once_its_copy_runs_is_that_moves_failure_and_no_rerun_rewinds_silently(
        drain, playbook, hosts3, started):
    """Two jobs, one move at a time: the 2 GiB one goes first, to hostc; the small one to hostb. hostc dies (every
    process killed, files kept) while its restored copy already counts (its unlock is slowed, so the restore has
    not returned yet: the controller's task there ends UNREACHABLE). That is the move's failure: the drain goes on
    with the other move, reports, and says that the job is HELD (stopped) on hosta, with the command that settles
    it. After hostc's restart a plain re-run settles the move: hostc answers that its copy was brought up and is
    gone, so resuming the source would rewind the job; the re-run does not, and says so (nothing written twice).
    recover.yml with gpuckpt_accept_rewind=true, as that line says, resumes it and says how long the lost copy ran
    at most: each job runs once, intact, and what was written twice is what the lost copy wrote."""
    first, second = started(), started()
    set_gpus(hosts3, big={first.pid: 2048})
    delay = hosts3.path("hostc", "fakecuda", "delay")
    with open(delay, "w") as fh:
        # Each unlock returns 3 s after the process it unlocked runs on: the copy counts while its restore (and the
        # controller's task on hostc) has not returned.
        fh.write("unlock 0 3000\n")
    box = {}

    def crash_once_the_copy_runs():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for mid, doc in target_journals(hosts3, "hostc").items():
                if doc.get("phase") == "restoring" and doc.get("identities"):
                    seen = first.counts()["parent"]
                    while first.counts()["parent"] < seen + 3:  # the source is stopped: this is the copy counting
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    crash_between_shell_starts(hosts3, "hostc")
                    box.update(mid=mid, counted=first.counts(), at=time.monotonic())
                    return
            time.sleep(0.005)

    t = threading.Thread(target=crash_once_the_copy_runs)
    t.daemon = True
    t.start()
    try:
        run = drain()
        t.join(30)
        assert "mid" in box, run.stdout[-6000:]
        assert run.rc not in (0, 4), run.stdout[-6000:]  # a failed move, never an UNREACHABLE end of the drain
        report = "\n".join(lines(run, "Where each workload runs now"))
        assert "MOVED   pid %d (python3) -> hostb" % second.pid in report, report
        held = line_of(report, "HELD    pid %d (python3) on hosta" % first.pid)
        assert "hostc could not be asked" in held and "recover" in held and box["mid"] in held, report
        assert states(first) == ["T", "T"], "held, stopped: %s" % states(first)
        assert "hosta is not empty" in run.task("The node is not empty")["msg"]
        assert where(hosts3, second) == "hostb" and second.one_copy_runs_intact()
    finally:
        os.unlink(delay)
        if "mid" in box:
            hosts3.boot("hostc")

    again = drain()  # hostc answers again; its copy died with it
    assert again.rc != 0, again.stdout[-6000:]
    report = "\n".join(lines(again, "Where each workload runs now"))
    held = line_of(report, "HELD    pid %d (python3) on hosta" % first.pid)
    assert "rewind" in held and "gpuckpt_accept_rewind=true" in held, report
    assert states(first) == ["T", "T"] and twice(first) == [], "nothing resumed, nothing written twice"

    # The operator accepts the rewind with the command the line names: the job runs on from its freeze, and the
    # play says what was rolled back.
    accepted = playbook(RECOVER, {"source": "hosta", "target": "hostc", "migration_id": box["mid"],
                                  "gpuckpt_accept_rewind": True}, inventory=hosts3.path("inventory.yml"))
    assert accepted.rc == 0, accepted.stdout[-6000:]
    said = accepted.task("Report where the workload runs")["msg"]
    assert "rolled back: the workload runs on hosta" in said and "its copy on hostc was brought up" in said, said
    assert "s at most" in said, said
    assert where(hosts3, first) == "hosta"
    for w in (first, second):
        assert w.one_copy_runs_intact()
    # What was written twice is exactly what the lost copy wrote, and no more.
    assert twice(first) and max(twice(first)) <= box["counted"]["parent"], (twice(first), box)
    assert twice(second) == []


# ---- issue 43, item 3: "empty" is read from the hosts at the end --------------------------------------------------
class WorkloadOn(RemoteWorkload):
    """A counting job on ``host`` whose pids start at ``first_pid`` (kept apart from the other host's jobs, whose
    pids a move onto this host would need free)."""

    def __init__(self, hosts, host, workdir, first_pid):
        self.dir = workdir
        res = hosts.ssh(host, "echo %d > /proc/sys/kernel/ns_last_pid; python3 %s --dir %s --daemon --fakecuda %s --mb 8"
                        % (first_pid - 1, COUNTER, workdir, FAKE_LIBCUDA))
        self.pid = int(res.stdout.strip().splitlines()[-1])
        self.wait_counting()


def test_two_drains_started_together_onto_each_other_never_both_call_their_node_empty(
        playbook, hosts3, started, tmp_path):
    """hosta drained onto hostb and hostb onto hosta, both at once: each drain marks its node before it plans, and
    checks its target's mark again right before a move. A drain ends 0 ("runs no GPU workload any more") only
    when its node is found empty at its end; whatever the interleaving, no job is left on a node whose drain
    said so, and each job runs once."""
    ja = started()
    jb = WorkloadOn(hosts3, "hostb", str(tmp_path / "jb"), 30001)
    set_gpus(hosts3)
    try:
        inventory = hosts3.path("inventory.yml")
        runs = {}

        def drain_of(node, target):
            runs[node] = playbook(DRAIN, {"node": node, "targets": target}, inventory=inventory)

        threads = [threading.Thread(target=drain_of, args=a) for a in (("hosta", "hostb"), ("hostb", "hosta"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(runs) == ["hosta", "hostb"], runs
        at = {"hosta": [w for w in (ja, jb) if where(hosts3, w) == "hosta"],
              "hostb": [w for w in (ja, jb) if where(hosts3, w) == "hostb"]}
        for node, run in runs.items():
            said_empty = "runs no GPU workload any more" in run.stdout
            assert (run.rc == 0) == said_empty == (at[node] == []), (node, run.rc, at, run.stdout[-5000:])
            for w in at[node]:
                assert "pid %d" % w.pid in run.task("The node is not empty")["msg"], run.stdout[-5000:]
        for w in (ja, jb):
            assert w.one_copy_runs_intact()
    finally:
        jb.kill()


def test_a_job_started_on_the_node_after_the_plan_keeps_it_from_being_called_empty(drain, hosts3, started):
    """The plan names one job; a second starts on the node while the first one's move runs. The drain moves the
    first, finds the second when it reads the node again at its end, and fails naming it: the node is not empty."""
    first = started()
    set_gpus(hosts3)
    delay = hosts3.path("hosta", "fakecuda", "delay")
    with open(delay, "w") as fh:
        fh.write("checkpoint 0 4000\n")  # the move lasts long enough for the late job to be counting
    box, old = {}, source_journals(hosts3)

    def start_after_the_plan():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not frozen_moves(hosts3, old):
            time.sleep(0.02)
        box["late"] = started()
        box["at"] = time.monotonic()

    t = threading.Thread(target=start_after_the_plan)
    t.daemon = True
    t.start()
    try:
        run = drain()
        done = time.monotonic()
        t.join(60)
    finally:
        os.unlink(delay)
    late = box["late"]
    assert box["at"] < done, "the late job must be counting before the drain ends"
    assert "1 workload(s) to move" in "\n".join(lines(run, "The plan"))
    assert run.rc != 0, run.stdout[-5000:]
    report = "\n".join(lines(run, "Where each workload runs now"))
    assert "MOVED   pid %d (python3) -> " % first.pid in report, report
    assert "pid %d" % late.pid in report and "pid %d" % late.pid in run.task("The node is not empty")["msg"], report
    assert "runs no GPU workload any more" not in run.stdout
    assert where(hosts3, late) == "hosta" and where(hosts3, first) in ("hostb", "hostc")
    for w in (first, late):
        assert w.one_copy_runs_intact()
