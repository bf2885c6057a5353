"""engine/ports.py and core/sockets' TCP tables: the ports a restore binds again, and the wait for TIME_WAIT sockets
that hold them (the configuration mode's migration on one kernel failed with "Address already in use", issue 45).
The TIME_WAIT sockets here are real: a loopback connection closed from its listening side first leaves one on the
listening port for the kernel's 60 s; it refuses CRIU's bind (SO_REUSEADDR) only when the listener lacked
SO_REUSEADDR."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import TransactionError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image, sockets
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import tree_plan
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import ports
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.checkpoint import checkpoint
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore

pytestmark = pytest.mark.usefixtures("no_host_facts")  # (tests/unit/engine/conftest.py)


def _listener(reuse):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    return srv


def _time_wait_on(srv):
    """A connection to ``srv`` closed from the listening side first: its TIME_WAIT socket holds srv's port."""
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, unused = srv.accept()
    conn.close()  # the active close: this side goes through FIN_WAIT to TIME_WAIT
    while cli.recv(8):  # (reads the FIN)
        pass
    cli.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and port not in _tw_ports():
        time.sleep(0.02)
    return port


def _tw_ports():
    return {port for unused, unused2, port in sockets.tcp_time_wait()}


def test_a_real_time_wait_of_a_listener_without_reuseaddr_refuses_the_bind_until_it_clears():
    """As the configuration mode's store on one kernel: the listening port is recorded, its TIME_WAIT socket seen,
    and CRIU's bind (SO_REUSEADDR) refused: the wait is bounded, and its report says the restore may fail."""
    srv = _listener(reuse=False)
    port = srv.getsockname()[1]
    assert port in sockets.tcp_listen_ports([os.getpid()])
    assert port in tree_plan.criu_needs([os.getpid()])["tcp_listen"], "this process shares its own network namespace"
    assert port not in _tw_ports()
    _time_wait_on(srv)
    srv.close()  # (the dumped tree's listener is gone)
    assert (socket.AF_INET, "127.0.0.1", port) in sockets.tcp_time_wait()
    assert ports.bind_refused(socket.AF_INET, "127.0.0.1", port)
    started = time.monotonic()
    report = ports.wait_time_wait_gone([port, 1], timeout=0.3, poll=0.05)
    assert 0.25 < time.monotonic() - started < 3
    assert report["ports"] == [port] and report["left"] == [port] and not report["cleared"], report
    assert "refuse its bind" in report["msg"] and "60 s" in report["msg"], report["msg"]


def test_a_time_wait_of_a_listener_with_reuseaddr_is_no_wait():
    """PyTorch's TCPStore sets SO_REUSEADDR: its TIME_WAIT sockets let CRIU's bind pass, so nothing is waited for."""
    srv = _listener(reuse=True)
    port = _time_wait_on(srv)
    srv.close()
    assert port in _tw_ports()
    assert not ports.bind_refused(socket.AF_INET, "127.0.0.1", port)
    assert ports.wait_time_wait_gone([port], timeout=5) is None


def test_nothing_to_wait_for_is_no_wait():
    assert ports.wait_time_wait_gone([]) is None
    assert ports.wait_time_wait_gone([29500], read=lambda: [(socket.AF_INET, "127.0.0.1", 40000)],
                                     refused=lambda *a: True) is None
    assert ports.listen_ports({"target": {"tcp_listen_ports": [29500, "29501"]}}) == [29500, 29501]
    assert ports.listen_ports({"target": {}}) == [] and ports.listen_ports(None) == []


def test_the_wait_ends_when_the_time_wait_sockets_are_gone():
    now = [0.0]
    tw = [(socket.AF_INET, "127.0.0.1", 29500), (socket.AF_INET6, "::1", 29500), (socket.AF_INET, "127.0.0.1", 40000)]
    tables = [tw, tw[:1], tw[:1], []]
    slept = []

    def read():
        return tables.pop(0) if len(tables) > 1 else tables[0]

    def sleep(s):
        slept.append(s)
        now[0] += s

    report = ports.wait_time_wait_gone([29500, 29501], read=read, refused=lambda *a: True, poll=1.0,
                                       clock=lambda: now[0], sleep=sleep)
    assert report == {"ports": [29500], "left": [], "waited_s": 3.0, "cleared": True, "msg": report["msg"]}
    assert "waited 3.0 s for the TIME_WAIT sockets on TCP port 29500" in report["msg"]
    # bounded by the kernel's TIME_WAIT length and a margin
    now[0] = 0.0
    stuck = ports.wait_time_wait_gone([29500], read=lambda: tw, refused=lambda *a: True, poll=1.0,
                                      clock=lambda: now[0], sleep=sleep)
    assert not stuck["cleared"] and stuck["waited_s"] == ports.TIME_WAIT_S + ports.MARGIN_S


