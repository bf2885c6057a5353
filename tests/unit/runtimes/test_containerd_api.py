"""runtimes/containerd_api.py against a containerd TEST DOUBLE: a gRPC server on a unix socket built from the
servicer base classes generated from containerd's .proto files (containerd_proto), holding containers, tasks and
snapshots per namespace as containerd does. What is checked is what containerd would receive and what the backend
gets back: the right namespace, the runc options its shim reads, a missing object as None, failures as
ContainerdError with their gRPC code."""
from __future__ import annotations

import os
import sys
import threading
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")

# pylint: disable=wrong-import-position
from google.protobuf import empty_pb2  # noqa: E402

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import InvalidTarget  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import containerd_api  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_api import (  # noqa: E402
    RUNC_CHECKPOINT_OPTIONS_URL, RUNC_OPTIONS_URL, Client, ContainerdError, runc_options)
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_proto import (  # noqa: E402
    containers_pb2, containers_pb2_grpc, namespace_pb2, namespace_pb2_grpc, oci_pb2, snapshots_pb2,
    snapshots_pb2_grpc, task_pb2, tasks_pb2, tasks_pb2_grpc, version_pb2, version_pb2_grpc)

SPEC_URL = "types.containerd.io/opencontainers/runtime-spec/1/Spec"


class FakeContainerd(object):
    """The state the servicers share: {namespace: {id: Container}}, tasks {(namespace, id): Process}, snapshots
    {(snapshotter, key): Info}, and every request received as (method, namespace, request)."""

    def __init__(self):
        self.containers, self.tasks, self.snapshots, self.calls = {"default": {}, "k8s.io": {}}, {}, {}, []
        self.lock = threading.Lock()

    def seen(self, method, request, context):
        ns = dict(context.invocation_metadata()).get("containerd-namespace")
        with self.lock:
            self.calls.append((method, ns, request))
        return ns

    def sent(self, method):
        return [req for m, unused, req in self.calls if m == method]


def _not_found(context, what):
    context.abort(grpc.StatusCode.NOT_FOUND, "%s: not found" % what)


class Containers(containers_pb2_grpc.ContainersServicer):
    def __init__(self, state):
        self.state = state

    def Get(self, request, context):
        ns = self.state.seen("Containers/Get", request, context)
        c = self.state.containers.get(ns, {}).get(request.id)
        if c is None:
            _not_found(context, "container %r" % request.id)
        return containers_pb2.GetContainerResponse(container=c)

    def List(self, request, context):
        ns = self.state.seen("Containers/List", request, context)
        return containers_pb2.ListContainersResponse(containers=list(self.state.containers.get(ns, {}).values()))

    def Create(self, request, context):
        ns = self.state.seen("Containers/Create", request, context)
        if request.container.id in self.state.containers[ns]:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, "container %r: already exists" % request.container.id)
        c = containers_pb2.Container()
        c.CopyFrom(request.container)
        c.created_at.seconds, c.created_at.nanos = 1700000000, 5
        self.state.containers[ns][c.id] = c
        return containers_pb2.CreateContainerResponse(container=c)

    def Update(self, request, context):
        ns = self.state.seen("Containers/Update", request, context)
        c = self.state.containers[ns][request.container.id]
        for path in request.update_mask.paths:
            getattr(c, path).CopyFrom(getattr(request.container, path))
        return containers_pb2.UpdateContainerResponse(container=c)

    def Delete(self, request, context):
        ns = self.state.seen("Containers/Delete", request, context)
        if self.state.containers[ns].pop(request.id, None) is None:
            _not_found(context, "container %r" % request.id)
        return empty_pb2.Empty()


