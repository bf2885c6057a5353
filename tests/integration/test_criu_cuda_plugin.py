"""CRIU's own cuda plugin (issue 43, item 10): the collection's CRIU never loads it.

CRIU 4.x builds ``cuda_plugin.so`` (plugins/cuda; tests/setup.sh builds it from the CRIU source it builds CRIU
from), and a distribution's CRIU may install it where CRIU loads plugins. Loaded, it drives the GPU from inside
CRIU: at the restore of an image it marked, it restores and unlocks each CUDA task in turn inside ``criu
restore`` (cuda_plugin.c resume_device), behind the engine, whose order is every pid restored before any is
unlocked, and validation before the unlock. The collection gives every CRIU command an empty plugin
directory of its own (runtimes/criu.py), which CRIU takes over anything else (criu/plugin.c, criu/config.c).

Here the plugin is put exactly where this CRIU looks by default (its compiled-in directory, /usr/lib/criu/,
read from ``criu --help``), in a private mount namespace (an overlay on its parent directory), so nothing on
this machine changes and it is gone with the namespace. This machine has no GPU: CRIU's own switch
CRIU_FAULT=138 (FI_PLUGIN_CUDA_FORCE_ENABLE, read by the plugin) turns it on anyway, and the ``cuda-checkpoint``
it runs is the collection's own (roles/cuda_checkpoint), on the libcuda TEST DOUBLE, whose calls.log shows
every driver call: the engine's and the plugin's alike.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import COUNTER, REPO, CountingWorkload, alive, tree

PLUGIN = os.path.join(REPO, ".build", "criu-4.2.1", "plugins", "cuda", "cuda_plugin.so")
TOOL = os.path.join(REPO, ".build", "gpuckpt-cuda-checkpoint")
CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"
FORCE_ENABLE = "138"  # criu/include/fault-injection.h FI_PLUGIN_CUDA_FORCE_ENABLE

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(PLUGIN) or not os.path.exists(TOOL),
                                reason="needs root, and CRIU's cuda plugin and the cuda-checkpoint tool (tests/setup.sh)")


def _criu_module():
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import criu
    return criu


class PluginNamespace(object):
    """A private mount namespace where CRIU's compiled-in plugin directory holds the built cuda plugin;
    ``wrap`` runs a command in it, ``env`` has the plugin turned on and ``cuda-checkpoint`` on the PATH."""

    def __init__(self, base, fakecuda):
        self.criu = _criu_module().Criu().path
        usage = subprocess.run([self.criu, "--help"], stdout=subprocess.PIPE, universal_newlines=True,
                               check=False).stdout
        self.plugin_dir = re.search(r"--libdir .*\(by default (\S+)\)", usage).group(1).rstrip("/")
        parent = os.path.dirname(self.plugin_dir)
        assert os.path.isdir(parent), parent
        upper, work, bindir = (os.path.join(base, d) for d in ("upper", "work", "bin"))
        os.makedirs(os.path.join(upper, os.path.basename(self.plugin_dir)))
        os.makedirs(work)
        os.makedirs(bindir)
        shutil.copy(PLUGIN, os.path.join(upper, os.path.basename(self.plugin_dir), "cuda_plugin.so"))
        os.symlink(TOOL, os.path.join(bindir, "cuda-checkpoint"))
        self.holder = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t overlay gpuckpt-test-plugin -o "lowerdir=$1,upperdir=$2,workdir=$3" "$1" && echo ready '
             '&& exec sleep 600', "sh", parent, upper, work], stdout=subprocess.PIPE, universal_newlines=True)
        assert self.holder.stdout.readline().strip() == "ready"
        self.wrap = ["nsenter", "-t", str(self.holder.pid), "-m", "--"]
        self.env = dict(fakecuda.env, CRIU_FAULT=FORCE_ENABLE, PATH=bindir + os.pathsep + os.environ["PATH"])

    def run(self, cmd, **kw):
        return subprocess.run(self.wrap + list(cmd), env=dict(os.environ, **self.env), check=False,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, **kw)

    def close(self):
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def plugin_ns(tmp_path, fakecuda):
    ns = PluginNamespace(str(tmp_path / "plugin-ns"), fakecuda)
    try:
        # CRIU's own directory holds the plugin inside the namespace only
        assert ns.run(["test", "-f", os.path.join(ns.plugin_dir, "cuda_plugin.so")]).returncode == 0
        assert not os.path.exists(os.path.join(ns.plugin_dir, "cuda_plugin.so"))
        yield ns
    finally:
        ns.close()
    assert not os.path.exists(os.path.join(ns.plugin_dir, "cuda_plugin.so"))


class NsWorkload(CountingWorkload):
    """The counter workload (two processes on the libcuda double), started inside the namespace: CRIU dumps a
    tree of its own mount namespace only."""

    def __init__(self, directory, ns, fakecuda):
        self.dir = directory
        cmd = [sys.executable, COUNTER, "--dir", directory, "--daemon", "--children", "1", "--mb", "4",
               "--fakecuda", fakecuda.lib]
        res = ns.run(cmd)
        assert res.returncode == 0, res.stdout
        self.pid = int(res.stdout.strip().splitlines()[-1])
        self.roles = ["parent", "child1"]
        self.wait_counting()
        self.pids = tree(self.pid)
        assert len(self.pids) == 2, self.pids

    def alive_pids(self):
        return [p for p in self.pids if alive(p)]

    def wait_gone(self, timeout=10):
        """Until no pid of it is left, zombies too (their parent reaps them): CRIU restores the same pids."""
        deadline = time.monotonic() + timeout
        while any(os.path.exists("/proc/%d" % p) for p in self.pids):
            assert time.monotonic() < deadline, "pids %s still there" % self.pids
            time.sleep(0.02)

    def intact(self):
        assert not [f for f in os.listdir(self.dir) if f.endswith(".corrupt")]
        return all(self.read(r)["digest"] == self.digest0(r) for r in self.roles)

    def kill(self):
        for p in tree(self.pid) + self.pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def _read(path, mode="r"):
    with open(path, mode) as fh:
        return fh.read()


def _driver_calls(fakecuda):
    return [c for c in fakecuda.calls() if c[0] != "attach"]


def test_engine_checkpoint_and_restore_keep_the_plugin_out(tmp_path, playbook, fakecuda, plugin_ns):
    """Through the engine, with the plugin where CRIU looks and turned on: CRIU loads no plugin (its debug log
    says nothing of one), the image names none, and the driver saw the engine's calls alone, in its order."""
    w = NsWorkload(str(tmp_path / "w"), plugin_ns, fakecuda)
    try:
        image_dir = str(tmp_path / "img")
        opts = {"gpuckpt_criu_options": ["-v4"]}  # CRIU's debug log: a loaded plugin would be named there
        run = playbook(CHECKPOINT, dict(opts, gpuckpt_pid=w.pid, gpuckpt_image_dir=image_dir),
                       env=plugin_ns.env, wrap=plugin_ns.wrap)
        assert run.rc == 0, run.stdout
        assert not w.alive_pids()
        stopped_at = w.counts()
        run = playbook(RESTORE, dict(opts, gpuckpt_image_dir=image_dir), env=plugin_ns.env, wrap=plugin_ns.wrap)
        assert run.rc == 0, run.stdout
        assert sorted(run.task("Restore from")["pids"]) == sorted(w.pids)
        w.went_on_intact(stopped_at)
        assert w.intact()

        n, pids = len(w.pids), sorted(w.pids)
        calls = _driver_calls(fakecuda)
        assert [c for c, unused in calls] == ["lock"] * n + ["checkpoint"] * n + ["restore"] * n + ["unlock"] * n, calls
        for i in range(4):
            assert sorted(int(p) for unused, p in calls[i * n:(i + 1) * n]) == pids, calls
        assert all(fakecuda.state(p) == "running" for p in w.pids)

        state = os.path.join(image_dir, ".gpuckpt")
        dump_log, restore_log = _read(os.path.join(state, "dump.log")), _read(os.path.join(state, "restore.log"))
        assert "Writing image inventory" in dump_log  # the debug log it is: a plugin would show here
        assert "Run late stage hook from criu master for external devices" in restore_log
        for log in (dump_log, restore_log):
            assert 'Plugin "' not in log and "cuda_plugin" not in log
        assert b"cuda_plugin" not in _read(os.path.join(image_dir, "inventory.img"), "rb")
        assert not [f for f in os.listdir(state) if f.startswith("criu-no-plugins.")]  # removed after each CRIU
    finally:
        w.kill()


