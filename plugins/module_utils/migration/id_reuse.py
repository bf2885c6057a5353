# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A migration id used before: whether the workload named now is the one the source's journal recorded for that
id (a re-run, which finishes or reports that migration), or another workload, refused with the reason (``id_reuse``).
Pure: no I/O, the standard library only."""
from __future__ import annotations


def _recorded_workload(journal):
    if journal.get("pod"):
        pod = journal["pod"]
        return "pod %s/%s" % (pod.get("namespace"), pod.get("name")) if isinstance(pod, dict) else "pod %s" % pod
    if journal.get("container"):
        return "container %s (%s)" % (journal["container"], journal.get("runtime"))
    pids = journal.get("pids") or []
    return "pid %s" % pids[0] if pids else "an unknown workload"


def _names_recorded(journal, pid=None, container=None, pod=None, pid_now=None, target_journal=None):
    """Whether the workload named now (a pod, else a container, else a pid) is the one ``journal`` recorded."""
    if pod:
        rec = journal.get("pod")
        if isinstance(rec, dict):
            return str(pod) in ("%s/%s" % (rec.get("namespace"), rec.get("name")), rec.get("name"))
        return str(rec) == str(pod)
    if container:
        return str(journal.get("container")) == str(container)
    pids = journal.get("pids") or []
    root = str(pids[0]) if pids else None
    if root != str(pid):
        return False
    if pid_now is None:
        return True
    # The process the migration froze, the one its rollback brought back (restored from the source's image: the
    # same pid, a new start time), or its copy on the target (``target_journal``), which has that very pid where
    # the two hosts are one machine.
    where = ((journal, "identities"), (journal, "resumed_identities"), (target_journal or {}, "identities"))
    known = [(doc.get(key) or {}).get(root) or {} for doc, key in where]
    return any(i.get("starttime") in (None, pid_now.get("starttime")) for i in known if i) or not any(known)


def _named(pid, container, pod):
    """The workload named now, in words (a pod, else a container, else a pid), or None when none is."""
    return "pod %s" % pod if pod else "container %s" % container if container else "pid %s" % pid if pid else None


def id_reuse(migration_id, journal, pid=None, container=None, pod=None, pid_now=None, target_journal=None):
    """Why this migration id may not be used for the workload named now, or None when it names the
    workload the id was used for (a re-run, which finishes or reports that migration). ``journal``: the
    source's journal as ``gpu_migration`` reads it; ``pid_now``: the identity ({"starttime"}) of the process
    that has ``pid`` now, or None when none has it. A pid of the journal that another process holds now is
    another workload: the id is not answered with the old migration's result."""
    if not journal or not journal.get("exists"):
        return None
    asked = _named(pid, container, pod)
    if asked is None or _names_recorded(journal, pid, container, pod, pid_now, target_journal):
        return None
    recorded = _recorded_workload(journal)
    if recorded == asked:  # the same pid, that another process holds now: say so, or the two read alike
        asked += " (another process holds it now: it started at tick %s after boot, the migration's at tick %s)" % (
            pid_now.get("starttime"), ((journal.get("identities") or {}).get(str(pid)) or {}).get("starttime"))
    return ("migration id %s was used before for %s (phase %s); this run names %s: choose another migration_id "
            "(the old id only finishes or reports that migration)" % (migration_id, recorded, journal.get("phase"), asked))
