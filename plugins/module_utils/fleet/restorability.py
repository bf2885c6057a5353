# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Can this image still be restored on this host, and which image goes where when a node is lost? Facts in,
verdicts with reasons out.

Pure: no I/O, no Ansible, the standard library only. An image on a replica (``gpu_replica``'s list: each
image with its ``facts``, what its manifest recorded of the host that took it and of the workload) stands in
for the source of a migration: its recorded facts are mapped onto the facts ``cuda_process_facts`` returns
for a host (``source_facts``, ``image_tree``), and the migration's own planner (``migration/planner.py``)
checks them against the host's: driver and CUDA API version, GPU model and count, free GPU memory, CRIU,
pids, the host's drain mark. What an image adds: it is complete and verified, its runtime is present on the
host (the drain's check, ``fleet/placement.py``), the kernel, and the room its known size takes (disk for the
copy, host RAM for the restore).

A figure the image or the host does not record is unknown, never zero: an unknown check refuses unless the
caller accepts it by name (``allow_unknown``). The image does not record the workload's GPU memory (only its
whole size, of which the GPU memory is a part): where the whole image fits on each GPU it lands on, the
memory check passes; otherwise it is unknown, with both figures.

``choose`` picks, among the images of a job, the newest complete and verified one (the highest epoch first:
an image of an older epoch is never taken for a newer one) that can be restored on the named target, or on
the host the drain's placement would choose (``placement.place``); each image passed over is named with why.
The failover's plan around it (who owns the job, which replicas) is ``fleet/failover.py``.
"""
from __future__ import annotations

import datetime
import re

from ..migration import planner
from . import placement

OK, FAILS, UNKNOWN = planner.OK, planner.FAILS, planner.UNKNOWN
GIB = planner.GIB

# The checks of an image on a host, in order; the names allow_unknown takes.
CHECK_NAMES = ("image", "checkpoint_api", "driver_version", "cuda_api_version", "gpu_model", "gpu_count",
               "gpu_memory", "criu", "kernel", "runtime", "disk", "host_ram", "pids", "not_draining")
# The planner's checks that apply to an image as they are (the others are replaced below or do not apply: the
# workload's existence and its CUDA state were the source's, and the source's CRIU and disk did their work).
FROM_PLANNER = ("checkpoint_api", "driver_version", "cuda_api_version", "gpu_model", "gpu_count", "gpu_memory",
                "pids", "not_draining")
# Runtimes that need no CRIU of the host to restore (gVisor restores its own sandbox).
WITHOUT_CRIU = ("runsc",)
DEFAULTS = {"allow_unknown": (), "allow_driver_mismatch": False, "target_path": None, "target_paths": None,
            "same_kernel": False}


def options(**given):
    """The options of a verdict, the rest their defaults: ``allow_unknown`` (names of CHECK_NAMES whose unknown
    status does not refuse), ``allow_driver_mismatch`` (accept another driver and CUDA API version),
    ``target_path`` (the host's image root, whose free disk the copy needs; ``target_paths``: each host's, by
    name), ``same_kernel`` (refuse a host that runs another kernel release than the one that took the image)."""
    wrong = set(given) - set(DEFAULTS)
    if wrong:
        raise ValueError("unknown restorability options: %s" % ", ".join(sorted(wrong)))
    opts = dict(DEFAULTS, **{k: v for k, v in given.items() if v is not None})
    names = opts["allow_unknown"] or ()
    if isinstance(names, str):  # -e allow_unknown=gpu_memory,disk, or an AWX survey's text: one string
        names = [n.strip("'\" ") for n in re.split(r"[\s,]+", names.strip().strip("[]")) if n.strip("'\" ")]
    opts["allow_unknown"] = tuple(str(n) for n in names)
    bad = [n for n in opts["allow_unknown"] if n not in CHECK_NAMES]
    if bad:
        raise ValueError("allow_unknown names no check: %s (the checks: %s)" % (", ".join(bad), ", ".join(CHECK_NAMES)))
    return opts


# -- what a playbook registered -------------------------------------------------------------------------

def _failure(result, what):
    if result.get("unreachable"):
        return "unreachable: %s" % result.get("msg", "")
    if result.get("skipped"):
        return "not asked (skipped)"
    return "%s failed: %s" % (what, result.get("msg", "no answer"))


def facts_of(result):
    """A host's facts from its registered cuda_process_facts result (or the facts themselves), or a text that
    says why there are none."""
    if not isinstance(result, dict):
        return "not asked"
    if "ansible_facts" not in result and "host" in result:
        return result
    if result.get("failed") or result.get("unreachable") or "gpuckpt" not in (result.get("ansible_facts") or {}):
        return _failure(result, "its facts")
    return result["ansible_facts"]["gpuckpt"]


def listing_of(result):
    """A replica's listing ({"record", "images"}) from its registered gpu_replica result, or a text that says why
    there is none."""
    if not isinstance(result, dict):
        return "not asked"
    if result.get("failed") or result.get("unreachable") or result.get("skipped") or "images" not in result:
        return _failure(result, "its listing")
    return {"record": result.get("record"), "images": result.get("images") or []}


# -- the image's recorded facts as a host's --------------------------------------------------------------

def timestamp(value):
    """Seconds since the epoch of a checkpoint time as recorded (a number, or an ISO 8601 text); None when
    it is missing or cannot be read."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def _recorded(image):
    return image.get("facts") or {}


