"""A P4Runtime server without a switch, for the control-plane tests: a P4Info made from a
control plane's own schema (p4/entries.py, p4/tna_entries.py), and a server that keeps
tables and multicast groups and answers as bmv2's does."""
import itertools


def schema_p4info(schema: dict, counters: dict, value_sets: dict | None = None, registers: dict | None = None):
    """A P4Info with the schema's tables, actions, counters, value sets ({name: (bits, size)})
    and 32-bit registers ({name: size}), ids as p4c would number them.  A key field is
    (name, bits) (exact) or (name, bits, "exact" | "range")."""
    from p4.config.v1 import p4info_pb2
    kinds = {"exact": p4info_pb2.MatchField.EXACT, "range": p4info_pb2.MatchField.RANGE}
    info, ids, actions = p4info_pb2.P4Info(), itertools.count(0x01000001), {}
    for table, (keys, acts) in schema.items():
        t = info.tables.add()
        t.preamble.id, t.preamble.name, t.size = next(ids), table, 128
        for k, (name, bits, *kind) in enumerate(keys, 1):
            t.match_fields.add(id=k, name=name, bitwidth=bits, match_type=kinds[(kind or ["exact"])[0]])
        for action, params in acts.items():
            if action not in actions:
                a = info.actions.add()
                a.preamble.id, a.preamble.name = next(ids), action
                for k, (name, bits) in enumerate(params, 1):
                    a.params.add(id=k, name=name, bitwidth=bits)
                actions[action] = a.preamble.id
            t.action_refs.add(id=actions[action])
    for name, size in counters.items():
        c = info.counters.add()
        c.preamble.id, c.preamble.name, c.size = next(ids), name, size
    for name, (bits, size) in (value_sets or {}).items():
        v = info.value_sets.add()
        v.preamble.id, v.preamble.name, v.size = next(ids), name, size
        v.match.add(id=1, bitwidth=bits, match_type=p4info_pb2.MatchField.EXACT)
    for name, size in (registers or {}).items():
        r = info.registers.add()
        r.preamble.id, r.preamble.name, r.size = next(ids), name, size
        r.type_spec.bitstring.bit.bitwidth = 32
    return info


class FakeServer:
    """Tables and multicast groups as bmv2's P4Runtime server keeps them, answering as it does:
    an insert of a key that is there is ALREADY_EXISTS, a delete of one that is not NOT_FOUND,
    a table at its `capacity` UNKNOWN "Error when adding match entry to target", an unknown
    table id NOT_FOUND; each update on its own (CONTINUE_ON_ERROR, bmv2's only mode).  Value
    set, register and counter writes are kept in order (`writes`)."""

    def __init__(self, capacity: dict):
        from p4.v1 import p4runtime_pb2
        self.pb, self.capacity = p4runtime_pb2, capacity
        self.tables: dict = {}
        self.groups: dict = {}
        self.writes: list = []
        self.address = "fake:0"

    def _one(self, u) -> tuple:
        pb, ent = self.pb, u.entity
        if ent.HasField("table_entry"):
            te = ent.table_entry
            if te.table_id not in self.capacity:
                return 5, f"unknown table id {te.table_id}"
            rows = self.tables.setdefault(te.table_id, set())
            key = tuple(m.exact.value if m.HasField("exact") else (m.range.low, m.range.high) for m in te.match)
            if u.type == pb.Update.INSERT:
                if key in rows:
                    return 6, "entry exists"
                if len(rows) >= self.capacity[te.table_id]:
                    return 2, "Error when adding match entry to target"
                rows.add(key)
            elif u.type == pb.Update.DELETE:
                if key not in rows:
                    return 5, "no such entry"
                rows.remove(key)
            return 0, ""
        if ent.HasField("packet_replication_engine_entry"):
            g = ent.packet_replication_engine_entry.multicast_group_entry
            there = g.multicast_group_id in self.groups
            if (u.type == pb.Update.INSERT) == there:
                return (6, "group exists") if there else (5, "no such group")
            if u.type == pb.Update.DELETE:
                del self.groups[g.multicast_group_id]
            else:
                self.groups[g.multicast_group_id] = sorted((r.egress_port, r.instance) for r in g.replicas)
            return 0, ""
        self.writes.append(ent)
        return 0, ""

    def write(self, updates):
        out = [self._one(u) for u in updates]
        return [] if all(code == 0 for code, _ in out) else out

    def read(self, entities):
        return []

    def set_pipeline(self, p4info, config):
        self.tables.clear()
        self.groups.clear()

    def close(self):
        pass
