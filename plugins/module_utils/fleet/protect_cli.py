# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``gpuckpt-protect``: the command the role gpuckpt.fleet.protect installs on a node and its timers run.

  gpuckpt-protect run --protect-dir D [--job J]           a checkpoint of J (of every job without --job)
  gpuckpt-protect now --protect-dir D --job J [--within S] a checkpoint now, outside the schedule: prints at once
                                                          whether it is expected to finish within S seconds
  gpuckpt-protect status --protect-dir D [--job J]        each job's last runs, stall, overhead, images, fence
  gpuckpt-protect fence-check --protect-dir D [--job J]   only the fence check (and the give-back below)
  gpuckpt-protect give-back --protect-dir D [--job J]     give back what a run that died left frozen (its tree
                                                          SIGKILLed, an OOM kill, systemd's stop timeout): the
                                                          driver's restore and unlock, the runtime's resume; every
                                                          other command does this first, the unit's ExecStopPost too

Each prints JSON: run and now one line per attempt (the history line), status one document, give-back one line
per job. Exit status: 0 done (a skipped run too: one was running), 1 a checkpoint failed (or a give-back did), 2 a
usage or configuration error, 3 the job is fenced (failed over to another node: its copy here was stopped). See
fleet/protect.py.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..core.errors import GpuCkptError, InvalidTarget
from . import protect


def _print(doc, out, indent=None):
    out.write(json.dumps(doc, sort_keys=True, default=str, indent=indent) + "\n")
    out.flush()


def _seconds(text):
    """--within: a positive, finite number of seconds ("x", "-5", "0", "nan", "inf" are refused before anything runs)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds, not %r" % text)
    return value


def _parser():
    p = argparse.ArgumentParser(prog="gpuckpt-protect", description="Checkpoints of protected jobs, kept on replicas")
    p.add_argument("command", choices=["run", "now", "status", "fence-check", "give-back"])
    p.add_argument("--protect-dir", default=protect.DEFAULT_PROTECT_DIR)
    p.add_argument("--job")
    p.add_argument("--within", type=_seconds, help="now: the seconds left (a spot notice's, say)")
    return p


def _run(args, out):
    if args.command == "now" and not args.job:
        raise InvalidTarget("now needs --job", stage="preflight")
    worst = protect.EXIT_OK
    for job in protect.jobs_of(args.protect_dir, args.job):
        try:
            line, code = protect.run(args.protect_dir, job, trigger="now" if args.command == "now" else "timer",
                                     within=args.within, announce=lambda doc: _print(doc, out))
        except GpuCkptError as exc:  # this job's config: the other jobs still run
            line, code = {"job": job, "result": "error", "error": exc.msg, "stage": exc.stage}, protect.EXIT_USAGE
        _print(line, out)
        worst = max(worst, code)
    return worst


def main(argv=None, out=None):
    out = out or sys.stdout
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command in ("run", "now"):
            return _run(args, out)
        if args.command == "status":
            docs = protect.status_all(args.protect_dir, args.job)
            _print(docs[0] if args.job and docs else docs, out, indent=1)
            return protect.EXIT_FENCED if any(d.get("fenced") for d in docs) else protect.EXIT_OK
        if args.command == "give-back":
            docs = protect.give_back_all(args.protect_dir, args.job)
            for doc in docs:
                _print(doc, out)
            return protect.EXIT_FAILED if any(d.get("failed") for d in docs) else \
                protect.EXIT_USAGE if any(d.get("error") for d in docs) else protect.EXIT_OK
        checks = protect.fence_check_all(args.protect_dir, args.job)
        for doc in checks:
            _print(doc, out)
        return protect.EXIT_FENCED if any(d.get("fenced") for d in checks) else protect.EXIT_OK
    except GpuCkptError as exc:
        _print({"error": exc.msg, "stage": exc.stage}, out)
        sys.stderr.write("gpuckpt-protect: %s\n" % exc.msg)
        return protect.EXIT_USAGE
