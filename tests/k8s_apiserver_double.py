"""A TEST DOUBLE of the Kubernetes API server: no API server can be installed on these machines, so
the tests serve the few core/v1 endpoints the collection uses over real HTTP on loopback, and the real
``kubernetes`` Python client (what the modules use) talks to it.

What it does: pods (get, list, create, delete) and nodes (get) kept in memory, a bearer token checked
on every request, errors as the API's own Status objects (404 NotFound, 409 AlreadyExists, 401),
uid/resourceVersion/creationTimestamp set on create, and every request recorded (``requests``, its headers in
``request_headers``) so a test can assert what was, or was not, asked. What it does not do: scheduling, admission, watches, a
kubelet (a created pod stays Pending unless the test says otherwise)."""
from __future__ import annotations

import copy
import datetime
import json
import re
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")


def _merge(obj, patch):
    """A JSON merge patch (RFC 7386): null deletes, a dict merges, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            obj.pop(key, None)
        elif isinstance(value, dict) and isinstance(obj.get(key), dict):
            _merge(obj[key], value)
        else:
            obj[key] = copy.deepcopy(value)


def _status(code, reason, message):
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class ApiServerDouble(object):
    def __init__(self, token="gpuckpt-test-token"):
        self.token = token
        self.pods, self.nodes = {}, {}
        self.requests = []
        self.request_headers = []  # each request's headers, in order, as (name, value) pairs: repeated ones stay
        self.deleted_uids = []
        # Nodes whose pods a (stand-in) kubelet stops: their deletion is graceful, as the API server's is (the
        # pod gets a deletionTimestamp and stays until the kubelet is done); elsewhere a pod goes at once.
        self.graceful_nodes = set()
        self._rv = 1000
        self._lock = threading.Lock()
        self._server = None
        self._thread = None

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self._server.server_address[1]

    def kubeconfig(self, path):
        """A kubeconfig file for the double (context gpuckpt-test), written to ``path``."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "gpuckpt-test",
               "clusters": [{"name": "double", "cluster": {"server": self.url}}],
               "users": [{"name": "tester", "user": {"token": self.token}}],
               "contexts": [{"name": "gpuckpt-test", "context": {"cluster": "double", "user": "tester"}}]}
        with open(path, "w") as fh:
            json.dump(doc, fh)
        return path

    # ---- objects ----------------------------------------------------------------------------------
    def _stamp(self, obj):
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = str(self._rv)
        return obj

    def add_pod(self, pod):
        with self._lock:
            pod = self._stamp(copy.deepcopy(pod))
            pod.setdefault("apiVersion", "v1")
            pod.setdefault("kind", "Pod")
            self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
            return pod

    def add_node(self, name, gpus=0, ready=True):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                                       "capacity": {"nvidia.com/gpu": str(gpus)},
                                       "allocatable": {"nvidia.com/gpu": str(gpus)}}}
        with self._lock:
            self.nodes[name] = self._stamp(node)

    def pod(self, namespace, name):
        with self._lock:
            return copy.deepcopy(self.pods.get((namespace, name)))

    def all_pods(self):
        with self._lock:
            return [copy.deepcopy(p) for unused, p in sorted(self.pods.items())]

    def set_status(self, namespace, name, status):
        """What a kubelet reports of its pod (tests' kubelet stand-in)."""
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is not None:
                pod["status"] = copy.deepcopy(status)
                self._stamp(pod)

    def finalize(self, namespace, name, uid):
        """The kubelet has stopped the containers of a pod being deleted: the pod leaves the API server."""
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is not None and pod["metadata"]["uid"] == uid and pod["metadata"].get("deletionTimestamp"):
                del self.pods[(namespace, name)]

    def _pods_on_node(self, query):
        """The pods of every namespace, or those bound to one node (``fieldSelector=spec.nodeName=<node>``, the
        only selector the collection sends)."""
        selector = dict(urllib.parse.parse_qsl(query)).get("fieldSelector", "")
        node = selector.split("=", 1)[1] if selector.startswith("spec.nodeName=") else None
        with self._lock:
            items = [copy.deepcopy(p) for unused, p in sorted(self.pods.items())
                     if node is None or (p.get("spec") or {}).get("nodeName") == node]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    # ---- HTTP -------------------------------------------------------------------------------------
    def start(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the tests assert on ``requests``
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                path, unused, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with double._lock:
                    double.requests.append((method, path))
                    double.request_headers.append(list(self.headers.items()))
                if self.headers.get("Authorization") != "Bearer " + double.token:
                    return self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                code, out = double._route(method, path, body, query)
                self._send(code, out)

            def do_GET(self):  # noqa: N802 - http.server's names
                self._handle("GET")

            def do_POST(self):  # noqa: N802
                self._handle("POST")

            def do_DELETE(self):  # noqa: N802
                self._handle("DELETE")

            def do_PATCH(self):  # noqa: N802
                self._handle("PATCH")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="k8s-apiserver-double")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(10)
            self._server = None

    def _route(self, method, path, body, query=""):
        if path == "/version" and method == "GET":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-gpuckpt-test-double"}
        if path == "/api/v1/pods" and method == "GET":
            return 200, self._pods_on_node(query)
        m = _NODE.match(path)
        if m and method in ("GET", "PATCH"):
            with self._lock:
                node = self.nodes.get(m.group(1))
                if node is None:
                    return 404, _status(404, "NotFound", 'nodes "%s" not found' % m.group(1))
                if method == "PATCH":  # a merge patch (what a cordon sends: spec.unschedulable, annotations)
                    _merge(node, json.loads(body or b"{}"))
                    self._stamp(node)
                return 200, copy.deepcopy(node)
        m = _POD.match(path)
        if not m:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        ns, name = m.group(1), m.group(2)
        with self._lock:
            if name is None and method == "GET":
                items = [p for key, p in sorted(self.pods.items()) if key[0] == ns]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self._rv)},
                             "items": items}
            if name is None and method == "POST":
                pod = json.loads(body or b"{}")
                pod.setdefault("metadata", {})["namespace"] = ns
                key = (ns, pod["metadata"].get("name"))
                if key in self.pods:
                    return 409, _status(409, "AlreadyExists", 'pods "%s" already exists' % key[1])
                pod.setdefault("status", {"phase": "Pending"})
                self.pods[key] = self._stamp(pod)
                return 201, pod
            pod = self.pods.get((ns, name))
            if pod is None:
                return 404, _status(404, "NotFound", 'pods "%s" not found' % name)
            if method == "GET":
                return 200, pod
            if method == "DELETE":
                options = json.loads(body or b"{}")
                want = (options.get("preconditions") or {}).get("uid")
                if want and want != (pod.get("metadata") or {}).get("uid"):
                    return 409, _status(409, "Conflict", "Precondition failed: UID in precondition: %s, UID in "
                                                         "object meta: %s" % (want, pod["metadata"].get("uid")))
                self.deleted_uids.append(pod["metadata"].get("uid"))
                if (pod.get("spec") or {}).get("nodeName") in self.graceful_nodes and \
                        options.get("gracePeriodSeconds") != 0:
                    meta = pod["metadata"]
                    if not meta.get("deletionTimestamp"):
                        meta["deletionTimestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime(
                            "%Y-%m-%dT%H:%M:%SZ")
                        grace = options.get("gracePeriodSeconds")
                        meta["deletionGracePeriodSeconds"] = grace if grace is not None else \
                            (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                        self._stamp(pod)
                    return 200, pod
                del self.pods[(ns, name)]
                return 200, pod
        return 405, _status(405, "MethodNotAllowed", "%s is not supported by the test double" % method)
