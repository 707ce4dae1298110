"""Test hosts in network namespaces: two on either end of a veth pair (`two_hosts`: PS and
workers), n on one bridge (`star`: a host per rank, as a rack behind a switch), or one host
with only loopback (`one_host`: a run whose kernel counters, `udp_errors`, are its own).

Used by the experiments (kernel-level loss, rate limits) and tests; everything is created
under unique names and removed on exit.  Needs root, `ip`, and for loss `nft` (this
kernel has no netem: loss is an nftables `numgen random` drop rule) or `tc` for rates
(token bucket filter).  Addresses are 10.77.x.0/30 and 10.79.x.0/24 inside our own
namespaces only.  `enter` moves a process (a spawned rank) into one of them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, or tools missing)."""


def check_available(need_nft: bool = False, need_tc: bool = False) -> None:
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    for tool, needed in (("ip", True), ("nft", need_nft), ("tc", need_tc)):
        if needed and shutil.which(tool) is None:
            raise NetnsUnavailable(f"'{tool}' is not installed (Debian: "
                                   f"{ {'ip': 'iproute2', 'nft': 'nftables', 'tc': 'iproute2'}[tool]})")


def unavailable(need_nft: bool = False, need_tc: bool = False) -> str | None:
    """Why namespaces cannot be used here (a test's skip reason), or None."""
    try:
        check_available(need_nft=need_nft, need_tc=need_tc)
    except NetnsUnavailable as exc:
        return str(exc)
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


@dataclass
class TwoHosts:
    ps_ns: str
    worker_ns: str
    ps_ip: str
    worker_ip: str

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def nft_drops(self) -> int:
        """Datagrams the loss rules of both namespaces dropped so far."""
        return nft_drop_counters(self.ps_ns) + nft_drop_counters(self.worker_ns)


def _drop_rule(ns: str, loss: float, match: str, port_lo: int, port_hi: int) -> None:
    """Drop UDP datagrams arriving in `ns` whose `match` (sport or dport) is in [lo, hi], with
    probability `loss`: on receipt (the input hook), not on the sender's output hook, where a
    drop fails the sender's sendmmsg at that datagram, which the sender (sendmmsg reports no
    error once a first message went out) sends again with its next call."""
    per_million = int(round(loss * 1_000_000))
    _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "thcloss")
    _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "thcloss", "input",
         "{ type filter hook input priority 0; }")
    _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "thcloss", "input", "udp", match,
         f"{port_lo}-{port_hi}", "numgen", "random", "mod", "1000000", "<", str(per_million),
         "counter", "drop")


@contextlib.contextmanager
def two_hosts(*, rate_mbit: float | None = None, loss: float = 0.0, ps_ports=(9000, 9010)):
    """Create PS and worker namespaces joined by a veth pair; optional rate limit and loss.

    Loss applies in both directions: the PS namespace drops DATA datagrams arriving for the
    PS ports and the worker namespace results arriving from them, with probability `loss`
    each way (`TwoHosts.nft_drops` counts them).  nftables sees a
    UDP GSO batch as one packet, so for per-datagram loss run the workers and PS with
    THC_UDP_OFFLOAD=0 (the loss experiment and tests/test_netns.py do).
    """
    check_available(need_nft=loss > 0, need_tc=rate_mbit is not None)
    tag = uuid.uuid4().hex[:6]
    ps_ns, wk_ns = f"thcps-{tag}", f"thcwk-{tag}"
    va, vb = f"thca{tag}", f"thcb{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    ps_ip, wk_ip = f"10.77.{octet}.1", f"10.77.{octet}.2"
    created = []
    try:
        for ns in (ps_ns, wk_ns):
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        _run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        _run("ip", "link", "set", va, "netns", ps_ns)
        _run("ip", "link", "set", vb, "netns", wk_ns)
        for ns, dev, ip in ((ps_ns, va, ps_ip), (wk_ns, vb, wk_ip)):
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/30", "dev", dev)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            if rate_mbit is not None:
                _rate_limit(ns, dev, rate_mbit)
        if loss > 0:
            _drop_rule(ps_ns, loss, "dport", *ps_ports)
            _drop_rule(wk_ns, loss, "sport", *ps_ports)
        yield TwoHosts(ps_ns, wk_ns, ps_ip, wk_ip)
    finally:
        _remove(created)


@contextlib.contextmanager
def one_host():
    """A namespace with only loopback, up, and a multicast route on it (a cluster there uses
    a result group as it does on the host); yields its name.  What it runs is counted by its
    own kernel counters (`udp_errors`), not the host's."""
    check_available()
    ns = f"thcone-{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", ns, "ip", "route", "add", "224.0.0.0/4", "dev", "lo")
        yield ns
    finally:
        _remove([ns])


