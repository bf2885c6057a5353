# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""CRIU: find it, require 4.x, `criu check`, dump and restore a process tree, with no CRIU plugin loaded.

Why no plugin. CRIU 4.x builds its own cuda plugin (plugins/cuda, ``cuda_plugin.so``), and a distribution's
CRIU may install it where CRIU loads plugins. Loaded, it drives the GPU from inside CRIU through NVIDIA's
``cuda-checkpoint`` tool (the cuda_checkpoint role installs one on the PATH): at a dump it locks and
checkpoints every CUDA task it finds running and marks the image as needing it (``cuda_plugin`` in
inventory.img); at the restore of a marked image it restores and then unlocks each task in turn, inside
``criu restore`` (CRIU 4.2 cuda_plugin.c resume_device(), from the RESUME_DEVICES_LATE hook that
criu/cr-restore.c runs for every task): the first task runs on its GPU before the next one is restored and
before the engine has validated anything. That stage is the engine's (every pid locked before any is
checkpointed; every pid restored before any is unlocked; validation before the unlock), so CRIU must not
act on the GPU behind it.

How CRIU 4.2 finds plugins (criu/plugin.c cr_plugin_init): in ``opts.libdir``; only when nothing set that,
in ``$CRIU_LIBS_DIR``, else in its compiled-in directory (CR_PLUGIN_DEFAULT: ``/usr/lib/criu/``, or the
PLUGINDIR it was built with) when that exists. It dlopen()s every ``*.so`` there and runs its init.
``opts.libdir`` is set by ``--libdir``/``-L`` or a ``libdir`` line of a configuration file; the configuration
is read in this order, each one overriding the ones before (criu/config.c next_config): /etc/criu/default.conf,
~/.criu/default.conf, ``$CRIU_CONFIG_FILE``, ``--config FILE``, the command line, and last, for a CRIU run
over RPC (``criu swrk``: runc, crun), the configuration file of the request (runc: the ``org.criu.config``
annotation, else /etc/criu/runc.conf). Plugins are loaded by dump, pre-dump and restore only
(criu/cr-dump.c, criu/cr-restore.c), never by ``criu check``.

So every CRIU command here names an empty directory of its own with ``--libdir``, last on its command line:
no configuration file and no environment can make it load a plugin. Where another program runs CRIU, the same
directory reaches it through a CRIU configuration file (``write_config``, ``plugin_free_env``) where the call
can carry one: runc passes its environment to CRIU, and reads a restored container's ``org.criu.config``.
Where nothing of the call reaches CRIU (Docker; Podman 4.3, which runs its runtime with an environment of its
own; a containerd checkpoint), only the node's /etc/criu/default.conf can (a ``libdir`` line).
An image whose inventory names a plugin (dumped by a CRIU that loaded CRIU's cuda plugin, not by this
collection) is then refused by CRIU ("Missing required plugin"), before anything is restored; the error
says why. ``Criu.plugin_facts()`` tells where this CRIU would find
plugins and whether CRIU's cuda plugin is there.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

from ..core.errors import CommandError, GpuCkptError
from ..core.run import find_binary, run

MIN_VERSION = (4, 0)

# criu/include/plugin.h: CR_PLUGIN_DEFAULT when CRIU was built without PLUGINDIR (this one is read from
# `criu --help` when it can be).
DEFAULT_PLUGIN_DIR = "/usr/lib/criu/"
# The configuration files CRIU reads by itself, in its order (criu/config.c): a libdir in a later one wins.
GLOBAL_CONFIG = "/etc/criu/default.conf"
USER_CONFIG = ".criu/default.conf"  # under $HOME
NO_PLUGINS_PREFIX = "criu-no-plugins."
CUDA_PLUGIN_FILE = "cuda_plugin.so"
# CRIU's cuda plugin execs NVIDIA's tool by this name: found in a plugin under another file name too.
CUDA_PLUGIN_MARK = b"cuda-checkpoint"
# A path a CRIU configuration file can hold as it is (its parser splits at blanks and cuts at '#').
CONFIG_SAFE_PATH = re.compile(r'^/[^\s#"\\]*\Z')


def log_excerpt(path, limit=25):
    """The lines of a CRIU log a person needs: its errors, else its last lines."""
    try:
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ""
    # "Can't setup RLIMIT_NOFILE" is harmless (hosts without CAP_SYS_RESOURCE): leave it out.
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    picked = (errors or lines)[-limit:]
    return "\n".join(picked)


