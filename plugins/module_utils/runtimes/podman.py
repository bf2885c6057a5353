# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Podman container, checkpointed to ``<image dir>/container.tar`` by ``podman container checkpoint
--export`` and brought back by ``podman container restore --import`` (Podman drives CRIU).

As with runc, the CUDA stage stays the engine's, on the container's host pids (``podman inspect``);
after a restore the CUDA processes are found again by their pid inside the container.

- after=exit:    checkpoint, then the stopped container is removed: the image is the container now
- after=running: checkpoint --leave-running
- after=stopped: refused. Podman checkpoints only a running container: not a paused one, and a
  SIGSTOPped one hangs CRIU on the cgroup freezer (tried with Podman 4.3.1). A migration of a Podman
  container therefore lets the source exit, and rolls back by restoring the source's own image.
The export is uncompressed: GPU memory does not compress, and gzip would cost downtime.

GPUs: the GPUs the container had are recorded at the checkpoint from the spec Podman made for it. Podman
restores under the spec its export carries, so an export whose spec names other device numbers than this
host's is imported from a copy given this host's numbers (podman_export.py); after the restore, before the
GPU memory comes back, the processes go onto this host's GPUs of the same places and the container's /dev is
made to match its spec (ContainerBackend.adopt_restored).
"""
from __future__ import annotations

import json
import os

from ..core import procfs
from ..core.errors import CommandError, InvalidTarget
from . import criu_log
from .cli import RuntimeCli
from ..cuda import devices as gpu_devices
from .base import ContainerBackend, ns_pid, read_oci_spec
from .podman_export import retarget_export

EXPORT = "container.tar"


class PodmanBackend(ContainerBackend):
    name = "podman"
    capabilities = ContainerBackend.capabilities._replace(keeps_criu_plugins_off=False)  # its own environment for CRIU
    root_record = "podman_root"

    def __init__(self, podman_path=None, root=None, runroot=None, criu_path=None, criu_options=(), timeout=None,
                 tcp_established=False):
        super(PodmanBackend, self).__init__(criu_path, criu_options, timeout, tcp_established=tcp_established)
        self.podman_path, self.root, self.runroot = podman_path, root, runroot
        self._network_mode = None  # (the container's, read by resolve)
        self.cli = self._make_cli()

    def _make_cli(self):
        """podman with its storage's root and runroot (made again when bind takes the image's root)."""
        return RuntimeCli("podman", self.podman_path, "install podman, or pass podman_path",
                          (["--root", self.root] if self.root else []) + (["--runroot", self.runroot] if self.runroot else []))

    def inspect(self, container, required=True):
        return self.cli.describe(["container", "inspect", "--format", "json", container],
                                 "podman container %r" % (container,), "check the name (podman ps) and podman_root",
                                 required, listed=True)

    passes_criu_flags = ("--tcp-established", "--file-locks")

    def present(self):
        return self.cli.installed() and \
            os.path.isdir(self.root or "/var/lib/containers/storage")

    def running_containers(self):
        res = self.cli.run("ps", "--format", "json", stage="facts")
        return [{"id": (c.get("Names") or [c.get("Id")])[0], "pid": int(c["Pid"]), "status": c.get("State")}
                for c in json.loads(res.stdout or "null") or [] if c.get("Pid")]

    def runtime_facts(self):
        res = self.cli.run("--version", stage="preflight")
        return {"podman_version": res.stdout.split()[-1] if res.stdout else None}

    def resolve(self, target):
        info = self.inspect(str(target))
        state = info.get("State") or {}
        if state.get("Status") != "running":
            raise InvalidTarget("podman container %s is %s, not running; nothing was frozen"
                                % (target, state.get("Status")), stage="preflight")
        self.container = info.get("Name") or str(target)
        self._id = info.get("Id")
        self._network_mode = (info.get("HostConfig") or {}).get("NetworkMode")
        pid = int(state["Pid"])
        tree = procfs.process_tree(pid)
        self._ns = {str(p): ns_pid(p) for p in tree}
        # its GPUs, as the spec Podman made for it names them (CDI, --device): what a restore onto other GPUs
        # maps from; a spec that cannot be read records nothing (unknown), not "no GPU"
        spec = read_oci_spec(info.get("OCIConfigPath") or "")
        self._gpus = None if spec is None else [{"uuid": g["uuid"], "minor": g["minor"]}
                                                for g in gpu_devices.spec_gpus(spec)]
        return pid, tree

    def plan_tree(self, pids, internal_tcp=False):
        """The tree's plan (Backend.plan_tree), and one refusal of Podman's own: a container on network mode "none"
        that holds established TCP connections (a distributed job's rendezvous and ranks). Podman 4.3.1 restores
        such a container into a network namespace whose loopback is down, where CRIU cannot connect them again
        ("Network is unreachable"): its checkpoint would be an image that no restore brings back."""
        flags = super(PodmanBackend, self).plan_tree(pids, internal_tcp=internal_tcp)
        if (self.criu_needs or {}).get("tcp") and self._network_mode == "none":
            raise InvalidTarget("podman container %s runs with network mode none and holds established TCP "
                                "connections (%s); Podman restores such a container into a network namespace whose "
                                "loopback is down, where CRIU cannot connect them again; nothing was frozen"
                                % (self.container, ", ".join(self.criu_needs["tcp"][:3])), stage="preflight",
                                hint="run the container on the host's network (--network host) or a bridge network")
        return flags

    def dump(self, target, image_dir, work_dir, after):
        if after == "stopped":
            raise InvalidTarget("podman cannot hold a container stopped after its checkpoint (it checkpoints only a "
                                "running container); checkpoint it with exit, and restore its image to roll back",
                                stage="preflight")
        args = ["container", "checkpoint", "--export", os.path.join(image_dir, EXPORT), "--compress", "none"]
        if after == "running":
            args.append("--leave-running")
        args += self.criu_flags() + [self.container]
        res = self.cli.run(*args, stage="runtime-dump", timeout=self.timeout, check=False)
        if res.rc != 0:
            try:
                os.unlink(os.path.join(image_dir, EXPORT))
            except OSError:
                pass
            raise CommandError("podman container checkpoint exited with rc=%d" % res.rc, stage="runtime-dump",
                               cmd=res.cmd, rc=res.rc, stdout=res.stdout[-4000:],
                               stderr=criu_log.with_named_log(res.stderr)[-6000:])
        if after == "exit":  # the exported image is the container now; its name is free for the restore
            self.cli.run("container", "rm", "--force", self.container, stage="runtime-dump", check=False)
        return {"backend": self.name, "container": self.container, "container_id": self._id,
                "root_pid": int(target), "podman_root": self.root, "ns_pids": self._ns, "export": EXPORT,
                "criu_options": self.extra, "auto_flags": list(self.auto_flags), "criu_seconds": round(res.seconds, 6),
                **({} if self._gpus is None else {"gpus": self._gpus})}

    def restore(self, image_dir, work_dir, manifest):
        self.bind(manifest)
        existing = self.inspect(self.container, required=False)
        if existing:
            raise InvalidTarget("a podman container %s already exists on this host (%s); refusing to start a second "
                                "copy" % (self.container, (existing.get("State") or {}).get("Status")),
                                stage="preflight", hint="remove it (podman rm) if it is a leftover, or restore elsewhere")
        export, retargeted = retarget_export(os.path.join(image_dir, EXPORT), work_dir)
        try:
            args = ["container", "restore", "--import", export] + self.criu_flags(manifest)
            res = self.cli.run(*args, stage="runtime-restore", timeout=self.timeout, check=False)
        finally:
            if export != os.path.join(image_dir, EXPORT):
                os.unlink(export)
        if res.rc != 0:
            copied = "" if not retargeted else (
                " (imported from a copy of the export with this host's device numbers: %s)" % ", ".join(retargeted))
            raise CommandError("podman container restore exited with rc=%d%s" % (res.rc, copied), stage="runtime-restore",
                               cmd=res.cmd, rc=res.rc, stdout=res.stdout[-4000:],
                               stderr=criu_log.with_named_log(res.stderr)[-6000:])
        info = self.inspect(self.container)
        pid = int(info["State"]["Pid"])
        tree = procfs.process_tree(pid)
        self.adopt_restored(manifest, pid, tree, read_oci_spec(info.get("OCIConfigPath") or ""))
        return tree

    def remove(self):
        self.cli.run("container", "rm", "--force", self.container, stage="cleanup", check=False)
