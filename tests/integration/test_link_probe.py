"""gpu_image_sync's probe_mib between the two loopback sshd hosts (127.0.0.2, 127.0.0.3): the link measured
with the transfer a migration uses (real ssh, the receiver on the other host), what a drain's deadline
estimates a move from when no earlier move measured it. Nothing is left on either host, also when the
link breaks during the probe."""
from __future__ import annotations

import os

from helpers import bad_link_python

PROBE = """
- name: Probe the link from hosta to hostb
  hosts: hosta
  gather_facts: false
  tasks:
    - name: Probe hostb
      gpuckpt.fleet.gpu_image_sync:
        probe_mib: "{{ probe_mib }}"
        src: "{{ gpuckpt_image_root }}/.gpuckpt-probe-{{ probe_name }}"
        dest_inventory_host: hostb
        dest: "{{ hostvars['hostb'].gpuckpt_image_root }}/.gpuckpt-probe-{{ probe_name }}"
        ssh_args: "{{ gpuckpt_transfer_ssh_args }}"
        python: "{{ probe_python | default(omit) }}"
        streams: 2
        retries: "{{ probe_retries | default(3) }}"
      register: gpuckpt_probe
"""


def _probe(playbook, hosts, tmp_path, check=False, **extra):
    path = tmp_path / "probe.yml"
    path.write_text(PROBE)
    return playbook(str(path), dict({"probe_mib": 128, "probe_name": "t"}, **extra), check=check,
                    inventory=hosts.path("inventory.yml"))


def _leftovers(hosts):
    found = []
    for name in ("hosta", "hostb"):
        root = hosts.host_dir(name, "images")
        found += [os.path.join(root, e) for e in (os.listdir(root) if os.path.isdir(root) else ())
                  if e.startswith(".gpuckpt-probe-")]
    return found


def test_a_probe_measures_the_link_and_leaves_nothing(playbook, hosts, tmp_path):
    run = _probe(playbook, hosts, tmp_path)
    assert run.rc == 0, run.stdout
    res = run.task("Probe hostb")
    probe = res["probe"]
    assert probe["bytes"] > 128 * 2**20 and probe["seconds"] > 0 and probe["streams"] == 2, probe
    assert probe["bytes_s"] == int(round(probe["bytes"] / probe["data_seconds"])) and probe["attempts"] == 1
    assert 0 < probe["data_seconds"] <= probe["seconds"], probe
    assert res["changed"] is False and "MB/s" in res["msg"]
    assert _leftovers(hosts) == []
    checked = _probe(playbook, hosts, tmp_path, check=True)
    assert checked.rc == 0, checked.stdout
    assert checked.task("Probe hostb")["probe"] is None and _leftovers(hosts) == []


def test_a_probe_whose_link_breaks_fails_and_leaves_nothing(playbook, hosts, tmp_path):
    cut = bad_link_python(tmp_path / "cut-python", "cut", 40 * 2**20, tmp_path / "cut")
    run = _probe(playbook, hosts, tmp_path, probe_python=cut, probe_retries=0, probe_name="cut")
    assert (tmp_path / "cut").exists(), "the link was never cut"
    assert run.rc != 0
    res = run.task("Probe hostb")
    assert res["_status"] == "failed" and "failed after 1 attempt" in res["msg"], res
    assert "could not remove" not in res["msg"], res["msg"]
    assert _leftovers(hosts) == []
