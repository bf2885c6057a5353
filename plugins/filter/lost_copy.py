# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether a migration's copy on its target may have run and is gone: then resuming the source is a rewind."""
from __future__ import annotations

import time

DOCUMENTATION = r"""
name: lost_copy
short_description: Whether the target's copy of a migration may have run and no longer runs (a rollback would rewind)
version_added: "0.5.0"
description:
  - Reads the result of the target's settlement (gpuckpt.fleet.gpu_migration, O(action=settle)), whose C(journal) is the
    target's journal after it. The copy may have run once a restore brought its processes up (the journal names them
    in C(identities), recorded before any unlock, and C(resumed_at) is the unlock, once the restore ended). It is
    C(lost) when it may have run and no longer runs. That is when the settlement cleaned the target after a restore
    had brought it up (its processes died, with their host or on their own, or not all of them ran), or when the
    target committed earlier and its copy's processes are gone now.
  - A lost copy's work is gone with it. The source, held at its freeze, is the only state left; resuming it rolls the job
    back by what the copy did, which only an operator may accept (C(gpuckpt_accept_rewind)). C(note) says so, with when
    the copy could have begun to run and, when the journal says it, for how long at most.
  - A target that could not be asked, or whose settlement failed, tells nothing (C(lost) and C(known) are false).
options:
  _input:
    description: The registered result of the settlement on the target.
    type: dict
    required: true
  target:
    description: The target's name, for the note.
    type: str
    default: the target
"""

EXAMPLES = r"""
- name: What the target's copy did
  ansible.builtin.set_fact:
    gpuckpt_lost_copy: "{{ gpuckpt_settled | gpuckpt.fleet.lost_copy(target=target) }}"
"""

RETURN = r"""
_value:
  description: C(lost), C(known), C(since) and C(until) (seconds since the epoch, or null), C(ran_s) (at most, or null) and C(note).
  type: dict
"""


def _iso(t):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))


def _last(history, phase):
    times = [h.get("time") for h in history or [] if isinstance(h, dict) and h.get("phase") == phase and h.get("time")]
    return float(times[-1]) if times else None


def lost_copy(settled, target="the target"):
    settled = settled if isinstance(settled, dict) else {}
    if settled.get("unreachable") or settled.get("failed") or settled.get("skipped") or "decision" not in settled:
        return {"lost": False, "known": False, "since": None, "until": None, "ran_s": None, "note": ""}
    j = settled.get("journal") or {}
    brought_up = bool(j.get("identities")) or j.get("resumed_at") is not None
    if settled["decision"] == "commit":
        lost = not j.get("alive_pids")
        until = None
    else:
        lost = brought_up
        until = _last(j.get("history"), "cleaned")
    since = j.get("resumed_at")
    how = "its restore had unlocked it"
    if since is None:
        since = _last(j.get("history"), "restoring")
        how = "its restore had brought its processes up; whether it unlocked them the journal does not say"
    ran = round(max(0.0, float(until) - float(since)), 1) if lost and until is not None and since is not None else None
    note = ""
    if lost:
        note = ("its copy on %s %s%s (%s) and no longer runs%s: the only state left is the source's, held at its "
                "freeze; resuming it rewinds the job by what that copy did%s" % (
                    target, "was committed and " if settled["decision"] == "commit" else "was brought up",
                    " at " + _iso(since) if since is not None else "", how,
                    " (found gone at %s)" % _iso(until) if until is not None else "",
                    " (it ran for %s s at most)" % ran if ran is not None else ""))
    return {"lost": lost, "known": True, "since": since, "until": until, "ran_s": ran, "note": note}


class FilterModule(object):
    def filters(self):
        return {"lost_copy": lost_copy}
