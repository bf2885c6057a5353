"""The Podman runtime (runtimes/podman.py) and what it decides around Podman's own commands: the container it is
given must run, a stopped one cannot be held, the export is written where the image is and removed when the
checkpoint fails (CRIU's error lines kept), the container goes once its export is the image, and a restore never
starts a second copy. A TEST DOUBLE ``podman`` (a script given as podman_path) logs each command line and answers
as the test says; a real sleeping process is the container's init."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import CommandError, InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import podman

FAKE_PODMAN = r'''#!%(py)s
import json, os, sys
here = os.environ["FAKE_PODMAN"]
args = sys.argv[1:]
with open(os.path.join(here, "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(args) + "\n")
rest = list(args)
while rest and rest[0] in ("--root", "--runroot"):
    rest = rest[2:]
key = rest[0] if rest[0] != "container" else "container " + rest[1]
if "--export" in rest:  # what Podman writes before CRIU's part can fail
    open(rest[rest.index("--export") + 1], "w").write("export")
with open(os.path.join(here, "answers.json")) as fh:
    answers = json.load(fh).get(key) or [{}]
count_file = os.path.join(here, "count." + key.replace(" ", "_"))
n = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(n + 1))
answer = answers[min(n, len(answers) - 1)]
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("rc", 0))
'''


class FakePodman(object):
    """The TEST DOUBLE's answers (``answer(key, ...)``, in the order asked) and the command lines it was given."""

    def __init__(self, path):
        self.dir = path
        self.path = str(path / "podman")
        self.answers = {}
        with open(self.path, "w") as fh:
            fh.write(FAKE_PODMAN % {"py": sys.executable})
        os.chmod(self.path, os.stat(self.path).st_mode | stat.S_IEXEC)

    def answer(self, key, *answers):
        self.answers[key] = list(answers)
        (self.dir / "answers.json").write_text(json.dumps(self.answers))

    def calls(self):
        log = self.dir / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def fake_podman(tmp_path, monkeypatch):
    here = tmp_path / "podman-double"
    here.mkdir()
    monkeypatch.setenv("FAKE_PODMAN", str(here))
    fake = FakePodman(here)
    fake.answer("--version", {"stdout": "podman version 4.3.1\n"})
    return fake


