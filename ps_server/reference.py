"""The PS aggregation logic in plain Python/numpy — the executable specification.

The C engine (`ps_server/_fastpath.c`) implements exactly the same rules and is
tested against this class on identical packet sequences.

Per slot (THC paper Pseudocode 1, with SwitchML's loss handling, docs/prior-art.md §2.1):
  round, contributor count, worker bitmap, the accumulated lanes, and a kept
  copy of the completed result plus the previous round's result (shadow copy).

For a DATA/NORM packet of round r at slot s whose current round is R:
  r > R            new round: reset count/bitmap/lanes (the old result becomes
                   the shadow copy when r = R + 1), then aggregate it
  r = R, new bit   aggregate (lookup-and-sum, float sum or max); at ⌈q·n⌉
                   contributors the result is fanned out to every worker (one
                   datagram to the job's result group when it has one)
  r = R, bit seen  duplicate: dropped; if the round is complete the kept result
                   is unicast back (the sender lost it)
  r = R, complete  late contribution after partial aggregation: counted,
  and bit unseen   dropped, and the result unicast to it
  r = R − 1        a retransmission from a worker that lost the previous
                   result: the shadow copy is unicast if there is one
  otherwise        stale: STRAGGLER notification carrying R
Loss notices (docs/protocol.md §3): a worker sends a phase's chunks in order and consecutive
chunks on a shard take consecutive slots, so when rank w has contributed to data slot s + 1
(slot 0 after the last) at the round that follows s's but not to s, w's packet for s was
lost (or overtaken).  When s's round is open and one contribution short of its quorum
without w, the PS sends w a NOTICE for s (its round, offset, count, bitmap and contributors
so far), so that w resends it at once instead of after a timeout (`notices`).  It checks
after each DATA contribution it aggregates: the contributor's slot before, and the
contributed slot's missing ranks.  A switch cannot send them (`notices=False` is its rules).
A round more than ROUND_WINDOW ahead of R (or of 0 for a slot not used yet) is
dropped as `ahead`, so no single packet can move a slot out of the workers' reach.
Every malformed or unauthorized datagram is counted under its reason and dropped:
a packet is aggregated only when its job id and nonce are this job's and its
(worker id, source address, token) is a current registration.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from thc_ps.proto import blob as B
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig, parse_group
from thc_ps.proto.packing import pack_lanes, unpack_indices
from thc_ps.ps_server.engine import serve_by_process

DROP_REASONS = ("malformed", "wrong_version", "unknown_job", "slot_out_of_range",
                "worker_out_of_range", "unregistered", "stale", "duplicate", "late", "codec_error",
                "ahead")
COUNTERS = ("packets_in", "bytes_in", "packets_out", "bytes_out", "rounds_completed",
            "partial_rounds", "results_resent", "stragglers_notified", "notices")


@dataclass
class _Result:
    round: int
    payload: bytes
    bitmap: int
    contributors: int
    offset: int
    count: int


@dataclass
class _Slot:
    active: bool = False
    round: int = 0
    count: int = 0
    bitmap: int = 0
    offset: int = 0
    elems: int = 0
    acc: np.ndarray | None = None
    result: _Result | None = None       # kept copy of the current round's result
    previous: _Result | None = None     # shadow copy of round − 1


class SlotSpace:
    """The PS's slots, shared by the jobs' engines in disjoint regions [base, base + size):
    the twin of the C engine's SlotSpace and of a switch's register arrays.  An engine claims
    its region when it is made and `close()` gives it back cleared."""

    def __init__(self, size: int):
        if not 1 <= size <= 65536:
            raise ValueError(f"a slot space holds 1..65536 slots (the 16-bit slot field), got {size}")
        self.size = size
        self.slots = [_Slot() for _ in range(size)]
        self.owner: list = [None] * size

    def claim(self, owner, base: int, total: int) -> None:
        if base < 0 or base + total > self.size:
            raise ValueError(f"region {base}..{base + total - 1} does not fit the slot space of "
                             f"{self.size} slots")
        taken = next((i for i in range(base, base + total) if self.owner[i] is not None), None)
        if taken is not None:
            raise ValueError(f"region {base}..{base + total - 1} overlaps another job's region at "
                             f"slot {taken}")
        for i in range(base, base + total):
            self.owner[i] = owner
            self.slots[i] = _Slot()

    def release(self, owner) -> None:
        for i, o in enumerate(self.owner):
            if o is owner:
                self.owner[i] = None
                self.slots[i] = _Slot()

    def used(self) -> int:
        return sum(o is not None for o in self.owner)

    def slot_state(self, i: int) -> tuple:
        st = self.slots[i]
        return (int(st.active), st.round, st.bitmap, st.count)


class _Region:
    """A job's slots: index s is slot base + s of the space."""

    def __init__(self, space: SlotSpace, base: int, total: int):
        self.space, self.base, self.total = space, base, total

    def __getitem__(self, s: int) -> _Slot:
        if not 0 <= s < self.total:
            raise IndexError(f"slot {s} outside the region of {self.total}")
        return self.space.slots[self.base + s]

    def __len__(self) -> int:
        return self.total