class Tasks(tasks_pb2_grpc.TasksServicer):
    def __init__(self, state):
        self.state = state

    def _task(self, ns, container_id, context):
        t = self.state.tasks.get((ns, container_id))
        if t is None:
            _not_found(context, "task %s" % container_id)
        return t

    def Get(self, request, context):
        ns = self.state.seen("Tasks/Get", request, context)
        return tasks_pb2.GetResponse(process=self._task(ns, request.container_id, context))

    def List(self, request, context):
        ns = self.state.seen("Tasks/List", request, context)
        # as containerd: a listed task carries the container's id in ``id`` only
        return tasks_pb2.ListTasksResponse(tasks=[task_pb2.Process(id=t.container_id, pid=t.pid, status=t.status)
                                                  for (n, unused), t in sorted(self.state.tasks.items()) if n == ns])

    def Create(self, request, context):
        ns = self.state.seen("Tasks/Create", request, context)
        self.state.tasks[(ns, request.container_id)] = task_pb2.Process(container_id=request.container_id, pid=4242,
                                                                        status=task_pb2.RUNNING)
        return tasks_pb2.CreateTaskResponse(container_id=request.container_id, pid=4242)

    def Pause(self, request, context):
        ns = self.state.seen("Tasks/Pause", request, context)
        self._task(ns, request.container_id, context).status = task_pb2.PAUSED
        return empty_pb2.Empty()

    def Checkpoint(self, request, context):
        self.state.seen("Tasks/Checkpoint", request, context)
        return tasks_pb2.CheckpointTaskResponse()

    def Kill(self, request, context):
        ns = self.state.seen("Tasks/Kill", request, context)
        t = self._task(ns, request.container_id, context)
        threading.Timer(0.2, setattr, (t, "status", task_pb2.STOPPED)).start()  # it takes containerd a moment
        return empty_pb2.Empty()

    def Delete(self, request, context):
        ns = self.state.seen("Tasks/Delete", request, context)
        t = self._task(ns, request.container_id, context)
        del self.state.tasks[(ns, request.container_id)]
        return tasks_pb2.DeleteResponse(id=t.container_id, pid=t.pid)


class Snapshots(snapshots_pb2_grpc.SnapshotsServicer):
    def __init__(self, state):
        self.state = state

    def Stat(self, request, context):
        self.state.seen("Snapshots/Stat", request, context)
        info = self.state.snapshots.get((request.snapshotter, request.key))
        if info is None:
            _not_found(context, "snapshot %s" % request.key)
        return snapshots_pb2.StatSnapshotResponse(info=info)

    def Prepare(self, request, context):
        self.state.seen("Snapshots/Prepare", request, context)
        self.state.snapshots[(request.snapshotter, request.key)] = snapshots_pb2.Info(
            name=request.key, parent=request.parent, kind=snapshots_pb2.ACTIVE)
        return snapshots_pb2.PrepareSnapshotResponse(mounts=[_overlay(request.key)])

    def Mounts(self, request, context):
        self.state.seen("Snapshots/Mounts", request, context)
        return snapshots_pb2.MountsResponse(mounts=[_overlay(request.key)])


def _overlay(key):
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_proto import mount_pb2
    return mount_pb2.Mount(type="overlay", source="overlay",
                           options=["index=off", "workdir=/snap/%s/work" % key, "upperdir=/snap/%s/fs" % key,
                                    "lowerdir=/snap/1/fs"])


class Namespaces(namespace_pb2_grpc.NamespacesServicer):
    def __init__(self, state):
        self.state = state

    def List(self, request, context):
        self.state.seen("Namespaces/List", request, context)
        return namespace_pb2.ListNamespacesResponse(
            namespaces=[namespace_pb2.Namespace(name=n) for n in reversed(sorted(self.state.containers))])


class Version(version_pb2_grpc.VersionServicer):
    def Version(self, request, context):
        return version_pb2.VersionResponse(version="v2.1.9", revision="test double")


@pytest.fixture
def containerd(tmp_path):
    """(the double's state, its socket's path): containerd's API on a unix socket."""
    state = FakeContainerd()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    containers_pb2_grpc.add_ContainersServicer_to_server(Containers(state), server)
    tasks_pb2_grpc.add_TasksServicer_to_server(Tasks(state), server)
    snapshots_pb2_grpc.add_SnapshotsServicer_to_server(Snapshots(state), server)
    namespace_pb2_grpc.add_NamespacesServicer_to_server(Namespaces(state), server)
    version_pb2_grpc.add_VersionServicer_to_server(Version(), server)
    sock = str(tmp_path / "containerd.sock")
    server.add_insecure_port("unix://" + sock)
    server.start()
    yield state, sock
    server.stop(None)


def _record(**extra):
    record = {"id": "job", "labels": {"app": "train", "io.cri-containerd.kind": "container"},
              "image": "docker.io/library/train:1", "runtime": "io.containerd.runc.v2",
              "runtime_options_url": RUNC_OPTIONS_URL,
              "runtime_options": oci_pb2.Options(systemd_cgroup=True, root="/run/runc-k8s").SerializeToString(),
              "spec_url": SPEC_URL, "spec": {"ociVersion": "1.1.0", "process": {"args": ["python3", "train.py"]}},
              "snapshotter": "overlayfs", "snapshot_key": "job-snap", "sandbox": ""}
    record.update(extra)
    return record


