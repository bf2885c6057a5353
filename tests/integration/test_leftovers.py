"""Nothing left behind: after each runtime's checkpoint, restore and migration (one that rolls back
included), /tmp, /var/tmp, the runtime's own state dirs and the image root hold nothing new that the
result does not name. One small workload per runtime (the counting workload of each runtime's own
tests, with the libcuda TEST DOUBLE), reusing those tests' fixtures.

What a result names and is kept on purpose is left out of the comparison: a checkpoint's image (the
result's image_dir), and the journals (each migration's record). So is what a restored container owns
while it runs, named one by one (Docker: its network namespace, and CRIU's restore log and runc's restore
stats in its containerd task's dir; all go with the container). On a machine shared with other test
runs, GPUCKPT_LEFTOVERS_IGNORE (a regular expression) leaves their names in /tmp out too.

Docker's containerd unpacks each restore's checkpoint into a ``ctrd-checkpoint*`` directory of its temporary
directory and never removes it (runtimes/docker_cleanup.py does): every Docker test here also checks
each containerd's temporary directory, as that containerd sees it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time

import pytest

from helpers import SKELETON_IMAGE
from loopback_workloads import MIGRATE, migrate
# The runtimes' own fixtures and workloads (imported by name: their tests are not collected again here).
from test_containerd import (RemoteContainerdWorkload, _inventory_with_addresses, _migrate_vars,  # noqa: F401,F811
                             available as containerd_available, containerd, containerd_workload, loopback_containerds)
from test_docker import DOCKERD, dockerd, docker_workload  # noqa: F401,F811
from test_migrate import RemoteDockerWorkload, RemotePodmanWorkload, RemoteRuncWorkload
from test_podman import PODMAN, podman_workload  # noqa: F401,F811
from test_runc import RUNC, runc_workload  # noqa: F401,F811
from test_runsc import RUNSC, sandbox  # noqa: F401,F811

# pytest finds a fixture by its name in this module: these names are used, by pytest, as the tests' arguments.
FIXTURES = (containerd, containerd_workload, loopback_containerds, dockerd, docker_workload, podman_workload,
            runc_workload, sandbox)

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
IGNORED = re.compile(os.environ.get("GPUCKPT_LEFTOVERS_IGNORE") or r"^pytest-of-")
NOT_INTO = {"rootfs", "diff", "merged", "fs", "mnt", "work", "overlay", "overlay2", "volumes", "image",
            "layers"}  # a container's files and layers: what the workload writes, not the runtime's state
STORE_DIRS = {"blobs", "sha256", "ingest"}  # containerd's content store, made once on first use (its blobs are listed)


def listing(root, depth):
    """Every path below ``root``, ``depth`` levels deep, relative; a container's files are not walked."""
    out = set()

    def walk(d, rel, left):
        try:
            names = os.listdir(d)
        except OSError:
            return
        for n in names:
            r = os.path.join(rel, n) if rel else n
            out.add(r)
            p = os.path.join(d, n)
            if left > 1 and n not in NOT_INTO and os.path.isdir(p) and not os.path.islink(p):
                walk(p, r, left - 1)
    walk(root, "", depth)
    return _numbered_snapshots(out)


def _numbered_snapshots(paths):
    """containerd numbers each snapshot anew: a container created again (a restore) has the same snapshots under
    new numbers. Numbered by rank instead, so that only more snapshots than before shows."""
    ranks = {}
    for p in sorted(paths):
        head, name = os.path.split(p)
        if os.path.basename(head) == "snapshots" and name.isdigit():
            ranks[p] = os.path.join(head, "#%d" % len([q for q in ranks if os.path.dirname(q) == head]))
    out = set()
    for p in paths:
        for old, new in ranks.items():
            if p == old or p.startswith(old + "/"):
                p = new + p[len(old):]
                break
        out.add(p)
    return out


def _store_dir(path):
    """An empty directory of containerd's content store (blobs, blobs/sha256, ingest): its layout, made once
    on first use. (A checkpoint's content lives there until dockerd deletes it and containerd's GC runs.)"""
    if os.path.basename(path) not in STORE_DIRS or os.path.islink(path) or not os.path.isdir(path):
        return False
    return all(_store_dir(os.path.join(path, n)) for n in os.listdir(path))


