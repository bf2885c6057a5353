"""attach (plugin_utils/progress_display.py): waiting for a module's async job gives its result once it has
one, and a job killed as a whole is reported lost instead of being waited for for ever.

TEST DOUBLE: the managed host is a dict of files answered by ``cat``; the job's module is "alive" while the
test says so."""
from __future__ import annotations

import json
import types

import pytest

from ansible_collections.gpuckpt.fleet.plugins.plugin_utils import progress_display

JOB = "j123.45"


class FakeHost(object):
    """What _attach runs on the host, answered from ``files`` (path -> text); ``module_alive`` for /proc."""

    def __init__(self):
        self.files, self.module_alive, self.commands = {}, True, []

    def run(self, cmd, sudoable=True):
        self.commands.append(cmd)
        if cmd.startswith("rm -f "):
            self.files.pop(cmd.split()[-1].strip("'"), None)
            return {"stdout": ""}
        path = cmd.split()[1].strip("'")
        if path.startswith("/proc/"):
            alive = "4242 (python3) S " + " ".join(["0"] * 18) + " 777"
            return {"stdout": alive if self.module_alive else ""}
        if path in self.files:
            return {"stdout": self.files[path]}
        return {"stdout": "MISSING" if "MISSING" in cmd else ""}


@pytest.fixture
def action(monkeypatch):
    host = FakeHost()
    act = object.__new__(progress_display.ProgressActionBase)
    act._low_level_execute_command = host.run
    act._remote_expand_user = lambda path: path.replace("~", "/root")
    act.get_shell_option = lambda name, default=None: default
    act._connection = types.SimpleNamespace(_shell=types.SimpleNamespace(join_path=lambda *p: "/".join(p)))
    act._task = types.SimpleNamespace(delegate_to=None, get_name=lambda: "gpu_restore")
    monkeypatch.setattr(progress_display.time, "sleep", lambda s: None)
    monkeypatch.setattr(progress_display, "RESULT_GRACE", 0.05)
    return act, host


def test_the_jobs_result_is_returned_and_its_file_removed(action):
    act, host = action
    job_file = "/root/.ansible_async/" + JOB
    host.files[job_file] = json.dumps({"changed": True, "cuda_pids": [4242], "_ansible_suppress_tmpdir_delete": True})
    res = act._attach(JOB, None, 0, {"inventory_hostname": "hostb"})
    assert res == {"changed": True, "cuda_pids": [4242]}
    assert job_file not in host.files


def test_a_job_without_a_result_file_is_no_job(action):
    act, host = action
    res = act._attach(JOB, None, 0, {"inventory_hostname": "hostb"})
    assert res["failed"] and "no job %s" % JOB in res["msg"]


def test_a_job_whose_module_is_gone_without_a_result_is_lost(action, monkeypatch):
    act, host = action
    host.files["/root/.ansible_async/" + JOB] = json.dumps({"started": 1, "finished": 0})
    host.files["/tmp/p.json"] = json.dumps({"pid": 4242, "starttime": 777})
    host.module_alive = False
    clock = iter(range(0, 10000, 3))
    monkeypatch.setattr(progress_display.time, "monotonic", lambda: float(next(clock)))
    res = act._attach(JOB, "/tmp/p.json", 0, {"inventory_hostname": "hostb"})
    assert res["failed"] and res["job_lost"] and "pid 4242" in res["msg"]


def test_a_result_written_just_after_the_module_ended_is_not_taken_for_a_lost_job(action, monkeypatch):
    """The async wrapper writes the result a moment after its module has exited."""
    act, host = action
    job_file = "/root/.ansible_async/" + JOB
    host.files[job_file] = json.dumps({"started": 1, "finished": 0})
    host.files["/tmp/p.json"] = json.dumps({"pid": 4242, "starttime": 777})
    host.module_alive = False
    real_run = host.run

    def run(cmd, sudoable=True):
        out = real_run(cmd, sudoable)
        if cmd.startswith("cat /proc/"):  # asked whether the module is gone: its result lands right after
            host.files[job_file] = json.dumps({"changed": True, "resumed_at": 1.5})
        return out

    act._low_level_execute_command = run
    clock = iter(range(10000))
    monkeypatch.setattr(progress_display.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(progress_display, "RESULT_GRACE", 5)
    res = act._attach(JOB, "/tmp/p.json", 0, {"inventory_hostname": "hostb"})
    assert res == {"changed": True, "resumed_at": 1.5}
