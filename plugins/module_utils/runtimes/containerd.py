# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A containerd task (runc-based: io.containerd.runc.v2), checkpointed and restored through containerd's
API (``containerd_api``), in any namespace: ``k8s.io`` (a Kubernetes node's pods), ``default``, ...

The CUDA stage stays the engine's, on the task's host pids. The image directory holds:
- ``checkpoint/``: CRIU's images, written by the shim's runc (no copy in containerd's content store);
- ``rootfs-diff.tar``: what the container changed in its writable layer (overlayfs whiteouts written
  as OCI whiteouts), when it changed anything; the shim applies it to the new snapshot before the
  restore (containerd's CRI restore does the same with this name, next to ``checkpoint/``).
The container's record (spec, runtime and its options, image, snapshotter, labels) goes into the
manifest; the restore creates the container again from it, prepares its snapshot from the image's
unpacked layers on this host, and creates its task from ``checkpoint/`` with the ``RestoreFromPath``
checkpoint annotation (what containerd's CRI restore uses): a task that containerd manages, which
``ctr tasks ls`` shows and which can be paused, killed and deleted. Its stdout and stderr are appended
to ``<work dir>/container.log`` by the shim.

- after=exit:    checkpoint with exit: the task stops; its container stays until its image is restored in
                 its place (a rollback) or its migration commits (``release_exited``)
- after=running: checkpoint; containerd pauses the task for the dump and resumes it
- after=stopped: pause, then checkpoint: containerd leaves a task it did not pause paused, so the
  source is held until ``resume`` (roll back) or its removal (commit).
CRIU options reach the dump through runc's checkpoint options, and the restore through a CRIU
configuration file that the restored container's spec names (runc reads the ``org.criu.config``
annotation); that file also gives CRIU the cgroup the restored container's spec names.
Docker's containers (namespace ``moby``) are dockerd's: checkpointing them behind its back would leave
dockerd's own state wrong, so that namespace is refused with a pointer to ``runtime: docker``.
"""
from __future__ import annotations

import copy
import errno
import os
import signal
import stat
import tarfile

from ..core import procfs
from ..cuda import devices as gpu_devices
from ..k8s.names import K8S_NAMESPACE, KUBELET_LABELS
from .containerd_api import DEFAULT_ADDRESS, RUNC_OPTIONS_URL, Client, ContainerdError, runc_options
from ..core.errors import CommandError, GpuCkptError, InvalidTarget
from . import criu_log
from .base import ContainerBackend, mount_hint, ns_pid
from .criu import no_plugins_dir, write_config
from .runc import CGROUP2_ROOT, cgroup2_frozen, cgroup2_path

CRIU_SUBDIR = "checkpoint"
ROOTFS_DIFF = "rootfs-diff.tar"
RUNC_RUNTIME = "io.containerd.runc.v2"
CRIU_CONFIG_ANNOTATION = "org.criu.config"
RECORD_KEYS = ("labels", "image", "runtime", "runtime_options_url", "spec_url", "spec", "snapshotter",
               "snapshot_key", "snapshot_parent", "sandbox")  # what a restore needs of the container's record
STOP_WAIT = 30  # seconds a killed task may take to stop before its removal is given up


class ContainerdBackend(ContainerBackend):
    name = "containerd"
    # paused (cgroup freezer); its checkpoint's CRIU is the shim's, run with the node's configuration
    capabilities = ContainerBackend.capabilities._replace(can_hold_stopped=True, keeps_criu_plugins_off=False)
    passes_criu_flags = ("--tcp-established", "--ext-unix-sk", "--file-locks")

    def __init__(self, address=None, namespace=None, runc_root=None, criu_path=None, criu_options=(), timeout=None,
                 container=None, tcp_established=False):
        super(ContainerdBackend, self).__init__(criu_path, criu_options, timeout, container, tcp_established)
        self.namespace = namespace or "default"
        self.address = address
        self.runc_root = runc_root
        self._record = self._cgroup_seen = self._ns = None

    def client(self):
        return Client(self.address, self.namespace, timeout=60)

    def _check_namespace(self, api):
        if self.namespace == "moby":
            raise InvalidTarget("namespace moby holds Docker's containers: dockerd keeps their state, and a checkpoint "
                                "or restore behind its back would leave that state wrong; nothing was frozen",
                                stage="preflight", hint="use runtime: docker for Docker's containers")
        known = api.namespaces()
        if self.namespace not in known:
            raise InvalidTarget("containerd at %s has no namespace %r (it has: %s); nothing was frozen"
                                % (api.address, self.namespace, ", ".join(known) or "none"), stage="preflight",
                                hint="set containerd_namespace (k8s.io for a Kubernetes node's pods)")

    def present(self):
        try:
            return stat.S_ISSOCK(os.stat(self.address or DEFAULT_ADDRESS).st_mode)
        except OSError:
            return False

    def running_containers(self):
        """The tasks of every namespace but moby (Docker's: runtime docker lists them)."""
        out = []
        api = Client(self.address, self.namespace, timeout=30)
        try:
            namespaces = [n for n in api.namespaces() if n != "moby"]
        finally:
            api.close()
        for namespace in namespaces:
            out += self._running_in(namespace)
        return out

    def _running_in(self, namespace):
        """The running or paused tasks of containerd namespace ``namespace``, asked through a client of that namespace."""
        api = Client(self.address, namespace, timeout=30)
        try:
            tasks = [{"id": t["id"], "pid": t["pid"], "status": t["status"], "namespace": namespace}
                     for t in api.tasks() if t["pid"] and t["status"] in ("running", "paused")]
            if namespace == K8S_NAMESPACE and tasks:
                # The kubelet's labels say which pod each container belongs to: a drain moves a pod whole.
                labels = {c["id"]: c["labels"] for c in api.containers()}
                for t in tasks:
                    t["labels"] = {k: v for k, v in (labels.get(t["id"]) or {}).items() if k in KUBELET_LABELS}
            return tasks
        finally:
            api.close()

    # -- Backend -----------------------------------------------------------------------------------------
    def runtime_facts(self):
        api = self.client()
        try:
            return {"containerd_version": api.version(), "containerd_namespace": self.namespace}
        finally:
            api.close()

    def resolve(self, target):
        self.container = str(target)
        api = self.client()
        try:
            self._check_namespace(api)
            record = api.container(self.container)
            if record is None:
                raise InvalidTarget("no containerd container %r in namespace %s; nothing was frozen"
                                    % (self.container, self.namespace), stage="preflight",
                                    hint="check the id: ctr -n %s containers ls" % self.namespace)
            if record["runtime"] != RUNC_RUNTIME:
                raise InvalidTarget("container %s runs with runtime %s; only %s tasks can be checkpointed here"
                                    % (self.container, record["runtime"], RUNC_RUNTIME), stage="preflight")
            task = api.task(self.container)
            if task is None or task["status"] != "running":
                raise InvalidTarget("containerd container %s has %s, not a running task; nothing was frozen"
                                    % (self.container, "no task" if task is None else "a %s task" % task["status"]),
                                    stage="preflight", hint="start or resume it first")
            parent = None
            if record["snapshot_key"]:
                snap = api.snapshot(record["snapshotter"], record["snapshot_key"])
                parent = (snap or {}).get("parent") or None
                self._upper = _upper_dir(api.mounts(record["snapshotter"], record["snapshot_key"]))
            else:
                self._upper = None
        finally:
            api.close()
        pid = task["pid"]
        self._record = dict(record, snapshot_parent=parent)
        self._cgroup_seen = cgroup2_path(pid)
        tree = procfs.process_tree(pid)
        self._ns = {str(p): ns_pid(p) for p in tree}
        return pid, tree

    def dump(self, target, image_dir, work_dir, after):
        api = self.client()
        paused = False
        try:
            if after == "stopped":
                api.pause(self.container, "runtime-dump")
                paused = True
            return self.dump_task(api, target, image_dir, work_dir, exit_after=(after == "exit"), paused=paused)
        except Exception:
            if paused:
                try:
                    api.resume(self.container, "runtime-dump")
                except GpuCkptError:
                    pass
            raise
        finally:
            api.close()

    def dump_task(self, api, target, image_dir, work_dir, exit_after, paused):
        """Checkpoint this resolved task into ``image_dir`` through ``api``; ``paused``: the caller paused it
        (containerd then leaves it paused after the checkpoint; a pod's containers are all paused first).
        Returns the manifest's runtime record of this container."""
        flags = self.criu_flags()
        criu_dir = os.path.join(image_dir, CRIU_SUBDIR)
        os.mkdir(criu_dir, 0o700)
        diff = None
        if self._upper and paused:  # taken while the task cannot write
            diff = write_rootfs_diff(self._upper, os.path.join(image_dir, ROOTFS_DIFF))
        try:
            api.checkpoint(self.container, criu_dir, work_dir, exit_after=exit_after,
                           open_tcp="--tcp-established" in flags, external_unix_sockets="--ext-unix-sk" in flags,
                           file_locks="--file-locks" in flags, timeout=self.timeout)
        except ContainerdError as exc:
            log = criu_log.error_lines(os.path.join(work_dir, "dump.log"))
            raise CommandError("containerd's checkpoint of %s failed: %s" % (self.container, exc.msg),
                               stage="runtime-dump", stderr=log,
                               hint=mount_hint(log, "see dump.log in the work dir"))
        if self._upper and not paused:
            # The task ran on (after=running, paused by the checkpoint alone) or stopped (after=exit): its
            # writable layer is read now; for after=running the files may have changed since the dump, as
            # with any live copy.
            diff = write_rootfs_diff(self._upper, os.path.join(image_dir, ROOTFS_DIFF))
        rec = self._record
        return {"backend": self.name, "container": self.container, "namespace": self.namespace,
                "root_pid": int(target), "ns_pids": self._ns, "cgroup_v2_path": self._cgroup_seen,
                "record": {k: rec[k] for k in RECORD_KEYS},
                # the container's GPUs, by UUID: what a restore onto other GPUs maps from (gpus.py)
                "gpus": [{"uuid": g["uuid"], "minor": g["minor"]} for g in gpu_devices.spec_gpus(rec.get("spec"))],
                "runtime_options_b64": _b64(rec["runtime_options"]), "rootfs_diff": diff,
                "created_at": rec.get("created_at"),
                "criu_options": self.extra, "auto_flags": list(self.auto_flags)}

    def restore(self, image_dir, work_dir, manifest):
        rt = manifest.get("runtime") or {}
        self.container = rt.get("container") or self.container
        self.namespace = rt.get("namespace") or self.namespace
        record = dict(rt.get("record") or {})
        record["spec"] = copy.deepcopy(record.get("spec") or {})  # made this host's below, not the manifest's
        criu_dir = os.path.join(image_dir, CRIU_SUBDIR)
        if not rt.get("record") or not os.path.isdir(criu_dir):
            raise InvalidTarget("the image holds no containerd checkpoint (%s/)" % CRIU_SUBDIR, stage="preflight")
        # A spec recorded on another host names that host's device numbers: this host's, by path, as containerd
        # would have resolved them had the container been created here; the GPUs it then gives the container
        # are where its processes go, place by place. Checked before anything here is changed.
        moved = gpu_devices.retarget_spec_devices(record["spec"])
        pairs = self.placement(manifest, record["spec"])
        api = self.client()
        created = snapshot = False
        plugins_off = no_plugins_dir(work_dir)  # CRIU's plugin directory: empty, until the restore returned
        libdir = plugins_off.__enter__()
        try:
            self._check_namespace(api)
            existing = api.container(self.container)
            if existing is not None:
                self._remove_checkpointed(api, existing, rt, "preflight", refuse=True)
            parent = record.get("snapshot_parent")
            if record.get("snapshot_key") and parent and api.snapshot(record["snapshotter"], parent) is None:
                raise InvalidTarget("image %s is not unpacked into snapshotter %s on this host (layer %s is missing); "
                                    "nothing was restored" % (record.get("image"), record["snapshotter"], parent),
                                    stage="preflight", hint="pull it first: ctr -n %s images pull %s"
                                    % (self.namespace, record.get("image")))
            spec = record["spec"]
            dest_cgroup = self._cgroup_for(spec, rt)
            criu_config = self._criu_config(work_dir, manifest, dest_cgroup, libdir)
            spec.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = criu_config
            options = _b64decode(rt.get("runtime_options_b64"))
            if self.runc_root:
                options = runc_options(options, root=self.runc_root)
            record.update(id=self.container, spec=spec, runtime_options=options,
                          runtime_options_url=record.get("runtime_options_url") or RUNC_OPTIONS_URL)
            key = record.get("snapshot_key")
            # The container first: a snapshot that a container names is kept by containerd's garbage collector.
            api.create_container(record, "runtime-restore")
            created = True
            rootfs = []
            if key:
                rootfs = api.prepare_snapshot(record["snapshotter"], key, parent, "runtime-restore")
                snapshot = True
            # The task's options: the container's runc options, and CRIU's work dir for restore.log.
            task_options = runc_options(options, criu_image_path=None, criu_work_path=work_dir)
            try:
                pid = api.restore_task(self.container, rootfs, "file://" + os.path.join(work_dir, "container.log"),
                                       criu_dir, RUNC_OPTIONS_URL, task_options, timeout=self.timeout)
            except ContainerdError as exc:
                raise CommandError("containerd's restore of %s failed: %s" % (self.container, exc.msg),
                                   stage="runtime-restore", stderr=criu_log.error_lines(os.path.join(work_dir, "restore.log")),
                                   hint="see restore.log in the work dir")
            tree = procfs.process_tree(pid)
            self.adopt_devices(pid, tree, spec, pairs, sync=bool(moved))
        except Exception:
            if created:
                self._remove(api, record.get("snapshotter") if snapshot else None, record.get("snapshot_key"))
            raise
        finally:
            plugins_off.__exit__(None, None, None)
            api.close()
        return tree

    def _cgroup_for(self, spec, rt):
        """The cgroup the restored container goes into: the one its spec names, unless that cgroup is in
        use on this host (a held source on the same kernel): then a sibling of it, named for the container
        and this restore, so the restore neither joins nor freezes in the source's cgroup."""
        linux = spec.setdefault("linux", {})
        path = linux.get("cgroupsPath") or ""
        if not path.startswith("/") or ":" in path:  # systemd's slice:prefix:name is left to runc
            return None
        unified = os.path.exists(os.path.join(CGROUP2_ROOT, "cgroup.controllers"))
        # cgroup v2, or v1's freezer (the hierarchy a paused source holds) on a host of v1 or hybrid cgroups
        roots = [CGROUP2_ROOT]
        if not unified:
            roots = [os.path.join(CGROUP2_ROOT, "freezer"), os.path.join(CGROUP2_ROOT, "unified")]
        if any(os.path.isdir(os.path.join(root, path.lstrip("/"))) for root in roots):
            path = "%s-restored-%d" % (os.path.normpath(path), os.getpid())
            linux["cgroupsPath"] = path
        if not unified:
            return None  # on cgroup v1 runc tells CRIU each controller's cgroup itself
        if cgroup2_frozen(path):
            raise InvalidTarget("cgroup %s is frozen on this host; nothing was restored" % path, stage="preflight")
        return path

    def _criu_config(self, work_dir, manifest, cgroup, libdir):
        """A CRIU configuration file for this restore (runc hands it to CRIU): the CRIU options the dump
        needed, the cgroup root, and ``libdir``, an empty plugin directory (criu.py: CRIU reads this file
        last, so it loads no plugin). runc reads it instead of its default /etc/criu/runc.conf."""
        lines = [opt.lstrip("-") for opt in self.criu_flags(manifest)]
        if cgroup:
            lines.append("cgroup-root %s" % cgroup)
        return write_config(os.path.join(work_dir, "criu-restore.conf"), lines, libdir)

    def bind(self, manifest):
        super(ContainerdBackend, self).bind(manifest)
        rt = manifest.get("runtime") or {}
        self.namespace = rt.get("namespace") or self.namespace

    def is_held(self, pids):
        if not self.container:
            return False
        api = self.client()
        try:
            task = api.task(self.container, stage="resume-source")
        finally:
            api.close()
        return task is None or task["status"] in ("paused", "stopped")

    def resume(self, pids):
        if not self.container:
            return
        api = self.client()
        try:
            task = api.task(self.container, stage="resume-source")
            if task is not None and task["status"] in ("paused", "pausing"):
                api.resume(self.container, "resume-source")
        finally:
            api.close()

    def _remove_checkpointed(self, api, existing, rt, stage, refuse):
        """The container this image was checkpointed from, left with a stopped task (after=exit), is
        removed: before its own image is restored into its place (a rollback, or a restore on the host of
        the checkpoint), or once its migration committed. It is known by its creation time, recorded at
        the dump; any other container of that name, or one whose task runs, is refused (``refuse``) or
        left alone."""
        task = api.task(self.container, stage=stage)
        ours = bool(rt.get("created_at")) and existing.get("created_at") == rt.get("created_at")
        if not ours or (task is not None and task["status"] != "stopped"):
            if not refuse:
                return False
            raise InvalidTarget("a containerd container %s already exists in namespace %s on this host%s; refusing "
                                "to start a second copy" % (self.container, self.namespace,
                                                            " and runs" if ours else ""),
                                stage="preflight",
                                hint="remove it (ctr -n %s containers rm) if it is a leftover, or restore elsewhere"
                                % self.namespace)
        self._remove(api, existing["snapshotter"] or None, existing["snapshot_key"])
        return True

    def release_exited(self, manifest):
        """Commit of a migration whose source exited: remove its stopped container (and snapshot)."""
        rt = manifest.get("runtime") or {}
        self.container = rt.get("container") or self.container
        self.namespace = rt.get("namespace") or self.namespace
        api = self.client()
        try:
            existing = api.container(self.container, stage="release-source")
            return existing is not None and self._remove_checkpointed(api, existing, rt, "release-source", refuse=False)
        finally:
            api.close()

    def remove(self):
        api = self.client()
        try:
            record = api.container(self.container, stage="cleanup")
            if record is None:
                return
            self._remove(api, record["snapshotter"] or None, record["snapshot_key"])
        finally:
            api.close()

    def _remove(self, api, snapshotter, key):
        """Kill the task, then delete it, the container and its snapshot. A paused task is killed too
        (the kernel delivers SIGKILL into a frozen cgroup)."""
        task = api.task(self.container, stage="cleanup")
        if task is not None:
            if task["status"] != "stopped":
                try:
                    api.kill(self.container, signal.SIGKILL, "cleanup")
                except ContainerdError:
                    pass
                if not api.wait_stopped(self.container, STOP_WAIT, "cleanup"):
                    raise GpuCkptError("containerd task %s did not stop within %ss of SIGKILL"
                                       % (self.container, STOP_WAIT), stage="cleanup")
            try:
                api.delete_task(self.container, "cleanup")
            except ContainerdError as exc:
                if exc.code != "NOT_FOUND":
                    raise
        try:
            api.delete_container(self.container, "cleanup")
        except ContainerdError as exc:
            if exc.code != "NOT_FOUND":
                raise
        if snapshotter and key:
            try:
                api.remove_snapshot(snapshotter, key, "cleanup")
            except ContainerdError as exc:
                if exc.code != "NOT_FOUND":
                    raise


def _upper_dir(mounts):
    """The writable layer's directory on this host: overlayfs's upperdir, or a bind mount's source (a
    snapshot without parent layers is its whole rootfs). None for what is not a directory here."""
    for m in mounts:
        if m["type"] == "overlay":
            for opt in m["options"]:
                if opt.startswith("upperdir="):
                    return opt.split("=", 1)[1]
        elif m["type"] == "bind" and os.path.isdir(m["source"]):
            return m["source"]
    return None


def write_rootfs_diff(upper, dest):
    """Write the writable layer ``upper`` as a tar that containerd applies as a layer: overlayfs
    whiteouts (0/0 character devices) become ``.wh.<name>`` files and opaque directories get a
    ``.wh..wh..opq`` entry. Returns {"files": n, "bytes": size} or None when the layer is empty."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(upper):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            entries.append(os.path.join(dirpath, name))
    if not entries:
        return None
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    count = 0
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path in entries:
            rel = os.path.relpath(path, upper)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                info = tarfile.TarInfo(os.path.join(os.path.dirname(rel), ".wh." + os.path.basename(rel)))
                tf.addfile(info)
                count += 1
                continue
            tf.add(path, arcname=rel, recursive=False)
            count += 1
            if stat.S_ISDIR(st.st_mode) and _opaque(path):
                tf.addfile(tarfile.TarInfo(os.path.join(rel, ".wh..wh..opq")))
    return {"files": count, "bytes": os.path.getsize(dest)}


def _opaque(path):
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
    return False


def _b64(data):
    import base64
    return base64.b64encode(data or b"").decode()


def _b64decode(text):
    import base64
    return base64.b64decode(text or "")
