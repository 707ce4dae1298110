"""scapy layer for the THC header, derived from thc_ps.proto.headers.FIELDS (one definition).

Bound to UDP port 9000 (the default data port) so `IP()/UDP(dport=9000)/THC()`
dissects; tests and tools may bind other ports with `bind_port`.
"""
from __future__ import annotations

from scapy.fields import ByteEnumField, ByteField, IntField, ShortField, XShortField
from scapy.layers.inet import UDP
from scapy.packet import Packet, Raw, bind_layers

from thc_ps.proto import headers

DEFAULT_PORT = 9000

_BY_SIZE = {1: ByteField, 2: ShortField, 4: IntField}
_DEFAULTS = {"magic": headers.MAGIC, "version": headers.VERSION, "type": headers.DATA}


def _field(name: str, size: int):
    default = _DEFAULTS.get(name, 0)
    if name == "magic":
        return XShortField(name, default)
    if name == "type":
        return ByteEnumField(name, default, headers.TYPE_NAMES)
    return _BY_SIZE[size](name, default)


class THC(Packet):
    name = "THC"
    fields_desc = [_field(n, s) for n, s in headers.FIELDS]

    def post_build(self, pkt, pay):
        if self.payload_len is None or (self.payload_len == 0 and pay):
            n = len(pay)
            pkt = pkt[:22] + n.to_bytes(2, "big") + pkt[24:]
        return pkt + pay

    def extract_padding(self, s):
        return s, b""


bind_layers(THC, Raw)


def bind_port(port: int) -> None:
    bind_layers(UDP, THC, dport=port)
    bind_layers(UDP, THC, sport=port)


bind_port(DEFAULT_PORT)
