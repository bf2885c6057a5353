"""Loopback test hosts (loopback.py) of which some run a REAL systemd as PID 1 of their own pid, mount and UTS
namespaces, their sshd one of its units: Ansible finds systemd there as the service manager, the role installs its
units, and ``systemctl`` stops them as on a node. This machine's own PID 1 need not be systemd; the systemd
package's /lib/systemd/systemd is enough.

What the namespace gets, so that nothing of it reaches the machine: a private /run (systemd's sockets, sshd's
privilege separation directory) and /etc/systemd/system (what the role installs), both tmpfs; its own cgroup
subtree in each cgroup hierarchy systemd uses (it takes the cgroup it starts in as its root); its console bound
to a file of the host's directory. It loads units only from the host's own unit directory (a minimal set of empty
targets and the sshd unit) and /etc/systemd/system, so it starts nothing of this machine's (no udev, no getty).
Stopped by pid: SIGRTMIN+14 (systemd's immediate poweroff, which in a container ends it), then whatever is left.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from loopback import SSHD, LoopbackHosts, _descendants, _ppid

SYSTEMD = "/lib/systemd/systemd"
# The targets that units' default dependencies name (sysinit.target, basic.target, shutdown.target, ...): empty
# here, so a service needs nothing more than its own unit to start.
TARGETS = ("sysinit", "basic", "shutdown", "sockets", "timers", "paths", "slices", "local-fs", "network",
           "network-online", "multi-user", "final", "umount")
BOOT_TIMEOUT = 30.0


def cgroup_roots():
    """The cgroup hierarchies systemd runs its units in here: the cgroup v2 root when /sys/fs/cgroup is one, else
    the named v1 hierarchy ``systemd`` and the unified one beside it (hybrid), those that exist."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return ["/sys/fs/cgroup"]
    return [d for d in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified") if os.path.exists(d + "/cgroup.procs")]


def why_systemd_cannot_run():
    """Why no systemd can be started here as PID 1 of a namespace, or None when it may."""
    if os.geteuid() != 0:
        return "systemd as PID 1 of a namespace needs root"
    if not os.access(SYSTEMD, os.X_OK):
        return "%s is not installed (Debian's systemd package)" % SYSTEMD
    for tool in ("unshare", "nsenter", "mount"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":")):
            return "%s is not installed" % tool
    if not cgroup_roots():
        return "no cgroup hierarchy that systemd can run units in (/sys/fs/cgroup/systemd or a cgroup v2 root)"
    return None


