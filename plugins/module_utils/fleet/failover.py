# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The failover of a protected job, planned: the replicas' record of who owns it, and which image of which
replica goes to which host (``restorability.choose``); and the list of a job's images with their verdicts. Pure:
facts in (gpu_replica's listings, cuda_process_facts), a plan with reasons and its lines for people out.

Never two copies: the replicas' record (``replica/replica.py``) names the job's owner and its epoch, and a failover
is refused when that owner is not the lost node (it was failed over already) or is the target (it runs the job).
Each replica's record must name the new owner afterwards, so the plan names, for each other replica, the images
its own gpu_replica failover may take.
"""
from __future__ import annotations

import json

from ..migration import planner
from .restorability import GIB, choose, image_bytes, newest_first, refused, restorability, summary, unusable


def newest_record(records):
    """(replica, record) of the highest epoch among the replicas' records ({replica: record or None})."""
    known = [(name, r) for name, r in sorted(records.items()) if isinstance(r, dict) and r.get("epoch") is not None]
    if not known:
        return None, None
    return max(known, key=lambda pair: pair[1]["epoch"])


def record_refusal(record, job, lost_node, target=None):
    """Why the replicas' record of the job refuses this failover (it runs elsewhere already), or None."""
    if record is None:
        return "no replica has a record of job %s (was it protected, with these replicas?)" % job
    owner, epoch = record.get("owner"), record.get("epoch")
    last = ([h for h in record.get("history") or [] if h.get("event") == "failover"] or [{}])[-1]
    since = " (failed over from %s at %s)" % (last.get("from"), last.get("at")) if last else ""
    if target is not None and owner == target:
        return ("%s already owns job %s since epoch %s%s: refusing a second copy" % (target, job, epoch, since))
    if owner != lost_node:
        return ("job %s runs on %s since epoch %s%s, not on %s: it was already failed over"
                % (job, owner, epoch, since, lost_node))
    return None


def _listing_images(listings):
    """Every image of the replicas' listings ({replica: {"record", "images"} or a text why not}), each given
    its replica's name; and {replica: why it could not be read}."""
    images, unread = [], {}
    for name, listing in sorted(listings.items()):
        if not isinstance(listing, dict):
            unread[name] = str(listing)
            continue
        images += [dict(i, replica=name) for i in listing.get("images") or []]
    return images, unread


def plan_failover(listings, hosts_facts, job, lost_node, target=None, opts=None):
    """The failover of ``job`` from ``lost_node``: which image, from which replica, onto which host; or why
    not. ``listings``: {replica: gpu_replica's list ({"record", "images"}), or a text why there is none}."""
    images, unread = _listing_images(listings)
    owner_at, record = newest_record({n: l.get("record") for n, l in listings.items() if isinstance(l, dict)})
    if target is not None and target == lost_node:
        refusal = "the target %s is the lost node itself" % target
    elif listings and len(unread) == len(listings):
        refusal = "no replica could be read: " + "; ".join("%s: %s" % kv for kv in sorted(unread.items()))
    else:
        refusal = record_refusal(record, job, lost_node, target)
    picked = refused(refusal) if refusal else choose(images, hosts_facts, target, opts, lost_node, job)
    image = picked["image"]
    plan = {"ok": image is not None, "refused": picked["refused"], "job": job, "lost_node": lost_node,
            "target": picked["target"], "replica": image.get("replica") if image else None,
            "image": summary(image) if image else None, "candidates": picked["candidates"],
            "gpu_map": picked["gpu_map"], "skipped": picked["skipped"], "hosts": picked["hosts"],
            "record": record, "record_replica": owner_at, "epoch": (record or {}).get("epoch"),
            "unread_replicas": unread, "images": {i["id"]: summary(i) for i in images if i.get("id")},
            "checks": (picked["verdict"] or {}).get("checks", [])}
    plan["others"] = _other_replicas(images, plan, listings)
    plan["lines"] = plan_lines(plan)
    return plan


def _other_replicas(images, plan, listings):
    """{replica: the image ids its own gpu_replica failover may take} for each other replica that was read: every
    replica's record must name the new owner, or the job's next protection is refused there (and the old node's
    pushes accepted). The chosen image first where it holds it, then its other verified ones."""
    if not plan["ok"]:
        return {}
    out = {}
    for name in sorted(n for n, l in listings.items() if isinstance(l, dict) and n != plan["replica"]):
        own = [i for i in newest_first([i for i in images if i["replica"] == name]) if not unusable(i)]
        out[name] = sorted((i["id"] for i in own), key=lambda i: i != plan["image"]["id"])
    return out


def _size(n):
    if n is None:
        return "size ?"
    return planner.gib(n) if n >= GIB else "%.1f MiB" % (n / float(planner.MIB))


def _progress(value):
    return json.dumps(value, sort_keys=True, default=str)


def image_lines(img, verdict=None, host=None):
    """One image, for people: where, when, how big, verified, its epoch and the job's progress; then, with a
    verdict, whether it can be restored on ``host`` and why not."""
    state = "verified" if img.get("verified") else "CORRUPT: %s" % img.get("corrupt") if img.get("corrupt") else \
        "incomplete" if not img.get("complete", True) else "not verified"
    lines = ["  %s  %s  %s  %s  %s  epoch %s%s" % (
        img.get("replica"), img.get("id"), img.get("checkpoint_at"), _size(image_bytes(img)), state, img.get("epoch"),
        "  progress %s" % _progress(img["progress"]) if img.get("progress") is not None else "")]
    if verdict is not None:
        lines.append("    %s on %s%s" % ("RESTORABLE" if verdict["restorable"] else "NOT restorable", host,
                                         "" if verdict["restorable"] else ": " + "; ".join(verdict["reasons"])))
    return lines


def plan_lines(plan):
    """The failover's plan, for people."""
    if not plan["ok"]:
        lines = ["Failover of job %s from %s: REFUSED: %s" % (plan["job"], plan["lost_node"], plan["refused"])]
    else:
        img = plan["image"]
        lines = ["Failover of job %s from %s onto %s: image %s of replica %s, taken %s (%s, epoch %s)%s" % (
            plan["job"], plan["lost_node"], plan["target"], img["id"], plan["replica"], img["checkpoint_at"],
            _size(img["bytes"]), img["epoch"], ", progress %s" % _progress(img["progress"]) if img["progress"] is not None else "")]
        lines += ["  then, should it not verify again: %s" % ", ".join(plan["candidates"][1:])] if plan["candidates"][1:] else []
    lines += ["  SKIPPED image %s on %s: %s" % (s["id"], s["replica"], s["reason"]) for s in plan["skipped"]]
    lines += ["  HOST %s: %s" % (n, why) for n, why in sorted(plan["hosts"].items())]
    lines += ["  REPLICA %s not read: %s" % kv for kv in sorted(plan["unread_replicas"].items())]
    return lines


def report_images(listings, host_facts=None, host=None, opts=None, job="job"):
    """The images of a job on its replicas, the newest first, each with its verdict for ``host`` when its
    facts are given: ``{"record", "images": [summary + "restorable", "reasons", "checks"], "lines"}``."""
    images, unread = _listing_images(listings)
    unused, record = newest_record({n: l.get("record") for n, l in listings.items() if isinstance(l, dict)})
    out, lines = [], ["Images of job %s (owner %s, epoch %s): %d on %d replica(s)" % (
        job, (record or {}).get("owner", "?"), (record or {}).get("epoch", "?"), len(images), len(listings) - len(unread))]
    for img in newest_first(images):
        verdict = restorability(img, host_facts, opts, host) if isinstance(host_facts, dict) else None
        entry = dict(summary(img), complete=img.get("complete", True), corrupt=img.get("corrupt"),
                     stall_s=img.get("stall_s"))
        if verdict is not None:
            entry.update(restorable=verdict["restorable"], reasons=verdict["reasons"], checks=verdict["checks"])
        out.append(entry)
        lines += image_lines(img, verdict, host)
    if host is not None and not isinstance(host_facts, dict):
        lines.append("  %s could not be asked: %s" % (host, host_facts))
    lines += ["  REPLICA %s not read: %s" % kv for kv in sorted(unread.items())]
    return {"record": record, "images": out, "lines": lines, "unread_replicas": unread}
