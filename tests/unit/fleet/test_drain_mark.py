"""fleet/drain_mark.py: the drain mark written where it is read (gpu_drain_mark)."""
from __future__ import annotations

import json
import os
import stat

from ansible_collections.gpuckpt.fleet.plugins.module_utils.fleet import drain_mark


def test_the_first_mark_keeps_an_earlier_drains_start_moves_and_node(tmp_path):
    before = {"started": "2025-01-01T00:00:00Z", "drain_id": "d-0", "pending": [{"migration_id": "m-1"}],
              "k8s_node": "n1", "empty": True}
    mark = drain_mark.marked(before, "d-1", keep_all=True)
    assert mark == dict(before, drain_id="d-1", empty=False)


def test_a_new_mark_starts_now_and_names_the_moves():
    mark = drain_mark.marked({}, "d-1", pending=[{"migration_id": "m-2"}], k8s_node="n2")
    assert mark["drain_id"] == "d-1" and mark["pending"] == [{"migration_id": "m-2"}] and mark["k8s_node"] == "n2"
    assert mark["started"].endswith("Z") and mark["empty"] is False
    assert "k8s_node" not in drain_mark.marked({"other": 1}, "d-1") and "other" not in drain_mark.marked({"other": 1}, "d")


def test_written_whole_in_a_private_directory_read_back_and_taken_away(tmp_path):
    jdir = str(tmp_path / "journal" / "sub")
    drain_mark.write(jdir, {"started": "s", "drain_id": "d", "empty": False, "pending": []}, throughput={"b": 5.0})
    assert stat.S_IMODE(os.stat(jdir).st_mode) == 0o700
    assert drain_mark.read(jdir)["drain_id"] == "d"
    with open(os.path.join(jdir, "throughput.json")) as fh:
        assert json.load(fh) == {"b": 5.0}
    assert stat.S_IMODE(os.stat(drain_mark.path(jdir)).st_mode) == 0o600
    assert drain_mark.remove(jdir) is True and drain_mark.read(jdir) is None and drain_mark.remove(jdir) is False
