"""The transfer's connection derived from the inventory (plugin_utils/inventory_target.py), read from a
real inventory through ansible-core's own InventoryManager, VariableManager and Templar, down to the
ssh argv the transfer runs."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleActionFail
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from ansible.vars.hostvars import HostVars
from ansible.vars.manager import VariableManager

from ansible_collections.gpuckpt.fleet.plugins.module_utils.transfer import targets
from ansible_collections.gpuckpt.fleet.plugins.plugin_utils.inventory_target import (
    connection_of, inventory_connection, merge_connection)

INVENTORY = """
all:
  vars:
    node_net: fd00:10
  hosts:
    src: {}
    v6:
      ansible_host: "{{ node_net }}::12"
      ansible_port: 2222
      ansible_user: ckpt
      ansible_become: true
      ansible_ssh_private_key_file: /etc/gpuckpt/migrate_key
      ansible_python_interpreter: /usr/bin/python3.11
    bracketed:
      ansible_host: "[fd00::13]"
    plain: {}
    su_host:
      ansible_user: ckpt
      ansible_become: true
      ansible_become_method: su
"""


@pytest.fixture
def task_vars(tmp_path):
    path = tmp_path / "inventory.yml"
    path.write_text(INVENTORY)
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(path)])
    manager = VariableManager(loader=loader, inventory=inventory)
    manager._hostvars = HostVars(inventory=inventory, variable_manager=manager, loader=loader)  # as a play run sets it
    variables = manager.get_vars(host=inventory.get_host("src"))
    return variables, Templar(loader=loader, variables=variables)


def test_an_ipv6_target_reaches_ssh_with_its_port_user_key_python_and_sudo(task_vars):
    variables, templar = task_vars
    c = inventory_connection(variables, templar, "v6")
    assert c == {"host": "fd00:10::12", "port": 2222, "user": "ckpt", "ssh_args": ["-i", "/etc/gpuckpt/migrate_key"],
                 "python": "/usr/bin/python3.11", "become": True}
    target = targets.Target(c["host"], c["user"], c["port"], c["ssh_args"], c["python"], become=c["become"])
    argv = target.ssh()
    # ssh takes the address alone after "--" and the port in -p: no brackets, no user@host:path form
    assert argv[-2:] == ["--", "fd00:10::12"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ckpt"
    assert argv[1:3] == ["-i", "/etc/gpuckpt/migrate_key"]
    assert target.remote_command("/usr/bin/python3.11", "-c", "x").startswith("exec sudo -n -- /usr/bin/python3.11 -c ")


def test_a_bracketed_address_is_unwrapped_and_defaults_are_ssh_s(task_vars):
    variables, templar = task_vars
    c = inventory_connection(variables, templar, "bracketed")
    assert c["host"] == "[fd00::13]" and c["port"] == 22 and c["user"] == "root" and c["become"] is False
    assert targets.Target(c["host"]).ssh()[-1] == "fd00::13"
    assert inventory_connection(variables, templar, "plain")["host"] == "plain"  # no ansible_host: its name


def test_a_name_outside_the_inventory_and_a_become_other_than_sudo_are_refused(task_vars):
    variables, templar = task_vars
    with pytest.raises(AnsibleActionFail, match="not a host of the inventory"):
        inventory_connection(variables, templar, "src-typo")
    with pytest.raises(AnsibleActionFail, match="sudo only"):
        inventory_connection(variables, templar, "su_host")
    with pytest.raises(AnsibleActionFail, match="not a number"):
        connection_of("x", {"ansible_port": "ssh"})


def test_the_task_s_values_win_and_ssh_arguments_add_up():
    derived = connection_of("n", {"ansible_host": "10.0.0.2", "ansible_port": 2200, "ansible_ssh_private_key_file": "/k"})
    keys = {"host": "dest_host", "port": "dest_port", "user": "dest_user", "ssh_args": "ssh_args", "python": "python",
            "become": "dest_become"}
    out = merge_connection({"dest_port": 22, "ssh_args": ["-F", "/cfg"], "dest_become": False}, derived, keys)
    assert out["dest_host"] == "10.0.0.2" and out["dest_port"] == 22 and out["dest_user"] == "root"
    assert out["ssh_args"] == ["-F", "/cfg", "-i", "/k"] and out["dest_become"] is False
    # "auto" interpreter discovery is Ansible's: the receiver gets python3
    assert connection_of("n", {"ansible_python_interpreter": "auto_silent"})["python"] == "python3"
