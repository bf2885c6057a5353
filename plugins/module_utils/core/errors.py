# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Errors for people: which stage, which pid, the command, its rc/stdout/stderr, what to do next.

Plain Python: the engine is importable and testable without Ansible.
"""
from __future__ import annotations


class GpuCkptError(Exception):
    """Base error. ``to_dict()`` is what modules pass to ``fail_json``."""

    def __init__(self, msg, stage=None, pid=None, cmd=None, rc=None, stdout=None, stderr=None,
                 hint=None, driver_error=None, rolled_back=None, details=None):
        super().__init__(msg)
        self.msg = msg
        self.stage = stage
        self.pid = pid
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        self.hint = hint
        self.driver_error = driver_error
        self.rolled_back = rolled_back
        self.details = details or {}

    def __str__(self):
        parts = [self.msg]
        if self.hint:
            parts.append("Next: " + self.hint)
        return " ".join(parts)

    def to_dict(self):
        out = {"msg": str(self)}
        for key in ("stage", "pid", "cmd", "rc", "stdout", "stderr", "driver_error", "rolled_back"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.details:
            out.update(self.details)
        return out


class InvalidTarget(GpuCkptError):
    """The pid or image given cannot be worked on; nothing was touched."""


class CommandError(GpuCkptError):
    """An external command failed (criu, runc, ...)."""


class DriverError(GpuCkptError):
    """A CUDA driver checkpoint call returned an error."""

    def __init__(self, call, code, name, pid=None, stage=None, hint=None):
        self.call = call
        self.code = code
        self.name = name
        where = " for pid %d" % pid if pid is not None else ""
        super().__init__("%s%s failed: %s (%d)" % (call, where, name, code), stage=stage or call,
                         pid=pid, hint=hint, driver_error=name)


class DriverUnavailable(GpuCkptError):
    """libcuda.so.1 or its checkpoint entry points are missing."""


class ImageError(GpuCkptError):
    """The image directory is missing, incomplete, tampered with or not ours."""


class TransactionError(GpuCkptError):
    """A checkpoint/restore failed part-way; ``rolled_back`` says whether the workload runs on."""
