# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One small interface that every runtime backend (process/CRIU, runc, containerd, ...) implements.

The engine owns the CUDA stage and the transaction; a backend only knows its runtime:
which host pids make up the workload, how to write RAM+CPU state to an image dir and back.
"""
from __future__ import annotations

import abc
import copy
import json
import os
import signal
from collections import namedtuple

from ..core import procfs
from ..core.procfs import ns_pid
from ..cuda import driver as cuda
from ..cuda import devices as gpu_devices
from .criu import Criu
from . import tree_plan
from ..core.errors import GpuCkptError, InvalidTarget
from ..core.run import find_binary, run


def read_oci_spec(path):
    """An OCI spec (config.json) read from ``path``; None when it cannot be read."""
    try:
        with open(path) as fh:
            spec = json.load(fh)
        return spec if isinstance(spec, dict) else None
    except (OSError, ValueError):
        return None


def shim_bundle_spec(pid):
    """The OCI spec that the container whose init is ``pid`` was started under by a containerd shim (Docker's
    containers): config.json in the shim's bundle, the directory containerd starts each shim in (its cwd),
    the shim being the init's parent. None when it cannot be read (no shim parent, a vanished process)."""
    ppid = (procfs.read_stat(pid) or {}).get("ppid")
    if not ppid:
        return None
    try:
        bundle = os.readlink("/proc/%d/cwd" % int(ppid))
    except OSError:
        return None
    return read_oci_spec(os.path.join(bundle, "config.json"))


def map_by_ns_pid(manifest, new_pids):
    """Host pids of a restored container's CUDA processes, matched by their pid inside the container
    (recorded at dump as runtime.ns_pids): the container keeps those, its host pids change."""
    old_ns = (manifest.get("runtime") or {}).get("ns_pids") or {}
    by_ns = {ns_pid(p): p for p in new_pids}
    out = []
    for p in manifest["target"]["cuda_pids"]:
        ns = old_ns.get(str(p))
        if ns is None or ns not in by_ns:
            raise GpuCkptError("the restored container has no process for CUDA pid %s (pid %s inside it)" % (p, ns),
                               stage="runtime-restore")
        out.append(by_ns[ns])
    return out


# What a runtime can do, as the engine and a migration ask it; each backend class declares its own record
# (``capabilities = Backend.capabilities._replace(...)``), read as ``backend.capabilities.<field>``.
# - uses_criu: CRIU dumps and restores it; False: the runtime saves its own state (gVisor), and CRIU's
#   checks (its network lock, the pids a restore needs free) do not apply
# - can_hold_stopped: it can leave a workload stopped after its dump (leave_stopped: a migration's held
#   source), and later resume or kill it
# - cuda_in_sandbox: the workload's processes live on a sandbox's own kernel (gVisor), out of the host's
#   sight; its CUDA pids are the sandbox's, reached only through load_cuda()'s driver, never the host's /proc
# - owns_cuda_stage: the runtime's own dump and restore run the CUDA stage (runsc --cuda-checkpoint-path);
#   the engine then only finds the CUDA pids, checks them after a restore, and settles a held source
# - restores_host_pids: its restore brings the dumped pids back under the same numbers in the host's own pid
#   namespace (a bare process tree): they must be free, so a pid still in use there refuses the restore (the
#   original may still run), and a rollback waits for its dumped tree to be reaped first
# - gates_restore: its restore(..., gate=) holds the restored tree, not yet run, at a criu_gate.RestoreGate
#   until the engine's verdict on the image's pages (checked beside the restore, not before it)
# - keeps_criu_plugins_off: every CRIU it runs is told to load no plugin (criu.py: an empty --libdir, or a CRIU
#   configuration runc reads last), so CRIU's own cuda plugin never drives the GPU behind the engine; False: a
#   daemon runs CRIU with the node's own configuration (Docker, Podman, containerd's checkpoint), and a cuda
#   plugin that CRIU would load there refuses the workload before anything is frozen
Capabilities = namedtuple("Capabilities", "uses_criu can_hold_stopped cuda_in_sandbox owns_cuda_stage restores_host_pids "
                                          "gates_restore keeps_criu_plugins_off")