class SystemdHosts(LoopbackHosts):
    """LoopbackHosts whose hosts named in ``systemd_hosts`` run systemd as their namespace's PID 1."""

    def __init__(self, base, systemd_hosts=(), **kw):
        super().__init__(base, **kw)
        self.systemd_hosts = tuple(systemd_hosts)
        self.cgroups = {}

    def _spawn(self, name):
        if name not in self.systemd_hosts:
            return super()._spawn(name)
        d = self.path(name)
        units = os.path.join(d, "units")
        os.makedirs(units, exist_ok=True)
        for target in TARGETS:
            with open(os.path.join(units, target + ".target"), "w") as fh:
                fh.write("[Unit]\nDescription=%s (empty: test host %s)\n" % (target, name))
        with open(os.path.join(units, "gpuckpt-host.target"), "w") as fh:
            fh.write("[Unit]\nDescription=test host %s\nWants=gpuckpt-host-sshd.service\n" % name)
        with open(os.path.join(units, "gpuckpt-host-sshd.service"), "w") as fh:
            # KillMode=process: the sessions (the workloads they start) outlive a restart of sshd, as on a node.
            fh.write("[Unit]\nDescription=sshd of test host %s\n\n[Service]\nExecStart=%s -D -e -f %s\n"
                     "KillMode=process\n" % (name, SSHD, os.path.join(d, "sshd_config")))
        console, profile = os.path.join(d, "console.log"), os.path.join(d, "bashrc")
        with open(profile, "w") as fh:  # (as nsinit.py: no pyenv rehash in every command ssh runs)
            fh.write("# A test host's shell profile (tests/hosts/systemd_node.py): nothing beyond the system's.\n")
        open(console, "a").close()
        boot = os.path.join(d, "boot.sh")
        with open(boot, "w") as fh:
            fh.write("\n".join([
                "set -e",
                "mount --make-rprivate /",
                "mount -t tmpfs -o mode=0755 gpuckpt-host-run /run",
                "mkdir -p /run/sshd",
                "mount -t tmpfs -o mode=0755 gpuckpt-host-units /etc/systemd/system",
                "if [ -f /root/.bashrc ]; then mount --bind %s /root/.bashrc; fi" % profile,
                "mount --bind %s /dev/console" % console,
                "exec env -i container=gpuckpt-test SYSTEMD_UNIT_PATH=%s:/etc/systemd/system %s --system "
                "--unit=gpuckpt-host.target --log-target=console" % (units, SYSTEMD), ""]))
        cgroups = [os.path.join(root, "gpuckpt-host-%s-%d" % (name, os.getpid())) for root in cgroup_roots()]
        for cg in cgroups:
            os.makedirs(cg, exist_ok=True)
        self.cgroups[name] = cgroups

        def enter_cgroups():  # (in the child, before unshare: systemd takes the cgroup it starts in as its root)
            for cg in cgroups:
                with open(os.path.join(cg, "cgroup.procs"), "w") as out:
                    out.write(str(os.getpid()))

        log = open(os.path.join(d, "systemd.log"), "ab")  # (what fails before systemd runs: unshare, a mount)
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc", "sh", boot],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=enter_cgroups)
        self.pids[name] = proc.pid
        self.wait_for_systemd(name, proc)
        return None

    def wait_for_systemd(self, name, proc, timeout=BOOT_TIMEOUT):
        """Wait until the host's systemd answers systemctl; SystemdDidNotStart with its words when it does not."""
        deadline = time.monotonic() + timeout
        state = failed = ""
        while time.monotonic() < deadline and proc.poll() is None:
            kids = [p for p in _descendants(self.pids[name]) if _ppid(p) == self.pids[name]]
            if len(kids) == 1:
                state = self._systemctl_words(kids[0], "is-system-running")
                if state in ("running", "degraded"):
                    return
                if state in ("initializing", "starting", "maintenance"):  # (it runs, but a unit holds its start)
                    failed = self._systemctl_words(kids[0], "list-units", "--failed", "--no-legend", "--plain")
            time.sleep(0.2)
        lines = ["failed units: %s" % failed] if failed else []
        for log in ("systemd.log", "console.log"):
            try:
                with open(self.path(name, log)) as fh:
                    lines += fh.read().splitlines()[-15:]
            except OSError:
                pass
        raise SystemdDidNotStart("systemd did not start as PID 1 of a namespace on this machine within %d s (its "
                                 "state: %r): %s" % (timeout, state, " | ".join(lines) or "(no output)"))

    @staticmethod
    def _systemctl_words(init, *args):
        res = subprocess.run(["nsenter", "--target", str(init), "--mount", "--pid", "--", "systemctl"] + list(args),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
        return " ".join(res.stdout.split())

    def systemctl(self, name, *args, check=True):
        """``systemctl ARGS`` against the systemd of host ``name``; returns the CompletedProcess."""
        return subprocess.run(["nsenter", "--target", str(self._init(name)), "--mount", "--pid", "--", "systemctl"]
                              + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                              check=check, timeout=120)

    def stop(self):
        for name in self.systemd_hosts:
            if name not in self.pids:
                continue
            try:
                init = self._init(name)
                os.kill(init, signal.SIGRTMIN + 14)  # systemd's immediate poweroff: in a container it exits
            except (AssertionError, OSError):
                continue
            deadline = time.monotonic() + 10
            while _ppid(init) == self.pids[name] and time.monotonic() < deadline:
                time.sleep(0.1)
        super().stop()  # (whatever is left: SIGKILL by pid)
        for name, cgroups in self.cgroups.items():
            for cg in cgroups:
                _remove_cgroup(cg)
        self.cgroups = {}


class SystemdDidNotStart(RuntimeError):
    pass


def _remove_cgroup(path, timeout=10.0):
    """Remove a cgroup and those systemd made under it, deepest first, once their processes are gone. Returns
    those left (a process still in them after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for directory, unused_dirs, unused_files in os.walk(path, topdown=False):  # (children before parents)
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(directory)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
