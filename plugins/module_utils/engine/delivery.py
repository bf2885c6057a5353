# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A migration's image changing hands: the source delivers it (the push's last part, after the
checkpoint's steps), the target waits for it before its restore begins.

Delivering the image to the target is the checkpoint's last step and has no undo: from there on only
the migration's settlement decides (see migration/transaction.py).
"""
from __future__ import annotations

import threading
import time

from ..core.errors import GpuCkptError, ImageError, TransactionError
from ..core.journal import Fenced
from ..core.wait import wait_for
from ..cuda import driver as cuda

# The target journal's phases from which this migration's image is here (or was, and its restore began).
DELIVERED = ("received", "restore_failed", "restoring", "restored", "committed")


def deliver(sender, image_dir, journal, clock):
    """The push's last part: the rest of the image, then the manifest. The source's journal says
    'delivering' before the manifest goes: from then on the target may hold a complete image, and
    only the migration's settlement may resume the source (see transaction.rollback_source).
    Returns the push's report; a failed push never fails the checkpoint. The 'delivering' transition is
    the Sender's before_deliver hook, given to it when it was made (checkpoint.push_hooks)."""
    report = {"pushed": False}
    try:
        report.update(sender.finish(image_dir), pushed=True)
        if journal is not None:
            journal.transition("delivered")
    except (GpuCkptError, OSError) as exc:
        sender.abort()
        report.update(sender.report(), error=exc.msg if isinstance(exc, GpuCkptError) else str(exc))
        if isinstance(exc, Fenced):
            report["fenced"] = True
    clock.stop("push")
    return report


def wait_for_delivery(journal, timeout, libcuda_path=None, poll=0.02):
    """Wait, without the journal's lock, until this migration's image has been delivered here (the
    target journal's phase is received: its manifest landed, its nonce checked) while the driver loads
    (cuInit takes about 0.4 s on an H200). A migration starts its target's restore this way BEFORE the
    source is frozen, so that the restore begins the moment the image is complete. Raises
    TransactionError when the migration was settled meanwhile (rolled back) and ImageError after
    ``timeout`` seconds. Returns the seconds waited."""
    start = time.monotonic()
    warm = threading.Thread(target=cuda.load, args=(libcuda_path,), name="gpuckpt-cuinit")
    warm.daemon = True
    warm.start()

    def delivered():
        phase = journal.phase
        if phase in ("cleaned", None):
            raise TransactionError("migration %s was rolled back while this host waited for its image (journal %s); "
                                   "nothing was restored" % (journal.id, phase or "absent"), stage="wait")
        return phase in DELIVERED

    if not wait_for(delivered, timeout, "the image of migration %s" % journal.id, interval=poll, on_timeout="return"):
        raise ImageError("no complete image of migration %s arrived within %s s; nothing was restored"
                         % (journal.id, timeout), stage="wait", hint="see the source's checkpoint and transfer")
    warm.join()
    return time.monotonic() - start
