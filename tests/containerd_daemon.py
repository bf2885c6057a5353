"""A containerd 2.x started and stopped (by PID) by the tests: its own root, state and socket under a
temporary directory, the CRI plugins off, and a skeleton image (tests/helpers.skeleton_tar) imported
as an OCI archive, so containers are made from an image without any registry."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import uuid

from helpers import MANAGED_PYTHON, skeleton_tar

PREFIX = "/usr/local/lib/gpuckpt-containerd/bin"  # tests/setup.sh installs containerd 2.1.9 there
CONTAINERD, CTR = os.path.join(PREFIX, "containerd"), os.path.join(PREFIX, "ctr")
IMAGE = "localhost/gpuckpt-skel:1"
CONFIG = """version = 3
root = "%(dir)s/root"
state = "%(dir)s/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime",
                    "io.containerd.podsandbox.controller.v1.podsandbox", "io.containerd.sandbox.controller.v1.shim"]
[grpc]
  address = "%(dir)s/containerd.sock"
[ttrpc]
  address = "%(dir)s/containerd.sock.ttrpc"
"""


def available():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # modules run over ssh get none
    return os.path.exists(CONTAINERD) and subprocess.run([MANAGED_PYTHON, "-c", "import grpc"], env=env,
                                                         check=False).returncode == 0


def oci_archive(path, layer_tar, name):
    """An OCI image layout tar of one uncompressed layer, named ``name`` for containerd's import."""
    with open(layer_tar, "rb") as fh:
        layer = fh.read()
    blobs = {}

    def put(data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}
    lay = dict(put(layer), mediaType="application/vnd.oci.image.layer.v1.tar")
    config = dict(put(json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                                  "rootfs": {"type": "layers", "diff_ids": [lay["digest"]]}}).encode()),
                  mediaType="application/vnd.oci.image.config.v1+json")
    manifest = dict(put(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                    "config": config, "layers": [lay]}).encode()),
                    mediaType="application/vnd.oci.image.manifest.v1+json",
                    annotations={"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name})
    index = {"schemaVersion": 2, "manifests": [manifest]}
    with tarfile.open(path, "w") as tf:
        def add(name_, data):
            info = tarfile.TarInfo(name_)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        for digest, data in blobs.items():
            add("blobs/sha256/" + digest.split(":", 1)[1], data)
        add("index.json", json.dumps(index).encode())
    return path


class Containerd(object):
    def __init__(self, directory):
        self.dir = directory
        self.address = os.path.join(directory, "containerd.sock")
        self.proc = None

    def write_config(self):
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "config.toml"), "w") as fh:
            fh.write(CONFIG % {"dir": self.dir})

    def wait_ready(self, proc=None):
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError("containerd did not start; see %s/containerd.log" % self.dir)
            time.sleep(0.1)
        return self

    def start(self):
        self.write_config()
        log = open(os.path.join(self.dir, "containerd.log"), "ab")
        env = dict(os.environ, PATH=PREFIX + os.pathsep + os.environ.get("PATH", ""))
        self.proc = subprocess.Popen([CONTAINERD, "--config", os.path.join(self.dir, "config.toml")], stdout=log,
                                     stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        return self.wait_ready(self.proc)

    def ctr(self, *args, namespace="default", check=True):
        return subprocess.run([CTR, "--address", self.address, "--namespace", namespace] + list(args),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, check=check)

    def read_in_task(self, cid, path, namespace="default", via_dir=None):
        """The file ``path`` as a process that containerd execs into task ``cid`` reads it: ``cp`` there copies it
        into ``via_dir`` (a host directory bound read-write at the same path in the container), or else beside
        itself, read here through the task's root (/proc/<pid>/root: a daemon in the root pid namespace only),
        once ``ctr`` has returned the exit status, then removed. Not from ctr's stdout: ctr 2.1.9's ``tasks exec`` deletes the exec'd process as
        soon as its exit status comes, and that deletion closes ctr's own FIFO readers; a short output not yet
        copied out of the FIFO is lost, with rc 0 and nothing on stderr (a few in a hundred on a loaded 2-core
        machine: CI's flake of issue 43; fixed after 2.1.9 by containerd's commit 3778cc36f, "ctr: drain exec
        output before cleanup"). cp's own write is done before its exit: nothing is in flight."""
        exec_id = "x" + uuid.uuid4().hex[:6]
        copy = (os.path.join(via_dir, "read-" + exec_id) if via_dir else "%s.gpuckpt-read-%s" % (path, exec_id))
        res = self.ctr("tasks", "exec", "--exec-id", exec_id, cid, "/bin/cp", path, copy, namespace=namespace,
                       check=False)
        assert res.returncode == 0, "exec of cp in %s: rc=%d %s" % (cid, res.returncode, res.stderr)
        if via_dir:
            inside = copy
        else:
            pid = [int(ln.split()[1]) for ln in self.ctr("tasks", "ls", namespace=namespace).stdout.splitlines()[1:]
                   if ln.split() and ln.split()[0] == cid][0]
            inside = "/proc/%d/root%s" % (pid, copy)
        try:
            with open(inside) as fh:
                return fh.read().strip()
        finally:
            os.unlink(inside)

    def import_skeleton(self, namespace="default"):
        if IMAGE not in self.ctr("images", "ls", "-q", namespace=namespace).stdout.split():
            work = os.path.join(self.dir, "skel")
            os.makedirs(work, exist_ok=True)
            arch = oci_archive(os.path.join(work, "skel-oci.tar"), skeleton_tar(os.path.join(work, "skel.tar")), IMAGE)
            self.ctr("images", "import", "--local", arch, namespace=namespace)
        return IMAGE

    def remove_all(self):
        """Kill and delete every task and container this containerd holds, in every namespace."""
        for ns in self.ctr("namespaces", "ls", "-q", check=False).stdout.split():
            for cid in self.ctr("containers", "ls", "-q", namespace=ns, check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", cid, namespace=ns, check=False)
                for unused in range(50):
                    if "STOPPED" in self.ctr("tasks", "ls", namespace=ns, check=False).stdout or \
                            cid not in self.ctr("tasks", "ls", namespace=ns, check=False).stdout:
                        break
                    time.sleep(0.1)
                self.ctr("tasks", "delete", "--force", cid, namespace=ns, check=False)
                self.ctr("containers", "delete", cid, namespace=ns, check=False)

    def stop(self):
        if self.proc is None:
            return
        self.remove_all()
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        subprocess.run(["umount", "-R", os.path.join(self.dir, "root")], stderr=subprocess.DEVNULL, check=False)


def start_on_host(hosts, name, directory):
    """A containerd of loopback host ``name`` (tests/hosts/loopback.py), started over ssh so that its shims and
    tasks live in that host's pid space; one already running there is reused. ``directory`` must be short (a
    unix socket's path has at most 107 bytes)."""
    d = Containerd(directory)
    if not os.path.exists(d.address):
        d.write_config()
        hosts.ssh(name, "PATH=%s:$PATH setsid %s --config %s/config.toml >%s/containerd.log 2>&1 </dev/null & "
                        "echo $! >%s/pid" % (PREFIX, CONTAINERD, d.dir, d.dir, d.dir))
        d.wait_ready()
    return d


def stop_on_host(hosts, name, directory):
    """Stop the containerd start_on_host started on ``name`` (by the pid it recorded, in that host's pid space),
    with its tasks, and remove its state."""
    d = Containerd(directory)
    if not os.path.exists(os.path.join(d.dir, "pid")):
        return
    d.remove_all()
    hosts.ssh(name, "kill $(cat %s/pid)" % d.dir, check=False)
    for unused in range(100):  # its pid file is in the host's pid space: wait for its socket to go
        if not os.path.exists(d.address) or d.ctr("version", check=False).returncode != 0:
            break
        time.sleep(0.1)
    subprocess.run(["umount", "-R", os.path.join(d.dir, "root")], stderr=subprocess.DEVNULL, check=False)
    shutil.rmtree(d.dir, ignore_errors=True)