def image_bytes(image):
    """The image's size as recorded (its manifest, else the replica's count), or None."""
    size = _recorded(image).get("image_bytes")
    return size if size is not None else image.get("bytes")


def backend(image):
    """The runtime the image was taken with (its manifest's runtime.backend); None when not recorded."""
    return (_recorded(image).get("runtime") or {}).get("backend")


def workload_gpus(image):
    """The UUIDs of the GPUs the workload's CUDA processes held when the image was taken."""
    held = (_recorded(image).get("target") or {}).get("gpus") or {}
    return sorted({g.get("uuid") for gpus in held.values() for g in gpus or [] if g.get("uuid")})


def source_facts(image):
    """The image's recorded facts in the shape of a host's ``cuda_process_facts``: the host it was taken on,
    its driver and CUDA API version, its GPUs (those the workload held, where recorded), CRIU as it worked."""
    facts = _recorded(image)
    host = facts.get("host") or {}
    held = set(workload_gpus(image))
    gpus = [g for g in host.get("gpus") or [] if not held or g.get("uuid") in held]
    return {"host": {"hostname": "the image (taken on %s)" % (host.get("hostname") or "?"), "kernel": host.get("kernel")},
            "driver": {"driver_version": host.get("driver_version"), "api_version": host.get("cuda_api_version"),
                       # its CUDA processes were checkpointed through the driver's API
                       "checkpoint_api": bool((facts.get("target") or {}).get("cuda_pids"))},
            "gpus": gpus, "gpu_source": host.get("gpu_source"),
            "criu": {"installed": True, "version": host.get("criu_version") or "not recorded", "supported": True,
                     "check_ok": True}}


def image_tree(image, gpu_bound=False):
    """The workload as the planner takes a source's ``tree``. Its GPU memory is what the image records (None:
    unknown); with ``gpu_bound``, at most the whole image on each GPU it held (None when the size is unknown)."""
    facts = _recorded(image)
    target = facts.get("target") or {}
    pids = [int(p) for p in target.get("pids") or []]
    tree = {"root": pids[0] if pids else target.get("workload"), "exists": True, "pids": pids,
            "cuda_pids": [int(p) for p in target.get("cuda_pids") or []], "cuda_states": {},
            "rss_bytes": image_bytes(image), "gpu_bytes": target.get("gpu_bytes"),
            "gpu_bytes_by_gpu": target.get("gpu_bytes_by_gpu"),
            "gpu_memory_unknown_reason": "the image does not record the workload's GPU memory"}
    if gpu_bound:
        size, held = image_bytes(image), workload_gpus(image)
        tree["gpu_bytes"] = size
        tree["gpu_bytes_by_gpu"] = {uuid: size for uuid in held} if size is not None and held else None
    return tree


