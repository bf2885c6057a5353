"""A Kubernetes pod found by the collection: the real ``kubernetes`` client in gpu_pod_info talks over
HTTP to the API server TEST DOUBLE (tests/k8s_apiserver_double.py: none can be installed here), whose
pod names two containers that real containerd 2.1.9 runs in namespace k8s.io with the labels the
kubelet gives them; the node side then finds each container's process tree by the id the API gave."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from containerd_daemon import Containerd, available
from helpers import COLLECTIONS, COUNTER, MANAGED_PYTHON, REPO
from test_containerd import ContainerdWorkload

sys.path.insert(0, os.path.join(REPO, "tests"))
from k8s_apiserver_double import ApiServerDouble  # noqa: E402
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program

POD_INFO = os.path.join(REPO, "tests", "integration", "playbooks", "pod_info.yml")
CHECKPOINT, RESTORE = "gpuckpt.fleet.checkpoint", "gpuckpt.fleet.restore"
POD = "default/gpu-test-pod"
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and python3-grpcio (tests/setup.sh) needed")


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    daemon = Containerd(str(tmp_path_factory.mktemp("containerd"))).start()
    daemon.import_skeleton(namespace="k8s.io")
    yield daemon
    daemon.stop()


@pytest.fixture
def cluster(tmp_path, fakecuda, containerd):
    """The API double with nodes node-a (2 GPUs) and node-b (2 GPUs), and pod default/gpu-test-pod on
    node-a: containers trainer (2 GPUs) and logger, each a real containerd task in k8s.io."""
    api = ApiServerDouble().start()
    api.add_node("node-a", gpus=2)
    api.add_node("node-b", gpus=2)
    uid = str(uuid.uuid4())
    made = {}
    for name in ("trainer", "logger"):
        labels = {"io.kubernetes.pod.name": "gpu-test-pod", "io.kubernetes.pod.namespace": "default",
                  "io.kubernetes.pod.uid": uid, "io.kubernetes.container.name": name,
                  "io.cri-containerd.kind": "container"}
        made[name] = ContainerdWorkload(containerd, str(tmp_path / name), fakecuda, "k8s.io", labels=labels,
                                        cid=uuid.uuid4().hex + uuid.uuid4().hex)
    api.add_pod({"metadata": {"name": "gpu-test-pod", "namespace": "default", "uid": uid},
                 "spec": {"nodeName": "node-a", "containers": [
                     {"name": "trainer", "image": "localhost/gpuckpt-skel:1",
                      "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                     {"name": "logger", "image": "localhost/gpuckpt-skel:1"}]},
                 "status": {"phase": "Running", "containerStatuses": [
                     {"name": n, "containerID": "containerd://" + w.id, "image": "localhost/gpuckpt-skel:1",
                      "imageID": "sha256:" + "0" * 64, "ready": True, "restartCount": 0,
                      "state": {"running": {"startedAt": "2026-11-23T10:00:00Z"}}} for n, w in made.items()]}})
    inventory = tmp_path / "inventory.yml"
    node = {"ansible_connection": "local", "ansible_python_interpreter": MANAGED_PYTHON}
    inventory.write_text(json.dumps({"all": {"hosts": {
        "localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "gpu1": dict(node, gpuckpt_k8s_node_name="node-a"), "gpu2": dict(node, gpuckpt_k8s_node_name="node-b")}}}))
    yield {"api": api, "containers": made, "inventory": str(inventory),
           "kubeconfig": api.kubeconfig(str(tmp_path / "kubeconfig")), "address": containerd.address}
    api.stop()
    containerd.remove_all()


def run(playbook, cluster, **pod_args):
    args = dict({"namespace": "default", "name": "gpu-test-pod", "kubeconfig": cluster["kubeconfig"]}, **pod_args)
    return playbook(POD_INFO, {"pod_args": args, "containerd_address": cluster["address"]},
                    inventory=cluster["inventory"], interpreter=None)


def test_a_pods_containers_are_found_on_its_node_by_the_ids_the_api_gives(playbook, cluster):
    r = run(playbook, cluster, target_node="node-b", gpu_count=2)
    assert r.rc == 0, r.stdout
    pod = r.task("Ask the API server")["pod"]
    assert pod["node"] == "node-a" and pod["gpu_count"] == 2
    assert [c["name"] for c in pod["containers"]] == ["trainer", "logger"]
    trees = [res for res in r.results if res["_task"] == "Each container's process tree"]
    assert [t["_host"] for t in trees] == ["gpu1"], trees  # the node mapped to its inventory host
    for item in trees[0]["results"]:
        w = cluster["containers"][item["item"]["name"]]
        facts = item["ansible_facts"]["gpuckpt"]
        assert facts["container"]["id"] == w.id
        assert sorted(facts["tree"]["pids"]) == sorted(w.host_pids())
        assert facts["tree"]["cuda_pids"], facts["tree"]  # each holds CUDA processes (the libcuda double)
    assert {req[0] for req in cluster["api"].requests} == {"GET"}  # found, nothing changed


@pytest.mark.parametrize("args, says", [
    ({"gpu_count": 1}, "holds 2 GPU(s); it cannot be restored onto 1"),
    ({"target_node": "node-a"}, "already runs on node node-a"),
    ({"name": "no-such-pod"}, "there is no pod no-such-pod in namespace default"),
])
def test_what_cannot_move_is_refused_before_anything_is_frozen(playbook, cluster, args, says):
    before = {n: w.counts() for n, w in cluster["containers"].items()}
    r = run(playbook, cluster, **args)
    assert r.rc != 0 and says in r.stdout, r.stdout
    assert "nothing was frozen" in r.stdout
    for n, w in cluster["containers"].items():  # both containers count on, intact, never frozen
        w.went_on_intact(before[n])
        assert w.task()["status"] == "RUNNING"
    assert {req[0] for req in cluster["api"].requests} == {"GET"}


# ---- the node side: the pod's containers checkpointed as one workload -----------------------------------
def pod_vars(cluster, image_dir, **extra):
    v = {"gpuckpt_pod": POD, "gpuckpt_image_dir": image_dir, "gpuckpt_containerd_address": cluster["address"]}
    v.update(extra)
    return v


def cuda_calls(fakecuda, name):
    return [int(pid) for call, pid in fakecuda.calls() if call == name]


def image_size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, unused, files in os.walk(path) for f in files)


def test_a_pod_is_checkpointed_whole_and_runs_on(playbook, cluster, fakecuda, tmp_path):
    made = cluster["containers"]
    before = {n: w.counts() for n, w in made.items()}
    cuda = sorted(p for w in made.values() for p in w.host_pids())  # each process is a CUDA process here
    image_dir = str(tmp_path / "pod-image")
    run = playbook(CHECKPOINT, pod_vars(cluster, image_dir, gpuckpt_leave_running=True), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    res = run.task("Checkpoint pod " + POD)
    assert res["changed"] is True and res["gpu_stage"] == "done", res
    assert sorted(res["cuda_pids"]) == cuda, "the CUDA processes of both containers are one workload"
    assert sorted(cuda_calls(fakecuda, "lock")) == cuda and sorted(cuda_calls(fakecuda, "checkpoint")) == cuda
    with open(os.path.join(image_dir, "manifest.json")) as fh:
        manifest = json.load(fh)
    rt = manifest["runtime"]
    assert rt["backend"] == "k8s_pod" and rt["pod"]["name"] == "gpu-test-pod" and rt["pod"]["uid"]
    assert [c["name"] for c in rt["containers"]] == ["logger", "trainer"]
    assert {c["container"] for c in rt["containers"]} == {w.id for w in made.values()}
    for name in made:
        assert os.listdir(os.path.join(image_dir, "containers", name, "checkpoint")), name
    for name, w in made.items():  # both run on from where they were, GPU back and unlocked
        w.went_on_intact(before[name])
        assert w.task()["status"] == "RUNNING"
    assert all(fakecuda.state(p) == "running" for p in cuda)

    again = playbook(CHECKPOINT, pod_vars(cluster, image_dir, gpuckpt_leave_running=True), env=fakecuda.env)
    assert again.rc == 0 and again.task("Checkpoint pod " + POD)["changed"] is False, again.stdout

    # A pod image is not restored as bare containerd tasks beside the running pod: refused, nothing started.
    rs = playbook(RESTORE, {"gpuckpt_image_dir": image_dir, "gpuckpt_containerd_address": cluster["address"]},
                  env=fakecuda.env)
    assert rs.rc != 0 and "restored into the pod that the kubelet makes" in rs.stdout, rs.stdout
    assert len(containerd_ids(cluster)) == 2


def containerd_ids(cluster):
    return [w.id for w in cluster["containers"].values() if w.exists()]


def resume_held(cluster, fakecuda, image_dir, journal_only=False):
    """The rollback of a held pod, as a migration's recovery runs it: engine.resume_stopped on the image's
    manifest, or (``journal_only``) on what the journal alone tells after a checkpoint killed before its
    manifest: the pod's name and the pids it froze (migration._source_manifest)."""
    script = ("import json, sys\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.held import resume_stopped\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.k8s_pod import KubernetesPodBackend\n"
              "m = image.load_manifest(sys.argv[1])\n"
              "if sys.argv[4] == '1':\n"
              "    m = {'target': m['target'], 'runtime': {'backend': 'k8s_pod', 'container': m['runtime']['container']}}\n"
              "changed, pids = resume_stopped(m, KubernetesPodBackend(sys.argv[2]), libcuda_path=sys.argv[3])\n"
              "print(json.dumps({'changed': changed, 'pids': pids}))\n")
    env = dict(os.environ, PYTHONPATH=COLLECTIONS, **fakecuda.env)
    out = subprocess.run([MANAGED_PYTHON, "-c", script, image_dir, cluster["address"], fakecuda.lib,
                          "1" if journal_only else "0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)
    assert out.returncode == 0, out.stdout
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("journal_only", [False, True], ids=["from-manifest", "from-journal-only"])
def test_a_held_pod_stays_paused_whole_until_it_is_resumed(playbook, cluster, fakecuda, tmp_path, journal_only):
    made = cluster["containers"]
    cuda = sorted(p for w in made.values() for p in w.host_pids())
    image_dir = str(tmp_path / "held")
    run = playbook(CHECKPOINT, pod_vars(cluster, image_dir, gpuckpt_leave_stopped=True), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    held = {n: w.counts() for n, w in made.items()}
    for w in made.values():
        assert w.task()["status"] == "PAUSED" and not w.is_counting(within=1.0)
    assert all(fakecuda.state(p) == "checkpointed" for p in cuda)
    res = resume_held(cluster, fakecuda, image_dir, journal_only)
    assert res["changed"] is True and sorted(res["pids"]) == cuda
    for name, w in made.items():  # counting on from the held count: no count lost, none twice
        w.went_on_intact(held[name])
        assert w.task()["status"] == "RUNNING"
        w.no_count_twice()
    assert all(fakecuda.state(p) == "running" for p in cuda)
    assert resume_held(cluster, fakecuda, image_dir, journal_only)["changed"] is False  # a second resume changes nothing


def test_a_dump_failing_at_the_second_container_resumes_the_whole_pod(playbook, cluster, fakecuda, tmp_path):
    """The image dir fills up while the second container is written (a real ENOSPC on a small tmpfs): the
    first container's image is discarded and both containers run on, their GPU memory back."""
    made = cluster["containers"]
    cuda = sorted(p for w in made.values() for p in w.host_pids())
    probe = str(tmp_path / "probe")  # the size of one container's image, measured on this machine
    first = playbook(CHECKPOINT, pod_vars(cluster, probe, gpuckpt_leave_running=True), env=fakecuda.env)
    assert first.rc == 0, first.stdout
    one = image_size(os.path.join(probe, "containers", "logger"))
    small = str(tmp_path / "small")
    os.mkdir(small)
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dk" % ((one * 3 // 2) // 1024), "gpuckpt-pod-full",
                           small], check=False).returncode == 0
    try:
        before = {n: w.counts() for n, w in made.items()}
        run = playbook(CHECKPOINT, pod_vars(cluster, os.path.join(small, "img"), gpuckpt_leave_stopped=True),
                       env=fakecuda.env)
        assert run.rc != 0, run.stdout
        assert "containerd's checkpoint of" in run.stdout and made["trainer"].id in run.stdout, run.stdout
        assert not os.path.exists(os.path.join(small, "img", "manifest.json"))
        for name, w in made.items():
            w.went_on_intact(before[name])
            assert w.task()["status"] == "RUNNING"
            w.no_count_twice()
        assert all(fakecuda.state(p) == "running" for p in cuda)
    finally:
        subprocess.run(["umount", "-l", small], check=False)


@pytest.mark.parametrize("extra, says", [
    ({}, "a pod's containers cannot exit after their checkpoint"),
    ({"gpuckpt_pod": "default/no-such-pod", "gpuckpt_leave_running": True}, "no running container of pod default/no-such-pod"),
    ({"gpuckpt_pod": "Bad_Name", "gpuckpt_leave_running": True}, "is not <namespace>/<name>"),
    ({"gpuckpt_pod_uid": "not-this-pod", "gpuckpt_leave_running": True}, "(uid not-this-pod)"),
])
def test_a_pod_that_cannot_be_checkpointed_is_refused_before_any_freeze(
        playbook, cluster, fakecuda, tmp_path, extra, says):
    made = cluster["containers"]
    before = {n: w.counts() for n, w in made.items()}
    run = playbook(CHECKPOINT, pod_vars(cluster, str(tmp_path / "img"), **extra), env=fakecuda.env)
    assert run.rc != 0 and says in run.stdout and "nothing was frozen" in run.stdout, run.stdout
    assert [c for c, unused in fakecuda.calls() if c in ("lock", "checkpoint")] == []
    for name, w in made.items():
        w.went_on_intact(before[name])
        assert w.task()["status"] == "RUNNING"


# ---- the restore: into the pod the kubelet makes, through the runtime handler -------------------------------
HANDLER_FILES = os.path.join(REPO, "roles", "nvidia_container_runtime", "files")


def install_handler(tmp_path, image_root):
    """The runtime handler as roles/nvidia_container_runtime installs it, with its settings beside it."""
    d = tmp_path / "handler"
    d.mkdir()
    shutil.copy(os.path.join(HANDLER_FILES, "gpuckpt-restore-runtime"), str(d / "gpuckpt-restore-runtime"))
    with open(os.path.join(HANDLER_FILES, "gpuckpt_restore_runtime.py")) as fh:  # assembled, as the role installs it
        (d / "gpuckpt_restore_runtime.py").write_text(handler_program(fh.read()))
    path = str(d / "gpuckpt-restore-runtime")
    os.chmod(path, 0o755)
    with open(str(d / "restore-runtime.json"), "w") as fh:
        json.dump({"runc": shutil.which("runc"), "image_roots": [image_root], "state_dir": str(d / "state")}, fh)
    return path


def kubelet_makes(cluster, handler, w, pod, uid, name, request):
    """KUBELET STAND-IN (no kubelet can run here): the container that the kubelet would create for container
    ``name`` of the target pod, through the runtime class whose handler is ``handler``: the kubelet's labels,
    the CRI plugin's annotations, the pod's restore annotation, and the pod spec's image, mounts and command
    (those of the source's container ``w``). Returns its containerd id."""
    daemon, cid = w.daemon, uuid.uuid4().hex + uuid.uuid4().hex
    namespace, pod_name = pod.split("/")
    labels = {"io.kubernetes.pod.name": pod_name, "io.kubernetes.pod.namespace": namespace,
              "io.kubernetes.pod.uid": uid, "io.kubernetes.container.name": name,
              "io.cri-containerd.kind": "container"}
    annotations = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-namespace": namespace,
                   "io.kubernetes.cri.sandbox-name": pod_name, "io.kubernetes.cri.container-name": name,
                   "gpuckpt.fleet/restore": request}
    args = ["run", "--detach", "--runc-binary", handler, "--runc-root", w.runc_root,
            "--log-uri", "file://" + os.path.join(w.base, "out-restored.log"), "--env", "PATH=/usr/bin:/bin"]
    for k, v in sorted(labels.items()):
        args += ["--label", "%s=%s" % (k, v)]
    for k, v in sorted(annotations.items()):
        args += ["--annotation", "%s=%s" % (k, v)]
    for src, opt in [("/usr", "ro"), ("/etc", "ro"), (REPO, "ro"), (w.dir, "rw"), (w.fakecuda_dir, "rw")]:
        args += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, opt)]
    cmd = "echo fresh > /var/written-in-the-layer && exec /usr/bin/python3 %s --dir %s --mb 8" % (COUNTER, w.dir)
    res = daemon.ctr(*(args + [daemon.import_skeleton("k8s.io"), cid, "/bin/sh", "-c", cmd]), namespace="k8s.io",
                     check=False)
    return cid, res