@contextlib.contextmanager
def no_plugins_dir(parent=None):
    """An empty directory of its own (0700, under ``parent``, else the temporary dir) for CRIU's
    ``--libdir`` or a configuration file's ``libdir``: CRIU then loads no plugin. Removed afterwards."""
    path = os.path.abspath(tempfile.mkdtemp(prefix=NO_PLUGINS_PREFIX, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_config(path, lines=(), libdir=None, keep=None):
    """Write a CRIU configuration file at ``path`` (0600, never through a link) for a runtime that runs CRIU
    itself: the configuration file ``keep`` first (the user's ``$CRIU_CONFIG_FILE``, whose place this file
    takes), then ``lines`` (options without their leading ``--``), then ``libdir LIBDIR`` last
    (``no_plugins_dir``), so that CRIU loads no plugin whatever came before. Returns ``path``."""
    text = ""
    if keep and os.path.isfile(keep) and os.path.abspath(keep) != os.path.abspath(path):
        with open(keep, errors="replace") as kfh:
            text = kfh.read().rstrip("\n") + "\n"
    text += "".join(line + "\n" for line in lines)
    if libdir is not None:
        if not CONFIG_SAFE_PATH.match(libdir):
            raise GpuCkptError("CRIU's plugin directory %r cannot be written into a CRIU configuration file "
                               "(blanks, '#', quotes)" % libdir, stage="preflight",
                               hint="use a work dir whose path has none of them")
        text += "libdir %s\n" % libdir
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def plugin_free_env(libdir, config_path, lines=(), env=None):
    """The environment for a program that runs CRIU itself and passes its environment on (runc does; Podman
    4.3 does not): ``env`` (else this process's) with ``CRIU_CONFIG_FILE`` naming a configuration written at
    ``config_path`` (the one ``env`` named, ``lines``, then ``libdir``: it overrides /etc/criu/default.conf and
    ~/.criu/default.conf), and ``CRIU_LIBS_DIR`` naming ``libdir`` too. Only a request's own configuration
    file (runc: the container's ``org.criu.config``, else /etc/criu/runc.conf) comes after it; where the
    collection writes that file, write_config(..., libdir) gives it the libdir."""
    out = dict(os.environ if env is None else env)
    out["CRIU_CONFIG_FILE"] = write_config(config_path, lines, libdir, keep=out.get("CRIU_CONFIG_FILE"))
    out["CRIU_LIBS_DIR"] = libdir
    return out


def plugin_problem(log):
    """The reason a CRIU restore failed for want of a plugin (its log at ``log``), or None."""
    try:
        with open(log, errors="replace") as fh:
            missing = sorted(set(re.findall(r"Missing required plugin: (\S+)", fh.read())))
    except OSError:
        return None
    if not missing:
        return None
    return ("the image was dumped by a CRIU that loaded its plugin(s) %s (CRIU's cuda plugin checkpoints the "
            "GPU itself, and would restore and unlock each CUDA process inside CRIU's restore, behind the "
            "engine); gpuckpt.fleet runs CRIU without plugins, so this image cannot be restored here; nothing "
            "was restored" % ", ".join(missing))


def _config_libdir(path):
    """The libdir a CRIU configuration file sets (its last one), or None."""
    found = None
    try:
        with open(path, errors="replace") as fh:
            for line in fh:
                words = line.split("#", 1)[0].split()
                if len(words) == 2 and words[0] in ("libdir", "--libdir"):
                    found = words[1].strip('"')
    except OSError:
        pass
    return found


def _configured_libdirs(env):
    """The plugin directories CRIU's configuration files name (global, the user's, $CRIU_CONFIG_FILE), in the
    order CRIU reads them: the last one wins."""
    configs = [GLOBAL_CONFIG]
    if env.get("HOME"):
        configs.append(os.path.join(env["HOME"], USER_CONFIG))
    if env.get("CRIU_CONFIG_FILE"):
        configs.append(env["CRIU_CONFIG_FILE"])
    return [d for d in (_config_libdir(c) for c in configs) if d]


def _plugins_in(directory):
    """The shared objects in a plugin directory, sorted; none where it cannot be read."""
    try:
        return sorted(n for n in os.listdir(directory) if n.endswith(".so"))
    except OSError:
        return []


def is_cuda_plugin(path):
    """True when the shared object at ``path`` is CRIU's cuda plugin (by name, or by the tool it runs)."""
    if os.path.basename(path) == CUDA_PLUGIN_FILE:
        return True
    try:
        with open(path, "rb") as fh:
            return CUDA_PLUGIN_MARK in fh.read(16 << 20)
    except OSError:
        return False


class Criu(object):
    def __init__(self, path=None):
        self.path = find_binary("criu", path, what="install CRIU 4.x (role gpuckpt.fleet.criu) or set criu_path")
        self._version = None

    def version(self):
        if self._version is None:
            res = run([self.path, "--version"], timeout=30, stage="preflight")
            m = re.search(r"Version:\s*([0-9][0-9.]*)", res.stdout)
            if not m:
                raise GpuCkptError("cannot read CRIU's version from %r" % res.stdout.strip(), stage="preflight",
                                   cmd=res.cmd)
            self._version = m.group(1)
        return self._version

    def require_version(self):
        v = self.version()
        parts = tuple(int(x) for x in v.split(".")[:2])
        if parts < MIN_VERSION:
            raise GpuCkptError("CRIU %s at %s is too old: gpuckpt.fleet needs CRIU %d.%d or newer"
                               % (v, self.path, MIN_VERSION[0], MIN_VERSION[1]), stage="preflight",
                               hint="install CRIU 4.x (role gpuckpt.fleet.criu)")
        return v

    def default_plugin_dir(self):
        """The plugin directory compiled into this CRIU (its ``--help`` names it)."""
        res = run([self.path, "--help"], timeout=30, check=False, stage="preflight")
        m = re.search(r"--libdir\s+path to a plugin directory \(by default ([^)\s]+)\)", res.stdout + res.stderr)
        return m.group(1) if m else DEFAULT_PLUGIN_DIR

    def plugin_facts(self, env=None):
        """Where this CRIU, run as a user would run it, loads plugins from (``plugin_dir``: the last libdir of
        its configuration files, else $CRIU_LIBS_DIR, else its compiled-in directory; None: it would load none),
        the plugins there, and the path of CRIU's cuda plugin in any of those places (``cuda_plugin``, else
        None). This collection's CRIU commands load none of them (``plugins_loaded`` False)."""
        env = os.environ if env is None else env
        default = self.default_plugin_dir()
        from_config = _configured_libdirs(env)
        if from_config:
            plugin_dir = from_config[-1]
        elif env.get("CRIU_LIBS_DIR"):
            plugin_dir = env["CRIU_LIBS_DIR"]
        else:
            plugin_dir = default if os.path.exists(default) else None
        places = []
        for d in [plugin_dir] + from_config + [env.get("CRIU_LIBS_DIR"), default]:
            if d and d not in places:
                places.append(d)
        listed = {d: _plugins_in(d) for d in places}
        cuda = next((os.path.join(d, n) for d in places for n in listed[d] if is_cuda_plugin(os.path.join(d, n))), None)
        return {"plugin_dir": plugin_dir, "default_plugin_dir": default,
                "plugins": listed.get(plugin_dir, []) if plugin_dir else [],
                "cuda_plugin": cuda, "plugins_loaded": False}

    def check(self):
        """`criu check`: returns (ok, output)."""
        with no_plugins_dir() as libdir:
            res = run([self.path, "check", "--libdir", libdir], timeout=60, check=False, stage="preflight")
        out = (res.stdout + res.stderr).strip()
        return res.rc == 0, out

    def has_feature(self, feature):
        """`criu check --feature FEATURE` (e.g. network_lock_nftables): whether this CRIU and kernel have it."""
        res = run([self.path, "check", "--feature", feature], timeout=60, check=False, stage="preflight")
        return res.rc == 0

    def dump(self, pid, images_dir, work_dir, after="exit", shell_job=False, extra=(), timeout=None):
        """``after``: what becomes of the tree once dumped: exit (CRIU kills it), running, or stopped."""
        cmd = [self.path, "dump", "-t", pid, "-D", images_dir, "-W", work_dir, "-o", "dump.log", "-v2"]
        if after == "running":
            cmd.append("--leave-running")
        elif after == "stopped":
            cmd.append("--leave-stopped")
        if shell_job:
            cmd.append("--shell-job")
        cmd.extend(extra)
        with no_plugins_dir(work_dir) as libdir:
            return self._run(cmd + ["--libdir", libdir], os.path.join(work_dir, "dump.log"), "criu-dump", pid,
                             timeout)

    def restore(self, images_dir, work_dir, shell_job=False, extra=(), timeout=None, gate=None):
        """``gate``: a criu_gate.RestoreGate that holds the restored tree until the engine's verdict."""
        pidfile = os.path.join(work_dir, "restore.pid")
        if os.path.exists(pidfile):
            os.unlink(pidfile)
        cmd = [self.path, "restore", "-D", images_dir, "-W", work_dir, "-o", "restore.log", "-v2",
               "--restore-detached", "--pidfile", pidfile]
        if shell_job:
            cmd.append("--shell-job")
        cmd.extend(extra)
        if gate is not None:
            cmd.extend(gate.criu_args)
        # A shell job is restored into criu's own session: give criu a new one, or the workload would
        # belong to the ssh session of the module and die of SIGHUP when that session ends.
        with no_plugins_dir(work_dir) as libdir:
            res = self._run(cmd + ["--libdir", libdir], os.path.join(work_dir, "restore.log"), "criu-restore", None,
                            timeout, new_session=True)
        with open(pidfile) as fh:
            return int(fh.read().strip()), res

    def _run(self, cmd, log, stage, pid, timeout, new_session=False):
        try:
            return run(cmd, timeout=timeout, stage=stage, pid=pid, new_session=new_session)
        except CommandError as exc:
            exc.stderr = ((exc.stderr or "") + "\n--- %s ---\n%s" % (log, log_excerpt(log))).strip()
            problem = plugin_problem(log)
            if problem:
                exc.msg = "%s: %s" % (exc.msg, problem)
                exc.hint = "checkpoint the workload with gpuckpt.fleet (its CRIU loads no plugin), or restore " \
                           "this image with the CRIU that made it, outside gpuckpt.fleet"
            raise
