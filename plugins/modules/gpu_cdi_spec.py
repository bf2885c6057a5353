#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_cdi_spec
short_description: Write a CDI spec for the node's NVIDIA GPUs from the driver's own files, without NVIDIA's toolkit
version_added: "0.5.0"
description:
  - Writes the Container Device Interface spec that C(nvidia-ctk cdi generate) would write, for a node where NVIDIA's
    container toolkit is not installed, so that Docker 25+ (C(docker run --device nvidia.com/gpu=all)) and Podman 4+
    (C(podman run --device nvidia.com/gpu=0)) give a container its GPUs.
  - The GPUs are read from the driver's C(/proc/driver/nvidia/gpus/*/information) and named by index (the driver's bus
    order, as nvidia-smi numbers them), by UUID, and C(all). Every request also gets the driver's control nodes this
    host has (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset), the driver's user-space libraries of the loaded
    driver's version (found with C(ldconfig -p)) mounted read-only under their file name and their soname, nvidia-smi
    and the driver's other tools, and the persistence daemon's socket.
  - No hook is written (nvidia-ctk's C(update-ldcache) hook needs nvidia-ctk). The libraries are found by the image's
    loader where O(lib_dir) is a directory it searches (see docs/cdi.md).
  - The file is replaced atomically, mode 0644, and only when its content differs, so that a run after a driver upgrade
    reports changed and any other run does not.
author: gpuckpt.fleet maintainers (@gpuckpt)
options:
  state:
    description: V(present) writes the spec; V(absent) removes the file at O(path).
    type: str
    choices: [present, absent]
    default: present
  path:
    description: The spec's file. Docker and Podman read C(/etc/cdi) and C(/var/run/cdi).
    type: path
    default: /etc/cdi/nvidia.yaml
  kind:
    description: The spec's kind, the part of a device's name before C(=).
    type: str
    default: nvidia.com/gpu
  lib_dir:
    description:
      - The directory in the container where the libraries are mounted. Each library's own directory on the host when
        not given (as nvidia-ctk does).
      - V(/usr/local/nvidia/lib64) suits the CUDA images, whose C(LD_LIBRARY_PATH) names it.
    type: path
  dev_dir:
    description:
      - Where this host's device nodes are. When it is not C(/dev), each node of the spec gets a C(hostPath) there (the
        container still sees it under C(/dev)); for tests with stand-in nodes.
    type: path
    default: /dev
  driver_proc_dir:
    description: The driver's directory in /proc. C($GPUCKPT_NVIDIA_PROC) or C(/proc/driver/nvidia) when not given.
    type: path
  ldconfig_path:
    description: The ldconfig that lists the host's libraries (C(ldconfig -p)). C(/sbin/ldconfig) when not given.
    type: path
  allow_no_gpus:
    description: Write a spec without devices when the driver lists no GPU, instead of failing.
    type: bool
    default: false
notes:
  - 'Nothing but the spec''s file is changed, and nothing is restarted: Docker and Podman read the spec when a container
    is created. Docker 25 to 28.1 read CDI specs only with C({"features": {"cdi": true}}) in daemon.json (the
    C(gpuckpt.fleet.nvidia_container_runtime) role adds it).'
attributes:
  check_mode:
    support: full
    details: It reads the host and the spec's file and reports whether it would write the file, without writing it.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpuckpt.fleet.common.attributes
  - gpuckpt.fleet.common.actiongroup_gpu
"""

EXAMPLES = r"""
- name: Write the CDI spec for this node's GPUs (NVIDIA's toolkit is not installed)
  gpuckpt.fleet.gpu_cdi_spec:
    path: /etc/cdi/nvidia.yaml
  register: cdi

- name: Mount the libraries where the CUDA images look for them
  gpuckpt.fleet.gpu_cdi_spec:
    lib_dir: /usr/local/nvidia/lib64

- name: Remove it
  gpuckpt.fleet.gpu_cdi_spec:
    state: absent
