# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpuckpt-restore-runtime: the OCI runtime through which a pod's containers are restored on a Kubernetes node.

containerd's runc shim runs it in place of runc (``BinaryName`` of a runtime handler, named by the target pod's
``runtimeClassName``). It is runc for every container, except the first ``create`` of a container whose pod the
collection made for a restore (annotation ``gpuckpt.fleet/restore``, passed into the OCI spec by the handler's
``pod_annotations``): that ``create`` becomes ``runc restore --detach`` of the container's checkpoint, into the
bundle, rootfs, mounts and devices that the kubelet and the device plugin gave the new container, and its
``start`` is then a no-op. The kubelet sees its container running, and it is the job itself: its exit, its logs
and ``kubectl exec`` are the job's, which a placeholder pod could not give. It works the same on containerd 1.7
to 2.4 and on every CRI runtime that takes a runtime handler, unlike the restore from a checkpoint image inside
CreateContainer, which containerd 2.4 removed (docs/kubernetes.md).

Why each check (a pod's annotations are written by whoever may create pods):
- the checkpoint must lie under one of the configured image roots, reached without a symlink, and carry a restore
  ticket that the collection wrote as root on this node for this pod's namespace and name, whose token (only its
  SHA-256 is on disk) the annotation must give: another tenant's pod cannot restore somebody else's job;
- each container is restored once: a claim file is created exclusively before the restore. A later ``create`` of
  a container that was restored (the job exited and the kubelet restarts it) is plain runc, as for any pod; one
  whose restore failed or never finished is refused, so that the kubelet cannot start the job from its
  entrypoint while the migration still holds the source (two copies, or a rewound job).

The ticket, the claims and the restore request are the collection's restore protocol
(plugins/module_utils/k8s/restore_protocol.py), which the node's restore (runtimes/k8s_pod.py) speaks too. This file
is the handler's own code; what the role installs is one program of this code and the modules of the collection
it imports, the protocol and the core modules it uses (k8s/restore_handler.handler_program, core/bundle.py: the
imports below work there as they are written). It runs on the node with the standard library only, outside
Ansible, started by the launcher ``gpuckpt-restore-runtime`` beside it (the handler's ``BinaryName``). Its settings,
``restore-runtime.json`` beside it or /etc/gpuckpt/restore-runtime.json: ``runc`` (the runtime it runs),
``image_roots``, ``state_dir``, ``ticket_wait`` (seconds a create waits for the node to write the restore ticket),
``restore_timeout`` (seconds a restore may run before it is killed).
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.fsutil import UnsafePath
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.wait import wait_for
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.restore_protocol import (
    CLAIM, FAILED, RESTORE_ANNOTATION, RESTORED, RESTORING, TICKET, claim_lock, container_path, load_ticket, read_claim,
    set_claim, take_claim, token_matches, write_claim)

SANDBOX_NS, SANDBOX_NAME = "io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name"
CONTAINER_NAME, CONTAINER_TYPE = "io.kubernetes.cri.container-name", "io.kubernetes.cri.container-type"
DEFAULTS = {"runc": "runc", "image_roots": ["/var/lib/gpuckpt/images"], "state_dir": "/run/gpuckpt-restore-runtime",
            "ticket_wait": 60, "restore_timeout": 1800}
GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}
# CRIU options runc restore takes as its own flags; the others go to CRIU through a configuration file
RUNC_RESTORE_FLAGS = {"--tcp-established", "--ext-unix-sk", "--file-locks", "--shell-job"}


class Refused(Exception):
    pass


def load_config():
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "restore-runtime.json"), "/etc/gpuckpt/restore-runtime.json"):
        if os.path.exists(path):
            with open(path) as fh:
                return dict(DEFAULTS, **json.load(fh))
    return dict(DEFAULTS)


def split_args(argv):
    """(global options, command, command's options, container id) of a runc command line."""
    i, glob = 0, []
    while i < len(argv) and argv[i].startswith("-"):
        glob.append(argv[i])
        if argv[i] in GLOBAL_WITH_VALUE and i + 1 < len(argv):
            glob.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        return glob, None, [], None
    cmd, rest = argv[i], argv[i + 1:]
    return glob, cmd, rest[:-1], (rest[-1] if rest else None)


def option(opts, *names):
    for i, o in enumerate(opts):
        for n in names:
            if o == n and i + 1 < len(opts):
                return opts[i + 1]
            if o.startswith(n + "="):
                return o.split("=", 1)[1]
    return None


