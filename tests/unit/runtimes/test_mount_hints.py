"""CRIU's words for a container mount it cannot dump are turned into what the user can do about it."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.base import mount_hint


def test_a_mount_made_by_a_hook_points_to_cdi():
    log = "Error (criu/mount.c:1071): mnt: 1412:./usr/lib/x86_64-linux-gnu/libcuda.so.1 doesn't have a proper root mount"
    assert "CDI" in mount_hint(log)


def test_shared_propagation_points_to_private_mounts():
    assert "rprivate" in mount_hint("Error (criu/mount.c:1): mnt: 77:./dev/shm has unreachable sharing")


def test_other_failures_keep_the_default():
    assert mount_hint("Error (criu/cr-dump.c:1): Dumping FAILED.", "see dump.log") == "see dump.log"
    assert mount_hint(None) is None


def test_the_probe_gives_the_host_side_nsenter_no_loader_variables(monkeypatch):
    """nsenter runs on the host as root: a workload's LD_PRELOAD must not reach its loader; it is set
    again inside, through the container's env; other variables (secrets too) stay out of argv."""
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import procfs
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import base
    seen = {}
    monkeypatch.setattr(procfs, "environ", lambda pid: {"LD_PRELOAD": "/w/evil.so", "TOKEN": "s3cret", "PATH": "/bin"})
    monkeypatch.setattr(base, "find_binary", lambda *a, **k: "/usr/bin/nsenter")
    monkeypatch.setattr(base.os.path, "isfile", lambda p: p.endswith("/usr/bin/env"))
    monkeypatch.setattr(base, "run", lambda cmd, **kw: seen.update(cmd=cmd, env=kw["env"]))
    monkeypatch.setattr(base.Backend, "__abstractmethods__", frozenset())  # (the interface's own probe alone)
    base.Backend().probe(4242, ["nvidia-smi"], 5)  # pylint: disable=abstract-class-instantiated
    assert "LD_PRELOAD" not in seen["env"] and seen["env"]["TOKEN"] == "s3cret"
    assert seen["cmd"][-3:] == ["/usr/bin/env", "LD_PRELOAD=/w/evil.so", "nvidia-smi"]
    assert not any("s3cret" in a for a in seen["cmd"])
