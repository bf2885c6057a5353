# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The listening ports a CRIU restore binds again, and the TIME_WAIT sockets that can keep them taken.

A tree that listens on a TCP port (torchrun's rendezvous store, a TCPStore that rank 0 hosts) and closed
connections on it from its own side leaves TIME_WAIT sockets with that local port for the kernel's TIME_WAIT
length (60 s). Restored in the same network namespace within that time (in place right after the checkpoint, or
on another "host" of the same kernel, or the rollback onto the source), CRIU cannot bind the listening socket
again ("Address already in use") and the restore fails. CRIU binds with SO_REUSEADDR, which the
kernel lets pass a TIME_WAIT socket only when the socket it came from had SO_REUSEADDR too (PyTorch's TCPStore
sets it; a listener that did not, as tests/workloads/nccl_ranks.py's, blocks the bind). So the checkpoint records
the ports the tree listens on as it is dumped (where the plan, ``tree_plan.criu_needs``' ``tcp_listen``, found the
tree sharing the checkpointer's network namespace and listening; kept in the manifest's ``target.tcp_listen_ports``),
and the restore first
waits, bounded by that length plus a margin, while a TIME_WAIT socket of the restoring namespace holds one of them
against a bind as CRIU's (SO_REUSEADDR, on that socket's address); the result says so.
"""
from __future__ import annotations

import errno
import socket
import time

from ..core import sockets

TIME_WAIT_S = 60.0  # the kernel's TCP_TIMEWAIT_LEN
MARGIN_S = 5.0


def recorded(backend):
    """The listening ports the runtime's plan of the tree found (``plan_tree``, before anything was asked or
    frozen); [] where the tree has its own network namespace or the runtime plans none."""
    return list((backend.criu_needs or {}).get("tcp_listen") or [])


def at_dump(backend, pids):
    """The ports the tree ``pids`` listens on as it is dumped, for the manifest and the rollback: read again after
    the quiesce, just before the dump, where the plan read them (``recorded``). A cooperative job releases its
    communicators in between: their listeners are gone, and CRIU will not bind their ports again, but the TIME_WAIT
    sockets of their closed connections made every restore wait out the kernel's TIME_WAIT length for nothing
    (57 s of a drain's 64 s downtime on 2 x H100, 2026-11-27). [] where the plan found none to bind again (a tree
    in a network namespace of its own, a runtime whose restore binds nothing in the restorer's namespace)."""
    if not recorded(backend):
        return []
    return sockets.tcp_listen_ports(pids)


def listen_ports(manifest):
    """The ports the image's tree listened on, as its manifest recorded them."""
    return sorted({int(p) for p in ((manifest or {}).get("target") or {}).get("tcp_listen_ports") or []})


def bind_refused(family, address, port):
    """Whether a bind as CRIU's restore makes (SO_REUSEADDR) to ``address``:``port`` is refused as in use."""
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return False
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((address, port))
        return False
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    finally:
        probe.close()


def wait_time_wait_gone(ports, timeout=TIME_WAIT_S + MARGIN_S, read=None, refused=None, poll=0.2,
                        clock=time.monotonic, sleep=time.sleep):
    """Wait (at most ``timeout`` s) while a TIME_WAIT socket that ``read()`` lists ([(family, address, port)]; by
    default this process's network namespace, sockets.tcp_time_wait) has one of ``ports`` as its local port and
    keeps a bind there ``refused`` (by default bind_refused). Returns None when nothing held them, else a report: the ports held, those
    still held when it gave up, the seconds waited, whether they cleared, and a sentence for the log."""
    wanted = set(int(p) for p in ports or [])
    if not wanted:
        return None
    read, refused = read or sockets.tcp_time_wait, refused or bind_refused

    def held():
        return sorted({port for family, address, port in read() or [] if port in wanted
                       and refused(family, address, port)})

    started = clock()
    first = held()
    if not first:
        return None
    left = first
    while left and clock() - started < timeout:
        sleep(poll)
        left = held()
    waited = round(clock() - started, 3)
    what = "TCP port%s %s" % ("s" if len(first) > 1 else "", ", ".join(map(str, first)))
    if left:
        msg = ("%s, which the image's tree listened on, still had TIME_WAIT sockets in this network namespace that "
               "refuse its bind after %.1f s (the kernel's TIME_WAIT length is %d s): the restore may fail with "
               "\"Address already in use\"" % (what, waited, TIME_WAIT_S))
    else:
        msg = ("waited %.1f s for the TIME_WAIT sockets on %s, which the image's tree listened on, to clear before "
               "the restore bound %s again" % (waited, what, "them" if len(first) > 1 else "it"))
    return {"ports": first, "left": left, "waited_s": waited, "cleared": not left, "msg": msg}
