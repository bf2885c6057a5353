"""migrate.yml to a target whose ansible_host is an IPv6 address (::1), between real sshd "hosts" on
loopback: the image's transfer takes the target's address, port and user from the inventory (the
gpu_checkpoint and gpu_image_sync action plugins), and Ansible's own connections use it too."""
from __future__ import annotations

import os
import socket

import pytest

from loopback import LoopbackHosts
from loopback_workloads import RemoteWorkload, fakecuda_host_vars, migrate, processes


def _ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


@pytest.fixture(scope="module")
def v6hosts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("v6hosts"))
    host_vars = fakecuda_host_vars(base)
    h = LoopbackHosts(base, hosts=(("hosta", "127.0.0.4"), ("hostb", "::1"))).start(host_vars)
    yield h
    h.stop()


@pytest.mark.parametrize("push", [True, False], ids=["push-during-dump", "transfer-after-dump"])
def test_a_migration_to_an_ipv6_target_reaches_it_through_the_inventory(playbook, v6hosts, tmp_path, push):
    w = RemoteWorkload(v6hosts, "hosta", str(tmp_path / "w"))
    try:
        mid = "t-v6-%s" % ("push" if push else "sync")
        run = migrate(playbook, v6hosts, w, mid, gpuckpt_transfer_during_dump=push)
        assert run.rc == 0, run.stdout
        assert bool((run.task("Stage 1/3").get("push") or {}).get("pushed")) is push
        if not push:
            assert run.task("Stage 2/3")["bytes_transferred"] > 0
        assert "::1" in open(v6hosts.path("inventory.yml")).read()
        assert w.one_copy_runs_intact()
        ns_b = v6hosts.ssh("hostb", "readlink /proc/self/ns/pid").stdout.strip()
        assert os.readlink("/proc/%d/ns/pid" % processes(w.dir)[0][0]) == ns_b  # the copy that runs is hostb's
    finally:
        w.kill()
