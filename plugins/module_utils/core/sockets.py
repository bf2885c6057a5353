# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The sockets a process tree holds, read from /proc: their inodes (/proc/<pid>/fd), the addresses they
hold bound, the TCP connections and listening ports of the tree's network namespace (/proc/<pid>/net/tcp,
tcp6, udp, unix), TIME_WAIT sockets, and this namespace's unix sockets with their peers (NETLINK_SOCK_DIAG).
The rest of /proc is read in core/procfs.py. Standard library only."""
from __future__ import annotations

import os
import socket
import struct

from . import procfs


def socket_inodes(pids):
    """The inodes (as strings) of the sockets that ``pids`` hold open."""
    return {link[8:-1] for pid in pids for _path, link in procfs.fd_links(pid) if link.startswith("socket:[")}


def _hex_port(addr):
    return int(addr.rsplit(":", 1)[1], 16)


def bound_sockets(pids):
    """The addresses that the processes ``pids`` hold bound in their network namespace: listening
    TCP ports, bound UDP ports and abstract unix socket names (e.g. "tcp port 8000", "unix @x").
    A second copy of the workload restored in the SAME network namespace (one kernel seen as two
    hosts, host networking) cannot bind them again while the first copy is held stopped."""
    pids = [int(p) for p in pids or []]
    inodes = socket_inodes(pids)
    if not inodes:
        return []
    out = set()
    net = "/proc/%d/net/" % pids[0]  # the workload's own view of its network namespace
    for name, listen_only in (("tcp", True), ("tcp6", True), ("udp", False), ("udp6", False)):
        try:
            with open(net + name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[9] in inodes and (f[3] == "0A" if listen_only else _hex_port(f[1]) != 0):
                        out.add("%s port %d" % (name.rstrip("6"), _hex_port(f[1])))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    try:
        with open(net + "unix") as fh:
            next(fh)
            for line in fh:
                f = line.split()
                if len(f) > 7 and f[6] in inodes and f[7].startswith("@"):
                    out.add("unix %s" % f[7])
    except (OSError, StopIteration):
        pass
    return sorted(out)


def socket_owner(inode):
    """(pid, comm) of a process holding socket ``inode``, or None."""
    for pid in procfs.all_pids():
        if str(inode) in socket_inodes([pid]):
            return pid, (procfs.read_stat(pid) or {}).get("comm")
    return None


def unix_sockets():
    """{inode: {"type", "peer", "name"}} of this network namespace's unix sockets, through
    NETLINK_SOCK_DIAG (the only place the kernel tells a socket's peer). {} when it cannot be asked."""
    NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
    UDIAG_SHOW_NAME, UDIAG_SHOW_PEER = 0x1, 0x4
    UNIX_DIAG_NAME, UNIX_DIAG_PEER = 0, 2
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except OSError:
        return {}
    out = {}
    try:
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xffffffff, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_PEER, 0, 0)
        s.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, 0x1 | 0x300, 1, 0) + req)
        done = False
        while not done:
            data = s.recv(1 << 16)
            if not data:
                break
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    done = True
                    break
                if kind in (2, 3):  # NLMSG_ERROR, NLMSG_DONE
                    done = True
                    break
                fam, typ, state, _pad, ino = struct.unpack_from("=BBBBI", data, off + 16)
                entry = {"type": {1: "stream", 2: "dgram", 5: "seqpacket"}.get(typ, str(typ)), "peer": 0, "name": None}
                a = off + 16 + 16
                while a + 4 <= off + length:
                    alen, atype = struct.unpack_from("=HH", data, a)
                    if alen < 4:
                        break
                    payload = data[a + 4:a + alen]
                    if atype == UNIX_DIAG_PEER and len(payload) >= 4:
                        entry["peer"] = struct.unpack_from("=I", payload)[0]
                    elif atype == UNIX_DIAG_NAME:
                        entry["name"] = ("@" + payload[1:].decode("utf-8", "replace") if payload[:1] == b"\0"
                                         else payload.decode("utf-8", "replace"))
                    a += (alen + 3) & ~3
                out[ino] = entry
                off += (length + 3) & ~3
    except OSError:
        return {}
    finally:
        s.close()
    return out


def tcp_connections(pids):
    """The established (or closing) TCP connections that ``pids`` hold, as "local -> remote" text."""
    return sorted({"tcp port %d -> port %d" % (_hex_port(local), _hex_port(remote))
                   for local, remote in tcp_endpoints(pids)})


def tcp_endpoints(pids):
    """The established (or closing) TCP connections that ``pids`` hold: a list of (local, remote) address texts as
    /proc/net/tcp{,6} gives them ("0100007F:9C40"), read in the network namespace of the first pid."""
    inodes = socket_inodes(pids)
    out = []
    if not inodes:
        return out
    net = "/proc/%d/net/" % pids[0]
    for name in ("tcp", "tcp6"):
        try:
            with open(net + name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 9 and f[9] in inodes and f[3] not in ("0A", "07"):  # not LISTEN, not CLOSE
                        out.append((f[1], f[2]))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    return sorted(set(out))


def tcp_listen_ports(pids):
    """The TCP ports that sockets of ``pids`` listen on (IPv4 and IPv6), read in the network namespace of the first
    pid: a restore in that namespace binds each of them again."""
    pids = [int(p) for p in pids or []]
    inodes = socket_inodes(pids)
    if not inodes:
        return []
    return sorted({_hex_port(f[1]) for f in _tcp_rows("/proc/%d/net/" % pids[0]) if f[3] == "0A" and f[9] in inodes})


def tcp_time_wait(net_dir="/proc/self/net/"):
    """The TIME_WAIT sockets of the network namespace ``net_dir`` shows (by default this process's own), as
    [(address family, local address text, local port)]. Such a socket holds its local port for the kernel's
    TIME_WAIT length (60 s) after its connection closed from this side."""
    out = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for f in _tcp_rows(net_dir, (name,)):
            if f[3] == "06":
                addr = _addr_text(f[1])
                out.append((family, addr.rsplit(":", 1)[0].strip("[]"), _hex_port(f[1])))
    return out


def _tcp_rows(net_dir, names=("tcp", "tcp6")):
    """The split lines of ``net_dir``'s tcp and tcp6 tables (at least 10 fields each); none when unreadable."""
    rows = []
    for name in names:
        try:
            with open(os.path.join(net_dir, name)) as fh:
                next(fh)
                rows += [f for f in (line.split() for line in fh) if len(f) > 9]
        except (OSError, StopIteration):
            pass
    return rows


def tcp_outside(pids):
    """The TCP connections of ``pids`` whose other end the tree does not hold (a peer process outside it, or
    on another host), as "local -> remote" text; [] when every connection runs between two of its own sockets
    (torchrun's rendezvous store and its ranks, say)."""
    ends = tcp_endpoints([int(p) for p in pids])
    ours = set(ends)
    return ["tcp port %d -> %s" % (_hex_port(local), _addr_text(remote)) for local, remote in ends
            if (remote, local) not in ours]


def _addr_text(hexaddr):
    """"0100007F:9C40" as "127.0.0.1:40000" (an IPv6 address as [..]:port)."""
    host, unused, port = hexaddr.partition(":")
    try:
        raw = b"".join(struct.pack("<I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
        text = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
        return ("%s:%d" if len(raw) == 4 else "[%s]:%d") % (text, int(port, 16))
    except (ValueError, OSError, struct.error):
        return hexaddr