def test_without_the_fix_criu_loads_the_plugin_and_unlocks_behind_the_engine(tmp_path, fakecuda, plugin_ns):
    """The same CRIU commands as the engine's before the fix (no --libdir): CRIU loads the plugin at the dump and
    marks the image; at the restore the plugin restores and unlocks each task in turn inside ``criu restore``.
    The collection's CRIU (with the fix) refuses to restore such an image, before anything is restored."""
    criu_mod = _criu_module()
    w = NsWorkload(str(tmp_path / "w"), plugin_ns, fakecuda)
    try:
        for action in ("lock", "checkpoint"):  # the engine's GPU stage, before CRIU's dump
            for p in w.pids:
                res = plugin_ns.run([TOOL, "--action", action, "--pid", str(p)])
                assert res.returncode == 0, res.stdout
        img, work = str(tmp_path / "img"), str(tmp_path / "work")
        os.mkdir(img)
        os.mkdir(work)
        res = plugin_ns.run([plugin_ns.criu, "dump", "-t", str(w.pid), "-D", img, "-W", work, "-o", "dump.log",
                             "-v4", "--shell-job"])
        assert res.returncode == 0, res.stdout + criu_mod.log_excerpt(os.path.join(work, "dump.log"))
        dump_log = _read(os.path.join(work, "dump.log"))
        assert 'Plugin "cuda_plugin"' in dump_log and "cuda_plugin: initialized" in dump_log
        assert b"cuda_plugin" in _read(os.path.join(img, "inventory.img"), "rb")  # the image now needs it
        w.wait_gone()
        before = _driver_calls(fakecuda)

        # With the fix: CRIU refuses the marked image at once; nothing restored, no driver call.
        marked, work2 = str(tmp_path / "marked"), str(tmp_path / "work2")
        shutil.copytree(img, marked)
        os.mkdir(work2)
        with pytest.raises(criu_mod.CommandError) as refused:
            criu_mod.Criu().restore(marked, work2, shell_job=True)
        assert "Missing required plugin: cuda_plugin" in refused.value.stderr
        assert "loaded its plugin(s) cuda_plugin" in refused.value.msg and refused.value.hint
        assert not w.alive_pids()
        assert _driver_calls(fakecuda) == before

        # Without it: the plugin restores and unlocks pid after pid, inside CRIU's restore.
        res = plugin_ns.run([plugin_ns.criu, "restore", "-D", img, "-W", work, "-o", "restore.log", "-v4",
                             "--restore-detached", "--shell-job", "--pidfile", os.path.join(work, "pid")],
                            start_new_session=True)
        assert res.returncode == 0, res.stdout + criu_mod.log_excerpt(os.path.join(work, "restore.log"))
        assert "cuda_plugin: resuming devices on pid" in _read(os.path.join(work, "restore.log"))
        by_plugin = _driver_calls(fakecuda)[len(before):]
        first, second = (str(p) for p in sorted(w.pids))
        assert sorted(by_plugin) == sorted([("restore", first), ("unlock", first), ("restore", second),
                                            ("unlock", second)]), by_plugin
        ops = [c for c, unused in by_plugin]
        assert ops.index("unlock") < len(ops) - 1 - ops[::-1].index("restore"), \
            "CRIU's plugin unlocked a process before every one was restored: %s" % by_plugin
        assert all(fakecuda.state(p) == "running" for p in w.pids)  # nobody validated anything
    finally:
        w.kill()


