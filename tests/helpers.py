"""Helpers shared by the tests (plain functions; fixtures live in conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS = os.path.join(REPO, ".build", "collections")
VENV_BIN = os.path.join(REPO, ".venv", "bin")
# On the GPU machine there is no venv: tests/gpu/run_on_device.sh points this at the carried ansible.
ANSIBLE_PLAYBOOK = os.environ.get("GPUCKPT_ANSIBLE_PLAYBOOK") or os.path.join(VENV_BIN, "ansible-playbook")
FAKE_LIBCUDA = os.path.join(REPO, "tests", "fakecuda", "libcuda.so.1")
COUNTER = os.path.join(REPO, "tests", "workloads", "counter.py")
# Modules run on the managed host's system Python with the standard library alone.
MANAGED_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as fh:
                    data = fh.read()
                ppid = int(data[data.rindex(")") + 2:].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
        return data[data.rindex(")") + 2] not in "ZX"
    except OSError:
        return False


class RuncOnLoopbackHosts(object):
    """runc for a test container with id ``self.id`` on the loopback hosts ``self.hosts``, each host
    with its own runc root (<host>/runc-root); mixed into the workloads that run in such containers."""

    hosts = id = None

    def runc(self, host, args, relay=False, check=True):
        cmd = "runc --root %s %s" % (self.hosts.path(host, "runc-root"), args)
        if relay:  # stdio through a pipe to a relay (CRIU cannot dump host files as a container's stdio)
            cmd = "setsid sh -c '%s 2>&1 | cat >> %s/container.log' </dev/null >/dev/null 2>&1 &" % (cmd, self.dir)
        return self.hosts.ssh(host, cmd, check=check)

    def state(self, host):
        res = self.runc(host, "state %s" % self.id, check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def delete_everywhere(self):
        for host in ("hosta", "hostb"):
            self.runc(host, "delete --force %s" % self.id, check=False)


def hanging_wrapper(path, real, subcommand, child_pidfile):
    """TEST DOUBLE of a hung tool: an executable at ``path`` that runs ``real`` except for
    ``subcommand``, which never ends; it starts a child of its own (its pid in ``child_pidfile``), as
    CRIU under runc does, so a test can check that the whole process group was killed."""
    with open(path, "w") as fh:
        fh.write('#!/bin/sh\ncase " $* " in *" %s "*) sleep 300 & echo $! > %s; wait; exit 1;; esac\nexec %s "$@"\n'
                 % (subcommand, child_pidfile, real))
    os.chmod(path, 0o755)
    return str(path)


class FakeCuda(object):
    """Handle on the libcuda TEST DOUBLE's per-pid state files."""

    def __init__(self, state_dir):
        self.state_dir = state_dir
        self.lib = FAKE_LIBCUDA
        os.makedirs(state_dir, exist_ok=True)

    @property
    def env(self):
        return {"GPUCKPT_LIBCUDA": self.lib, "FAKECUDA_STATE_DIR": self.state_dir}

    def state(self, pid):
        """The pid's state as the test double reports it (read from inside that process), or None."""
        import ctypes
        lib = ctypes.CDLL(self.lib)
        st = ctypes.c_int(-1)
        if lib.cuCheckpointProcessGetState(int(pid), ctypes.byref(st)) != 0:
            return None
        return {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}[st.value]

    def calls(self):
        try:
            with open(os.path.join(self.state_dir, "calls.log")) as fh:
                return [tuple(line.split()[:2]) for line in fh if line.strip()]
        except OSError:
            return []

    def calls_log(self):
        """calls.log's lines as written (the restore's GPU pairs among them)."""
        try:
            with open(os.path.join(self.state_dir, "calls.log")) as fh:
                return [line.rstrip("\n") for line in fh if line.strip()]
        except OSError:
            return []

    def inject(self, call, pid, code):
        with open(os.path.join(self.state_dir, "inject"), "a") as fh:
            fh.write("%s %d %d\n" % (call, pid, code))

    def clear_injections(self):
        try:
            os.unlink(os.path.join(self.state_dir, "inject"))
        except OSError:
            pass


