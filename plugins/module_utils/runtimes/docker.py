# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Docker container (dockerd with experimental features on, as checkpoints need), checkpointed by
``docker checkpoint create --checkpoint-dir <image dir>`` (Docker drives runc, which drives CRIU).

Docker restores only from a container's own checkpoint folder ("custom checkpointdir is not
supported"), so the restore copies the image's checkpoint there (hard links when it can) and runs
``docker start --checkpoint``. On a host that does not have the container (a migration's target),
it is first created again, under the same name, from the Config and HostConfig that
``docker inspect`` gave at checkpoint time, through the Engine API's /containers/create.

As with the other containers, the CUDA stage stays the engine's, on the container's host pids.
Docker, like Podman, checkpoints only a running container, so leave_stopped is refused.

GPUs: dockerd makes the container's spec on the host it is created on, so a container created again on a
target has that host's device numbers for the GPUs it asks for (CDI names, --device paths, --gpus), while
CRIU brings its /dev back as it was. The GPUs it had are recorded at the checkpoint from the spec dockerd
made (config.json in its containerd shim's bundle); after ``docker start --checkpoint``, before the GPU
memory comes back, its processes are put onto the GPUs of the new spec place by place and its /dev made
to match that spec (ContainerBackend.adopt_restored).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket

from ..core import procfs
from ..core.errors import CommandError, InvalidTarget
from . import criu_log
from .cli import RuntimeCli
from ..cuda import devices as gpu_devices
from .base import ContainerBackend, shim_bundle_spec
from .docker_cleanup import RESTORE_ID, new_restore_id, remove_containerd_copies

CHECKPOINT = "gpuckpt"


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to the Docker daemon over its unix socket (the Engine API's own transport)."""

    def __init__(self, sock_path, timeout):
        super(_UnixHTTPConnection, self).__init__("docker", timeout=timeout)  # "docker": the Host header
        self.sock_path = sock_path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.sock_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _api(sock_path, method, path, body=None, timeout=60, stage=None):
    """One request to the Docker Engine API over its unix socket: (status, the answer as JSON, or as
    text when it is not JSON). A daemon that cannot be reached, or whose answer is not HTTP, is a
    CommandError naming the request and the socket."""
    data = json.dumps(body).encode() if body is not None else b""
    conn = _UnixHTTPConnection(sock_path, timeout)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        status, payload = answer.status, answer.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        raise CommandError("the Docker API request %s %s over %s failed: %s" % (method, path, sock_path, exc),
                           stage=stage, details={"api": {"socket": sock_path, "method": method, "path": path}},
                           hint="is dockerd running, and is docker_host right?")
    finally:
        conn.close()
    try:
        return status, json.loads(payload or "null")
    except ValueError:
        return status, payload


class DockerBackend(ContainerBackend):
    name = "docker"
    capabilities = ContainerBackend.capabilities._replace(keeps_criu_plugins_off=False)  # dockerd runs its CRIU
    passes_criu_flags = ()  # docker checkpoint takes no CRIU options

    def __init__(self, docker_path=None, docker_host=None, criu_path=None, criu_options=(), timeout=None,
                 tcp_established=False):
        super(DockerBackend, self).__init__(criu_path, criu_options, timeout, tcp_established=tcp_established)
        self.docker_path, self.docker_host = docker_path, docker_host
        self.cli = RuntimeCli("docker", docker_path, "install docker, or pass docker_path",
                              ["--host", docker_host] if docker_host else [])

    def _socket(self):
        host = self.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        if not host.startswith("unix://"):
            raise InvalidTarget("docker_host %s: only a local unix socket is supported" % host, stage="preflight")
        return host[len("unix://"):]

    def inspect(self, container, required=True):
        return self.cli.describe(["container", "inspect", container], "docker container %r" % (container,),
                                 "check the name (docker ps) and docker_host", required, listed=True)

    def present(self):
        try:
            return self.cli.installed() and os.path.exists(self._socket())
        except InvalidTarget:
            return False

    def running_containers(self):
        ids = self.cli.run("ps", "--quiet", "--no-trunc", stage="facts").stdout.split()
        if not ids:
            return []
        res = self.cli.run("container", "inspect", "--format", "{{.Name}} {{.State.Pid}} {{.State.Status}}", *ids,
                           stage="facts")
        out = []
        for line in res.stdout.splitlines():
            name, pid, status = (line.split() + ["", "", ""])[:3]
            if pid.isdigit() and int(pid) > 0:
                out.append({"id": name.lstrip("/"), "pid": int(pid), "status": status})
        return out

    def runtime_facts(self):
        res = self.cli.run("version", "--format", "{{.Server.Version}} {{.Server.Experimental}}",
                           stage="preflight", hint="is dockerd running, and is docker_host right?")
        server, experimental = (res.stdout.split() + ["", ""])[:2]
        if experimental != "true":
            raise InvalidTarget("dockerd %s runs without experimental features, which `docker checkpoint` needs"
                                % server, stage="preflight",
                                hint='set "experimental": true in daemon.json and restart dockerd')
        return {"docker_version": server}

    def resolve(self, target):
        info = self.inspect(str(target))
        state = info.get("State") or {}
        if not state.get("Running") or state.get("Paused"):
            raise InvalidTarget("docker container %s is %s, not running; nothing was frozen"
                                % (target, state.get("Status")), stage="preflight")
        self.container = info["Name"].lstrip("/")
        self._info = info
        pid = int(state["Pid"])
        tree = procfs.process_tree(pid)
        self._ns = {str(p): procfs.ns_pid(p) for p in tree}
        # its GPUs, as the spec dockerd made for it names them (CDI's device nodes, --device, --gpus): what a
        # restore on another host, whose dockerd gives it that host's GPUs and numbers, maps from. A spec that
        # cannot be read records nothing (unknown), not "no GPU".
        spec = shim_bundle_spec(pid)
        self._gpus = None if spec is None else [{"uuid": g["uuid"], "minor": g["minor"]}
                                                for g in gpu_devices.spec_gpus(spec)]
        return pid, tree

    def dump(self, target, image_dir, work_dir, after):
        if after == "stopped":
            raise InvalidTarget("docker cannot hold a container stopped after its checkpoint", stage="preflight")
        if self.extra:
            raise InvalidTarget("criu options cannot be passed through docker checkpoint", stage="preflight")
        args = ["checkpoint", "create", "--checkpoint-dir", image_dir]
        if after == "running":
            args.append("--leave-running")
        args += [self.container, CHECKPOINT]
        res = self.cli.run(*args, stage="runtime-dump", timeout=self.timeout, check=False)
        if res.rc != 0:
            shutil.rmtree(os.path.join(image_dir, CHECKPOINT), ignore_errors=True)
            raise CommandError("docker checkpoint create exited with rc=%d" % res.rc, stage="runtime-dump",
                               cmd=res.cmd, rc=res.rc, stdout=res.stdout[-4000:],
                               stderr=criu_log.with_named_log(res.stderr)[-6000:])
        info = self._info
        return {"backend": self.name, "container": self.container, "container_id": info["Id"],
                "root_pid": int(target), "ns_pids": self._ns, "checkpoint": CHECKPOINT,
                "create": {"Config": info.get("Config"), "HostConfig": info.get("HostConfig")},
                "criu_seconds": round(res.seconds, 6), **({} if self._gpus is None else {"gpus": self._gpus})}

    def _create(self, manifest):
        spec = dict((manifest.get("runtime") or {}).get("create", {}).get("Config") or {})
        spec["HostConfig"] = (manifest.get("runtime") or {}).get("create", {}).get("HostConfig") or {}
        sock, path = self._socket(), "/containers/create?name=%s" % self.container
        status, body = _api(sock, "POST", path, spec, stage="runtime-restore")
        if status != 201:
            raise CommandError("creating container %s from its saved configuration failed (HTTP %d): %s"
                               % (self.container, status, body), stage="runtime-restore",
                               details={"api": {"socket": sock, "method": "POST", "path": path, "status": status,
                                                "body": body}},
                               hint="the container's image must be on this host")
        return body["Id"]

    def restore(self, image_dir, work_dir, manifest):
        self.bind(manifest)
        info = self.inspect(self.container, required=False)
        rt = manifest.get("runtime") or {}
        if info and (info.get("State") or {}).get("Running"):
            raise InvalidTarget("a docker container %s already runs on this host; refusing to start a second copy"
                                % self.container, stage="preflight")
        if info and info["Id"] != rt.get("container_id"):
            raise InvalidTarget("a different docker container named %s exists on this host" % self.container,
                                stage="preflight", hint="remove or rename it, or restore elsewhere")
        created = False
        if not info:
            cid = self._create(manifest)
            created = True
        else:
            cid = info["Id"]
        root = self.cli.run("info", "--format", "{{.DockerRootDir}}", stage="runtime-restore").stdout.strip()
        dest = os.path.join(root, "containers", cid, "checkpoints", CHECKPOINT)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        restore_id = new_restore_id()
        try:
            shutil.copytree(os.path.join(image_dir, rt.get("checkpoint", CHECKPOINT)), dest, copy_function=_link_or_copy)
            # Docker 20.10 uploads this folder to containerd as a tar; a tar equal to one containerd already
            # holds (the checkpoint's own) fails with "content ... already exists". A file of this restore's
            # own makes it differ; CRIU ignores files it does not know. It also names containerd's copy below.
            with open(os.path.join(dest, RESTORE_ID), "w") as fh:
                fh.write(restore_id + "\n")
            res = self.cli.run("start", "--checkpoint", CHECKPOINT, cid, stage="runtime-restore",
                               timeout=self.timeout, check=False)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
            remove_containerd_copies(restore_id)
        if res.rc != 0:
            if created:
                self.cli.run("rm", "--force", cid, stage="cleanup", check=False)
            raise CommandError("docker start --checkpoint exited with rc=%d" % res.rc, stage="runtime-restore",
                               cmd=res.cmd, rc=res.rc, stdout=res.stdout[-4000:],
                               stderr=criu_log.with_named_log(res.stderr)[-6000:])
        info = self.inspect(cid)
        pid = int(info["State"]["Pid"])
        tree = procfs.process_tree(pid)
        # dockerd made the container's spec here (this host's GPUs and device numbers); CRIU brought its /dev
        # back as it was on the source
        self.adopt_restored(manifest, pid, tree, shim_bundle_spec(pid))
        return tree

    def remove(self):
        self.cli.run("rm", "--force", self.container, stage="cleanup", check=False)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