# -- the checks ------------------------------------------------------------------------------------------

def _hostname(host_facts, name=None):
    return name or (host_facts.get("host") or {}).get("hostname") or "the host"


def _as_dict(check, image_side=True):
    """A planner Check as a verdict's check; the planner says "source" where an image stands in for it."""
    reason = check.reason
    if reason and image_side:
        reason = reason.replace("on the source", "in the image").replace("the source", "the image")
    return {"name": check.name, "label": check.label, "image": check.source, "host": check.target,
            "status": check.status, "reason": reason}


def _check(name, label, image_value, host_value, status, reason=None):
    return {"name": name, "label": label, "image": str(image_value), "host": str(host_value), "status": status,
            "reason": None if status == OK else reason}


def _image_check(image):
    label = "image complete and verified on its replica"
    shown = "%s, %s" % ("complete" if image.get("complete", True) else "incomplete",
                        "verified" if image.get("verified") else "not verified")
    why = unusable(image)
    return _check("image", label, shown, "-", FAILS if why else OK, why)


def unusable(image):
    """Why this image cannot be restored anywhere (incomplete, corrupt, never verified), or None."""
    if not image.get("complete", True):
        return "incomplete (no manifest: a push that did not finish)"
    if image.get("corrupt"):
        return "corrupt: %s" % image["corrupt"]
    if not image.get("verified"):
        return "not verified on its replica (a push cut before its commit, or not checked yet)"
    if not image.get("facts"):
        return "its manifest's facts were not read"
    return None


def _gpu_memory(image, host_facts, exact, popts):
    """The planner's GPU memory check, with the image's whole size as the bound where its GPU memory is not
    recorded: the bound fitting decides ok, anything else stays unknown, saying both figures."""
    if exact["status"] != UNKNOWN or image_tree(image)["gpu_bytes"] is not None:
        return exact
    size = image_bytes(image)
    if size is None:
        return dict(exact, reason="the image records neither the workload's GPU memory nor its own size")
    bound = [c for c in planner.check_target(image_tree(image, gpu_bound=True), source_facts(image), host_facts, popts)
             if c.name == "gpu_memory"]
    checked = _as_dict(bound[0]) if bound else exact
    if checked["status"] == OK:
        return dict(checked, image="at most %s (the image's size)" % planner.gib(size))
    return dict(checked, status=UNKNOWN, image="at most %s" % planner.gib(size),
                reason="the image does not record the workload's GPU memory, only its whole size (%s), and that "
                       "bound does not settle it: %s" % (planner.gib(size), checked["reason"] or "?"))


def _planner_checks(image, host_facts, opts):
    runtime = backend(image)
    popts = planner.options(allow_driver_mismatch=bool(opts["allow_driver_mismatch"]),
                            container=runtime not in (None, "process"))
    checks = planner.check_target(image_tree(image), source_facts(image), host_facts, popts)
    out = {c.name: _as_dict(c) for c in checks if c.name in FROM_PLANNER}
    if "gpu_memory" in out:
        out["gpu_memory"] = _gpu_memory(image, host_facts, out["gpu_memory"], popts)
    criu = [c for c in checks if c.name == "criu"]
    if criu and runtime not in WITHOUT_CRIU:  # the planner's second CRIU check is the target's
        out["criu"] = _criu(image, criu[-1], host_facts)
    return out


def _version(text):
    try:
        return tuple(int(x) for x in str(text).split(".")[:3])
    except ValueError:
        return None