@dataclass
class _BlobRound:
    """One round of a decode–sum–re-encode codec: reassembly per worker, then the result."""

    round: int
    parts: dict = field(default_factory=dict)       # worker -> Reassembly
    bitmap: int = 0
    count: int = 0
    frag_counts: dict = field(default_factory=dict)  # worker -> its number of uplink fragments
    result: list | None = None                       # [(offset, fragment payload)]


@dataclass
class Stats:
    counters: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    drops: dict = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def as_dict(self) -> dict:
        return {**self.counters, "drops": dict(self.drops)}

    __call__ = as_dict      # ReferencePS.stats() -> dict, as every engine (thc_ps.ps_server.engine)


class ReferencePS:
    """Packet-in, packets-out PS for one job; no sockets (the server shell adds them)."""

    def __init__(self, job: JobConfig, nonce: int = 0, space: SlotSpace | None = None, base: int = 0,
                 notices: bool = True):
        """`space`/`base`: the job's slots are slots base.. of a shared SlotSpace (else its own).
        `notices`: send loss notices (the software PS); False is a switch's rules."""
        self.job = job
        self.nonce = nonce
        self.notices = notices
        self.group = parse_group(job.result_group)       # (ip, port) or None
        self.table = np.asarray(job.table or (0,), dtype=np.int64)
        total = job.slots + job.norm_slots
        self.space = space or SlotSpace(total)
        self.base = base if space is not None else 0
        self.space.claim(self, self.base, total)
        self.slots = _Region(self.space, self.base, total)
        self.closed = False
        # the PS's data thread processes while its control thread (un)registers ranks: one at a time
        self._lock = threading.Lock()
        self.workers: dict[int, tuple] = {}
        self.tokens: dict[int, int] = {}
        self.stats = Stats()
        self._blob_cur: _BlobRound | None = None
        self._blob_prev: _BlobRound | None = None
        self._codec = None
        self._codec_state: dict = {}
        if job.blob:
            from thc_ps.compression import registry
            self._codec = registry.get(job.codec, **job.codec_params)

    def register(self, rank: int, ip: str, port: int, token: int = 0) -> None:
        """Bind a rank to its source address and registration token (replaces an old one)."""
        if not 0 <= rank < self.job.num_workers:
            raise ValueError(f"worker id {rank} out of range 0..{self.job.num_workers - 1}")
        with self._lock:
            self.workers[rank] = (ip, int(port))
            self.tokens[rank] = token

    def unregister(self, rank: int) -> None:
        """Forget a rank (it left or its lease expired): its packets are `unregistered`."""
        with self._lock:
            self.workers.pop(rank, None)
            self.tokens.pop(rank, None)

    def region(self) -> tuple:
        """(base, size) of this job's slots in its SlotSpace."""
        return self.base, len(self.slots)

    def restore_slot(self, s: int, round: int, count: int, bitmap: int, offset: int, lanes=(),
                     previous: tuple | None = None) -> None:
        """Put slot s in a state packets leave it in, for replaying a switch's tests from its
        registers (p4/replay.py): round `round` at `offset` with `count` contributors
        (`bitmap`) whose values summed (or, in a norm slot, maxed) to `lanes` (zeros when
        empty), a kept result once the count reached the quorum, and `previous` = (count,
        bitmap, offset, lanes) of round − 1's kept result (the shadow copy) or None."""
        norm = s >= self.job.slots
        kind = H.NORM if norm else H.DATA
        elems = 1 if norm else self.job.elems_per_packet

        def acc(values):
            values = np.asarray(values, dtype=np.int64)
            return values if values.size else np.zeros(elems, dtype=np.int64)

        st = self.slots[s]
        st.active, st.round, st.count, st.bitmap, st.offset, st.elems = True, round, count, bitmap, offset, elems
        st.acc = acc(lanes)
        st.result = (_Result(round, self._result_payload(kind, st.acc), bitmap, count, offset, elems)
                     if count >= self.job.quorum_count else None)
        st.previous = None
        if previous is not None:
            p_count, p_bitmap, p_offset, p_lanes = previous
            st.previous = _Result(round - 1, self._result_payload(kind, acc(p_lanes)), p_bitmap, p_count,
                                  p_offset, elems)

    def close(self) -> None:
        """The job ended: give the region back, cleared; later packets count as unknown_job."""
        if not self.closed:
            self.closed = True
            self.space.release(self)

    def serve(self, fd: int, duration_ms: int, gro: bool = True, gso: bool = True) -> int:
        """The UDP socket `fd` for `duration_ms`, one datagram at a time through `process`
        (coalesced receives are split; replies go out one by one)."""
        return serve_by_process(self, fd, duration_ms)

    # ------------------------------------------------------------------ helpers
    def _drop(self, reason: str) -> list:
        self.stats.drops[reason] += 1
        return []

    def _payload_ok(self, h: H.Header) -> bool:
        job = self.job
        if h.type == H.NORM:
            return h.elem_bits == 32 and h.op == H.OP_MAX_U32 and h.count <= job.elems_per_packet \
                and h.payload_len == 4 * h.count
        if job.blob:
            return h.elem_bits == 8 and h.op == H.OP_BLOB and h.count <= job.elems_per_packet \
                and h.payload_len == B.SUB_SIZE + h.count
        return h.elem_bits == job.up_bits and h.op == job.op and h.count <= job.elems_per_packet \
            and h.payload_len == job.up_payload_len(h.count)

    def _values(self, h: H.Header, payload) -> np.ndarray:
        if h.type == H.NORM:
            return np.frombuffer(payload, dtype=">u4").astype(np.int64)
        if self.job.op == H.OP_FLOAT_SUM:
            return np.frombuffer(payload, dtype=">f4").astype(np.float32)
        return self.table[unpack_indices(bytes(payload), self.job.bits, h.count)]

    def _result_payload(self, h_type: int, acc: np.ndarray) -> bytes:
        if h_type == H.NORM:
            return acc.astype(">u4").tobytes()
        if self.job.op == H.OP_FLOAT_SUM:
            return acc.astype(">f4").tobytes()
        return pack_lanes(acc, self.job.lane_bits)

    def _result_packet(self, slot: int, res: _Result, data_type: int, dest: int | None) -> bytes:
        norm = data_type == H.NORM
        h = H.Header(type=H.NORM_RESULT if norm else H.RESULT, job_id=self.job.job_id,
                     worker_id=0 if dest is None else dest, num_workers=self.job.num_workers,
                     elem_bits=32 if norm else self.job.down_bits, slot=slot, round=res.round,
                     offset=res.offset, count=res.count, bitmap=res.bitmap,
                     contributors=res.contributors,
                     op=H.OP_MAX_U32 if norm else self.job.op,
                     flags=0 if dest is None else H.F_RESENT, nonce=self.nonce)
        return H.build(h, res.payload)

    def _emit(self, out: list, pkt: bytes, dest: int) -> None:
        out.append((pkt, self.workers[dest]))
        self.stats.counters["packets_out"] += 1
        self.stats.counters["bytes_out"] += len(pkt)

    def _fan_out(self, out: list, pkt: bytes) -> None:
        """A result to every registered worker: one datagram to the job's result group, or
        one per worker when it has none."""
        if self.group is not None:
            out.append((pkt, self.group))
            self.stats.counters["packets_out"] += 1
            self.stats.counters["bytes_out"] += len(pkt)
            return
        for wid in sorted(self.workers):
            self._emit(out, pkt, wid)

    def _unicast_result(self, slot: int, res: _Result, data_type: int, dest: int) -> list:
        out: list = []
        self.stats.counters["results_resent"] += 1
        self._emit(out, self._result_packet(slot, res, data_type, dest), dest)
        return out

    # ------------------------------------------------------------------ main entry
    def process(self, datagram: bytes, addr: tuple) -> list:
        """Handle one datagram from `addr`; returns [(bytes, (ip, port)), ...] to send.  Safe
        beside `register`/`unregister` from another thread (a rank leaving while its resend is
        answered: before the lock, a KeyError there ended the PS's data thread)."""
        with self._lock:
            return self._process(datagram, addr)

    def _process(self, datagram: bytes, addr: tuple) -> list:
        c = self.stats.counters
        c["packets_in"] += 1
        c["bytes_in"] += len(datagram)
        checked = self._validate(datagram, addr)
        if isinstance(checked, str):
            return self._drop(checked)
        h, payload = checked
        if self.job.blob and h.type == H.DATA:
            return self._blob(h, bytes(payload))
        st = self.slots[h.slot]
        out = self._round_step(st, h)
        if out is not None:
            return out
        return self._aggregate(st, h, payload) + self._notices(h, st)

    def process_segments(self, buffer: bytes, seg_size: int, addr: tuple) -> list:
        """A UDP GRO batch: every segment is processed exactly as a lone datagram."""
        out: list = []
        for seg in H.split_segments(buffer, seg_size):
            out += self.process(bytes(seg), addr)
        return out

    def _validate(self, datagram: bytes, addr: tuple):
        """The validation half of docs/design.md's rules: (header, payload) of a well-formed,
        authorized DATA/NORM packet of this job, or the name of the drop counter."""
        try:
            h, payload = H.parse(datagram)
        except H.PacketError as exc:
            return exc.reason
        job = self.job
        if h.type not in (H.DATA, H.NORM):
            return "malformed"
        if h.job_id != job.job_id or h.nonce != self.nonce or self.closed:
            return "unknown_job"
        if h.worker_id >= job.num_workers:
            return "worker_out_of_range"
        if self.workers.get(h.worker_id) != (addr[0], int(addr[1])) \
                or self.tokens.get(h.worker_id) != h.token:
            return "unregistered"
        # the region check: a slot is relative to the job's region and must lie inside it
        lo, hi = (job.slots, job.slots + job.norm_slots) if h.type == H.NORM else (0, job.slots)
        if not lo <= h.slot < hi:
            return "slot_out_of_range"
        if h.num_workers != job.num_workers or (h.count == 0 and not job.blob) or not self._payload_ok(h):
            return "malformed"
        return h, payload

    def _straggler(self, st: _Slot, h: H.Header) -> list:
        self.stats.drops["stale"] += 1
        self.stats.counters["stragglers_notified"] += 1
        job = self.job
        note = H.build(H.Header(type=H.STRAGGLER, job_id=job.job_id, worker_id=h.worker_id,
                                num_workers=job.num_workers, slot=h.slot, round=st.round,
                                offset=h.offset, op=h.op, nonce=self.nonce))
        out: list = []
        self._emit(out, note, h.worker_id)
        return out

    def _notices(self, h: H.Header, st: _Slot) -> list:
        """After rank w's DATA contribution to slot s: a NOTICE to w for the slot before, and
        to each rank missing from s, when their packet for it was lost (module docstring)."""
        out: list = []
        if not self.notices or h.type != H.DATA:
            return out
        self._notice(h.slot - 1 if h.slot else self.job.slots - 1, h.worker_id, out)
        if st.result is None and st.count == self.job.quorum_count - 1:
            for w in sorted(self.workers):
                self._notice(h.slot, w, out)
        return out

    def _notice(self, s: int, w: int, out: list) -> None:
        """A NOTICE to rank w for data slot s if s's open round is one short of its quorum
        without w and w contributed to the next slot at the round after s's."""
        st, nxt = self.slots[s], self.slots[(s + 1) % self.job.slots]
        if not st.active or st.result is not None or st.count != self.job.quorum_count - 1 \
                or st.bitmap >> w & 1 or w not in self.workers:
            return
        if not (nxt.active and nxt.bitmap >> w & 1
                and nxt.round == (st.round + (s == self.job.slots - 1)) & 0xFFFFFFFF):
            return
        self.stats.counters["notices"] += 1
        job = self.job
        self._emit(out, H.build(H.Header(type=H.NOTICE, job_id=job.job_id, worker_id=w,
                                         num_workers=job.num_workers, slot=s, round=st.round,
                                         offset=st.offset, count=st.elems, bitmap=st.bitmap,
                                         contributors=st.count, op=job.op, nonce=self.nonce)), w)

    def _round_step(self, st: _Slot, h: H.Header) -> list | None:
        """The round half of the rules, one branch per row of docs/design.md's table: the
        packets to send for a packet that is answered or dropped, None to aggregate it."""
        bit = 1 << h.worker_id
        if h.round > (st.round if st.active else 0) + H.ROUND_WINDOW:             # ahead
            return self._drop("ahead")
        if not st.active or h.round > st.round:                                   # r > R
            st.previous = st.result if (st.active and st.result is not None
                                        and h.round == st.round + 1) else None
            st.active, st.round, st.count, st.bitmap = True, h.round, 0, 0
            st.offset, st.elems, st.result = h.offset, h.count, None
            st.acc = None
            return None
        if h.round == st.round:
            if h.offset != st.offset or h.count != st.elems:
                return self._drop("malformed")
            if st.bitmap & bit:                                                   # duplicate
                if st.result is not None:
                    return self._unicast_result(h.slot, st.result, h.type, h.worker_id)
                return self._drop("duplicate")
            if st.result is not None:                                             # late
                self.stats.drops["late"] += 1
                return self._unicast_result(h.slot, st.result, h.type, h.worker_id)
            return None                                                           # new worker
        if h.round + 1 == st.round and st.previous is not None \
                and h.offset == st.previous.offset and h.count == st.previous.count:  # r = R − 1
            return self._unicast_result(h.slot, st.previous, h.type, h.worker_id)
        return self._straggler(st, h)                                             # stale

    def _aggregate(self, st: _Slot, h: H.Header, payload) -> list:
        """r = R, new worker: add the contribution; at quorum, the result to every worker."""
        values = self._values(h, payload)
        if st.acc is None:
            st.acc = values.copy()
        elif h.type == H.NORM:
            np.maximum(st.acc, values, out=st.acc)
        else:
            st.acc += values
        st.bitmap |= 1 << h.worker_id
        st.count += 1
        if st.count < self.job.quorum_count:
            return []
        st.result = _Result(st.round, self._result_payload(h.type, st.acc), st.bitmap, st.count,
                            st.offset, st.elems)
        c = self.stats.counters
        c["rounds_completed"] += 1
        if st.count < self.job.num_workers:
            c["partial_rounds"] += 1
        out: list = []
        self._fan_out(out, self._result_packet(h.slot, st.result, h.type, None))
        return out

    # ------------------------------------------------------------------ BLOB codecs
    def _blob_result_packets(self, rnd: _BlobRound, which, dest: int | None) -> list:
        out: list = []
        for off, frag in which:
            h = H.Header(type=H.RESULT, job_id=self.job.job_id, worker_id=0 if dest is None else dest,
                         num_workers=self.job.num_workers, elem_bits=8, slot=0, round=rnd.round,
                         offset=off, count=len(frag) - B.SUB_SIZE, bitmap=rnd.bitmap,
                         contributors=rnd.count, op=H.OP_BLOB,
                         flags=0 if dest is None else H.F_RESENT, nonce=self.nonce)
            pkt = H.build(h, frag)
            if dest is None:
                self._fan_out(out, pkt)
            else:
                self._emit(out, pkt, dest)
        return out

    def _blob_resend(self, rnd: _BlobRound, h: H.Header, total: int) -> list:
        """Answer uplink fragment f with the result fragments j ≡ f (mod F) (proto/blob.py)."""
        self.stats.counters["results_resent"] += 1
        per = self.job.elems_per_packet
        nfrag = B.fragment_count(total, per + B.SUB_SIZE)
        f = h.offset // per
        return self._blob_result_packets(rnd, rnd.result[f % nfrag::nfrag], h.worker_id)

    def _blob(self, h: H.Header, payload: bytes) -> list:
        try:
            total, dim, data = B.parse_fragment(payload)
        except B.BlobError:
            return self._drop("malformed")
        if h.offset + len(data) > total or (not data and total) or dim == 0:
            return self._drop("malformed")      # checked before it can move the round on
        cur, prev = self._blob_cur, self._blob_prev
        if h.round > (cur.round if cur is not None else 0) + H.ROUND_WINDOW:
            return self._drop("ahead")
        if cur is None or h.round > cur.round:
            self._blob_prev = cur if (cur is not None and cur.result is not None
                                      and h.round == cur.round + 1) else None
            cur = self._blob_cur = _BlobRound(h.round)
        elif h.round < cur.round:
            if prev is not None and h.round == prev.round:
                return self._blob_resend(prev, h, total)
            return self._straggler(cur, h)
        bit = 1 << h.worker_id
        if cur.result is not None:
            if not cur.bitmap & bit:
                self.stats.drops["late"] += 1
            return self._blob_resend(cur, h, total)
        part = cur.parts.get(h.worker_id)
        try:
            if part is None:
                part = cur.parts[h.worker_id] = B.Reassembly(total, dim)
            added = part.add(h.offset, data, total, dim)
        except B.BlobError:
            return self._drop("malformed")
        if not added:
            return self._drop("duplicate")
        if not part.complete or cur.bitmap & bit:
            return []
        cur.bitmap |= bit
        cur.count += 1
        if cur.count < self.job.quorum_count:
            return []
        return self._blob_aggregate(cur, dim)

    def _blob_aggregate(self, cur: _BlobRound, dim: int) -> list:
        from thc_ps.compression.codec import CodecError, Context
        members = [w for w in sorted(cur.parts) if cur.bitmap >> w & 1]
        if any(cur.parts[w].dim != dim for w in members):
            return self._drop("malformed")
        ctx = Context(key=str(dim), dim=dim, round_no=cur.round, contributors=len(members))
        state = self._codec_state.setdefault(dim, self._codec.new_ps_state())
        try:
            down = self._codec.aggregate([cur.parts[w].payload() for w in members], state, ctx)
        except CodecError:
            # a worker's payload does not decode: forget the contributions, keep serving
            self.stats.drops["codec_error"] += 1
            cur.parts.clear()
            cur.bitmap = cur.count = 0
            return []
        cur.result = B.fragments(down, dim, self.job.elems_per_packet + B.SUB_SIZE)
        self.stats.counters["rounds_completed"] += 1
        if cur.count < self.job.num_workers:
            self.stats.counters["partial_rounds"] += 1
        return self._blob_result_packets(cur, cur.result, None)
