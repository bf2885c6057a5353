# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The restore of a pod on its target node, as two processes agree on it through files in the pod's image: the
node's restore (runtimes/k8s_pod.py, run by the engine) and the node's runtime handler (gpuckpt-restore-runtime,
run by containerd's runc shim in place of runc). Defined here once: the handler's program carries this
source (k8s/restore_handler.py), so the two cannot drift apart.

- The target pod carries the **restore request** (annotation ``gpuckpt.fleet/restore``: the image's path on the
  node and a token), written by whoever may create pods, so it is checked against:
- the **ticket** (``restore-ticket.json`` in the image, root's, 0600), which the node's restore writes: the target
  pod's ``namespace/name``, the SHA-256 of the token (the token itself is only in the pod's annotation) and each
  container's CRIU options;
- each container's **claim** (``containers/<name>/.restore-claim``), created exclusively by the handler before it
  restores that container, so that each is restored once: ``restoring``, then ``restored`` (a later create of it
  is the kubelet restarting a job that exited: plain runc) or ``failed`` (refused: the job must never start from
  its entrypoint while the migration holds its source). A node's restore that gives up marks every claim failed
  under the claim's lock (``.restore-claim.lock``), which the handler also takes before it marks a finished
  restore: a restore that finishes after the mark sees it and removes its copy.

Standard library and core/ only (the handler runs on the node, outside Ansible).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os

from ..core.fsutil import atomic_write

RESTORE_ANNOTATION = "gpuckpt.fleet/restore"
TICKET = "restore-ticket.json"
CONTAINERS_SUBDIR = "containers"
CLAIM, CLAIM_LOCK = ".restore-claim", ".restore-claim.lock"
RESTORING, RESTORED, FAILED = "restoring", "restored", "failed"


def restore_request(image_dir, token):
    """The value of the target pod's restore annotation: where the image is on the node, and the token."""
    return json.dumps({"image": image_dir, "token": token})


def token_digest(token):
    return hashlib.sha256(str(token or "").encode()).hexdigest()


def container_path(image_dir, name):
    """Where container ``name``'s checkpoint lies in a pod image (its ``checkpoint/``, ``rootfs-diff.tar`` and claim)."""
    return os.path.join(image_dir, CONTAINERS_SUBDIR, name)


# ---- the ticket ------------------------------------------------------------------------------------------------
def write_restore_ticket(image_dir, pod, token, records):
    """What the runtime handler on this node checks before it restores a container of ``pod`` from this image:
    the pod's name, the SHA-256 of its token and the containers, each with the CRIU options its dump needed.
    Root's, 0600, written atomically."""
    body = {"pod": pod, "token_sha256": token_digest(token),
            "containers": [{"name": r["name"], "auto_flags": list(r.get("auto_flags") or []),
                            "criu_options": list(r.get("criu_options") or [])} for r in records]}
    atomic_write(os.path.join(image_dir, TICKET), json.dumps(body, indent=1).encode(), mode=0o600)


def load_ticket(image_dir):
    """The ticket in ``image_dir``; OSError or ValueError when it cannot be read."""
    with open(os.path.join(image_dir, TICKET)) as fh:
        return json.load(fh)


def read_restore_ticket(image_dir):
    """The ticket the node's restore wrote into ``image_dir``, or None."""
    try:
        return load_ticket(image_dir)
    except (OSError, ValueError):
        return None


def token_matches(ticket, token):
    """Whether ``token`` (from the pod's annotation) is the one whose digest the ticket holds (compared in
    constant time: the annotation is anyone's who may create pods)."""
    want = str(ticket.get("token_sha256") or "")
    return bool(want) and hmac.compare_digest(want, token_digest(token))


# ---- the claims ------------------------------------------------------------------------------------------------
def take_claim(cdir):
    """Take the container's one restore: (True, None) when taken now, else (False, what the claim says)."""
    path = os.path.join(cdir, CLAIM)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False, read_claim(cdir) or RESTORING
    with os.fdopen(fd, "w") as fh:
        fh.write(RESTORING)
    return True, None


def read_claim(cdir):
    """The claim's state, or None when no restore of the container was claimed."""
    try:
        with open(os.path.join(cdir, CLAIM)) as fh:
            return fh.read().strip() or RESTORING
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def claim_lock(cdir):
    """The claim's changes after its creation, one at a time (see the module's doc)."""
    fd = os.open(os.path.join(cdir, CLAIM_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_claim(cdir, state):
    """Replace the claim's state; the caller holds claim_lock."""
    atomic_write(os.path.join(cdir, CLAIM), state.encode(), mode=0o600)


def set_claim(cdir, state):
    """Replace the claim's state under its lock."""
    with claim_lock(cdir):
        write_claim(cdir, state)