class Backend(metaclass=abc.ABCMeta):
    name = "base"
    capabilities = Capabilities(uses_criu=True, can_hold_stopped=True, cuda_in_sandbox=False, owns_cuda_stage=False,
                                restores_host_pids=False, gates_restore=False, keeps_criu_plugins_off=True)
    extra = ()           # the user's CRIU options
    auto_flags = ()      # CRIU options the tree needs, found by plan_tree
    criu_needs = None    # what plan_tree found of the tree (tree_plan.criu_needs), None before it ran
    tcp_established = False
    # CRIU options this runtime can pass on (None: any); the others make plan_tree refuse the tree
    passes_criu_flags = None
    # CRIU options, by name, that this runtime hands its CRIU through the configuration file CRIU reads from
    # CRIU_CONFIG_FILE (given as --name=value; for those its own command line has no flag for)
    criu_config_options = ()
    # What the journal records of the workload, when its runtime has it (set by resolve, bind or restore)
    container = None     # the container's name or id
    pod = None           # a Kubernetes pod's {namespace, name, uid}
    restore_pod = None   # the pod a Kubernetes restore brings the workload up in ("namespace/name")

    def load_cuda(self, libcuda_path):
        """(driver, None) that reaches the workload's CUDA processes, or (None, the reason it cannot)."""
        return cuda.load(libcuda_path)

    def cuda_candidates(self, root, pids):
        """The pids to ask the driver about: the workload's host pids (a sandbox: its own pids)."""
        return pids

    def plan_tree(self, pids, internal_tcp=False):
        """Before anything is frozen: find what CRIU must be told for this tree, or cannot do, and
        set ``auto_flags`` (recorded in the image; a restore passes them again), or refuse.
        - file locks: --file-locks (without it CRIU's dump fails after the GPU stage ran);
        - a datagram unix socket connected to a named peer outside the tree (/dev/log): --ext-unix-sk;
        - one end of a unix stream connection to a process outside the tree: refused (CRIU cannot);
        - established TCP connections: --tcp-established when ``tcp_established``, or when
          ``internal_tcp`` (the engine found that both ends of each are the tree's: a distributed job's
          rendezvous and ranks, nccl.py), else refused. The steps are tree_plan's."""
        needs = tree_plan.criu_needs(pids)
        tree_plan.refuse_undumpable(needs, tcp_ok=self.tcp_established or internal_tcp)
        flags = tree_plan.needed_flags(needs, self.tcp_established, internal_tcp,
                                       lambda: self._network_lock_flags("the workload's TCP connections are"))
        if pids and self.capabilities.uses_criu and procfs.net_namespace(pids[0]) not in (None, procfs.net_namespace()):
            flags += [f for f in self._network_lock_flags("pid %s has a network namespace of its own, whose "
                                                          "network is" % pids[0]) if f not in flags]
        flags = tree_plan.without_user_given(flags, self.extra)
        tree_plan.refuse_unpassable(flags, self.passes_criu_option, needs, self.name)
        self.auto_flags = flags
        self.criu_needs = needs
        self.criu_flags()  # the user's own options too: refused here, before anything is frozen
        return flags

    def _network_lock_flags(self, what):
        """How CRIU is to lock ``what`` during the dump (tree_plan.network_lock_flags)."""
        if not self.capabilities.uses_criu:
            return []
        return tree_plan.network_lock_flags(what, self.extra, self.passes_criu_option(tree_plan.NFTABLES_LOCK),
                                            lambda: self.criu.has_feature("network_lock_nftables"), self.name)

    def criu_flags(self, manifest=None):
        """The CRIU options for a dump (``manifest`` None) or for the restore of ``manifest``; for a
        runtime that passes only some options on to CRIU, refused when it cannot pass one."""
        auto = self.auto_flags if manifest is None else ((manifest.get("runtime") or {}).get("auto_flags") or [])
        out = list(self.extra or ()) + [f for f in auto if f not in (self.extra or ())]
        for opt in out:
            if not self.passes_criu_option(opt):
                accepted = list(self.passes_criu_flags) + ["%s=VALUE" % o for o in self.criu_config_options]
                raise InvalidTarget("criu option %s cannot be passed through %s (it accepts %s)"
                                    % (opt, self.name, ", ".join(accepted) or "none"), stage="preflight")
        return out

    def passes_criu_option(self, opt):
        """Whether this runtime can hand CRIU the option ``opt``: on its command line, or (--name=value) through
        CRIU's configuration file."""
        if self.passes_criu_flags is None or opt in self.passes_criu_flags:
            return True
        name, has_value, _value = opt.partition("=")
        return bool(has_value) and name in self.criu_config_options

    def split_criu_flags(self, flags):
        """``flags`` as (those for the runtime's command line, the lines of CRIU's configuration file)."""
        on_cli, config_lines = [], []
        for opt in flags:
            if opt in (self.passes_criu_flags or ()) or self.passes_criu_flags is None:
                on_cli.append(opt)
            else:
                name, _eq, value = opt.partition("=")
                config_lines.append("%s %s" % (name[2:], value))
        return on_cli, config_lines

    def check_after(self, after):
        """Before anything is frozen: refuse what the workload cannot be left as after its dump
        (``after``: exit|running|stopped)."""

    def bind(self, manifest):
        """Take what the backend needs to act on a workload (its container id...) from a manifest."""

    def with_container(self, container, **found):
        """A copy of this backend that acts on container ``container`` (a journal's or a job's record of it), with
        what the caller found of it (``found``: a sandbox's ``sandbox_host_pid``); this backend is left as it was."""
        twin = copy.copy(self)
        twin._take(dict(found, container=container))
        return twin

    def _take(self, values):
        """Set this backend's own ``values`` (names it already has); a name it has not is a caller's mistake."""
        for key, value in values.items():
            if not hasattr(self, key):
                raise TypeError("%s backend has no attribute %s" % (self.name, key))
            setattr(self, key, value)

    def is_held(self, pids):
        """True when the workload left by dump(after='stopped') is still held (not running)."""
        states = [(procfs.process_state(p) or "Z") for p in pids]
        return all(s in ("T", "t", "Z") for s in states)

    def map_pids(self, manifest, new_pids):
        """Host pids of the restored CUDA processes; None lets the engine match them by tree order."""
        return None

    def gpu_pairs_for(self, pid):
        """The driver's (old, new) GPU UUID pairs for restored CUDA process ``pid``, when this runtime put it
        into a container that was given other GPUs (gpus.py); None: the GPUs it had."""
        return None

    def after_gpu_restore(self):
        """After the driver restored the GPU memory, before the unlock: put right what that restore changed in
        the workload's runtime (a container's /dev). Nothing here."""

    @abc.abstractmethod
    def preflight(self, full=True):
        """Check the runtime is present and usable; return facts for the manifest (versions...).
        ``full=False`` skips the slow checks (kept for restore, where time is downtime)."""
        raise NotImplementedError

    @abc.abstractmethod
    def resolve(self, target):
        """Validate ``target`` and return (root_host_pid, [host pids of the workload])."""
        raise NotImplementedError

    @abc.abstractmethod
    def dump(self, target, image_dir, work_dir, after):
        """Write the workload's state into image_dir; afterwards the workload exits, runs on, or is
        left stopped (``after``: exit|running|stopped). On failure the workload must run on (the
        runtime thaws it). Returns a dict recorded in the manifest under 'runtime'."""
        raise NotImplementedError

    @abc.abstractmethod
    def restore(self, image_dir, work_dir, manifest):
        """Bring the workload back from image_dir; return its host pids (root first)."""
        raise NotImplementedError

    @abc.abstractmethod
    def resume(self, pids):
        """Let a workload left stopped by dump(after='stopped') run again."""
        raise NotImplementedError

    @abc.abstractmethod
    def kill(self, pids):
        """Stop what a failed restore brought up, so the target is left clean."""
        raise NotImplementedError

    def kill_restored(self, image_dir, pids):
        """A target's clean-up (a migration rolled back, or its restore's module died): what a restore of the
        image in ``image_dir`` brought up on this host (``pids``, alive by identity) is stopped."""
        self.kill(pids)

    def abandon_restore_wait(self, image_dir):
        """A restore of the image in ``image_dir`` that waits here for what the controller brings up (a pod's
        containers) is told to give up, its caller having seen that it will never come. Returns the names of
        what was marked. Nothing here: this runtime's restore waits for no one."""
        return []

    def release_exited(self, manifest):
        """A migration whose source exited after its dump committed: remove what the runtime keeps of
        the source (a stopped container). Returns whether anything was removed."""
        return False

    def probe(self, root_pid, argv, timeout, stage="probe"):
        """Run the user's post-restore probe (``nvidia-smi``, a health check) or quiesce command inside the
        workload: in all of its root process's namespaces, its root directory and working directory, with
        its environment, so that a container's own PATH and libraries answer, as `exec` into it would.
        nsenter itself runs on the host as root, so the workload's variables that steer the host's
        dynamic loader (LD_PRELOAD, LD_LIBRARY_PATH, ...) are not given to it: they are set again inside,
        through the container's own `env`. The rest travels in the environment, never in argv (which
        every user can read). Returns the command's Result; the caller decides what a failure means."""
        nsenter = find_binary("nsenter", what="install util-linux")
        env = procfs.environ(root_pid)
        loader = ["%s=%s" % (k, env.pop(k)) for k in sorted(env) if k.startswith("LD_") or k in UNSAFE_FOR_ROOT]
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        inner = list(argv)
        if loader:
            env_bin = next((b for b in ("/usr/bin/env", "/bin/env")
                            if os.path.isfile("/proc/%d/root%s" % (root_pid, b))), None)
            if env_bin:
                inner = [env_bin] + loader + inner
        return run([nsenter, "--target", str(root_pid), "--all", "--root", "--wd", "--"] + inner,
                   timeout=timeout, check=False, stage=stage, pid=root_pid, env=env, new_session=True)


