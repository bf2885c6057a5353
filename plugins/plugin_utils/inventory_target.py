# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller side of a transfer: how the sending host reaches another inventory host over ssh,
derived from that host's inventory variables, as ansible.posix.synchronize derives its destination.

A playbook then names the target (``dest_inventory_host: gpu-node-2``, ``push: {to: gpu-node-2}``)
instead of copying ``ansible_host``, ``ansible_port`` and ``ansible_user`` into every task: a typo
is an error here, before anything is frozen, and an IPv6 ``ansible_host`` needs no care (the
transfer hands ssh the address alone after ``--``, with the port in ``-p``: brackets are what a
``user@[addr]:path`` form needs, and a bracketed inventory value is unwrapped).
"""
from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.module_utils.parsing.convert_bool import boolean

# The inventory variables read, first match wins (the names ansible-core's ssh connection reads).
HOST_VARS = ("ansible_host", "ansible_ssh_host")
PORT_VARS = ("ansible_port", "ansible_ssh_port")
USER_VARS = ("ansible_user", "ansible_ssh_user", "ansible_remote_user")
KEY_VARS = ("ansible_ssh_private_key_file", "ansible_private_key_file")
PYTHON_VARS = ("ansible_python_interpreter",)


def _first(variables, names, default=None):
    for name in names:
        value = variables.get(name)
        if value not in (None, ""):
            return value
    return default


def connection_of(name, variables):
    """Where a transfer from another host reaches inventory host ``name`` whose (templated) variables
    are ``variables``: {host, port, user, ssh_args, python, become}. Refused: a become method other
    than sudo, and a become user other than root (the receiver writes root's image directories)."""
    host = str(_first(variables, HOST_VARS, name))
    try:
        port = int(_first(variables, PORT_VARS, 22))
    except (TypeError, ValueError):
        raise AnsibleActionFail("inventory host %s has ansible_port %r, not a number; nothing was frozen"
                                % (name, _first(variables, PORT_VARS)))
    user = str(_first(variables, USER_VARS, "root"))
    ssh_args = []
    key = _first(variables, KEY_VARS)
    if key:
        # The path is used on the sending host, as synchronize uses it when delegated.
        ssh_args += ["-i", str(key)]
    python = str(_first(variables, PYTHON_VARS, "python3"))
    if python.startswith("auto") or "{" in python:
        python = "python3"  # interpreter discovery is Ansible's; the receiver needs only Python 3
    become = user != "root" and boolean(variables.get("ansible_become", False), strict=False)
    if become:
        method = str(variables.get("ansible_become_method") or "sudo")
        become_user = str(variables.get("ansible_become_user") or "root")
        if method != "sudo" or become_user != "root":
            raise AnsibleActionFail(
                "inventory host %s becomes %s with %s; the image's receiver there runs as root through sudo "
                "only (a passwordless sudo for %s); nothing was frozen" % (name, become_user, method, user))
    return {"host": host, "port": port, "user": user, "ssh_args": ssh_args, "python": python, "become": become}


def inventory_connection(task_vars, templar, name):
    """connection_of() for inventory host ``name``, its variables read through ``task_vars['hostvars']``
    and templated. A name that is not an inventory host is refused."""
    hostvars = task_vars.get("hostvars") or {}
    if not name or name not in hostvars:
        raise AnsibleActionFail("%r is not a host of the inventory; nothing was frozen" % (name,))
    raw = hostvars[name]
    wanted = HOST_VARS + PORT_VARS + USER_VARS + KEY_VARS + PYTHON_VARS + (
        "ansible_become", "ansible_become_method", "ansible_become_user")
    variables = {}
    for key in wanted:
        if key in raw:
            variables[key] = templar.template(raw[key])
    return connection_of(name, variables)


def merge_connection(given, derived, keys):
    """The task's own values win over the inventory's (``keys`` maps the derived names to the task's
    option names); ssh arguments add up, the task's first (for ssh, the first value of an option wins)."""
    out = dict(given)
    for derived_key, option in keys.items():
        if derived_key == "ssh_args":
            out[option] = list(given.get(option) or []) + derived["ssh_args"]
        elif given.get(option) in (None, ""):
            out[option] = derived[derived_key]
    return out
