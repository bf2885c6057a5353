"""Fixtures of the integration tests that migrate between the loopback hosts (tests/hosts/loopback.py):
one pair of hosts per test module, and counting workloads started on them, killed at the end."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from loopback import LoopbackHosts
from loopback_workloads import PODMAN_ROOT, PODMAN_RUNROOT, RemoteWorkload, fakecuda_host_vars


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hosts"))
    host_vars = fakecuda_host_vars(base)
    for name in host_vars:
        host_vars[name].update({
            # each host its own runc state and bundle (with its own cgroup), as on two machines
            "gpuckpt_runc_root": os.path.join(base, name, "runc-root"),
            "gpuckpt_runc_bundle": os.path.join(base, name, "bundle"),
            # The same Podman paths on both hosts, as on two machines (Podman's export records
            # them): each host binds its own storage there in its mount namespace.
            "gpuckpt_podman_root": PODMAN_ROOT, "gpuckpt_podman_runroot": PODMAN_RUNROOT,
            # a dockerd per host (started by the Docker tests), under a short path
            "gpuckpt_docker_dir": "/tmp/gpk-%s-%d" % (name, os.getpid()),
            "gpuckpt_docker_host": "unix:///tmp/gpk-%s-%d/docker.sock" % (name, os.getpid())})
    h = LoopbackHosts(base).start(host_vars)
    h.host_vars = host_vars
    yield h
    for name in host_vars:  # the Docker tests' dockerd, if they started one (its pid file is in the host's pid space)
        d = host_vars[name]["gpuckpt_docker_dir"]
        if os.path.exists(os.path.join(d, "docker.pid")):
            h.ssh(name, "/usr/bin/docker --host unix://{d}/docker.sock ps -aq | xargs -r /usr/bin/docker --host "
                        "unix://{d}/docker.sock rm -f; kill $(cat {d}/docker.pid)".format(d=d), check=False)
    time.sleep(2)
    h.stop()
    for name in host_vars:
        subprocess.run(["umount", "-R", os.path.join(host_vars[name]["gpuckpt_docker_dir"], "exec")], check=False,
                       stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", host_vars[name]["gpuckpt_docker_dir"]], check=False)


@pytest.fixture
def remote_workload(hosts, tmp_path):
    started = []

    def start(host="hosta", **kw):
        w = RemoteWorkload(hosts, host, str(tmp_path / ("w%d" % len(started))), **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()