class Watch(object):
    """The state dirs of one operation: ``leftovers()`` is what is new in them since it began. A dir is
    {name: (path, depth)}, or (path, depth, prefix) to watch only the names that begin with ``prefix``."""

    def __init__(self, dirs, kept=()):
        self.dirs = {name: (tuple(d) + ("",))[:3] for name, d in dict(dirs, tmp=("/tmp", 1), var_tmp=("/var/tmp", 1)).items()}
        self.kept = set(kept)
        self.before = {name: listing(path, depth) for name, (path, depth, unused) in self.dirs.items()}

    def leftovers(self, settle=0.0):
        """What is new; with ``settle``, asked again for up to that many seconds until nothing is (for
        what a runtime removes on its own shortly after: containerd's GC of a content blob)."""
        deadline = time.monotonic() + settle
        new = self._new()
        while new and time.monotonic() < deadline:
            time.sleep(0.5)
            new = self._new()
        return new

    def _new(self):
        new = {}
        for name, (path, depth, prefix) in self.dirs.items():
            added = sorted(p for p in listing(path, depth) - self.before[name]
                           if p.startswith(prefix) and not (name in ("tmp", "var_tmp") and IGNORED.search(p))
                           and os.path.join(path, p) not in self.kept and not _store_dir(os.path.join(path, p))
                           and not any(os.path.join(path, p).startswith(k + "/") for k in self.kept))
            if added:
                new[name] = added
        return new


def _checkpoint_restore(playbook, env, tmp_path, vars_for, dirs, owned=None, settle=0.0):
    """A checkpoint, then its restore, each watched: nothing new but the checkpoint's image (and, after the
    restore, what ``owned()`` names: what the restored container owns while it runs)."""
    images = str(tmp_path / "images")
    os.makedirs(images, exist_ok=True)
    image_dir = os.path.join(images, "img")
    dirs = dict(dirs, images=(images, 1))
    watch = Watch(dirs)
    run = playbook(CHECKPOINT, vars_for(image_dir), env=env)
    assert run.rc == 0, run.stdout
    kept = [t for t in run.results if t.get("image_dir")]
    assert kept and kept[0]["image_dir"] == image_dir  # the result names the image it keeps
    watch.kept.add(image_dir)
    assert watch.leftovers(settle) == {}
    run = playbook(RESTORE, vars_for(image_dir, restore=True), env=env)
    assert run.rc == 0, run.stdout
    # The same container runs again: its runtime's state is as it was before the checkpoint, no more.
    watch.kept.update(owned() if owned else ())
    assert watch.leftovers(settle) == {}


def _rolled_back(run, host="hosta"):
    assert run.rc != 0
    assert "rolled back; the workload runs on %s" % host in run.stdout, run.stdout[-3000:]
    resumed = run.task("Resume the source")
    removed = resumed["journal"].get("image_removed")
    assert removed and removed in resumed["msg"], resumed  # the result names the image it removed
    assert not os.path.exists(removed)
    return resumed


def _host_dirs(hosts, **extra):
    dirs = {"images_" + h: (hosts.path(h, "images"), 2) for h in ("hosta", "hostb")}
    dirs.update(extra)
    return dirs


# ---- bare processes -------------------------------------------------------------------------------
def test_a_process_leaves_nothing(tmp_path, playbook, workloads, fakecuda):
    w = workloads(fakecuda=fakecuda)

    def v(image_dir, restore=False):
        return {"gpuckpt_image_dir": image_dir} if restore else {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir}
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, {})


