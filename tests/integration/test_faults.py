"""The migration under faults and hostile input: it never loses, rewinds, freezes, corrupts or exposes
the workload.

Two real sshd "hosts" on loopback (each its own pid namespace), real ssh, CRIU and ansible-playbook;
the GPU stage against the libcuda TEST DOUBLE, which can be told to make a call slow (a large GPU
memory) or fail. The faults are made from outside, as they happen: the controller's whole process
tree killed at every phase (Ansible's workers call setsid: the tree is walked and frozen before it is
killed), a target host that hangs or dies, a full disk under the target's journal, a byte changed with
its timestamps put back, stale and planted paths, an unprivileged reader, pids reused after a crash.

Every test ends with exactly one copy running, counting on from its last count with no count written
twice (a copy that ran and was thrown away would have written some twice), its memory intact.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import bad_link_python

from loopback_workloads import RECOVER, Controller, changed_tasks, migrate, processes


# ---- helpers ------------------------------------------------------------------------------------------
def journal(hosts, host, mid, role):
    try:
        with open(hosts.path(host, "journal", "%s.%s.json" % (mid, role))) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def phase(hosts, host, mid, role):
    return journal(hosts, host, mid, role).get("phase")


def wait_for(what, predicate, timeout=60.0, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    raise AssertionError("timed out waiting for %s" % what)


def pages_arriving(hosts, mid):
    """Some of the image's page data is on the target already."""
    d = hosts.path("hostb", "images", mid)
    try:
        return any(n.startswith("pages-") and os.path.getsize(os.path.join(d, n)) > 0 for n in os.listdir(d))
    except OSError:
        return False


def fakecuda(hosts, host, kind, line):
    """Tell the libcuda test double of ``host`` to fail (kind inject), slow down (kind delay) or hold until the test
    removes the file (kind hold) a call."""
    with open(hosts.path(host, "fakecuda", kind), "a") as fh:
        fh.write(line + "\n")


@pytest.fixture(autouse=True)
def clean_fakecuda(hosts):
    yield
    for host in ("hosta", "hostb"):
        for kind in ("inject", "delay", "hold"):
            try:
                os.unlink(hosts.path(host, "fakecuda", kind))
            except OSError:
                pass


def recover(playbook, mid, **extra):
    v = {"source": "hosta", "target": "hostb", "migration_id": mid}
    v.update(extra)
    return playbook(RECOVER, v, inventory=HOSTS_INVENTORY[0])


HOSTS_INVENTORY = []


@pytest.fixture(autouse=True)
def inventory(hosts):
    HOSTS_INVENTORY[:] = [hosts.path("inventory.yml")]


def runs_on(hosts, w):
    """The host whose pid namespace runs the workload's copy."""
    ns = os.readlink("/proc/%d/ns/pid" % processes(w.dir)[0][0])
    for host in ("hosta", "hostb"):
        if ns == hosts.ssh(host, "readlink /proc/self/ns/pid").stdout.strip():
            return host
    return None