def _criu(image, target_check, host_facts):
    """The host's CRIU (4.x, criu check passing), and not older than the CRIU that wrote the image."""
    check = _as_dict(target_check, image_side=False)
    wrote = (_recorded(image).get("host") or {}).get("criu_version")
    has = (host_facts.get("criu") or {}).get("version")
    check.update(label="CRIU 4.x, criu check, not older than the image's", image=str(wrote or "not recorded"))
    if check["status"] == OK and wrote and has and _version(has) and _version(wrote) and _version(has) < _version(wrote):
        check.update(status=FAILS, reason="%s has CRIU %s, older than the %s that wrote the image"
                     % (_hostname(host_facts), has, wrote))
    return check


def _kernel(image, host_facts, opts):
    took = (_recorded(image).get("host") or {}).get("kernel")
    runs = (host_facts.get("host") or {}).get("kernel")
    label = "kernel"
    if not took or not runs:
        return _check("kernel", label, took or "?", runs or "?", UNKNOWN, "the kernel of %s is not known" %
                      " and ".join(w for w, k in (("the image", took), (_hostname(host_facts), runs)) if not k))
    if took == runs:
        return _check("kernel", label, took, runs, OK)
    if opts["same_kernel"]:
        return _check("kernel", label, took, runs, FAILS, "the image was taken on kernel %s, %s runs %s (same_kernel)"
                      % (took, _hostname(host_facts), runs))
    criu = host_facts.get("criu") or {}
    if criu.get("check_ok") is None:
        return _check("kernel", label + " (another release)", took, runs, UNKNOWN,
                      "the image was taken on kernel %s, %s runs %s, and criu check was not run there to say that it "
                      "has what CRIU needs" % (took, _hostname(host_facts), runs))
    # CRIU restores across kernel releases where `criu check` passes (the criu check above fails otherwise).
    return _check("kernel", label + " (another release; criu check decides)", took, runs, OK)


def _runtime(image, host_facts, name):
    runtime = backend(image)
    if runtime in (None, "process"):
        return _check("runtime", "runtime", runtime or "not recorded", "-", OK if runtime else UNKNOWN,
                      "the image does not record its runtime")
    return _as_dict(placement._runtime_check(runtime, _hostname(host_facts, name), host_facts), image_side=False)


def _room(name, label, need, free, where, why_free):
    """The image's known size against what the host has; unknown where either is not known."""
    shown = (planner.gib(need), planner.gib(free))
    if need is None:
        return _check(name, label, *shown, status=UNKNOWN, reason="the image's size is not recorded")
    if free is None:
        return _check(name, label, *shown, status=UNKNOWN, reason=why_free)
    return _check(name, label, *shown, status=OK if free >= need else FAILS,
                  reason="%s has %s, the image needs %s" % (where, planner.gib(free), planner.gib(need)))


def _rooms(image, host_facts, opts, name):
    host, size = _hostname(host_facts, name), image_bytes(image)
    path = opts["target_path"] or (opts["target_paths"] or {}).get(name)
    disk = ((host_facts.get("disk") or {}).get(path) or {}).get("free_bytes") if path else None
    ram = (host_facts.get("memory") or {}).get("available_bytes")
    return [_room("disk", "free disk for the image's copy", size, disk, "%s:%s" % (host, path),
                  "%s reports no free disk at %s (gather its facts with paths)" % (host, path) if path else
                  "no image root of %s was given to check its free disk" % host),
            _room("host_ram", "host RAM for the restore (MemAvailable)", size, ram, host,
                  "%s reports no MemAvailable" % host)]


def _named(host_facts, name):
    """The host's facts with its inventory name in its hostname, which the planner's reasons name it by (loopback or
    cloned hosts often share one hostname)."""
    if not name:
        return host_facts
    host = host_facts.get("host") or {}
    known = host.get("hostname")
    return dict(host_facts, host=dict(host, hostname=name if known in (None, name) else "%s (%s)" % (name, known)))


