# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A process tree's plan for CRIU, made before anything is frozen (``Backend.plan_tree`` runs these steps):
what CRIU must be told of the tree or cannot dump (``criu_needs``), the refusals of what it cannot dump, the
options the tree needs, and the refusal of an option the runtime cannot pass on to CRIU."""
from __future__ import annotations

import shutil

from ..core import procfs, sockets
from ..core.errors import InvalidTarget


def criu_needs(pids):
    """What CRIU must be told, or cannot do, for the tree ``pids``, found before anything is frozen:
    {"file_locks": {pid: [...]}, "ext_unix_dgram": [...], "ext_unix_stream": [...], "tcp": [...],
    "tcp_listen": [ports the tree listens on, when it shares this process's network namespace]}.
    External unix sockets are connected to a peer outside the tree: CRIU dumps a datagram one to a
    named peer with --ext-unix-sk (and reconnects it on restore, e.g. /dev/log) and cannot dump one
    end of a stream connection at all. Peers are seen only in this host's network namespace."""
    pids = [int(p) for p in pids]
    ghost = (procfs.deleted_files(pids) or [None])[0]  # (the largest: CRIU's --ghost-limit must take it)
    needs = {"file_locks": procfs.file_locks(pids), "ext_unix_dgram": [], "ext_unix_stream": [], "tcp": sockets.tcp_connections(pids),
             "io_uring": procfs.io_uring_users(pids), "ghost_bytes": ghost[0] if ghost else 0,
             "ghost_file": ghost[1] if ghost else None, "tcp_listen": []}
    ours = set(sockets.socket_inodes(pids))
    if any(procfs.net_namespace(p) == procfs.net_namespace() for p in pids[:1]):
        # (a tree in this namespace is restored into the restorer's own: it binds these ports there again)
        needs["tcp_listen"] = sockets.tcp_listen_ports(pids)
        table = sockets.unix_sockets()
        for ino in sorted(ours):
            entry = table.get(int(ino))
            if not entry or not entry["peer"] or str(entry["peer"]) in ours:
                continue
            peer = table.get(entry["peer"]) or {}
            owner = sockets.socket_owner(entry["peer"])
            what = "unix %s socket %s connected to %s%s" % (
                entry["type"], ino, peer.get("name") or "an unnamed socket",
                " (held by pid %d, %s)" % owner if owner else "")
            if entry["type"] == "dgram" and peer.get("name"):
                needs["ext_unix_dgram"].append(what)
            else:
                needs["ext_unix_stream"].append(what)
    return needs


def refuse_undumpable(needs, tcp_ok):
    """Refuse a tree that holds what CRIU cannot dump: one end of a unix stream connection to a process outside
    it, an io_uring, or established TCP connections unless ``tcp_ok`` (the user's tcp_established, or the
    engine found both ends of each in the tree)."""
    if needs["ext_unix_stream"]:
        raise InvalidTarget("the workload holds %s; CRIU cannot checkpoint one end of a unix stream connection; "
                            "nothing was frozen" % needs["ext_unix_stream"][0], stage="preflight",
                            hint="checkpoint a tree that holds both ends (their common parent), or close that "
                                 "connection first")
    if needs["io_uring"]:
        p = needs["io_uring"][0]
        raise InvalidTarget("pid %d (%s) holds an io_uring, which CRIU cannot checkpoint; nothing was frozen"
                            % (p, (procfs.read_stat(p) or {}).get("comm")), stage="preflight", pid=p,
                            hint="libuv makes one by itself: PyTorch's TCPStore server (torchrun's agent holds "
                                 "one in PyTorch 2.11 whatever its options) and node; start the ranks with a "
                                 "launcher of the job's own and USE_LIBUV=0 (docs/multi_gpu.md)")
    if needs["tcp"] and not tcp_ok:
        raise InvalidTarget("the workload holds established TCP connections (%s); nothing was frozen"
                            % ", ".join(needs["tcp"][:3]), stage="preflight",
                            hint="set tcp_established: true to checkpoint them (CRIU --tcp-established: the "
                                 "connections are restored where the workload is restored, with the same addresses)")


def needed_flags(needs, tcp_established, internal_tcp, tcp_lock_flags):
    """The CRIU options the tree needs: --file-locks, --ext-unix-sk, a --ghost-limit above its largest deleted
    file, --tcp-established (with how the connections are locked, ``tcp_lock_flags()``, where it holds some)."""
    flags = []
    if needs["file_locks"]:
        flags.append("--file-locks")
    if needs["ext_unix_dgram"]:
        flags.append("--ext-unix-sk")
    if needs["ghost_bytes"] > procfs.GHOST_LIMIT:  # a deleted file it maps or holds, larger than CRIU takes
        flags.append("--ghost-limit=%d" % (needs["ghost_bytes"] + procfs.GHOST_LIMIT))
    if tcp_established or (internal_tcp and needs["tcp"]):
        flags.append("--tcp-established")
        if needs["tcp"]:
            flags += tcp_lock_flags()
    return flags


def without_user_given(flags, extra):
    """``flags`` less those the user gave among the CRIU options ``extra`` (by name: the user's value wins)."""
    extra = extra or ()
    return [f for f in flags if f not in extra and f.split("=", maxsplit=1)[0] not in extra]


def refuse_unpassable(flags, passes, needs, runtime):
    """Refuse the tree when it needs a CRIU option that the runtime cannot pass on (``passes(option)``)."""
    blocked = [f for f in flags if not passes(f)]
    if blocked:
        raise InvalidTarget("the workload needs CRIU's %s (%s), which the %s runtime cannot pass to CRIU; "
                            "nothing was frozen" % (" ".join(blocked), _why(needs), runtime),
                            stage="preflight")


def _why(needs):
    out = []
    if needs["file_locks"]:
        out.append("file locks")
    if needs["ext_unix_dgram"]:
        out.append(needs["ext_unix_dgram"][0])
    if needs["tcp"]:
        out.append("TCP connections")
    if needs.get("ghost_bytes", 0) > procfs.GHOST_LIMIT:
        out.append("a deleted file of %d bytes that it maps or holds open%s" % (
            needs["ghost_bytes"], ": %s" % needs["ghost_file"] if needs.get("ghost_file") else ""))
    return ", ".join(out)


NFTABLES_LOCK = "--network-lock=nftables"


def network_lock_method(criu_options=()):
    """The --network-lock METHOD among the user's CRIU options, or None (CRIU's default, iptables)."""
    opts = list(criu_options or ())
    method = None
    for i, opt in enumerate(opts):
        if opt == "--network-lock" and i + 1 < len(opts):
            method = opts[i + 1]
        elif opt.startswith("--network-lock="):
            method = opt.split("=", 1)[1]
    return method


def network_lock_flags(what, user_options, can_hand_nftables, has_nftables, runtime):
    """How CRIU is to lock ``what`` ("... are": a tree's TCP connections, or its network namespace's) during the
    dump: by default with iptables-restore, which this host may lack (the GPU machines here do); then with nftables
    (libnftables, no binary) where this CRIU and kernel can (``has_nftables()``) and the runtime can hand CRIU the
    option; else refused before anything is frozen. The user's own --network-lock=METHOD stands (iptables needs its
    tool all the same). CRIU finds iptables-restore on its PATH (execvp), as shutil.which does here."""
    method = network_lock_method(user_options)
    if method not in (None, "iptables") or shutil.which("iptables-restore"):
        return []
    can_hand = method is None and can_hand_nftables
    if can_hand and has_nftables():
        return [NFTABLES_LOCK]
    raise InvalidTarget("%s locked by CRIU during the dump with iptables-restore, which is not installed on this host, "
                        "and %s; nothing was frozen" % (
                            what, "this CRIU cannot lock with nftables" if can_hand else
                            "the %s runtime cannot hand CRIU %s" % (runtime, NFTABLES_LOCK)
                            if method is None else "the criu options ask for iptables"),
                        stage="preflight",
                        hint="install iptables (the gpuckpt.fleet.criu role does), or run the workload on the host's "
                             "network")
