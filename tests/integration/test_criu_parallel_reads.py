"""The collection's CRIU patch (roles/criu/files/patches/criu-4.2-parallel-page-reads.patch), on the
CRIU that tests/setup.sh builds with it: a restored task's pages are read by several threads.

Real CRIU dumps and restores a real process tree (tests/workloads/page_tree.c) whose every process
checks its memory word by word and counts its threads after the restore. The adversarial case is a
pid namespace: the reader threads take tids of the namespace while the other tasks of the tree create
their threads with the tids they had (clone3's set_tid); CRIU must wait for the readers, not fail.
Pieces of one page and eight threads per task make the readers many and their lives overlap.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from helpers import REPO

CRIU = os.path.join(REPO, ".build", "criu-4.2.1-parallel-reads", "criu", "criu")
SOURCE = os.path.join(REPO, "tests", "workloads", "page_tree.c")
READ_ENV = ("CRIU_RESTORE_READ_THREADS", "CRIU_RESTORE_READ_PIECE", "CRIU_RESTORE_READ_MIN")

# These failed at times on a loaded machine (a full CI run beside them): the cause was the workload's
# own lost wake-up (page_tree.c used pause(), and a SIGUSR1 sent the moment the restore returned was
# taken by its handler before the restored task entered pause() again), not the patch. Once it was
# fixed, 49 of 50 runs of this file beside a full CI run passed; the 50th failed in CRIU's dump (see _dump).
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(CRIU),
                                reason="needs root and the patched CRIU (tests/setup.sh)")


@pytest.fixture(scope="module")
def page_tree(tmp_path_factory):
    binary = str(tmp_path_factory.mktemp("page_tree") / "page_tree")
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", binary, SOURCE], check=True)
    return binary


def _lines(path, word):
    try:
        with open(path) as fh:
            return [line.split() for line in fh if line.startswith(word + " ")]
    except FileNotFoundError:
        return []


def _wait_lines(path, word, count, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = _lines(path, word)
        if len(got) >= count:
            return got
        time.sleep(0.05)
    raise AssertionError("%d %r lines in %s, %d wanted" % (len(_lines(path, word)), word, path, count))


def _children(pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as fh:
                    data = fh.read()
            except OSError:
                continue
            if int(data[data.rindex(")") + 2:].split()[1]) == pid:
                kids.append(int(d))
    return kids


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
        return data[data.rindex(")") + 2]
    except (OSError, ValueError):
        return None


def _gone(pid, timeout=10):
    """Gone, or a zombie on its way out (its parent, criu, has exited; init reaps it)."""
    deadline = time.time() + timeout
    while _state(pid) not in (None, "Z") and time.time() < deadline:
        time.sleep(0.05)
    return _state(pid) in (None, "Z")


def _start(binary, out, nproc, nthreads, mib, pid_namespace):
    """Starts the tree; returns the pid CRIU dumps (the namespace's init, or the tree's root)."""
    argv = [binary, str(nproc), str(nthreads), str(mib), out]
    if pid_namespace:
        # unshare leads the session outside; setsid in the namespace makes the tree's own session.
        argv = ["unshare", "--pid", "--fork", "setsid"] + argv
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_lines(out, "ready", nproc)
    return proc, (_children(proc.pid)[0] if pid_namespace else proc.pid)


def _dump(pid, images):
    """CRIU's dump of the tree (the part of CRIU this patch leaves alone). On a loaded 2-core machine a
    dump failed once in about 40 runs with no error in its log; a failed dump resumes the tree, so it is
    taken once more, with a verbose log of the failure kept beside the images."""
    for attempt in (1, 2):
        run = subprocess.run([CRIU, "dump", "-t", str(pid), "-D", images, "-o", "dump.log", "-v4"], check=False,
                             capture_output=True, text=True, timeout=300)
        if run.returncode == 0:
            return
        log = os.path.join(images, "dump.log")
        if os.path.exists(log):
            os.rename(log, os.path.join(images, "dump-failed-%d.log" % attempt))
        for name in os.listdir(images):
            if name.endswith(".img"):
                os.unlink(os.path.join(images, name))
    failed = os.path.join(images, "dump-failed-2.log")
    text = "(no log)"
    if os.path.exists(failed):
        with open(failed) as fh:
            text = fh.read()
    raise AssertionError("criu dump failed twice (rc %d): %s\n%s" % (run.returncode, run.stderr[-1000:], text[-3000:]))


def _restore(images, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in READ_ENV}
    env.update(env_extra)
    pidfile = os.path.join(images, "restored.pid")
    run = subprocess.run([CRIU, "restore", "-D", images, "-d", "--pidfile", pidfile, "-o", "restore.log", "-v4"], check=False,
                         env=env, capture_output=True, text=True, timeout=300)
    with open(os.path.join(images, "restore.log")) as fh:
        log = fh.read()
    root = int(open(pidfile).read()) if run.returncode == 0 else None
    return run.returncode, root, log


def _cycle(tmp_path, binary, nproc, nthreads, mib, pid_namespace, env_extra):
    """Dump the tree, restore it with env_extra, ask every process to check itself; kill it after."""
    images, out = str(tmp_path / "images"), str(tmp_path / "tree.out")
    os.mkdir(images)
    proc, dumped = _start(binary, out, nproc, nthreads, mib, pid_namespace)
    try:
        _dump(dumped, images)
        proc.wait(timeout=30)
        rc, root, log = _restore(images, env_extra)
        assert rc == 0, log[-3000:]
        processes = [root] + _children(root)
        assert len(processes) == nproc, processes
        for pid in processes:
            os.kill(pid, signal.SIGUSR1)
        checks = _wait_lines(out, "check", nproc)
        return checks, log
    finally:
        for pid in [proc.pid, dumped]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if os.path.exists(os.path.join(images, "restored.pid")):
            root = int(open(os.path.join(images, "restored.pid")).read())
            if _alive(root):
                os.kill(root, signal.SIGKILL)


def _readers(log):
    return [int(n) for n in re.findall(r"Reading \d+ bytes of pages in \d+ pieces with (\d+) threads", log)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attempt", range(3))
def test_a_pid_namespace_tree_restores_while_page_readers_hold_its_tids(tmp_path, page_tree, attempt):
    checks, log = _cycle(tmp_path, page_tree, nproc=4, nthreads=6, mib=24, pid_namespace=True,
                         env_extra={"CRIU_RESTORE_READ_THREADS": "8", "CRIU_RESTORE_READ_PIECE": "4096",
                                    "CRIU_RESTORE_READ_MIN": "0"})
    assert sorted(c[1] for c in checks) == ["0", "1", "2", "3"]
    assert all(c[2:] == ["bad=0", "threads=6/6"] for c in checks), checks
    # every process's own pages were read by 8 threads (the root's premapped ones too)
    assert len(_readers(log)) >= 4 and set(_readers(log)) == {8}, _readers(log)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("threads", ["default", "1"])
def test_a_big_task_is_read_in_parallel_by_default_and_serially_when_told(tmp_path, page_tree, threads):
    env = {} if threads == "default" else {"CRIU_RESTORE_READ_THREADS": threads}
    checks, log = _cycle(tmp_path, page_tree, nproc=1, nthreads=2, mib=320, pid_namespace=False, env_extra=env)
    assert checks[0][2:] == ["bad=0", "threads=2/2"], checks
    cpus = len(os.sched_getaffinity(0))
    expected = [] if threads == "1" or cpus == 1 else [min(cpus, 8)]
    assert _readers(log) == expected, log[-2000:]


@pytest.mark.timeout(600)
def test_a_pages_image_cut_short_fails_the_restore_clearly_and_leaves_nothing_running(tmp_path, page_tree):
    images, out = str(tmp_path / "images"), str(tmp_path / "tree.out")
    os.mkdir(images)
    proc, dumped = _start(page_tree, out, 1, 2, 320, False)
    try:
        _dump(dumped, images)
        proc.wait(timeout=30)
        pages = max((f for f in os.listdir(images) if f.startswith("pages-")),
                    key=lambda f: os.path.getsize(os.path.join(images, f)))
        path = os.path.join(images, pages)
        os.truncate(path, os.path.getsize(path) - (8 << 20))
        rc, root, log = _restore(images, {"CRIU_RESTORE_READ_THREADS": "4"})
        assert rc != 0 and root is None
        assert "The pages image ends before its pagemap says" in log, log[-3000:]
        assert _gone(dumped), "a task restored from a cut image is still there: %s" % _state(dumped)
    finally:
        if _alive(dumped):
            os.kill(dumped, signal.SIGKILL)