class CountingWorkload(object):
    """What every test workload shares: each role (parent, child1, ...) counts into <dir>/<role>.state
    and keeps the checksum of its memory pattern from the start in <dir>/<role>.digest."""

    dir = None
    roles = ("parent",)
    count_timeout = 20.0

    def read(self, role):
        with open(os.path.join(self.dir, role + ".state")) as fh:
            return json.load(fh)

    def digest0(self, role):
        with open(os.path.join(self.dir, role + ".digest")) as fh:
            return fh.read().strip()

    def counts(self):
        return {r: self.read(r)["count"] for r in self.roles}

    def wait_counting(self, beyond=None, timeout=None):
        """Wait until every role has counted past ``beyond`` (dict), or at least twice."""
        deadline = time.monotonic() + (timeout or self.count_timeout)
        while time.monotonic() < deadline:
            try:
                c = self.counts()
                if all(c[r] > (beyond or {}).get(r, 1) for r in self.roles):
                    return c
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        raise AssertionError("workload in %s is not counting beyond %s" % (self.dir, beyond))

    def went_on_intact(self, before):
        """It counts on from where it was (``before``, a counts() dict) with every role's memory
        pattern as it was at the start. Returns the new counts; raises AssertionError otherwise."""
        after = self.wait_counting(beyond=before)
        for r in self.roles:
            assert after[r] > before[r], "%s did not count on from %s" % (r, before[r])
        self.verified_since(before)
        return after

    def verified_since(self, before, timeout=None):
        """Every role's memory pattern checked whole at a count after ``before`` (a counts() dict: a workload hashes
        its pattern every half second or so, and at the first count after a freeze), and found as it started."""
        deadline = time.monotonic() + (timeout or self.count_timeout)
        for r in self.roles:
            state = self.read(r)
            while state.get("digest_count", state["count"]) <= before[r] and time.monotonic() < deadline:
                time.sleep(0.05)
                state = self.read(r)
            assert state.get("digest_count", state["count"]) > before[r], \
                "%s's memory pattern was not checked after count %s" % (r, before[r])
            assert state["digest"] == self.digest0(r), "the memory pattern of %s changed" % r

    def counted(self, role):
        """Every count ``role`` wrote, in order (its <role>.counts log)."""
        with open(os.path.join(self.dir, role + ".counts")) as fh:
            return [int(x) for x in fh.read().split()]

    def no_count_twice(self):
        """No count was written twice: no copy ran and was thrown away while an older one went on
        (a rewind). Returns the last counts."""
        out = {}
        for r in self.roles:
            seen = self.counted(r)
            twice = sorted({c for i, c in enumerate(seen[1:]) if c <= seen[i]})
            assert not twice, "%s wrote counts %s twice (a copy ran and was thrown away)" % (r, twice[:10])
            out[r] = seen[-1] if seen else 0
        return out

    def is_counting(self, within=15.0):
        """Whether every role counts on: each writes a new count within ``within`` seconds. A loaded machine (the
        tests run in parallel shards) can delay a tick by far more than its period, so a positive answer is
        waited for; a test that expects no count (a paused workload) passes a short ``within``."""
        before = self.counts()
        deadline = time.monotonic() + within
        while True:
            time.sleep(0.05)
            try:
                after = self.counts()
            except (OSError, ValueError, KeyError):
                after = before
            if all(after[r] > before[r] for r in self.roles):
                return True
            if time.monotonic() >= deadline:
                return False


