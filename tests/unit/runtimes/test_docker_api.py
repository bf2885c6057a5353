"""runtimes/docker.py: the one Engine API call (creating a container again from its saved
configuration), over a unix socket.

TEST DOUBLE: a small HTTP server on a unix socket stands for dockerd; it records each request and
answers as told. The real daemon runs in tests/integration/test_docker.py."""
from __future__ import annotations

import http.server
import json
import socketserver
import threading

import pytest

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import CommandError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import docker

MANIFEST = {"runtime": {"create": {"Config": {"Image": "busybox", "Cmd": ["sleep", "1d"]},
                                   "HostConfig": {"NetworkMode": "none"}}}}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append({"method": self.command, "path": self.path, "host": self.headers["Host"],
                                     "type": self.headers["Content-Type"], "body": json.loads(body)})
        status, answer = self.server.answer
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass  # (a unix socket's peer has no address to log)


@pytest.fixture
def dockerd(tmp_path):
    sock = str(tmp_path / "docker.sock")
    server = socketserver.UnixStreamServer(sock, _Handler)
    server.requests, server.answer = [], (201, {"Id": "c0ffee", "Warnings": []})
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, sock
    server.shutdown()
    server.server_close()


def _backend(sock):
    b = docker.DockerBackend(docker_host="unix://" + sock)
    b.container = "ctr-1"
    return b


def test_a_container_is_created_from_its_saved_configuration(dockerd):
    server, sock = dockerd
    assert _backend(sock)._create(MANIFEST) == "c0ffee"
    req, = server.requests
    assert req["method"] == "POST" and req["path"] == "/containers/create?name=ctr-1"
    assert req["host"] == "docker" and req["type"] == "application/json"
    assert req["body"] == {"Image": "busybox", "Cmd": ["sleep", "1d"], "HostConfig": {"NetworkMode": "none"}}


def test_a_refusal_names_the_request_its_status_and_the_daemons_words(dockerd):
    server, sock = dockerd
    server.answer = (409, {"message": "Conflict. The container name \"/ctr-1\" is already in use"})
    with pytest.raises(CommandError, match=r"creating container ctr-1 .* failed \(HTTP 409\): .*already in use") as exc:
        _backend(sock)._create(MANIFEST)
    api = exc.value.to_dict()["api"]
    assert api == {"socket": sock, "method": "POST", "path": "/containers/create?name=ctr-1", "status": 409,
                   "body": {"message": "Conflict. The container name \"/ctr-1\" is already in use"}}
    assert exc.value.stage == "runtime-restore"
    # an answer that is not JSON comes back as its text
    server.answer = (500, b"page not found")
    assert docker._api(sock, "POST", "/x", {}) == (500, "page not found")


def test_a_daemon_that_cannot_be_reached_is_a_clear_error(tmp_path):
    sock = str(tmp_path / "none.sock")
    with pytest.raises(CommandError, match=r"the Docker API request POST /containers/create\?name=ctr-1 over %s "
                       r"failed: .*No such file" % sock) as exc:
        _backend(sock)._create(MANIFEST)
    assert exc.value.stage == "runtime-restore" and exc.value.details["api"]["method"] == "POST"