def restorability(image, host_facts, opts=None, name=None):
    """Can ``image`` (an entry of gpu_replica's list) be restored on the host of ``host_facts`` (its
    cuda_process_facts, gathered with ``check_pids`` = the image's pids and ``paths`` = its image root)?
    ``{"restorable", "checks": [{"name", "label", "image", "host", "status", "reason"}], "failed", "unknown",
    "allowed", "reasons"}``; refused by a check that fails, or is unknown and not allowed by name."""
    opts = opts or options()
    host_facts = _named(host_facts or {}, name)
    by_name = _planner_checks(image, host_facts, opts)
    by_name["image"] = _image_check(image)
    by_name["kernel"] = _kernel(image, host_facts, opts)
    by_name["runtime"] = _runtime(image, host_facts, name)
    by_name.update({c["name"]: c for c in _rooms(image, host_facts, opts, name)})
    checks = [by_name[n] for n in CHECK_NAMES if n in by_name]
    failed = [c["name"] for c in checks if c["status"] == FAILS]
    unknown = [c["name"] for c in checks if c["status"] == UNKNOWN]
    allowed = [n for n in unknown if n in opts["allow_unknown"]]
    reasons = ["%s: %s" % (c["label"], c["reason"]) for c in checks
               if c["status"] == FAILS or (c["status"] == UNKNOWN and c["name"] not in allowed)]
    return {"restorable": not reasons, "checks": checks, "failed": failed, "unknown": unknown, "allowed": allowed,
            "reasons": reasons}


# -- which image, onto which host --------------------------------------------------------------------------

def newest_first(images):
    """The images, the newest first: the highest epoch, then the latest checkpoint (an image of an older
    epoch was pushed before a failover and is never taken for a newer one), then the replica's order."""
    def key(pair):
        i, img = pair
        return (-(img.get("epoch") or 0), -(timestamp(img.get("checkpoint_at")) or float("-inf")), i)
    return [img for unused, img in sorted(enumerate(images), key=key)]


def summary(image):
    """What a report says of an image."""
    return {"id": image.get("id"), "replica": image.get("replica"), "path": image.get("path"),
            "checkpoint_at": image.get("checkpoint_at"), "checkpoint_ts": timestamp(image.get("checkpoint_at")),
            "bytes": image_bytes(image), "epoch": image.get("epoch"), "node": image.get("node"),
            "progress": image.get("progress"), "verified": bool(image.get("verified")),
            "runtime": backend(image), "container": (_recorded(image).get("runtime") or {}).get("container")}


def _workload_of(image, job):
    runtime = backend(image) or "process"
    # A pod's restore goes through its node's runtime handler (migrate.yml's pod path), not a host's runtime:
    # placed as a container, its runtime (containerd) is what the host needs.
    return {"key": "%s:%s" % (runtime, job), "kind": "process" if runtime == "process" else "container",
            "runtime": "containerd" if runtime == "k8s_pod" else runtime, "tree": image_tree(image)}


def best_host(image, fits, hosts_facts, job="job"):
    """(the host the drain's placement chooses among ``fits``, the GPU map it would give, {other: why not it}).
    The hosts were found able to restore the image already; placement orders them as a drain does (fewest moves
    planned there, then the most free GPU memory), its own checks accepting what is not known."""
    targets = {n: hosts_facts[n] for n in fits}
    anything = tuple(planner.CHECK_NAMES) + ("runtime", "deadline")
    moves, unused = placement.place(source_facts(image), [_workload_of(image, job)], targets, None, {},
                                    allow_unknown=anything, allow_driver_mismatch=True, margin=1.0)
    if not moves:  # what placement's own checks refuse, restorability accepted: the first by name then
        best = sorted(fits)[0]
        return best, None, {n: "restorable too; %s was chosen (first by name)" % best for n in fits if n != best}
    move = moves[0]
    return move["target"], move.get("gpu_map"), dict(move["rejected"])


def _not_restorable(verdicts, unreachable):
    why = ["%s: %s" % (n, "; ".join(v["reasons"])) for n, v in sorted(verdicts.items()) if not v["restorable"]]
    return "; ".join(why + ["%s: %s" % (n, w) for n, w in sorted(unreachable.items())])


