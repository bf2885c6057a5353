"""Two test "hosts" on this machine: sshd on 127.0.0.2 and 127.0.0.3 (port 22), each in its own pid
namespace (its own /proc), sharing the filesystem. Real ssh, real rsync; per-host image, state and
journal directories. Started and stopped by PID by the tests; also usable from the command line:

  python3 tests/hosts/loopback.py start DIR   # writes DIR/inventory.yml and DIR/ssh_config, prints pids
  python3 tests/hosts/loopback.py stop DIR
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = (("hosta", "127.0.0.2"), ("hostb", "127.0.0.3"))
# Two test runs side by side (tests/run.sh's workers, a developer's second run) must never share a host's address: with GPUCKPT_TEST_NET=N,
# every 127.0.0.X a test names is 127.0.N.X (all of 127/8 is this machine's loopback).
# Under pytest-xdist (tests/run.sh's integration workers), worker gwK adds 10 + K to it: each worker its own net.
TEST_NET = int(os.environ.get("GPUCKPT_TEST_NET", "0") or 0)
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    TEST_NET += 10 + int(os.environ["PYTEST_XDIST_WORKER"][2:])


def on_test_net(address):
    """``address`` on this run's loopback net (GPUCKPT_TEST_NET), or as it is when it is no 127.0.0.X."""
    if TEST_NET and address.startswith("127.0.0."):
        return "127.0.%d.%s" % (TEST_NET, address.rsplit(".", 1)[1])
    return address


SSHD = shutil.which("sshd") or "/usr/sbin/sshd"  # sshd wants an absolute path (it re-executes itself)


