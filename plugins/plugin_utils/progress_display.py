# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of the long modules' progress: run the module, and meanwhile poll the progress
file it writes on the managed host and print a line whenever it changes.

A module cannot print while it runs. Without this, a user watching a 70 GB checkpoint or transfer in
AWX sees one task line for minutes. The module runs as it always does (same connection, become and
environment) in a thread; the poll is a plain `cat` of a world-readable JSON file over the same
connection, without become, so it never touches the become plugin's per-command state.
"""
from __future__ import annotations

import json
import re
import shlex
import threading
import time
import uuid

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.module_utils.common.text.converters import to_text
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# What may reach the remote shell: an async job id as Ansible makes them, and a progress file's path.
JOB_ID_RE = re.compile(r"^j?[0-9]+\.[0-9]+\Z")
PROGRESS_PATH_RE = re.compile(r"^/[A-Za-z0-9._/-]+\Z")
LOST_AFTER = 120  # seconds without any sign of the job's module (no progress file) before it counts as lost
RESULT_GRACE = 15  # seconds for the async wrapper to write the result once its module has exited

STAGE_LABELS = {
    "cuda_lock": "locking the CUDA processes",
    "cuda_checkpoint": "GPU memory to host RAM",
    "runtime_dump": "CRIU dump to disk",
    "checksum": "checksums",
    "manifest": "manifest",
    "wait_pids_free": "waiting for the pids",
    "verify": "verifying checksums",
    "preflight": "preflight",
    "runtime_restore": "CRIU restore",
    "cuda_restore": "host RAM to GPU memory",
    "cuda_unlock": "unlocking",
    "validate": "validating",
}


def _size(n):
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return ("%.0f %s" if unit == "B" else "%.1f %s") % (n, unit)
        n /= 1000.0
    return "%d B" % n


def format_progress(data, now=None):
    """One human line from a progress file's JSON (see module_utils/core/progress.py), or None."""
    now = now or data.get("updated") or time.time()
    if data.get("kind") == "bytes":
        done, total = data.get("bytes_done", 0), data.get("bytes_total", 0)
        elapsed = max(1e-3, now - data.get("started", now))
        rate = done / elapsed
        line = "sent %s of %s" % (_size(done), _size(total))
        if total:
            line += " (%d%%)" % (100 * done // total)
        line += ", %s/s" % _size(rate)
        if rate > 0 and total > done:
            line += ", about %d s left" % ((total - done) / rate)
        return line
    if data.get("kind") == "stages":
        running = data.get("running")
        if not running:
            return None
        line = "%s for %d s" % (STAGE_LABELS.get(running, running), now - data.get("since", now))
        if running == "runtime_dump" and data.get("image_bytes"):
            line += ", %s written" % _size(data["image_bytes"])
        done = data.get("done") or {}
        if done:
            line += " (done: %s)" % ", ".join("%s %.1f s" % (STAGE_LABELS.get(k, k), v) for k, v in done.items())
        return line
    return None


class ProgressActionBase(ActionBase):
    """Runs the task's module; while it runs, prints its progress every ``gpuckpt_progress_interval``
    seconds (a variable; default 5, 0 turns it off)."""

    TRANSFERS_FILES = False
    _supports_check_mode = True
    _supports_async = True

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super(ProgressActionBase, self).run(tmp, task_vars)
        del tmp
        args = dict(self._task.args)
        try:
            interval = float(task_vars.get("gpuckpt_progress_interval", 5))
        except (TypeError, ValueError):
            interval = 5.0
        bad = self._bad_args(args)
        if bad:
            result.update(failed=True, msg=bad)
            return result
        try:
            args = self._derive_args(args, task_vars)
        except AnsibleActionFail as exc:
            result.update(failed=True, msg=to_text(exc.message))
            return result
        if args.get("attach"):
            result.update(self._attach(args["attach"], args.get("progress_file"), interval, task_vars))
            return result
        if self._task.check_mode or self._task.async_val or interval <= 0 or args.get("progress_file"):
            # With async, the module goes to the background (async_wrapper) and the task returns its job id.
            wrap_async = bool(self._task.async_val) and not self._connection.has_native_async
            try:
                result.update(self._execute_module(module_args=args, task_vars=task_vars, wrap_async=wrap_async))
            except AnsibleError as exc:
                if not wrap_async:
                    raise
                # A job that cannot start is a task result, so that failed_when can judge it.
                result.update(failed=True, msg="the job could not start: %s" % to_text(exc))
            if not wrap_async:
                self._remove_tmp_path(self._connection._shell.tmpdir)
            return result
        path = "/tmp/.gpuckpt-progress-%s.json" % uuid.uuid4().hex
        args["progress_file"] = path
        box = {}

        def work():
            try:
                box["result"] = self._execute_module(module_args=args, task_vars=task_vars)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                box["error"] = exc

        worker = threading.Thread(target=work, name="gpuckpt-module")
        worker.daemon = True
        worker.start()
        who = self._who(task_vars)
        last = None
        while True:
            worker.join(interval)
            if not worker.is_alive():
                break
            line = self._poll(path)
            if line and line != last:
                display.display("  [%s] %s: %s" % (who, self._task.get_name().split(":")[0], line))
                last = line
        if "error" in box:
            raise box["error"]
        result.update(box["result"])
        return result

    def _derive_args(self, args, task_vars):
        """The module's arguments, completed on the controller (from the inventory, say); as given here."""
        return args

    @staticmethod
    def _bad_args(args):
        """Arguments that would reach a shell on the managed host are checked first."""
        if args.get("attach") is not None and not JOB_ID_RE.match(str(args["attach"])):
            return "attach must be an async job id (ansible_job_id), got %r" % (args["attach"],)
        path = args.get("progress_file")
        if path is not None and (not PROGRESS_PATH_RE.match(str(path)) or "/../" in str(path) + "/"):
            return "progress_file must be an absolute path of letters, digits, '.', '_', '-' and '/', got %r" % (path,)
        return None

    def _who(self, task_vars):
        host = task_vars.get("inventory_hostname", "?")
        delegated = self._task.delegate_to or ""
        return "%s -> %s" % (host, delegated) if delegated and delegated != host else host

    def _attach(self, jid, progress_path, interval, task_vars):
        """Wait for the job ``jid`` of this module, started earlier with async, and return its result;
        meanwhile print its progress file's lines. Reads the job's result file (what async_status
        reads) with a plain ``cat`` through the task's become, as the job ran: the result is there the
        moment the module ends, and no retry loop fills the output.

        A job killed as a whole (the OOM killer, a reboot) never writes its result: the module's pid and
        start time, which its progress file carries, tell that it is gone, and the task fails with
        ``job_lost`` instead of waiting for ever."""
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        job_file = self._connection._shell.join_path(async_dir, jid)
        quoted = shlex.quote(job_file)
        who, label = self._who(task_vars), self._task.get_name().split(":")[0]
        last, next_poll, pause = None, time.monotonic() + (interval if interval > 0 else float("inf")), 0.1
        started, next_check, owner = time.monotonic(), time.monotonic() + 2, None
        while True:
            data = self._job_result(quoted)
            if data == "missing":
                return {"failed": True, "msg": "no job %s on this host (its result file %s is gone)" % (jid, job_file)}
            if data is not None and "started" not in data:  # the module's own result: the job has ended
                self._low_level_execute_command("rm -f %s" % quoted)
                return {k: v for k, v in data.items() if not k.startswith("_ansible")}
            if progress_path and time.monotonic() >= next_poll:
                line = self._poll(progress_path)
                if line and line != last:
                    display.display("  [%s] %s: %s" % (who, label, line))
                    last = line
                next_poll = time.monotonic() + interval
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 2
                owner = self._progress_owner(progress_path) or owner
                if self._job_gone(owner, started):
                    if self._late_result(quoted) is not None:
                        continue  # read again above, and returned
                    return {"failed": True, "job_lost": True,
                            "msg": "the job %s of this module ended without a result (killed as a whole: the OOM "
                                   "killer, a reboot?)%s" % (jid, " (its module was pid %s)" % owner[0] if owner else "")}
            time.sleep(pause)
            pause = min(1.0, pause * 1.2)  # quick at first (a restore's end is the migration's commit)

    def _late_result(self, quoted_job_file):
        """The async wrapper writes the result a moment after its module exits: the job's result when it
        comes within RESULT_GRACE seconds, else None."""
        deadline = time.monotonic() + RESULT_GRACE
        while time.monotonic() < deadline:
            data = self._job_result(quoted_job_file)
            if data is not None and data != "missing" and "started" not in data:
                return data
            time.sleep(0.5)
        return None

    def _job_result(self, quoted_job_file):
        res = self._low_level_execute_command("cat %s 2>/dev/null || echo MISSING" % quoted_job_file)
        text = to_text(res.get("stdout", "")).strip()
        if text.endswith("MISSING") and "{" not in text:
            return "missing"
        if "{" in text:
            try:
                return json.loads(text[text.index("{"):])
            except ValueError:
                return None  # being written
        return None

    def _progress_owner(self, path):
        """(pid, starttime) of the module writing the progress file ``path``, or None."""
        if not path:
            return None
        try:
            res = self._low_level_execute_command("cat %s 2>/dev/null || true" % shlex.quote(path), sudoable=False)
            data = json.loads(to_text(res.get("stdout", "")).strip() or "{}")
            return (int(data["pid"]), data.get("starttime")) if data.get("pid") else None
        except (ValueError, KeyError, TypeError):
            return None

    def _job_gone(self, owner, started):
        if owner is None:
            return time.monotonic() - started > LOST_AFTER
        res = self._low_level_execute_command("cat /proc/%d/stat 2>/dev/null || true" % owner[0])
        text = to_text(res.get("stdout", "")).strip()
        if not text:
            return True
        try:
            rest = text[text.rindex(")") + 2:].split()
            return rest[0] in ("Z", "X") or (owner[1] is not None and int(rest[19]) != owner[1])
        except (ValueError, IndexError):
            return False

    def _poll(self, path):
        try:
            res = self._low_level_execute_command("cat %s 2>/dev/null || true" % shlex.quote(path), sudoable=False)
            text = to_text(res.get("stdout", "")).strip()
            return format_progress(json.loads(text)) if text else None
        except Exception:  # noqa: BLE001 - a missed progress line never fails the task
            return None
