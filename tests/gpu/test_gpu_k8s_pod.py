"""On a real GPU: a pod's GPU container held on its node and restored through the pod path, into the container a
KUBELET STAND-IN makes for the target pod through the runtime handler gpuckpt-restore-runtime (no kubelet runs
here). One containerd 2.1 (carried: tests/gpu/prepare_carry.sh), namespace k8s.io, the kubelet's labels and the CRI
plugin's annotations on both containers, the GPU put into each spec as CDI does (test_gpu_runc.gpu_spec).

Steps, as a pod migration runs them on one machine (its only GPU is both nodes' GPU): gpu_checkpoint with runtime
k8s_pod holds the pod paused, its GPU memory in host RAM (then the held source is removed, as it would be on
another node: here it would share the host network namespace, and its abstract sockets, with the copy); the node's
restore (engine.restore with the pod backend and
the restore ticket) waits; the stand-in makes the target pod's container under the handler, which restores it with
runc restore; the engine brings the GPU memory back and unlocks it. The PyTorch workload's GPU checksum is then
compared with the one taken when it filled its memory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from gpu_helpers import REPO, WORKLOAD_PYTHON, TorchWorkload
from test_gpu_runc import PASS_ENV, gpu_spec

sys.path.insert(0, os.path.join(REPO, "tests"))
from containerd_daemon import CTR, Containerd, available  # noqa: E402

GIB = float(os.environ.get("GPUCKPT_GPU_GIB", "4"))
NAMESPACE = "k8s.io"
COLLECTIONS = os.path.join(REPO, ".build", "collections")
HANDLER_FILES = os.path.join(REPO, "roles", "nvidia_container_runtime", "files")
pytestmark = pytest.mark.skipif(not available(), reason="containerd 2.x and grpcio (tests/gpu/install_tools.sh)")


def _api(address):
    sys.path.insert(0, COLLECTIONS)
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.containerd_api import Client
    return Client(address, NAMESPACE)


def make_container(daemon, runc_root, pod, uid, cname, workdir, args, handler=None, annotations=None, gpu_minors=None,
                   env=None, spec_edit=None):
    """What the kubelet makes for container ``cname`` of pod ``pod``: labels, CRI annotations, a GPU spec with
    the GPUs ``gpu_minors`` (None: all), as the device plugin gives them; ``env`` beside PASS_ENV, and
    ``spec_edit(spec)`` for what the pod's spec asks beyond that (mounts, a host name)."""
    namespace, name = pod.split("/")
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    labels = {"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace, "io.kubernetes.pod.uid": uid,
              "io.kubernetes.container.name": cname, "io.cri-containerd.kind": "container"}
    ann = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-namespace": namespace,
           "io.kubernetes.cri.sandbox-name": name, "io.kubernetes.cri.container-name": cname}
    ann.update(annotations or {})
    create = [CTR, "--address", daemon.address, "--namespace", NAMESPACE, "containers", "create", "--net-host",
              "--runc-root", runc_root] + (["--runc-binary", handler] if handler else [])
    for k, v in dict(PASS_ENV, **(env or {})).items():
        create += ["--env", "%s=%s" % (k, v)]
    for src in (REPO, workdir):
        create += ["--mount", "type=bind,src=%s,dst=%s,options=rbind:%s" % (src, src, "ro" if src == REPO else "rw")]
    for k, v in sorted(labels.items()):
        create += ["--label", "%s=%s" % (k, v)]
    for k, v in sorted(ann.items()):
        create += ["--annotation", "%s=%s" % (k, v)]
    subprocess.run(create + [daemon.import_skeleton(NAMESPACE), cid] + args, check=True)
    api = _api(daemon.address)
    try:
        record = api.container(cid)
        spec = gpu_spec(record["spec"], gpu_minors=gpu_minors)
        if spec_edit is not None:
            spec_edit(spec)
        api.update_spec(cid, spec, record["spec_url"], "test")
    finally:
        api.close()
    res = subprocess.run([CTR, "--address", daemon.address, "--namespace", NAMESPACE, "tasks", "start", "--detach",
                          "--log-uri", "file://" + os.path.join(workdir, "container-%s.log" % cid[:8]), cid],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False,
                         timeout=240)
    return cid, res


