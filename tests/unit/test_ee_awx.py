"""The execution environment definition passes ansible-builder's own check (`ansible-builder create`
writes the build context without building an image), and the AWX job templates follow the
controller's configuration-as-code format: awx.awx.job_template fields and AWX's survey spec rules,
checked here field by field (no AWX server runs in CI)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import yaml

from helpers import REPO

from ansible_collections.gpuckpt.fleet.plugins.filter.drain_plan import drain_plan
from ansible_collections.gpuckpt.fleet.plugins.module_utils.migration import planner

VENV_BIN = os.path.join(REPO, ".venv", "bin")
SURVEY_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}
JOB_TEMPLATE_FIELDS = {"name", "description", "job_type", "inventory", "project", "playbook", "execution_environment",
                       "verbosity", "survey_enabled", "survey_spec", "become_enabled", "ask_limit_on_launch",
                       "ask_variables_on_launch", "ask_job_type_on_launch", "extra_vars", "limit", "forks", "timeout", "credentials"}


@pytest.mark.skipif(not os.path.exists(os.path.join(VENV_BIN, "ansible-builder")), reason="needs tests/setup.sh")
def test_execution_environment_definition_passes_ansible_builder(tmp_path):
    out = os.path.join(REPO, ".build", "ee")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "build", "--output-path", out, REPO],
                   check=True, stdout=subprocess.PIPE, cwd=REPO)
    built = glob.glob(os.path.join(out, "gpuckpt-fleet-*.tar.gz"))
    assert len(built) == 1
    os.rename(built[0], os.path.join(out, "gpuckpt-fleet.tar.gz"))
    ctx = str(tmp_path / "context")
    res = subprocess.run([os.path.join(VENV_BIN, "ansible-builder"), "create", "-f",
                          os.path.join(REPO, "ee", "execution-environment.yml"), "-c", ctx],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
    assert res.returncode == 0, res.stdout
    # Containerfile (podman) or Dockerfile (docker), by the container runtime ansible-builder finds
    name = "Containerfile" if os.path.exists(os.path.join(ctx, "Containerfile")) else "Dockerfile"
    containerfile = open(os.path.join(ctx, name)).read()
    assert "gpuckpt-fleet.tar.gz" in containerfile
    assert os.path.exists(os.path.join(ctx, "_build", "collections", "gpuckpt-fleet.tar.gz"))


@pytest.mark.skipif(not os.path.exists(os.path.join(VENV_BIN, "ansible-builder")), reason="needs tests/setup.sh")
def test_an_ee_that_lists_the_installed_collection_introspects(tmp_path):
    """ansible-builder reads meta/execution-environment.yml of every collection an EE lists, as the
    collection's dependency file: it must be that form (a full build definition there crashed it)."""
    out = str(tmp_path / "built")
    subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "build", "--output-path", out, REPO],
                   check=True, stdout=subprocess.PIPE, cwd=REPO)
    [tarball] = glob.glob(os.path.join(out, "gpuckpt-fleet-*.tar.gz"))
    installed = str(tmp_path / "collections")
    subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "install", "--offline", "-p", installed,
                    tarball], check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    res = subprocess.run([os.path.join(VENV_BIN, "ansible-builder"), "introspect", "--sanitize", installed],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
    assert res.returncode == 0, res.stdout
    assert "openssh-client [platform:dpkg]" in res.stdout and "gpuckpt.fleet" in res.stdout, res.stdout
    assert "kubernetes>=24.2.0" in res.stdout, res.stdout  # gpu_pod_info runs on the controller


def _argspec_options(playbook="migrate"):
    meta = yaml.safe_load(open(os.path.join(REPO, "playbooks", playbook + ".meta.yml")))
    return meta["argument_specs"]["main"]["options"]


def _playbook_options(playbook):
    """The options a playbook's first task checks its variables against (None: it checks none). drain.yml
    checks drain.meta.yml's with the gpuckpt_* options of migrate.meta.yml, which apply to each move."""
    if playbook in ("playbooks/migrate.yml", "playbooks/recover.yml"):
        return _argspec_options()
    if playbook == "playbooks/drain.yml":
        migrate = {k: v for k, v in _argspec_options().items() if k.startswith("gpuckpt_")}
        return dict(migrate, **_argspec_options("drain"))
    if playbook == "playbooks/failover.yml":
        return _argspec_options("failover")
    return None


# Which answers of a survey question type an argument spec type takes. A text answer arrives as one string:
# drain.yml's list options (include, exclude) split it into names (gpuckpt.fleet.drain_plan).
SURVEY_ANSWERS_FIT = {"text": {"str", "raw", "path"}, "textarea": {"str", "raw"}, "password": {"str", "raw"},
                      "integer": {"int", "float", "raw"}, "float": {"float", "raw"},
                      "multiplechoice": {"str", "bool", "raw"}, "multiselect": {"list"}}
TEXT_SPLIT_INTO_NAMES = {("playbooks/drain.yml", "include"), ("playbooks/drain.yml", "exclude")}


def _check_question_fits_the_option(playbook, q, option):
    kinds = SURVEY_ANSWERS_FIT[q["type"]] | ({"list"} if (playbook, q["variable"]) in TEXT_SPLIT_INTO_NAMES else set())
    assert option.get("type", "str") in kinds, (playbook, q, option)
    if option.get("required"):
        assert q["required"], "%s requires %s: the survey must ask for it" % (playbook, q["variable"])
    if q["type"] in ("multiplechoice", "multiselect") and option.get("type") == "bool":
        assert set(q["choices"]) <= {"true", "false"}, q
    elif q["type"] in ("multiplechoice", "multiselect") and option.get("choices"):
        assert set(q["choices"]) <= set(option["choices"]), q


def _check_question(q):
    assert {"question_name", "variable", "type", "required"} <= set(q), q
    assert q["type"] in SURVEY_TYPES, q
    if q["type"] == "multiplechoice":
        assert q["choices"] and q.get("default", q["choices"][0]) in q["choices"], q
    if q["type"] == "multiselect":  # AWX keeps a multiselect's default as its choices, one per line
        assert q["choices"] and set(filter(None, q.get("default", "").split("\n"))) <= set(q["choices"]), q
    if q["type"] in ("integer", "float") and "default" in q:
        number = int if q["type"] == "integer" else (int, float)
        assert isinstance(q["default"], number) and q.get("min", q["default"]) <= q["default"] <= q.get("max", q["default"])


def test_job_templates_follow_the_controller_format():
    doc = yaml.safe_load(open(os.path.join(REPO, "awx", "job_templates.yml")))
    templates = doc["controller_templates"]
    names = {"gpuckpt migrate", "gpuckpt recover", "gpuckpt drain", "gpuckpt checkpoint", "gpuckpt restore",
             "gpuckpt provision", "gpuckpt protect", "gpuckpt images", "gpuckpt failover"}
    assert {t["name"] for t in templates} == names
    for t in templates:
        assert set(t) <= JOB_TEMPLATE_FIELDS, set(t) - JOB_TEMPLATE_FIELDS
        assert t["job_type"] in ("run", "check")
        assert os.path.exists(os.path.join(REPO, t["playbook"])), t["playbook"]
        spec = t["survey_spec"]
        assert spec["name"] and "description" in spec and spec["spec"]
        seen = set()
        options = _playbook_options(t["playbook"])
        for q in spec["spec"]:
            _check_question(q)
            assert q["variable"] not in seen
            seen.add(q["variable"])
            if options is not None:
                assert q["variable"] in options, (t["name"], q["variable"])
            if t["playbook"] in ("playbooks/drain.yml", "playbooks/failover.yml"):
                _check_question_fits_the_option(t["playbook"], q, options[q["variable"]])
    assert doc["controller_execution_environments"][0]["name"] == templates[0]["execution_environment"]


def _drain_template():
    doc = yaml.safe_load(open(os.path.join(REPO, "awx", "job_templates.yml")))
    [drain] = [t for t in doc["controller_templates"] if t["playbook"] == "playbooks/drain.yml"]
    return drain


def test_the_drain_template_plans_first_and_asks_for_every_option_of_a_drain():
    """Launched as it is, the drain template runs in check mode (the plan, nothing frozen); the job type is
    asked at launch. Its multiselect of unknown checks offers exactly what drain_plan accepts by name."""
    drain = _drain_template()
    assert drain["job_type"] == "check" and drain["ask_job_type_on_launch"] is True
    asked = {q["variable"]: q for q in drain["survey_spec"]["spec"]}
    assert set(asked) == {"node", "targets", "drain_parallel", "deadline", "include", "exclude", "undrain",
                          "gpuckpt_allow_unknown"}
    assert set(asked["gpuckpt_allow_unknown"]["choices"]) == set(planner.CHECK_NAMES) | {"deadline", "runtime"}
    assert asked["drain_parallel"]["min"] >= 1 and asked["deadline"].get("min", 0) > 0  # option_errors' rules


def _workload(pid, container=None):
    tree = {"root": pid, "exists": True, "pids": [pid, pid + 1], "cuda_pids": [pid + 1], "rss_bytes": 2**30,
            "gpu_bytes": 2**30}
    if container:
        return {"key": "runc:" + container, "kind": "container", "runtime": "runc", "container": container,
                "root_pid": pid, "tree": tree}
    return {"key": "process:%d" % pid, "kind": "process", "runtime": "process", "pid": pid, "root_pid": pid, "tree": tree}


@pytest.mark.parametrize("include,exclude", [
    ("4242, train-7", None),                 # an AWX text answer
    ("[4242,train-7]", None),                # -e include=[4242,train-7] on the command line
    (["4242", "train-7"], None),             # a list (JSON or YAML extra vars)
    (None, "5000"),
    ("", "5000"),                            # an empty answer to include leaves no workload out
    (None, "[5001]"),                        # any pid of a workload's tree names it
])
def test_a_text_answer_for_include_and_exclude_names_workloads(include, exclude):
    """A survey has no list question but a multiselect of fixed choices: include and exclude are text, and
    reach the playbook as one string, as -e include=[...] does. Taken as a list it named single characters,
    and an exclude left out nothing."""
    node = {"workloads": [_workload(4242), _workload(5000), _workload(6000, container="train-7")]}
    plan = drain_plan(node, {}, "node-7", "/img", {}, "drain-x", include=include, exclude=exclude,
                      allow_unknown="")
    left = sorted(w["key"] for w in plan["left_out"])
    assert left == ["process:5000"], (include, exclude, left)
    assert plan["workloads"] == 3
