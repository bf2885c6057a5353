# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The plan of one migration, made on the source before anything is frozen (``gpu_migration action=plan``).

migrate.yml (tasks/migrate_one.yml) and recover.yml run module calls; what to call, and with what, is decided
here, in one record:

- ``settle``: this id left a journal on either host, so the run finishes or rolls back that migration, and
  ``id_reuse``: why the workload named now is not the one the id was used for (a pid of the journal that another
  process holds now is another workload), "" when it is;
- ``runtime``: the runtime named (a pod, a container of ``runtime``, else a bare process tree), its ``root_pid``
  as the backend resolves it (the backend's ``resolve()``, never the runtime's CLI again), the ``workload`` in
  words, and ``error``: why the workload could not be found (said by the playbook after its own checks);
- ``hold_stopped`` or exit and ``exit_reason``: from the backend's capabilities (``can_hold_stopped``,
  ``restores_host_pids``) and the facts of the two hosts (one kernel, one pid space, a network namespace the
  copy would share with the held source's bound sockets);
- the pods of a pod migration (``pod_ref``, ``target_pod``, ``restore_token``);
- ``calls``: the arguments of the later module calls that depend on the workload (the source's and the target's
  facts, the preflight's options, the checkpoint).

The decisions are pure functions of their inputs (unit-tested with tables); ``make`` reads the host through the
probe it is given (``HostProbe`` on the source).

``with_calls`` (the ``migration_plan`` filter, on the controller) adds what the play's options decide: each later
module call's arguments ready to pass (``*_args``), the restore job's ``restore_async_s``, the option errors and the
``refusal`` of a new migration (nothing frozen). It runs on the controller, not in the source's module, because the
target's calls (its restore's probe command and bundle) must come from the inventory, never from the source.
"""
from __future__ import annotations

import random
import string

from ..core import procfs, sockets
from .id_reuse import id_reuse
from .planner import option_errors
from .report import as_bool
from ..runtimes.registry import POD_RUNTIME, PROCESS_RUNTIME, runtime_of

TOKEN_CHARS = string.ascii_letters + string.digits
DEFAULT_IMAGE_ROOT = "/var/lib/gpuckpt/images"
DEFAULT_PROTECT_DIR = "/etc/gpuckpt/protect"
# Unknown checks that only a drain accepts by name (its deadline, a workload's runtime): not the preflight's.
DRAIN_ONLY_UNKNOWN = ("deadline", "runtime")
# The restore job's margin over its waits: Ansible kills an async job at its limit, so the limit is the job's own
# waits (the image, the runtime) and this much more; a runtime without a limit (0) counts as three days.
RESTORE_JOB_MARGIN_S = 600
UNLIMITED_RUNTIME_S = 259200
# The restore run after the transfer (no job begun before the freeze, or a lost one): the image is complete then.
RESTORE_NOW_IMAGE_WAIT_S = 120


def named(pid=None, container=None, pod=None):
    """The workloads named (pid > 0, a container, a pod): a new migration needs exactly one."""
    out = []
    if pid and int(pid) > 0:
        out.append("pid")
    if container:
        out.append("container")
    if pod:
        out.append("pod")
    return out


def workload_words(pid=None, container=None, pod=None):
    """The workload in words, as the summary names it."""
    return ("pod %s" % pod) if pod else ("container %s" % container) if container else ("pid %s" % pid)


def pod_ref(move_pod=None, journal=None):
    """A pod migration's source pod ({namespace, name, uid}): as gpu_pod_info described it (``move_pod``), or as the
    source's journal recorded it (a re-run, recover.yml); None for any other workload."""
    if isinstance(move_pod, dict):
        return {"namespace": move_pod.get("namespace"), "name": move_pod.get("name"), "uid": move_pod.get("uid")}
    journal = journal or {}
    if journal.get("runtime") == POD_RUNTIME and isinstance(journal.get("pod"), dict):
        return journal["pod"]
    return None


def hold_or_exit(capabilities, runtime, source_host, target_host, tree, target="the target"):
    """How the source waits while the target restores: (hold_stopped, exit_reason, one_pid_space).

    The source stays stopped (held, resumed on a rollback) unless its copy on the target would clash with it:
    - a runtime that cannot hold a workload stopped (``can_hold_stopped`` False: Podman and Docker checkpoint only
      running containers) exits, its image the way back;
    - a held source keeps its listening ports and abstract socket names bound: a copy restored into the same
      network namespace (one kernel, host networking) could not bind them again;
    - a restore that brings the dumped pids back under their numbers (``restores_host_pids``: a bare process tree)
      needs them free, which a held source in the same pid space keeps.
    ``source_host`` and ``target_host``: each host's boot_id, pid_namespace and net_namespace; ``tree``: the
    workload's bound_sockets and net_namespace (as cuda_process_facts reports its tree)."""
    one_kernel = source_host.get("boot_id") == target_host.get("boot_id")
    one_pid_space = bool(one_kernel and source_host.get("pid_namespace") == target_host.get("pid_namespace"))
    sockets = tree.get("bound_sockets") or []
    net_clash = bool(one_kernel and len(sockets) > 0
                     and tree.get("net_namespace", "") == target_host.get("net_namespace", "-"))
    if not capabilities.can_hold_stopped:
        reason = "%s cannot hold a container stopped" % runtime.capitalize()
    elif net_clash:
        reason = "the workload holds %s in the network namespace that its copy on %s would use" % (
            ", ".join(sockets), target)
    elif capabilities.restores_host_pids and one_pid_space:
        reason = "source and target share one pid space"
    else:
        reason = ""
    hold = capabilities.can_hold_stopped and not net_clash and not (capabilities.restores_host_pids and one_pid_space)
    return bool(hold), reason, one_pid_space


def source_facts_call(runtime, root_pid, pod=None):
    """cuda_process_facts' arguments on the source: the tree of the root pid; a pod's, the union of its containers'
    trees, found on its node by the kubelet's labels."""
    if runtime == POD_RUNTIME:
        return {"container": "%s/%s" % (pod["namespace"], pod["name"]), "runtime": POD_RUNTIME}
    return {"tree_of": int(root_pid or 0)}


def checkpoint_call(runtime, hold, pid=None, container=None, pod=None, pod_containers=None):
    """gpu_checkpoint's arguments that the workload decides (the playbook adds the options)."""
    out = {"runtime": runtime, "leave_stopped": bool(hold)}
    if runtime == PROCESS_RUNTIME:
        out["pid"] = int(pid)
    if container:
        out["container"] = container
    if runtime == POD_RUNTIME and pod:
        out.update(pod="%s/%s" % (pod["namespace"], pod["name"]), pod_uid=pod.get("uid"),
                   pod_containers=list(pod_containers or []))
    return out


def _settle_part(params, journal, target_journal, probe):
    """An id that left a journal: the id-reuse verdict for the workload named now."""
    pid = int(params.get("pid") or 0)
    pid_now = None
    if pid and journal.get("exists"):
        st = probe.stat(pid)
        pid_now = {"starttime": st["starttime"]} if st else None
    reason = id_reuse(params["migration_id"], journal, pid=pid or None, container=params.get("container") or None,
                      pod=params.get("pod") or None, pid_now=pid_now, target_journal=target_journal or None)
    return {"id_reuse": reason or ""}


def _new_part(params, pod, probe):
    """A new migration: the runtime, the root pid the backend resolves, how the source waits, the later calls."""
    pid, container, pod_name = params.get("pid"), params.get("container"), params.get("pod")
    runtime = runtime_of(container, pod_name, params.get("runtime"))
    out = {"runtime": runtime, "workload": workload_words(pid, container, pod_name), "root_pid": None,
           "error": "", "hold_stopped": None, "exit_reason": "", "one_pid_space": None}
    if len(named(pid, container, pod_name)) != 1:
        return out
    if runtime == POD_RUNTIME and not pod:
        out["error"] = "%s was not described by the API server (gpu_pod_info)" % out["workload"]
        return out
    caps = probe.capabilities(runtime)
    try:
        root, tree = probe.resolve(runtime, pid, container, pod)
    except Exception as e:  # (said by the playbook after its own checks: nothing is frozen)
        out["error"] = "%s was not found on the source: %s" % (out["workload"], e)
        return out
    target_host = params.get("target_host") or {}
    hold, reason, one_pid_space = hold_or_exit(caps, runtime, probe.host(), target_host, tree,
                                               params.get("target_name") or "the target")
    out.update(root_pid=root, hold_stopped=hold, exit_reason=reason, one_pid_space=one_pid_space,
               # a container keeps its pids in its own pid namespace; a bare tree's must be free on the target
               restores_host_pids=bool(caps.restores_host_pids),
               calls={"source_facts": source_facts_call(runtime, root, pod),
                      "checkpoint": checkpoint_call(runtime, hold, pid, container, pod,
                                                    [c.get("name") for c in (params.get("move_pod") or {}).get(
                                                        "containers") or []])})
    return out


def make(params, journal, probe):
    """The migration's plan (see the module's docstring). ``params``: gpu_migration's (migration_id, pid,
    container, runtime, pod, move_pod, target_journal, target_host, target_name, target_pod_name, settle_only);
    ``journal``: the source's journal as ``transaction.status`` reads it; ``probe``: the host (HostProbe)."""
    target_journal = params.get("target_journal") or {}
    settle = bool(journal.get("exists") or target_journal.get("exists"))
    pod = pod_ref(params.get("move_pod"), journal)
    plan = {"settle": settle, "new": not settle and not params.get("settle_only"), "id_reuse": "", "pod_ref": pod,
            "target_pod": None, "restore_token": None, "calls": {}}
    if pod:
        name = params.get("target_pod_name") or probe.target_pod_name(str(pod["name"]), params["migration_id"])
        rng = random.SystemRandom()
        plan["target_pod"] = name
        plan["restore_token"] = "".join(rng.choice(TOKEN_CHARS) for dummy in range(40))
    if settle:
        plan.update(_settle_part(params, journal, target_journal, probe))
    elif plan["new"]:
        plan.update(_new_part(params, pod, probe))
    return plan


class Options(object):
    """The play's options as given (``gpuckpt_*``, and the plain probe_command and quiesce_* of migrate.yml), read
    with the defaults the playbooks document. A number that is not one reads as 0, as Jinja's ``float`` reads it:
    such an option is refused anyway (``option_errors``) before anything is frozen."""

    def __init__(self, values):
        self._values = dict(values or {})

    def given(self):
        return dict(self._values)

    def value(self, name, default=None):
        given = self._values.get(name)
        return default if given is None else given

    def flag(self, name, default=False):
        return as_bool(self.value(name, default))

    def seconds(self, name, default):
        try:
            return float(self.value(name, default))
        except (TypeError, ValueError):
            return 0.0

    def count(self, name, default):
        try:
            return int(float(self.value(name, default)))
        except (TypeError, ValueError):
            return 0

    def names(self, name):
        """A list option; ``-e name=[a,b]`` arrives as a string."""
        given = self.value(name, [])
        if isinstance(given, str):
            given = [n.strip(" '\"") for n in given.strip().strip("[]").split(",")]
        return [n for n in given if n]


def _given(**values):
    """The arguments whose value is given (an option left out is the module's default, as Jinja's ``omit``)."""
    return {k: v for k, v in values.items() if v is not None}


def headline(migration_id, source, target, hold_stopped, exit_reason):
    """The preflight's first line: the two hosts, and how the source waits."""
    waits = (", source held stopped until the target runs" if hold_stopped
             else ", %s: the source exits and its image is the way back" % exit_reason)
    return "Migration %s: %s -> %s%s" % (migration_id, source, target, waits)


def refusal(plan, opts, source, target, source_vars, target_vars):
    """Why a new migration must not begin (nothing was frozen), as lines; [] when it may: options out of range
    (``option_errors``, as this host sees them), no workload named, a workload the source cannot find, a target
    image kept in memory after the migration, or signing keys that differ (the target would refuse the image only
    after the source was frozen)."""
    errors = option_errors(opts.given())
    if errors:
        return ["Nothing was frozen: fix these options first"] + errors
    reason = _refusal_reason(plan, opts, source, target, source_vars, target_vars)
    return [reason] if reason else []


def _refusal_reason(plan, opts, source, target, source_vars, target_vars):
    if plan.get("root_pid") is None and not plan.get("error"):
        return ("migrate.yml needs one of -e pid=<root pid of the workload on %s>, -e container=<container id on %s> "
                "(with -e runtime=runc, podman, docker, containerd or runsc), or -e pod=<namespace>/<name> "
                "(a Kubernetes pod)" % (source, source))
    if plan.get("error"):
        return "%s; nothing was frozen" % plan["error"]
    if opts.flag("gpuckpt_target_image_in_memory") and opts.flag("gpuckpt_keep_target_image"):
        return ("gpuckpt_keep_target_image would hold the image's tmpfs, and its RAM, on %s after the migration: keep "
                "it on the target's disk (leave gpuckpt_target_image_in_memory off), or do not keep it. Nothing was "
                "frozen." % target)
    if str(source_vars.get("gpuckpt_sign_key") or "") != str(target_vars.get("gpuckpt_sign_key") or ""):
        return ("gpuckpt_sign_key differs between %s and %s (or is set on one only): the target would refuse the "
                "image only after the source was frozen; set the same key for both, or for neither. Nothing was "
                "frozen." % (source, target))
    return ""


def push_args(opts, target, dest, dest_journal):
    """gpu_checkpoint's push: the image goes to the target while it is written (the dump and the transfer overlap),
    unless turned off or the link is rate-limited (a limit is gpu_image_sync's, after the dump); None then."""
    if not opts.flag("gpuckpt_transfer_during_dump", True) or opts.count("gpuckpt_transfer_bwlimit", 0) > 0:
        return None
    return _given(to=target, dest=dest, journal_dir=dest_journal, ssh_args=opts.value("gpuckpt_transfer_ssh_args", []),
                  streams=opts.count("gpuckpt_transfer_streams", 0),
                  io_timeout=opts.count("gpuckpt_transfer_io_timeout", 120),
                  python=opts.value("gpuckpt_transfer_python"))


def restore_args(plan, opts, target_vars):
    """gpu_restore's arguments on the target, the same for each of its calls (the early one, one after the
    transfer, one after a repair); from the inventory and the plan, never from the source."""
    pod = plan.get("pod_ref")
    return _given(
        image_dir=opts.value("gpuckpt_dst_image"), gpu_map=opts.value("gpuckpt_gpu_map"),
        allow_unverified_signature=opts.flag("gpuckpt_allow_unverified_signature"),
        bundle=target_vars.get("gpuckpt_bundle") or target_vars.get("gpuckpt_runc_bundle"),
        runtime_timeout=opts.seconds("gpuckpt_runtime_timeout", 1800),
        probe_command=opts.value("probe_command", target_vars.get("gpuckpt_probe_command")),
        probe_timeout=opts.seconds("gpuckpt_probe_timeout", 60),
        host_huge_pages=opts.flag("gpuckpt_host_huge_pages"),
        migration_id=opts.value("gpuckpt_mid"), journal_dir=opts.value("gpuckpt_dst_journal"),
        # a pod: restored by the target node's runtime handler into the pod created for it
        restore_pod=("%s/%s" % (pod["namespace"], plan.get("target_pod"))) if pod else None,
        restore_token=plan.get("restore_token") if pod else None,
        restore_wait=opts.seconds("gpuckpt_pod_restore_wait", 600))


def checkpoint_args(plan, opts, target, source_vars):
    """gpu_checkpoint's arguments: the workload's (the plan's ``calls.checkpoint``: its pid, container or pod and
    whether the source is held stopped) and the options'."""
    return _given(
        image_in_memory=opts.flag("gpuckpt_image_in_memory"),
        image_memory_bytes=opts.value("gpuckpt_image_memory_bytes"),
        lock_timeout=opts.seconds("gpuckpt_lock_timeout", 30),
        quiesce_signal=opts.value("quiesce_signal", source_vars.get("gpuckpt_quiesce_signal")),
        quiesce_command=opts.value("quiesce_command", source_vars.get("gpuckpt_quiesce_command")),
        quiesce_timeout=opts.seconds("gpuckpt_quiesce_timeout", 30),
        quiesce_mode=opts.value("quiesce_mode", source_vars.get("gpuckpt_quiesce_mode") or "release"),
        quiesce_lease=opts.seconds("gpuckpt_quiesce_lease", 600),
        host_huge_pages=opts.flag("gpuckpt_host_huge_pages"),
        runtime_timeout=opts.seconds("gpuckpt_runtime_timeout", 1800),
        tcp_established=opts.flag("gpuckpt_tcp_established"),
        migration_id=opts.value("gpuckpt_mid"), journal_dir=opts.value("gpuckpt_src_journal"),
        push=push_args(opts, target, opts.value("gpuckpt_dst_image"), opts.value("gpuckpt_dst_journal")),
        **(plan.get("calls") or {}).get("checkpoint", {}))


def sync_args(opts):
    """gpu_image_sync's arguments (stage 2, and the repair of a damaged copy); the target's address is its
    inventory host's."""
    return _given(dest=opts.value("gpuckpt_dst_image"), ssh_args=opts.value("gpuckpt_transfer_ssh_args", []),
                  python=opts.value("gpuckpt_transfer_python"), bwlimit=opts.count("gpuckpt_transfer_bwlimit", 0),
                  streams=opts.count("gpuckpt_transfer_streams", 0),
                  io_timeout=opts.count("gpuckpt_transfer_io_timeout", 120), migration_id=opts.value("gpuckpt_mid"),
                  journal_dir=opts.value("gpuckpt_src_journal"), dest_journal_dir=opts.value("gpuckpt_dst_journal"))


def target_pod_args(plan, opts):
    """gpu_pod's arguments for the pod a pod migration's copy runs in (bound to the target node, run by the restore
    runtime class); None for any other workload."""
    pod = plan.get("pod_ref")
    if not pod:
        return None
    return _given(namespace=pod["namespace"], name=plan.get("target_pod"), from_pod=opts.value("gpuckpt_move_pod"),
                  target_node=opts.value("gpuckpt_move_pod_node"), image_dir=opts.value("gpuckpt_dst_image"),
                  restore_token=plan.get("restore_token"),
                  runtime_class=opts.value("gpuckpt_restore_runtime_class", "gpuckpt-restore"),
                  migration_id=opts.value("gpuckpt_mid"))


def with_calls(plan, options, source, target, source_vars=None, target_vars=None):
    """The plan (``make``'s, from the source) with what the play's options decide (the ``migration_plan``
    filter): the arguments of each later module call, ready to pass. ``options``: the play's variables by name
    (``gpuckpt_*`` with the migration's names and directories that tasks/migration_vars.yml set, probe_command,
    quiesce_*); ``source_vars`` and ``target_vars``: each host's inventory variables."""
    opts, source_vars, target_vars = Options(options), source_vars or {}, target_vars or {}
    mid = opts.value("gpuckpt_mid")
    out = dict(plan)
    restore = restore_args(plan, opts, target_vars)
    image_wait = opts.seconds("gpuckpt_image_wait", 3600)
    out.update(
        refusal=refusal(plan, opts, source, target, source_vars, target_vars) if plan.get("new") else [],
        summary_args=dict(migration_id=mid, workload=plan.get("workload"), source=source, target=target,
                          pod=plan.get("pod_ref"), target_pod=plan.get("target_pod")),
        source_facts_args=dict((plan.get("calls") or {}).get("source_facts", {}),
                               paths=[opts.value("gpuckpt_src_root", DEFAULT_IMAGE_ROOT)], list_containers=[],
                               # (every operation on a node fences first: a stale copy of a job failed over
                               # elsewhere is stopped, not moved)
                               protect_dir=source_vars.get("gpuckpt_protect_dir") or DEFAULT_PROTECT_DIR),
        # The target's own journal directory, where its drain mark is: a target that began draining since a plan was
        # made is refused by the preflight's not_draining check, right before the freeze.
        target_facts_args=dict(paths=[opts.value("gpuckpt_dst_root", DEFAULT_IMAGE_ROOT)], list_containers=[],
                               protect_dir=target_vars.get("gpuckpt_protect_dir") or DEFAULT_PROTECT_DIR,
                               journal_dir=opts.value("gpuckpt_dst_journal")),
        preflight_args=dict(
            source_path=opts.value("gpuckpt_src_root", DEFAULT_IMAGE_ROOT),
            target_path=opts.value("gpuckpt_dst_root", DEFAULT_IMAGE_ROOT),
            allow_driver_mismatch=opts.flag("gpuckpt_allow_driver_mismatch"),
            check_gpus=opts.value("gpuckpt_gpu_map") is None, gpu_map=opts.value("gpuckpt_gpu_map"),
            same_pid_space=bool(plan.get("one_pid_space")), container=not plan.get("restores_host_pids"),
            allow_unknown=[n for n in opts.names("gpuckpt_allow_unknown") if n not in DRAIN_ONLY_UNKNOWN],
            image_in_memory=opts.flag("gpuckpt_image_in_memory"),
            target_image_in_memory=opts.flag("gpuckpt_target_image_in_memory"), migration_id=mid,
            headline=headline(mid, source, target, plan.get("hold_stopped"), plan.get("exit_reason"))),
        # The target's image in memory: a tmpfs sized from the preflight's estimate (or the size given).
        begin_args=_given(action="begin", journal_dir=opts.value("gpuckpt_dst_journal"),
                          image_dir=opts.value("gpuckpt_dst_image"),
                          image_in_memory=opts.flag("gpuckpt_target_image_in_memory"),
                          image_memory_bytes=opts.value("gpuckpt_image_memory_bytes")),
        restore_early=opts.flag("gpuckpt_restore_early", True),
        restore_early_args=dict(restore, wait_for_image=image_wait, progress_file=opts.value("gpuckpt_restore_progress")),
        restore_async_s=int(image_wait + RESTORE_JOB_MARGIN_S
                            + (opts.seconds("gpuckpt_runtime_timeout", 1800) or UNLIMITED_RUNTIME_S)),
        restore_attach_args=dict(image_dir=opts.value("gpuckpt_dst_image"),
                                 progress_file=opts.value("gpuckpt_restore_progress")),
        restore_now_args=dict(restore, wait_for_image=RESTORE_NOW_IMAGE_WAIT_S),
        restore_args=restore,
        checkpoint_args=checkpoint_args(plan, opts, target, source_vars),
        sync_args=sync_args(opts),
        target_pod_args=target_pod_args(plan, opts))
    return out


def host_identity():
    """This host's kernel and namespaces (its boot, pid and network namespaces): gpu_migration returns it with every
    journal it reads, so that the source's plan knows whether the target is the same kernel or pid space."""
    return {"boot_id": procfs.boot_id(), "pid_namespace": procfs.pid_namespace(), "net_namespace": procfs.net_namespace()}


class HostProbe(object):
    """What the plan reads of the source host: /proc, and the runtime's backend (built from the module's options);
    and the name of a pod migration's target pod (k8s/, a room above this one, handed in by the module)."""

    def __init__(self, build_backend, target_pod_name):
        self._build = build_backend  # runtime name -> its backend, from the module's options
        self.target_pod_name = target_pod_name  # (source pod's name, migration id) -> the target pod's (k8s/pods.py)

    def stat(self, pid):
        return procfs.read_stat(int(pid))

    @staticmethod
    def host():
        return host_identity()

    @staticmethod
    def capabilities(runtime):
        from ..runtimes.registry import backend_class
        return backend_class(runtime).capabilities

    def resolve(self, runtime, pid, container, pod):
        """(root pid, its tree's bound_sockets and net_namespace), as cuda_process_facts would report the tree:
        a bare tree and a container by their root's process tree, a pod by its containers' trees."""
        if runtime == PROCESS_RUNTIME:
            root = int(pid)
            pids = procfs.process_tree(root) if procfs.read_stat(root) is not None else []
        elif runtime == POD_RUNTIME:
            root, pids = self._build(runtime).resolve("%s/%s" % (pod["namespace"], pod["name"]))
        else:
            root = int(self._build(runtime).resolve(container)[0])
            pids = procfs.process_tree(root)
        if not pids:
            return root, {"bound_sockets": []}
        return root, {"bound_sockets": sockets.bound_sockets(pids), "net_namespace": procfs.net_namespace(int(root))}
