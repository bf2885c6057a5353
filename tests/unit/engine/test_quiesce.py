"""The quiesce hook's parts: signal names, who catches a signal, and reading a workload's
acknowledgement without trusting it (a symlink, a fifo, junk)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import quiesce
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget

TOOLS = os.path.join(REPO, "tools")


def test_signal_names():
    assert quiesce.signal_number("SIGUSR1") == (signal.SIGUSR1, "SIGUSR1")
    assert quiesce.signal_number("usr2") == (signal.SIGUSR2, "SIGUSR2")
    assert quiesce.signal_number(str(int(signal.SIGUSR1)))[1] == "SIGUSR1"
    for bad in ("SIGKILL", "STOP", "SIGCONT", "SIGTSTP", "nope", "999", ""):
        with pytest.raises(InvalidTarget):
            quiesce.signal_number(bad)


def _job(tmp_path, handler=True):
    """A process with (or without) tools/gpuckpt_quiesce.py's handler, its acks in a private tmp."""
    code = ("import sys, time; sys.path.insert(0, %r); import gpuckpt_quiesce as q; q.ACK_DIR = %r\n"
            "%s\nprint('up', flush=True)\nwhile True: time.sleep(0.01)\n"
            % (TOOLS, str(tmp_path), "q.install(release=lambda: {'freed': 7})" if handler else ""))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"up"
    return p


def test_only_a_process_that_handles_the_signal_is_asked(tmp_path):
    with_h, without = _job(tmp_path), _job(tmp_path, handler=False)
    try:
        assert quiesce.catches(with_h.pid, signal.SIGUSR1) is True
        assert quiesce.catches(without.pid, signal.SIGUSR1) is False
        with pytest.raises(InvalidTarget) as exc:
            quiesce.check_caught([with_h.pid, without.pid], signal.SIGUSR1, "SIGUSR1")
        assert str(without.pid) in exc.value.msg and "nothing was sent" in exc.value.msg
        assert without.poll() is None  # never sent: still alive
    finally:
        for p in (with_h, without):
            p.kill()
            p.wait()
    assert quiesce.catches(with_h.pid, signal.SIGUSR1) is None  # gone


def test_the_acknowledgement_is_waited_for_and_a_second_one_is_new(tmp_path, monkeypatch):
    job = _job(tmp_path)
    # The job's acks live in tmp_path, not /tmp: read them from there.
    monkeypatch.setattr(quiesce, "ACK", os.path.relpath(str(tmp_path), "/") + "/gpuckpt-quiesced.%d")
    try:
        first = quiesce.by_signal([job.pid], signal.SIGUSR1, "SIGUSR1", timeout=10)
        assert first["acknowledged"][str(job.pid)]["freed"] == 7 and "warning" not in first
        second = quiesce.by_signal([job.pid], signal.SIGUSR1, "SIGUSR1", timeout=10)
        assert second["acknowledged"][str(job.pid)]["seq"] == 2
    finally:
        job.kill()
        job.wait()


def test_no_acknowledgement_is_a_warning_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "ACK", os.path.relpath(str(tmp_path), "/") + "/gpuckpt-quiesced.%d")
    code = "import signal, time; signal.signal(signal.SIGUSR1, lambda *a: None); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"up"
    try:
        t = time.monotonic()
        rep = quiesce.by_signal([p.pid], signal.SIGUSR1, "SIGUSR1", timeout=0.5)
        assert time.monotonic() - t < 5
        assert rep["not_acknowledged"] == [p.pid] and "did not acknowledge" in rep["warning"]
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_a_planted_symlink_fifo_or_junk_is_no_acknowledgement(tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "ACK", os.path.relpath(str(tmp_path), "/") + "/gpuckpt-quiesced.%d")
    me = os.getpid()
    ack = tmp_path / ("gpuckpt-quiesced.%d" % me)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"root": "only"}))
    os.symlink(str(secret), str(ack))
    assert quiesce.read_ack(me) is None
    os.unlink(str(ack))
    os.mkfifo(str(ack))  # opening a fifo for reading would block: it must not
    t = time.monotonic()
    assert quiesce.read_ack(me) is None
    assert time.monotonic() - t < 2
    os.unlink(str(ack))
    ack.write_text("not json")
    assert quiesce.read_ack(me) is None
    ack.write_text(json.dumps({"seq": 1}))
    assert quiesce.read_ack(me) == {"seq": 1}