def test_a_process_migration_and_its_rollback_leave_nothing(playbook, hosts, remote_workload):
    w = remote_workload()
    watch = Watch(_host_dirs(hosts))
    inject = hosts.path("hostb", "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("restore 0 2\n")  # every CUDA restore on the target fails: the migration rolls back
    try:
        run = migrate(playbook, hosts, w, "t-left-fail")
    finally:
        os.unlink(inject)
    _rolled_back(run)
    assert w.one_copy_runs_intact()
    assert watch.leftovers() == {}
    run = migrate(playbook, hosts, w, "t-left")
    assert run.rc == 0, run.stdout
    assert w.one_copy_runs_intact()
    assert watch.leftovers() == {}


def test_a_kept_image_of_a_rollback_is_named(playbook, hosts, remote_workload):
    w = remote_workload()
    inject = hosts.path("hostb", "fakecuda", "inject")
    with open(inject, "w") as fh:
        fh.write("restore 0 2\n")
    try:
        run = migrate(playbook, hosts, w, "t-left-keep", gpuckpt_keep_failed_image=True)
    finally:
        os.unlink(inject)
    assert run.rc != 0
    resumed = run.task("Resume the source")
    kept = resumed["journal"].get("image_kept")
    assert kept == hosts.path("hosta", "images", "t-left-keep") and os.path.isdir(kept), resumed
    assert kept in resumed["msg"]
    assert w.one_copy_runs_intact()


# ---- runc ---------------------------------------------------------------------------------------
@pytest.mark.skipif(RUNC is None, reason="runc is not installed")
def test_a_runc_container_leaves_nothing(tmp_path, playbook, runc_workload, fakecuda):  # noqa: F811 (the fixture imported above)
    w = runc_workload()

    def v(image_dir, restore=False):
        out = {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root}
        return out if restore else dict(out, gpuckpt_container=w.id)
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, {"runc_root": (w.root, 2)})


@pytest.mark.skipif(RUNC is None, reason="runc is not installed")
def test_a_runc_container_left_running_leaves_nothing(tmp_path, playbook, runc_workload, fakecuda):  # noqa: F811 (the fixture imported above)
    """runc marks each dump with an empty file ``checkpoint`` in the container's state dir, removed only by a
    restore: a container that runs on after its checkpoint would keep it."""
    w = runc_workload()
    images = str(tmp_path / "images")
    os.makedirs(images)
    image_dir = os.path.join(images, "img")
    watch = Watch({"runc_root": (w.root, 2), "images": (images, 1)}, kept=[image_dir])
    run = playbook(CHECKPOINT, {"gpuckpt_image_dir": image_dir, "gpuckpt_runc_root": w.root,
                                "gpuckpt_container": w.id, "gpuckpt_leave_running": True}, env=fakecuda.env)
    assert run.rc == 0, run.stdout
    assert w.is_counting()
    assert watch.leftovers() == {}


@pytest.mark.skipif(RUNC is None, reason="runc is not installed")
def test_a_runc_rollback_leaves_nothing(playbook, hosts, tmp_path):
    w = RemoteRuncWorkload(hosts, str(tmp_path / "rw"))
    try:
        watch = Watch(_host_dirs(hosts, **{"runc_root_" + h: (hosts.host_vars[h]["gpuckpt_runc_root"], 2)
                                           for h in ("hosta", "hostb")}))
        os.rename(hosts.path("hostb", "bundle", "config.json"), hosts.path("hostb", "bundle", "config.off"))
        try:
            run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.id,
                                     "migration_id": "t-left-runc"}, inventory=hosts.path("inventory.yml"))
        finally:
            os.rename(hosts.path("hostb", "bundle", "config.off"), hosts.path("hostb", "bundle", "config.json"))
        _rolled_back(run)
        assert w.is_counting()
        assert watch.leftovers() == {}
    finally:
        w.cleanup()


# ---- containerd ---------------------------------------------------------------------------------
# seconds: a snapshot removed through containerd's API (the checkpointed container's, before its restore prepares the
# same key again; a rolled-back target's) leaves its directory until containerd's GC runs, which its scheduler puts
# off by its pause threshold after the last collection (seconds on a loaded machine: seen in a full run)
CONTAINERD_SETTLE = 10.0


