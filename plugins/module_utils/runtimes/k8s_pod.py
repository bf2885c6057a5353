# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Kubernetes pod on its node: every running container of the pod, found in containerd's ``k8s.io``
namespace by the labels the kubelet gives them (``io.kubernetes.pod.namespace``, ``.pod.name``,
``.pod.uid``, ``io.kubernetes.container.name``; the sandbox's pause container, kind ``sandbox``, is not
part of the workload), checkpointed as one workload.

One workload, because a pod's containers share its network, its IPC and often a volume or shared
memory: a checkpoint that froze them one at a time would record one container after the other had
already gone on talking to it. So:
- the engine locks and checkpoints the CUDA processes of *all* containers before any is dumped (this
  backend's tree is their union);
- every container is paused before the first is checkpointed, and each is then checkpointed by
  containerd while paused (``ContainerdBackend.dump_task``): the image is one moment of the whole pod;
- after=running resumes them all once every container is written; after=stopped keeps them all
  paused (a migration's source, held until its target runs);
- a failure at any container resumes every container it paused (the engine then gives the GPU back).

after=exit is refused before anything is frozen: the kubelet restarts a pod's exited containers from
their image's entrypoint (restartPolicy), which would run the job a second time from its start.

The image holds one directory per container, ``containers/<name>/``, each laid out as the containerd
backend lays out a container's image (``checkpoint/``, ``rootfs-diff.tar``); the manifest's runtime
record names the pod and each container's own record.

A pod image is restored by the pod migration, into the pod the kubelet makes on the target node; a
plain restore of it here as containerd tasks would run containers that no kubelet manages and no
device plugin accounts for, so ``restore`` refuses it (docs/kubernetes.md).
"""
from __future__ import annotations

import os
import re

from ..core import procfs
from ..core.errors import GpuCkptError, InvalidTarget
from ..core.wait import wait_for
from ..cuda import devices as gpu_devices
from ..k8s.names import CONTAINER_NAME, K8S_NAMESPACE, KIND, POD_NAME, POD_NAMESPACE, POD_UID
from ..k8s.restore_protocol import (CONTAINERS_SUBDIR, FAILED, RESTORED, container_path, read_claim,
                                    read_restore_ticket, set_claim, write_restore_ticket)
from .base import ContainerBackend
from .containerd import ContainerdBackend
from .containerd_api import Client, ContainerdError

STOP_WAIT = 120  # seconds a committed source waits for the kubelet to stop its deleted pod's containers
# Kubernetes names: namespaces and container names are DNS labels, pod names DNS subdomains
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


def parse_pod(target):
    """"namespace/name" (or a bare name, in namespace default) as (namespace, name), or refused."""
    text = str(target or "")
    namespace, sep, name = text.partition("/")
    if not sep:
        namespace, name = "default", text
    if not DNS_LABEL.match(namespace) or not DNS_SUBDOMAIN.match(name):
        raise InvalidTarget("pod %r is not <namespace>/<name> with Kubernetes names; nothing was frozen" % text,
                            stage="preflight", hint="for example: pod: default/gpu-test-pod")
    return namespace, name


def container_dir(image_dir, name):
    """The directory of container ``name`` in a pod image, refused for a name Kubernetes would not give
    (the name comes from a manifest on restore, or from labels on the node)."""
    if not DNS_LABEL.match(str(name or "")):
        raise InvalidTarget("container name %r is not a Kubernetes container name" % (name,), stage="preflight")
    return container_path(image_dir, name)


def restore_claim(image_dir, name):
    """The state of container ``name``'s restore claim in a pod image (restore_protocol), None when unclaimed."""
    return read_claim(container_dir(image_dir, name))


def set_restore_claim(image_dir, name, state):
    """Under the claim's lock, which the runtime handler takes before it marks a finished restore: a restore
    that finishes after this sees "failed" and removes its copy."""
    set_claim(container_dir(image_dir, name), state)


def _is_pod_container(labels, namespace, name):
    """A workload container of pod ``namespace/name`` by the kubelet's labels (not the sandbox's pause container)."""
    return labels.get(POD_NAMESPACE) == namespace and labels.get(POD_NAME) == name and \
        labels.get(KIND, "container") == "container"


class KubernetesPodBackend(ContainerBackend):
    name = "k8s_pod"
    # (its containers' checkpoints are containerd's: the shim's CRIU, with the node's configuration)
    capabilities = ContainerBackend.capabilities._replace(can_hold_stopped=True, keeps_criu_plugins_off=False)
    passes_criu_flags = ContainerdBackend.passes_criu_flags

    def __init__(self, address=None, runc_root=None, criu_path=None, criu_options=(), timeout=None, pod_uid=None,
                 containers=None, restore_pod=None, restore_token=None, restore_wait=None, tcp_established=False):
        super(KubernetesPodBackend, self).__init__(criu_path, criu_options, timeout, tcp_established=tcp_established)
        self.address, self.runc_root = address, runc_root
        self.namespace = K8S_NAMESPACE
        self.pod_uid = pod_uid or None
        self.expected = list(containers or [])  # the names the API server lists (gpu_pod_info), when given
        self.pod = None
        self.members = []  # [(container name, ContainerdBackend bound to its container)], in name order
        self.trees = {}    # container name: (its task's host pid, its process tree), found by resolve
        # the restore: the target pod (namespace/name) the controller creates, its token, how long to wait for it
        self.restore_pod, self.restore_token, self.restore_wait = restore_pod, restore_token, restore_wait
        self._restoring, self._restored_image = [], None

    def _member(self, container_id=None):
        return ContainerdBackend(self.address, K8S_NAMESPACE, self.runc_root, self._criu_path, self.extra, self.timeout,
                                 container=container_id, tcp_established=self.tcp_established)

    def client(self):
        return Client(self.address, K8S_NAMESPACE, timeout=60)

    def runtime_facts(self):
        facts = self._member().runtime_facts()
        facts["kubernetes_pod"] = self.pod
        return facts

    # -- finding the pod ---------------------------------------------------------------------------------
    def _pod_containers(self, api, namespace, name):
        """The containers of pod ``namespace/name`` (of ``pod_uid`` when given) in containerd's k8s.io namespace,
        and the pod's uid; refused when this is no Kubernetes node, or when two pods of that name are here."""
        if K8S_NAMESPACE not in api.namespaces():
            raise InvalidTarget("containerd at %s has no namespace %s: this host is not a Kubernetes node that "
                                "runs containerd (or containerd_address names another containerd); nothing was "
                                "frozen" % (api.address, K8S_NAMESPACE), stage="preflight")
        ours = [c for c in api.containers() if _is_pod_container(c["labels"], namespace, name)
                and (self.pod_uid is None or c["labels"].get(POD_UID) == self.pod_uid)]
        uids = sorted({c["labels"].get(POD_UID) or "" for c in ours})
        if len(uids) > 1:
            raise InvalidTarget("containers of %d pods named %s/%s are on this node (uids %s); nothing was frozen"
                                % (len(uids), namespace, name, ", ".join(uids)), stage="preflight",
                                hint="give pod_uid (gpu_pod_info returns it)")
        return ours, (uids[0] if uids else None)

    @staticmethod
    def _running_by_name(api, containers, namespace, name):
        """{container name: id} of those of ``containers`` whose task runs (the kubelet keeps a restarted
        container's exited attempts beside the running one); refused when a name runs twice."""
        running = {}
        for c in containers:
            task = api.task(c["id"])
            if task is None or task["status"] != "running":
                continue
            cname = c["labels"].get(CONTAINER_NAME)
            if cname in running:
                raise InvalidTarget("container %s of pod %s/%s runs twice on this node (%s and %s); nothing was "
                                    "frozen" % (cname, namespace, name, running[cname], c["id"]),
                                    stage="preflight")
            container_dir("/", cname)  # a name Kubernetes would give, or refused
            running[cname] = c["id"]
        return running

    def running_containers(self):
        """None of its own: a pod's containers are containerd's in the kubelet's namespace, which the containerd
        backend lists with their pod's labels (fleet/workloads groups them into pods)."""
        return []

    def _running_containers(self, namespace, name):
        """({container name: container id} of the pod's running containers on this node, the pod's uid)."""
        api = self.client()
        try:
            ours, uid = self._pod_containers(api, namespace, name)
            running = self._running_by_name(api, ours, namespace, name)
        finally:
            api.close()
        if not running:
            raise InvalidTarget("no running container of pod %s/%s%s in containerd's %s namespace on this node; "
                                "nothing was frozen" % (namespace, name, " (uid %s)" % self.pod_uid if self.pod_uid
                                                        else "", K8S_NAMESPACE), stage="preflight",
                                hint="run this on the pod's node (gpu_pod_info names it), with the node's "
                                     "containerd_address")
        missing = [n for n in self.expected if n not in running]
        if missing:
            raise InvalidTarget("container %s of pod %s/%s does not run on this node; nothing was frozen"
                                % (missing[0], namespace, name), stage="preflight",
                                hint="a pod is checkpointed with all of its containers running")
        return running, uid

    def resolve(self, target):
        namespace, name = parse_pod(target)
        running, uid = self._running_containers(namespace, name)
        self.pod = {"namespace": namespace, "name": name, "uid": uid or self.pod_uid}
        self.members, self.trees, pids, root = [], {}, [], None
        for cname in sorted(running):
            member = self._member()
            pid, tree = member.resolve(running[cname])
            self.members.append((cname, member))
            self.trees[cname] = (pid, tree)
            root = pid if root is None else root
            pids += [p for p in tree if p not in pids]
        self.container = "%s/%s" % (namespace, name)
        return root, pids

    def plan_tree(self, pids, internal_tcp=False):
        """Each container's CRIU needs, found on its own tree: its own options go to its own checkpoint."""
        flags = []
        for cname, member in self.members:
            member.plan_tree(self.trees[cname][1], internal_tcp=internal_tcp)
            flags += [f for f in member.auto_flags if f not in flags]
        self.auto_flags = flags
        self.criu_flags()
        return flags

    # -- checkpoint ----------------------------------------------------------------------------------------
    def check_after(self, after):
        if after == "exit":
            raise InvalidTarget("a pod's containers cannot exit after their checkpoint: the kubelet would start them "
                                "again from their entrypoint, running the job a second time from its start; nothing "
                                "was frozen", stage="preflight",
                                hint="checkpoint a pod with leave_stopped (held until its copy runs elsewhere) or "
                                     "leave_running (a copy)")

    def dump(self, target, image_dir, work_dir, after):
        self.check_after(after)
        inv = gpu_devices.inventory()  # (read before the pause: no downtime)
        api = self.client()
        paused, records = [], []
        try:
            for cname, member in self.members:  # the whole pod stops first: one moment of all its containers
                api.pause(member.container, "runtime-dump")
                paused.append(member)
            os.mkdir(os.path.join(image_dir, CONTAINERS_SUBDIR), 0o700)
            for cname, member in self.members:
                sub, work = container_dir(image_dir, cname), os.path.join(work_dir, cname)
                os.mkdir(sub, 0o700)
                os.mkdir(work, 0o700)
                info = member.dump_task(api, self.trees[cname][0], sub, work, exit_after=False, paused=True)
                # its GPUs, from its spec (the device plugin's allocation): a restore maps them onto the new pod's
                gpus = [{"uuid": g["uuid"], "minor": g["minor"]}
                        for g in gpu_devices.spec_gpus((info.get("record") or {}).get("spec"), inv)]
                records.append(dict(info, name=cname, gpus=gpus))
            if after == "running":
                self._resume(api, paused, "runtime-dump")
        except Exception:
            self._resume(api, paused, "runtime-dump", quiet=True)
            raise
        finally:
            api.close()
        return {"backend": self.name, "pod": self.pod, "container": self.container, "namespace": K8S_NAMESPACE,
                "root_pid": int(target), "containers": records,
                "criu_options": self.extra, "auto_flags": list(self.auto_flags)}

    @staticmethod
    def _resume(api, members, stage, quiet=False):
        failed = None
        for member in members:
            try:
                task = api.task(member.container, stage=stage)
                if task is not None and task["status"] in ("paused", "pausing"):
                    api.resume(member.container, stage)
            except ContainerdError as exc:
                failed = failed or exc
        if failed is not None and not quiet:
            raise failed

    # -- a held pod ----------------------------------------------------------------------------------------
    def bind(self, manifest):
        rt = manifest.get("runtime") or {}
        self.pod = rt.get("pod") or self.pod
        self.container = rt.get("container") or self.container
        self.members = []
        for rec in rt.get("containers") or []:
            container_dir("/", rec.get("name"))
            self.members.append((rec["name"], self._member(rec.get("container"))))
        if not self.members and self.container:
            # A checkpoint killed before its manifest: the journal names only the pod and the pids it froze;
            # the containers are the pod's whose task is one of those pids (paused ones included).
            self.members = self._members_holding(self.container, (manifest.get("target") or {}).get("pids") or [])

    def abandon_restore_wait(self, image_dir):
        """The restore claims of the containers not yet restored are marked failed: the waiting restore gives up
        at once (and rolls back), and the runtime handler refuses any later create. Never more than a rollback: a
        container already restored is left alone, and the engine unlocks nothing it has not restored."""
        marked = []
        for rec in (read_restore_ticket(image_dir) or {}).get("containers") or []:
            name = rec.get("name")
            try:
                if restore_claim(image_dir, name) not in (RESTORED, FAILED):
                    set_restore_claim(image_dir, name, FAILED)
                    marked.append(name)
            except (OSError, InvalidTarget):
                continue
        return marked

    def _members_holding(self, pod, pids):
        namespace, name = parse_pod(pod)
        api = self.client()
        try:
            out = []
            for c in api.containers():
                labels = c["labels"]
                if not _is_pod_container(labels, namespace, name):
                    continue
                task = api.task(c["id"], stage="resume-source")
                if task is not None and task["pid"] in pids:
                    out.append((labels.get(CONTAINER_NAME), self._member(c["id"])))
            return sorted(out, key=lambda m: m[0] or "")
        finally:
            api.close()

    def is_held(self, pids):
        if not self.members:
            return False
        api = self.client()
        try:
            tasks = [api.task(m.container, stage="resume-source") for unused, m in self.members]
        finally:
            api.close()
        return all(t is None or t["status"] in ("paused", "stopped") for t in tasks)

    def resume(self, pids):
        api = self.client()
        try:
            self._resume(api, [m for unused, m in self.members], "resume-source")
        finally:
            api.close()

    def kill(self, pids):
        if self._restoring:  # a restore that failed after the handler brought the containers up
            self._fail_claims(self._restored_image, self._restoring)
            return
        self._wait_stopped_by_kubelet(pids)

    def kill_restored(self, image_dir, pids):
        """The target's clean-up, from the settlement (another process than the restore's): every claim of the
        image's ticket is marked failed and the copies the handler restored into the target pod are killed, as
        a restore that gives up does itself; any other process the restore recorded goes too."""
        ticket = read_restore_ticket(image_dir)
        if ticket:
            self.restore_pod = ticket.get("pod")
            self._fail_claims(image_dir, ticket.get("containers") or [])
        for p in pids:
            try:
                os.kill(p, 9)
            except OSError:
                pass

    def _wait_stopped_by_kubelet(self, pids, wait=STOP_WAIT):
        """A committed migration's held source: the controller has deleted its pod through the API server, and
        the kubelet stops its containers (a paused container dies at the kubelet's SIGKILL). Killing them here
        instead, behind the kubelet, while the pod still existed would have them started again from their
        entrypoint; so this waits for them to go, and says what to do when they do not."""
        started = {p: (procfs.read_stat(p) or {}).get("starttime") for p in pids}  # a reused pid is not ours
        left = list(pids)

        def ours_alive(p):
            st = procfs.read_stat(p) or {}
            return st.get("starttime") == started[p] and st.get("state", "Z") not in ("Z", "X")

        def all_stopped():
            nonlocal left
            left = [p for p in pids if started[p] is not None and ours_alive(p)]
            return not left
        pod = self.pod or {}
        if not wait_for(all_stopped, wait, "the kubelet to stop the containers of pod %s/%s"
                        % (pod.get("namespace"), pod.get("name")), interval=0.2, on_timeout="return"):
            raise GpuCkptError("the held containers of pod %s/%s still run (pids %s) %ds after the release: a "
                               "pod's containers are stopped by deleting the pod, not from its node"
                               % (pod.get("namespace"), pod.get("name"), left, wait), stage="release-source",
                               hint="delete the pod (kubectl delete pod %s -n %s, with its uid as precondition), "
                                    "then run recover.yml" % (pod.get("name"), pod.get("namespace")))

    def _kill_source(self):
        """The held source of a committed migration: its pod is deleted through the API server (the kubelet
        stops its containers); killing them here, behind the kubelet, would have them started again from
        their entrypoint while the pod still exists."""
        raise GpuCkptError("a pod's containers are stopped by deleting the pod (kubectl delete pod %s -n %s), not "
                           "from its node" % ((self.pod or {}).get("name"), (self.pod or {}).get("namespace")),
                           stage="release-source")

    def restore(self, image_dir, work_dir, manifest):
        """The pod's containers restored on this node by the runtime handler (gpuckpt-restore-runtime), into
        the target pod that the controller creates through the API server: the restore ticket for that pod is
        written, then each container of the checkpoint is waited for until its task runs restored. Returns
        the union of their process trees, in the checkpoint's container order (the engine then restores
        their GPU memory onto the GPUs the device plugin gave the new pod, and unlocks them)."""
        rt = manifest.get("runtime") or {}
        if not self.restore_pod or not self.restore_token:
            pod = rt.get("pod") or {}
            raise InvalidTarget("the image holds pod %s/%s: a pod is restored into the pod that the kubelet makes on "
                                "the target node (restore_pod and its token, given by the pod migration); restoring "
                                "its containers here as bare containerd tasks would run them outside any pod; nothing "
                                "was restored" % (pod.get("namespace"), pod.get("name")), stage="preflight",
                                hint="see docs/kubernetes.md")
        namespace, name = parse_pod(self.restore_pod)
        records = rt.get("containers") or []
        for rec in records:
            container_dir(image_dir, rec.get("name"))
        write_restore_ticket(image_dir, "%s/%s" % (namespace, name), self.restore_token, records)
        self._restoring = []
        api = self.client()
        try:
            found = self._wait_restored(api, image_dir, namespace, name, records)
            self._restoring, self._restored_image = records, image_dir
            return self._restored_trees(api, namespace, name, records, found)
        except Exception:
            self._fail_claims(image_dir, records)
            raise
        finally:
            api.close()

    def _wait_restored(self, api, image_dir, namespace, name, records):
        """{container name: containerd id} once the handler has restored every container of ``records`` into
        the target pod and its task runs; refused as soon as the handler's restore of one failed, or after
        ``restore_wait`` seconds (600 by default)."""
        found = {}

        def all_restored():
            for rec in records:
                if rec["name"] not in found:
                    cid = self._restored_by_handler(api, image_dir, namespace, name, rec["name"])
                    if cid:
                        found[rec["name"]] = cid
            return len(found) == len(records)
        wait = self.restore_wait or 600
        if not wait_for(all_restored, wait, "the containers of pod %s/%s to be restored" % (namespace, name),
                        interval=0.2, on_timeout="return"):
            waiting = [r["name"] for r in records if r["name"] not in found]
            raise GpuCkptError("container(s) %s of pod %s/%s were not restored on this node within %ds"
                               % (", ".join(waiting), namespace, name, wait), stage="runtime-restore",
                               hint="the pod must be scheduled here with the restore runtime class")
        return found

    def _restored_by_handler(self, api, image_dir, namespace, name, cname):
        """The id of container ``cname`` once the handler's claim says restored and its task runs; None until then."""
        state = restore_claim(image_dir, cname)
        if state == FAILED:
            raise GpuCkptError("the runtime handler's restore of container %s of pod %s/%s failed on this node"
                               % (cname, namespace, name), stage="runtime-restore",
                               hint="the kubelet's events for the pod, and restore.log under the handler's state_dir")
        if state != RESTORED:
            return None
        return self._restored_container(api, namespace, name, cname)

    def _restored_trees(self, api, namespace, name, records, found):
        """The restored containers' process trees, in the checkpoint's order, each process given the GPU pairs
        of its container (onto the GPUs the device plugin gave the new container, place by place)."""
        pids, self._pairs_by_pid, self._devices_synced, inv = [], {}, [], None
        for rec in records:
            pid, tree = self._member().resolve(found[rec["name"]])
            pids += [p for p in tree if p not in pids]
            if "gpus" not in rec:  # an image of an older collection: its GPUs were not recorded
                continue
            new_spec = (api.container(found[rec["name"]], stage="runtime-restore") or {}).get("spec") or {}
            inv = gpu_devices.inventory() if inv is None else inv
            pairs = self._onto_new_gpus(rec.get("gpus") or [], new_spec, inv, pid,
                                        "container %s of pod %s/%s" % (rec["name"], namespace, name))

            for p in tree:
                self._pairs_by_pid[p] = pairs
        return pids

    def _onto_new_gpus(self, old, new_spec, inv, pid, what):
        """The pairs that map a container's checkpointed GPUs ``old`` onto those of its new spec (None: the same
        places), its /dev made to hold the new ones (again after the driver's restore: after_gpu_restore); None
        when it had and has no GPU."""
        new = gpu_devices.spec_gpus(new_spec, inv)
        if not old and not new:
            return None
        pairs = gpu_devices.placement_pairs(old, new, what)
        gpu_devices.sync_device_nodes(pid, new_spec)
        self._devices_synced.append((pid, new_spec))
        return pairs

    def _restored_container(self, api, namespace, name, cname):
        for c in api.containers():
            labels = c["labels"]
            if _is_pod_container(labels, namespace, name) and labels.get(CONTAINER_NAME) == cname:
                task = api.task(c["id"])
                if task is not None and task["status"] == "running":
                    return c["id"]
        return None

    def _fail_claims(self, image_dir, records):
        """This restore gave up: no container of it may run. Each claim is marked failed first (the runtime
        handler then refuses a create, and removes a copy whose restore finishes after this), then every copy
        that the handler had already restored into the target pod is killed (the kubelet's restart is then
        refused too; the pod migration deletes the target pod)."""
        for rec in records:
            set_restore_claim(image_dir, rec["name"], FAILED)
        namespace, name = parse_pod(self.restore_pod)
        api = self.client()
        try:
            for rec in records:
                cid = self._restored_container(api, namespace, name, rec["name"])
                if cid:
                    api.kill(cid, 9, "runtime-restore")
        finally:
            api.close()

    def map_pids(self, manifest, new_pids):
        return None  # the containers' trees in the checkpoint's order: the engine matches them one by one

    def remove(self):
        self._kill_source()
