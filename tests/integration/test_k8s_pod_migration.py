"""A Kubernetes pod of two GPU containers moved between the loopback nodes by migrate.yml (-e pod=...).

Real parts: ansible-playbook over ssh to two loopback "nodes", each running its own containerd 2.1.9 (its runc
shim, runc 1.1.5, CRIU 4.2.1), the real ``kubernetes`` client in the controller's modules, and the runtime handler
gpuckpt-restore-runtime on the target node as the role installs it. Test doubles, named as such: the API server
(tests/k8s_apiserver_double.py: none installs here), a KUBELET STAND-IN per node (no kubelet runs here: it makes
the containers of the pods bound to its node through containerd, with the kubelet's labels and the CRI plugin's
annotations, through the pod's runtime class, reports them in the pod's status, and stops them when the pod is
deleted), and the libcuda double under the counting workloads."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import uuid

import pytest

from containerd_daemon import IMAGE, available, start_on_host, stop_on_host
from helpers import COUNTER, FAKE_LIBCUDA, REPO, CountingWorkload, give_container_gpus, write_nvidia_proc

from loopback_workloads import MIGRATE, changed_tasks

sys.path.insert(0, os.path.join(REPO, "tests"))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program  # noqa: E402

RECOVER = "gpuckpt.fleet.recover"
HANDLER_FILES = os.path.join(REPO, "roles", "nvidia_container_runtime", "files")
NODES = {"hosta": "node-a", "hostb": "node-b"}
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and python3-grpcio (tests/setup.sh) needed")


class KubeletStandIn(object):
    """KUBELET STAND-IN for the loopback nodes: a thread that does for the API double's pods what a kubelet does
    for the pods bound to its node, as far as this collection depends on it: it makes each container of a new pod
    through containerd (namespace k8s.io; the kubelet's labels, the CRI plugin's annotations, the pod's
    ``gpuckpt.fleet/*`` annotations as the handler's pod_annotations pass them, the runtime class's handler
    binary), retries a create that failed (the kubelet's back-off, shortened), reports Running with each
    container's id, and on a deletion kills the pod's containers (SIGKILL after the grace period: a paused task
    dies of it) before the pod leaves the API server."""

    def __init__(self, api, daemons, hosts, handlers, gpus=None):
        self.api, self.daemons, self.hosts, self.handlers = api, daemons, hosts, handlers
        self.made, self.failures, self.log = {}, {}, []
        # DEVICE PLUGIN STAND-IN (CDI mode): {host: [free GPU minors]}; a container that asks for nvidia.com/gpu
        # gets the first free ones as device nodes in its spec (linux.devices and the device cgroup's rules)
        self.gpus_free = {h: list(m) for h, m in (gpus or {}).items()}
        self.gpus_given = {}  # container id: [minors]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-stand-in", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(30)

    def _run(self):
        while not self._stop.is_set():
            try:
                for pod in self.api.all_pods():
                    self._sync(pod)
            except Exception as exc:  # noqa: BLE001 - a kubelet goes on; the tests read self.log
                self.log.append("sync: %r" % exc)
            self._stop.wait(0.2)

    def _host(self, pod):
        node = (pod.get("spec") or {}).get("nodeName")
        return {v: k for k, v in NODES.items()}.get(node)

    def _sync(self, pod):
        meta = pod["metadata"]
        host, uid = self._host(pod), meta["uid"]
        if host is None:
            return
        if meta.get("deletionTimestamp"):
            self._stop_pod(host, pod)
            return
        if uid in self.made:
            return
        if time.monotonic() < self.failures.get(uid, 0):
            return
        statuses = []
        for c in pod["spec"]["containers"]:
            cid, err = self._make(host, pod, c)
            if err:
                self.log.append("%s/%s %s: %s" % (meta["namespace"], meta["name"], c["name"], err))
                self.failures[uid] = time.monotonic() + 2  # the kubelet's back-off, shortened
                self._remove_made(host, uid)
                self.api.set_status(meta["namespace"], meta["name"], {"phase": "Pending", "containerStatuses": [
                    {"name": c["name"], "ready": False, "restartCount": 0, "image": c["image"], "imageID": "",
                     "state": {"waiting": {"reason": "CreateContainerError", "message": err[-300:]}}}]})
                return
            statuses.append({"name": c["name"], "containerID": "containerd://" + cid, "image": c["image"],
                             "imageID": "sha256:" + "0" * 64, "ready": True, "restartCount": 0,
                             "state": {"running": {"startedAt": "2026-11-24T10:00:00Z"}}})
        self.made[uid] = [s["containerID"][len("containerd://"):] for s in statuses]
        self.api.set_status(meta["namespace"], meta["name"], {"phase": "Running", "containerStatuses": statuses})

    def _make(self, host, pod, c):
        meta, spec = pod["metadata"], pod["spec"]
        daemon, cid = self.daemons[host], uuid.uuid4().hex + uuid.uuid4().hex
        labels = {"io.kubernetes.pod.name": meta["name"], "io.kubernetes.pod.namespace": meta["namespace"],
                  "io.kubernetes.pod.uid": meta["uid"], "io.kubernetes.container.name": c["name"],
                  "io.cri-containerd.kind": "container"}
        annotations = {"io.kubernetes.cri.container-type": "container",
                       "io.kubernetes.cri.sandbox-namespace": meta["namespace"],
                       "io.kubernetes.cri.sandbox-name": meta["name"], "io.kubernetes.cri.container-name": c["name"]}
        annotations.update({k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith("gpuckpt.fleet/")})
        args = ["run", "--detach", "--runc-root", self.hosts.host_vars[host]["gpuckpt_runc_root"],
                "--log-uri", "file://" + os.path.join(daemon.dir, cid[:12] + ".log")]
        rc = spec.get("runtimeClassName")
        if rc:
            if rc not in self.handlers.get(host, {}):
                return None, "no runtime handler %s on this node" % rc
            args += ["--runc-binary", self.handlers[host][rc]]
        for e in c.get("env") or []:
            args += ["--env", "%s=%s" % (e["name"], e["value"])]
        for k, v in sorted(labels.items()):
            args += ["--label", "%s=%s" % (k, v)]
        for k, v in sorted(annotations.items()):
            args += ["--annotation", "%s=%s" % (k, v)]
        volumes = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            args += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s"
                     % (volumes[m["name"]], m["mountPath"], "ro" if m.get("readOnly") else "rw")]
        asked = int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
        if asked:
            return self._make_with_gpus(daemon, host, cid, args, c, asked)
        res = daemon.ctr(*(args + [IMAGE, cid] + c["command"]), namespace="k8s.io", check=False)
        if res.returncode != 0:
            daemon.ctr("containers", "delete", cid, namespace="k8s.io", check=False)
            return None, (res.stderr or res.stdout).strip()
        return cid, None

    def _make_with_gpus(self, daemon, host, cid, run_args, c, asked):
        """As the CRI plugin does with a device plugin's CDI devices: the container created, its spec given the
        GPUs' device nodes and device cgroup rules, then its task started."""
        free = self.gpus_free.get(host) or []
        if len(free) < asked:
            return None, "the device plugin stand-in has %d free GPU(s) on %s, %d asked" % (len(free), host, asked)
        minors, self.gpus_free[host] = free[:asked], free[asked:]
        try:
            log_uri = run_args[run_args.index("--log-uri") + 1]
            create = [a for a in run_args[1:] if a != "--detach"]
            del create[create.index("--log-uri"):create.index("--log-uri") + 2]
            res = daemon.ctr(*(["containers", "create"] + create + [IMAGE, cid] + c["command"]), namespace="k8s.io",
                             check=False)
            if res.returncode == 0:
                # the spec is changed through containerd's API by the managed python (its grpc; the tests' has none)
                res = give_container_gpus(daemon.address, "k8s.io", cid, minors)
            if res.returncode == 0:
                res = daemon.ctr("tasks", "start", "--detach", "--log-uri", log_uri, cid, namespace="k8s.io",
                                 check=False)
        except BaseException:
            self.gpus_free[host] = sorted(self.gpus_free[host] + minors)
            raise
        if res.returncode != 0:
            daemon.ctr("containers", "delete", cid, namespace="k8s.io", check=False)
            self.gpus_free[host] = sorted(self.gpus_free[host] + minors)
            return None, (res.stderr or res.stdout).strip()
        self.gpus_given[cid] = minors
        return cid, None

    def _remove_made(self, host, uid):
        for c in self._containers_of(host, uid):
            self._kill(host, c)

    def _containers_of(self, host, uid):
        out = self.daemons[host].ctr("containers", "ls", "labels.\"io.kubernetes.pod.uid\"==%s" % uid,
                                     namespace="k8s.io", check=False).stdout
        return [ln.split()[0] for ln in out.splitlines()[1:] if ln.strip()]

    def _kill(self, host, cid):
        if cid in self.gpus_given:
            self.gpus_free[host] = sorted(self.gpus_free.get(host, []) + self.gpus_given.pop(cid))
        d = self.daemons[host]
        d.ctr("tasks", "kill", "--signal", "SIGKILL", cid, namespace="k8s.io", check=False)
        for unused in range(100):
            if d.ctr("tasks", "delete", cid, namespace="k8s.io", check=False).returncode == 0 or \
                    "not found" in d.ctr("tasks", "ps", cid, namespace="k8s.io", check=False).stderr:
                break
            time.sleep(0.1)
        d.ctr("containers", "delete", cid, namespace="k8s.io", check=False)

    def _stop_pod(self, host, pod):
        meta = pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds") or 0
        for cid in self._containers_of(host, meta["uid"]):
            self.daemons[host].ctr("tasks", "kill", "--signal", "SIGTERM", cid, namespace="k8s.io", check=False)
        time.sleep(min(grace, 5))
        for cid in self._containers_of(host, meta["uid"]):
            self._kill(host, cid)
        self.made.pop(meta["uid"], None)
        self.api.finalize(meta["namespace"], meta["name"], meta["uid"])


class PodContainer(CountingWorkload):
    """One container of the test pod: the counter (a parent and a child holding a memory pattern, registered with
    the libcuda double) in its work dir, a hostPath volume."""

    roles = ("parent", "child1")

    def __init__(self, workdir):
        self.dir = workdir
        os.makedirs(workdir, exist_ok=True)


def node_dir(host):
    return "/tmp/gpk-pod-%s-%d" % (host, os.getpid())


@pytest.fixture(scope="module")
def node_containerds(hosts):
    """Each loopback host's containerd, started once for the module and stopped by its pid at the end."""
    yield {host: start_on_host(hosts, host, node_dir(host)) for host in NODES}
    for host in NODES:
        stop_on_host(hosts, host, node_dir(host))


@pytest.fixture
def cluster(hosts, node_containerds, tmp_path):
    """Each loopback host a node: its containerd (started over ssh, so that its shims live in the host's pid
    space), the API double knowing both nodes, a kubelet stand-in, and the restore runtime handler installed on
    both (handlers[host]), as the role installs it."""
    daemons = dict(node_containerds)
    for d in daemons.values():
        d.import_skeleton("k8s.io")
    handlers = {}
    for host in NODES:
        hdir = os.path.join(str(tmp_path), "handler-" + host)
        os.makedirs(hdir)
        shutil.copy(os.path.join(HANDLER_FILES, "gpuckpt-restore-runtime"), os.path.join(hdir, "gpuckpt-restore-runtime"))
        with open(os.path.join(HANDLER_FILES, "gpuckpt_restore_runtime.py")) as src, \
                open(os.path.join(hdir, "gpuckpt_restore_runtime.py"), "w") as dst:  # assembled, as the role installs it
            dst.write(handler_program(src.read()))
        os.chmod(os.path.join(hdir, "gpuckpt-restore-runtime"), 0o755)
        with open(os.path.join(hdir, "restore-runtime.json"), "w") as fh:
            json.dump({"runc": shutil.which("runc"), "image_roots": [hosts.host_dir(host, "images")],
                       "state_dir": os.path.join(hdir, "state"), "ticket_wait": 30}, fh)
        handlers[host] = {"gpuckpt-restore": os.path.join(hdir, "gpuckpt-restore-runtime")}
    api = ApiServerDouble().start()
    api.add_node("node-a", gpus=2)
    api.add_node("node-b", gpus=2)
    api.graceful_nodes.update(NODES.values())  # deletion waits for the kubelet stand-in, as the API's does
    # Each node's GPUs as its driver lists them (/proc/driver/nvidia/gpus, through GPUCKPT_NVIDIA_PROC), four a
    # node, and the libcuda double told which are the target's. node-b's GPU 0 is another pod's: the device plugin
    # stand-in gives the moved pod other minors than it had, so its GPUs are remapped and its /dev is redone.
    gpu_uuids = {}
    for host in NODES:
        gpu_uuids[host] = {m: "GPU-%s-0000-4000-8000-00000000000%d" % (("aaaaaaaa", "bbbbbbbb")[host == "hostb"], m)
                           for m in range(4)}
        write_nvidia_proc(os.path.join(str(tmp_path), "nvidia-proc-" + host), [gpu_uuids[host][m] for m in range(4)])
    env_b = hosts.host_vars["hostb"]["gpuckpt_environment"]
    with open(os.path.join(env_b["FAKECUDA_STATE_DIR"], "gpus"), "w") as fh:
        fh.write("".join(u + "\n" for u in gpu_uuids["hostb"].values()))
    kubelet = KubeletStandIn(api, daemons, hosts, handlers, gpus={"hosta": [0, 1, 2, 3], "hostb": [1, 2, 3]}).start()
    with open(hosts.path("inventory.yml")) as fh:
        inv = json.load(fh)
    for host, d in daemons.items():
        env = dict(hosts.host_vars[host]["gpuckpt_environment"],
                   GPUCKPT_NVIDIA_PROC=os.path.join(str(tmp_path), "nvidia-proc-" + host))
        inv["gpu_nodes"]["hosts"][host].update(gpuckpt_containerd_address=d.address, gpuckpt_k8s_node_name=NODES[host],
                                               gpuckpt_environment=env)
    inv["all"] = {"hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}
    inventory = os.path.join(str(tmp_path), "inventory-pods.yml")
    with open(inventory, "w") as fh:
        json.dump(inv, fh)
    c = {"api": api, "kubelet": kubelet, "daemons": daemons, "inventory": inventory, "handlers": handlers,
         "gpu_uuids": gpu_uuids,
         "kubeconfig": api.kubeconfig(os.path.join(str(tmp_path), "kubeconfig")), "dir": str(tmp_path)}
    yield c
    kubelet.stop()
    api.stop()
    for d in daemons.values():
        d.remove_all()


def start_pod(cluster, hosts, name="gpu-test-pod"):
    """Pod default/<name> on node-a, containers trainer (2 GPUs) and logger, made by node-a's kubelet stand-in;
    returns {container name: PodContainer} once both count."""
    fc = hosts.host_vars["hosta"]["gpuckpt_environment"]["FAKECUDA_STATE_DIR"]
    made, containers, volumes = {}, [], [{"name": "usr", "hostPath": {"path": "/usr"}},
                                         {"name": "etc", "hostPath": {"path": "/etc"}},
                                         {"name": "repo", "hostPath": {"path": REPO}},
                                         {"name": "hosts", "hostPath": {"path": hosts.path()}}]
    for cname in ("trainer", "logger"):
        w = PodContainer(os.path.join(cluster["dir"], "pod-" + cname))
        volumes.append({"name": "work-" + cname, "hostPath": {"path": w.dir}})
        cmd = ("echo %s > /var/written-in-the-layer && exec /usr/bin/python3 %s --dir %s --mb 8 --fakecuda %s"
               % (cname, COUNTER, w.dir, FAKE_LIBCUDA))
        containers.append({
            "name": cname, "image": IMAGE, "command": ["/bin/sh", "-c", cmd],
            "env": [{"name": "PATH", "value": "/usr/bin:/bin"}, {"name": "GPUCKPT_LIBCUDA", "value": FAKE_LIBCUDA},
                    {"name": "FAKECUDA_STATE_DIR", "value": fc}],
            "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True},
                             {"name": "etc", "mountPath": "/etc", "readOnly": True},
                             {"name": "repo", "mountPath": REPO, "readOnly": True},
                             {"name": "hosts", "mountPath": hosts.path()},
                             {"name": "work-" + cname, "mountPath": w.dir}],
            "resources": {"limits": {"nvidia.com/gpu": "2"}} if cname == "trainer" else {}})
        made[cname] = w
    cluster["api"].add_pod({"metadata": {"name": name, "namespace": "default"},
                            "spec": {"nodeName": "node-a", "containers": containers, "volumes": volumes,
                                     "restartPolicy": "Always"}})
    for w in made.values():
        try:
            w.wait_counting(timeout=60)
        except AssertionError as exc:
            raise AssertionError("%s; the kubelet stand-in: %s" % (exc, "\n".join(cluster["kubelet"].log[:4])))
    return made


def migrate_vars(cluster, mid, **extra):
    v = {"pod": "default/gpu-test-pod", "target_node": "node-b", "migration_id": mid,
         "gpuckpt_k8s_auth": {"kubeconfig": cluster["kubeconfig"]}}
    v.update(extra)
    return v


def layer_of(cluster, host, cid, made):
    """The writable layer's file of pod container ``cid``, read by a process exec'd there, through its work dir."""
    daemon = cluster["daemons"][host]
    info = json.loads(daemon.ctr("containers", "info", cid, namespace="k8s.io").stdout)
    name = info["Labels"]["io.kubernetes.container.name"]
    return daemon.read_in_task(cid, "/var/written-in-the-layer", namespace="k8s.io", via_dir=made[name].dir)


def container_pid(cluster, host, cid):
    out = cluster["daemons"][host].ctr("tasks", "ls", namespace="k8s.io", check=False).stdout
    return [int(ln.split()[1]) for ln in out.splitlines()[1:] if ln.split() and ln.split()[0] == cid][0]


def running_pod_containers(cluster, host):
    out = cluster["daemons"][host].ctr("tasks", "ls", namespace="k8s.io", check=False).stdout
    return sorted(ln.split()[0] for ln in out.splitlines()[1:] if ln.strip() and "RUNNING" in ln)


def test_a_pod_of_two_gpu_containers_migrates_to_the_named_node_and_a_rerun_changes_nothing(
        playbook, hosts, cluster):
    made = start_pod(cluster, hosts)
    api = cluster["api"]
    source_uid = api.pod("default", "gpu-test-pod")["metadata"]["uid"]
    before = {n: w.counts() for n, w in made.items()}
    calls_b = os.path.join(hosts.host_vars["hostb"]["gpuckpt_environment"]["FAKECUDA_STATE_DIR"], "calls.log")
    calls_before = os.path.getsize(calls_b) if os.path.exists(calls_b) else 0  # (the hosts live for the session)
    run = playbook(MIGRATE, migrate_vars(cluster, "t-pod"), inventory=cluster["inventory"], interpreter=None)
    assert run.rc == 0, run.stdout[-6000:] + "\n".join(cluster["kubelet"].log)
    ck = run.task("Stage 1/3")
    assert ck["leave_stopped"] is True and len(ck["cuda_pids"]) == 4  # both containers' CUDA processes, one moment
    summary = "\n".join(run.task("Summary")["msg"])
    assert "pod default/gpu-test-pod moved from hosta to hostb" in summary, summary
    target = [p for p in api.all_pods() if p["metadata"]["name"] != "gpu-test-pod"]
    assert len(target) == 1 and target[0]["spec"]["nodeName"] == "node-b", target
    assert target[0]["spec"]["runtimeClassName"] == "gpuckpt-restore"
    assert "as pod default/%s" % target[0]["metadata"]["name"] in summary
    assert api.pod("default", "gpu-test-pod") is None, "the source pod is deleted once its copy runs"
    assert running_pod_containers(cluster, "hosta") == [], "the source's containers were stopped by its kubelet"
    ids = cluster["kubelet"].made[target[0]["metadata"]["uid"]]
    assert sorted(running_pod_containers(cluster, "hostb")) == sorted(ids)
    for name, w in made.items():  # each counts on from its held count, memory intact, no count twice
        w.went_on_intact(before[name])
        w.no_count_twice()
    # each container's writable layer as it was checkpointed, not written again by its entrypoint
    assert sorted(layer_of(cluster, "hostb", cid, made) for cid in ids) == ["logger", "trainer"]
    # The trainer had GPUs 0 and 1 of node-a; the device plugin gave its new container GPUs 1 and 2 of node-b: each
    # of its CUDA processes was restored with the driver's map, place by place, and the restored container's /dev
    # holds the nodes of its new GPUs only (CRIU brought back the old /dev/nvidia0 and /dev/nvidia1).
    a, b = cluster["gpu_uuids"]["hosta"], cluster["gpu_uuids"]["hostb"]
    with open(calls_b) as fh:
        fh.seek(calls_before)
        pairs = [ln.split() for ln in fh.read().splitlines() if ln.startswith("restore-pairs ")]
    assert sorted(p[2] for p in pairs) == ["%s=%s,%s=%s" % (a[0], b[1], a[1], b[2])] * 2, pairs
    trainer = [cid for cid in ids if cid in cluster["kubelet"].gpus_given]
    assert len(trainer) == 1 and cluster["kubelet"].gpus_given[trainer[0]] == [1, 2]
    # (its pid is one of hostb's pid namespace: looked at from there)
    listing = hosts.ssh("hostb", "cd /proc/%d/root/dev && stat -c '%%n %%F %%t %%T' nvidia*"
                        % container_pid(cluster, "hostb", trainer[0])).stdout.split("\n")
    nodes = sorted(ln.strip() for ln in listing if ln.strip())
    assert nodes == ["nvidia1 character special file c3 1", "nvidia2 character special file c3 2"], nodes
    deletes = [r for r in api.requests if r[0] == "DELETE"]
    assert deletes == [("DELETE", "/api/v1/namespaces/default/pods/gpu-test-pod")], deletes
    assert api.deleted_uids == [source_uid]

    again = playbook(MIGRATE, migrate_vars(cluster, "t-pod"), inventory=cluster["inventory"], interpreter=None)
    assert again.rc == 0 and changed_tasks(again) == [], (changed_tasks(again), again.stdout[-5000:])
    for w in made.values():
        assert w.is_counting()
        w.no_count_twice()


def test_a_pod_whose_restore_fails_on_the_target_node_runs_on_at_its_source(playbook, hosts, cluster):
    """The target node's runtime handler restores nothing (its image roots do not hold the image): the node's
    restore gives up, the migration rolls back, the target pod is deleted, and the source pod, held paused,
    runs on: one copy, counting on from its held count, no count twice."""
    with open(os.path.join(os.path.dirname(cluster["handlers"]["hostb"]["gpuckpt-restore"]),
                           "restore-runtime.json")) as fh:
        config = json.load(fh)
    config.update(image_roots=["/nonexistent"], ticket_wait=2)
    with open(os.path.join(os.path.dirname(cluster["handlers"]["hostb"]["gpuckpt-restore"]),
                           "restore-runtime.json"), "w") as fh:
        json.dump(config, fh)
    made = start_pod(cluster, hosts)
    api = cluster["api"]
    run = playbook(MIGRATE, migrate_vars(cluster, "t-pod-fail", gpuckpt_pod_restore_wait=15),
                   inventory=cluster["inventory"], interpreter=None)
    assert run.rc != 0
    assert "rolled back; the workload runs on hosta" in run.stdout, run.stdout[-4000:]
    assert "were not restored on this node" in run.stdout, run.stdout[-4000:]
    deadline = time.monotonic() + 20  # deleted with a grace period: its kubelet (stand-in) then removes it
    while len(api.all_pods()) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p["metadata"]["name"] for p in api.all_pods()] == ["gpu-test-pod"], \
        (api.all_pods(), cluster["kubelet"].log, run.stdout[-5000:])
    assert len(api.deleted_uids) == 1
    assert running_pod_containers(cluster, "hostb") == []
    assert any("is not under the image roots" in ln for ln in cluster["kubelet"].log), cluster["kubelet"].log
    for w in made.values():
        w.went_on_intact(w.counts())
        w.no_count_twice()
    assert len(running_pod_containers(cluster, "hosta")) == 2


@pytest.mark.parametrize("extra, says", [
    ({"gpu_count": 1}, "holds 2 GPU(s); it cannot be restored onto 1"),
    ({"target_node": "node-a"}, "already runs on node node-a"),
    ({"target_node": "node-z"}, "there is no node node-z"),
])
def test_a_pod_that_cannot_move_is_refused_before_anything_is_frozen(playbook, hosts, cluster, extra, says):
    made = start_pod(cluster, hosts)
    before = {n: w.counts() for n, w in made.items()}
    run = playbook(MIGRATE, migrate_vars(cluster, "t-pod-no", **extra), inventory=cluster["inventory"],
                   interpreter=None)
    assert run.rc != 0 and says in run.stdout and "nothing was frozen" in run.stdout, run.stdout[-3000:]
    assert {r[0] for r in cluster["api"].requests} == {"GET"}  # read only: nothing created or deleted
    for name, w in made.items():
        w.went_on_intact(before[name])
    assert len(running_pod_containers(cluster, "hosta")) == 2


@pytest.mark.parametrize("when", ["source-held", "target-pod-made"])
def test_a_pod_migration_whose_controller_dies_is_recovered_to_exactly_one_copy(playbook, hosts, cluster, tmp_path,
                                                                                when):
    """The controller is killed as a whole (its workers and ssh masters too) while the source pod is held, before
    or after the target pod was created; recover.yml then settles the migration: either the target pod runs the
    job and the source pod is deleted, or the target is cleaned and the source pod runs on. Exactly one copy,
    counting on from its held count, none twice; a second recovery changes nothing."""
    from test_faults import Controller
    made = start_pod(cluster, hosts)
    api, mid = cluster["api"], "t-pod-kill-" + when
    # The target node's restore would wait 600 s for the containers of a target pod that may never be made: the
    # recovery asks the API server and, the pod absent, has that restore give up at once.
    ctl = Controller(hosts, tmp_path, dict(migrate_vars(cluster, mid), gpuckpt_pod_restore_wait=600),
                     inventory=cluster["inventory"])

    def source_paused():
        out = cluster["daemons"]["hosta"].ctr("tasks", "ls", namespace="k8s.io", check=False).stdout
        return sum(1 for ln in out.splitlines() if "PAUSED" in ln) == 2
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (when == "source-held" and source_paused()) or (when == "target-pod-made" and len(api.all_pods()) == 2):
            break
        assert ctl.proc.poll() is None, ctl.output()[-3000:]
        time.sleep(0.02)
    else:
        raise AssertionError(ctl.output()[-3000:])
    ctl.kill()
    held = {n: w.counts() for n, w in made.items()}
    rv = {"source": "hosta", "target": "hostb", "migration_id": mid,
          "gpuckpt_k8s_auth": {"kubeconfig": cluster["kubeconfig"]}}
    t0 = time.monotonic()
    r = playbook(RECOVER, rv, inventory=cluster["inventory"], interpreter=None)
    assert r.rc == 0, r.stdout[-5000:] + "\n".join(cluster["kubelet"].log)
    assert time.monotonic() - t0 < 300, "the recovery waited out the target's restore_wait"
    deadline = time.monotonic() + 20  # a pod deleted with a grace period leaves once its kubelet stopped it
    while len(api.all_pods()) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    pods = api.all_pods()
    assert len(pods) == 1, pods
    on_target = pods[0]["metadata"]["name"] != "gpu-test-pod"
    assert len(running_pod_containers(cluster, "hostb" if on_target else "hosta")) == 2
    assert running_pod_containers(cluster, "hosta" if on_target else "hostb") == []
    for name, w in made.items():
        w.went_on_intact(held[name])
        w.no_count_twice()
    again = playbook(RECOVER, rv, inventory=cluster["inventory"], interpreter=None)
    assert again.rc == 0 and changed_tasks(again) == [], changed_tasks(again)


def test_a_kubernetes_node_is_drained_cordoned_its_gpu_pod_moved_and_undrained(playbook, hosts, cluster):
    """drain.yml on a Kubernetes node: --check plans the pod onto node-b and changes nothing; the drain cordons
    node-a through the API server (marked as the drain's), moves the pod whole with the pod path, and reports the
    node empty; undrain takes back only its own cordon. The pod counts on, memory intact, never twice."""
    made = start_pod(cluster, hosts)
    api = cluster["api"]
    before = {n: w.counts() for n, w in made.items()}
    auth = {"gpuckpt_k8s_auth": {"kubeconfig": cluster["kubeconfig"]}}
    check = playbook("gpuckpt.fleet.drain", dict(auth, node="hosta"), inventory=cluster["inventory"], interpreter=None,
                     check=True)
    plan = "\n".join(check.task("The plan")["msg"])
    assert check.rc == 0 and "MOVE  pod default/gpu-test-pod" in plan and "-> hostb" in plan, check.stdout[-5000:]
    assert {r[0] for r in api.requests} == {"GET"} and len(api.all_pods()) == 1  # nothing cordoned, created, deleted
    for name, w in made.items():
        w.went_on_intact(before[name])

    run = playbook("gpuckpt.fleet.drain", dict(auth, node="hosta"), inventory=cluster["inventory"], interpreter=None)
    assert run.rc == 0, run.stdout[-8000:] + "\n".join(cluster["kubelet"].log)
    node_a = api.nodes["node-a"]
    assert node_a["spec"].get("unschedulable") is True
    assert node_a["metadata"]["annotations"]["gpuckpt.fleet/cordoned-by"].startswith("drain-hosta-")
    report = "\n".join(run.task("Where each workload runs now")["msg"])
    assert "MOVED   pod default/gpu-test-pod -> hostb" in report, report
    pods = api.all_pods()
    assert len(pods) == 1 and pods[0]["spec"]["nodeName"] == "node-b", pods
    assert running_pod_containers(cluster, "hosta") == []
    assert len(running_pod_containers(cluster, "hostb")) == 2
    for name, w in made.items():
        w.went_on_intact(before[name])
        w.no_count_twice()

    undrain = playbook("gpuckpt.fleet.drain", dict(auth, node="hosta", undrain=True), inventory=cluster["inventory"],
                       interpreter=None)
    assert undrain.rc == 0, undrain.stdout[-4000:]
    node_a = api.nodes["node-a"]
    assert not node_a["spec"].get("unschedulable") and "gpuckpt.fleet/cordoned-by" not in \
        (node_a["metadata"].get("annotations") or {})