@pytest.mark.skipif(not containerd_available(), reason="containerd 2.x and python3-grpcio needed")
def test_a_containerd_task_leaves_nothing(tmp_path, playbook, containerd_workload, fakecuda, containerd):  # noqa: F811 (the fixture imported above)
    w = containerd_workload()

    def v(image_dir, restore=False):
        return w.vars(image_dir)
    dirs = {"containerd_root": (os.path.join(containerd.dir, "root"), 4),
            "containerd_state": (os.path.join(containerd.dir, "state"), 4), "runc_root": (w.runc_root, 3)}
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, dirs, settle=CONTAINERD_SETTLE)


@pytest.mark.skipif(not containerd_available(), reason="containerd 2.x and python3-grpcio needed")
def test_a_containerd_rollback_leaves_nothing(playbook, hosts, loopback_containerds, tmp_path):  # noqa: F811 (the fixture imported above)
    w = RemoteContainerdWorkload(hosts, str(tmp_path / "cw"))
    try:
        inventory = _inventory_with_addresses(hosts, w)
        dirs = {}
        for h, d in w.daemons.items():
            dirs.update({"containerd_root_" + h: (os.path.join(d.dir, "root"), 4),
                         "containerd_state_" + h: (os.path.join(d.dir, "state"), 4)})
        w.daemons["hostb"].ctr("images", "rm", "--sync", "localhost/gpuckpt-skel:1", namespace=w.namespace)
        watch = Watch(_host_dirs(hosts, **dirs))
        run = playbook(MIGRATE, _migrate_vars(w, "t-left-ctrd"), inventory=inventory)
        _rolled_back(run)
        assert w.status("hosta") == "RUNNING"
        assert watch.leftovers(CONTAINERD_SETTLE) == {}
    finally:
        w.cleanup()
        for d in w.daemons.values():  # hostb's image again, for the tests after this one
            d.import_skeleton(w.namespace)


# ---- Docker -------------------------------------------------------------------------------------
DOCKER_SETTLE = 10.0  # seconds: dockerd deletes a checkpoint's content blob, containerd's GC removes it soon after
CONTAINERD_COPY_PREFIX = "ctrd-checkpoint"  # containerd's copy of a checkpoint handed to it, in its temp dir


def _docker_dirs(base, prefix=""):
    return {prefix + "docker_data": (os.path.join(base, "data"), 7),
            prefix + "docker_exec": (os.path.join(base, "exec"), 7)}


def _containerd_temp_dirs(docker_dir, prefix=""):
    """{name: (dir, 1, the copies' prefix)}: the temporary directory of the containerd that the dockerd under ``docker_dir`` runs
    (Go's os.MkdirTemp: its XDG_RUNTIME_DIR, else TMPDIR, else /tmp), seen through that containerd's root."""
    out = {}
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open("/proc/%s/comm" % pid) as fh:
                comm = fh.read().strip()
            with open("/proc/%s/cmdline" % pid, "rb") as fh:
                argv = fh.read().decode("utf-8", "replace").split("\0")
            with open("/proc/%s/environ" % pid, "rb") as fh:
                env = dict(kv.partition("=")[::2] for kv in fh.read().decode("utf-8", "replace").split("\0") if kv)
        except OSError:
            continue
        if comm == "containerd" and any(a.startswith(docker_dir.rstrip("/") + "/") for a in argv):
            where = env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"
            out[prefix + "containerd_tmp_" + pid] = ("/proc/%s/root/%s" % (pid, where.lstrip("/")), 1, CONTAINERD_COPY_PREFIX)
    assert out, "no containerd of the dockerd under %s runs" % docker_dir
    return out


def _docker_owned(inspect, docker_dir):
    """What a running Docker container owns in its dockerd's dirs, all gone with it: its network namespace
    (its SandboxKey: libnetwork removes the one of the container checkpointed within a minute), and in its
    containerd task's dir the restore's CRIU log and runc's stats (removed with the task)."""
    info = json.loads(inspect)[0]
    tasks = os.path.join(docker_dir, "data", "containerd", "daemon", "io.containerd.runtime.v2.task")
    out = [info["NetworkSettings"]["SandboxKey"]]
    for ns in os.listdir(tasks):
        task = os.path.join(tasks, ns, info["Id"])
        if os.path.isdir(task):
            out += [os.path.join(task, "restore.log"), os.path.join(task, "stats-restore")]
    return out


