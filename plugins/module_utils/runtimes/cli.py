# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A container runtime's command line (podman, docker, runc, runsc): one client for the four backends that drive
their runtime through its CLI.

Its binary and global options are given when it is made; each command runs through core/run.py (never a shell,
a failure that names the command, its rc and output). The binary is looked up at each command, as before there
was this class: a runtime installed or removed meanwhile is seen, and a missing one fails where it is used.
"""
from __future__ import annotations

import json

from ..core.errors import InvalidTarget
from ..core.run import find_binary, run, run_detaching


class RuntimeCli(object):
    """``binary`` (or ``path``, the user's), with ``global_args`` before each command; ``what``: how to get it."""

    def __init__(self, binary, path=None, what=None, global_args=()):
        self.binary, self.path, self.what = binary, path, what
        self.global_args = [str(a) for a in global_args]

    def installed(self):
        """Whether the binary is there (for facts: no error when not)."""
        return bool(find_binary(self.binary, self.path, required=False))

    def argv(self, *args):
        """The command line of ``args``: the binary, its global options, then ``args``."""
        return [find_binary(self.binary, self.path, what=self.what)] + self.global_args + list(args)

    def run(self, *args, **options):
        """core.run.run of the command ``args`` (``options``: its timeout, check, stage, new_session, ...)."""
        return run(self.argv(*args), **options)

    def run_detaching(self, args, stdout, stderr, **options):
        """core.run.run_detaching of the command ``args``: one that leaves a daemon behind (a restore --detach)."""
        return run_detaching(self.argv(*args), stdout, stderr, **options)

    def describe(self, args, what, hint, required=True, listed=False):
        """The JSON the runtime prints for ``args`` (its ``state`` or ``inspect`` of one container), read before
        anything is frozen: None where it knows no such container and it is not ``required``; else InvalidTarget
        that says ``what`` was not found, the runtime's own words and ``hint``. ``listed``: the command prints a
        list of one (inspect), whose item is returned."""
        res = self.run(*args, stage="preflight", check=False)
        if res.rc != 0 or (listed and not res.stdout.strip().startswith("[")):
            if not required:
                return None
            raise InvalidTarget("no %s: %s" % (what, (res.stderr or res.stdout).strip()[:300]), stage="preflight",
                                hint=hint)
        found = json.loads(res.stdout)
        return found[0] if listed else found

    def running_containers(self, *list_args):
        """[{id, pid, status}] of the containers that an OCI runtime (runc, runsc) lists with ``list_args`` (its
        JSON listing) as running or paused."""
        res = self.run(*list_args, stage="facts")
        return [{"id": c["id"], "pid": c["pid"], "status": c["status"]} for c in json.loads(res.stdout or "null") or []
                if c.get("pid") and c.get("status") in ("running", "paused")]
