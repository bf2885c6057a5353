"""Doubles shared by the unit tests of several rooms."""
from __future__ import annotations

import os
import stat
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.run import Result
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.base import Backend


@pytest.fixture
def fake_ssh(request, tmp_path, monkeypatch):
    """An ``ssh`` TEST DOUBLE first on PATH: the test module's ``FAKE_SSH`` script (``%(py)s``: this Python), which
    plays the far host (a receiver, a probe...). Each call may log to ``FAKE_SSH_LOG``: the fixture's value."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(request.module.FAKE_SSH % {"py": sys.executable})
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", "%s:%s" % (bindir, os.environ["PATH"]))
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    return tmp_path / "ssh.log"


class RecordingBackend(Backend):
    """A runtime TEST DOUBLE (a real Backend subclass, so the engine calls it through the real interface): its dump
    writes one pages file, its restore 'brings up' ``pids`` again (the same pids, as CRIU does; by default this
    test's own process), and it touches no process. It records every call the engine makes, by name, in ``calls``
    (preflight and bind too: a refusal that comes first leaves it empty), and the calls that act on the workload,
    with their arguments, in ``log``, a list it may share with a driver double so that the order of the two shows.
    ``fail``: names of its calls that raise OSError; ``probe_rc``: the exit status of the probe and the quiesce
    command; ``capabilities``: the runtime's, where they are not a plain Backend's; ``drv``: the driver
    load_cuda hands the engine."""
    name = "double"

    def __init__(self, log=None, pids=None, drv=None, fail=(), probe_rc=0, capabilities=None):
        self.log = [] if log is None else log
        self.pids = list(pids) if pids else [os.getpid()]
        self.drv, self.fail, self.probe_rc = drv, set(fail), probe_rc
        self.calls = []
        if capabilities is not None:
            self.capabilities = capabilities

    def _called(self, name, *args, logged=False):
        """Records the call (in ``log`` too when ``logged``), then fails it when told to."""
        self.calls.append(name)
        if logged:
            self.log.append((name,) + args)
        if name in self.fail:
            raise OSError("the %s of the test double failed" % name)

    def _record(self, name, *args):
        self._called(name, *args, logged=True)

    def preflight(self, full=True):
        self._called("preflight")
        return {}

    def bind(self, manifest):
        self._called("bind")

    def resolve(self, target):
        self._called("resolve")
        return self.pids[0], list(self.pids)

    def plan_tree(self, pids, internal_tcp=False):
        self._called("plan_tree")
        return []

    def load_cuda(self, libcuda_path):
        self._called("load_cuda")
        return self.drv, None

    def dump(self, target, image_dir, work_dir, after):
        self._record("dump", after)
        with open(os.path.join(image_dir, "pages-1.img"), "wb") as fh:
            fh.write(b"\0" * 4096)
        return {"backend": self.name}

    def restore(self, image_dir, work_dir, manifest):
        self._record("runtime_restore")
        return list(self.pids)

    def resume(self, pids):
        self._record("resume", sorted(pids))

    def kill(self, pids):
        self._record("kill", sorted(pids))

    def probe(self, root_pid, argv, timeout, stage="probe"):
        self._record(stage)
        return Result(list(argv), self.probe_rc, "", "told to fail" if self.probe_rc else "", 0.0)


@pytest.fixture
def recording_backend():
    """The RecordingBackend class (a test module makes its own, or a subclass of it)."""
    return RecordingBackend
