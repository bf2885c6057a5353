# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one waiter: a deadline, an interval and a predicate, and a timeout that names what was awaited.

Every wait of the collection (a pid to be reaped, a journal's lock, a delivered image, a container
to stop, a pod to run or go) goes through ``wait_for``, so each has a bound, none spins, and a
timeout always says what it waited for and for how long. Standard library only: the receiver
program carries core/ modules (core/bundle.py) and may use it.
"""
from __future__ import annotations

import errno
import fcntl
import time

from .errors import GpuCkptError


class WaitTimeout(GpuCkptError):
    """What was awaited did not happen before the deadline; ``last`` is the predicate's last answer."""

    def __init__(self, msg, last=None, **kw):
        super().__init__(msg, **kw)
        self.last = last


def wait_for(predicate, timeout, what, interval=0.05, max_interval=None, backoff=1.0, on_timeout="raise",
             clock=time.monotonic, sleep=time.sleep, stage=None, hint=None):
    """Call ``predicate()`` until it returns something true, and return that.

    ``timeout`` seconds at most (None: no deadline; 0: one try). Between tries it sleeps
    ``interval``, multiplied by ``backoff`` after each try up to ``max_interval``, never past the
    deadline. On timeout it raises WaitTimeout("timed out after Ns waiting for <what>"), or, with
    ``on_timeout="return"``, returns the predicate's last (false) answer, for callers that report
    what is left (the pids still there) rather than fail.
    """
    deadline = None if timeout is None else clock() + max(0.0, float(timeout))
    pause = float(interval)
    while True:
        value = predicate()
        if value:
            return value
        now = clock()
        if deadline is not None and now >= deadline:
            if on_timeout == "return":
                return value
            raise WaitTimeout("timed out after %gs waiting for %s" % (float(timeout), what), last=value,
                              stage=stage, hint=hint)
        step = pause if deadline is None else min(pause, max(0.0, deadline - now))
        sleep(step)
        pause = pause * backoff
        if max_interval is not None:
            pause = min(pause, max_interval)


def flock_within(fd, timeout, what, on_timeout="raise", stage=None, hint=None, max_interval=0.2):
    """Take an exclusive flock on ``fd`` within ``timeout`` seconds (None: no deadline; 0: one try), through the
    waiter. Returns True once held; on timeout raises WaitTimeout naming ``what``, or returns False with
    ``on_timeout="return"``. An error other than "held by another" is raised as it is."""
    def taken():
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return False

    return bool(wait_for(taken, timeout, what, interval=0.02, backoff=1.5, max_interval=max_interval,
                         on_timeout=on_timeout, stage=stage, hint=hint))