def test_a_created_container_reads_back_as_it_was_recorded(containerd):
    state, sock = containerd
    api = Client(sock, "k8s.io", timeout=5)
    api.create_container(_record(sandbox="pod-sandbox"), "runtime-restore")
    got = api.container("job")
    assert got["id"] == "job" and got["labels"] == {"app": "train", "io.cri-containerd.kind": "container"}
    assert got["spec"] == {"ociVersion": "1.1.0", "process": {"args": ["python3", "train.py"]}}
    assert got["spec_url"] == SPEC_URL and got["runtime"] == "io.containerd.runc.v2"
    assert got["runtime_options_url"] == RUNC_OPTIONS_URL
    assert oci_pb2.Options.FromString(got["runtime_options"]) == oci_pb2.Options(systemd_cgroup=True, root="/run/runc-k8s")
    assert (got["snapshotter"], got["snapshot_key"], got["sandbox"]) == ("overlayfs", "job-snap", "pod-sandbox")
    assert got["created_at"] == "1700000000.000000005"
    # it went into the namespace asked for, and only there
    assert [c["id"] for c in api.containers()] == ["job"]
    assert Client(sock, "default", timeout=5).container("job") is None
    assert {ns for unused, ns, unused in state.calls} == {"k8s.io", "default"}
    api.close()


def test_missing_objects_are_none_and_other_failures_name_the_call(containerd):
    unused, sock = containerd
    api = Client(sock, "default", timeout=5)
    assert api.container("nope") is None and api.task("nope") is None
    assert api.snapshot("overlayfs", "nope") is None
    api.create_container(_record(), "runtime-restore")
    with pytest.raises(ContainerdError) as err:
        api.create_container(_record(), "runtime-restore")
    assert err.value.code == "ALREADY_EXISTS" and err.value.stage == "runtime-restore"
    assert "containerd Containers/Create (namespace default) failed: ALREADY_EXISTS" in err.value.msg
    with pytest.raises(ContainerdError) as err:
        api.delete_task("nope", "cleanup")
    assert err.value.code == "NOT_FOUND" and err.value.stage == "cleanup"


def test_a_socket_without_containerd_is_unavailable_with_a_hint(tmp_path):
    api = Client(str(tmp_path / "none.sock"), "default", timeout=2)
    with pytest.raises(ContainerdError) as err:
        api.namespaces()
    assert err.value.code == "UNAVAILABLE" and err.value.stage == "preflight"
    assert str(tmp_path / "none.sock") in err.value.hint


def test_reads_namespaces_version_tasks_snapshots(containerd):
    state, sock = containerd
    state.tasks[("default", "job")] = task_pb2.Process(container_id="job", pid=77, status=task_pb2.RUNNING)
    state.tasks[("default", "old")] = task_pb2.Process(container_id="old", pid=0, status=task_pb2.STOPPED)
    state.tasks[("default", "new")] = task_pb2.Process(container_id="new", pid=5, status=9)  # a state unknown here
    state.snapshots[("overlayfs", "job-snap")] = snapshots_pb2.Info(name="job-snap", parent="sha256:layer",
                                                                    kind=snapshots_pb2.ACTIVE)
    api = Client(sock, "default", timeout=5)
    assert api.namespaces() == ["default", "k8s.io"]
    assert api.version() == "v2.1.9"
    assert api.task("job") == {"id": "job", "pid": 77, "status": "running"}
    assert api.tasks() == [{"id": "job", "pid": 77, "status": "running"}, {"id": "new", "pid": 5, "status": "unknown"},
                           {"id": "old", "pid": 0, "status": "stopped"}]
    assert api.snapshot("overlayfs", "job-snap") == {"name": "job-snap", "parent": "sha256:layer",
                                                     "kind": snapshots_pb2.ACTIVE}
    assert api.mounts("overlayfs", "job-snap")[0]["options"][2] == "upperdir=/snap/job-snap/fs"


def test_checkpoint_hands_runc_its_checkpoint_options(containerd):
    """What containerd's runc shim reads: the options under containerd's own type URL (no
    type.googleapis.com/ prefix), CRIU's image and work paths, the CRIU flags asked for."""
    state, sock = containerd
    Client(sock, "default", timeout=5).checkpoint("job", "/img/checkpoint", "/work", exit_after=True, open_tcp=True,
                                                  file_locks=True, timeout=30)
    (req,) = state.sent("Tasks/Checkpoint")
    assert req.container_id == "job" and req.options.type_url == RUNC_CHECKPOINT_OPTIONS_URL
    assert oci_pb2.CheckpointOptions.FromString(req.options.value) == oci_pb2.CheckpointOptions(
        exit=True, open_tcp=True, file_locks=True, image_path="/img/checkpoint", work_path="/work")


