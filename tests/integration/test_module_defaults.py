"""module_defaults for the collection's action group (meta/runtime.yml: group/gpuckpt.fleet.gpu), through
ansible-playbook: a module and a module behind an action plugin both take the group's options."""
from __future__ import annotations

import os

from helpers import REPO

PLAYBOOK = os.path.join(REPO, "tests", "integration", "playbooks", "module_defaults.yml")


def test_the_group_s_options_reach_every_module(playbook):
    run = playbook(PLAYBOOK)
    assert run.rc == 0, run.stdout
    assert run.task("Check both")["msg"] == "All assertions passed"
