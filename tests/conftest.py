"""Shared fixtures: the collection on sys.path, ansible-playbook runs, workloads stopped by PID,
and the libcuda TEST DOUBLE (CI has no GPU; see tests/fakecuda/fakecuda.c)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from helpers import (  # noqa: F401 - re-exported for tests
    ANSIBLE_PLAYBOOK, COLLECTIONS, COUNTER, MANAGED_PYTHON, REPO, CountingWorkload, FakeCuda, alive, tree)

sys.path.insert(0, COLLECTIONS)
sys.path.insert(0, os.path.join(REPO, "tests", "hosts"))  # the loopback "hosts" (tests/hosts/loopback.py)


def pytest_configure(config):
    if not os.path.exists(os.path.join(COLLECTIONS, "ansible_collections", "gpuckpt", "fleet")):
        raise pytest.UsageError("run `bash tests/setup.sh` first (collection link, venv, CRIU, test double)")
    # The playbook runs of this pytest process share their modules' payloads (record_results.share_module_payloads
    # says why), in a folder of this process's own: a new session builds them again from the code as it is now.
    if "GPUCKPT_TEST_ANSIBALLZ_CACHE" not in os.environ:
        os.environ["GPUCKPT_TEST_ANSIBALLZ_CACHE"] = tempfile.mkdtemp(prefix="gpuckpt-ansiballz-")
        atexit.register(shutil.rmtree, os.environ["GPUCKPT_TEST_ANSIBALLZ_CACHE"], True)
    # PYTHONUNBUFFERED (set in this machine's environment) makes a Python that reads its program from a pipe read it
    # one byte at a time: every module run of a playbook over the local connection with pipelining (the `playbook`
    # fixture's default, molecule, the zdtm runner) read its 600 KB payload in 600,000 reads, about 0.5 s of system
    # CPU each time. The tests' Python programs flush what they print themselves.
    os.environ.pop("PYTHONUNBUFFERED", None)
    # Ansible's ssh arguments less its -C: the test hosts are on loopback, where compressing each module's payload
    # (2 MB with its bytecode) cost more CPU than the module's own run (20 runs of cuda_process_facts on a test
    # host: 14 s of CPU with -C, 10.7 s without). A user's runs keep Ansible's default; the collection's own image
    # transfer never compresses (transfer/targets.py).
    os.environ.setdefault("ANSIBLE_SSH_ARGS", "-o ControlMaster=auto -o ControlPersist=60s")
    # The tests' Ansible configuration (tests/ansible.cfg): ansible-playbook looks for its workers' results every
    # internal_poll_interval, 0.001 s by default and settable only there (27,578 rounds in one 40-second migrate.yml
    # run; the suite's playbooks run 5,400 s in all). Molecule and ansible-test set their own.
    os.environ.setdefault("ANSIBLE_CONFIG", os.path.join(REPO, "tests", "ansible.cfg"))


# How long each test file took in a whole run (seconds, tests/file_seconds.json): the files run longest first, so
# that tests/run.sh's workers, each taking a whole file at a time, end close together.
FILE_SECONDS = os.path.join(REPO, "tests", "file_seconds.json")


def pytest_collection_modifyitems(session, config, items):
    try:
        with open(FILE_SECONDS) as fh:
            seconds = json.load(fh)
    except (OSError, ValueError):
        return
    known = sorted(seconds.values())
    middle = known[len(known) // 2] if known else 0  # a new file: about as long as most

    def weight(item):
        path = os.path.relpath(str(item.path), REPO)
        return -seconds.get(path, middle)

    order = {item: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (weight(item), os.path.relpath(str(item.path), REPO), order[item]))


@pytest.fixture
def fakecuda(tmp_path, monkeypatch):
    fc = FakeCuda(str(tmp_path / "fakecuda"))
    for k, v in fc.env.items():
        monkeypatch.setenv(k, v)
    return fc


@pytest.fixture
def cuda_child(fakecuda):
    """A child process registered with the test double as a CUDA process."""
    code = ("import ctypes,sys,time; l=ctypes.CDLL(sys.argv[1]); l.fakeCudaAttach(); print('up', flush=True); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, fakecuda.lib], stdout=subprocess.PIPE,
                         env=dict(os.environ, **fakecuda.env))
    assert p.stdout.readline().strip() == b"up"
    yield p.pid
    p.kill()
    p.wait()


class Workload(CountingWorkload):
    """The counter workload (tests/workloads/counter.py): a parent and children counting into files."""

    def __init__(self, directory, fakecuda=None, children=1, mb=8, serve=None, cache_mb=0, quiesce=False):
        self.dir = directory
        cmd = [sys.executable, COUNTER, "--dir", directory, "--daemon", "--children", str(children), "--mb", str(mb),
               "--cache-mb", str(cache_mb)] + (["--quiesce"] if quiesce else [])
        if serve:
            cmd += ["--serve", str(serve)]
        if fakecuda:
            cmd += ["--fakecuda", fakecuda.lib]
        env = dict(os.environ)
        if fakecuda:
            env.update(fakecuda.env)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, env=env, universal_newlines=True).stdout
        self.pid = int(out.strip())
        self.roles = ["parent"] + ["child%d" % (i + 1) for i in range(children)]
        self.wait_counting()
        self.pids = tree(self.pid)
        assert len(self.pids) == children + 1, self.pids

    def intact(self):
        """Every process's memory pattern is the one it started with, and nothing reported corruption."""
        corrupt = [f for f in os.listdir(self.dir) if f.endswith(".corrupt")]
        assert not corrupt, "workload reported corruption: %s" % corrupt
        for r in self.roles:
            assert self.read(r)["digest"] == self.digest0(r), "memory pattern of %s changed" % r
        return True

    def alive(self):
        return [p for p in self.pids if alive(p)]

    def kill(self):
        for p in tree(self.pid) + self.pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def workloads(tmp_path):
    started = []

    def start(name="w", **kw):
        w = Workload(str(tmp_path / name), **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


class PlaybookRun(object):
    def __init__(self, proc, results):
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.results = results

    def task(self, name_part):
        hits = [r for r in self.results if name_part in r["_task"]]
        assert hits, "no task matching %r in %s\n%s" % (name_part, [r["_task"] for r in self.results], self.stdout)
        ran = [r for r in hits if r.get("_status") != "skipped"]  # of two alternative tasks, the one that ran
        return (ran or hits)[-1]


@pytest.fixture
def playbook(tmp_path):
    counter = {"n": 0}

    def run(name, extra_vars=None, check=False, env=None, inventory="localhost,", limit=None, args=(), wrap=(),
            interpreter=MANAGED_PYTHON):
        counter["n"] += 1
        record = str(tmp_path / ("results-%d.jsonl" % counter["n"]))
        e = dict(os.environ)
        e.update({
            "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS,
            "ANSIBLE_CALLBACK_PLUGINS": os.path.join(REPO, "tests", "integration", "callback_plugins"),
            "ANSIBLE_CALLBACKS_ENABLED": "record_results",
            "ANSIBLE_LOCALHOST_WARNING": "false",
            "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_HOST_KEY_CHECKING": "false",
            "ANSIBLE_PIPELINING": "true",
            # Fresh ssh master connections for every run: a master left from an earlier test could
            # still reach a stopped test host's old session (another pid namespace).
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp"),
            "GPUCKPT_RECORD": record,
        })
        e.update(env or {})
        cmd = [ANSIBLE_PLAYBOOK, name, "-i", inventory,
               "-e", "ansible_connection=local" if inventory == "localhost," else "gpuckpt_x=1",
               "-e", json.dumps(extra_vars or {})]
        if interpreter:  # (None: the inventory names each host's Python)
            cmd[6:6] = ["-e", "ansible_python_interpreter=%s" % interpreter]
        if check:
            cmd.append("--check")
        if limit:
            cmd += ["--limit", limit]
        cmd = list(wrap) + cmd + list(args)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e, cwd=REPO,
                              universal_newlines=True, timeout=600, check=False)
        results = []
        if os.path.exists(record):
            with open(record) as fh:
                results = [json.loads(line) for line in fh if line.strip()]
        return PlaybookRun(proc, results)

    yield run
    # End this test's ssh master connections: their sessions on a test host hold pids there, which a
    # later test's workload may need (CRIU restores the same pids).
    subprocess.run(["pkill", "-f", str(tmp_path / "cp")], check=False)
