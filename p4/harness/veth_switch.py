"""Packet-level harness: a bmv2 switch on veth pairs that the harness creates and removes,
programmed through either control plane: `simple_switch` and its Thrift CLI (`thrift`), or
`simple_switch_grpc` and P4Runtime (`p4runtime`, which loads the program itself).

Switch side `thcsw{i}a` is port i; the test side `thcsw{i}b` is a raw AF_PACKET socket.
IPv6 is off on both ends so the kernel's own packets do not reach the switch; the frames
the tests send carry UDP checksum 0, so checksum offload cannot corrupt them.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import time
import uuid
from pathlib import Path

from thc_ps.p4.control import (SwitchCLI, ThriftControl, free_port, p4info_path, reset_commands, start_switch,
                        start_switch_grpc)

ETH_P_ALL = 0x0003


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


class VethSwitch:
    """A bmv2 switch with veth-attached ports: 1..ports, or the port numbers listed;
    `control` is its backend (thc_ps.p4.control.ThriftControl or thc_ps.p4.p4runtime.P4RuntimeControl, the
    program loaded)."""

    def __init__(self, json_path: Path, ports, thrift_port: int | None = None, log: str | None = None,
                 control: str = "thrift"):
        if os.geteuid() != 0:
            raise PermissionError("veth pairs need root")
        thrift_port = thrift_port or free_port()    # other switches on this machine may hold 9090
        self.tag = uuid.uuid4().hex[:4]
        numbers = range(1, ports + 1) if isinstance(ports, int) else ports
        self.names = {i: (f"t{self.tag}s{i}a", f"t{self.tag}s{i}b") for i in numbers}
        self.proc = None
        self.socks: dict = {}
        try:
            for a, b in self.names.values():
                _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
                for dev in (a, b):
                    subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                                   capture_output=True)
                    _run("ip", "link", "set", dev, "up")
            ifaces = {i: a for i, (a, _) in self.names.items()}
            if control == "p4runtime":
                from thc_ps.p4.p4runtime import P4RuntimeControl
                self.proc, address = start_switch_grpc(ifaces, log=log)
                self.control = P4RuntimeControl(address, p4info_path(json_path), json_path)
            else:
                self.proc = start_switch(json_path, ifaces, thrift_port=thrift_port, log=log)
                self.cli = SwitchCLI(thrift_port)
                self.control = ThriftControl(self.cli)
            self.control.take_over(0)
            for i, (_, b) in self.names.items():
                s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                s.bind((b, 0))
                s.setblocking(False)
                self.socks[i] = s
            self.drain(0.2)
        except Exception:
            self.close()
            raise

    def send(self, port: int, frame: bytes) -> None:
        self.socks[port].send(frame)

    def drain(self, quiet: float = 0.3, limit: float = 5.0) -> list:
        """Every frame the switch emitted until `quiet` seconds pass without one: [(port, bytes)]."""
        out = []
        end = time.monotonic() + limit
        by_fd = {s.fileno(): (p, s) for p, s in self.socks.items()}
        while time.monotonic() < end:
            ready, _, _ = select.select(list(by_fd), [], [], quiet)
            if not ready:
                break
            for fd in ready:
                port, s = by_fd[fd]
                try:
                    while True:
                        out.append((port, s.recv(65535)))
                except BlockingIOError:
                    pass
        return out

    def poll(self, timeout: float) -> int:
        """Number of frames waiting (read and discarded) once any arrives within `timeout`;
        returns without waiting for quiet, for throughput loops that only count outputs."""
        ready, _, _ = select.select([s.fileno() for s in self.socks.values()], [], [], timeout)
        n = 0
        for s in self.socks.values():
            if s.fileno() in ready:
                try:
                    while True:
                        s.recv(65535)
                        n += 1
                except BlockingIOError:
                    pass
        return n

    def reset(self) -> None:
        """Every register and counter to zero (Thrift only: bmv2's P4Runtime server writes no
        registers; tests/p4/test_switch.py gives its jobs new epochs instead)."""
        self.cli.run(reset_commands())

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        if getattr(self, "control", None) is not None:
            self.control.close()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
        for a, _ in self.names.values():
            subprocess.run(["ip", "link", "del", a], capture_output=True)
