"""The switch programmed through P4Runtime (bmv2's `simple_switch_grpc` today; the same
messages suit any P4Runtime server, e.g. Stratum).

The client library is PyPI's `p4runtime` (p4lang's generated bindings: `p4.v1`,
`p4.config.v1`) over `grpcio`: the project's `p4runtime` extra.  Its generated modules
predate protobuf 4's C implementation, so they load with protobuf's pure-Python one: this
module selects it before protobuf is first imported (docs/p4.md, "Control planes").

`P4Info` looks every table, match field, action, parameter and counter up by the name
p4/entries.py uses; `P4RuntimeClient` holds the primary connection (arbitration), loads the
pipeline, writes batches and reads; `P4RuntimeControl` turns p4/entries.py's writes into
P4Runtime updates — the P4Runtime backend of thc_ps.p4.control.SwitchEngine.
"""
from __future__ import annotations

import hashlib
import os
import queue
import sys
from pathlib import Path

from thc_ps.p4.entries import CounterCells, McGroup, RegisterFill, TableEntry, ValueSet, describe

PURE_PYTHON = ("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")


def client_problem() -> str:
    """'' when the P4Runtime client library imports here, else why not (one line)."""
    if "google.protobuf" not in sys.modules:
        os.environ.setdefault(*PURE_PYTHON)
    try:
        import grpc  # noqa: F401
        from p4.v1 import p4runtime_pb2  # noqa: F401
    except ImportError as exc:
        return f"the P4Runtime client is not installed ({exc.name or exc}): pip install '.[p4runtime]'"
    except TypeError:
        return ("the P4Runtime bindings need protobuf's pure-Python implementation: set "
                "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python before anything imports google.protobuf")
    return ""


def _modules():
    problem = client_problem()
    if problem:
        raise ImportError(problem)
    import grpc
    from google.protobuf import text_format
    from google.rpc import status_pb2
    from p4.config.v1 import p4info_pb2
    from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
    return grpc, text_format, status_pb2, p4info_pb2, p4runtime_pb2, p4runtime_pb2_grpc


