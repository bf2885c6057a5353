# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A host's runtime options for the gpuckpt.fleet.gpu action group, read once from its inventory
variables: a playbook hands them to every module acting on that host through ``module_defaults``
instead of relaying each option, task by task."""
from __future__ import annotations

DOCUMENTATION = r"""
name: runtime_options
short_description: A host's gpuckpt_* inventory variables as options of the gpuckpt.fleet.gpu action group
version_added: "0.2.0"
description:
  - Maps the inventory variables C(gpuckpt_runc_path), C(gpuckpt_runc_root), C(gpuckpt_podman_path), C(gpuckpt_podman_root),
    C(gpuckpt_podman_runroot), C(gpuckpt_docker_path), C(gpuckpt_docker_host), C(gpuckpt_containerd_address),
    C(gpuckpt_containerd_namespace), C(gpuckpt_runsc_path), C(gpuckpt_runsc_root), C(gpuckpt_runsc_flags),
    C(gpuckpt_sandbox_cuda_checkpoint), C(gpuckpt_runsc_cuda_stage) and C(gpuckpt_libcuda_path) to the options of the modules of the
    C(gpuckpt.fleet.gpu) group. Variables the host does not set are left out, so each module keeps its default.
  - For C(module_defaults), in a play that acts on several hosts from one task list (see C(gpuckpt.fleet.migrate)).
options:
  _input:
    description: The host's variables, C(hostvars[host]).
    type: dict
    required: true
  overrides:
    description: Options that win over the host's (an extra variable that applies to both hosts, say).
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Checkpoint on the source with its runtime options from the inventory
  gpuckpt.fleet.gpu_checkpoint:
    container: train-7
    runtime: runc
    image_dir: /var/lib/gpuckpt/images/m-1
  module_defaults:
    group/gpuckpt.fleet.gpu: "{{ hostvars[source] | gpuckpt.fleet.runtime_options }}"
"""

RETURN = r"""
_value:
  description: 'The module options, for example C({"runc_root": "/run/runc", "containerd_namespace": "k8s.io"}).'
  type: dict
"""

# module option: the inventory variable that sets it
OPTION_VARS = (
    ("runc_path", "gpuckpt_runc_path"),
    ("runc_root", "gpuckpt_runc_root"),
    ("podman_path", "gpuckpt_podman_path"),
    ("podman_root", "gpuckpt_podman_root"),
    ("podman_runroot", "gpuckpt_podman_runroot"),
    ("docker_path", "gpuckpt_docker_path"),
    ("docker_host", "gpuckpt_docker_host"),
    ("containerd_address", "gpuckpt_containerd_address"),
    ("containerd_namespace", "gpuckpt_containerd_namespace"),
    ("runsc_path", "gpuckpt_runsc_path"),
    ("runsc_root", "gpuckpt_runsc_root"),
    ("runsc_flags", "gpuckpt_runsc_flags"),
    ("cuda_checkpoint_path", "gpuckpt_sandbox_cuda_checkpoint"),
    ("runsc_cuda_stage", "gpuckpt_runsc_cuda_stage"),
    ("libcuda_path", "gpuckpt_libcuda_path"),
)


def runtime_options(host_vars, overrides=None):
    out = {}
    for option, var in OPTION_VARS:
        if var in host_vars and host_vars[var] is not None:
            out[option] = host_vars[var]
    out.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return out


class FilterModule(object):
    def filters(self):
        return {"runtime_options": runtime_options}
