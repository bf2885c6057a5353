"""CRIU's own zdtm static tests, run through gpuckpt.fleet's modules and through plain CRIU.

The tests come from the CRIU source tarball that tests/setup.sh builds CRIU from (test/zdtm/static).
Each one starts as a daemon (``make <name>.pid``), sets up some kernel state (a zombie, a stopped
task, a pending signal, file locks, sockets, timers...), waits for SIGTERM, then checks that its state
is what it set up and writes PASS or FAIL to <name>.out. zdtm.py (CRIU's own runner) dumps and restores
it in between; this file does the same in two ways:

- ``plain``: ``criu dump --tree <pid>`` and ``criu restore --restore-detached``, with the options the
  test's .desc file gives (what zdtm.py passes);
- ``modules``: gpuckpt.fleet.gpu_checkpoint and gpu_restore, through ansible-playbook, with those
  options too, except the ones the modules must find by themselves (--file-locks, --ext-unix-sk) and
  --tcp-established, which is the modules' tcp_established option.

  python3 tests/zdtm/zdtm_tests.py --src CRIU_SRC --mode plain|modules --out results.jsonl [names...]

The selection: the static tests that were built and run on the host (flavor h), with no hook or
checkskip script, not expected to fail, not needing a CRIU feature this kernel lacks, and whose dump
and restore options are the same (the modules take one list for both). Tests marked "excl" run alone;
every test runs alone here anyway.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
AUTO_FLAGS = ("--file-locks", "--ext-unix-sk")  # found and passed by the modules themselves
# zdtm.py runs the tests that do not need root as another user (ZDTM_UID...). CRIU then reads their
# rlimits with prlimit(), which needs CAP_SYS_RESOURCE for another user's process, and the CI kind of
# machine has none: every test runs as root here, in both modes.
ENV = {"TMPDIR": "/tmp"}


def _makefile_lists(static):
    text = open(os.path.join(static, "Makefile")).read().replace("\\\n", " ")
    names = set()
    for var in ("TST_NOFILE", "TST_FILE", "TST_DIR", "TST_DIR_FILE"):
        for m in re.finditer(r"^%s\s*[+:]?=(.*)$" % var, text, re.M):
            names.update(m.group(1).split())
    return names


def desc(static, name):
    path = os.path.join(static, name + ".desc")
    if not os.path.exists(path):
        return {}
    try:
        return ast.literal_eval(open(path).read().strip() or "{}")
    except (ValueError, SyntaxError):
        return {"unreadable": True}


_FEATURES = {}


def feature_ok(criu, feature):
    if feature not in _FEATURES:
        _FEATURES[feature] = subprocess.run([criu, "check", "--feature", feature], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, check=False).returncode == 0
    return _FEATURES[feature]


def select(src, criu):
    """(selected names, {skipped name: why})."""
    static = os.path.join(src, "test", "zdtm", "static")
    chosen, skipped = [], {}
    for name in sorted(_makefile_lists(static)):
        d = desc(static, name)
        why = None
        if not os.access(os.path.join(static, name), os.X_OK):
            why = "not built here"
        elif d.get("unreadable"):
            why = "unreadable .desc"
        elif any(os.path.exists(os.path.join(static, name + ext)) for ext in (".hook", ".checkskip")):
            why = "needs a hook or checkskip script"
        elif "flavor" in d and "h" not in d["flavor"].split():
            why = "runs only in a namespace flavor (%s)" % d["flavor"]
        elif "crfail" in d.get("flags", "") or "reqrst" in d.get("flags", ""):
            why = "expected to fail or to need a reset"
        elif d.get("arch") and d["arch"] != platform.machine():
            why = "another arch"
        elif any(not feature_ok(criu, f) for f in d.get("feature", "").split()):
            why = "needs CRIU feature %s" % d["feature"]
        elif d.get("dopts") or d.get("ropts"):
            why = "different dump and restore options"
        if why:
            skipped[name] = why
        else:
            chosen.append(name)
    return chosen, skipped


def _make(static, target, timeout=30):
    env = dict(os.environ, **ENV)
    return subprocess.run(["make", "--no-print-directory", "-C", static, target], env=env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, check=False)


def _subreaper():
    """Become the parent of the tests' daemons (and of what CRIU restores), so that they are reaped at
    once: PID 1 of the CI kind of machine takes about a second, and a restore needs the pid free."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap_orphans(keep=()):
    """Reap every zombie child of ours (the tests' daemons and their children, reparented to us) but
    the processes in ``keep`` (a command we wait for ourselves)."""
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in keep:
            continue
        try:
            with open("/proc/%s/stat" % d) as fh:
                rest = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if rest[0] == "Z" and int(rest[1]) == me:
            try:  # WNOHANG: a thread-group leader shows as a zombie while its other threads run
                os.waitpid(int(d), os.WNOHANG)
            except ChildProcessError:
                pass


