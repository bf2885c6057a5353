# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the modules gpu_checkpoint, gpu_restore, gpu_image_sync, gpu_migration and cuda_process_facts
do between reading their options and returning their result, so that each module file holds its
documentation, its argument spec, one call and its result.

Here: the argument specs they share (a checkpoint's and a restore's options, a transfer target's ssh
options), the one way an expected error (GpuCkptError) becomes fail_json, the ssh target and push of a
checkpoint, the image transfer of gpu_image_sync, the journal actions of gpu_migration, and the
containers that cuda_process_facts reports. The engine's own calls stay in the modules.
"""
from __future__ import annotations

from .core import hugepages, image
from .transfer import targets, transfer
from .core.errors import GpuCkptError, InvalidTarget, TransactionError
from .runtimes.registry import PROCESS_RUNTIME as DEFAULT_RUNTIME
from .module_common import (MIGRATION_ARGS, PROGRESS_ARGS, RUNTIME_ARGS, SPEED_ARGS, TOOL_ARGS, backend_of_image,
                            check_path_arg, journal_for, make_backend)


def operation_spec(**own):
    """The argument spec of a checkpoint or a restore: its ``own`` options, then the options both take
    (the tools, the runtimes, a migration's journal, the progress file, the speed options, the
    manifest's signature key and the parallel driver calls; doc fragment gpuckpt.fleet.common.*)."""
    spec = dict(own)
    spec.update(sign_key=dict(type="str", no_log=True), parallel=dict(type="bool", default=True))
    for shared in (TOOL_ARGS, PROGRESS_ARGS, SPEED_ARGS, RUNTIME_ARGS, MIGRATION_ARGS):
        spec.update(shared)
    return spec


def transfer_target_spec(prefix):
    """How a transfer reaches its target over ssh, and where the image goes there: the options of
    gpu_checkpoint's ``push`` (``prefix`` "") and of gpu_image_sync (``prefix`` "dest_", for the
    target's host, become, user and port)."""
    return {
        prefix + "host": dict(type="str"),
        prefix + "become": dict(type="bool", default=False),
        "dest": dict(type="path", required=True),
        prefix + "user": dict(type="str", default="root"),
        prefix + "port": dict(type="int", default=22),
        "ssh_args": dict(type="list", elements="str", default=[]),
        "python": dict(type="str", default="python3"),
        "io_timeout": dict(type="int", default=120),
        "streams": dict(type="int", default=0),
    }


def transfer_target(params, prefix):
    """The targets.Target of the options of transfer_target_spec(``prefix``); it checks every value,
    which becomes part of an ssh command line (InvalidTarget)."""
    return targets.Target(params[prefix + "host"], params[prefix + "user"], params[prefix + "port"],
                          params["ssh_args"], params["python"], params["io_timeout"], become=params[prefix + "become"])


def receiver_checks(migration_id, journal_dir, nonce, image_id=None):
    """What the target's receivers check before they write: in a migration, that the target's journal
    created the directory and awaits this checkpoint (``nonce``); outside one, the image's id."""
    if migration_id:
        return {"migration_id": migration_id, "journal_dir": journal_dir, "nonce": nonce}
    return {"image_id": image_id}


def or_fail(module, fn, *args):
    """``fn(*args)``; an expected error (GpuCkptError) fails the module with its stage, hint and details."""
    try:
        return fn(*args)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())


def run_module(module, fn, *args):
    """Exit the module with the result of ``fn(*args)`` (a dict with ``changed``), or fail it as or_fail()."""
    module.exit_json(**or_fail(module, fn, *args))


# -- gpu_checkpoint ---------------------------------------------------------------------------------------

