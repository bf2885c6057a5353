"""A dockerd of the tests' own: its own data root, exec root, socket, pid file and containerd namespaces,
so that it never touches the machine's Docker. Two builds run here: bookworm's Docker 20.10 (no CDI) at
/usr/bin, and Debian trixie's Docker 26 (CDI) that tests/setup.sh unpacks into DOCKER26_DIR."""
from __future__ import annotations

import json
import os
import subprocess
import time

DOCKER20_DIR = "/usr/bin"
DOCKER26_DIR = "/usr/local/lib/gpuckpt-docker26/bin"


def docker26_installed():
    return os.access(os.path.join(DOCKER26_DIR, "dockerd"), os.X_OK)


def daemon_config(base, socket_uri, namespace, cdi_spec_dirs=None):
    """daemon.json for a test dockerd under ``base`` (keep it short: containerd's sockets live under it).
    ``cdi_spec_dirs``: turn CDI on (Docker 25+) and read specs only from these directories."""
    cfg = {"experimental": True, "bridge": "none", "iptables": False, "ip6tables": False,
           "data-root": os.path.join(base, "data"), "exec-root": os.path.join(base, "exec"),
           "pidfile": os.path.join(base, "docker.pid"), "hosts": [socket_uri],
           "containerd-namespace": namespace, "containerd-plugins-namespace": namespace + "-p"}
    if cdi_spec_dirs is not None:
        cfg["features"] = {"cdi": True}
        cfg["cdi-spec-dirs"] = list(cdi_spec_dirs)
    path = os.path.join(base, "daemon.json")
    os.makedirs(base, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return path


def dockerd_command(bin_dir, config_path):
    """The shell line that starts that dockerd detached (its own session), logging next to its config.
    PATH puts the build's own docker-proxy first; containerd, runc and docker-init come from the system."""
    base = os.path.dirname(config_path)
    return ("PATH={bin}:$PATH setsid {bin}/dockerd --config-file {cfg} > {base}/dockerd.log 2>&1 < /dev/null &"
            .format(bin=bin_dir, cfg=config_path, base=base))


def wait_until_up(bin_dir, socket_uri, log_path, timeout=60, run=None):
    """Wait for the daemon to answer ``docker version``; ``run(argv)`` runs a command where the daemon
    runs (a loopback host's ssh), default here."""
    run = run or (lambda argv: subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              check=False).returncode)
    deadline = time.monotonic() + timeout
    while run([os.path.join(bin_dir, "docker"), "--host", socket_uri, "version"]) != 0:
        if time.monotonic() > deadline:
            tail = open(log_path).read()[-3000:] if os.path.exists(log_path) else "(no log)"
            raise AssertionError("dockerd at %s did not start:\n%s" % (socket_uri, tail))
        time.sleep(0.3)
