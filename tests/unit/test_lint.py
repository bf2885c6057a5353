"""ansible-lint with the production profile on the collection's playbooks and roles (issue: lint in CI)."""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers import COLLECTIONS, REPO

ANSIBLE_LINT = os.path.join(REPO, ".venv", "bin", "ansible-lint")


@pytest.mark.skipif(not os.path.exists(ANSIBLE_LINT), reason="needs the venv from tests/setup.sh")
def test_ansible_lint_production_profile():
    # At the repository root, as a user or Galaxy would run it (.ansible-lint: production profile).
    res = subprocess.run([ANSIBLE_LINT, "--profile", "production", "--offline", "--nocolor", "-f", "pep8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, cwd=REPO,
                         env=dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS,
                                  PATH=os.path.join(REPO, ".venv", "bin") + os.pathsep + os.environ.get("PATH", "")), check=False)
    assert res.returncode == 0, res.stdout[-4000:]


ANTSIBULL_CHANGELOG = os.path.join(REPO, ".venv", "bin", "antsibull-changelog")


@pytest.mark.skipif(not os.path.exists(ANTSIBULL_CHANGELOG), reason="needs the venv from tests/setup.sh")
def test_changelog_fragments_are_valid():
    """changelogs/: every fragment in a known section (antsibull-changelog lint), and the generated
    CHANGELOG.rst up to date with changelogs/changelog.yaml."""
    res = subprocess.run([ANTSIBULL_CHANGELOG, "lint"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, cwd=REPO, check=False)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout
