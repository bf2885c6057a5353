"""Names and ids are checked to the true end of the string (issue 43 item 11). Python's ``$`` also matches before a
trailing newline, so ``re.compile(r"^[a-z]+$").match("nl\\n")`` passes: a protected job named "nl\\n" made
``nl\\n.json`` and a replica directory of that name. Each validator anchors with ``\\Z``; each is tried here with a
name that ends in "\\n", and the collection's sources are scanned so that a new validator cannot bring ``$`` back."""
from __future__ import annotations

import os
import re

import pytest

from ansible_collections.gpuckpt.fleet.plugins.filter.drain_move_host import drain_move_host
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image, journal
from ansible_collections.gpuckpt.fleet.plugins.module_utils.replica import replica
from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import targets
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import devices
from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine import plan
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_job
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import criu_gate, k8s_pod
from ansible_collections.gpuckpt.fleet.plugins.modules import gpu_checkpoint
from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.progress_display import ProgressActionBase as ProgressAction

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_replica_job_name_with_a_trailing_newline_is_refused():
    assert replica.check_job("train-1") == "train-1"
    with pytest.raises(InvalidTarget, match="job name"):
        replica.check_job("train-1\n")


def test_a_replica_image_id_with_a_trailing_newline_is_refused():
    assert replica.check_image_id("20240101T000000-1") == "20240101T000000-1"
    with pytest.raises(InvalidTarget, match="image id"):
        replica.check_image_id("20240101T000000-1\n")


def test_a_protected_job_name_with_a_trailing_newline_is_refused_before_its_config_is_read(tmp_path):
    (tmp_path / "nl\n.json").write_text("{}")
    with pytest.raises(InvalidTarget, match="job name 'nl\\\\n' must be"):
        protect_job.load_config(str(tmp_path), "nl\n")


def test_a_config_file_named_with_a_newline_is_no_protected_job(tmp_path):
    for name in ("nl\n.json", "ok.json", "a.b-c_1.json"):
        (tmp_path / name).write_text("{}")
    assert protect_job.job_names(str(tmp_path)) == ["a.b-c_1", "ok"]


def test_an_image_id_with_a_trailing_newline_is_refused():
    assert plan._checked_image_id("img-1") == "img-1"
    with pytest.raises(InvalidTarget, match="image_id"):
        plan._checked_image_id("img-1\n")


def test_a_migration_id_with_a_trailing_newline_is_refused():
    assert journal.check_id("mig-1") == "mig-1"
    with pytest.raises(InvalidTarget, match="migration_id"):
        journal.check_id("mig-1\n")


@pytest.mark.parametrize("field,kwargs", [
    ("host", dict(host="hostb\n")),
    ("user", dict(host="hostb", user="root\n")),
    ("python", dict(host="hostb", python="python3\n")),
])
def test_a_transfer_target_with_a_trailing_newline_is_refused(field, kwargs):
    """Each value becomes part of an ssh command line."""
    targets.Target("hostb", user="root", python="python3")
    with pytest.raises(InvalidTarget, match="transfer %s" % field):
        targets.Target(**kwargs)


def test_a_pod_or_container_name_with_a_trailing_newline_is_refused(tmp_path):
    assert k8s_pod.parse_pod("default/gpu-pod") == ("default", "gpu-pod")
    for bad in ("default/gpu-pod\n", "default\n/gpu-pod", "gpu-pod\n"):
        with pytest.raises(InvalidTarget):
            k8s_pod.parse_pod(bad)
    with pytest.raises(InvalidTarget, match="container name"):
        k8s_pod.container_dir(str(tmp_path), "main\n")


def test_paths_quoted_into_a_script_and_nonces_end_at_the_end():
    assert criu_gate.SAFE_PATH.match("/usr/bin/flock")
    assert not criu_gate.SAFE_PATH.match("/usr/bin/flock\n")
    assert gpu_checkpoint.NONCE_RE.match("abcd1234")
    assert not gpu_checkpoint.NONCE_RE.match("abcd1234\n")
    assert devices.GPU_NODE.match("nvidia0")
    assert not devices.GPU_NODE.match("nvidia0\n")
    assert image.GROWING.match("pages-1.img")
    assert not image.GROWING.match("pages-1.img\n")


def test_progress_display_refuses_a_job_id_or_path_with_a_trailing_newline():
    assert ProgressAction._bad_args({"attach": "j1.2", "progress_file": "/tmp/p"}) is None
    assert "attach" in ProgressAction._bad_args({"attach": "j1.2\n"})
    assert "progress_file" in ProgressAction._bad_args({"progress_file": "/tmp/p\n"})


def test_a_move_host_keeps_only_true_connection_variables():
    out = drain_move_host({"ansible_host": "10.0.0.7", "ansible_host\n": "evil", "group_names": []}, "m", "g")
    assert out["ansible_host"] == "10.0.0.7"
    assert "ansible_host\n" not in out


# -- the class: no validating regex of the collection ends with `$` ---------------------------------------------

# Patterns that parse lines or deny names, where `$` matching before a newline does no harm (a deny list: more denied).
ALLOWED_DOLLAR = {
    ("plugins/module_utils/cuda/cdi.py", "LDCONFIG_LINE"),  # parses ldconfig -p lines (\s* takes the newline)
    ("plugins/filter/drain_move_host.py", "_DRAIN_OWN"),  # a deny list
}
PY_PATTERN = re.compile(r'^(\w+)\s*=\s*re\.compile\(r?"\^(?:[^"\n]|"\s*\n\s*r?")*\$"\)', re.M)
YAML_MATCH = re.compile(r"""\bis\s+(?:match|search|regex)\(\s*'\^[^']*\$'|select\(\s*'(?:match|search)'\s*,\s*'\^[^']*\$'""")


def _sources(top, ext):
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith(ext):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as fh:
                    yield os.path.relpath(path, REPO), fh.read()


def test_the_scan_sees_an_anchor_before_a_newline():
    assert PY_PATTERN.search('JOB_RE = re.compile(r"^[a-z]+$")')
    assert PY_PATTERN.search('X = re.compile(r"^a"\n    r"|b$")')
    assert not PY_PATTERN.search('JOB_RE = re.compile(r"^[a-z]+\\Z")')
    assert YAML_MATCH.search("that: job is match('^[a-z]+$')")
    assert not YAML_MATCH.search("that: job is match('^[a-z]+\\\\Z')")


def test_no_validating_regex_in_plugins_ends_with_dollar():
    found = [(path, m.group(1)) for path, text in _sources("plugins", ".py") for m in PY_PATTERN.finditer(text)]
    assert set(found) - ALLOWED_DOLLAR == set(), "anchor these at the true end with \\Z: %s" % sorted(found)


@pytest.mark.parametrize("top", ["roles", "playbooks"])
def test_no_match_test_in_roles_or_playbooks_ends_with_dollar(top):
    found = ["%s: %s" % (path, m.group(0)) for ext in (".yml", ".yaml") for path, text in _sources(top, ext)
             for m in YAML_MATCH.finditer(text)]
    assert found == [], "anchor these at the true end with \\\\Z: %s" % found