def udp_errors(ns: str) -> int:
    """Datagrams the kernel of `ns` dropped on receipt so far (/proc/net/snmp Udp InErrors:
    full socket buffers, bad checksums)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True,
                         text=True).stdout.splitlines()
    rows = [line.split() for line in out if line.startswith("Udp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:]))["InErrors"]) if len(rows) >= 2 else 0


def _rate_limit(ns: str, dev: str, rate_mbit: float) -> None:
    """A token bucket on dev's egress in ns.  The bucket holds 4 ms of the rate (at least
    32 KB): tc-tbf(8) asks for at least rate / HZ, and with less the link runs below its rate
    (1 Gbit/s with a 32 KB bucket gave float32 rounds 151-157 ms for 136 ms of bytes; 141-142
    with this)."""
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
         f"{rate_mbit}mbit", "burst", f"{max(256, int(rate_mbit * 4))}kbit", "latency", "100ms")


def _remove(namespaces: list) -> None:
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass(frozen=True)
class Star:
    """n hosts on one bridge: host i is namespace hosts[i] with address ips[i] on `ifname`."""

    hub: str
    hosts: tuple
    ips: tuple
    ifname: str = "thc0"
    rate_mbit: float | None = None      # every link's cap (None: uncapped)

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i]]


@contextlib.contextmanager
def star(n: int, *, rate_mbit: float | None = None):
    """n host namespaces, each joined by its own veth to a bridge in a hub namespace (a
    switch); with `rate_mbit`, every link is rate-limited both ways (a token bucket on the
    host's end, its uplink, and on the bridge's end, its downlink), so each host — a DDP rank,
    a THC worker, the PS — has a link of that rate of its own."""
    check_available(need_tc=rate_mbit is not None)
    if not 2 <= n <= 250:
        raise ValueError(f"a star holds 2..250 hosts, not {n}")
    tag = uuid.uuid4().hex[:6]
    hub = f"thchub-{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    hosts = tuple(f"thch{i}-{tag}" for i in range(n))
    ips = tuple(f"10.79.{octet}.{i + 1}" for i in range(n))
    created = []
    try:
        _run("ip", "netns", "add", hub)
        created.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(zip(hosts, ips)):
            _run("ip", "netns", "add", ns)
            created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
            near, far = f"thh{tag}{i}", f"thb{tag}{i}"
            _run("ip", "link", "add", near, "type", "veth", "peer", "name", far)
            _run("ip", "link", "set", near, "netns", ns)
            _run("ip", "-n", ns, "link", "set", near, "name", "thc0")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "thc0")
            _run("ip", "-n", ns, "link", "set", "thc0", "up")
            _run("ip", "link", "set", far, "netns", hub)
            _run("ip", "-n", hub, "link", "set", far, "master", "br0")
            _run("ip", "-n", hub, "link", "set", far, "up")
            if rate_mbit is not None:
                _rate_limit(ns, "thc0", rate_mbit)
                _rate_limit(hub, far, rate_mbit)
        yield Star(hub, hosts, ips, rate_mbit=rate_mbit)
    finally:
        _remove(created)


def link_bytes(net: Star) -> list[tuple[int, int]]:
    """(bytes sent, bytes received) so far on each host's link (its `thc0`, the one cable to
    the bridge), in host order: the kernel's interface counters, every frame's IP, UDP or TCP
    headers included."""
    import json as _json
    out = []
    for ns in net.hosts:
        proc = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", net.ifname],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"cannot read {ns}'s {net.ifname} counters: {proc.stderr.strip()}")
        stats = _json.loads(proc.stdout)[0]["stats64"]
        out.append((int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])))
    return out


#: setns(2)'s flag for a network namespace
CLONE_NEWNET = 0x40000000


def enter(ns: str) -> None:
    """Move the calling process into network namespace `ns` (made by `ip netns add`); a
    spawned rank calls this first, before it opens a socket."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {ns}: {os.strerror(err)}")


def nft_drop_counters(ns: str) -> int:
    """Packets the loss rules of `ns` dropped so far."""
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "thcloss"],
                         capture_output=True, text=True).stdout
    total = 0
    for line in out.splitlines():
        if "counter packets" in line:
            total += int(line.split("counter packets")[1].split()[0])
    return total


def qdisc_drops(ns: str) -> int:
    """Packets the queueing disciplines of `ns` dropped so far (a rate limit's full queue)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc"], capture_output=True, text=True).stdout
    return sum(int(line.split("(dropped")[1].split(",")[0]) for line in out.splitlines() if "(dropped" in line)


def partition(ns: str) -> None:
    """Cut `ns` off: drop every packet in and out of it (data and control plane alike), as a
    switch failure or a cable pulled would, until `heal(ns)`."""
    _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "thcpart")
    for hook, dev in (("input", "iifname"), ("output", "oifname")):
        _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "thcpart", hook,
             f"{{ type filter hook {hook} priority -10; }}")
        _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "thcpart", hook,
             "meta", dev, "!=", "lo", "counter", "drop")


def heal(ns: str) -> None:
    """Undo `partition(ns)`."""
    _run("ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "thcpart")
