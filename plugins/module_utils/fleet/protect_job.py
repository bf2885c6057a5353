# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A protected job's config on its node, its replicas as the transfer reaches them, and its workload as the engine
takes it (see protect.py). Job J is configured in ``<protect_dir>/J.json``, written by the role gpuckpt.fleet.protect
(0600): {"job", "node", "pid_file" | "container" + "runtime" | "pod" + "namespace", "interval_s", "keep", "epoch",
"replicas": [{"name", "host", "port", "user", "ssh_args", "python", "become", "root"}], "image_root", "journal_dir",
"progress_file", "progress_key", "environment", "checkpoint" (the engine's and the runtime's options),
"sign_key_file"}."""
from __future__ import annotations

import os
import re
import stat

from ..transfer import targets, transfer
from ..core.errors import InvalidTarget
from ..core.fsutil import make_dirs_private, read_json
from ..runtimes import registry
from . import protect_history as hist

JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
DEFAULT_PROTECT_DIR = "/etc/gpuckpt/protect"


def timer_unit(job):
    return "gpuckpt-protect-%s.timer" % job


# -- configuration --------------------------------------------------------------------------------------------

def job_names(protect_dir):
    """The jobs configured in ``protect_dir`` (``<job>.json``), sorted; none when it does not exist."""
    try:
        names = os.listdir(protect_dir)
    except OSError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and JOB_RE.match(n[:-5]))


def _check_private(path):
    """A config tells the runner what to run as root and where to send the job's memory: only root (or we)
    may have written it."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise InvalidTarget("%s must be a regular file of root's that nobody else can write (mode %o, uid %d)"
                            % (path, stat.S_IMODE(st.st_mode), st.st_uid), stage="preflight")


def _check_replicas(cfg, where):
    reps = cfg.get("replicas")
    if not isinstance(reps, list) or not reps:
        raise InvalidTarget("%s names no replica: a job's checkpoints are kept off its node" % where, stage="preflight")
    for rep in reps:
        if not isinstance(rep, dict) or not rep.get("name") or not rep.get("host") or not rep.get("root"):
            raise InvalidTarget("%s: each replica needs name, host and root, got %r" % (where, rep), stage="preflight")
        if rep["name"] == cfg.get("node"):
            raise InvalidTarget("%s names the node %s itself as a replica: its checkpoints must leave it"
                                % (where, rep["name"]), stage="preflight")


def load_config(protect_dir, job):
    """Job ``job``'s config, checked. Raises InvalidTarget."""
    if not JOB_RE.match(str(job or "")):
        raise InvalidTarget("job name %r must be 1-64 letters, digits, '.', '_' or '-'" % (job,), stage="preflight")
    path = os.path.join(protect_dir, job + ".json")
    try:
        _check_private(path)
    except FileNotFoundError:
        raise InvalidTarget("job %s is not protected on this node (no %s)" % (job, path), stage="preflight")
    cfg = read_json(path)
    if not isinstance(cfg, dict) or cfg.get("job") != job:
        raise InvalidTarget("%s is not the config of job %s" % (path, job), stage="preflight")
    kinds = [k for k in ("pid_file", "container", "pod") if cfg.get(k)]
    if len(kinds) != 1:
        raise InvalidTarget("%s must name exactly one of pid_file, container, pod (it names %s)"
                            % (path, ", ".join(kinds) or "none"), stage="preflight")
    if cfg.get("container") and not cfg.get("runtime"):
        raise InvalidTarget("%s names container %s without its runtime" % (path, cfg["container"]), stage="preflight")
    _check_replicas(cfg, path)
    for key in ("node", "image_root"):
        if not cfg.get(key):
            raise InvalidTarget("%s lacks %s" % (path, key), stage="preflight")
    cfg["epoch"] = int(cfg.get("epoch") or 1)
    cfg["keep"] = max(1, int(cfg.get("keep") or 3))
    return cfg


def state_folder(protect_dir, job):
    folder = hist.state_dir(protect_dir, job)
    make_dirs_private(folder)
    return folder


def apply_environment(cfg):
    """The job's environment (say GPUCKPT_LIBCUDA for the driver's test double) into this process, before the
    engine loads the driver."""
    for key, value in (cfg.get("environment") or {}).items():
        os.environ[str(key)] = str(value)


# -- replicas ---------------------------------------------------------------------------------------------------

def replica_target(rep, io_timeout=None):
    become = rep.get("become")
    if isinstance(become, str):  # (a config templated by an older Ansible carries "False" as a string)
        become = become.strip().lower() in ("true", "yes", "on", "1")
    return targets.Target(rep["host"], rep.get("user") or "root", int(rep.get("port") or 22), rep.get("ssh_args") or [],
                          rep.get("python") or "python3", int(io_timeout or rep.get("io_timeout") or 120),
                          become=bool(become))


def replica_ref(cfg, rep):
    """What a replica checks a push and a call of this node's against: the job, its epoch, this node."""
    return {"root": rep["root"], "job": cfg["job"], "epoch": cfg["epoch"], "node": cfg["node"]}


def replica_dest(rep, job, image_id):
    return os.path.join(rep["root"], job, image_id)


def replica_call(target, config, timeout=60):
    """transfer/transfer's replica_call (one JSON request to the replica's receiver, one reply)."""
    return transfer.replica_call(target, config, timeout=timeout)


def read_pid(pid_file):
    try:
        with open(pid_file) as fh:
            return int(fh.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def target_and_backend(cfg):
    """The engine's target and runtime backend of the job."""
    params = dict(cfg.get("checkpoint") or {})
    if cfg.get("pid_file"):
        pid = read_pid(cfg["pid_file"])
        if pid is None:
            raise InvalidTarget("pid file %s names no process: job %s is not running here" % (cfg["pid_file"], cfg["job"]),
                                stage="preflight")
        return pid, registry.make("process", params)
    if cfg.get("pod"):
        return "%s/%s" % (cfg.get("namespace") or "default", cfg["pod"]), registry.make("k8s_pod", params)
    return cfg["container"], registry.make(cfg["runtime"], params)
