"""CRIU's own words in a runtime's failure. A runtime that runs CRIU for us (Docker, Podman, containerd) reports only
that it failed ("criu failed: type NOTIFY errno 0"), and names the log where CRIU said why: its error and warning lines
go into the error we give, read at once, as the runtime may remove the log with its failed attempt."""
from __future__ import annotations

import re

LINES = 15
# How the runtimes name the log: Podman "log file: <path>", runc under Docker and containerd "path= <path>: unknown".
_NAMED = re.compile(r"(?:log file:|path=)\s*(/\S+?\.log)\b")


def error_lines(path):
    """``path``'s last error and warning lines under a heading, or "" where it cannot be read."""
    try:
        with open(path, errors="replace") as fh:
            lines = [ln for ln in fh if "Error" in ln or "Warn" in ln][-LINES:]
    except OSError:
        return ""
    return "--- %s ---\n%s" % (path, "".join(lines))


def with_named_log(stderr):
    """``stderr`` with the error lines of each CRIU log it names appended."""
    text = stderr or ""
    extra = [e for e in (error_lines(path) for path in dict.fromkeys(_NAMED.findall(text))) if e]
    if not extra:
        return text
    return "".join([text if text.endswith("\n") else text + "\n"] + extra)