# What CRIU says when a container holds a mount it cannot dump, and what the user can do about it.
# GPU containers meet these through the NVIDIA Container Toolkit (docs/migration.md, "GPU containers").
MOUNT_TROUBLE = (
    ("doesn't have a proper root mount",
     "a mount inside the container is not in its spec (a hook made it: the NVIDIA Container Toolkit's legacy "
     "mode binds the driver's libraries that way), and the runtime tells CRIU only about the spec's bind mounts; "
     "run GPU containers with CDI (nvidia-ctk cdi generate, and the toolkit's mode cdi or containerd's "
     "enable_cdi), which puts the devices and the driver's mounts into the spec"),
    ("unreachable sharing",
     "a mount of the container shares propagation with a mount outside it (shared or slave bind mounts, as "
     "some device plugins and CSI drivers make): give those mounts private propagation (rprivate) in the spec"),
    ("nvidia-ctk-hook",
     "the NVIDIA Container Toolkit's hook mounted a tmpfs of its own into the container; run the container "
     "with CDI mode, whose spec declares every mount"),
)


# Variables besides LD_* that glibc ignores for set-uid programs: what a root process on the host must
# not take from a workload's environment.
UNSAFE_FOR_ROOT = ("GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH",
                   "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR")


def mount_hint(log_text, default=None):
    """A hint for CRIU's log text when it names a mount CRIU could not dump, else ``default``."""
    for words, hint in MOUNT_TROUBLE:
        if words in (log_text or ""):
            return hint
    return default


