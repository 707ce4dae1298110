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


def multicast_from(sock: socket.socket, ip: str) -> None:
    """Make multicast datagrams from `sock` leave by the interface with address `ip` (the
    routing table decides when `ip` is 0.0.0.0, a socket bound to every interface)."""
    if ip != "0.0.0.0":
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))


def multicast_unreachable(src_ip: str, group: tuple) -> str:
    """Why multicast datagrams sent from the interface with address `src_ip` cannot reach
    `group` (address, port): the route lookup's error, or "" when there is a route.  A
    throwaway socket looks it up, so the answer comes before any traffic."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        multicast_from(probe, src_ip)
        probe.connect(group)
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        probe.close()


def group_socket(group: tuple, iface_ip: str, rcvbuf: int) -> socket.socket:
    """A non-blocking socket that receives the datagrams sent to the IPv4 multicast `group`
    (address, port) on the interface with address `iface_ip` (JobConfig.result_group).

    It is bound to the group's address, so it hears nothing else; SO_REUSEADDR lets every
    worker of a host bind the same group, and each gets its own copy of a datagram."""
    addr, port = group
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        set_buffer(sock, rcvbuf)
        sock.bind((addr, port))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        socket.inet_aton(addr) + socket.inet_aton(iface_ip))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
