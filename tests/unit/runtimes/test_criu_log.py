"""CRIU's own words in a runtime's failure (runtimes/criu_log.py): the error and warning lines of the log that Docker,
containerd or Podman names in its error, in each runtime's wording; nothing added where no readable log is named."""
from __future__ import annotations

from ansible_collections.gpuckpt.fleet.plugins.module_utils.runtimes import criu_log

LOG = "(00.01) info only\n(00.02) Error (criu/cr-dump.c:1): a task changed under the dump\n(00.03) Warn (x): hmm\n"


def test_the_log_each_runtime_names_is_read_into_the_error(tmp_path):
    log = tmp_path / "criu-dump.log"
    log.write_text(LOG)
    docker = ("Error response from daemon: Cannot checkpoint container c: runc did not terminate successfully: exit "
              "status 1: criu failed: type NOTIFY errno 0 path= %s: unknown" % log)
    podman = "criu failed: type NOTIFY errno 0\nlog file: %s\n" % log
    for said in (docker, podman):
        out = criu_log.with_named_log(said)
        assert out.startswith(said)
        assert "--- %s ---" % log in out and "a task changed under the dump" in out and "Warn (x): hmm" in out
        assert "info only" not in out
        assert out.count("--- %s ---" % log) == 1


def test_nothing_is_added_where_no_readable_log_is_named(tmp_path):
    assert criu_log.with_named_log("exit status 1") == "exit status 1"
    assert criu_log.with_named_log(None) == ""
    gone = "criu failed: type NOTIFY errno 0 path= %s: unknown" % (tmp_path / "gone.log")
    assert criu_log.with_named_log(gone) == gone
    assert criu_log.error_lines(str(tmp_path / "gone.log")) == ""