def criu_preflight(criu, full=True):
    """CRIU 4.x present, and (``full``) `criu check` passing; returns the CRIU facts for the manifest."""
    version = criu.require_version()
    if full:
        ok, out = criu.check()
        if not ok:
            raise GpuCkptError("`criu check` failed on this host: the kernel lacks what CRIU needs",
                               stage="preflight", cmd=[criu.path, "check"], stdout=out,
                               hint="see CRIU's output; run the gpuckpt.fleet.criu role's checks")
    return {"criu_version": version, "criu_path": criu.path}


def refuse_cuda_plugin(criu, runtime):
    """Refuse (InvalidTarget) when the CRIU that ``runtime``'s daemon runs, with the node's own configuration,
    would load CRIU's cuda plugin: it would restore and unlock the GPU inside CRIU, behind the engine (all
    restored before any unlocked, validation before unlock)."""
    found = criu.plugin_facts(env={})
    plugin_dir = found["plugin_dir"]
    cuda = found["cuda_plugin"]
    if cuda and plugin_dir and os.path.dirname(cuda) == plugin_dir.rstrip("/"):
        raise InvalidTarget("%s runs CRIU with this node's configuration, and that CRIU would load its cuda plugin %s, "
                            "which restores and unlocks the GPU behind the engine; nothing was frozen"
                            % (runtime, cuda), stage="preflight",
                            hint="remove %s, or point CRIU at an empty plugin directory in /etc/criu/default.conf "
                                 "(a line 'libdir /var/lib/gpuckpt/criu-no-plugins')" % cuda)