def _candidates(chosen, ordered, facts, opts, name):
    """The images of the chosen one's replica that gpu_replica may fall back to, in order (it verifies each
    again and takes the first that verifies): the chosen one, then each later one restorable there too."""
    later = ordered[ordered.index(chosen) + 1:]
    same = [i for i in later if i.get("replica") == chosen.get("replica")]
    return [chosen["id"]] + [i["id"] for i in same if not unusable(i) and restorability(i, facts, opts, name)["restorable"]]


def _hosts_to_ask(hosts_facts, target, lost_node):
    """({name: facts or why there are none} of the hosts the job may go to, why there is none to ask or None)."""
    if target is not None and target == lost_node:
        return {}, "the target %s is the lost node itself" % target
    names = [target] if target is not None else sorted(n for n in hosts_facts if n != lost_node)
    if not names:
        return {}, "no host to fail over to (name a target, or give failover_targets)"
    facts = {n: hosts_facts.get(n, "not asked") for n in names}
    if not any(isinstance(f, dict) for f in facts.values()):
        return facts, "no host to fail over to could be asked: " + "; ".join(
            "%s: no facts: %s" % kv for kv in sorted(facts.items()))
    return facts, None


def _place(image, facts, unreachable, opts, job):
    """(the image's verdict on each host that was asked, the host chosen among those that can restore it or None,
    its GPU map, {other host: why not it})."""
    verdicts = {n: restorability(image, f, opts, n) for n, f in facts.items() if isinstance(f, dict)}
    fits = sorted(n for n, v in verdicts.items() if v["restorable"])
    if not fits:
        return verdicts, None, None, {}
    best, gpu_map, others = best_host(image, fits, facts, job)
    hosts = {n: "not restorable: " + "; ".join(v["reasons"]) for n, v in verdicts.items() if not v["restorable"]}
    hosts.update(unreachable)
    hosts.update(others)
    return verdicts, best, gpu_map, hosts


def choose(images, hosts_facts, target=None, opts=None, lost_node=None, job="job"):
    """The newest complete and verified image restorable on ``target`` (or, without one, on the host the drain's
    placement chooses among ``hosts_facts``: {name: facts, or a text saying why there are none}).
    ``{"image", "target", "verdict", "candidates", "gpu_map", "skipped": [{"id", "replica", "reason"}], "hosts":
    {name: why not}, "refused"}``; ``image`` None (and ``refused`` why) when none can be restored."""
    opts = opts or options()
    facts, refusal = _hosts_to_ask(hosts_facts, target, lost_node)
    unreachable = {n: "no facts: %s" % f for n, f in facts.items() if not isinstance(f, dict)}
    if refusal:
        return dict(refused(refusal), hosts=unreachable)
    skipped, ordered = [], newest_first(images)
    for image in ordered:
        why = unusable(image)
        verdicts, best, gpu_map, hosts = ({}, None, None, {}) if why else _place(image, facts, unreachable, opts, job)
        if best is not None:
            return {"image": image, "target": best, "verdict": verdicts[best], "gpu_map": gpu_map, "skipped": skipped,
                    "candidates": _candidates(image, ordered, facts[best], opts, best), "hosts": hosts, "refused": None}
        skipped.append({"id": image.get("id"), "replica": image.get("replica"),
                        "reason": why or "restorable on no host: " + _not_restorable(verdicts, unreachable)})
    why = "no replica holds an image of the job" if not images else \
        "no complete and verified image of the job" if all(unusable(i) for i in images) else \
        "no image can be restored on %s" % (target or " or ".join(sorted(facts)))
    return dict(refused(why), skipped=skipped, hosts=unreachable)


def refused(reason):
    """A choice that found nothing, and why."""
    return {"image": None, "target": None, "verdict": None, "gpu_map": None, "skipped": [], "candidates": [],
            "hosts": {}, "refused": reason}
