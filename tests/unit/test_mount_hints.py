"""CRIU's words for a container mount it cannot dump are turned into what the user can do about it."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from plugins.module_utils.runtimes.base import mount_hint  # noqa: E402


def test_a_mount_made_by_a_hook_points_to_cdi():
    log = "Error (criu/mount.c:1071): mnt: 1412:./usr/lib/x86_64-linux-gnu/libcuda.so.1 doesn't have a proper root mount"
    assert "CDI" in mount_hint(log)


def test_shared_propagation_points_to_private_mounts():
    assert "rprivate" in mount_hint("Error (criu/mount.c:1): mnt: 77:./dev/shm has unreachable sharing")


def test_other_failures_keep_the_default():
    assert mount_hint("Error (criu/cr-dump.c:1): Dumping FAILED.", "see dump.log") == "see dump.log"
    assert mount_hint(None) is None