def diagnostics(daemon, hdir):
    """What a failed or hung restore left to read: the handler's CRIU logs, containerd's log, the tasks, the
    processes of the restore."""
    out = {}
    for d, unused, files in os.walk(str(hdir)):
        for f in files:
            if f.endswith(".log"):
                with open(os.path.join(d, f), errors="replace") as fh:
                    out[os.path.join(d, f)] = fh.read()[-3000:]
    log = os.path.join(daemon.dir, "containerd.log")
    if os.path.exists(log):
        with open(log, errors="replace") as fh:
            out["containerd.log"] = fh.read()[-4000:]
    out["tasks"] = daemon.ctr("tasks", "ls", namespace=NAMESPACE, check=False).stdout
    out["ps"] = subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,args"], stdout=subprocess.PIPE,
                               universal_newlines=True, check=False).stdout[-6000:]
    return out


def gpus_cgroup_devices(pid):
    """Which GPU device nodes the cgroup of ``pid`` lets it open, tried from a child in that cgroup: {node: allowed}
    for /dev/nvidia0..7 of the host (cgroup v2's device rules are a BPF program, not readable as a list)."""
    with open("/proc/%d/cgroup" % pid) as fh:
        cg = [ln.split(":", 2)[2].strip() for ln in fh if ln.startswith("0::")][0]
    code = ("import os, sys\n"
            "open('/sys/fs/cgroup%s/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "out = {}\n"
            "for m in range(8):\n"
            "    p = '/dev/nvidia%%d' %% m\n"
            "    if os.path.exists(p):\n"
            "        try:\n"
            "            os.close(os.open(p, os.O_RDWR)); out[p] = True\n"
            "        except OSError as e:\n"
            "            out[p] = e.strerror\n"
            "print(out)\n" % cg)
    res = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, check=False, timeout=30)
    return {"cgroup": cg, "probe": res.stdout.strip()[-2000:]}


class PodTorch(TorchWorkload):
    """torch_counter.py as the container ``trainer`` of pod default/gpu-test-pod."""

    def __init__(self, daemon, runc_root, directory, gib, gpu_minors=None):  # pylint: disable=super-init-not-called
        self.dir, self.gib, self.roles = directory, gib, ["parent"]
        os.makedirs(directory, exist_ok=True)
        self.uid = str(uuid.uuid4())
        args = [WORKLOAD_PYTHON, os.path.join(REPO, "tests", "workloads", "torch_counter.py"), "--dir", directory,
                "--gib", str(gib)]
        self.id, res = make_container(daemon, runc_root, "default/gpu-test-pod", self.uid, "trainer", directory, args,
                                      gpu_minors=gpu_minors)
        assert res.returncode == 0, res.stdout
        deadline = time.monotonic() + 180
        while not os.path.exists(os.path.join(directory, "parent.state")):
            assert time.monotonic() < deadline, "the pod's container never started counting"
            time.sleep(0.2)
        self.wait_counting()
        self.pids = []


def install_handler(hdir, image_root):
    """The runtime handler gpuckpt-restore-runtime in ``hdir`` (a new folder), assembled as the role installs it,
    restoring images under ``image_root`` only; returns its path."""
    hdir.mkdir()
    sys.path.insert(0, COLLECTIONS)
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_handler import handler_program
    shutil.copy(os.path.join(HANDLER_FILES, "gpuckpt-restore-runtime"), str(hdir / "gpuckpt-restore-runtime"))
    with open(os.path.join(HANDLER_FILES, "gpuckpt_restore_runtime.py")) as fh:
        (hdir / "gpuckpt_restore_runtime.py").write_text(handler_program(fh.read()))
    os.chmod(str(hdir / "gpuckpt-restore-runtime"), 0o755)
    (hdir / "restore-runtime.json").write_text(json.dumps({
        "runc": shutil.which("runc"), "image_roots": [image_root], "state_dir": str(hdir / "state"),
        "ticket_wait": 120}))
    return str(hdir / "gpuckpt-restore-runtime")


