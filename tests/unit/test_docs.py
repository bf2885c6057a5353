"""Every plugin's DOCUMENTATION parses (ansible-doc), with the shared doc fragments."""
from __future__ import annotations

import functools
import json
import os
import subprocess

import pytest
import yaml

from helpers import COLLECTIONS, REPO

ANSIBLE_DOC = os.path.join(REPO, ".venv", "bin", "ansible-doc")


@pytest.mark.skipif(not os.path.exists(ANSIBLE_DOC), reason="needs the venv from tests/setup.sh")
def _documented_plugins():
    """Every module and filter in the tree: a new one is checked without being listed here."""
    found = []
    for kind, folder in (("module", "modules"), ("filter", "filter")):
        for fname in sorted(os.listdir(os.path.join(REPO, "plugins", folder))):
            if fname.endswith((".py", ".yml")) and not fname.startswith("_") and fname != "__init__.py":
                found.append((kind, fname.rsplit(".", 1)[0]))
    return found


def _ansible_doc(kind, names):
    return subprocess.run([ANSIBLE_DOC, "-t", kind, "--json"] + ["gpuckpt.fleet." + n for n in names],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                          env=dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS), check=False)


@functools.lru_cache(maxsize=None)
def _all_docs(kind):
    """Every plugin's of ``kind`` in one ansible-doc run (one run a plugin took 2 s each, 75 of them); {} when it
    fails, where each test asks for its own plugin alone and shows ansible-doc's words."""
    res = _ansible_doc(kind, [n for k, n in _documented_plugins() if k == kind])
    try:
        return json.loads(res.stdout) if res.returncode == 0 else {}
    except ValueError:
        return {}


def _doc(kind, name):
    """ansible-doc's JSON of plugin ``name`` (its own run where the run of them all did not give it)."""
    found = _all_docs(kind).get("gpuckpt.fleet." + name)
    if found is not None:
        return found
    res = _ansible_doc(kind, [name])
    assert res.returncode == 0, res.stdout
    return json.loads(res.stdout)["gpuckpt.fleet." + name]


@pytest.mark.parametrize("kind,name", _documented_plugins())
def test_documentation_parses(kind, name):
    doc = _doc(kind, name)
    assert "options" in doc["doc"]
    if kind == "module":  # EXAMPLES must be valid YAML: a list of tasks that call this module
        options = doc["doc"]["options"]
        examples = yaml.safe_load(doc["examples"])
        assert isinstance(examples, list) and examples
        for task in examples:
            args = task.get("gpuckpt.fleet." + name)
            if args is None:
                continue
            for key, value in (args or {}).items():
                assert key in options, "example %r passes %s, which is no option" % (task["name"], key)
                if options[key].get("type") == "bool":
                    assert isinstance(value, bool), "example %r: %s must be a bool" % (task["name"], key)


# What each module's check mode does, as its documentation must say (the shared fragment gpuckpt.fleet.common.attributes
# says full; a module with less says so itself).
CHECK_MODE = {"cuda_process_facts": "full", "gpu_checkpoint": "full", "gpu_restore": "full", "gpu_image_sync": "full",
              "gpu_migration": "partial", "gpu_pod_info": "full", "gpu_k8s_node": "full", "gpu_cdi_spec": "full",
              "gpu_replica": "full", "gpu_protect": "full"}


@pytest.mark.parametrize("name", sorted(CHECK_MODE))
def test_attributes_say_the_modules_check_mode_and_its_action_group(name):
    attributes = _doc("module", name)["doc"]["attributes"]
    assert attributes["check_mode"]["support"] == CHECK_MODE[name]
    assert attributes["check_mode"].get("details"), "say what check mode does"
    assert attributes["diff_mode"]["support"] == "none"
    with open(os.path.join(REPO, "meta", "runtime.yml")) as fh:
        groups = yaml.safe_load(fh)["action_groups"]
    documented = (attributes.get("action_group") or {}).get("membership") or []
    member_of = ["gpuckpt.fleet." + g for g, members in groups.items() if name in members]
    assert set(documented) <= set(member_of), "a group named in the documentation must hold it in meta/runtime.yml"
    if name in groups["gpu"]:
        assert "gpuckpt.fleet.gpu" in documented, "module_defaults for group/gpuckpt.fleet.gpu reach it: say so"
