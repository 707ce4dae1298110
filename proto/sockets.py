"""Socket options both ends of the data plane use (Linux)."""
from __future__ import annotations

import socket

#: setsockopt names Python's socket module does not export: like SO_RCVBUF/SO_SNDBUF, but
#: allowed to exceed net.core.rmem_max/wmem_max (needs CAP_NET_ADMIN, i.e. root).
SO_RCVBUFFORCE, SO_SNDBUFFORCE = 33, 32


def set_buffer(sock: socket.socket, size: int, *, send: bool = False) -> None:
    """Ask for a `size`-byte receive (or send) buffer: forced past the sysctl cap when root,
    else the ordinary option (which the kernel caps)."""
    force, opt = (SO_SNDBUFFORCE, socket.SO_SNDBUF) if send else (SO_RCVBUFFORCE, socket.SO_RCVBUF)
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