def workload_processes(script, workdir):
    """(pid, state) of every live process of a test workload, in every pid namespace of this machine."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode()
            with open("/proc/%s/stat" % d) as fh:
                st = fh.read()
        except OSError:
            continue
        if script in cmd and ("--dir %s " % workdir) in cmd + " ":
            state = st[st.rindex(")") + 2]
            if state not in "ZX":
                out.append((int(d), state))
    return out


def write_runc_bundle(bundle, args, env=(), rw=(), cgroup=None):
    """A runc bundle whose rootfs binds this machine's /usr and /etc read-only (merged /usr links
    as on the host), the repo read-only, and each of ``rw`` read-write, all at their host paths, so
    the libcuda test double finds its library at the same path inside. No terminal: CRIU dumps a
    container whose stdio are pipes."""
    import shutil
    runc = shutil.which("runc")
    rootfs = os.path.join(bundle, "rootfs")
    for d in ("usr", "etc", "proc", "dev", "sys", "tmp", "run"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + link) and not os.path.lexists(os.path.join(rootfs, link)):
            os.symlink(os.readlink("/" + link), os.path.join(rootfs, link))
    if os.path.exists(os.path.join(bundle, "config.json")):
        os.unlink(os.path.join(bundle, "config.json"))
    subprocess.run([runc, "spec", "--bundle", bundle], check=True)
    with open(os.path.join(bundle, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = list(args)
    cfg["process"]["env"] += list(env)
    cfg["root"] = {"path": "rootfs", "readonly": True}
    for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro")] + [(d, "rw") for d in rw]:
        os.makedirs(os.path.join(rootfs, src.lstrip("/")), exist_ok=True)
        cfg["mounts"].append({"destination": src, "type": "bind", "source": src, "options": ["rbind", opt]})
    if cgroup:
        cfg["linux"]["cgroupsPath"] = cgroup
    with open(os.path.join(bundle, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return bundle


# A device plugin's part of making a container (CDI mode): its GPUs' device nodes and device cgroup rules put in
# its spec, as the CRI plugin does with CDI devices. Run by the managed python (its grpc; the tests' venv has
# none) with argv: containerd address, namespace, container id, JSON list of minors.
ADD_GPUS = """
import json, sys
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_api import Client
api = Client(sys.argv[1], sys.argv[2], timeout=30)
record = api.container(sys.argv[3])
spec, minors = record["spec"], json.loads(sys.argv[4])
linux = spec.setdefault("linux", {})
linux["devices"] = list(linux.get("devices") or []) + [
    {"path": "/dev/nvidia%d" % m, "type": "c", "major": 195, "minor": m, "fileMode": 438, "uid": 0, "gid": 0}
    for m in minors]
linux.setdefault("resources", {}).setdefault("devices", []).extend(
    {"allow": True, "type": "c", "major": 195, "minor": m, "access": "rwm"} for m in minors)
api.update_spec(sys.argv[3], spec, record["spec_url"], "preflight")
api.close()
"""


def give_container_gpus(address, namespace, cid, minors):
    """ADD_GPUS on containerd container ``cid`` (made, its task not started); the completed process."""
    return subprocess.run([MANAGED_PYTHON, "-c", ADD_GPUS, address, namespace, cid, json.dumps(list(minors))],
                          env=dict(os.environ, PYTHONPATH=COLLECTIONS), capture_output=True, universal_newlines=True,
                          check=False)


def write_nvidia_proc(root, uuids):
    """A node's /proc/driver/nvidia as its driver writes it (gpus/<bus>/information), GPU minor m with uuids[m]:
    what GPUCKPT_NVIDIA_PROC points the collection at, for a test double of a node's GPUs."""
    for m, uuid_ in enumerate(uuids):
        d = os.path.join(root, "gpus", "0000:%02x:00.0" % (0x10 + m))
        os.makedirs(d)
        with open(os.path.join(d, "information"), "w") as fh:
            fh.write("Model: \t\t NVIDIA H100 80GB HBM3 (a test double)\nGPU UUID: \t %s\nDevice Minor: \t %d\n"
                     "Bus Location: \t 0000:%02x:00.0\n" % (uuid_, m, 0x10 + m))
    return root


SKELETON_IMAGE = "localhost/gpuckpt-skel:1"


