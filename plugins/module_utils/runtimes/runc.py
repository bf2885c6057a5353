# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A runc container, checkpointed and restored by runc (which drives CRIU).

The CUDA stage stays the engine's: the driver resolves pids in the host's pid namespace (measured on
driver 580), so the engine works on the container's host pids, found through ``runc state``.

- after=exit:    ``runc checkpoint`` (the container is gone afterwards; ``runc restore`` recreates it)
- after=running: ``runc checkpoint --leave-running``
- after=stopped: ``runc pause``, then ``runc checkpoint --leave-running``: the container stays frozen
  (cgroup freezer) until ``runc resume`` (roll back) or ``runc delete --force`` (commit).
A restored container's stdout and stderr go to a pipe read by a small detached relay that appends to
``<work dir>/container.log``: CRIU can only dump a container whose stdio are pipes, never host files.

On a cgroup v2 host runc hands CRIU no cgroup root (runc 1.1 and later), so CRIU would move the
restored container into the cgroup path it had on the source, not into the one the target's bundle
names (where runc put CRIU, and where ``runc pause``/``delete`` act). With an absolute
``linux.cgroupsPath`` in the target's bundle, the restore gives CRIU that path as its cgroup root
(``cgroup-root`` in a CRIU configuration file named by CRIU_CONFIG_FILE, which runc's CRIU inherits).
A destination cgroup that is frozen (a paused container of the same path on this host) would freeze
the restored process inside CRIU and hang the restore: that is refused before anything is restored.

runc marks each dump with an empty file ``checkpoint`` in the container's state dir (runc 1.1 and later, on CRIU's
post-dump notification) and removes it only when a restore of that container starts; no runc command depends on it.
A container left running (after=running), or held and later resumed (a rolled-back migration), would
keep it for the rest of its life: it is removed after such a dump.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess

from ..core import procfs
from ..cuda import devices as gpu_devices
from ..core.errors import CommandError, InvalidTarget
from .cli import RuntimeCli
from .base import ContainerBackend, mount_hint
from .oci import OciCliBackend
from .criu import no_plugins_dir, plugin_free_env

CGROUP2_ROOT = "/sys/fs/cgroup"  # the unified hierarchy; tests point this elsewhere
DEFAULT_ROOT = "/run/runc"  # runc's own default --root for root
DUMP_MARKER = "checkpoint"  # runc's empty marker of a dump, in <root>/<container id>/


def cgroup2_path(pid):
    """The cgroup v2 path of ``pid`` as the host sees it, or None on a host without a unified hierarchy."""
    if not os.path.exists(os.path.join(CGROUP2_ROOT, "cgroup.controllers")):
        return None
    return procfs.unified_cgroup(pid)


def cgroup2_frozen(path):
    """True when the cgroup v2 ``path`` exists on this host and is frozen."""
    try:
        with open(os.path.join(CGROUP2_ROOT, path.lstrip("/"), "cgroup.events")) as fh:
            return any(line.split() == ["frozen", "1"] for line in fh)
    except OSError:
        return False


