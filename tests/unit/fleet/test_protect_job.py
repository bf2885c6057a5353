"""A protected job's config on its node (fleet/protect_job.py): which files are jobs, what a config must say and
who may have written it (it tells a root runner what to run and where to send the job's memory), its replicas as
the transfer reaches them, and its workload as the engine takes it. Configs are written in a tmp dir; the runtime
registry is a TEST DOUBLE that records what it is asked to build."""
from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget
from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import protect_job

REPLICA = {"name": "node-b", "host": "10.0.0.2", "root": "/var/lib/gpuckpt/replicas"}


def config(**changes):
    cfg = {"job": "train", "node": "node-a", "pid_file": "/run/train.pid", "image_root": "/var/lib/gpuckpt/images",
           "replicas": [dict(REPLICA)]}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def write(protect_dir, cfg, name=None, mode=0o600):
    path = os.path.join(str(protect_dir), (name or cfg.get("job") or "train") + ".json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    os.chmod(path, mode)
    return path


def test_the_jobs_are_the_configs_with_a_job_name(tmp_path):
    for name in ("b-job", "a.job", "-dash", "notes"):
        (tmp_path / (name + (".json" if name != "notes" else ".txt"))).write_text("{}")
    (tmp_path / "state").mkdir()
    assert protect_job.job_names(str(tmp_path)) == ["a.job", "b-job"]
    assert protect_job.job_names(str(tmp_path / "none")) == [], "no protect dir: no job"


def test_a_config_is_read_with_its_defaults(tmp_path):
    write(tmp_path, config())
    cfg = protect_job.load_config(str(tmp_path), "train")
    assert cfg["epoch"] == 1 and cfg["keep"] == 3
    write(tmp_path, config(keep=-2))
    assert protect_job.load_config(str(tmp_path), "train")["keep"] == 1, "at least one checkpoint is kept"
    write(tmp_path, config(epoch="4", keep="5"))
    cfg = protect_job.load_config(str(tmp_path), "train")
    assert (cfg["epoch"], cfg["keep"]) == (4, 5)


@pytest.mark.parametrize("job", ["../etc/passwd", "", None, "-x", "a" * 65])
def test_a_job_name_that_is_no_name_is_refused_before_any_file_is_read(tmp_path, job):
    with pytest.raises(InvalidTarget, match="job name .* must be 1-64 letters"):
        protect_job.load_config(str(tmp_path), job)


def test_a_job_that_is_not_configured_here_says_so(tmp_path):
    with pytest.raises(InvalidTarget, match="job train is not protected on this node"):
        protect_job.load_config(str(tmp_path), "train")


def test_a_config_others_can_write_or_a_link_is_refused(tmp_path):
    write(tmp_path, config(), mode=0o622)
    with pytest.raises(InvalidTarget, match="must be a regular file of root's that nobody else can write"):
        protect_job.load_config(str(tmp_path), "train")
    os.unlink(str(tmp_path / "train.json"))
    real = write(tmp_path, config(), name="elsewhere")
    os.symlink(real, str(tmp_path / "train.json"))
    with pytest.raises(InvalidTarget, match="must be a regular file"):
        protect_job.load_config(str(tmp_path), "train")


@pytest.mark.parametrize("cfg, says", [
    (config(job="other"), "is not the config of job train"),
    (config(pid_file=None), "must name exactly one of pid_file, container, pod (it names none)"),
    (config(container="c1", runtime="podman"), "it names pid_file, container"),
    (config(pid_file=None, container="c1"), "names container c1 without its runtime"),
    (config(replicas=[]), "names no replica: a job's checkpoints are kept off its node"),
    (config(replicas=[{"name": "node-b", "host": "10.0.0.2"}]), "each replica needs name, host and root"),
    (config(replicas=[dict(REPLICA, name="node-a")]), "names the node node-a itself as a replica"),
    (config(node=None), "lacks node"),
    (config(image_root=None), "lacks image_root"),
])
def test_a_config_that_says_too_little_or_too_much_is_refused(tmp_path, cfg, says):
    write(tmp_path, cfg, name="train")
    with pytest.raises(InvalidTarget) as err:
        protect_job.load_config(str(tmp_path), "train")
    assert says in err.value.msg and err.value.stage == "preflight"


def test_the_state_folder_is_made_private(tmp_path):
    folder = protect_job.state_folder(str(tmp_path), "train")
    assert folder == str(tmp_path / "state" / "train") and os.stat(folder).st_mode & 0o777 == 0o700


def test_a_replica_is_reached_as_the_config_says(tmp_path):
    rep = dict(REPLICA, user="gpuckpt", port="2222", ssh_args=["-o", "BatchMode=yes"], python="/usr/bin/python3",
               become="False", io_timeout=30)
    target = protect_job.replica_target(rep)
    assert (target.host, target.user, target.port, target.python, target.io_timeout) == (
        "10.0.0.2", "gpuckpt", 2222, "/usr/bin/python3", 30)
    assert target.ssh_args == ["-o", "BatchMode=yes"]
    assert target.become is False, "an older Ansible's templated 'False' is false"
    assert protect_job.replica_target(dict(rep, become="yes")).become is True
    assert protect_job.replica_target(rep, io_timeout=5).io_timeout == 5, "the caller's timeout wins"
    plain = protect_job.replica_target(REPLICA)
    assert (plain.user, plain.port, plain.python, plain.io_timeout, plain.become) == ("root", 22, "python3", 120, False)


def test_a_replica_checks_the_job_its_epoch_and_this_node():
    cfg = config(epoch=3)
    expected = {"root": REPLICA["root"], "job": "train", "epoch": 3, "node": "node-a"}
    assert protect_job.replica_ref(cfg, REPLICA) == expected
    assert protect_job.replica_dest(REPLICA, "train", "img-7") == os.path.join(REPLICA["root"], "train", "img-7")


def test_the_job_environment_reaches_this_process(monkeypatch):
    monkeypatch.delenv("GPUCKPT_LIBCUDA", raising=False)
    protect_job.apply_environment({"environment": {"GPUCKPT_LIBCUDA": "/opt/fake/libcuda.so.1"}})
    assert os.environ["GPUCKPT_LIBCUDA"] == "/opt/fake/libcuda.so.1"
    monkeypatch.delenv("GPUCKPT_LIBCUDA")
    protect_job.apply_environment({})


@pytest.mark.parametrize("content, pid", [("4242\n", 4242), ("4242 extra", 4242), ("", None), ("x", None)])
def test_a_pid_file_gives_its_pid_or_none(tmp_path, content, pid):
    (tmp_path / "job.pid").write_text(content)
    assert protect_job.read_pid(str(tmp_path / "job.pid")) == pid
    assert protect_job.read_pid(str(tmp_path / "missing.pid")) is None


@pytest.fixture
def built(monkeypatch):
    """The backends the runtime registry was asked to make: (runtime, params) each."""
    calls = []
    monkeypatch.setattr(protect_job.registry, "make", lambda name, params, bundle=None: calls.append((name, params)) or name)
    return calls


def test_the_workload_is_the_engines_target_on_its_runtime(tmp_path, built):
    (tmp_path / "job.pid").write_text("4242\n")
    options = {"checkpoint": {"tcp_established": True}}
    assert protect_job.target_and_backend(config(pid_file=str(tmp_path / "job.pid"), **options)) == (4242, "process")
    pod = config(pid_file=None, pod="trainer", namespace="ml")
    assert protect_job.target_and_backend(pod) == ("ml/trainer", "k8s_pod")
    assert protect_job.target_and_backend(config(pid_file=None, pod="trainer"))[0] == "default/trainer"
    assert protect_job.target_and_backend(config(pid_file=None, container="c1", runtime="podman")) == ("c1", "podman")
    assert built[0] == ("process", {"tcp_established": True})


def test_a_job_whose_pid_file_names_no_process_is_not_running_here(tmp_path, built):
    with pytest.raises(InvalidTarget, match="pid file .* names no process: job train is not running here"):
        protect_job.target_and_backend(config(pid_file=str(tmp_path / "missing.pid")))
    assert built == [], "no runtime was built"