def push_sender(module, params, hooks):
    """The transfer.Sender of gpu_checkpoint's ``push`` (None without one), its options checked before
    anything is frozen; ``hooks``: the engine's push_hooks of the checkpoint's journal."""
    q = params["push"]
    if not q:
        return None
    check_path_arg(module, "push.dest", q["dest"])
    if not 0 <= q["streams"] <= 64:
        module.fail_json(msg="push.streams must be 0 (automatic) to 64, got %s; nothing was frozen" % q["streams"])
    if not q["host"]:
        module.fail_json(msg="push.to %r was not resolved: run this module through its action plugin, or give "
                         "push.host; nothing was frozen" % q["to"])
    target = or_fail(module, transfer_target, q, "")
    receiver = receiver_checks(params["migration_id"], q["journal_dir"], params["nonce"])
    return transfer.Sender(target, q["dest"], streams=q["streams"], receiver=receiver, fence=hooks["fence"],
                           before_deliver=hooks["before_deliver"])


# -- gpu_restore ------------------------------------------------------------------------------------------

def restore_backend_maker(params):
    """What makes the restore's backend from the image's manifest (engine.restore's ``make_backend``): the
    backend of the runtime it records, with the module's parameters. In a migration the image may not be
    there yet when the restore starts (wait_for_image): the backend is made once it is open."""
    def make(manifest):
        return make_backend((manifest.get("runtime") or {}).get("backend") or DEFAULT_RUNTIME, params,
                            bundle=params["bundle"])
    return make


# -- gpu_image_sync ---------------------------------------------------------------------------------------

def _source_journal_hooks(journal):
    """In a migration: the receivers' checks, and the source journal's 'delivering' (under its lock)
    right before the manifest goes, refused once the source was rolled back."""
    doc = journal.read() or {}
    if doc.get("phase") not in ("checkpointed", "delivering", "delivered"):
        raise TransactionError("migration %s has no checkpoint to send on this host (journal phase %s); nothing was "
                               "sent" % (journal.id, doc.get("phase") or "absent"), stage="transfer")

    def before_deliver():
        with journal.hold(wait=60, purpose="the delivery of migration %s" % journal.id):
            journal.check_fence("deliver")
            journal.transition("delivering")

    def fence():
        journal.check_fence("transfer")

    return doc.get("nonce"), before_deliver, fence


def sync_image(params, check_mode):
    """gpu_image_sync: send the image ``src`` to ``dest`` on the target; in a migration, only while the
    source's journal holds its checkpoint, and recorded there as delivered. The module's result."""
    p = params
    target = transfer_target(p, "dest_")
    manifest = image.load_manifest(p["src"])
    if check_mode:
        size = image.image_bytes(manifest)
        return dict(changed=True, bytes_total=size, msg="would send up to %d bytes" % size)
    before_deliver = fence = None
    if p["migration_id"]:
        journal = journal_for(p, "source")
        nonce, before_deliver, fence = _source_journal_hooks(journal)
        receiver = receiver_checks(p["migration_id"], p["dest_journal_dir"], nonce)
    else:
        journal, receiver = None, receiver_checks(None, None, None, image_id=manifest.get("id"))
    res = transfer.send_image(p["src"], target, p["dest"], receiver=receiver, streams=p["streams"],
                              bwlimit_kbps=p["bwlimit"], retries=p["retries"], progress_file=p["progress_file"],
                              before_deliver=before_deliver, fence=fence)
    if journal is not None:
        with journal.hold(wait=60, purpose="the delivery of migration %s" % journal.id):
            journal.transition("delivered")
    rate = res["bytes_transferred"] / res["seconds"] if res["seconds"] else 0
    return dict(res, changed=res["bytes_transferred"] > 0,
                msg="sent %d of %d bytes in %.2fs (%.0f MB/s), %d attempt(s)"
                % (res["bytes_transferred"], res["bytes_total"], res["seconds"], rate / 1e6, res["attempts"]))


# -- gpu_migration ----------------------------------------------------------------------------------------

def _image_backend(journal, params):
    """The backend of the image the journal names (process when it names none)."""
    image_dir = (journal.read() or {}).get("image_dir")
    return make_backend(backend_of_image(image_dir) if image_dir else "process", params)