def _sh(cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _descendants(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as fh:
                    data = fh.read()
                kids.setdefault(int(data[data.rindex(")") + 2:].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], list(kids.get(root, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def split_cpus(hosts, cpusets, cpus=None):
    """{host name: cpu list for taskset}: ``cpusets`` "split" gives each host an equal share of this machine's
    cores (what two machines would have: nothing of one host's ssh, receiver or hashing runs on the other's
    cores); a dict names them; None or "" leaves every host on every core."""
    if not cpusets:
        return {}
    if isinstance(cpusets, dict):
        return dict(cpusets)
    if cpusets != "split":
        raise ValueError("cpusets must be 'split' or a dict of host -> cpu list, not %r" % (cpusets,))
    allowed = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    share = len(allowed) // len(hosts)
    if share < 1:
        raise ValueError("%d cores cannot be split between %d hosts" % (len(allowed), len(hosts)))
    return {name: ",".join(str(c) for c in allowed[i * share:(i + 1) * share]) for i, (name, unused) in enumerate(hosts)}


def _ppid(pid):
    """The parent of ``pid``, or None when it has exited meanwhile (a session ending while we walk)."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _wait_port(addr, port, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("sshd on %s:%d did not come up" % (addr, port))


class LoopbackHosts(object):
    def __init__(self, base, port=22, pid_namespaces=True, python="/usr/bin/python3", hosts=HOSTS, cpusets=None):
        self.hosts = tuple((n, on_test_net(a)) for n, a in hosts)  # (name, address): an IPv6 address as ::1, bare
        self.cpusets = split_cpus(self.hosts, cpusets)
        self.base = os.path.abspath(base)
        self.port = port
        self.pidns = pid_namespaces
        self.python = python
        self.pids = {}

    def path(self, *parts):
        return os.path.join(self.base, *parts)

    def host_dir(self, name, what):
        return self.path(name, what)

    def start(self, host_vars=None):
        for _name, addr in self.hosts:  # a host left by a killed run would answer in place of ours
            try:
                socket.create_connection((addr, self.port), 0.5).close()
            except OSError:
                continue
            raise RuntimeError("something listens on %s:%d already (a test host left by a killed run?); "
                               "stop it first" % (addr, self.port))
        os.makedirs(self.base, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)
        key = self.path("id_ed25519")
        if not os.path.exists(key):
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key])
        with open(key + ".pub") as fh, open(self.path("authorized_keys"), "w") as out:
            out.write(fh.read())
        lines = []
        for name, addr in self.hosts:
            d = self.path(name)
            os.makedirs(d, exist_ok=True)
            hk = os.path.join(d, "ssh_host_ed25519_key")
            if not os.path.exists(hk):
                _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hk])
            cfg = os.path.join(d, "sshd_config")
            with open(cfg, "w") as fh:
                fh.write("\n".join([
                    "ListenAddress %s:%d" % ("[%s]" % addr if ":" in addr else addr, self.port), "HostKey %s" % hk,
                    "PidFile %s" % os.path.join(d, "sshd.pid"), "AuthorizedKeysFile %s" % self.path("authorized_keys"),
                    "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                    "UsePAM no", "StrictModes no", "Subsystem sftp internal-sftp", "MaxStartups 50", "MaxSessions 50",
                    "LogLevel ERROR", ""]))
            self._spawn(name)
            lines.append((name, addr))
        for _name, addr in self.hosts:
            _wait_port(addr, self.port)
        known = self.path("known_hosts")
        with open(self.path("ssh_config"), "w") as fh:
            for name, addr in self.hosts:
                # Match both the alias and the address, or a stale known_hosts entry breaks the host.
                fh.write("Host %s %s\n  HostName %s\n  Port %d\n  User root\n  IdentityFile %s\n"
                         "  UserKnownHostsFile %s\n  StrictHostKeyChecking accept-new\n  LogLevel ERROR\n"
                         % (name, addr, addr, self.port, key, known))
        if os.path.exists(known):
            os.unlink(known)
        hosts = {}
        for name, addr in self.hosts:
            hv = {"ansible_host": addr, "ansible_port": self.port, "ansible_user": "root",
                  "ansible_python_interpreter": self.python,
                  "gpuckpt_image_root": self.host_dir(name, "images"),
                  "gpuckpt_journal_dir": self.host_dir(name, "journal")}
            hv.update((host_vars or {}).get(name) or {})
            hosts[name] = hv
        inventory = {"gpu_nodes": {"hosts": hosts, "vars": {
            "ansible_ssh_common_args": "-F %s" % self.path("ssh_config"),
            "gpuckpt_transfer_ssh_args": ["-F", self.path("ssh_config")]}}}
        with open(self.path("inventory.yml"), "w") as fh:  # JSON is YAML
            json.dump(inventory, fh, indent=1)
        with open(self.path("pids.json"), "w") as fh:
            json.dump(self.pids, fh)
        return self

    def _spawn(self, name):
        d = self.path(name)
        cmd = [SSHD, "-D", "-e", "-f", os.path.join(d, "sshd_config")]
        if self.cpusets.get(name):  # the host's own cores: its sshd and all it starts inherit the affinity
            cmd = ["taskset", "-c", self.cpusets[name]] + cmd
        if self.pidns:
            cmd = ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "unchanged",
                   self.python, os.path.join(HERE, "nsinit.py")] + cmd
        env = None
        if self.pidns:  # (its own mount namespace: nsinit binds this profile over root's ~/.bashrc there)
            profile = os.path.join(d, "bashrc")
            with open(profile, "w") as fh:
                fh.write("# A test host's shell profile (tests/hosts/nsinit.py): nothing beyond the system's.\n")
            env = dict(os.environ, GPUCKPT_HOST_SHELL_PROFILE=profile)
        log = open(os.path.join(d, "sshd.log"), "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=env)
        self.pids[name] = proc.pid

    def processes(self, name):
        """Every process of host ``name`` (its sshd and all that runs under it), root first."""
        root = self.pids[name]
        return [root] + _descendants(root)

    def freeze(self, name):
        """The host hangs: every process of it is stopped (SIGSTOP), until thaw()."""
        for _round in range(3):  # processes started meanwhile are caught by the next round
            for p in self.processes(name):
                try:
                    os.kill(p, signal.SIGSTOP)
                except OSError:
                    pass

    def thaw(self, name):
        for p in self.processes(name):
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass

    def crash(self, name):
        """The host dies: every process of it is killed at once (its files stay, as after a power cut)."""
        self.freeze(name)
        for p in self.processes(name):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass

    def boot(self, name):
        """Start host ``name`` again after crash()."""
        addr = dict(self.hosts)[name]
        self._spawn(name)
        _wait_port(addr, self.port)

    def _listeners(self, name):
        """The host's sshd listeners: its sshd processes whose parent is the namespace's init."""
        root = self._init(name)
        out = []
        for p in _descendants(root):
            try:
                ppid = _ppid(p)
                with open("/proc/%d/cmdline" % p, "rb") as fh:
                    argv0 = fh.read().split(b"\0")[0]
            except (OSError, ValueError, IndexError):
                continue
            if ppid == root and (argv0.startswith(b"sshd:") or os.path.basename(argv0) == b"sshd"):  # (sshd renames itself)
                out.append(p)
        return out

    def _init(self, name):
        """The pid of the host's namespace init (nsinit.py), the child of the unshare we started."""
        kids = [p for p in _descendants(self.pids[name]) if _ppid(p) == self.pids[name]]
        assert len(kids) == 1, "host %s has no single namespace init: %s" % (name, kids)
        return kids[0]

    def cut_off(self, name):
        """A partition: the host's sshd and its sessions end, and nothing reaches the host any more, while
        everything else on it (its workloads) runs on. Needs the pid namespace (its init outlives sshd)."""
        assert self.pidns, "cut_off needs the host's own pid namespace"
        for listener in self._listeners(name):
            for p in [listener] + _descendants(listener):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        addr = dict(self.hosts)[name]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((addr, self.port), 0.5).close()
                time.sleep(0.1)
            except OSError:
                return
        raise RuntimeError("sshd of %s still answers after cut_off" % name)

    def reconnect(self, name):
        """The partition heals: a new sshd in the host's own namespaces (what ran there runs on)."""
        d = self.path(name)
        pin = ["taskset", "-c", self.cpusets[name]] if self.cpusets.get(name) else []
        # (no -D: it forks, and its listener is reparented to the namespace's init)
        sshd = [SSHD, "-e", "-f", os.path.join(d, "sshd_config")]
        _sh(["nsenter", "--target", str(self._init(name)), "--pid", "--mount", "--"] + pin + sshd)
        _wait_port(dict(self.hosts)[name], self.port)

    def ssh(self, name, command, check=True, timeout=120):
        """Run a shell command on a test host (inside its pid namespace)."""
        return subprocess.run(["ssh", "-F", self.path("ssh_config"), name, command], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True, check=check, timeout=timeout)

    def popen_ssh(self, name, command):
        """Start a shell command on a test host and return at once; its output (stderr too) is read
        with ``communicate()``."""
        return subprocess.Popen(["ssh", "-F", self.path("ssh_config"), name, command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, universal_newlines=True)

    def stop(self):
        pids = self.pids
        if not pids and os.path.exists(self.path("pids.json")):
            with open(self.path("pids.json")) as fh:
                pids = json.load(fh)
        # The per-connection sshd processes start sessions of their own: kill every descendant of a
        # host's listener too, or a client's master connection could keep reaching a stopped host.
        for pid in list(pids.values()):
            for p in _descendants(pid):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)  # the namespace's init and everything in its session
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.pids = {}


if __name__ == "__main__":
    action, base = sys.argv[1], sys.argv[2]
    hosts = LoopbackHosts(base)
    if action == "start":
        print(json.dumps(hosts.start().pids))
    else:
        hosts.stop()
