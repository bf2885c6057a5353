"""Bad input gets a clear error and touches nothing."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from helpers import hanging_wrapper

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"


def _fail(run, task):
    assert run.rc != 0, run.stdout
    res = run.task(task)
    assert res["_status"] == "failed"
    return res


PF_KTHREAD = 0x00200000


def _kernel_thread_pid():
    """A kernel thread this test can see (by its flag: in a container's pid namespace pid 2 and its children are
    user processes, never to be checkpointed by a test), else None (none is seen from inside such a namespace)."""
    for d in sorted((d for d in os.listdir("/proc") if d.isdigit()), key=int):
        try:
            with open("/proc/%s/stat" % d) as fh:
                data = fh.read()
        except OSError:
            continue
        if int(data[data.rindex(")") + 2:].split()[6]) & PF_KTHREAD:
            return int(d)
    return None


@pytest.mark.parametrize("pid,words", [
    (4194303, "no process with pid 4194303"),
    (1, "pid 1 is the init process"),
    ("kthread", "kernel thread"),
])
def test_bad_pid_is_refused(tmp_path, playbook, pid, words):
    if pid == "kthread":
        pid = _kernel_thread_pid()
        if pid is None:
            pytest.skip("no kernel thread is seen from this pid namespace")
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT, {"gpuckpt_pid": pid, "gpuckpt_image_dir": image_dir})
    res = _fail(run, "Checkpoint pid")
    assert words in res["msg"]
    assert res["stage"] == "preflight"
    assert not os.path.exists(image_dir)


def test_a_process_whose_session_leader_is_outside_its_pid_namespace_is_refused(tmp_path, playbook):
    """What `docker exec` or a CI runner makes: the session leader lives outside the process's pid
    namespace, so its session id reads 0. CRIU cannot dump that, so it is refused before anything is
    frozen, and the workload keeps running. Built with a real pid namespace: sh is its pid 1 and keeps
    the outer session; the two sleeps get pids 2 and 3."""
    image_dir = str(tmp_path / "img")
    wrap = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
            'sleep 300 & sleep 300 & "$@"; rc=$?; echo "after: $(grep ^State: /proc/3/status)"; exit $rc',
            "sh"]
    run = playbook(CHECKPOINT, {"gpuckpt_pid": 3, "gpuckpt_image_dir": image_dir}, wrap=wrap)
    res = _fail(run, "Checkpoint pid")
    assert res["stage"] == "preflight", res
    assert "outside this pid namespace" in res["msg"] and "nothing was frozen" in res["msg"]
    assert "Next: start the workload in its own session (setsid" in res["msg"]
    assert "after: State:\tS (sleeping)" in run.stdout, run.stdout
    assert not os.path.exists(image_dir)


def test_non_empty_image_dir_is_refused(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = tmp_path / "img"
    image_dir.mkdir()
    (image_dir / "notes.txt").write_text("mine")
    run = playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": str(image_dir)}, env=fakecuda.env)
    res = _fail(run, "Checkpoint pid")
    assert "not empty" in res["msg"] and "notes.txt" in res["msg"]
    assert os.listdir(image_dir) == ["notes.txt"]
    assert [c for c, unused in fakecuda.calls() if c != "attach"] == [], "nothing may be locked"
    assert w.is_counting()


def test_tampered_image_is_refused_and_names_the_file(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    assert playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir}, env=fakecuda.env).rc == 0
    pages = max((f for f in os.listdir(image_dir) if f.startswith("pages-")),
                key=lambda f: os.path.getsize(os.path.join(image_dir, f)))
    path = os.path.join(image_dir, pages)
    with open(path, "r+b") as fh:
        fh.seek(4096 + 17)
        b = fh.read(1)
        fh.seek(4096 + 17)
        fh.write(bytes([b[0] ^ 0x01]))
    run = playbook(RESTORE, {"gpuckpt_image_dir": image_dir}, env=fakecuda.env)
    res = _fail(run, "Restore from")
    assert res["stage"] == "verify"
    assert pages in res["msg"] and "checksum mismatch" in res["msg"]
    assert res["bad_files"] == [pages]
    assert not w.alive(), "nothing may be started from a corrupt image"
    assert not [c for c, unused in fakecuda.calls() if c in ("restore", "unlock")]


def test_missing_criu_is_a_clear_error(tmp_path, playbook, workloads):
    w = workloads()
    image_dir = str(tmp_path / "img")
    # The module also searches the sbin dirs, where CRIU is installed here: name a missing file.
    run = playbook(CHECKPOINT_WITH_CRIU_PATH, {"pid": w.pid, "image_dir": image_dir,
                                               "criu_path": str(tmp_path / "no-criu")})
    res = _fail(run, "gpu_checkpoint")
    assert "criu not found" in res["msg"] and "no-criu" in res["msg"]
    assert not os.path.exists(image_dir)
    assert w.is_counting()


def test_too_old_criu_is_refused(tmp_path, playbook, workloads):
    w = workloads()
    old = tmp_path / "criu"
    # TEST DOUBLE: a criu that reports bookworm's 3.17, which fails on current kernels.
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    image_dir = str(tmp_path / "img")
    run = playbook(CHECKPOINT_WITH_CRIU_PATH, {"pid": w.pid, "image_dir": image_dir, "criu_path": str(old)})
    res = _fail(run, "gpu_checkpoint")
    assert "CRIU 3.17.1" in res["msg"] and "too old" in res["msg"] and "4.0 or newer" in res["msg"]
    assert not os.path.exists(image_dir)
    assert w.is_counting()


def test_bad_argument_fails_with_the_argument_spec_message(tmp_path, playbook):
    run = playbook(CHECKPOINT_WITH_CRIU_PATH, {"pid": "not-a-pid", "image_dir": str(tmp_path / "i")})
    res = _fail(run, "gpu_checkpoint")
    assert "pid" in res["msg"] and "int" in res["msg"]


def test_restore_of_a_directory_that_is_no_image(tmp_path, playbook):
    d = tmp_path / "empty"
    d.mkdir()
    res = _fail(playbook(RESTORE, {"gpuckpt_image_dir": str(d)}), "Restore from")
    assert "manifest.json" in res["msg"] and res["stage"] == "verify"


CHECKPOINT_WITH_CRIU_PATH = os.path.join(os.path.dirname(__file__), "playbooks", "checkpoint_raw.yml")


RESTORE_RAW = os.path.join(os.path.dirname(__file__), "playbooks", "restore_raw.yml")


def test_a_hung_restore_is_killed_after_runtime_timeout_and_the_image_is_kept(tmp_path, playbook, workloads, fakecuda):
    """CRIU hangs during a restore (TEST DOUBLE: a criu whose restore never ends, with a child of its
    own). After runtime_timeout the restore fails with a clear error, CRIU and its child are killed,
    nothing was started, and the image still restores with the real CRIU: nothing is lost."""
    w = workloads(fakecuda=fakecuda)
    image_dir = str(tmp_path / "img")
    assert playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir}, env=fakecuda.env).rc == 0
    stopped_at = w.counts()
    child = tmp_path / "hung-child.pid"
    hung = hanging_wrapper(tmp_path / "criu", shutil.which("criu"), "restore", child)
    t0 = time.monotonic()
    run = playbook(RESTORE_RAW, {"image_dir": image_dir, "criu_path": hung, "runtime_timeout": 3},
                   env=fakecuda.env)
    res = _fail(run, "gpu_restore")
    assert time.monotonic() - t0 < 60
    assert res["stage"] == "criu-restore" and "timed out after 3" in res["msg"], res
    pid = int(child.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists("/proc/%d" % pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists("/proc/%d" % pid), "the hung CRIU's child must be killed with it"
    assert not w.alive() and not [c for c, unused in fakecuda.calls() if c == "restore"]
    again = playbook(RESTORE_RAW, {"image_dir": image_dir}, env=fakecuda.env)
    assert again.rc == 0, again.stdout
    w.went_on_intact(stopped_at)


def test_a_rollback_pointed_at_an_unrelated_directory_deletes_nothing(tmp_path, playbook):
    """gpu_migration removes only the directory its journal says the migration created (by device
    and inode): pointed at someone's directory, with no such migration, it touches nothing."""
    victim = tmp_path / "someones-data"
    victim.mkdir()
    (victim / "keep.txt").write_text("unrelated\n")
    base = os.path.join(os.path.dirname(__file__), "playbooks", "migration_raw.yml")
    for role in ("target", "source"):
        run = playbook(base, {"migration_id": "t-unrelated", "role": role, "action": "rollback",
                              "journal_dir": str(tmp_path / "journal"), "image_dir": str(victim)})
        assert run.rc == 0, run.stdout
    assert (victim / "keep.txt").read_text() == "unrelated\n"
    # A begin at a path that exists is refused, and leaves it as it is.
    run = playbook(base, {"migration_id": "t-unrelated2", "role": "target", "action": "begin",
                          "journal_dir": str(tmp_path / "journal"), "image_dir": str(victim)})
    res = _fail(run, "gpu_migration")
    assert "exists already" in res["msg"] and "nothing was frozen" in res["msg"]
    assert (victim / "keep.txt").read_text() == "unrelated\n"


@pytest.mark.parametrize("attach,progress", [
    ("1.2; touch {pwned}", None),
    ("j123.45", "/tmp/x; touch {pwned}"),
    ("j123.45", "relative/path.json"),
])
def test_values_that_would_reach_a_shell_are_refused(tmp_path, playbook, attach, progress):
    pwned = tmp_path / "pwned"
    v = {"attach": attach.format(pwned=pwned)}
    if progress:
        v["progress_file"] = progress.format(pwned=pwned)
    base = os.path.join(os.path.dirname(__file__), "playbooks", "restore_attach.yml")
    res = _fail(playbook(base, v), "gpu_restore attach")
    assert "must be" in res["msg"]
    assert not pwned.exists()
