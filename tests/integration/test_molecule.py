"""Each role's molecule scenario (roles/*/molecule/default), run with molecule itself: prepare,
converge, converge again failing on any change (idempotence), verify, clean up. The delegated
"default" driver converges this machine over a local connection, each role's paths under
/tmp/gpuckpt-molecule."""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers import ANSIBLE_PLAYBOOK, COLLECTIONS, MANAGED_PYTHON, REPO

ROLES = sorted(r for r in os.listdir(os.path.join(REPO, "roles"))
               if os.path.isdir(os.path.join(REPO, "roles", r, "molecule", "default")))
MOLECULE = os.path.join(os.path.dirname(ANSIBLE_PLAYBOOK), "molecule")
CRIU_TARBALL = "/var/cache/criu_4.2.1.orig.tar.xz"  # kept by tests/setup.sh
# The compiler cache tests/setup.sh builds CRIU through: the criu role's build of the same source (the converge
# runs on this machine, over a local connection) finds its objects there. The role runs every step as it would
# without it; only gcc's work is found again.
CCACHE = {"PATH": "/usr/lib/ccache", "CCACHE_DIR": "/var/cache/gpuckpt-ccache", "CCACHE_NOHASHDIR": "true"}


def test_every_role_has_a_scenario():
    assert ROLES == sorted(os.listdir(os.path.join(REPO, "roles")))


@pytest.mark.skipif(not os.path.exists(MOLECULE), reason="molecule is installed by tests/setup.sh")
@pytest.mark.parametrize("role", ROLES)
def test_molecule_converges_the_role_twice_and_the_second_run_changes_nothing(role):
    if role == "criu" and not os.path.exists(CRIU_TARBALL):
        pytest.skip("tests/setup.sh keeps CRIU's release tarball at " + CRIU_TARBALL)
    path = [os.path.dirname(ANSIBLE_PLAYBOOK)] + ([CCACHE["PATH"]] if os.path.isdir(CCACHE["PATH"]) else [])
    env = dict(os.environ, PATH=os.pathsep.join(path + [os.environ.get("PATH", "")]),
               CCACHE_DIR=CCACHE["CCACHE_DIR"], CCACHE_NOHASHDIR=CCACHE["CCACHE_NOHASHDIR"],
               GPUCKPT_COLLECTIONS_PATH=COLLECTIONS, GPUCKPT_MOLECULE_PYTHON=MANAGED_PYTHON,
               GPUCKPT_CRIU_TARBALL=CRIU_TARBALL, NO_COLOR="1", ANSIBLE_FORCE_COLOR="0")
    res = subprocess.run([MOLECULE, "test", "--scenario-name", "default"], cwd=os.path.join(REPO, "roles", role),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                         timeout=1200, check=False)
    tail = res.stdout[-6000:]
    assert res.returncode == 0, tail
    for action in ("converge", "idempotence", "verify"):
        assert "%s: Executed: Successful" % action in res.stdout, tail
    # molecule's prerun is off: no copy of the collection is left in the user's collections path
    assert not os.path.exists(os.path.expanduser("~/.ansible/collections/ansible_collections/gpuckpt/fleet"))