def nothing_left(hosts, mid, settled_on):
    """No straggler: nothing of the migration runs on either host (receivers, modules, ssh streams),
    and nothing writes into the target afterwards."""
    target_image = hosts.path("hostb", "images", mid)

    def quiet():
        # Any process that names the migration, and any module run on these hosts (another test's modules run on
        # its own hosts when the tests run in parallel workers).
        on_hosts = {p for name in ("hosta", "hostb") for p in hosts.processes(name)}
        mine = []
        for d in os.listdir("/proc"):
            try:
                with open("/proc/%s/cmdline" % d, "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if mid in cmd or ("AnsiballZ_gpu_" in cmd and d.isdigit() and int(d) in on_hosts):
                mine.append(cmd[:160])
        return not mine

    wait_for("the migration's processes to end", quiet, timeout=20, poll=0.2)
    for host in ("hosta", "hostb"):  # nor an image tmpfs of it (gpuckpt_image_in_memory)
        mounts = hosts.ssh(host, "cat /proc/self/mountinfo").stdout
        assert not [m for m in mounts.splitlines() if mid in m], "an image tmpfs of %s is left on %s" % (mid, host)
    if settled_on == "hosta":
        time.sleep(2)
        assert not os.path.exists(target_image), "something wrote into the target after it was cleaned"


def settle_checks(playbook, hosts, w, mid, recovery="recover"):
    """Recover twice (or re-run migrate.yml with the same id): the second changes nothing; exactly one
    copy runs, no count written twice, memory intact, nothing left behind."""
    if recovery == "recover":
        first = recover(playbook, mid)
        second = recover(playbook, mid)
    else:
        first = migrate(playbook, hosts, w, mid)
        second = migrate(playbook, hosts, w, mid)
    assert first.rc == 0, first.stdout
    assert second.rc == 0 and changed_tasks(second) == [], (changed_tasks(second), second.stdout)
    assert w.one_copy_runs_intact()
    w.no_count_twice()
    where = runs_on(hosts, w)
    said = first.task("Report where the workload runs")["msg"]
    assert ("runs on %s" % where) in said, said
    nothing_left(hosts, mid, where)
    return where


# ---- the controller killed at every phase ------------------------------------------------------------
PHASES = {
    # name: (extra vars, host/role/phases to wait for, fakecuda delays)
    "begun": ({}, ("hostb", "target", ("receiving",)), ()),
    "freezing": ({}, ("hosta", "source", ("freezing",)), [("hosta", "checkpoint 0 3000")]),
    "push": ({"gpuckpt_transfer_streams": 1}, ("hosta", "source", ("frozen", "checkpointed")), ()),
    "streams": ({"gpuckpt_transfer_during_dump": False, "gpuckpt_transfer_bwlimit": 6000},
                ("hostb", "target", ("receiving",)), ()),
    "restoring": ({}, ("hostb", "target", ("restoring",)), [("hostb", "restore 0 3000")]),
    "restored": ({}, ("hostb", "target", ("restored",)), [("hostb", "unlock 0 300")]),
    # The source's image in memory (issue 32): its tmpfs must go with whichever way the recovery settles.
    "push, image in memory": ({"gpuckpt_transfer_streams": 1, "gpuckpt_image_in_memory": True},
                              ("hosta", "source", ("frozen", "checkpointed")), ()),
    "restoring, image in memory": ({"gpuckpt_image_in_memory": True}, ("hostb", "target", ("restoring",)),
                                   [("hostb", "restore 0 3000")]),
    "target committed": ({}, ("hostb", "target", ("committed",)), ()),
}


@pytest.mark.parametrize("when", list(PHASES))
def test_controller_killed_then_recovered_twice(playbook, hosts, remote_workload, tmp_path, when):
    extra, (host, role, phases), delays = PHASES[when]
    w = remote_workload(mb=96 if when in ("push", "streams") else 24)
    mid = "t-kill-" + when.replace(",", "").replace(" ", "-")
    for h, line in delays:
        fakecuda(hosts, h, "delay", line)
    if when == "streams":  # let the kill land while the stage-2 streams run, not before them
        extra = dict(extra)
    ctl = Controller(hosts, tmp_path, dict({"source": "hosta", "target": "hostb", "pid": w.pid, "migration_id": mid},
                                           **extra))
    if when == "streams":
        wait_for("stage 2 to send", lambda: phase(hosts, "hosta", mid, "source") == "checkpointed"
                 and pages_arriving(hosts, mid), timeout=120)
    elif when == "push":
        wait_for("the push to carry pages", lambda: phase(hosts, host, mid, role) in phases
                 and pages_arriving(hosts, mid), timeout=120)
    else:
        wait_for("phase %s" % (phases,), lambda: phase(hosts, host, mid, role) in phases, timeout=120)
    ctl.kill()
    for h in ("hosta", "hostb"):
        try:
            os.unlink(hosts.path(h, "fakecuda", "delay"))
        except OSError:
            pass
    settle_checks(playbook, hosts, w, mid,
                  recovery="migrate" if when.split(",")[0] in ("freezing", "restoring") else "recover")


# ---- a step that runs longer than the recovery waits ---------------------------------------------------
def test_a_freeze_longer_than_the_recovery_waits_is_never_decided_under_it(playbook, hosts, remote_workload, tmp_path):
    """The controller dies while the source's CUDA checkpoint takes 12 s. A recovery that may wait only
    3 s fences the checkpoint and says what it waits for, deciding nothing on the source; the
    checkpoint stops at its next step and rolls itself back; the next recovery finds it done."""
    w = remote_workload()
    mid = "t-long-freeze"
    # The CUDA checkpoint returns when the test says so (at most 120 s), however slow the machine is meanwhile.
    fakecuda(hosts, "hosta", "hold", "checkpoint 0 120000")
    ctl = Controller(hosts, tmp_path, {"source": "hosta", "target": "hostb", "pid": w.pid, "migration_id": mid})
    wait_for("the freeze", lambda: phase(hosts, "hosta", mid, "source") == "freezing", timeout=60)
    ctl.kill()
    busy = recover(playbook, mid, gpuckpt_settle_wait=3)
    assert busy.rc != 0
    said = busy.task("Resume the source")["msg"]
    assert "the checkpoint of" in said and "held by" in said, said
    assert phase(hosts, "hosta", mid, "source") == "freezing"
    os.unlink(hosts.path("hosta", "fakecuda", "hold"))  # the checkpoint returns: it finds its fence
    wait_for("the fenced checkpoint to roll back", lambda: phase(hosts, "hosta", mid, "source") == "rolled_back",
             timeout=60, poll=0.2)
    assert settle_checks(playbook, hosts, w, mid) == "hosta"


# ---- the target's paths: stale, planted, not ours ------------------------------------------------------
@pytest.mark.parametrize("planted", ["an older complete image", "a directory with a file", "a symlink"])
def test_a_target_path_that_exists_is_refused_before_anything_is_frozen(playbook, hosts, remote_workload, tmp_path,
                                                                        planted):
    w = remote_workload()
    mid = "t-stale-" + planted.split()[-1]
    path = hosts.path("hostb", "images", mid)
    os.makedirs(hosts.path("hostb", "images"), exist_ok=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("unrelated\n")
    if planted == "a symlink":
        os.symlink(str(victim), path)
    else:
        os.mkdir(path, 0o700)
        if planted == "an older complete image":
            with open(os.path.join(path, "pages-1.img"), "wb") as fh:
                fh.write(os.urandom(4096))
            with open(os.path.join(path, "manifest.json"), "w") as fh:
                json.dump({"id": "another-job", "files": {}}, fh)
        else:
            with open(os.path.join(path, "keep.txt"), "w") as fh:
                fh.write("unrelated\n")
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    try:
        run = migrate(playbook, hosts, w, mid)
        assert run.rc != 0
        msg = run.task("Start the migration on hostb")["msg"]
        assert "exists already" in msg and "nothing was frozen" in msg, msg
        assert not os.path.exists(hosts.path("hosta", "journal", "%s.source.json" % mid)), "nothing may be frozen"
        assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
        assert (victim / "keep.txt").read_text() == "unrelated\n"
        # Recovering it deletes nothing that the migration did not create.
        assert recover(playbook, mid).rc == 0
        assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
        assert w.one_copy_runs_intact()
        w.no_count_twice()
    finally:
        if os.path.islink(path):
            os.unlink(path)
        else:
            subprocess.run(["rm", "-rf", path], check=False)


def test_an_unprivileged_user_never_reads_the_image_as_it_arrives(playbook, hosts, remote_workload, tmp_path):
    """While the image arrives on the target (slowly: a bandwidth limit), a process of user nobody
    tries again and again to list the target's image dir and read its files. It never can: the dir is
    0700 and every file 0600 from its first byte."""
    w = remote_workload(mb=24)
    mid = "t-reader"
    target = hosts.path("hostb", "images", mid)
    # The reader may reach the image root (as on a host whose /var/lib is 0755): only the modes that
    # the migration gives stop it.
    opened, d = [], hosts.path("hostb", "images")
    os.makedirs(d, exist_ok=True)
    while d != "/":
        opened.append((d, os.stat(d).st_mode & 0o7777))
        os.chmod(d, opened[-1][1] | 0o755)
        d = os.path.dirname(d)
    stop = "/tmp/.gpuckpt-test-reader-stop-%d" % os.getpid()  # the reader (user nobody) stops when it appears
    reader = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", r'''
import json, os, sys, time
target, stop, got, tries = sys.argv[1], sys.argv[2], [], 0
end = time.time() + 60
while time.time() < end and not os.path.exists(stop):
    tries += 1
    for path in [target] + [os.path.join(target, n) for n in ("pages-1.img", "pages-2.img", "pages-3.img", "core-1.img",
                                                               "inventory.img", ".gpuckpt")]:
        try:
            if os.path.isdir(path):
                got.append(("listed", path, os.listdir(path)))
            else:
                with open(path, "rb") as fh:
                    got.append(("read", path, len(fh.read(16))))
        except OSError:
            pass
    time.sleep(0.002)
print(json.dumps({"tries": tries, "got": got}))
''', target, stop], stdout=subprocess.PIPE)
    seen_modes = []

    def watch():  # what root sees meanwhile: the modes from the first byte
        while reader.poll() is None:
            try:
                seen_modes.append(("dir", os.stat(target).st_mode & 0o777))
                for f in os.listdir(target):
                    seen_modes.append((f, os.lstat(os.path.join(target, f)).st_mode & 0o777))
            except OSError:
                pass
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        run = migrate(playbook, hosts, w, mid, gpuckpt_transfer_bwlimit=8000)
    finally:
        open(stop, "w").close()
        out, _err = reader.communicate(timeout=70)
        os.unlink(stop)
        t.join()
        for d, mode in opened:
            os.chmod(d, mode)
    assert run.rc == 0, run.stdout
    result = json.loads(out)
    assert result["tries"] > 50 and result["got"] == [], result["got"][:5]
    modes = {m for name, m in seen_modes if name == "dir"}
    assert modes == {0o700}, modes
    files = {m for name, m in seen_modes if name not in ("dir", ".gpuckpt")}
    assert files and files <= {0o600}, files
    assert w.one_copy_runs_intact()


def test_a_byte_changed_on_the_target_with_its_times_put_back_is_found(playbook, hosts, remote_workload, tmp_path):
    """After the image arrived (receipts written, manifest landed) and before the restore reads it, a
    byte of a pages file is changed on the target and its mtime and atime put back. The receipts no
    longer stand for that file (its ctime moved): verification reads it, finds the chunk, the repair
    sends only what differs, and the workload comes back intact."""
    w = remote_workload(mb=24)
    mid = "t-flip-after"
    flipped = tmp_path / "flipped"
    tamper = bad_link_python(tmp_path / "tamper-python", "flip-after", 4096, flipped)
    run = migrate(playbook, hosts, w, mid, gpuckpt_transfer_python=tamper, gpuckpt_restore_early=False,
                  gpuckpt_transfer_streams=1)
    assert flipped.exists(), "the file was never changed"
    assert run.rc == 0, run.stdout
    first = [r for r in run.results if r["_task"].startswith("Restore on hostb") and r["_status"] != "skipped"][0]
    assert first["_status"] == "failed" and first["stage"] == "verify" and "checksum mismatch in pages-" in first["msg"]
    repair = run.task("re-send only what differs")
    assert repair["bytes_already_there"] > 0 and repair["bytes_transferred"] < repair["bytes_total"], repair
    assert w.one_copy_runs_intact()
    w.no_count_twice()


# ---- a full disk under the target's journal ------------------------------------------------------------
def test_the_targets_disk_full_under_its_journal_still_rolls_back(playbook, hosts, remote_workload):
    """The target's images and journal are on one small disk, which fills up while the image arrives
    (another job writes to it). The transfer fails, the settlement removes what the migration wrote
    and records it (the journal keeps a spare file for this), and the source runs on."""
    w = remote_workload(mb=24)
    mid = "t-disk-full"
    disk = hosts.path("hostb", "disk")
    setup = ("mkdir -p {d} && mount -t tmpfs -o size=200m gpuckpt-full {d} && mkdir -p {d}/images {d}/journal "
             "&& mount --bind {d}/images {i} && mount --bind {d}/journal {j}").format(
        d=disk, i=hosts.path("hostb", "images"), j=hosts.path("hostb", "journal"))
    os.makedirs(hosts.path("hostb", "images"), exist_ok=True)
    os.makedirs(hosts.path("hostb", "journal"), exist_ok=True)
    hosts.ssh("hostb", setup)
    # Another job takes the disk once the first pages have arrived. The wait runs on hostb itself, so
    # no ssh start-up lies between the arrival and the fill, and the transfer is slowed to 2 MB/s (a
    # 24 MiB workload's image then takes over 10 s), so the fill, which takes well under a second on
    # tmpfs, always lands while the image is still arriving: never after it is complete.
    pages = "%s/%s/pages-*" % (hosts.path("hostb", "images"), mid)
    filler = hosts.popen_ssh("hostb", "for i in $(seq 1200); do for f in %s; do [ -s \"$f\" ] && break 2; done; "
                             "sleep 0.05; done; dd if=/dev/zero of=%s/other-job bs=1M count=190 2>&1; true"
                             % (pages, disk))
    try:
        run = migrate(playbook, hosts, w, mid, gpuckpt_transfer_bwlimit=2000)
        out = filler.communicate(timeout=60)[0]
        assert "No space left" in out or "190+0 records out" in out, out
        assert run.rc != 0
        assert "disk is full" in run.stdout or "No space left" in run.stdout, run.stdout
        assert "rolled back; the workload runs on hosta" in run.stdout
        assert not os.path.exists(hosts.path("hostb", "images", mid))
        assert hosts.ssh("hostb", "cat %s/journal/%s.target.json" % (disk, mid)).stdout.count('"cleaned"') >= 1
        assert w.one_copy_runs_intact()
        w.no_count_twice()
    finally:
        if filler.poll() is None:
            filler.kill()
            filler.wait()
        hosts.ssh("hostb", "umount %s %s; umount %s" % (hosts.path("hostb", "images"), hosts.path("hostb", "journal"),
                                                        disk), check=False)


# ---- a target that hangs, or dies ----------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["hangs", "dies"])
def test_a_target_that_hangs_or_dies_mid_transfer_rolls_back_with_a_message(playbook, hosts, remote_workload, fault):
    """The target stops answering (all its processes stopped) or dies (all killed) while the image is
    on its way. The transfer gives up after its io_timeout, the target cannot be asked, and since the
    image's manifest never left the source, the source is resumed at once, saying so. Once the target
    is back, recover.yml cleans what is left there."""
    w = remote_workload(mb=96)
    mid = "t-target-" + fault
    box = {}

    def fault_in():
        wait_for("the image on its way", lambda: pages_arriving(hosts, mid), timeout=120)
        (hosts.freeze if fault == "hangs" else hosts.crash)("hostb")
        box["at"] = time.monotonic()

    t = threading.Thread(target=fault_in)
    t.daemon = True
    t.start()
    try:
        run = migrate(playbook, hosts, w, mid, gpuckpt_transfer_io_timeout=6, gpuckpt_transfer_bwlimit=20000,
                      gpuckpt_transfer_during_dump=False, gpuckpt_host_timeout=12, ansible_ssh_timeout=5)
        t.join()
        assert run.rc != 0 and "at" in box, run.stdout
        assert time.monotonic() - box["at"] < 90, "the source was frozen too long:\n" + run.stdout
        said = run.task("Report where the workload runs")["msg"]
        assert "rolled back: the workload runs on hosta" in said and "hostb could not be asked" in said, said
        assert w.one_copy_runs_intact()
    finally:
        if fault == "hangs":
            hosts.thaw("hostb")
        else:
            hosts.boot("hostb")
    assert settle_checks(playbook, hosts, w, mid) == "hosta"


# ---- a killed restore job, and pids reused after a crash -----------------------------------------------
def test_the_early_restore_killed_as_a_whole_is_noticed_and_the_restore_runs_anyway(playbook, hosts, remote_workload):
    """The target's restore job (begun before the freeze, waiting for the image) is killed with its
    async wrapper, as the OOM killer or a reboot would. Stage 3 notices that it is gone instead of
    waiting for ever, and restores at once: the migration commits."""
    w = remote_workload(mb=24)
    mid = "t-job-killed"
    fakecuda(hosts, "hosta", "delay", "checkpoint 0 3000")
    box = {}

    def kill_job():
        wait_for("the freeze", lambda: phase(hosts, "hosta", mid, "source") == "freezing", timeout=60)
        # (brackets: the pattern must not match this very command line)
        box["killed"] = hosts.ssh("hostb", "pgrep -f '[a]sync_wrapper|[A]nsiballZ_gpu_restore'; "
                                  "pkill -9 -f '[a]sync_wrapper|[A]nsiballZ_gpu_restore'", check=False).stdout

    t = threading.Thread(target=kill_job)
    t.start()
    t0 = time.monotonic()
    run = migrate(playbook, hosts, w, mid)
    t.join()
    assert run.rc == 0, run.stdout
    assert len(box["killed"].split()) >= 3, box  # two wrappers and the module
    assert time.monotonic() - t0 < 60, "the lost job must be noticed at once:\n" + run.stdout
    attached = [r for r in run.results if r["_task"] == "Restore on hostb" and r.get("job_lost")]
    assert attached, "the lost job must be noticed:\n" + run.stdout
    assert run.task("Restore on hostb")["changed"] is True, run.stdout
    assert w.one_copy_runs_intact() and runs_on(hosts, w) == "hostb"
    w.no_count_twice()


def test_a_target_copy_that_died_with_its_pids_reused_is_not_trusted(playbook, hosts, remote_workload, tmp_path):
    """The controller stops while the target restores; the restored copy then dies on the target, and
    unrelated processes take its pids. Recovery must not take those for the workload: it cleans the
    target without touching them and resumes the held source, the only copy left. (The target copy
    ran for a moment before it died, so a few of its counts are lost with it: that is the crash's.)"""
    w = remote_workload()
    mid = "t-reused"
    fakecuda(hosts, "hostb", "delay", "restore 0 2000")
    ctl = Controller(hosts, tmp_path, {"source": "hosta", "target": "hostb", "pid": w.pid, "migration_id": mid})
    wait_for("the restore", lambda: phase(hosts, "hostb", mid, "target") == "restoring", timeout=60)
    ctl.freeze()
    wait_for("the restored copy", lambda: phase(hosts, "hostb", mid, "target") == "restored", timeout=60)
    ctl.kill()
    pids = journal(hosts, "hostb", mid, "target")["pids"]
    hosts.ssh("hostb", "kill -9 %s" % " ".join(str(p) for p in pids))
    squatters = []
    for p in pids:  # unrelated processes take the same pids
        for _try in range(30):
            out = hosts.ssh("hostb", "echo %d > /proc/sys/kernel/ns_last_pid; setsid sleep 300 >/dev/null 2>&1 "
                            "</dev/null & echo $!" % (p - 1)).stdout.strip().splitlines()[-1]
            if int(out) == p:
                squatters.append(p)
                break
            hosts.ssh("hostb", "kill -9 %s" % out, check=False)
    assert squatters == pids, "could not reuse pids %s on hostb" % pids
    try:
        # The copy ran before it died: resuming the source rewinds the job, which only the operator may accept.
        held = recover(playbook, mid)
        assert held.rc != 0 and "gpuckpt_accept_rewind=true" in held.task("Report where the workload runs")["msg"]
        assert [s for unused, s in processes(w.dir)] == ["T", "T"], "held, never resumed silently"
        run = recover(playbook, mid, gpuckpt_accept_rewind=True)
        assert run.rc == 0, run.stdout
        said = run.task("Report where the workload runs")["msg"]
        assert "rolled back: the workload runs on hosta" in said and "rolled back to its freeze" in said, said
        alive = hosts.ssh("hostb", "for p in %s; do test -e /proc/$p && echo $p; done" % " ".join(map(str, pids)))
        assert sorted(int(x) for x in alive.stdout.split()) == sorted(pids), "unrelated processes were killed"
        assert w.one_copy_runs_intact() and runs_on(hosts, w) == "hosta"
        again = recover(playbook, mid)
        assert again.rc == 0 and changed_tasks(again) == []
    finally:
        hosts.ssh("hostb", "kill -9 %s; echo 40000 > /proc/sys/kernel/ns_last_pid" % " ".join(map(str, pids)),
                  check=False)