class ContainerBackend(Backend):
    """What the container backends share: the CRIU checks, the container's name (from the manifest
    when restoring or rolling back), CUDA pids matched by their pid inside the container, and
    removing the container to kill it. By default a container cannot be held stopped."""

    capabilities = Backend.capabilities._replace(can_hold_stopped=False)

    def __init__(self, criu_path=None, criu_options=(), timeout=None, container=None, tcp_established=False):
        self._criu_path, self._criu = criu_path, None
        self.extra = list(criu_options or ())
        self.timeout = timeout
        self.container = container
        self.tcp_established = bool(tcp_established)
        self._pairs_by_pid = {}
        self._devices_synced = []  # (pid, spec) of each restored container whose /dev was made to match its spec

    @property
    def criu(self):
        """CRIU, found when first needed (preflight): listing containers for facts needs none."""
        if self._criu is None:
            self._criu = Criu(self._criu_path)
        return self._criu

    @abc.abstractmethod
    def runtime_facts(self):
        """The runtime's own version facts (and checks), merged into preflight()'s."""
        raise NotImplementedError

    @abc.abstractmethod
    def remove(self):
        """Remove self.container (forcefully)."""
        raise NotImplementedError

    def present(self):
        """Whether this runtime is installed and in use on this host (for facts: no error when not)."""
        return False

    @abc.abstractmethod
    def running_containers(self):
        """[{id, pid (host pid of its init), status, ...}] of the containers that run or are paused."""
        raise NotImplementedError

    def preflight(self, full=True):
        facts = criu_preflight(self.criu, full)
        if not self.capabilities.keeps_criu_plugins_off:
            refuse_cuda_plugin(self.criu, self.name)
        facts.update(self.runtime_facts())
        return facts

    # The manifest's key of the runtime's state root, for a backend whose command line takes one (runc, runsc,
    # podman: ``root`` and ``_make_cli``): a restore or rollback given no root uses the one the checkpoint used.
    root_record = None

    def bind(self, manifest):
        recorded = manifest.get("runtime") or {}
        self.container = recorded.get("container") or self.container
        if self.root_record and self.root is None and recorded.get(self.root_record):
            self.root = recorded[self.root_record]
            self.cli = self._make_cli()

    def restore_bundle(self, manifest):
        """For a runtime that restores into an OCI bundle (runc, runsc; ``state(id, required=False)``):
        the bundle given, else the one recorded, refused when it has no config.json here or when a
        container of that id already exists here (a restore must never start a second copy)."""
        self.container = (manifest.get("runtime") or {}).get("container") or self.container
        bundle = self.bundle or (manifest.get("runtime") or {}).get("bundle")
        if not bundle or not os.path.isfile(os.path.join(bundle, "config.json")):
            raise InvalidTarget("%s bundle %s has no config.json on this host: the container's bundle (rootfs "
                                "and config) must be there to restore it" % (self.name, bundle), stage="preflight",
                                hint="copy the bundle to the target, or pass bundle")
        if self.state(self.container, required=False):
            raise InvalidTarget("a %s container %s already exists on this host; refusing to start a second copy"
                                % (self.name, self.container), stage="preflight",
                                hint="delete it (%s delete) if it is a leftover, or restore elsewhere" % self.name)
        return bundle

    def map_pids(self, manifest, new_pids):
        return map_by_ns_pid(manifest, new_pids)

    def placement(self, manifest, spec):
        """The driver's GPU pairs that put the CUDA processes of the container of ``manifest`` onto the GPUs
        ``spec`` (the spec it is restored into) gives it, place by place (gpus.placement_pairs); None when they
        are the GPUs it had, when the image has no CUDA process, or when it is of an older collection, which
        did not record the container's GPUs. Refused: another count, a GPU this host's driver does not list."""
        rt = manifest.get("runtime") or {}
        if "gpus" not in rt or not (manifest.get("target") or {}).get("cuda_pids"):
            return None
        new = gpu_devices.spec_gpus(spec)
        if not rt["gpus"] and not new:
            return None
        return gpu_devices.placement_pairs(rt["gpus"], new, "%s container %s" % (self.name, self.container))

    def adopt_restored(self, manifest, pid, tree, spec):
        """For a runtime that makes the container's spec itself at its restore (Docker, Podman: the GPUs and
        device numbers of the host it is restored on): the container restored, with ``spec`` the spec it now
        runs under, is put onto its GPUs (placement, adopt_devices). Refused (another count of GPUs, a spec
        that cannot be read while the image records GPUs): the restored container is removed, so that no copy
        keeps running, and the error says so."""
        try:
            if spec is None:
                if ((manifest.get("runtime") or {}).get("gpus")) and (manifest.get("target") or {}).get("cuda_pids"):
                    raise InvalidTarget("the restored %s container %s's OCI spec could not be read, so the GPUs it "
                                        "was given here are unknown" % (self.name, self.container),
                                        stage="runtime-restore")
                return
            pairs = self.placement(manifest, spec)
            self.adopt_devices(pid, tree, spec, pairs, sync=gpu_devices.lists_nvidia_devices(spec))
        except GpuCkptError as exc:
            self.remove()
            exc.msg = "%s; the restored container was removed, nothing of it runs here" % exc.msg
            raise

    def adopt_devices(self, pid, tree, spec, pairs, sync):
        """After the runtime's restore of the container whose init is ``pid`` (its processes ``tree``), before
        the GPU memory comes back: its processes are to go onto the GPUs ``pairs`` names (None: those they
        had), and (``sync``) its /dev, which CRIU restored as the source's, is made to hold the device nodes of
        ``spec``, the spec it now runs under (gpus.sync_device_nodes)."""
        self._pairs_by_pid = {p: pairs for p in tree} if pairs else {}
        if sync or pairs:
            gpu_devices.sync_device_nodes(pid, spec)
        self._devices_synced = [(pid, spec)] if (sync or pairs) else []

    def after_gpu_restore(self):
        """The driver's restore onto other GPUs makes the device nodes of the GPUs it had again, inside the restored
        container (measured on 2 x H100, driver 580.159.04: /dev/nvidia0 made during the CUDA restore of a pod moved
        onto minor 1, its device cgroup refusing it): each synced /dev is made to match its spec again."""
        for pid, spec in self._devices_synced:
            gpu_devices.sync_device_nodes(pid, spec)

    def gpu_pairs_for(self, pid):
        return self._pairs_by_pid.get(pid)

    def is_held(self, pids):
        return False

    def resume(self, pids):
        pass

    def kill(self, pids):
        if self.container:
            self.remove()
            return
        for p in pids:  # the container's name is unknown here: end its processes
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
