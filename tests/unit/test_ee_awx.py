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

VENV_BIN = os.path.join(REPO, ".venv", "bin")
SURVEY_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}
JOB_TEMPLATE_FIELDS = {"name", "description", "job_type", "inventory", "project", "playbook", "execution_environment",
                       "verbosity", "survey_enabled", "survey_spec", "become_enabled", "ask_limit_on_launch",
                       "ask_variables_on_launch", "extra_vars", "limit", "forks", "timeout", "credentials"}


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


def _argspec_options():
    meta = yaml.safe_load(open(os.path.join(REPO, "playbooks", "migrate.meta.yml")))
    return meta["argument_specs"]["main"]["options"]


def test_job_templates_follow_the_controller_format():
    doc = yaml.safe_load(open(os.path.join(REPO, "awx", "job_templates.yml")))
    templates = doc["controller_templates"]
    names = {"gpuckpt migrate", "gpuckpt recover", "gpuckpt checkpoint", "gpuckpt restore", "gpuckpt provision"}
    assert {t["name"] for t in templates} == names
    migrate_options = _argspec_options()
    for t in templates:
        assert set(t) <= JOB_TEMPLATE_FIELDS, set(t) - JOB_TEMPLATE_FIELDS
        assert t["job_type"] in ("run", "check")
        assert os.path.exists(os.path.join(REPO, t["playbook"])), t["playbook"]
        spec = t["survey_spec"]
        assert spec["name"] and "description" in spec and spec["spec"]
        seen = set()
        for q in spec["spec"]:
            assert {"question_name", "variable", "type", "required"} <= set(q), q
            assert q["type"] in SURVEY_TYPES, q
            assert q["variable"] not in seen
            seen.add(q["variable"])
            if q["type"] == "multiplechoice":
                assert q["choices"] and q.get("default", q["choices"][0]) in q["choices"], q
            if q["type"] == "integer" and "default" in q:
                assert isinstance(q["default"], int) and q.get("min", q["default"]) <= q["default"] <= q.get("max", q["default"])
        if t["playbook"] in ("playbooks/migrate.yml", "playbooks/recover.yml"):
            assert seen <= set(migrate_options), seen - set(migrate_options)
    assert doc["controller_execution_environments"][0]["name"] == templates[0]["execution_environment"]