def _journal_action(journal, params):
    """(changed, msg, extra result) of gpu_migration's ``action`` on this host's journal."""
    from .migration import transaction as migration  # see migration_step()
    action, role = params["action"], params["role"]
    if action in ("begin", "settle") and role != "target":
        raise InvalidTarget("%s is an action of the target's journal" % action, stage="preflight")
    if action == "begin":
        if not params["image_dir"]:
            raise InvalidTarget("begin needs image_dir", stage="preflight")
        if params.get("image_in_memory") and not params.get("image_memory_bytes"):
            raise InvalidTarget("image_in_memory needs image_memory_bytes (the image's expected size); nothing was "
                                "frozen", stage="preflight")
        changed, doc = migration.begin_target(journal, params["image_dir"], image_memory_bytes=params.get(
            "image_memory_bytes") if params.get("image_in_memory") else None)
        return changed, "ready to receive migration %s in %s%s" % (
            journal.id, doc["image_dir"], " (in memory)" if doc.get("image_in_memory") else ""), {}
    if role == "target":
        res = migration.settle_target(journal, _image_backend(journal, params), mode=action,
                                      remove_image=params["remove_image"], wait=params["wait"],
                                      abandon_pod_restore=params["abandon_pod_restore"])
        return res["changed"], res["msg"], {"decision": res["decision"]}
    if action == "commit":
        changed, msg = migration.commit_source(journal, _image_backend(journal, params),
                                               target_phase=params["target_phase"],
                                               remove_image=params["remove_image"], wait=params["wait"])
    else:
        changed, msg = migration.rollback_source(journal, _image_backend(journal, params),
                                                 target_phase=params["target_phase"],
                                                 target_lost=params["target_lost"],
                                                 libcuda_path=params["libcuda_path"], wait=params["wait"],
                                                 keep_image=params["keep_image_on_rollback"])
    return changed, msg, {}


def migration_step(params, check_mode):
    """gpu_migration: the journal as it is (``status``, and every action in check mode), or the action
    carried out under the journal's rules. The module's result, with the journal and its phase."""
    # Imported here: it brings the engine, which the other modules that share this file need not load.
    from .migration import transaction as migration
    from .migration import plan
    journal = journal_for(params, params["role"])
    if params["action"] == "plan":
        if params["role"] != "source":
            raise InvalidTarget("plan is an action of the source's journal", stage="preflight")
        st = migration.status(journal)
        from .k8s.pods import target_pod_name
        made = plan.make(params, st, plan.HostProbe(lambda name: make_backend(name, params), target_pod_name))
        return dict(changed=False, journal=st, phase=st.get("phase"), host=plan.host_identity(), plan=made,
                    msg="plan of migration %s: %s" % (journal.id, "settle it" if made["settle"] else
                                                      "a new migration" if made["new"] else "nothing to settle"))
    if params["action"] == "status" or check_mode:
        st = migration.status(journal)
        return dict(changed=False, journal=st, phase=st.get("phase"), host=plan.host_identity(),
                    msg="phase %s" % st.get("phase"))
    changed, msg, out = _journal_action(journal, params)
    # A module killed while it held the host's huge pages setting (host_huge_pages) left it changed:
    # a migration's settlement and recover.yml put it back too.
    note = hugepages.settle()
    if note:
        out["huge_pages"] = {"note": note}
    st = migration.status(journal)
    return dict(out, changed=changed, msg=msg, journal=st, phase=st.get("phase"), host=plan.host_identity())


# -- cuda_process_facts -----------------------------------------------------------------------------------

def container_tree(params):
    """For cuda_process_facts' ``container``: (the root pid whose tree to report, the ``container`` fact,
    the pids of the tree as the runtime resolved them); (tree_of, None, None) without one."""
    if not params["container"]:
        return params["tree_of"], None, None
    root_pid, tree_pids = make_backend(params["runtime"], params).resolve(params["container"])
    return root_pid, {"id": params["container"], "runtime": params["runtime"], "pid": root_pid}, tree_pids


def container_backends(params, runtimes):
    """The backends of cuda_process_facts' ``list_containers``: those named, or by default every one of
    ``runtimes`` that is in use on this host."""
    if params["list_containers"] is not None:
        return [make_backend(name, params) for name in params["list_containers"]]
    backends = [make_backend(name, params) for name in runtimes]
    return [b for b in backends if b.present()]