@pytest.mark.skipif(DOCKERD is None, reason="dockerd is not installed")
def test_a_docker_container_leaves_nothing(tmp_path, playbook, docker_workload, fakecuda):  # noqa: F811 (the fixture imported above)
    w = docker_workload()

    def v(image_dir, restore=False):
        out = {"gpuckpt_image_dir": image_dir, "gpuckpt_docker_host": w.host}
        return out if restore else dict(out, gpuckpt_container=w.name, gpuckpt_runtime="docker")
    base = os.path.dirname(w.host[len("unix://"):])
    dirs = dict(_docker_dirs(base), **_containerd_temp_dirs(base))
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, dirs, settle=DOCKER_SETTLE,
                        owned=lambda: _docker_owned(w.docker("container", "inspect", w.name).stdout, base))


def _fake_copy(where, maker):
    """A containerd copy of a Docker restore's checkpoint as it looks when its restore never removed it (its
    module killed): a ``ctrd-checkpoint*`` dir of root's holding a restore id that names its maker."""
    path = tempfile.mkdtemp(prefix=CONTAINERD_COPY_PREFIX, dir=where)
    with open(os.path.join(path, "gpuckpt-restore-id"), "w") as fh:
        fh.write(maker + "\n")
    return path


def _maker(pid, starttime, boot=None):
    with open("/proc/sys/kernel/random/boot_id") as fh:
        this_boot = fh.read().strip()
    return "%s %s %s %d %d" % ("0" * 32, boot or this_boot, os.readlink("/proc/self/ns/pid"), pid, starttime)


def _starttime(pid):
    with open("/proc/%d/stat" % pid) as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[19])


@pytest.mark.skipif(DOCKERD is None, reason="dockerd is not installed")
def test_a_docker_restore_removes_the_copies_of_restores_cut_off(tmp_path, playbook, docker_workload, fakecuda):  # noqa: F811
    """A restore killed before it removed containerd's copy leaves it: the next Docker restore on that host
    removes it, once the process that made it is gone (another boot's too); a copy whose maker still runs
    (a restore going on) is left alone."""
    w = docker_workload()
    base = os.path.dirname(w.host[len("unix://"):])
    where = sorted(_containerd_temp_dirs(base).values())[0][0]
    done = subprocess.Popen(["true"])
    started = _starttime(done.pid)
    done.wait()
    gone = [_fake_copy(where, _maker(done.pid, started)),
            _fake_copy(where, _maker(os.getpid(), _starttime(os.getpid()), boot="00000000-0000-0000-0000-000000000000"))]
    going_on = _fake_copy(where, _maker(os.getpid(), _starttime(os.getpid())))
    try:
        image_dir = str(tmp_path / "img")
        run = playbook(CHECKPOINT, {"gpuckpt_image_dir": image_dir, "gpuckpt_docker_host": w.host,
                                    "gpuckpt_container": w.name, "gpuckpt_runtime": "docker"}, env=fakecuda.env)
        assert run.rc == 0, run.stdout
        assert all(os.path.isdir(p) for p in gone + [going_on])
        run = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_docker_host": w.host}, env=fakecuda.env)
        assert run.rc == 0, run.stdout
        assert [p for p in gone if os.path.exists(p)] == []
        assert os.path.isdir(going_on)
    finally:
        for p in gone + [going_on]:
            subprocess.run(["rm", "-rf", p], check=False)


def _loopback_docker_dirs(hosts, hosts_of_docker=("hosta", "hostb")):
    dirs = {}
    for h in hosts_of_docker:
        dirs.update(_docker_dirs(hosts.host_vars[h]["gpuckpt_docker_dir"], h + "_"))
    for h in ("hosta", "hostb"):
        dirs.update(_containerd_temp_dirs(hosts.host_vars[h]["gpuckpt_docker_dir"], h + "_"))
    return dirs


