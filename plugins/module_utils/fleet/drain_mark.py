# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A node's drain mark: ``drain.json`` in its journal directory, written by drain.yml before anything is
frozen and removed by ``drain.yml -e undrain=true``. While it is there, the node is draining: the planners
place nothing on it (``cuda_process_facts`` reports it as ``drain``), and it names the moves a drain has
begun, so that a re-run after a killed drain settles them first (as recover.yml settles a migration)."""
from __future__ import annotations

import os
import time

from ..core.fsutil import atomic_write, make_dirs_private, read_json

MARK_NAME = "drain.json"


def path(journal_dir):
    return os.path.join(journal_dir, MARK_NAME)


def read(journal_dir):
    """The mark (a dict), or None when the node is not draining. A mark that cannot be read as JSON
    still marks the node: it says so instead of vanishing."""
    p = path(journal_dir)
    if not os.path.lexists(p):
        return None
    mark = read_json(p)
    return mark if isinstance(mark, dict) else {"started": None, "error": "%s cannot be read as a drain mark" % p}


THROUGHPUT_NAME = "throughput.json"


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def marked(before, drain_id, pending=None, empty=False, k8s_node=None, keep_all=False):
    """The mark a drain writes over ``before`` (the mark there, {} for none): the drain's start kept from an
    earlier mark, this drain's id, whether the node is empty, the moves not settled (``pending``; None keeps the
    earlier mark's), and the Kubernetes node the drain cordoned (``k8s_node``; None keeps the earlier mark's).
    ``keep_all``: keep the earlier mark's other fields too (the first mark, before anything is planned)."""
    before = before if isinstance(before, dict) else {}
    mark = dict(before) if keep_all else {}
    mark.update(started=before.get("started") or _now(), drain_id=drain_id, empty=bool(empty),
                pending=list(before.get("pending") or []) if pending is None else list(pending))
    node = k8s_node or before.get("k8s_node")
    if node:
        mark["k8s_node"] = node
    return mark


def write(journal_dir, mark=None, throughput=None):
    """Write the node's mark (and the throughput its moves showed, ``throughput.json``), each whole under a new
    name and then renamed, in the journal directory (made 0700 when missing). None writes nothing of it."""
    make_dirs_private(journal_dir)
    if mark is not None:
        atomic_write(path(journal_dir), mark)
    if throughput is not None:
        atomic_write(os.path.join(journal_dir, THROUGHPUT_NAME), throughput)


def remove(journal_dir):
    """Take the mark away (the node takes work again); whether there was one."""
    try:
        os.unlink(path(journal_dir))
        return True
    except FileNotFoundError:
        return False
