"""The protect role's fence check on a timer of its own (issue 43, "What to build": shrink the two-copies window of a
partition): per job, gpuckpt-fence-<job>.service runs ``gpuckpt-protect fence-check`` (no checkpoint) and
gpuckpt-fence-<job>.timer starts it every gpuckpt_protect_fence_interval seconds (30 by default); the role installs
both with the job's checkpoint units and removes them with the job (state=absent).

The units are rendered from the role's templates and checked by ``systemd-analyze verify`` where it is installed; the
window itself is measured on loopback hosts in tests/integration/test_failover_more.py.
"""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess

import jinja2
import pytest
import yaml

from helpers import REPO

ROLE = os.path.join(REPO, "roles", "protect")


def _render(name, **values):
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(ROLE, "templates")),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template(name).render(**values)


def _units(tmp_path, job="train-7", interval=30):
    values = {"protect_job": {"name": job}, "protect_bin": shutil.which("true") or "/bin/true",
              "protect_dir": "/etc/gpuckpt/protect", "protect_fence_interval": interval}
    out = {}
    for kind in ("service", "timer"):
        path = tmp_path / ("gpuckpt-fence-%s.%s" % (job, kind))
        path.write_text(_render("gpuckpt-fence.%s.j2" % kind, **values))
        parser = configparser.RawConfigParser(strict=False)
        parser.optionxform = str
        parser.read_string(path.read_text())
        out[kind] = (path, parser)
    return out


def test_the_fence_units_run_the_fence_check_of_the_job_every_interval(tmp_path):
    units = _units(tmp_path, interval=30)
    service = units["service"][1]
    assert service["Service"]["Type"] == "oneshot"
    assert service["Service"]["ExecStart"].split()[1:] == ["fence-check", "--protect-dir", "/etc/gpuckpt/protect",
                                                           "--job", "train-7"]
    # fenced (exit 3): the timer goes with the copy it stopped
    assert '"$$EXIT_STATUS" = 3' in service["Service"]["ExecStopPost"]
    assert "systemctl disable --now --no-block gpuckpt-fence-train-7.timer" in service["Service"]["ExecStopPost"]
    timer = units["timer"][1]
    assert timer["Timer"]["OnUnitActiveSec"] == "30s" and timer["Timer"]["OnActiveSec"] == "30s"
    assert timer["Install"]["WantedBy"] == "timers.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
def test_systemd_accepts_the_fence_units(tmp_path):
    units = _units(tmp_path, interval=7)
    res = subprocess.run(["systemd-analyze", "verify", str(units["service"][0]), str(units["timer"][0])],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
    assert res.returncode == 0 and "gpuckpt-fence" not in res.stdout, res.stdout


def _tasks(name):
    with open(os.path.join(ROLE, "tasks", name)) as fh:
        return yaml.safe_load(fh)


def _walk(tasks):
    for t in tasks:
        yield t
        for key in ("block", "rescue", "always"):
            yield from _walk(t.get(key) or [])


def test_the_role_installs_the_fence_timer_with_the_job_and_removes_it_with_the_job():
    installed = list(_walk(_tasks("timer.yml")))
    templates = [t for t in installed if "ansible.builtin.template" in t]
    fence = [t for t in templates if "gpuckpt-fence-" in t["ansible.builtin.template"]["dest"]]
    assert fence and {i["src"] for i in fence[0]["loop"]} == {"gpuckpt-fence.service.j2", "gpuckpt-fence.timer.j2"}
    started = [t["ansible.builtin.systemd_service"] for t in installed if "ansible.builtin.systemd_service" in t]
    assert any(s["name"] == "gpuckpt-fence-{{ protect_job.name }}.timer" and s.get("enabled") is True for s in started)

    removed = list(_walk(_tasks("absent.yml")))
    stopped = [t for t in removed if "ansible.builtin.systemd_service" in t]
    assert "gpuckpt-fence-{{ protect_job.name }}.timer" in stopped[0]["loop"]
    files = [t for t in removed if "ansible.builtin.file" in t and "loop" in t]
    units = {"gpuckpt-fence-{{ protect_job.name }}.timer", "gpuckpt-fence-{{ protect_job.name }}.service"}
    assert units <= set(files[0]["loop"])


def test_the_fence_interval_is_an_option_of_the_role_30_s_by_default():
    with open(os.path.join(ROLE, "meta", "argument_specs.yml")) as fh:
        spec = yaml.safe_load(fh)["argument_specs"]["main"]["options"]["gpuckpt_protect_fence_interval"]
    assert spec["type"] == "int" and spec["default"] == 30
    with open(os.path.join(ROLE, "defaults", "main.yml")) as fh:
        defaults = yaml.safe_load(fh)
    assert defaults["protect_fence_interval"] == "{{ gpuckpt_protect_fence_interval | default(30) }}"
