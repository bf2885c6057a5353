"""Doubles shared by the unit tests of several rooms."""
from __future__ import annotations

import os
import stat
import sys

import pytest


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
