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


ROLE_CUDA_CHECKPOINT = os.path.join(HERE, "playbooks", "role_cuda_checkpoint.yml")


def test_cuda_checkpoint_role_fails_clearly_without_a_driver(playbook, tmp_path):
    """CI has no NVIDIA driver: the role must say so, not pass."""
    run = playbook(ROLE_CUDA_CHECKPOINT, {"cuda_checkpoint_path": str(tmp_path / "cuda-checkpoint")},
                   env={"GPUCKPT_LIBCUDA": str(tmp_path / "no-libcuda.so.1")})
    assert run.rc != 0
    msg = run.task("Require driver")["msg"]
    assert "not found" in msg and "570 or newer" in msg
    assert not (tmp_path / "cuda-checkpoint").exists()


def test_cuda_checkpoint_role_installs_the_binary_then_changes_nothing(playbook, tmp_path):
    # TEST DOUBLE of the cuda-checkpoint binary (NVIDIA's is not reachable here): answers --help.
    fake = tmp_path / "cuda-checkpoint-src"
    fake.write_text("#!/bin/sh\necho 'CUDA checkpoint and restore utility'\n")
    dest = tmp_path / "bin" / "cuda-checkpoint"
    dest.parent.mkdir()
    v = {"cuda_checkpoint_require_driver": False, "cuda_checkpoint_source_file": str(fake),
         "cuda_checkpoint_path": str(dest)}
    run = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert run.rc == 0, run.stdout
    assert dest.exists() and os.access(str(dest), os.X_OK)
    assert _recap_changed(run) == 1
    again = playbook(ROLE_CUDA_CHECKPOINT, v)
    assert again.rc == 0 and _recap_changed(again) == 0
