"""The runc backend's cgroup v2 handling on restore, on a made-up cgroup v2 tree (this machine kind
runs cgroup v1; the real case runs on the GPU machine in tests/gpu/test_gpu_runc.py): the restored
container must land in the cgroup the target's bundle names, and a frozen destination (which would
freeze the restored process inside CRIU and hang the restore) is refused before anything runs."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import runc as runc_mod


@pytest.fixture
def v2(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(runc_mod, "CGROUP2_ROOT", str(root))
    monkeypatch.delenv("CRIU_CONFIG_FILE", raising=False)
    return root


def cgroup(root, path, frozen):
    d = root / path.lstrip("/")
    d.mkdir(parents=True)
    (d / "cgroup.events").write_text("populated 1\nfrozen %d\n" % (1 if frozen else 0))


def bundle(tmp_path, cgroups_path):
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    (b / "config.json").write_text(json.dumps({"linux": {"cgroupsPath": cgroups_path} if cgroups_path else {}}))
    return str(b)


MANIFEST = {"runtime": {"cgroup_v2_path": "/ctr-on-source"}}


def test_another_absolute_path_becomes_criu_cgroup_root(v2, tmp_path, monkeypatch):
    cgroup(v2, "/ctr-on-source", frozen=True)  # the paused source, as on one machine seen as two hosts
    user_conf = tmp_path / "user.conf"
    user_conf.write_text("tcp-established\n")
    monkeypatch.setenv("CRIU_CONFIG_FILE", str(user_conf))
    env = runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, "/ctr-on-target"), MANIFEST, str(tmp_path))
    with open(env["CRIU_CONFIG_FILE"]) as fh:
        assert fh.read().splitlines() == ["tcp-established", "cgroup-root /ctr-on-target"]


def test_a_frozen_destination_is_refused(v2, tmp_path):
    cgroup(v2, "/ctr-on-source", frozen=True)
    with pytest.raises(InvalidTarget, match=r"cgroup /ctr-on-source is frozen on this host.*nothing was restored"):
        runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, "/ctr-on-source"), MANIFEST, str(tmp_path))
    # a bundle without cgroupsPath leaves the source's path to CRIU: refused the same way
    with pytest.raises(InvalidTarget, match="frozen"):
        runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, None), MANIFEST, str(tmp_path))
    assert not os.path.exists(tmp_path / "criu-cgroup-root.conf")


def test_same_path_thawed_and_systemd_paths_change_nothing(v2, tmp_path):
    cgroup(v2, "/ctr-on-source", frozen=False)
    assert runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, "/ctr-on-source"), MANIFEST, str(tmp_path)) is None
    assert runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, "system.slice:runc:x"), MANIFEST, str(tmp_path)) is None


def test_cgroup_v1_hosts_and_old_manifests_change_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(runc_mod, "CGROUP2_ROOT", str(tmp_path / "none"))
    assert runc_mod.RuncBackend().cgroup_env(bundle(tmp_path, "/x"), MANIFEST, str(tmp_path)) is None
    assert runc_mod.cgroup2_path(os.getpid()) is None