def test_every_way_criu_finds_plugins_is_overridden(tmp_path, monkeypatch):
    """CRIU_LIBS_DIR, a libdir in $CRIU_CONFIG_FILE or in ~/.criu/default.conf: without the collection's option
    each makes CRIU load the plugin; the collection's dump loads none; the facts name the plugin; and a
    configuration written for a runtime (write_config/plugin_free_env) outranks the user's."""
    criu_mod = _criu_module()
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    shutil.copy(PLUGIN, str(plugins / "cuda_plugin.so"))
    user_conf = tmp_path / "user.conf"
    user_conf.write_text("libdir %s\n" % plugins)
    home = tmp_path / "home"
    (home / ".criu").mkdir(parents=True)
    (home / ".criu" / "default.conf").write_text("libdir %s\n" % plugins)
    for var in ("CRIU_LIBS_DIR", "CRIU_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    routes = {"CRIU_LIBS_DIR": {"CRIU_LIBS_DIR": str(plugins)},
              "CRIU_CONFIG_FILE": {"CRIU_CONFIG_FILE": str(user_conf)},
              "HOME": {"HOME": str(home)}}
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        c = criu_mod.Criu()
        for name, env in routes.items():
            full = dict(os.environ, **env)
            facts = c.plugin_facts(env=full)
            assert facts["plugin_dir"] == str(plugins) and facts["plugins"] == ["cuda_plugin.so"], (name, facts)
            assert facts["cuda_plugin"] == str(plugins / "cuda_plugin.so") and facts["plugins_loaded"] is False

            before = tmp_path / ("before-" + name)
            before.mkdir()
            subprocess.run([c.path, "dump", "-t", str(sleeper.pid), "-D", str(before), "-W", str(before), "-o",
                            "dump.log", "-v4", "--leave-running"], env=full, check=True)
            assert 'Plugin "cuda_plugin"' in _read(str(before / "dump.log")), name

            after = tmp_path / ("after-" + name)
            after.mkdir()
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            c.dump(sleeper.pid, str(after), str(after), after="running", extra=["-v4"])
            log = _read(str(after / "dump.log"))
            assert "Writing image inventory" in log and 'Plugin "' not in log and "cuda_plugin" not in log, name
            assert os.listdir(str(after)).count("dump.log") == 1
            assert not [f for f in os.listdir(str(after)) if f.startswith(criu_mod.NO_PLUGINS_PREFIX)]
            for k in env:
                monkeypatch.delenv(k)

        # A runtime's CRIU (runc, Podman) reads $CRIU_CONFIG_FILE: the collection's keeps the user's lines and
        # ends with its own libdir, which wins.
        runtime = tmp_path / "runtime"
        runtime.mkdir()
        monkeypatch.setenv("CRIU_CONFIG_FILE", str(user_conf))
        with criu_mod.no_plugins_dir(str(runtime)) as libdir:
            env = criu_mod.plugin_free_env(libdir, str(runtime / "criu.conf"), lines=["tcp-established"])
            assert _read(env["CRIU_CONFIG_FILE"]).splitlines() == [
                "libdir %s" % plugins, "tcp-established", "libdir %s" % libdir]
            subprocess.run([c.path, "dump", "-t", str(sleeper.pid), "-D", str(runtime), "-W", str(runtime),
                            "-o", "dump.log", "-v4", "--leave-running"], env=env, check=True)
        log = _read(str(runtime / "dump.log"))
        assert "Writing image inventory" in log and 'Plugin "' not in log
        assert not os.path.exists(libdir)
        assert alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