def log_error(glob, msg):
    """What containerd shows: runc's JSON log (``--log``), read by the shim when the runtime fails."""
    sys.stderr.write("gpuckpt-restore-runtime: %s\n" % msg)
    path = option(glob, "--log")
    if path:
        try:
            with open(path, "a") as fh:
                fh.write(json.dumps({"level": "error", "msg": "gpuckpt-restore-runtime: " + msg,
                                     "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        except OSError:
            pass


def runc(config, argv):
    os.execvp(config["runc"], [config["runc"]] + list(argv))


def checked_image(config, image):
    """The checkpoint directory named by the annotation, refused unless it is under an image root, reached
    without symlinks, and owned by root and writable by root alone."""
    image = os.path.normpath(str(image or ""))
    if not os.path.isabs(image) or os.path.realpath(image) != image:
        raise Refused("checkpoint %r is not an absolute path free of symlinks" % image)
    roots = [os.path.realpath(r) for r in config["image_roots"]]
    if not any(image.startswith(r.rstrip("/") + "/") for r in roots):
        raise Refused("checkpoint %s is not under the image roots %s" % (image, ", ".join(roots)))
    for path in (image, os.path.join(image, TICKET)):
        if path != image and not os.path.lexists(path):
            continue  # not written yet: wait_for_ticket waits for it, then checks it
        st = os.lstat(path)
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or stat.S_ISLNK(st.st_mode):
            raise Refused("%s must be root's and writable by root alone" % path)
    return image


def wait_for_ticket(config, image):
    """The ticket, once the node's restore has written it: the migration creates the target pod as soon as the
    image has left the source, and the node writes the ticket once the image is complete and verified, a few
    seconds later. Waiting here (``ticket_wait`` seconds) saves the kubelet's back-off of a refused create (10 s
    and more of downtime). No claim is taken meanwhile: a create refused for want of a ticket can come again."""
    path = os.path.join(image, TICKET)
    no_ticket = "no restore ticket in %s (the node's restore has not started, or gave up)" % image

    def written():
        if os.path.lexists(path):
            return True
        if not os.path.isdir(image):
            raise Refused(no_ticket)
        return False
    if not wait_for(written, float(config.get("ticket_wait", 60)), "the restore ticket in %s" % image, interval=0.2,
                    on_timeout="return"):
        raise Refused(no_ticket)
    checked_image(config, image)  # the ticket itself: root's, not a symlink
    return image


def read_ticket(image, pod, token):
    """The image's ticket, refused unless it is for ``pod`` and ``token`` is the one it was written for."""
    ticket = load_ticket(image)
    if ticket.get("pod") != pod:
        raise Refused("the checkpoint in %s is for pod %s, not %s" % (image, ticket.get("pod"), pod))
    if not token_matches(ticket, token):
        raise Refused("the restore token of pod %s does not match the checkpoint's ticket in %s" % (pod, image))
    return ticket


def _inside(rootfs, path):
    """``path`` resolved (symlinks followed, as the kernel would) is ``rootfs`` or under it."""
    real = os.path.realpath(path)
    return real == rootfs or real.startswith(rootfs + "/")


def apply_rootfs_diff(diff, rootfs):
    """The container's writable layer as it was at the checkpoint, onto the fresh rootfs. Its names come from
    the workload's own layer and the rootfs from the workload's image, so nothing may be written or linked
    outside the rootfs: each member's directory must resolve inside it, a hard link's source too, and a
    symlink (or file) already at a member's own path is removed first instead of being written through
    (tarfile would open a symlink planted by the image and write the host file it names)."""
    rootfs = os.path.realpath(rootfs)
    with tarfile.open(diff) as tf:
        for m in tf.getmembers():
            base, name = os.path.split(m.name)
            dest = os.path.join(rootfs, m.name)
            if os.path.isabs(m.name) or not _inside(rootfs, os.path.join(rootfs, base)):
                raise Refused("rootfs-diff member %s leaves the rootfs" % m.name)
            if name == ".wh..wh..opq":
                continue
            if name.startswith(".wh."):
                victim = os.path.join(rootfs, base, name[4:])
                if os.path.isdir(victim) and not os.path.islink(victim):
                    shutil.rmtree(victim)
                elif os.path.lexists(victim):
                    os.unlink(victim)
                continue
            if m.islnk() and (os.path.isabs(m.linkname) or not _inside(rootfs, os.path.join(rootfs, m.linkname))):
                raise Refused("rootfs-diff hard link %s -> %s leaves the rootfs" % (m.name, m.linkname))
            if os.path.lexists(dest) and (os.path.islink(dest) or not (m.isdir() and os.path.isdir(dest))):
                if os.path.isdir(dest) and not os.path.islink(dest):
                    shutil.rmtree(dest)
                else:
                    os.unlink(dest)
            tf.extract(m, rootfs, set_attrs=True, **({"filter": "fully_trusted"} if hasattr(tarfile, "data_filter")
                                                     else {}))


CGROUP_FS = "/sys/fs/cgroup"


def systemd_cgroup_path(path):
    """runc's cgroupsPath of the systemd driver, ``slice:prefix:name``, as the cgroup v2 path systemd makes for it
    (runc's ExpandSlice: each dash-separated prefix of a slice's name is a parent slice)."""
    slice_, prefix, name = (path.split(":") + ["", ""])[:3]
    slice_ = slice_ or "system.slice"
    out, parent = "", ""
    if slice_ != "-.slice":
        for part in slice_[:-len(".slice")].split("-") if slice_.endswith(".slice") else [slice_]:
            out += "/" + parent + part + ".slice"
            parent += part + "-"
    unit = name if name.endswith(".slice") else "%s-%s.scope" % (prefix, name) if prefix else name + ".scope"
    return out + "/" + unit


def cgroup_root(spec):
    """On cgroup v2, the cgroup the restored processes must go into: the new container's (its spec's cgroupsPath).
    Without it CRIU puts them back into the cgroup they were dumped from, the held source's, which is frozen: the
    restore would freeze there. (On cgroup v1, runc names each controller's cgroup to CRIU itself.)"""
    if not os.path.exists(os.path.join(CGROUP_FS, "cgroup.controllers")):
        return None
    path = str((spec.get("linux") or {}).get("cgroupsPath") or "")
    if ":" in path:
        return systemd_cgroup_path(path)
    return path if path.startswith("/") else None


def criu_config(path, record, cgroup=None):
    """The dump's CRIU options that runc restore has no flag for, and the cgroup the restored processes go into,
    as a CRIU configuration file (runc hands it to CRIU: annotation org.criu.config)."""
    opts = [o for o in list(record.get("auto_flags") or []) + list(record.get("criu_options") or [])
            if o not in RUNC_RESTORE_FLAGS]
    with open(path, "w") as fh:
        for o in opts:
            fh.write(o.lstrip("-") + "\n")
        if cgroup:
            fh.write("cgroup-root %s\n" % cgroup)
        # CRIU reads this file last: an empty plugin directory of its own, so that CRIU's cuda plugin never
        # restores and unlocks the GPU behind the engine (plugins/module_utils/runtimes/criu.py)
        libdir = os.path.join(os.path.dirname(os.path.abspath(path)), "criu-no-plugins")
        shutil.rmtree(libdir, ignore_errors=True)
        os.mkdir(libdir, 0o700)
        fh.write("libdir %s\n" % libdir)
    return [o for o in list(record.get("auto_flags") or []) + list(record.get("criu_options") or [])
            if o in RUNC_RESTORE_FLAGS]


def admitted(config, spec, request):
    """(pod, container name, image, the container's ticket record) of a create that asks for a restore, once the
    request's image, its ticket, the pod's name and the token have passed every check."""
    ann = spec.get("annotations") or {}
    pod = "%s/%s" % (ann.get(SANDBOX_NS), ann.get(SANDBOX_NAME))
    cname = ann.get(CONTAINER_NAME)
    try:
        req = json.loads(request)
    except ValueError:
        raise Refused("annotation %s is not JSON" % RESTORE_ANNOTATION)
    image = checked_image(config, req.get("image"))
    ticket = read_ticket(wait_for_ticket(config, image), pod, req.get("token"))
    records = {c.get("name"): c for c in ticket.get("containers") or []}
    if cname not in records:
        raise Refused("container %s of pod %s is not in the checkpoint (it has %s)"
                      % (cname, pod, ", ".join(sorted(records)) or "none"))
    return pod, cname, image, records[cname]


def prepare_bundle(spec, bundle, cdir, work, record):
    """The new container made ready for its restore: its writable layer applied to the rootfs the kubelet gave it,
    and its spec pointing runc at a CRIU configuration of the dump's options. Returns runc restore's own flags."""
    root = (spec.get("root") or {}).get("path") or "rootfs"
    rootfs = root if os.path.isabs(root) else os.path.join(bundle, root)
    if os.path.exists(os.path.join(cdir, "rootfs-diff.tar")):
        apply_rootfs_diff(os.path.join(cdir, "rootfs-diff.tar"), rootfs)
    flags = criu_config(os.path.join(work, "criu.conf"), record, cgroup_root(spec))
    spec.setdefault("annotations", {})["org.criu.config"] = os.path.join(work, "criu.conf")
    with open(os.path.join(bundle, "config.json"), "w") as fh:
        json.dump(spec, fh)
    return flags


def run_restore(config, glob, opts, cid, cdir, work, flags, what):
    """``runc restore --detach`` of the container's checkpoint, with the create's bundle, pid file and console."""
    argv = [config["runc"]] + glob + ["restore", "--detach", "--image-path", os.path.join(cdir, "checkpoint"),
                                      "--work-path", work] + flags
    for name in ("--bundle", "--pid-file", "--console-socket"):
        value = option(opts, name, "-b") if name == "--bundle" else option(opts, name)
        if value:
            argv += [name, value]
    if "--no-pivot" in opts:
        argv.append("--no-pivot")
    # With the shim's stdio: runc maps the dumped pipes onto it. In a session of its own, so that a restore
    # that hangs (CRIU waiting on something that never comes) is killed whole after restore_timeout seconds
    # instead of holding the kubelet's create for ever.
    proc = subprocess.Popen(argv + [cid], start_new_session=True)
    try:
        rc = proc.wait(timeout=float(config.get("restore_timeout", 1800)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        subprocess.call([config["runc"]] + glob + ["delete", "--force", cid])
        raise Refused("runc restore of %s did not end within %ss and was killed; CRIU's log: %s"
                      % (what, config.get("restore_timeout", 1800), os.path.join(work, "restore.log")))
    if rc != 0:
        raise Refused("runc restore of %s failed (rc %d); CRIU's log: %s" % (what, rc, os.path.join(work, "restore.log")))


def mark_restored(cdir, work, pod, cname):
    """The claim says restored, unless the node's restore gave up meanwhile (it marked the claim failed): then
    this copy must not run."""
    with claim_lock(cdir):
        if read_claim(cdir) != RESTORING:
            raise Refused("the node's restore of pod %s gave up while container %s was restored; it was removed"
                          % (pod, cname))
        with open(os.path.join(work, "restored"), "w") as fh:
            fh.write(str(int(time.time())))
        write_claim(cdir, RESTORED)


def restore(config, glob, opts, cid, spec, bundle, request):
    """The container's create as the restore of its checkpoint: True once it runs restored; False when its one
    restore was done before (the kubelet restarts a restored job that exited: plain runc creates it)."""
    pod, cname, image, record = admitted(config, spec, request)
    cdir = container_path(image, cname)
    taken, state = take_claim(cdir)
    if not taken:
        if state == RESTORED:  # the restored job exited and the kubelet restarts it: a pod's own semantics
            return False
        raise Refused("the restore of container %s of pod %s is %s (%s): it is not started from its entrypoint "
                      "while the migration holds its source" % (cname, pod, state, os.path.join(cdir, CLAIM)))
    running = False
    try:
        work = os.path.join(config["state_dir"], os.path.basename(cid))
        os.makedirs(work, 0o700, exist_ok=True)
        flags = prepare_bundle(spec, bundle, cdir, work, record)
        run_restore(config, glob, opts, cid, cdir, work, flags, "container %s of pod %s" % (cname, pod))
        running = True
        mark_restored(cdir, work, pod, cname)
        return True
    except BaseException:
        # Whatever failed after runc restored the copy (the claim says failed, the image was removed under it by
        # the migration's rollback, a full disk), that copy must not run: the kubelet would take it for its own.
        if running:
            subprocess.call([config["runc"]] + glob + ["delete", "--force", cid])
        try:
            set_claim(cdir, FAILED)
        except (OSError, UnsafePath):
            pass  # the image is gone (or not what it was): no create can take this claim again
        raise


def main(argv):
    config = load_config()
    glob, cmd, opts, cid = split_args(argv)
    try:
        if cmd == "create" and cid:
            bundle = option(opts, "--bundle", "-b") or os.getcwd()
            with open(os.path.join(bundle, "config.json")) as fh:
                spec = json.load(fh)
            ann = spec.get("annotations") or {}
            request = ann.get(RESTORE_ANNOTATION)
            if request and ann.get(CONTAINER_TYPE, "container") == "container":
                if restore(config, glob, opts, cid, spec, bundle, request):
                    return 0
        elif cmd == "start" and cid and os.path.exists(os.path.join(config["state_dir"], os.path.basename(cid),
                                                                    "restored")):
            return 0  # restored running by its create
        elif cmd == "delete" and cid:
            work = os.path.join(config["state_dir"], os.path.basename(cid))
            log = os.path.join(work, "restore.log")
            if os.path.exists(log) and not os.path.exists(os.path.join(work, "restored")):
                os.replace(log, work + ".failed-restore.log")  # what the operator reads: kept past the delete
            shutil.rmtree(work, ignore_errors=True)
    except (Refused, OSError, ValueError, UnsafePath) as exc:  # UnsafePath: a claim's directory is a symlink
        log_error(glob, str(exc))
        return 1
    runc(config, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
