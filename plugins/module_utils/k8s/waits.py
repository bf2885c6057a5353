# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's waits on a pod, through core/wait.wait_for: a migration's target pod until it runs (its
containers restored by the node's runtime handler), and a deleted source pod until the API server has let it go
(its node's kubelet stopped its containers). Each timeout names the pod and what it still waits in.
"""
from __future__ import annotations

from ..core.errors import GpuCkptError
from ..core.wait import wait_for
from .api import find_pod, read_pod


def wait_pod_gone(api, namespace, name, uid, timeout, poll=1.0):
    """Wait until the pod of ``uid`` is gone from the API server (the kubelet has stopped its containers and
    the API server removed it); a pod made since under the name does not count."""
    def gone():
        pod = find_pod(api, namespace, name)
        return pod is None or (pod.get("metadata") or {}).get("uid") != uid
    if not wait_for(gone, timeout, "pod %s/%s (uid %s) to go" % (namespace, name, uid), interval=poll,
                    on_timeout="return"):
        raise GpuCkptError("pod %s/%s (uid %s) is still there %ds after its deletion (its node's kubelet has not "
                           "stopped it)" % (namespace, name, uid, timeout), stage="release-source")


def _container_states(status):
    return [(s.get("name"), s.get("state") or {}) for s in status.get("containerStatuses") or []]


def _running(pod):
    """Whether the pod is Running with every container running."""
    status = pod.get("status") or {}
    states = _container_states(status)
    return status.get("phase") == "Running" and bool(states) and all("running" in st for unused, st in states)


def _check_not_ended(namespace, name, status):
    """Refused at once when the pod ended or a container of it terminated: its restore will not come up."""
    terminated = [(n, st["terminated"]) for n, st in _container_states(status) if "terminated" in st]
    if status.get("phase") in ("Failed", "Succeeded") or terminated:
        n, t = terminated[0] if terminated else (None, {})
        what = "container %s terminated" % n if terminated else "is " + status.get("phase", "")
        why = ": %s" % (t.get("reason") or t.get("message")) if t else ""
        raise GpuCkptError("pod %s/%s %s%s" % (namespace, name, what, why), stage="runtime-restore")


def wait_pod_running(api, namespace, name, timeout, poll=1.0):
    """The pod once it is Running with every container running (its restored copy came up), or an error
    naming what it waits in (the kubelet's reason) after ``timeout`` seconds."""
    last = None

    def running():
        nonlocal last
        last = read_pod(api, namespace, name)
        if _running(last):
            return last
        _check_not_ended(namespace, name, last.get("status") or {})
        return None
    if wait_for(running, timeout, "pod %s/%s to run" % (namespace, name), interval=poll, on_timeout="return"):
        return last
    status = last.get("status") or {}
    waiting = ["%s: %s" % (n, (st.get("waiting") or {}).get("reason") or "not started")
               for n, st in _container_states(status)]
    raise GpuCkptError("pod %s/%s is not running after %ds (phase %s%s)"
                       % (namespace, name, timeout, status.get("phase"), "; " + ", ".join(waiting) if waiting else ""),
                       stage="runtime-restore")
