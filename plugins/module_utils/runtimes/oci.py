# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the two OCI runtimes driven through their command line share (runc, gVisor's runsc): a container's
``state``, the ``list`` of those that run, and the check that the container asked for runs before anything is
frozen. Each subclass makes ``self.cli`` (runtimes/cli.RuntimeCli) with its state's ``root``."""
from __future__ import annotations

from ..core.errors import InvalidTarget
from .base import ContainerBackend


class OciCliBackend(ContainerBackend):
    """A container of an OCI runtime's command line (``name``: its binary; ``list_format``: its list's flag)."""

    list_format = "--format"
    root = None

    def state(self, container=None, required=True):
        """The runtime's state of ``container`` (this backend's by default): None when there is none and it is not
        ``required``; else InvalidTarget before anything is frozen."""
        container = container or self.container
        where = " under root %s" % self.root if self.root else ""
        return self.cli.describe(["state", container], "%s container %r%s" % (self.name, container, where),
                                 "check the id (%s list) and %s_root" % (self.name, self.name), required)

    def running_containers(self):
        return self.cli.running_containers("list", self.list_format, "json")

    def running_state(self, target):
        """Take container ``target`` as this backend's: its state, refused unless it runs (a paused or stopped one
        would be dumped as it is, or not at all). Nothing is frozen either way."""
        self.container = str(target)
        st = self.state(self.container)
        if st.get("status") != "running":
            raise InvalidTarget("%s container %s is %s, not running; nothing was frozen"
                                % (self.name, self.container, st.get("status")), stage="preflight",
                                hint="resume or start it first")
        self._bundle_seen = st.get("bundle")
        return st
