# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The few calls of containerd's gRPC API (v1 services, containerd 1.6, 1.7 and 2.x) that the containerd
backend makes, through the messages and stubs generated from containerd's own .proto files
(``containerd_proto``, made by tools/gen_containerd_proto.sh).

Why the API and not ``ctr``: a restore must create a task that containerd manages, from the CRIU image
in a directory (the ``RestoreFromPath`` checkpoint annotation that containerd's CRI restore uses), with
its stdout in a file (the shim then appends to it). ``ctr`` offers neither: its restore reads a
checkpoint image from the content store, and its detached tasks write into FIFOs that nobody reads
once ``ctr`` exits, which blocks a workload that logs after 64 KiB. Its checkpoint passes none of
CRIU's options (TCP connections, file locks, external unix sockets).

The generated code needs Python's grpc and protobuf (4.21 or newer) on the managed host; both are
imported on the first call, so that a host without them fails with a hint, and other backends never
load them.
"""
from __future__ import annotations

import json
import sys

from ..core.errors import GpuCkptError, InvalidTarget
from ..core.wait import wait_for

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
# containerd's type URLs are the messages' full names, without the type.googleapis.com/ prefix of Any.Pack
RUNC_OPTIONS_URL = "containerd.runc.v1.Options"
RUNC_CHECKPOINT_OPTIONS_URL = "containerd.runc.v1.CheckpointOptions"
NOT_FOUND = "NOT_FOUND"  # google.golang.org/grpc/codes, as grpc.StatusCode names it


class ContainerdError(GpuCkptError):
    """A containerd API call failed; ``code`` is the gRPC status name (NOT_FOUND, ...)."""

    def __init__(self, msg_, code=None, **kw):
        super(ContainerdError, self).__init__(msg_, **kw)
        self.code = code


def _grpc():
    try:
        import grpc  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        raise InvalidTarget("the containerd backend needs Python's grpc module on this host (%s: %s)"
                            % (sys.executable, exc), stage="preflight",
                            hint="install python3-grpcio (Debian, Ubuntu) or python3-grpcio/grpcio with pip for the "
                                 "Python that Ansible runs here")
    return grpc


def _proto():
    """The generated modules, as a dict by name; imported here so that a host without protobuf (or with
    one older than 4.21, which cannot read the generated code) is told what to install."""
    _grpc()
    try:
        # pylint: disable=import-outside-toplevel
        from .containerd_proto import (containers_pb2, containers_pb2_grpc, namespace_pb2, namespace_pb2_grpc,
                                       oci_pb2, mount_pb2, snapshots_pb2, snapshots_pb2_grpc, task_pb2, tasks_pb2,
                                       tasks_pb2_grpc, version_pb2_grpc)
        from google.protobuf import any_pb2, empty_pb2, field_mask_pb2
        from google.protobuf.message import DecodeError
    except ImportError as exc:
        raise InvalidTarget("the containerd backend needs Python's protobuf module, 4.21 or newer, on this host "
                            "(%s: %s)" % (sys.executable, exc), stage="preflight",
                            hint="install python3-protobuf (Debian 12, Ubuntu 24.04 or newer) or protobuf with pip "
                                 "for the Python that Ansible runs here")
    return {"containers": containers_pb2, "namespaces": namespace_pb2, "oci": oci_pb2, "mount": mount_pb2,
            "snapshots": snapshots_pb2, "task": task_pb2, "tasks": tasks_pb2, "any": any_pb2, "empty": empty_pb2,
            "field_mask": field_mask_pb2, "DecodeError": DecodeError,
            "stubs": {"Containers": containers_pb2_grpc.ContainersStub, "Namespaces": namespace_pb2_grpc.NamespacesStub,
                      "Snapshots": snapshots_pb2_grpc.SnapshotsStub, "Tasks": tasks_pb2_grpc.TasksStub,
                      "Version": version_pb2_grpc.VersionStub}}


def runc_options(data, **changes):
    """runc's options (``containerd.runc.v1.Options``, an Any's value as containerd keeps a container's
    runtime options) with the named fields set, or cleared where the value is None. Fields that these
    .proto files do not know (containerd 1.x's criu_path) are kept as they came."""
    pb = _proto()
    options = pb["oci"].Options()
    try:
        options.ParseFromString(data or b"")
    except pb["DecodeError"] as exc:
        raise InvalidTarget("the container's runtime options are not runc's (%s): %s" % (RUNC_OPTIONS_URL, exc),
                            stage="preflight")
    for name, value in changes.items():
        if value is None:
            options.ClearField(name)
        else:
            setattr(options, name, value)
    return options.SerializeToString()


class Client(object):
    """One containerd, one namespace. Every call has a deadline (``timeout`` seconds, or the call's own)."""

    def __init__(self, address=None, namespace="default", timeout=60):
        self.address = address or DEFAULT_ADDRESS
        self.namespace = namespace
        self.timeout = timeout
        self._channel = None
        self._stubs = {}

    def _call(self, service, method, request, stage, timeout=None):
        """``service``/``method`` (Tasks/Get, ...) with ``request``; its reply, or ContainerdError."""
        grpc = _grpc()
        stub = self._stubs.get(service)
        if stub is None:
            if self._channel is None:
                self._channel = grpc.insecure_channel("unix://" + self.address)
            stub = self._stubs[service] = _proto()["stubs"][service](self._channel)
        deadline = timeout if timeout is not None else self.timeout
        try:
            return getattr(stub, method)(request, metadata=[("containerd-namespace", self.namespace)],
                                         timeout=deadline)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") and exc.code() else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            hint = None
            if code == "UNAVAILABLE":
                hint = "is containerd running, and is %s its socket? (containerd_address)" % self.address
            raise ContainerdError("containerd %s/%s (namespace %s) failed: %s: %s"
                                  % (service, method, self.namespace, code, details),
                                  code=code, stage=stage, hint=hint)

    def _get(self, service, method, request, stage):
        """The reply, or None where containerd has no such object (NOT_FOUND)."""
        try:
            return self._call(service, method, request, stage)
        except ContainerdError as exc:
            if exc.code == NOT_FOUND:
                return None
            raise

    def close(self):
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stubs = {}

    # -- reads -------------------------------------------------------------------------------------------
    def version(self):
        return self._call("Version", "Version", _proto()["empty"].Empty(), "preflight").version

    def _list(self, service, request, field, convert):
        """What ``service``'s List call answers (its reply's ``field``), each converted."""
        return [convert(item) for item in getattr(self._call(service, "List", request, "preflight"), field)]

    def namespaces(self):
        return sorted(self._list("Namespaces", _proto()["namespaces"].ListNamespacesRequest(), "namespaces",
                                 lambda namespace: namespace.name))

    def container(self, container_id, stage="preflight"):
        """The container record, or None when there is none with that id in the namespace."""
        reply = self._get("Containers", "Get", _proto()["containers"].GetContainerRequest(id=container_id), stage)
        return None if reply is None else _container(reply.container)

    def containers(self):
        return self._list("Containers", _proto()["containers"].ListContainersRequest(), "containers", _container)

    def task(self, container_id, stage="preflight"):
        """{pid, status} of the container's task, or None when it has none."""
        reply = self._get("Tasks", "Get", _proto()["tasks"].GetRequest(container_id=container_id), stage)
        return None if reply is None else _process(reply.process)

    def tasks(self):
        return self._list("Tasks", _proto()["tasks"].ListTasksRequest(), "tasks", _process)

    def snapshot(self, snapshotter, key, stage="preflight"):
        """{name, parent, kind} of a snapshot, or None."""
        request = _proto()["snapshots"].StatSnapshotRequest(snapshotter=snapshotter, key=key)
        reply = self._get("Snapshots", "Stat", request, stage)
        if reply is None:
            return None
        return {"name": reply.info.name, "parent": reply.info.parent, "kind": int(reply.info.kind)}

    def mounts(self, snapshotter, key, stage="preflight"):
        request = _proto()["snapshots"].MountsRequest(snapshotter=snapshotter, key=key)
        return [_mount(m) for m in self._call("Snapshots", "Mounts", request, stage).mounts]

    # -- changes -----------------------------------------------------------------------------------------
    def pause(self, container_id, stage):
        self._call("Tasks", "Pause", _proto()["tasks"].PauseTaskRequest(container_id=container_id), stage)

    def resume(self, container_id, stage):
        self._call("Tasks", "Resume", _proto()["tasks"].ResumeTaskRequest(container_id=container_id), stage)

    def checkpoint(self, container_id, image_path, work_path, exit_after=False, open_tcp=False,
                   external_unix_sockets=False, file_locks=False, timeout=None):
        """runc's checkpoint of the task into ``image_path`` (CRIU's images, no content-store copy)."""
        pb = _proto()
        options = pb["oci"].CheckpointOptions(exit=bool(exit_after), open_tcp=bool(open_tcp),
                                              external_unix_sockets=bool(external_unix_sockets),
                                              file_locks=bool(file_locks), image_path=image_path or "",
                                              work_path=work_path or "")
        request = pb["tasks"].CheckpointTaskRequest(container_id=container_id,
                                                    options=_any(RUNC_CHECKPOINT_OPTIONS_URL, options.SerializeToString()))
        self._call("Tasks", "Checkpoint", request, "runtime-dump", timeout=timeout)

    def kill(self, container_id, signal_number, stage, all_processes=True):
        request = _proto()["tasks"].KillRequest(container_id=container_id, signal=int(signal_number),
                                                all=bool(all_processes))
        self._call("Tasks", "Kill", request, stage)

    def delete_task(self, container_id, stage):
        self._call("Tasks", "Delete", _proto()["tasks"].DeleteTaskRequest(container_id=container_id), stage)

    def create_container(self, record, stage):
        pb = _proto()
        container = pb["containers"].Container(
            id=record["id"], labels=record.get("labels") or {}, image=record.get("image") or "",
            spec=_any(record["spec_url"], json.dumps(record["spec"]).encode()),
            snapshotter=record.get("snapshotter") or "", snapshot_key=record.get("snapshot_key") or "",
            sandbox=record.get("sandbox") or "")
        container.runtime.name = record["runtime"]
        if record.get("runtime_options_url"):
            container.runtime.options.CopyFrom(_any(record["runtime_options_url"], record["runtime_options"]))
        self._call("Containers", "Create", pb["containers"].CreateContainerRequest(container=container), stage)

    def update_spec(self, container_id, spec, spec_url, stage):
        """Replace a container's OCI spec (Containers/Update with the field mask ``spec``); its task, when
        started after this, runs with it."""
        pb = _proto()
        container = pb["containers"].Container(id=container_id, spec=_any(spec_url, json.dumps(spec).encode()))
        request = pb["containers"].UpdateContainerRequest(container=container,
                                                          update_mask=pb["field_mask"].FieldMask(paths=["spec"]))
        self._call("Containers", "Update", request, stage)

    def delete_container(self, container_id, stage):
        self._call("Containers", "Delete", _proto()["containers"].DeleteContainerRequest(id=container_id), stage)

    def prepare_snapshot(self, snapshotter, key, parent, stage):
        request = _proto()["snapshots"].PrepareSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent or "")
        return [_mount(m) for m in self._call("Snapshots", "Prepare", request, stage).mounts]

    def remove_snapshot(self, snapshotter, key, stage):
        self._call("Snapshots", "Remove", _proto()["snapshots"].RemoveSnapshotRequest(snapshotter=snapshotter, key=key),
                   stage)

    def restore_task(self, container_id, rootfs, stdout, restore_from, options_url, options, timeout=None):
        """Create the container's task from the CRIU image in ``restore_from`` (a directory on this host):
        containerd's shim restores and starts it. Returns its host pid."""
        pb = _proto()
        request = pb["tasks"].CreateTaskRequest(
            container_id=container_id, stdout=stdout, stderr=stdout, options=_any(options_url, options),
            rootfs=[pb["mount"].Mount(type=m["type"], source=m["source"], target=m.get("target") or "",
                                      options=list(m.get("options") or [])) for m in rootfs])
        request.checkpoint.annotations["RestoreFromPath"] = restore_from
        return self._call("Tasks", "Create", request, "runtime-restore", timeout=timeout).pid

    def wait_stopped(self, container_id, seconds, stage):
        """Wait (bounded) until the task is stopped or gone; True when it is."""
        def stopped():
            t = self.task(container_id, stage=stage)
            return t is None or t["status"] == "stopped"
        return wait_for(stopped, seconds, "containerd task %s to stop" % container_id, interval=0.1,
                        on_timeout="return", stage=stage)


def _any(type_url, value):
    return _proto()["any"].Any(type_url=type_url, value=value or b"")


def _container(c):
    try:
        spec = json.loads(c.spec.value.decode()) if c.spec.value else {}
    except ValueError:
        spec = {}
    return {"id": c.id, "labels": dict(c.labels), "image": c.image, "runtime": c.runtime.name,
            "runtime_options_url": c.runtime.options.type_url, "runtime_options": c.runtime.options.value,
            "spec_url": c.spec.type_url, "spec": spec, "snapshotter": c.snapshotter, "snapshot_key": c.snapshot_key,
            "sandbox": c.sandbox,
            # "seconds.nanoseconds": it names one creation of a container
            "created_at": "%d.%09d" % (c.created_at.seconds, c.created_at.nanos)}


def _process(p):
    # Tasks/List fills only id (the container's, for a task); Tasks/Get container_id too
    try:
        status = _proto()["task"].Status.Name(p.status).lower()
    except ValueError:  # a state newer than these .proto files
        status = "unknown"
    return {"id": p.container_id or p.id, "pid": p.pid, "status": status}


def _mount(m):
    return {"type": m.type, "source": m.source, "target": m.target, "options": list(m.options)}