@pytest.fixture
def init():
    """The container's init: a real sleeping process."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield p.pid
    p.kill()
    p.wait()


def inspected(pid, status="running", name="train"):
    return {"stdout": json.dumps([{"Name": name, "Id": "c0ffee" * 10, "State": {"Status": status, "Pid": pid}}])}


NO_SUCH = {"rc": 125, "stderr": "Error: no such container train\n"}


def _image_dir(tmp_path):
    image_dir = tmp_path / "img"
    image_dir.mkdir()
    with tarfile.open(str(image_dir / podman.EXPORT), "w") as tar:  # an export without a spec: imported as it is
        info = tarfile.TarInfo("checkpoint/inventory.img")
        tar.addfile(info)
    return str(image_dir)


def test_a_running_container_is_resolved_to_its_init_and_tree(fake_podman, init):
    fake_podman.answer("container inspect", inspected(init))
    backend = podman.PodmanBackend(podman_path=fake_podman.path, root="/srv/podman")
    assert backend.resolve("train") == (init, [init])
    assert fake_podman.calls() == [["--root", "/srv/podman", "container", "inspect", "--format", "json", "train"]]


@pytest.mark.parametrize("answer, says", [
    ("exited", "podman container train is exited, not running; nothing was frozen"),
    (None, "no podman container 'train': Error: no such container train"),
])
def test_a_container_that_does_not_run_is_refused(fake_podman, init, answer, says):
    fake_podman.answer("container inspect", inspected(init, status=answer) if answer else NO_SUCH)
    with pytest.raises(InvalidTarget, match=says):
        podman.PodmanBackend(podman_path=fake_podman.path).resolve("train")


def test_a_container_cannot_be_held_stopped_and_podman_is_not_asked(fake_podman, init, tmp_path):
    fake_podman.answer("container inspect", inspected(init))
    backend = podman.PodmanBackend(podman_path=fake_podman.path)
    backend.resolve("train")
    with pytest.raises(InvalidTarget, match="podman cannot hold a container stopped"):
        backend.dump(init, str(tmp_path), str(tmp_path), "stopped")
    assert [c[1] for c in fake_podman.calls()] == ["inspect"]


@pytest.mark.parametrize("after", ["exit", "running"])
def test_the_export_is_written_into_the_image_and_the_container_goes_only_when_it_exits(
        fake_podman, init, tmp_path, after):
    fake_podman.answer("container inspect", inspected(init))
    backend = podman.PodmanBackend(podman_path=fake_podman.path, criu_options=["--tcp-established"])
    backend.resolve("train")
    out = backend.dump(init, str(tmp_path), str(tmp_path), after)
    export = str(tmp_path / podman.EXPORT)
    checkpoint = ["container", "checkpoint", "--export", export, "--compress", "none"] + (
        ["--leave-running"] if after == "running" else []) + ["--tcp-established", "train"]
    removed = [["container", "rm", "--force", "train"]] if after == "exit" else []
    assert fake_podman.calls()[1:] == [checkpoint] + removed
    assert out["container"] == "train" and out["export"] == podman.EXPORT and out["root_pid"] == init
    assert out["ns_pids"] == {str(init): init} and out["podman_root"] is None
    assert "gpus" not in out, "no spec read: its GPUs are unknown, not none"


def test_a_failed_checkpoint_removes_its_partial_export_and_keeps_crius_errors(fake_podman, init, tmp_path):
    criu_log = tmp_path / "dump.log"
    criu_log.write_text("(00.1) Dumping tree\n(00.2) Error (criu/mount.c:1): mnt: ./dev/shm has unreachable sharing\n")
    fake_podman.answer("container inspect", inspected(init))
    fake_podman.answer("container checkpoint", {"rc": 125, "stderr": "Error: criu failed: log file: %s\n" % criu_log})
    backend = podman.PodmanBackend(podman_path=fake_podman.path)
    backend.resolve("train")
    with pytest.raises(CommandError, match="podman container checkpoint exited with rc=125") as err:
        backend.dump(init, str(tmp_path), str(tmp_path), "exit")
    assert "unreachable sharing" in err.value.stderr and "Dumping tree" not in err.value.stderr
    assert not os.path.exists(str(tmp_path / podman.EXPORT)), "the partial export was removed"
    assert [c[1] for c in fake_podman.calls()] == ["inspect", "checkpoint"], "the container was not removed"


def test_a_restore_never_starts_a_second_copy(fake_podman, init, tmp_path):
    fake_podman.answer("container inspect", inspected(init))
    backend = podman.PodmanBackend(podman_path=fake_podman.path)
    manifest = {"runtime": {"container": "train", "auto_flags": []}, "target": {"cuda_pids": []}}
    with pytest.raises(InvalidTarget, match="a podman container train already exists on this host"):
        backend.restore(_image_dir(tmp_path), str(tmp_path), manifest)
    assert [c[1] for c in fake_podman.calls()] == ["inspect"], "podman's restore was never asked"


def test_a_restore_imports_the_export_under_the_storage_the_image_names(fake_podman, init, tmp_path):
    fake_podman.answer("container inspect", NO_SUCH, inspected(init))
    backend = podman.PodmanBackend(podman_path=fake_podman.path)
    image_dir = _image_dir(tmp_path)
    manifest = {"runtime": {"container": "train", "podman_root": "/srv/podman", "auto_flags": ["--file-locks"]},
                "target": {"cuda_pids": []}}
    assert backend.restore(image_dir, str(tmp_path), manifest) == [init]
    root = ["--root", "/srv/podman"]
    assert fake_podman.calls() == [
        root + ["container", "inspect", "--format", "json", "train"],
        root + ["container", "restore", "--import", os.path.join(image_dir, podman.EXPORT), "--file-locks"],
        root + ["container", "inspect", "--format", "json", "train"]]


def test_a_failed_restore_says_podmans_exit_status(fake_podman, tmp_path):
    fake_podman.answer("container inspect", NO_SUCH)
    fake_podman.answer("container restore", {"rc": 125, "stderr": "Error: restoring failed\n"})
    backend = podman.PodmanBackend(podman_path=fake_podman.path)
    with pytest.raises(CommandError, match="podman container restore exited with rc=125"):
        backend.restore(_image_dir(tmp_path), str(tmp_path), {"runtime": {"container": "train"}})


def test_the_running_containers_and_the_version_are_read_from_podman(fake_podman):
    fake_podman.answer("ps", {"stdout": json.dumps([{"Names": ["train"], "Id": "a1", "Pid": 4242, "State": "running"},
                                                    {"Names": ["made"], "Id": "b2", "Pid": 0, "State": "created"}])})
    backend = podman.PodmanBackend(podman_path=fake_podman.path, runroot="/run/podman-test")
    assert backend.running_containers() == [{"id": "train", "pid": 4242, "status": "running"}]
    assert backend.runtime_facts() == {"podman_version": "4.3.1"}
    assert fake_podman.calls()[0][:2] == ["--runroot", "/run/podman-test"]
