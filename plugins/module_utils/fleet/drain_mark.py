# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A node's drain mark: ``drain.json`` in its journal directory, written by drain.yml before anything is
frozen and removed by ``drain.yml -e undrain=true``. While it is there, the node is draining: the planners
place nothing on it (``cuda_process_facts`` reports it as ``drain``), and it names the moves a drain has
begun, so that a re-run after a killed drain settles them first (as recover.yml settles a migration)."""
from __future__ import annotations

import os

from ..core.fsutil import read_json

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