def test_restore_creates_the_task_from_the_image_directory(containerd):
    state, sock = containerd
    api = Client(sock, "default", timeout=5)
    api.create_container(_record(), "runtime-restore")
    rootfs = api.prepare_snapshot("overlayfs", "job-snap", "sha256:layer", "runtime-restore")
    options = runc_options(_record()["runtime_options"], criu_work_path="/work")
    pid = api.restore_task("job", rootfs, "file:///work/container.log", "/img/checkpoint", RUNC_OPTIONS_URL, options)
    assert pid == 4242
    (req,) = state.sent("Tasks/Create")
    assert dict(req.checkpoint.annotations) == {"RestoreFromPath": "/img/checkpoint"}
    assert req.stdout == req.stderr == "file:///work/container.log" and not req.stdin
    assert [(m.type, m.source, list(m.options)) for m in req.rootfs] == [(m["type"], m["source"], m["options"])
                                                                         for m in rootfs]
    assert req.options.type_url == RUNC_OPTIONS_URL
    assert oci_pb2.Options.FromString(req.options.value).criu_work_path == "/work"
    assert state.snapshots[("overlayfs", "job-snap")].parent == "sha256:layer"


def test_update_spec_replaces_only_the_spec(containerd):
    state, sock = containerd
    api = Client(sock, "default", timeout=5)
    api.create_container(_record(), "preflight")
    spec = dict(_record()["spec"], linux={"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195}]})
    api.update_spec("job", spec, SPEC_URL, "preflight")
    (req,) = state.sent("Containers/Update")
    assert list(req.update_mask.paths) == ["spec"]
    got = api.container("job")
    assert got["spec"] == spec and got["labels"]["app"] == "train" and got["snapshot_key"] == "job-snap"


def test_kill_then_wait_until_the_task_stopped(containerd):
    state, sock = containerd
    state.tasks[("default", "job")] = task_pb2.Process(container_id="job", pid=77, status=task_pb2.PAUSED)
    api = Client(sock, "default", timeout=5)
    api.kill("job", 9, "cleanup")
    (req,) = state.sent("Tasks/Kill")
    assert (req.signal, req.all) == (9, True)
    assert api.wait_stopped("job", 5, "cleanup") is True
    api.delete_task("job", "cleanup")
    assert api.wait_stopped("job", 0, "cleanup") is True  # gone
    state.tasks[("default", "stuck")] = task_pb2.Process(container_id="stuck", pid=78, status=task_pb2.RUNNING)
    assert api.wait_stopped("stuck", 0.3, "cleanup") is False


def test_runc_options_change_only_the_named_fields_and_keep_unknown_ones():
    """containerd 1.x's criu_path (field 8, gone from 2.x's .proto) survives a restore's changes byte for byte."""
    criu_path = b"\x42\x0a/opt/criu!"  # field 8, length 10
    original = oci_pb2.Options(systemd_cgroup=True, root="/run/runc", criu_image_path="/old/img",
                               criu_work_path="/old/work", binary_name="nvidia-container-runtime").SerializeToString()
    changed = runc_options(original + criu_path, root="/run/runc-restore", criu_image_path=None,
                           criu_work_path="/work")
    opts = oci_pb2.Options.FromString(changed)
    assert opts == oci_pb2.Options.FromString(
        oci_pb2.Options(systemd_cgroup=True, root="/run/runc-restore", criu_work_path="/work",
                        binary_name="nvidia-container-runtime").SerializeToString() + criu_path)
    assert criu_path in changed and b"/old/img" not in changed
    assert oci_pb2.Options.FromString(runc_options(b"", criu_work_path="/w")).criu_work_path == "/w"


def test_runc_options_refuse_what_is_not_runcs():
    with pytest.raises(InvalidTarget) as err:
        runc_options(b"\x0a\xff")  # a truncated string
    assert err.value.stage == "preflight" and RUNC_OPTIONS_URL in err.value.msg


def test_a_host_without_protobuf_is_told_what_to_install(monkeypatch, tmp_path):
    package = sys.modules[containerd_api.__name__.rsplit(".", 1)[0] + ".containerd_proto"]
    monkeypatch.delattr(package, "tasks_pb2")
    monkeypatch.setitem(sys.modules, package.__name__ + ".tasks_pb2", None)  # its import fails, as without protobuf
    with pytest.raises(InvalidTarget) as err:
        Client(os.path.join(str(tmp_path), "containerd.sock")).task("job")
    assert "protobuf" in err.value.msg and "python3-protobuf" in err.value.hint and err.value.stage == "preflight"
