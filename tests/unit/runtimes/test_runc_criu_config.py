"""How CRIU locks the network, and the CRIU options runc has no flag for (issue 45: a torchrun job in a runc container needs CRIU's
--network-lock=nftables on the GPU machines, which have no iptables-restore, and NCCL's large deleted /dev/shm
files need --ghost-limit): runc's CRIU reads them from the configuration file named by CRIU_CONFIG_FILE, which
runc passes on. A TEST DOUBLE stands in for runc's command line; the configuration file is the real one written."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.wait import wait_for
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.tree_plan import NFTABLES_LOCK
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd import ContainerdBackend
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.docker import DockerBackend
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.process import ProcessBackend
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.runc import RuncBackend


class Result(object):
    rc, stdout, stderr, seconds = 0, "", "", 0.5


class RecordingCli(object):
    """TEST DOUBLE of runtimes/cli.RuntimeCli: records each command with the CRIU configuration its CRIU would read."""

    def __init__(self):
        self.calls = []

    def run(self, *args, **options):
        conf = (options.get("env") or {}).get("CRIU_CONFIG_FILE")
        with open(conf) as fh:
            self.calls.append((list(args), fh.read()))
        return Result()


def test_runc_takes_the_network_lock_and_the_ghost_limit_through_crius_configuration(tmp_path, monkeypatch):
    monkeypatch.delenv("CRIU_CONFIG_FILE", raising=False)
    backend = RuncBackend(criu_options=["--network-lock=nftables", "--tcp-established"])
    backend.container, backend.auto_flags = "train-7", ["--ghost-limit=4194304", "--file-locks"]
    backend.cli = RecordingCli()
    assert backend.passes_criu_option("--network-lock=nftables") and backend.passes_criu_option("--ghost-limit=9")
    backend.dump(4242, str(tmp_path / "img"), str(tmp_path), "exit")
    (args, config), = backend.cli.calls
    assert args[:1] == ["checkpoint"] and args[-1] == "train-7"
    assert "--tcp-established" in args and "--file-locks" in args
    assert not [a for a in args if a.startswith(("--network-lock", "--ghost-limit"))], args
    lines = config.splitlines()
    assert lines[:2] == ["network-lock nftables", "ghost-limit 4194304"] and lines[-1].startswith("libdir "), lines


@pytest.mark.parametrize("option", ["--network-lock", "--auto-dedup", "--ghost-limit"])
def test_an_option_runc_cannot_hand_on_is_refused_before_anything(option):
    """A bare --name (its value as the next word) and an option outside the configuration's list are refused."""
    backend = RuncBackend(criu_options=[option])
    with pytest.raises(InvalidTarget, match="cannot be passed through runc .*--network-lock=VALUE"):
        backend.criu_flags()


def test_a_tree_with_a_large_deleted_file_is_planned_for_runc_and_refused_for_containerd(tmp_path):
    """containerd's shim starts runc, whose CRIU does not inherit this module's environment: refused there."""
    code = ("import mmap, os, sys, tempfile, time\nfd, path = tempfile.mkstemp(dir=sys.argv[1])\n"
            "os.ftruncate(fd, 3 << 20)\nm = mmap.mmap(fd, 3 << 20)\nos.unlink(path)\nprint('up', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"up"
        want = "--ghost-limit=%d" % ((3 << 20) + procfs.GHOST_LIMIT)
        assert want in RuncBackend().plan_tree([p.pid])
        with pytest.raises(InvalidTarget, match="cannot pass to CRIU; nothing was frozen"):
            ContainerdBackend().plan_tree([p.pid])
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_the_user_configuration_comes_first_and_stays(tmp_path, monkeypatch):
    mine = tmp_path / "mine.conf"
    mine.write_text("log-file /tmp/x.log\n")
    monkeypatch.setenv("CRIU_CONFIG_FILE", str(mine))
    backend = RuncBackend(criu_options=["--ghost-limit=1048577"])
    backend.container, backend.cli = "c", RecordingCli()
    backend.dump(4242, str(tmp_path / "img"), str(tmp_path), "exit")
    lines = backend.cli.calls[0][1].splitlines()
    assert lines[:2] == ["log-file /tmp/x.log", "ghost-limit 1048577"], lines
    assert os.environ["CRIU_CONFIG_FILE"] == str(mine)


@pytest.fixture
def in_its_own_netns():
    """A real sleeper in a network namespace of its own (as any container not on the host's network)."""
    p = subprocess.Popen(["unshare", "--net", "sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: procfs.net_namespace(p.pid) not in (None, procfs.net_namespace()) and
                 procfs.read_stat(p.pid)["comm"] == "sleep", timeout=10, what="the sleeper's own namespace")
        yield p.pid
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def no_iptables_restore(monkeypatch):
    """This host as the GPU machines are: no iptables-restore on the PATH."""
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "iptables-restore" else which(name, *a, **k))


def test_a_tree_in_its_own_network_namespace_is_locked_with_nftables_where_iptables_is_missing(
        in_its_own_netns, no_iptables_restore):
    assert NFTABLES_LOCK in RuncBackend().plan_tree([in_its_own_netns])
    assert NFTABLES_LOCK in ProcessBackend().plan_tree([in_its_own_netns])


def test_a_runtime_that_cannot_hand_crius_lock_on_is_refused_naming_it(in_its_own_netns, no_iptables_restore):
    with pytest.raises(InvalidTarget, match="network namespace of its own, whose network is locked by CRIU during the "
                                            "dump with iptables-restore, which is not installed on this host, and the "
                                            "containerd runtime cannot hand CRIU --network-lock=nftables; nothing"):
        ContainerdBackend().plan_tree([in_its_own_netns])
    with pytest.raises(InvalidTarget, match="the criu options ask for iptables") as err:
        ProcessBackend(criu_options=["--network-lock", "iptables"]).plan_tree([in_its_own_netns])
    assert "install iptables" in err.value.hint


def test_with_iptables_restore_or_on_the_hosts_network_nothing_is_added(in_its_own_netns):
    assert shutil.which("iptables-restore"), "tests/setup.sh installs iptables"
    assert not [f for f in RuncBackend().plan_tree([in_its_own_netns]) if f.startswith("--network-lock")]
    me = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        assert not [f for f in ContainerdBackend().plan_tree([me.pid]) if f.startswith("--network-lock")]
    finally:
        me.kill()
        me.wait()


def test_a_tree_whose_tcp_connections_are_its_own_is_refused_for_docker_before_anything():
    """A distributed job's rendezvous and ranks hold TCP connections whose ends are all in the tree (internal_tcp, as
    the engine finds for a torchrun job): ``docker checkpoint`` cannot be handed --tcp-established, so a Docker
    container of such a job is refused at the plan, before anything is asked or frozen (docs/multi_gpu.md)."""
    code = ("import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen(1)\n"
            "c = socket.create_connection(s.getsockname())\na, unused = s.accept()\nprint('up', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"up"
        with pytest.raises(InvalidTarget, match="nothing was frozen") as err:
            DockerBackend().plan_tree([p.pid], internal_tcp=True)
        assert "--tcp-established" in err.value.msg and "docker" in err.value.msg, err.value.msg
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