def _wait_gone(pid, timeout, keep=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap_orphans(keep)
        if not os.path.exists("/proc/%d" % pid):
            return True
        time.sleep(0.01)
    return False


class Reaper(object):
    """Reaps the zombie children of ours, but ``keep``, while a playbook runs."""

    def __init__(self, keep):
        import threading
        self.keep, self.stop = keep, threading.Event()
        self.thread = threading.Thread(target=self.loop)
        self.thread.daemon = True
        self.thread.start()

    def loop(self):
        while not self.stop.wait(0.01):
            _reap_orphans(self.keep)

    def close(self):
        self.stop.set()
        self.thread.join()


def start(static, name):
    _make(static, name + ".cleanout")
    res = _make(static, name + ".pid")
    if res.returncode != 0:
        return None, "start failed: " + res.stdout[-300:]
    with open(os.path.join(static, name + ".pid")) as fh:
        return int(fh.read().split()[0]), None


def kill_leftovers(name):
    """Every process of test ``name`` still there (a helper it forked, a failed restore's remains)."""
    prefix = "./%s --pidfile=" % name
    for d in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % d, "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith(prefix):
            try:
                os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass
    _reap_orphans()


def stop(static, name, pid, timeout):
    """SIGTERM the (restored) test and read its verdict."""
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError as exc:
        return "FAIL (no process %d after restore: %s)" % (pid, exc)
    _wait_gone(pid, timeout)
    try:
        with open(os.path.join(static, name + ".out")) as fh:
            out = fh.read()
    except OSError:
        return "FAIL (no .out)"
    return "PASS" if "PASS" in out.split() else "FAIL (%s)" % " ".join(out.split()[-12:])


def cr_plain(criu, pid, opts, work):
    dump = subprocess.run([criu, "dump", "--tree", str(pid), "-D", work, "-o", "dump.log", "-v4"] + opts,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=60, check=False)
    if dump.returncode != 0:
        return "dump failed: " + _log_errors(os.path.join(work, "dump.log"))
    _wait_gone(pid, 10)
    time.sleep(0.05)
    _reap_orphans()  # the tree's other processes
    rst = subprocess.run([criu, "restore", "-D", work, "-o", "restore.log", "-v4", "--restore-detached",
                          "--pidfile", os.path.join(work, "restore.pid")] + opts,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=60, check=False)
    if rst.returncode != 0:
        return "restore failed: " + _log_errors(os.path.join(work, "restore.log"))
    return None


def _log_errors(path):
    try:
        lines = [ln.strip() for ln in open(path, errors="replace") if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-3:])[:400]


PLAYBOOK = """---
- name: Checkpoint and restore a zdtm test through the modules
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Checkpoint it
      gpuckpt.fleet.gpu_checkpoint:
        pid: "{{ zdtm_pid | int }}"
        image_dir: "{{ zdtm_image }}"
        criu_options: "{{ zdtm_opts }}"
        criu_path: "{{ zdtm_criu }}"
        tcp_established: "{{ zdtm_tcp | bool }}"
      register: ck

    - name: Restore it
      gpuckpt.fleet.gpu_restore:
        image_dir: "{{ zdtm_image }}"
        criu_options: "{{ zdtm_opts }}"
        criu_path: "{{ zdtm_criu }}"
        validate_wait: 0
"""


def cr_modules(criu, pid, opts, work, playbook):
    tcp = "--tcp-established" in opts
    mine = [o for o in opts if o not in AUTO_FLAGS + ("--tcp-established",)]
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.join(REPO, ".build", "collections"),
               ANSIBLE_LOCALHOST_WARNING="false", ANSIBLE_INVENTORY_UNPARSED_WARNING="false", ANSIBLE_NOCOLOR="1",
               ANSIBLE_PIPELINING="true", ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal")
    proc = subprocess.Popen([os.path.join(REPO, ".venv", "bin", "ansible-playbook"), playbook, "-i", "localhost,",
                             "-e", "ansible_connection=local", "-e", "ansible_python_interpreter=" + sys.executable,
                             "-e", json.dumps({"zdtm_pid": pid, "zdtm_image": os.path.join(work, "img"),
                                               "zdtm_opts": mine, "zdtm_criu": criu, "zdtm_tcp": tcp})],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    reaper = Reaper(keep=(proc.pid,))  # the dumped tree must be reaped before its restore needs the pids
    try:
        out, _err = proc.communicate(timeout=180)
    finally:
        reaper.close()
    if proc.returncode != 0:
        msgs = re.findall(r'"msg": "([^"]*)"', out)
        return "modules failed: " + (msgs[-1] if msgs else out[-400:])[:400]
    return None


def run(src, criu, mode, names, out):
    static = os.path.join(src, "test", "zdtm", "static")
    _subreaper()
    playbook = None
    if mode == "modules":
        fd, playbook = tempfile.mkstemp(suffix=".yml")
        os.write(fd, PLAYBOOK.encode())
        os.close(fd)
    results = []
    with open(out, "a") as fh:
        for name in names:
            d = desc(static, name)
            opts = d.get("opts", "").split()
            timeout = int(d.get("timeout") or 30)
            t0 = time.monotonic()
            pid, err = start(static, name)
            verdict = None
            if pid is None:
                verdict = "START FAILED: " + err
            else:
                work = tempfile.mkdtemp(prefix="zdtm-%s-" % name)
                err = cr_plain(criu, pid, opts, work) if mode == "plain" else cr_modules(criu, pid, opts, work, playbook)
                if err:
                    verdict = "FAIL (%s)" % err
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                else:
                    verdict = stop(static, name, pid, timeout)
                subprocess.run(["rm", "-rf", work], check=False)
            kill_leftovers(name)
            _make(static, name + ".cleanout")
            line = {"test": name, "mode": mode, "result": verdict, "seconds": round(time.monotonic() - t0, 2)}
            results.append(line)
            fh.write(json.dumps(line) + "\n")
            fh.flush()
    if playbook:
        os.unlink(playbook)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="the extracted CRIU source tarball, its zdtm tests built")
    ap.add_argument("--criu", default="/usr/local/sbin/criu")
    ap.add_argument("--mode", choices=["plain", "modules", "list"], required=True)
    ap.add_argument("--out", default="/dev/stdout")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    names, skipped = select(a.src, a.criu)
    if a.mode == "list":
        print(json.dumps({"selected": names, "skipped": skipped}, indent=1))
        return 0
    res = run(a.src, a.criu, a.mode, a.names or names, a.out)
    passed = sum(1 for r in res if r["result"] == "PASS")
    print("%s: %d of %d passed" % (a.mode, passed, len(res)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