def encode(value: int) -> bytes:
    """P4Runtime's canonical bytestring of an unsigned value (no leading zero bytes)."""
    return int(value).to_bytes(max(1, (int(value).bit_length() + 7) // 8), "big")


class P4Info:
    """A P4Info message indexed by name (the full name, or its alias)."""

    def __init__(self, message):
        self.message = message
        self.tables = self._index(message.tables)
        self.actions = self._index(message.actions)
        self.counters = self._index(message.counters)
        self.registers = self._index(message.registers)
        self.value_sets = self._index(message.value_sets)

    @staticmethod
    def _index(items) -> dict:
        out = {}
        for item in items:
            out[item.preamble.name] = item
            out.setdefault(item.preamble.alias, item)
        return out

    @classmethod
    def load(cls, path: Path | str) -> P4Info:
        """A P4Info as p4c writes it with --p4runtime-files: protobuf text (NAME.txtpb, NAME.txt),
        or binary (NAME.bin), which also holds externs of types this client has no
        description of (p4c-barefoot's `barefoot.PortMetadata`: text cannot be parsed without it)."""
        _, text_format, _, p4info_pb2, _, _ = _modules()
        path = Path(path)
        if path.suffix == ".bin":
            return cls(p4info_pb2.P4Info.FromString(path.read_bytes()))
        return cls(text_format.Parse(path.read_text(), p4info_pb2.P4Info()))

    def _get(self, kind: str, index: dict, name: str):
        if name not in index:
            raise ValueError(f"the P4Info has no {kind} {name}")
        return index[name]

    def table(self, name: str):
        return self._get("table", self.tables, name)

    def action(self, name: str):
        return self._get("action", self.actions, name)

    def counter(self, name: str):
        return self._get("counter", self.counters, name)

    def register(self, name: str):
        return self._get("register", self.registers, name)

    def value_set(self, name: str):
        return self._get("value set", self.value_sets, name)

    def match_fields(self, table: str) -> dict:
        return {m.name: m for m in self.table(table).match_fields}

    def params(self, action: str) -> dict:
        return {p.name: p for p in self.action(action).params}

    def name_of(self, p4_id: int) -> str:
        for index in (self.tables, self.actions, self.counters, self.registers, self.value_sets):
            for item in index.values():
                if item.preamble.id == p4_id:
                    return item.preamble.name
        return f"id {p4_id}"


class P4RuntimeError(RuntimeError):
    """A write the switch rejected: `rejected` [(op, item, message)], `applied` [(op, item)]."""

    def __init__(self, message: str, rejected: list, applied: list):
        super().__init__(message)
        self.rejected, self.applied = rejected, applied


class P4RuntimeClient:
    """One P4Runtime connection: the primary controller of device `device_id`, or (`primary`
    False) a reader, which needs no arbitration."""

    def __init__(self, address: str, device_id: int = 0, election_id: int = 1, timeout: float = 10.0,
                 primary: bool = True):
        grpc, _, _, _, pb, pb_grpc = _modules()
        self.address, self.device_id, self.pb = address, device_id, pb
        # a rejected batch's status carries one error per update (~37 bytes each): past gRPC's
        # default 16 KiB of metadata for a job's 515 writes
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_metadata_size", 16 << 20)])
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise ConnectionError(f"no P4Runtime server answered on {address} within {timeout:g} s") from None
        self.stub = pb_grpc.P4RuntimeStub(self.channel)
        self.election_id = pb.Uint128(high=0, low=election_id)
        self._requests: queue.Queue = queue.Queue()
        if not primary:
            return
        self._stream = self.stub.StreamChannel(iter(self._requests.get, None))
        hello = pb.StreamMessageRequest()
        hello.arbitration.device_id = device_id
        hello.arbitration.election_id.CopyFrom(self.election_id)
        self._requests.put(hello)
        reply = next(self._stream)
        if reply.arbitration.status.code != 0:
            self.close()
            raise ConnectionError(f"P4Runtime server {address} did not make this client primary for device "
                                  f"{device_id}: {reply.arbitration.status.message}")

    def set_pipeline(self, p4info, device_config: bytes) -> None:
        """Load a program: its P4Info and the target's config (bmv2: the JSON).  The switch
        starts it with every table, group, register and counter empty."""
        pb = self.pb
        req = pb.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=self.election_id,
            action=pb.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT)
        req.config.p4info.CopyFrom(p4info)
        req.config.p4_device_config = device_config
        req.config.cookie.cookie = int.from_bytes(hashlib.sha256(device_config).digest()[:8], "big")
        self.stub.SetForwardingPipelineConfig(req)

    def write(self, updates: list) -> list:
        """One WriteRequest; [] when every update applied, else one (code, message) per update
        (code 0: applied) as the server reported them."""
        grpc = _modules()[0]
        req = self.pb.WriteRequest(device_id=self.device_id, election_id=self.election_id)
        req.updates.extend(updates)
        try:
            self.stub.Write(req)
        except grpc.RpcError as exc:
            return self._errors(exc, len(updates))
        return []

    def _errors(self, exc, n: int) -> list:
        status_pb2 = _modules()[2]
        raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
        out = []
        if raw:
            for detail in status_pb2.Status.FromString(raw).details:
                err = self.pb.Error()
                if detail.Unpack(err):
                    out.append((err.canonical_code, err.message))
        if len(out) != n:            # no per-update detail: which updates applied is unknown
            out = [(UNKNOWN_OUTCOME, exc.details() or str(exc.code()))] * n
        return out

    def read(self, entities: list) -> list:
        req = self.pb.ReadRequest(device_id=self.device_id)
        req.entities.extend(entities)
        return [e for reply in self.stub.Read(req) for e in reply.entities]

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


def read_cells(client: P4RuntimeClient, info: P4Info, counter: str, cells) -> list[int]:
    """The packet counts of a counter array's cells, in one ReadRequest."""
    cid = info.counter(counter).preamble.id
    entities = []
    for i in cells:
        e = client.pb.Entity()
        e.counter_entry.counter_id, e.counter_entry.index.index = cid, i
        entities.append(e)
    got = {e.counter_entry.index.index: e.counter_entry.data.packet_count for e in client.read(entities)}
    return [got.get(i, 0) for i in cells]


#: the status of an update the server's answer does not give one for
UNKNOWN_OUTCOME = -1

#: P4Runtime's canonical codes (google.rpc.Code) by number, for messages
CODES = {0: "OK", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS",
         8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 12: "UNIMPLEMENTED", 13: "INTERNAL"}


class P4RuntimeControl:
    """The P4Runtime backend of thc_ps.p4.control.SwitchEngine: p4/entries.py's writes as P4Runtime
    updates, one WriteRequest per batch; names resolved through the P4Info."""

    name = "p4runtime"

    def __init__(self, address: str, p4info: Path | str, device_config: Path | str, device_id: int = 0,
                 election_id: int = 1, client: P4RuntimeClient | None = None):
        self.p4info_path, self.device_config = Path(p4info), Path(device_config)
        self.p4info = P4Info.load(p4info)
        self.client = client or P4RuntimeClient(address, device_id, election_id)
        self.pb = self.client.pb
        self._p4info_pb2 = _modules()[3]

    def take_over(self, max_jobs: int) -> None:
        """Load the program (p4c's JSON and P4Info): the switch starts it with every table,
        multicast group, register and counter empty."""
        self.client.set_pipeline(self.p4info.message, self.device_config.read_bytes())

    # ---------------------------------------------------------------- writes

    def _table_entry(self, e: TableEntry, with_action: bool):
        te = self.pb.TableEntry(table_id=self.p4info.table(e.table).preamble.id)
        fields = self.p4info.match_fields(e.table)
        for name, value in e.match:
            if name not in fields:
                raise ValueError(f"the P4Info's table {e.table} has no key field {name}")
            fm = te.match.add(field_id=fields[name].id)
            if fields[name].match_type == self._p4info_pb2.MatchField.RANGE:
                if not isinstance(value, tuple):
                    raise ValueError(f"{e.table} key {name} is a range: give (low, high)")
                fm.range.low, fm.range.high = encode(value[0]), encode(value[1])
            elif isinstance(value, tuple):
                raise ValueError(f"{e.table} key {name} is not a range in the P4Info")
            else:
                fm.exact.value = encode(value)
        te.priority = e.priority
        if with_action:
            act = te.action.action
            act.action_id = self.p4info.action(e.action).preamble.id
            params = self.p4info.params(e.action)
            for name, value in e.params:
                if name not in params:
                    raise ValueError(f"the P4Info's action {e.action} has no parameter {name}")
                act.params.add(param_id=params[name].id, value=encode(value))
        return te

    def updates(self, op: str, item) -> list:
        """The P4Runtime updates of one write (a counter block: one per cell)."""
        pb = self.pb
        kind = {"insert": pb.Update.INSERT, "modify": pb.Update.MODIFY, "delete": pb.Update.DELETE}[op]
        if isinstance(item, CounterCells):
            cid = self.p4info.counter(item.counter).preamble.id
            out = []
            for i in range(item.first, item.first + item.count):
                u = pb.Update(type=pb.Update.MODIFY)
                ce = u.entity.counter_entry
                ce.counter_id, ce.index.index = cid, i
                ce.data.packet_count = ce.data.byte_count = 0
                out.append(u)
            return out
        u = pb.Update(type=kind)
        if isinstance(item, ValueSet):
            vs = self.p4info.value_set(item.name)
            ve = u.entity.value_set_entry
            ve.value_set_id = vs.preamble.id
            fid = vs.match[0].id if vs.match else 1     # p4c-barefoot lists no match field: one, id 1
            for value in item.members:
                ve.members.add().match.add(field_id=fid).exact.value = encode(value)
        elif isinstance(item, RegisterFill):
            re_ = u.entity.register_entry      # no index: every cell (P4Runtime's wildcard write)
            re_.register_id = self.p4info.register(item.register).preamble.id
            re_.data.bitstring = encode(item.value)
        elif isinstance(item, TableEntry):
            u.entity.table_entry.CopyFrom(self._table_entry(item, op != "delete"))
        elif isinstance(item, McGroup):
            g = u.entity.packet_replication_engine_entry.multicast_group_entry
            g.multicast_group_id = item.group
            for port, instance in item.replicas:
                g.replicas.add(egress_port=port, instance=instance)
        else:
            raise TypeError(f"no P4Runtime update for {item!r}")
        return [u]

    def write(self, writes: list) -> None:
        """One WriteRequest of every write; P4RuntimeError naming each rejected one (bmv2
        applies the others: `applied` lists them)."""
        if not writes:
            return
        updates, owner = [], []
        for k, (op, item) in enumerate(writes):
            for u in self.updates(op, item):
                updates.append(u)
                owner.append(k)
        errors = self.client.write(updates)
        if not errors:
            return
        bad: dict = {}
        for k, (code, message) in zip(owner, errors):
            if code != 0:
                bad.setdefault(k, f"{CODES.get(code, code)}: {message}")
        rejected = [(op, item, bad[k]) for k, (op, item) in enumerate(writes) if k in bad]
        unknown = {k for k, (code, _) in zip(owner, errors) if code == UNKNOWN_OUTCOME}
        # an update of unknown outcome may have applied: taken back too
        applied = [(op, item) for k, (op, item) in enumerate(writes) if k not in bad or k in unknown]
        first = rejected[0]
        raise P4RuntimeError(f"the switch (P4Runtime, {self.client.address}) rejected {len(rejected)} of "
                             f"{len(writes)} writes; first: {first[0]} {describe(first[1])}: {first[2]}",
                             rejected, applied)

    # ---------------------------------------------------------------- reads

    def read_counters(self, counter: str, first: int, count: int) -> list[int]:
        return read_cells(self.client, self.p4info, counter, range(first, first + count))

    def table_keys(self, table: str) -> list[tuple]:
        """The match values of every entry of a table, as TableEntry.key's second half."""
        e = self.pb.Entity()
        e.table_entry.table_id = self.p4info.table(table).preamble.id
        names = {m.id: m.name for m in self.p4info.table(table).match_fields}
        order = [m.name for m in self.p4info.table(table).match_fields]
        keys = []
        for got in self.client.read([e]):
            values = {names[m.field_id]: int.from_bytes(m.exact.value, "big") for m in got.table_entry.match}
            keys.append(tuple(values[n] for n in order))
        return keys

    def groups(self) -> dict:
        """{multicast group id: sorted [(egress port, rid)]} of every group on the switch."""
        e = self.pb.Entity()
        e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0     # all
        out = {}
        for got in self.client.read([e]):
            g = got.packet_replication_engine_entry.multicast_group_entry
            out[g.multicast_group_id] = sorted((r.egress_port, r.instance) for r in g.replicas)
        return out

    def close(self) -> None:
        self.client.close()


def main(argv=None) -> int:
    """`python -m thc_ps.p4.p4runtime --address A --p4info P --blocks N`: the event counters of
    blocks 0..N-1, one `packets=N` line per cell as simple_switch_CLI prints them (read by
    p4/harness/mininet_thc.py, whose Debian python has no P4Runtime client)."""
    import argparse

    from thc_ps.p4.entries import EVENTS_COUNTER
    from thc_ps.p4.spec import EVENT_CELLS, EVENTS
    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--p4info", required=True)
    ap.add_argument("--blocks", type=int, default=1)
    args = ap.parse_args(argv)
    client = P4RuntimeClient(args.address, primary=False)
    try:
        cells = [b * EVENT_CELLS + e for b in range(args.blocks) for e in range(len(EVENTS))]
        for i, n in zip(cells, read_cells(client, P4Info.load(args.p4info), EVENTS_COUNTER, cells)):
            print(f"{EVENTS_COUNTER}[{i}]= (packets={n})")
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