def bundle_spec(bundle):
    """The OCI spec (config.json) of a bundle, or {} when it cannot be read."""
    try:
        with open(os.path.join(bundle or "", "config.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


class RuncBackend(OciCliBackend):
    name = "runc"
    capabilities = ContainerBackend.capabilities._replace(can_hold_stopped=True)  # paused (cgroup freezer)
    root_record = "runc_root"

    def __init__(self, runc_path=None, root=None, bundle=None, criu_path=None, criu_options=(), timeout=None,
                 tcp_established=False):
        super(RuncBackend, self).__init__(criu_path, criu_options, timeout, tcp_established=tcp_established)
        self.runc_path = runc_path
        self.root = root
        self.bundle = bundle
        self._bundle_seen = self._cgroup_seen = None
        self._ns = {}  # the tree's pids inside the container, by host pid (resolve)
        self.cli = self._make_cli()

    # -- helpers -------------------------------------------------------------------------------
    def _make_cli(self):
        """runc with its state's root (made again when bind takes the image's root)."""
        return RuntimeCli("runc", self.runc_path, "install runc, or pass runc_path", ["--root", self.root] if self.root else [])

    # runc passes its own options to CRIU; ours go through a CRIU configuration file only, so only
    # the flags runc knows are offered here.
    passes_criu_flags = ("--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks")
    # runc's CRIU inherits CRIU_CONFIG_FILE, and runc sets neither in its requests: how CRIU locks the TCP
    # connections (nftables, where the host has no iptables-restore) and the largest deleted file it dumps
    criu_config_options = ("--network-lock", "--ghost-limit")

    def present(self):
        return self.cli.installed() and os.path.isdir(self.root or "/run/runc")

    # -- Backend ---------------------------------------------------------------------------------
    def runtime_facts(self):
        res = self.cli.run("--version", stage="preflight")
        return {"runc_version": res.stdout.splitlines()[0].split()[-1] if res.stdout else None}

    def resolve(self, target):
        st = self.running_state(target)
        pid = int(st["pid"])
        self._cgroup_seen = cgroup2_path(pid)
        tree = procfs.process_tree(pid)
        self._ns = {str(p): procfs.ns_pid(p) for p in tree}
        return pid, tree

    def dump(self, target, image_dir, work_dir, after):
        on_cli, config_lines = self.split_criu_flags(self.criu_flags())
        if after == "stopped":
            self.cli.run("pause", self.container, stage="runtime-dump")
        args = ["checkpoint", "--image-path", image_dir, "--work-path", work_dir]
        if after in ("running", "stopped"):
            args.append("--leave-running")
        args += on_cli + [self.container]
        try:
            # runc's CRIU inherits this environment: a configuration with the options runc has no flag for, and
            # an empty plugin directory (criu.py)
            with no_plugins_dir(work_dir) as libdir:
                res = self.cli.run(*args, stage="runtime-dump", timeout=self.timeout, new_session=True,
                                   env=plugin_free_env(libdir, os.path.join(work_dir, "criu-dump.conf"), config_lines),
                                   hint="see dump.log in the work dir")
        except CommandError as exc:
            log = os.path.join(work_dir, "dump.log")
            if os.path.exists(log):
                with open(log, errors="replace") as fh:
                    exc.stderr = (exc.stderr or "") + "\n--- %s ---\n" % log + "".join(
                        [ln for ln in fh if "Error" in ln][-15:])
            exc.hint = mount_hint(exc.stderr, exc.hint)
            if after == "stopped":
                self.cli.run("resume", self.container, stage="runtime-dump", check=False)
            raise
        if after in ("running", "stopped"):  # the container lives on here, and so would runc's marker
            self.remove_dump_marker()
        return {"backend": self.name, "container": self.container, "root_pid": int(target),
                "bundle": self._bundle_seen, "runc_root": self.root, "ns_pids": self._ns,
                # the container's GPUs, by UUID: what a restore into a bundle that names others maps from
                "gpus": [{"uuid": g["uuid"], "minor": g["minor"]}
                         for g in gpu_devices.spec_gpus(bundle_spec(self._bundle_seen))],
                "cgroup_v2_path": self._cgroup_seen, "criu_options": self.extra, "auto_flags": list(self.auto_flags),
                "criu_seconds": round(res.seconds, 6)}

    def cgroup_env(self, bundle, manifest, work_dir):
        """The environment for ``runc restore`` that puts the restored container into the cgroup the
        target's bundle names, on a cgroup v2 host (see the module's doc). None: nothing to change.
        Raises InvalidTarget when the restore would move the container into a frozen cgroup."""
        src = (manifest.get("runtime") or {}).get("cgroup_v2_path")
        if not src or not os.path.exists(os.path.join(CGROUP2_ROOT, "cgroup.controllers")):
            return None
        want = (bundle_spec(bundle).get("linux") or {}).get("cgroupsPath") or ""
        # Only an absolute cgroupfs path is where runc surely puts the container; a systemd
        # "slice:prefix:name" or a relative path is left to runc and CRIU as they are.
        env, dest = None, src
        if want.startswith("/") and ":" not in want and os.path.normpath(want) != os.path.normpath(src):
            dest = os.path.normpath(want)
            conf = os.path.join(work_dir, "criu-cgroup-root.conf")
            with open(conf, "w") as fh:
                user = os.environ.get("CRIU_CONFIG_FILE")
                if user and os.path.isfile(user):  # keep what the user configured; this line comes last
                    with open(user) as ufh:
                        fh.write(ufh.read().rstrip("\n") + "\n")
                fh.write("cgroup-root %s\n" % dest)
            env = dict(os.environ, CRIU_CONFIG_FILE=conf)
        if cgroup2_frozen(dest):
            raise InvalidTarget("cgroup %s is frozen on this host (a paused container?): CRIU would move the restored "
                                "container into it and hang; nothing was restored" % dest, stage="preflight",
                                hint="resume or delete what is paused there, or give the target's bundle a "
                                     "linux.cgroupsPath of its own")
        return env

    def devices_for(self, bundle, manifest):
        """The target bundle's spec, checked against this host's devices (runc builds the container's device
        cgroup from the spec's numbers: a spec made on another node would deny the GPU its job reopens), and
        the driver's GPU pairs that put the container's processes onto the GPUs that spec gives it."""
        spec = bundle_spec(bundle)
        stale = gpu_devices.stale_spec_devices(spec)
        if stale:
            raise InvalidTarget("the bundle's config.json names device numbers other than this host's (%s); "
                                "nothing was restored" % ", ".join("%s %s:%s, here %d:%d" % (
                                    e.get("path"), e.get("major"), e.get("minor"), ma, mi) for e, ma, mi in stale[:3]),
                                stage="preflight", hint="make the target's bundle on the target (nvidia-ctk cdi "
                                                        "generate and your runtime's spec), or pass bundle")
        return spec, self.placement(manifest, spec)

    def restore(self, image_dir, work_dir, manifest):
        bundle = self.restore_bundle(manifest)
        spec, pairs = self.devices_for(bundle, manifest)
        env = self.cgroup_env(bundle, manifest, work_dir)
        log = open(os.path.join(work_dir, "container.log"), "ab")
        # The relay holds the read end of the container's stdio pipe and outlives this module.
        relay = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
        log.close()
        try:
            on_cli, config_lines = self.split_criu_flags(self.criu_flags(manifest))
            args = ["restore", "--detach", "--image-path", image_dir, "--work-path", work_dir, "--bundle", bundle]
            args += on_cli + [self.container]
            with no_plugins_dir(work_dir) as libdir:  # (after cgroup_env's configuration, which it keeps)
                rc = self.cli.run_detaching(args, relay.stdin, relay.stdin, timeout=self.timeout,
                                            env=plugin_free_env(libdir, os.path.join(work_dir, "criu-restore.conf"),
                                                                config_lines, env=env))
        finally:
            relay.stdin.close()
        if rc != 0:
            rlog = os.path.join(work_dir, "restore.log")
            lines = []
            if os.path.exists(rlog):
                with open(rlog, errors="replace") as fh:
                    lines = fh.readlines()
            if rc is None:  # hung: where CRIU stopped says more than its (absent) errors
                raise CommandError("runc restore did not finish within runtime_timeout (%ss) and was killed with "
                                   "its CRIU" % self.timeout, stage="runtime-restore", cmd=self.cli.argv(*args),
                                   stderr="".join(lines[-8:]), hint="see restore.log in the work dir")
            raise CommandError("runc restore exited with rc=%d" % rc, stage="runtime-restore",
                               cmd=self.cli.argv(*args), rc=rc, stderr="".join([ln for ln in lines if "Error" in ln][-15:]))
        st = self.state(self.container)
        pid = int(st["pid"])
        tree = procfs.process_tree(pid)
        try:
            self.adopt_devices(pid, tree, spec, pairs, sync=gpu_devices.lists_nvidia_devices(spec))
        except Exception:
            self.remove()  # restored, but its GPUs cannot be given back: no copy is left behind
            raise
        return tree

    def is_held(self, pids):
        st = self.state(self.container, required=False) if self.container else None
        return st is None or st.get("status") == "paused"

    def resume(self, pids):
        if self.container:
            self.cli.run("resume", self.container, stage="resume-source", check=False)
            self.remove_dump_marker()  # a container held by an earlier version still has it

    def remove_dump_marker(self):
        """Remove runc's marker of a dump (see the module's doc) from the container's state dir: only
        that empty regular file, nothing else. Returns its path when it was removed."""
        if not self.container or os.sep in self.container or self.container in (".", ".."):
            return None
        path = os.path.join(self.root or DEFAULT_ROOT, self.container, DUMP_MARKER)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size:
                return None
            os.unlink(path)
        except OSError:
            return None
        return path

    def remove(self):
        self.cli.run("delete", "--force", self.container, stage="cleanup", check=False)