def restore_pod(cluster, fakecuda, image_dir, pod, token, wait=60):
    """The node's part of a pod's restore, as the pod migration runs it: engine.restore with the pod backend,
    which writes the restore ticket and waits for the target pod's containers (in the background: the kubelet
    makes them meanwhile)."""
    script = ("import json, sys\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.k8s_pod import KubernetesPodBackend\n"
              "b = KubernetesPodBackend(sys.argv[2], restore_pod=sys.argv[4], restore_token=sys.argv[5],\n"
              "                         restore_wait=int(sys.argv[6]))\n"
              "try:\n"
              "    r = restore(sys.argv[1], backend=b, libcuda_path=sys.argv[3])\n"
              "    print(json.dumps({'ok': True, 'pids': r['pids'], 'cuda_pids': r['cuda_pids'], 'timings': r['timings']}))\n"
              "except Exception as exc:\n"
              "    print(json.dumps({'ok': False, 'error': str(exc)}))\n")
    env = dict(os.environ, PYTHONPATH=COLLECTIONS, **fakecuda.env)
    return subprocess.Popen([MANAGED_PYTHON, "-c", script, image_dir, cluster["address"], fakecuda.lib, pod, token,
                             str(wait)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True)


def finished(proc):
    out, unused = proc.communicate(timeout=180)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out
    return json.loads(lines[-1]), out


def test_a_held_pod_is_restored_into_the_pod_the_kubelet_makes_and_counts_on(playbook, cluster, fakecuda, tmp_path):
    made = cluster["containers"]
    image_root = str(tmp_path / "images")
    os.mkdir(image_root, 0o700)
    image_dir = os.path.join(image_root, "m1")
    run = playbook(CHECKPOINT, pod_vars(cluster, image_dir, gpuckpt_leave_stopped=True), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    held = {n: w.counts() for n, w in made.items()}
    handler = install_handler(tmp_path, image_root)
    token, target, uid = uuid.uuid4().hex, "default/gpu-test-pod-b", str(uuid.uuid4())
    request = json.dumps({"image": image_dir, "token": token})

    # Another pod, or the right pod with a wrong token, is refused by the handler: nothing restored or started.
    node = restore_pod(cluster, fakecuda, image_dir, target, token)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(image_dir, "restore-ticket.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pod, req in [("default/someone-else", request),
                     (target, json.dumps({"image": image_dir, "token": "guess"})),
                     (target, json.dumps({"image": "/etc", "token": token}))]:
        cid, res = kubelet_makes(cluster, handler, made["logger"], pod, str(uuid.uuid4()), "logger", req)
        assert res.returncode != 0, res.stdout
        assert "gpuckpt-restore-runtime" in res.stderr + res.stdout, res.stderr
    for w in made.values():
        assert w.task()["status"] == "PAUSED" and not w.is_counting(within=1.0)

    made_b = {}
    for name, w in made.items():
        cid, res = kubelet_makes(cluster, handler, w, target, uid, name, request)
        assert res.returncode == 0, res.stderr
        made_b[name] = cid
    out, text = finished(node)
    assert out["ok"] is True, text
    assert sorted(out["cuda_pids"]) == sorted(out["pids"])  # every process is a CUDA process here
    # The held source's processes keep their host pids; the restored ones live in new pid namespaces, so the
    # restore does not wait for those host pids to be free (it once waited 10 s here).
    assert out["timings"]["wait_pids_free"] < 2, out["timings"]
    assert all(fakecuda.state(p) == "running" for p in out["cuda_pids"])
    for name, w in made.items():  # the restored copy counts on from the held count: none lost, none twice
        w.went_on_intact(held[name])
        w.no_count_twice()
        # its writable layer as checkpointed, not the fresh command's
        assert w.daemon.read_in_task(made_b[name], "/var/written-in-the-layer", namespace="k8s.io") == w.id
    # The same container made again (the job exited, the kubelet restarts it) is never restored twice.
    with open(os.path.join(image_dir, "containers", "logger", ".restore-claim")) as fh:
        assert fh.read() == "restored"
    # A container whose restore failed is never started from its entrypoint by a later create (the kubelet's
    # retry) while the migration decides: refused, nothing runs.
    with open(os.path.join(image_dir, "containers", "logger", ".restore-claim"), "w") as fh:
        fh.write("failed")
    cid, res = kubelet_makes(cluster, handler, made["logger"], target, uid, "logger", request)
    assert res.returncode != 0 and "is failed" in res.stderr + res.stdout, res.stderr
    made["logger"].went_on_intact(made["logger"].counts())
    made["logger"].no_count_twice()


def test_a_node_restore_that_gives_up_leaves_no_restored_copy_running(playbook, cluster, fakecuda, tmp_path):
    """Only one of the pod's containers is made on the node before the restore's wait ends: the copy that was
    restored is killed, every claim says failed (the kubelet's restart and the other container are refused),
    and the source stays held whole, ready for the rollback."""
    made = cluster["containers"]
    image_root = str(tmp_path / "images")
    os.mkdir(image_root, 0o700)
    image_dir = os.path.join(image_root, "m2")
    run = playbook(CHECKPOINT, pod_vars(cluster, image_dir, gpuckpt_leave_stopped=True), env=fakecuda.env)
    assert run.rc == 0, run.stdout
    held = {n: w.counts() for n, w in made.items()}
    handler = install_handler(tmp_path, image_root)
    token, target, uid = uuid.uuid4().hex, "default/gpu-test-pod-c", str(uuid.uuid4())
    request = json.dumps({"image": image_dir, "token": token})
    node = restore_pod(cluster, fakecuda, image_dir, target, token, wait=8)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(image_dir, "restore-ticket.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    cid, res = kubelet_makes(cluster, handler, made["logger"], target, uid, "logger", request)
    assert res.returncode == 0, res.stderr
    out, text = finished(node)
    assert out["ok"] is False and "trainer" in out["error"] and "were not restored" in out["error"], text
    restored = made["logger"].daemon.ctr("tasks", "ls", namespace="k8s.io").stdout
    assert not [ln for ln in restored.splitlines() if ln.startswith(cid) and "RUNNING" in ln], restored
    for name in made:
        with open(os.path.join(image_dir, "containers", name, ".restore-claim")) as fh:
            assert fh.read() == "failed"
    cid2, res = kubelet_makes(cluster, handler, made["trainer"], target, uid, "trainer", request)
    assert res.returncode != 0 and "is failed" in res.stderr + res.stdout, res.stderr
    for w in made.values():  # the source, held whole, resumes and counts on from its held count
        assert w.task()["status"] == "PAUSED"
    res = resume_held(cluster, fakecuda, image_dir)
    assert res["changed"] is True
    for name, w in made.items():
        w.went_on_intact(held[name])
        w.no_count_twice()
