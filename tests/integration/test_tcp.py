"""An inference server in miniature (tests/workloads/counter.py --serve): it listens on a TCP port and
answers requests on connections it keeps open. CRIU 4.2.1 (tests/setup.sh) dumps TCP sockets on this
kernel; 4.1.1 could not ("Can't get 1:16 opt"). With tcp_established, a client's open connection goes
with the server: checkpointed and restored on one host, and migrated between the loopback hosts
(one kernel and one network namespace: the source holds the port, so it exits after its dump and
its copy binds the port again). Without it, established connections are refused before anything is
frozen. The GPU stage runs against the libcuda TEST DOUBLE."""
from __future__ import annotations

import os
import socket

from loopback_workloads import migrate, processes

CHECKPOINT = "gpuckpt.fleet.checkpoint"
RESTORE = "gpuckpt.fleet.restore"


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Client(object):
    """A client with one connection kept open, as an inference client keeps its keep-alive connection."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def ask(self):
        self.sock.sendall(b"count?\n")
        while b"\n" not in self.buf:
            data = self.sock.recv(4096)
            assert data, "the server closed the connection"
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        count, digest, pid = line.split()
        return int(count), digest.decode(), int(pid)


def test_a_server_and_its_open_connection_are_checkpointed_and_restored(playbook, workloads, fakecuda, tmp_path):
    port = _port()
    w = workloads(fakecuda=fakecuda, serve=port)
    client = Client(port)
    count, digest, pid = client.ask()
    assert pid == w.pid and digest == w.digest0("parent")
    image_dir = str(tmp_path / "img")
    env = fakecuda.env
    refused = playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir}, env=env)
    assert refused.rc != 0
    msg = refused.task("Checkpoint pid")["msg"]
    assert "established TCP connections" in msg and "tcp_established" in msg and "nothing was frozen" in msg, msg
    assert w.is_counting() and not os.path.exists(image_dir)
    run = playbook(CHECKPOINT, {"gpuckpt_pid": w.pid, "gpuckpt_image_dir": image_dir, "gpuckpt_tcp_established": True},
                   env=env)
    assert run.rc == 0, run.stdout
    assert not w.alive()
    back = playbook(RESTORE, {"gpuckpt_image_dir": image_dir}, env=env)
    assert back.rc == 0, back.stdout
    again, digest2, pid2 = client.ask()  # the same connection, answered by the restored server
    assert again > count and digest2 == digest and pid2 == w.pid
    fresh, _d, _p = Client(port).ask()  # and it still listens
    assert fresh >= again
    w.went_on_intact(w.counts())
    w.no_count_twice()


def test_a_server_migrates_with_its_open_connection(playbook, hosts, remote_workload):
    port = _port()
    w = remote_workload(serve=port)
    client = Client(port)
    count, digest, _pid = client.ask()
    run = migrate(playbook, hosts, w, "t-tcp", gpuckpt_tcp_established=True)
    assert run.rc == 0, run.stdout
    shown = "\n".join(run.task("Show the preflight")["msg"])
    assert ("tcp port %d" % port) in shown and "the source exits" in shown, shown
    again, digest2, _pid2 = client.ask()  # the same connection, now served on hostb
    assert again > count and digest2 == digest
    ns = os.readlink("/proc/%d/ns/pid" % processes(w.dir)[0][0])
    assert ns == hosts.ssh("hostb", "readlink /proc/self/ns/pid").stdout.strip()
    assert Client(port).ask()[0] >= again
    assert w.one_copy_runs_intact()
    w.no_count_twice()
