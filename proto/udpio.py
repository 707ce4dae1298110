"""UDP batching shared by the PS and the workers: GRO on receive, GSO on send (Linux).

`UDP_GRO` on a socket lets the kernel hand over a run of datagrams from one sender as one
buffer with the segment size in a control message; `UDP_SEGMENT` (GSO) sends a run of
equal-size datagrams to one destination as one buffer.  Both work on loopback and veth and
on real NICs (in software when the NIC lacks the offload), and both fall back: a kernel
without them refuses the socket option and every datagram travels alone.

``THC_UDP_OFFLOAD=0`` in the environment turns both off on both ends (the tests force the
fallback this way; the kernel-loss experiment uses it so nftables drops single datagrams,
not GSO runs).
"""
from __future__ import annotations

import os
import socket
import struct

from thc_ps.proto.headers import split_segments

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
_CMSG_SPACE = socket.CMSG_SPACE(4)


def offload_enabled() -> bool:
    """Whether GRO/GSO may be used (``THC_UDP_OFFLOAD`` unset or not 0)."""
    return os.environ.get("THC_UDP_OFFLOAD", "1").strip().lower() not in ("0", "no", "off", "false")


def set_gro(sock: socket.socket, on: bool) -> bool:
    """Turn UDP_GRO on or off; False if the kernel does not have it (then it is off)."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1 if on else 0)
        return on
    except OSError:
        return False


def recv_datagrams(sock: socket.socket, size: int = 65536) -> tuple[list, tuple]:
    """One recvmsg: ([datagram bytes, ...], source address), a GRO batch split into its
    datagrams (a socket without GRO yields one)."""
    data, anc, _flags, addr = sock.recvmsg(size, _CMSG_SPACE)
    seg = 0
    for level, kind, payload in anc:
        if level == SOL_UDP and kind == UDP_GRO and len(payload) >= 4:
            seg = struct.unpack("i", payload[:4])[0]
    return [bytes(s) for s in split_segments(data, seg)], addr