def node_restore(image_dir, daemon, target, token, runc_root):
    """The target node's side of a pod restore (engine.restore with the pod backend and the ticket), started: it
    waits for the target pod's containers, which the handler restores. Prints its result as one JSON line."""
    script = ("import json, sys\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.engine.restore import restore\n"
              "from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes.k8s_pod import "
              "KubernetesPodBackend\n"
              "b = KubernetesPodBackend(sys.argv[2], runc_root=sys.argv[5], restore_pod=sys.argv[3], "
              "restore_token=sys.argv[4], restore_wait=300)\n"
              "r = restore(sys.argv[1], backend=b)\n"
              "print(json.dumps({'pids': r['pids'], 'cuda_pids': r['cuda_pids'], 'timings': r['timings'], "
              "'resumed_at': r['resumed_at'], 'gpu_pairs': r['gpu_pairs'], "
              "'cooperative_resumed': r.get('cooperative_resumed'), 'msg': r.get('msg')}))\n")
    env = dict(os.environ, PYTHONPATH=COLLECTIONS + ":" + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", script, image_dir, daemon.address, target, token, runc_root],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)


def gpu_inventory():
    sys.path.insert(0, COLLECTIONS)
    from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import devices as gpus
    return gpus.inventory()


def test_a_gpu_pod_is_held_then_restored_through_the_runtime_handler_with_its_gpu_memory(playbook, tmp_path, record):
    """On a machine with one GPU the target pod is given that GPU again; with two or more, the source pod has
    the first and the target pod the second (as a device plugin on another node would choose): the restore
    maps the job onto it with the driver's pairs, and its container's /dev holds that GPU's node only."""
    inv = gpu_inventory()
    src_minors = dst_minors = None
    if len(inv) >= 2:
        src_minors, dst_minors = [inv[0]["minor"]], [inv[1]["minor"]]
    record("gpu_k8s_pod_placement", inventory=inv, source_minors=src_minors, target_minors=dst_minors)
    daemon = Containerd("/tmp/gpk-gpod-%d" % os.getpid()).start()
    runc_root = str(tmp_path / "runc-root")
    image_root = str(tmp_path / "images")
    os.mkdir(image_root, 0o700)
    image_dir = os.path.join(image_root, "gpu-pod-1")
    try:
        w = PodTorch(daemon, runc_root, str(tmp_path / "w"), GIB, gpu_minors=src_minors)
        before = w.counts()
        run = playbook("gpuckpt.fleet.checkpoint", {
            "gpuckpt_pod": "default/gpu-test-pod", "gpuckpt_image_dir": image_dir, "gpuckpt_leave_stopped": True,
            "gpuckpt_containerd_address": daemon.address, "gpuckpt_runc_root": runc_root})
        record("gpu_k8s_pod_checkpoint_attempt", rc=run.rc, tail=run.stdout[-4000:] if run.rc else "")
        assert run.rc == 0, run.stdout
        ck = run.task("Checkpoint pod default/gpu-test-pod")
        assert len(ck["cuda_pids"]) == 1 and ck["gpu_stage"] == "done", ck
        held = w.counts()
        # the GPU its CUDA process held (its device files) and its container's GPUs (its spec), by the driver's UUID
        sys.path.insert(0, COLLECTIONS)
        from ansible_collections.gpuckpt.fleet.plugins.module_utils.core import image as image_mod
        manifest = image_mod.load_manifest(image_dir)
        uuids = manifest["host"]["cuda_device_uuids"]
        held_gpus = manifest["target"]["gpus"][str(ck["cuda_pids"][0])]
        container_gpus = manifest["runtime"]["containers"][0]["gpus"]
        record("gpu_k8s_pod_gpus", driver_uuids=uuids, process_gpus=held_gpus, container_gpus=container_gpus)
        given = [g["uuid"] for g in inv if src_minors is None or g["minor"] in src_minors]
        assert [g["uuid"] for g in held_gpus] == given[:1] and [g["uuid"] for g in container_gpus] == given, \
            (held_gpus, container_gpus, given)
        time.sleep(1)
        assert w.counts() == held, "the held pod must not count"
        # On two nodes the held source lives on in its own node's network namespace. Here both containers would
        # share this machine's (gpu_spec: host network), where the held source keeps its abstract unix sockets
        # bound, so the copy could not bind them again: the source goes first, as if it were on another node.
        daemon.ctr("tasks", "kill", "--signal", "SIGKILL", w.id, namespace=NAMESPACE, check=False)
        for unused in range(100):
            if daemon.ctr("tasks", "delete", w.id, namespace=NAMESPACE, check=False).returncode == 0:
                break
            time.sleep(0.1)

        hdir = tmp_path / "handler"
        handler = install_handler(hdir, image_root)
        token, target = uuid.uuid4().hex, "default/gpu-test-pod-b"
        node = node_restore(image_dir, daemon, target, token, runc_root)
        t0 = time.monotonic()
        args2 = [WORKLOAD_PYTHON, os.path.join(REPO, "tests", "workloads", "torch_counter.py"), "--dir", w.dir,
                 "--gib", str(GIB)]  # the pod spec's command: never run, the handler restores instead
        request = json.dumps({"image": image_dir, "token": token})
        try:
            cid, res = make_container(daemon, runc_root, target, str(uuid.uuid4()), "trainer", w.dir, args2,
                                      handler=handler,
                                      annotations={"gpuckpt.fleet/restore": request}, gpu_minors=dst_minors)
            made = time.monotonic() - t0
            out, unused = node.communicate(timeout=330)
        except subprocess.TimeoutExpired as exc:
            node.kill()
            record("gpu_k8s_pod_restore_hung", what=str(exc), node=(node.communicate()[0] or "")[-4000:],
                   **diagnostics(daemon, hdir))
            raise
        if res.returncode != 0 or node.returncode != 0:
            record("gpu_k8s_pod_restore_diagnostics", **diagnostics(daemon, hdir))
        record("gpu_k8s_pod_restore_attempt", rc=node.returncode, create_rc=res.returncode, create=res.stdout[-2000:],
               node=out[-4000:])
        assert res.returncode == 0, res.stdout
        assert node.returncode == 0, out
        result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        assert len(result["cuda_pids"]) == 1
        new_pid = result["cuda_pids"][0]
        if dst_minors is None:
            assert not result["gpu_pairs"], "its own GPU again: the driver's default, no map"
            expect_minors = [g["minor"] for g in container_gpus]
        else:
            moved = {g["minor"]: g["uuid"] for g in inv}
            assert result["gpu_pairs"] == {str(new_pid): [[moved[src_minors[0]], moved[dst_minors[0]]]]}, \
                result["gpu_pairs"]
            expect_minors = dst_minors
        dev = "/proc/%d/root/dev" % result["pids"][0]
        nodes = {}
        for n in sorted(os.listdir(dev)):
            if n.startswith("nvidia"):
                st = os.lstat(os.path.join(dev, n))
                nodes[n] = {"rdev": [os.major(st.st_rdev), os.minor(st.st_rdev)], "ctime": st.st_ctime}
        # (issue 43, 9: on two GPUs the restored /dev once held nvidia0 beside nvidia1: when each node was made,
        # against the restore's stages, says who made it; and which device nodes the container's cgroup allows)
        record("gpu_k8s_pod_restored_dev", nodes=nodes, resumed_at=result["resumed_at"], timings=result["timings"],
               expect_minors=expect_minors, cgroup=gpus_cgroup_devices(result["pids"][0]))
        assert sorted(n for n in nodes if n[6:].isdigit()) == ["nvidia%d" % m for m in expect_minors], nodes
        from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import devices as gpus
        now_on = gpus.process_gpus(new_pid, inv)
        record("gpu_k8s_pod_restored_onto", gpu_pairs=result["gpu_pairs"], process_gpus=now_on)
        assert [g["minor"] for g in now_on] == expect_minors[:1], now_on
        w.wait_counting(beyond=held)
        assert w.verified_after(w.counts())
        record("gpu_k8s_pod_restore", gib=GIB, image_bytes=ck["image_bytes"], checkpoint=ck["timings"],
               restore=result["timings"], handler_create_seconds=made, counts_before=before, counts_held=held,
               counts_after=w.counts())
    finally:
        daemon.remove_all()
        daemon.stop()