"""

RETURN = r"""
devices:
  description: The names a container asks for, with C(--device).
  returned: when state is present
  type: list
  elements: str
  sample: ["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-8f6c0c2a-3b1e-4e52-9d1a-6a1d2b3c4d5e", "nvidia.com/gpu=all"]
driver_version:
  description: The loaded driver's version, whose libraries the spec mounts; null when the driver does not say.
  returned: when state is present
  type: str
  sample: 550.54.15
libraries:
  description: The libraries the spec mounts, each by its soname and host file.
  returned: when state is present
  type: list
  elements: dict
  sample: [{"soname": "libcuda.so.1", "path": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"}]
path:
  description: The spec's file.
  returned: always
  type: str
  sample: /etc/cdi/nvidia.yaml
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.errors import GpuCkptError
from ansible_collections.gpuckpt.fleet.plugins.module_utils.core.fsutil import atomic_write
from ansible_collections.gpuckpt.fleet.plugins.module_utils.cuda import cdi
from ansible_collections.gpuckpt.fleet.plugins.module_utils.module_common import RUNTIME_ARGS, check_path_arg

SPEC_MODE = 0o644


def _current(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _absent(module, path):
    exists = os.path.lexists(path)
    if exists and not module.check_mode:
        os.unlink(path)
    module.exit_json(changed=exists, path=path, msg=("removed %s" % path) if exists else "%s is absent" % path)


def _present(module, p):
    listing = cdi.gather(proc_dir=p["driver_proc_dir"], dev_dir=p["dev_dir"], ldconfig=p["ldconfig_path"])
    if not listing["gpus"] and not p["allow_no_gpus"]:
        module.fail_json(msg="the NVIDIA driver lists no GPU in %s/gpus; no CDI spec was written"
                             % (p["driver_proc_dir"] or "/proc/driver/nvidia"), stage="preflight",
                         hint="load the driver (nvidia.ko), or set allow_no_gpus")
    spec = cdi.build_spec(listing, kind=p["kind"], dev_dir=p["dev_dir"], lib_dir=p["lib_dir"])
    content = cdi.render(spec, header=[
        "Written by gpuckpt.fleet.gpu_cdi_spec from the NVIDIA driver's files (driver %s); rewritten when they change."
        % (listing["driver_version"] or "unknown")]).encode("utf-8")
    path = p["path"]
    changed = _current(path) != content
    if changed and not module.check_mode:
        os.makedirs(os.path.dirname(path) or ".", 0o755, exist_ok=True)
        atomic_write(path, content, mode=SPEC_MODE)
        os.chmod(path, SPEC_MODE)  # past the umask: Podman run by a user reads it too
    for name in listing["missing_gpu_nodes"]:
        module.warn("%s/%s is missing: a container given that GPU fails to start until the node exists "
                    "(nvidia-modprobe -c <minor>, or any CUDA program on the host, makes it)" % (p["dev_dir"], name))
    module.exit_json(changed=changed, path=path, devices=cdi.device_names(spec),
                     driver_version=listing["driver_version"], libraries=listing["libraries"],
                     msg="%s %s" % ("wrote" if changed else "kept", path))


def main():
    module = AnsibleModule(argument_spec=dict(
        state=dict(type="str", choices=["present", "absent"], default="present"),
        path=dict(type="path", default="/etc/cdi/nvidia.yaml"),
        kind=dict(type="str", default=cdi.KIND),
        lib_dir=dict(type="path"),
        dev_dir=dict(type="path", default="/dev"),
        driver_proc_dir=dict(type="path"),
        ldconfig_path=dict(type="path"),
        allow_no_gpus=dict(type="bool", default=False),
        # the options of the action group gpu (module_defaults), which this module has no use for
        libcuda_path=dict(type="path"),
        **RUNTIME_ARGS
    ), supports_check_mode=True)
    p = module.params
    check_path_arg(module, "path", p["path"])
    try:
        if p["state"] == "absent":
            _absent(module, p["path"])
        _present(module, p)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    except OSError as exc:
        module.fail_json(msg="could not write the CDI spec %s: %s" % (p["path"], exc))


if __name__ == "__main__":
    main()