@pytest.mark.skipif(DOCKERD is None, reason="dockerd is not installed")
def test_a_docker_migration_leaves_no_containerd_copy(playbook, hosts, tmp_path):
    """A Docker container moves from hosta to hostb (each host its own dockerd and containerd, in its own pid
    namespace): no ``ctrd-checkpoint*`` copy is left in /tmp or in either containerd's temporary directory,
    and hosta's Docker holds nothing new. (hostb's Docker holds the moved container now: not watched.)"""
    w = RemoteDockerWorkload(hosts, str(tmp_path / "dw"))
    try:
        watch = Watch(_host_dirs(hosts, **_loopback_docker_dirs(hosts, ("hosta",))))
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "docker",
                                 "migration_id": "t-left-dk-ok"}, inventory=hosts.path("inventory.yml"))
        assert run.rc == 0, run.stdout
        assert w.state("hostb") == "running" and w.state("hosta") == "exited"
        assert watch.leftovers(DOCKER_SETTLE) == {}
    finally:
        w.cleanup()


@pytest.mark.skipif(DOCKERD is None, reason="dockerd is not installed")
def test_a_docker_rollback_leaves_nothing(playbook, hosts, tmp_path):
    w = RemoteDockerWorkload(hosts, str(tmp_path / "dw"))
    try:
        w.docker("hostb", ["create", "--name", w.name, SKELETON_IMAGE, "/usr/bin/true"])
        watch = Watch(_host_dirs(hosts, **_loopback_docker_dirs(hosts)))
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "docker",
                                 "migration_id": "t-left-dk"}, inventory=hosts.path("inventory.yml"))
        _rolled_back(run)
        assert w.state("hosta") == "running"
        watch.kept.update(_docker_owned(w.docker("hosta", ["container", "inspect", w.name]).stdout,
                                        hosts.host_vars["hosta"]["gpuckpt_docker_dir"]))
        assert watch.leftovers(DOCKER_SETTLE) == {}
    finally:
        w.cleanup()


# ---- Podman -------------------------------------------------------------------------------------
@pytest.mark.skipif(PODMAN is None, reason="podman is not installed")
def test_a_podman_container_leaves_nothing(tmp_path, playbook, podman_workload, fakecuda):  # noqa: F811 (the fixture imported above)
    w = podman_workload()

    def v(image_dir, restore=False):
        out = {"gpuckpt_image_dir": image_dir, "gpuckpt_podman_root": w.storage[1],
               "gpuckpt_podman_runroot": w.storage[3]}
        return out if restore else dict(out, gpuckpt_container=w.name, gpuckpt_runtime="podman")
    dirs = {"podman_root": (w.storage[1], 5), "podman_runroot": (w.storage[3], 4)}
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, dirs)


@pytest.mark.skipif(PODMAN is None, reason="podman is not installed")
def test_a_podman_rollback_leaves_nothing(playbook, hosts, tmp_path):
    w = RemotePodmanWorkload(hosts, str(tmp_path / "pw"))
    try:
        w.podman("hostb", ["create", "--name", w.name, SKELETON_IMAGE, "/usr/bin/true"])
        dirs = {}
        for h in ("hosta", "hostb"):
            store = hosts.path(h, "podman-store")
            dirs.update({h + "_podman_root": (os.path.join(store, "root"), 5),
                         h + "_podman_runroot": (os.path.join(store, "run"), 4)})
        watch = Watch(_host_dirs(hosts, **dirs))
        run = playbook(MIGRATE, {"source": "hosta", "target": "hostb", "container": w.name, "runtime": "podman",
                                 "migration_id": "t-left-pm"}, inventory=hosts.path("inventory.yml"))
        _rolled_back(run)
        assert w.status("hosta") == "running"
        assert watch.leftovers() == {}
    finally:
        w.cleanup()


# ---- runsc --------------------------------------------------------------------------------------
@pytest.mark.skipif(RUNSC is None, reason="runsc is not installed")
def test_a_runsc_sandbox_leaves_nothing(tmp_path, playbook, sandbox, fakecuda):  # noqa: F811 (the fixture imported above)
    w = sandbox()

    def v(image_dir, restore=False):
        return w.vars(image_dir)
    _checkpoint_restore(playbook, fakecuda.env, tmp_path, v, {"runsc_root": (w.root, 3)})