def test_the_checkpoint_records_the_listening_ports_and_the_restore_waits_for_them(workload, tmp_path, monkeypatch, doubles, recording_backend):
    """The runtime's plan found the ports (criu_needs' tcp_listen): the manifest keeps them, and the restore waits
    until no TIME_WAIT socket holds them, before the runtime's restore, saying so in its result."""
    log, drv, backend = doubles()
    backend.criu_needs = {"tcp_listen": [29500]}
    monkeypatch.setattr(sockets, "tcp_listen_ports", lambda pids: [29500])  # (the tree still listens as it is dumped)
    image_dir = str(tmp_path / "img")
    checkpoint(workload[0], image_dir, backend=backend, parallel=False)
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        assert json.load(fh)["target"]["tcp_listen_ports"] == [29500]
    held = [(socket.AF_INET, "127.0.0.1", 29500)]
    tables = [held, held, []]
    seen = []

    def read():
        seen.append(list(log))
        return tables.pop(0) if len(tables) > 1 else tables[0]

    monkeypatch.setattr(sockets, "tcp_time_wait", read)
    monkeypatch.setattr(ports, "bind_refused", lambda *a: True)
    monkeypatch.setattr(ports.time, "sleep", lambda s: None)
    log[:] = []
    res = restore(image_dir, backend=recording_backend(log, workload, drv), parallel=False, validate_wait=0, pid_wait=0)
    assert seen and all(("runtime_restore",) not in s for s in seen), "waited before the runtime's restore"
    assert res["tcp_time_wait"]["cleared"] and res["tcp_time_wait"]["ports"] == [29500], res
    assert "TIME_WAIT sockets on TCP port 29500" in res["msg"]


def test_the_undo_of_a_failed_checkpoint_whose_tree_exited_waits_for_its_ports_before_it_restores(
        workload, tmp_path, monkeypatch, doubles):
    """The manifest cannot be written after the dump (the tree exited): its undo restores the tree from its own
    image in place, once no TIME_WAIT socket holds a port the tree listened on."""
    log, drv, backend = doubles()
    backend.criu_needs = {"tcp_listen": [29500]}
    monkeypatch.setattr(sockets, "tcp_listen_ports", lambda pids: [29500])
    held = [(socket.AF_INET, "127.0.0.1", 29500)]
    tables = [held, []]
    seen = []

    def read():
        seen.append(list(log))
        return tables.pop(0) if len(tables) > 1 else tables[0]

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sockets, "tcp_time_wait", read)
    monkeypatch.setattr(ports, "bind_refused", lambda *a: True)
    monkeypatch.setattr(ports.time, "sleep", lambda s: None)
    monkeypatch.setattr(image, "write_manifest", no_room)
    with pytest.raises(TransactionError, match="rolled back"):
        checkpoint(workload[0], str(tmp_path / "img"), backend=backend, parallel=False)
    assert len(seen) == 2 and all(("runtime_restore",) not in s for s in seen) and ("runtime_restore",) in log, seen


def test_the_ports_are_those_the_tree_listens_on_as_it_is_dumped_not_at_the_plan():
    """A cooperative job releases its communicators between the plan and the dump: their listeners (NCCL's, without
    SO_REUSEADDR) are gone, CRIU will not bind their ports again, and their TIME_WAIT sockets must not hold the
    restore (on 2 x H100 they made a drain's restore wait 57 s for nothing). Real sockets of this process."""
    kept, released = _listener(reuse=True), _listener(reuse=False)
    kept_port, released_port = kept.getsockname()[1], released.getsockname()[1]

    class Planned(object):
        criu_needs = tree_plan.criu_needs([os.getpid()])

    assert {kept_port, released_port} <= set(ports.recorded(Planned)), "the plan saw both listening"
    _time_wait_on(released)
    released.close()  # (the release: the communicator's listener closed, its closed connection in TIME_WAIT)
    try:
        assert ports.bind_refused(socket.AF_INET, "127.0.0.1", released_port)
        at_dump = ports.at_dump(Planned, [os.getpid()])
        assert kept_port in at_dump and released_port not in at_dump, (at_dump, kept_port, released_port)
        assert ports.wait_time_wait_gone(at_dump, timeout=5) is None, "nothing the restore binds is held"
    finally:
        kept.close()


def test_a_tree_the_plan_found_not_listening_in_the_restorers_namespace_records_no_port(monkeypatch):
    """Where the plan recorded none (a tree in a network namespace of its own, a runtime that plans none), nothing
    is read at the dump either."""
    monkeypatch.setattr(sockets, "tcp_listen_ports", lambda pids: pytest.fail("read for a tree the plan left out"))

    class OwnNamespace(object):
        criu_needs = {"tcp_listen": []}

    class Unplanned(object):
        criu_needs = None

    assert ports.at_dump(OwnNamespace, [os.getpid()]) == [] and ports.at_dump(Unplanned, [os.getpid()]) == []


def test_the_manifest_keeps_only_the_ports_still_listened_on_and_the_restore_waits_for_none(
        workload, tmp_path, monkeypatch, doubles, recording_backend):
    """The plan found port 29500 listening; by the dump the tree had closed it (and a TIME_WAIT socket holds it): the
    manifest records no port, and the restore starts at once."""
    log, drv, backend = doubles()
    backend.criu_needs = {"tcp_listen": [29500]}
    monkeypatch.setattr(sockets, "tcp_listen_ports", lambda pids: [])
    monkeypatch.setattr(sockets, "tcp_time_wait", lambda: [(socket.AF_INET, "127.0.0.1", 29500)])
    monkeypatch.setattr(ports, "bind_refused", lambda *a: True)
    image_dir = str(tmp_path / "img")
    checkpoint(workload[0], image_dir, backend=backend, parallel=False)
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        assert json.load(fh)["target"]["tcp_listen_ports"] == []
    res = restore(image_dir, backend=recording_backend(log, workload, drv), parallel=False, validate_wait=0, pid_wait=0)
    assert "tcp_time_wait" not in res, res