def skeleton_tar(path):
    """A tar of a skeleton rootfs: empty dirs and the merged-/usr links (/usr and /etc come in as
    volumes). Imported, it is a container image made without any registry."""
    import tarfile
    with tarfile.open(path, "w") as tf:
        for d in ("usr", "etc", "proc", "dev", "sys", "tmp", "run", "var"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink("/" + link):
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink("/" + link)
                tf.addfile(info)
    return path


def podman_skeleton(podman_args, tag=SKELETON_IMAGE, tmpdir="/tmp"):
    """Import the skeleton image into the Podman storage that ``podman_args`` (--root/--runroot) name."""
    import shutil
    import tempfile
    podman = shutil.which("podman")
    if subprocess.run([podman] + list(podman_args) + ["image", "exists", tag], check=False).returncode == 0:
        return tag
    work = tempfile.mkdtemp(dir=tmpdir)
    subprocess.run([podman] + list(podman_args) + ["import", skeleton_tar(os.path.join(work, "skel.tar")), tag],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(work, ignore_errors=True)
    return tag


def unmount_podman_storage(root):
    """Podman's overlay driver mounts its storage's overlay folder on itself and may leave it mounted, once for each
    podman that found it not yet mounted in its view (a playbook's and a test's): the next run's pytest could not
    remove its basetemp ("Device or resource busy"). Unmounted until none is left."""
    overlay = os.path.join(root, "overlay")
    for unused in range(8):
        if not os.path.ismount(overlay) or subprocess.run(["umount", overlay], stderr=subprocess.DEVNULL,
                                                          check=False).returncode != 0:
            return


def podman_run_args(name, image, args, env=(), rw=()):
    """`podman run` arguments for a test container: no network, the rlimits this machine allows, this
    machine's /usr and /etc and the repo read-only, each of ``rw`` read-write, at their host paths."""
    out = ["run", "--detach", "--name", name, "--network", "none",
           "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
    for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro")] + [(d, "rw") for d in rw]:
        out += ["--volume", "%s:%s:%s" % (src, src, opt)]
    for e in env:
        out += ["--env", e]
    return out + [image] + list(args)


# TEST DOUBLES of a bad link, put in front of the target's Python that runs a transfer's receiver
# (gpuckpt_transfer_python): the receiver program comes first on the stream (its length is in the
# bootstrap, the -c argument), then framed operations (a JSON header line, then its bytes).
_LINK = r'''#!/usr/bin/python3
import json, os, re, subprocess, sys
MODE, ARG, MARKER = %(mode)r, %(arg)r, %(marker)r
inp, out = sys.stdin.buffer, None
proc = subprocess.Popen(["/usr/bin/python3"] + sys.argv[1:], stdin=subprocess.PIPE)
out = proc.stdin
def first_time():
    try:
        os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
def put(b):
    out.write(b)
    out.flush()
if MODE == "cut" and first_time():  # ARG bytes get through, then the link dies
    left = ARG
    while left > 0:
        b = inp.read1(min(left, 1 << 16)) if hasattr(inp, "read1") else inp.read(min(left, 1 << 16))
        if not b:
            break
        put(b)
        left -= len(b)
    out.close()
    proc.wait()
    sys.exit(255)
program = int(re.search(r"read\((\d+)\)", sys.argv[2]).group(1))
put(inp.read(program))
flip = MODE == "flip"
delivered = False
while True:
    head = inp.readline()
    if not head:
        break
    put(head)
    op = json.loads(head)
    delivered = delivered or op.get("op") == "deliver"
    n = op.get("len", 0) if op.get("op") in ("data", "deliver") else 0
    at = ARG if (flip and op.get("op") == "data" and "pages-" in op.get("path", "") and n > ARG
                 and first_time()) else None
    done = 0
    while done < n:
        b = inp.read(min(n - done, 1 << 20))
        if not b:
            break
        if at is not None and done <= at < done + len(b):
            b = b[:at - done] + bytes([b[at - done] ^ 1]) + b[at - done + 1:]
            flip = False
        put(b)
        done += len(b)
out.close()
rc = proc.wait()
if MODE == "flip-after" and delivered and rc == 0 and first_time():
    # the image has landed: change one byte of its largest pages file, then put its times back
    dest = json.loads(sys.argv[3])["dest"]
    pages = max((n for n in os.listdir(dest) if n.startswith("pages-")), key=lambda n: os.path.getsize(os.path.join(dest, n)))
    path = os.path.join(dest, pages)
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(ARG)
        b = fh.read(1)
        fh.seek(ARG)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
sys.exit(rc)
'''


def bad_link_python(path, mode, arg, marker):
    """An executable to give as the target's python: ``mode`` "cut" passes ``arg`` bytes of the first
    stream, then cuts it; "flip" changes the byte at offset ``arg`` of the first pages file's data it
    carries; "flip-after" changes the byte at offset ``arg`` of the largest pages file on the target
    once the image has landed there, and puts back its mtime and atime. Once (``marker`` records that
    it happened)."""
    with open(path, "w") as fh:
        fh.write(_LINK % {"mode": mode, "arg": arg, "marker": str(marker)})
    os.chmod(path, 0o755)
    return str(path)
