"""ansible-test sanity on the collection (all tests that run here: validate-modules, pylint, pep8,
compile, import, ansible-doc, yamllint...; pylint with the current ansible-core only). ansible-test wants the collection at
ansible_collections/gpuckpt/fleet in a git tree, so the tracked files are copied into one."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import REPO

# The venv's ansible-core, and the oldest that meta/runtime.yml's requires_ansible claims
VENVS = {"current": os.path.join(REPO, ".venv"), "oldest": os.path.join(REPO, ".venv-oldest")}


@pytest.mark.parametrize("which", sorted(VENVS))
def test_ansible_test_sanity(tmp_path, which):
    ansible_test = os.path.join(VENVS[which], "bin", "ansible-test")
    if not os.path.exists(ansible_test):
        pytest.skip("needs the venvs from tests/setup.sh")
    dest = tmp_path / "ansible_collections" / "gpuckpt" / "fleet"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, stdout=subprocess.PIPE, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(str(dest / rel)), exist_ok=True)
            shutil.copy2(src, str(dest / rel))
    git = ["git", "-c", "user.email=ci@localhost", "-c", "user.name=ci"]
    subprocess.run(git + ["init", "-q"], cwd=str(dest), check=True)
    subprocess.run(git + ["add", "-A"], cwd=str(dest), check=True)
    subprocess.run(git + ["commit", "-qm", "sanity"], cwd=str(dest), check=True)
    # pylint runs once, with the current ansible-core's (70 s of the oldest run's 175 s on the CI kind of machine):
    # the oldest run is there for what its ansible-core reads differently (validate-modules, ansible-doc, import,
    # runtime-metadata), not for a second lint of the same code.
    skip = ["--skip-test", "pylint"] if which == "oldest" else []
    res = subprocess.run([ansible_test, "sanity", "--python", "3.11"] + skip, cwd=str(dest), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, universal_newlines=True, timeout=1800, check=False)
    errors = [line for line in res.stdout.splitlines() if line.startswith(("ERROR", "FATAL"))]
    assert res.returncode == 0, "\n".join(errors) or res.stdout[-4000:]
