"""The provisioning roles, run for real on this machine (Debian 12) through ansible-playbook."""
from __future__ import annotations

import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROLE_CRIU = os.path.join(HERE, "playbooks", "role_criu.yml")
TARBALL = "/var/cache/criu_4.1.1.orig.tar.xz"  # kept by tests/setup.sh


def _recap_changed(run):
    return sum(1 for r in run.results if r.get("changed"))


@pytest.mark.skipif(not os.path.exists(TARBALL), reason="tests/setup.sh keeps CRIU's release tarball at " + TARBALL)
def test_criu_role_builds_from_a_local_tarball_then_changes_nothing(playbook, tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "sbin").mkdir(parents=True)
    v = {"criu_install_method": "source", "criu_source_file": TARBALL, "criu_prefix": str(prefix),
         "criu_build_dir": str(tmp_path / "build")}
    run = playbook(ROLE_CRIU, v)
    assert run.rc == 0, run.stdout
    built = prefix / "sbin" / "criu"
    out = subprocess.run([str(built), "--version"], stdout=subprocess.PIPE, universal_newlines=True).stdout
    assert "Version: 4.1.1" in out
    assert run.task("Check the kernel with criu check")["rc"] == 0
    assert _recap_changed(run) > 0
    again = playbook(ROLE_CRIU, v)
    assert again.rc == 0, again.stdout
    assert _recap_changed(again) == 0, [r["_task"] for r in again.results if r.get("changed")]


def test_criu_role_rejects_a_bad_argument(playbook, tmp_path):
    run = playbook(ROLE_CRIU, {"criu_install_method": "bogus", "criu_prefix": str(tmp_path)})
    assert run.rc != 0
    text = run.stdout
    assert "criu_install_method" in text and "bogus" in text and "one of" in text
