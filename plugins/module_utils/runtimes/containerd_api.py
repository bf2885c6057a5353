# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The few calls of containerd's gRPC API (v1 services, containerd 1.7 and 2.x) that the containerd
backend makes, without generated stubs.

Why the API and not ``ctr``: a restore must create a task that containerd manages, from the CRIU image
in a directory (the ``RestoreFromPath`` checkpoint annotation that containerd's CRI restore uses), with
its stdout in a file (the shim then appends to it). ``ctr`` offers neither: its restore reads a
checkpoint image from the content store, and its detached tasks write into FIFOs that nobody reads
once ``ctr`` exits, which blocks a workload that logs after 64 KiB. Its checkpoint passes none of
CRIU's options (TCP connections, file locks, external unix sockets).

grpcio carries raw bytes; each message is encoded here by its field numbers (containerd's api/*.proto).
The messages are small and their numbers are part of containerd's stable API.
"""
from __future__ import annotations

import json
import sys
import time

from ..core.errors import GpuCkptError, InvalidTarget

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
RUNC_OPTIONS_URL = "containerd.runc.v1.Options"
RUNC_CHECKPOINT_OPTIONS_URL = "containerd.runc.v1.CheckpointOptions"
TASK_STATUS = {0: "unknown", 1: "created", 2: "running", 3: "stopped", 4: "paused", 5: "pausing"}
# google.golang.org/grpc/codes
NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION = "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION"


# -- protobuf wire format: what these messages use (varints, strings, bytes, nested messages, maps) -----
def _varint(n):
    out = bytearray()
    n = int(n)
    if n < 0:
        n += 1 << 64
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | 0x80 if n else low)
        if not n:
            return bytes(out)


def msg(*fields):
    """Encode ``(number, value)`` pairs: str/bytes are length-delimited (a nested message is bytes),
    bool/int are varints, a list repeats its number, a dict is a map<string, string>; None and empty
    values are left out, as proto3 does."""
    out = bytearray()
    for num, value in fields:
        if value is None or value == "" or value == b"" or value is False or value == 0:
            continue
        if isinstance(value, dict):
            for k, v in sorted(value.items()):
                out += _varint(num << 3 | 2) + _len_delimited(msg((1, k), (2, v)))
        elif isinstance(value, (list, tuple)):
            for item in value:
                out += msg((num, item))
        elif isinstance(value, (bool, int)):
            out += _varint(num << 3) + _varint(int(value))
        else:
            out += _varint(num << 3 | 2) + _len_delimited(value)
    return bytes(out)


def _len_delimited(value):
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _varint(len(data)) + data


def _read_varint(data, i):
    shift = result = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def fields(data):
    """Decode a message into {number: [values]} (varints as int, length-delimited as bytes)."""
    out, i = {}, 0
    while i < len(data):
        key, i = _read_varint(data, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
        elif wire == 2:
            size, i = _read_varint(data, i)
            value, i = bytes(data[i:i + size]), i + size
        elif wire == 1:
            value, i = bytes(data[i:i + 8]), i + 8
        elif wire == 5:
            value, i = bytes(data[i:i + 4]), i + 4
        else:
            raise ValueError("unsupported wire type %d" % wire)
        out.setdefault(num, []).append(value)
    return out


def without_fields(data, numbers):
    """``data`` (an encoded message) with the fields ``numbers`` removed, the others kept byte for byte."""
    out, i = bytearray(), 0
    while i < len(data):
        start = i
        key, i = _read_varint(data, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            i = _read_varint(data, i)[1]
        elif wire == 2:
            size, i = _read_varint(data, i)
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError("unsupported wire type %d" % wire)
        if num not in numbers:
            out += data[start:i]
    return bytes(out)


def _str(f, num, default=""):
    v = f.get(num)
    return v[-1].decode("utf-8", "replace") if v else default


def _int(f, num, default=0):
    v = f.get(num)
    return v[-1] if v else default


def _map(f, num):
    out = {}
    for entry in f.get(num, []):
        e = fields(entry)
        out[_str(e, 1)] = _str(e, 2)
    return out


def any_msg(type_url, value):
    return msg((1, type_url), (2, value))


def _any(raw):
    f = fields(raw)
    return _str(f, 1), (f.get(2) or [b""])[-1]


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


class Client(object):
    """One containerd, one namespace. Every call has a deadline (``timeout`` seconds, or the call's own)."""

    def __init__(self, address=None, namespace="default", timeout=60):
        self.address = address or DEFAULT_ADDRESS
        self.namespace = namespace
        self.timeout = timeout
        self._channel = None

    def _call(self, method, request, stage, timeout=None):
        grpc = _grpc()
        if self._channel is None:
            self._channel = grpc.insecure_channel("unix://" + self.address)
        deadline = timeout if timeout is not None else self.timeout
        try:
            return self._channel.unary_unary(method)(request, metadata=[("containerd-namespace", self.namespace)],
                                                     timeout=deadline)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") and exc.code() else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            hint = None
            if code == "UNAVAILABLE":
                hint = "is containerd running, and is %s its socket? (containerd_address)" % self.address
            raise ContainerdError("containerd %s (namespace %s) failed: %s: %s"
                                  % (method.rsplit(".", 1)[-1], self.namespace, code, details),
                                  code=code, stage=stage, hint=hint)

    def close(self):
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- reads -------------------------------------------------------------------------------------------
    def version(self):
        f = fields(self._call("/containerd.services.version.v1.Version/Version", b"", "preflight"))
        return _str(f, 1)

    def namespaces(self):
        f = fields(self._call("/containerd.services.namespaces.v1.Namespaces/List", b"", "preflight"))
        return sorted(_str(fields(n), 1) for n in f.get(1, []))

    def container(self, container_id, stage="preflight"):
        """The container record, or None when there is none with that id in the namespace."""
        try:
            raw = self._call("/containerd.services.containers.v1.Containers/Get", msg((1, container_id)), stage)
        except ContainerdError as exc:
            if exc.code == NOT_FOUND:
                return None
            raise
        return _container(fields(fields(raw)[1][-1]))

    def containers(self):
        raw = self._call("/containerd.services.containers.v1.Containers/List", b"", "preflight")
        return [_container(fields(c)) for c in fields(raw).get(1, [])]

    def task(self, container_id, stage="preflight"):
        """{pid, status} of the container's task, or None when it has none."""
        try:
            raw = self._call("/containerd.services.tasks.v1.Tasks/Get", msg((1, container_id)), stage)
        except ContainerdError as exc:
            if exc.code == NOT_FOUND:
                return None
            raise
        return _process(fields(fields(raw)[1][-1]))

    def tasks(self):
        raw = self._call("/containerd.services.tasks.v1.Tasks/List", b"", "preflight")
        return [_process(fields(p)) for p in fields(raw).get(1, [])]

    def snapshot(self, snapshotter, key, stage="preflight"):
        """{name, parent, kind} of a snapshot, or None."""
        try:
            raw = self._call("/containerd.services.snapshots.v1.Snapshots/Stat", msg((1, snapshotter), (2, key)), stage)
        except ContainerdError as exc:
            if exc.code == NOT_FOUND:
                return None
            raise
        info = fields(fields(raw)[1][-1])
        return {"name": _str(info, 1), "parent": _str(info, 2), "kind": _int(info, 3)}

    def mounts(self, snapshotter, key, stage="preflight"):
        raw = self._call("/containerd.services.snapshots.v1.Snapshots/Mounts", msg((1, snapshotter), (2, key)), stage)
        return [_mount(fields(m)) for m in fields(raw).get(1, [])]

    # -- changes -----------------------------------------------------------------------------------------
    def pause(self, container_id, stage):
        self._call("/containerd.services.tasks.v1.Tasks/Pause", msg((1, container_id)), stage)

    def resume(self, container_id, stage):
        self._call("/containerd.services.tasks.v1.Tasks/Resume", msg((1, container_id)), stage)

    def checkpoint(self, container_id, image_path, work_path, exit_after=False, open_tcp=False,
                   external_unix_sockets=False, file_locks=False, timeout=None):
        """runc's checkpoint of the task into ``image_path`` (CRIU's images, no content-store copy)."""
        opts = msg((1, exit_after), (2, open_tcp), (3, external_unix_sockets), (5, file_locks),
                   (8, image_path), (9, work_path))
        self._call("/containerd.services.tasks.v1.Tasks/Checkpoint",
                   msg((1, container_id), (3, any_msg(RUNC_CHECKPOINT_OPTIONS_URL, opts))), "runtime-dump",
                   timeout=timeout)

    def kill(self, container_id, signal_number, stage, all_processes=True):
        self._call("/containerd.services.tasks.v1.Tasks/Kill",
                   msg((1, container_id), (3, signal_number), (4, all_processes)), stage)

    def delete_task(self, container_id, stage):
        self._call("/containerd.services.tasks.v1.Tasks/Delete", msg((1, container_id)), stage)

    def create_container(self, record, stage):
        options = None
        if record.get("runtime_options_url"):
            options = any_msg(record["runtime_options_url"], record["runtime_options"])
        runtime = msg((1, record["runtime"]), (2, options))
        container = msg((1, record["id"]), (2, record.get("labels") or {}), (3, record.get("image")), (4, runtime),
                        (5, any_msg(record["spec_url"], json.dumps(record["spec"]).encode())),
                        (6, record.get("snapshotter")), (7, record.get("snapshot_key")), (11, record.get("sandbox")))
        self._call("/containerd.services.containers.v1.Containers/Create", msg((1, container)), stage)

    def update_spec(self, container_id, spec, spec_url, stage):
        """Replace a container's OCI spec (Containers/Update with the field mask ``spec``); its task, when
        started after this, runs with it."""
        container = msg((1, container_id), (5, any_msg(spec_url, json.dumps(spec).encode())))
        self._call("/containerd.services.containers.v1.Containers/Update", msg((1, container), (2, msg((1, "spec")))),
                   stage)

    def delete_container(self, container_id, stage):
        self._call("/containerd.services.containers.v1.Containers/Delete", msg((1, container_id)), stage)

    def prepare_snapshot(self, snapshotter, key, parent, stage):
        raw = self._call("/containerd.services.snapshots.v1.Snapshots/Prepare",
                         msg((1, snapshotter), (2, key), (3, parent)), stage)
        return [_mount(fields(m)) for m in fields(raw).get(1, [])]

    def remove_snapshot(self, snapshotter, key, stage):
        self._call("/containerd.services.snapshots.v1.Snapshots/Remove", msg((1, snapshotter), (2, key)), stage)

    def restore_task(self, container_id, rootfs, stdout, restore_from, options_url, options, timeout=None):
        """Create the container's task from the CRIU image in ``restore_from`` (a directory on this host):
        containerd's shim restores and starts it. Returns its host pid."""
        mounts = [msg((1, m["type"]), (2, m["source"]), (3, m.get("target")), (4, list(m.get("options") or [])))
                  for m in rootfs]
        checkpoint = msg((5, {"RestoreFromPath": restore_from}))
        request = msg((1, container_id), (3, mounts), (5, stdout), (6, stdout), (8, checkpoint),
                      (9, any_msg(options_url, options)))
        raw = self._call("/containerd.services.tasks.v1.Tasks/Create", request, "runtime-restore", timeout=timeout)
        return _int(fields(raw), 2)

    def wait_stopped(self, container_id, seconds, stage):
        """Wait (bounded) until the task is stopped or gone; True when it is."""
        deadline = time.monotonic() + seconds
        while True:
            t = self.task(container_id, stage=stage)
            if t is None or t["status"] == "stopped":
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def _container(f):
    runtime = fields((f.get(4) or [b""])[-1])
    options_url, options = _any((runtime.get(2) or [b""])[-1])
    spec_url, spec = _any((f.get(5) or [b""])[-1])
    try:
        spec = json.loads(spec.decode()) if spec else {}
    except ValueError:
        spec = {}
    return {"id": _str(f, 1), "labels": _map(f, 2), "image": _str(f, 3), "runtime": _str(runtime, 1),
            "runtime_options_url": options_url, "runtime_options": options, "spec_url": spec_url, "spec": spec,
            "snapshotter": _str(f, 6), "snapshot_key": _str(f, 7), "sandbox": _str(f, 11),
            "created_at": _timestamp((f.get(8) or [b""])[-1])}


def _timestamp(raw):
    """A google.protobuf.Timestamp as "seconds.nanoseconds" (it names one creation of a container)."""
    t = fields(raw) if raw else {}
    return "%d.%09d" % (_int(t, 1), _int(t, 2))


def _process(f):
    # types.task.Process: container_id = 1, id = 2; Tasks/List fills only id (the container's, for a task)
    return {"id": _str(f, 1) or _str(f, 2), "pid": _int(f, 3), "status": TASK_STATUS.get(_int(f, 4), "unknown")}


def _mount(f):
    return {"type": _str(f, 1), "source": _str(f, 2), "target": _str(f, 3),
            "options": [o.decode("utf-8", "replace") for o in f.get(4, [])]}
