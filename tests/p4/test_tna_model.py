"""The Tofino program's slot logic, step for step in Python, against the software PS.

p4/tofino/thc_tna.p4 splits bmv2's one atomic slot update into a chain of registers (round + 1,
offset, arrivals, count << 24 | bitmap, shadow copy, lane words) with 32-bit round arithmetic,
over two passes of the ingress: pass 1 validates and runs the round, offset, arrival and
contributor registers, then the packet recirculates with a bridge header; pass 2 keeps the
shadow copy, decides the verdict and runs the lanes.  No Tofino model runs here, so this test
runs the same chain as the P4 ingress does — each function below is one RegisterAction or one
block of p4/templates/tna/ingress.p4 — on random packet sequences (loss, duplicates, late,
previous, stale and far-future rounds, offset mismatches, quorum < n), with the second passes
waiting in a FIFO (the recirculation port) while later packets make their first pass, and
requires the software PS's verdicts, counters and results for every packet."""
import collections

import numpy as np
import pytest

from thc_ps.proto import headers as H
from thc_ps.proto.packing import pack_indices
from thc_ps.ps_server.reference import ReferencePS

from thc_ps.p4.control import switch_job

W = H.ROUND_WINDOW
M32 = 0xFFFFFFFF
ONE = 1 << 24


class TnaSlots:
    """The registers of one TNA pipeline (per slot) and the ingress's slot rules."""

    def __init__(self, job):
        self.job = job
        self.round_reg, self.offset_reg, self.arrived_reg, self.contrib_reg = {}, {}, {}, {}
        self.shadow_reg, self.acc = {}, {}
        self.quorum_cb = job.quorum_count << 24

    # one RegisterAction each
    def round_near(self, s, rnd):
        last = self.round_reg.get(s, 0)
        if last <= rnd:
            self.round_reg[s] = (rnd + 1) & M32
        return last

    def round_far(self, s, rnd):
        cell = self.round_reg.get(s, 0)
        if cell <= rnd and cell + (W - 1) >= rnd:         # 34-bit SALU compare: no wrap
            self.round_reg[s] = (rnd + 1) & M32
        return cell

    def contrib_start(self, s, me_cb, keep):
        cell = self.contrib_reg.get(s, 0)
        self.contrib_reg[s] = me_cb
        return cell if keep and cell >= self.quorum_cb else 0

    def contrib_add(self, s, me_cb):
        if self.contrib_reg.get(s, 0) < self.quorum_cb:
            self.contrib_reg[s] = self.contrib_reg.get(s, 0) + me_cb
        return self.contrib_reg[s]

    def pass1(self, h):
        """Pass 1: the round, offset, arrival and contributor registers.  Returns
        ('done', outcome) for a packet finished here, or ('pass2', bridge)."""
        s, rnd, me = h.slot, h.round, 1 << h.worker_id
        me_cb = ONE | me
        last = self.round_far(s, rnd) if rnd > W else self.round_near(s, rnd)
        diff = ((rnd + 1) - last) & M32
        gap = max(rnd - last, 0)                          # round |-| last (saturating)
        if last == 0:
            rel = "ahead" if rnd > W else "new"
        elif gap >= W:
            rel = "ahead"
        elif diff == 0:
            rel = "same"
        elif diff == M32:
            rel = "prev"
        elif diff <= W:
            rel = "new"
        else:
            rel = "stale"
        bridge = {"me": me, "cb": me_cb, "seen": 0, "shadow_cb": 0, "off_old": 0}
        if rel == "new":
            bridge.update(kind="first", off_old=self.offset_reg.get(s, 0))
            self.offset_reg[s] = h.offset
            self.arrived_reg[s] = me
            bridge["shadow_cb"] = self.contrib_start(s, me_cb, keep=diff == 1)
        elif rel == "same":
            if (self.offset_reg.get(s, 0) - h.offset) & M32:     # offset_cmp
                return "done", ("malformed", None, None)
            seen = self.arrived_reg.get(s, 0) & me                # arrived_add
            self.arrived_reg[s] = self.arrived_reg.get(s, 0) | me
            cb = self.contrib_add(s, me_cb) if not seen else self.contrib_reg.get(s, 0)
            bridge.update(kind="same", seen=seen, cb=cb)
        elif rel == "prev":
            bridge.update(kind="prev", off_old=h.offset)
        elif rel == "stale":
            return "done", ("stale", None, ("straggler", (last - 1) & M32))
        else:
            return "done", ("ahead", None, None)
        return "pass2", bridge

    def pass2(self, h, values, b):
        """Pass 2: the shadow copy, the verdict table, the lanes and the outputs."""
        s, bank = h.slot, 2 * h.slot + (h.round & 1)
        if b["kind"] == "first":
            self.shadow_reg[s] = (b["shadow_cb"], b["off_old"])
        elif b["kind"] == "prev":
            kept, offset = self.shadow_reg.get(s, (0, 0))
            b["cb"] = kept if offset == b["off_old"] else 0
        cb = b["cb"]
        mine = cb & b["me"]
        below_quorum = max(self.job.quorum_count - (cb >> 24), 0)       # quorum |-| count
        if b["kind"] == "first":
            verdict = "done" if self.job.quorum_count == 1 else "agg"
        elif b["kind"] == "prev":
            verdict = "resend" if cb else "stale"
        elif not mine:
            verdict = "late"
        elif not b["seen"]:
            verdict = "agg" if below_quorum else "done"
        else:
            verdict = "dup" if below_quorum else "resend"
        lanes = None
        norm = h.type == H.NORM                   # norm_acc: the maximum, not the sum
        if b["kind"] == "first":
            lanes = self.acc[bank] = values.copy()
        elif verdict in ("agg", "done"):
            lanes = self.acc[bank] = np.maximum(self.acc[bank], values) if norm else self.acc[bank] + values
        elif verdict in ("resend", "late"):
            lanes = self.acc[bank]
        if norm and lanes is not None:            # the RESULT's payload bytes: one big-endian u32
            lanes = np.frombuffer(np.asarray(lanes, dtype=">u4").tobytes(), np.uint8)
        if verdict == "stale":                    # the slot is at the packet's round + 1
            return "stale", None, ("straggler", (h.round + 1) & M32)
        if verdict == "dup":
            return "duplicate", None, None
        if verdict == "agg":
            return None, None, None
        if verdict == "done":
            partial = max(self.job.num_workers - (cb >> 24), 0)          # n |-| count
            return "rounds_completed", "partial_rounds" if partial else None, ("mcast", cb, tuple(lanes))
        return "results_resent", "late" if verdict == "late" else None, ("unicast", cb, tuple(lanes))


def reference_view(ps, before, out):
    """The software PS's answer in the model's terms."""
    drops = {k: v - before["drops"][k] for k, v in ps.stats.drops.items() if v != before["drops"][k]}
    resent = ps.stats.counters["results_resent"] - before["results_resent"]
    done = ps.stats.counters["rounds_completed"] - before["rounds_completed"]
    partial = ps.stats.counters["partial_rounds"] - before["partial_rounds"]
    events = [k for k in ("malformed", "duplicate", "ahead", "stale") if k in drops]
    event = events[0] if events else "rounds_completed" if done else "results_resent" if resent else None
    extra = "late" if "late" in drops else "partial_rounds" if partial else None
    if not out:
        return event, extra, None
    h, payload = H.parse(out[0][0])
    if h.type == H.STRAGGLER:
        return event, extra, ("straggler", h.round)
    kind = "unicast" if h.flags & H.F_RESENT else "mcast"
    return event, extra, (kind, h.contributors << 24 | h.bitmap, tuple(np.frombuffer(payload, np.uint8)))


@pytest.mark.parametrize("quorum, seed", [(1.0, 0), (1.0, 1), (0.75, 2), (0.75, 3), (0.25, 4)])
def test_tna_slot_chain_matches_the_software_ps(quorum, seed):
    n = 4
    job = switch_job(n, quorum=quorum, slots=4, norm_slots=1)
    ps = ReferencePS(job, notices=False)       # a switch sends no loss notices
    for w in range(n):
        ps.register(w, "10.0.0.1", 5000 + w)
    model = TnaSlots(job)
    table = np.asarray(job.table, dtype=np.int64)
    rng = np.random.default_rng(seed)
    rounds = np.ones(job.slots, dtype=np.int64)
    seen = set()
    want, got = {}, {}
    recirculating = collections.deque()             # second passes waiting, first in first out
    for _ in range(3000):
        slot = int(rng.integers(0, job.slots))
        w = int(rng.integers(0, n))
        r = int(rounds[slot] + rng.choice([-3, -1, -1, 0, 0, 0, 0, 1, 2]))
        if rng.random() < 0.01:
            r = int(rng.choice([W, W + 1, rounds[slot] + W, rounds[slot] + W + 1, M32, 0]))
        r = max(r, 0) & M32
        if rng.random() < 0.12:
            rounds[slot] += 1
        offset = 32 * (r % 3) if rng.random() > 0.04 else 7
        z = rng.integers(0, 16, H.MAX_WORKERS).astype(np.uint8)
        h = H.Header(type=H.DATA, job_id=job.job_id, worker_id=w, num_workers=n, elem_bits=4, slot=slot,
                     round=r, offset=offset, count=32, op=H.OP_LOOKUP_SUM)
        before = {"drops": dict(ps.stats.drops), **ps.stats.counters}
        out = ps.process(H.build(h, pack_indices(z, 4).tobytes()), ("10.0.0.1", 5000 + w))
        want[len(want)] = reference_view(ps, before, out)
        if r > rounds[slot] and want[len(want) - 1][0] not in ("ahead", "malformed"):
            rounds[slot] = r                      # a far round the PS took: go on from there
        where, result = model.pass1(h)
        if where == "done":
            got[len(got)] = result
        else:
            recirculating.append((len(got), h, table[z].astype(np.uint8), result))
            got[len(got)] = "in pass 2"
        for _ in range(min(len(recirculating), int(rng.integers(0, 3)))):   # the port drains in order
            k, *rest = recirculating.popleft()
            got[k] = model.pass2(*rest)
    while recirculating:
        k, *rest = recirculating.popleft()
        got[k] = model.pass2(*rest)
    for k in want:
        assert got[k] == want[k], (k, got[k], want[k])
        seen.update(got[k][:2])
    assert {"rounds_completed", "results_resent", "stale", "malformed", "ahead"} <= seen
    assert ("duplicate" in seen) == (job.quorum_count > 1)       # a duplicate needs an open round
    assert ("late" in seen) == ("partial_rounds" in seen) == (job.quorum_count < n)


def norm_code(x: float) -> np.ndarray:
    return H.float_to_ordered(np.array([x], np.float32)).astype(np.uint32)


def test_tna_chain_runs_a_scripted_round_like_the_software_ps():
    """Issue 54's sequence across packets, which p4testgen cannot run (one input packet per
    test; registers written by one test are never read by another: docs/p4.md, "p4testgen"):
    n = 4 workers at quorum 3/4 — a round of DATA and one of NORM, a duplicate, a late
    packet, a retransmission after completion, a straggler notice for a round with nothing
    kept and for one far behind, and a shadow-copy resend while the next round fills.  Each
    packet's first pass runs at once and its second pass after the next packet's first, as a
    recirculation port delays it; every answer is the software PS's, and the software PS's
    answers are the scripted ones."""
    n = 4
    job = switch_job(n, quorum=0.75, slots=4, norm_slots=1)
    ps = ReferencePS(job)
    for w in range(n):
        ps.register(w, "10.0.0.1", 5000 + w)
    model, table = TnaSlots(job), np.asarray(job.table, dtype=np.int64)
    rng = np.random.default_rng(54)
    data, norm = 1, job.slots
    script = [  # (worker, slot, round, what the software PS does)
        (0, data, 1, (None, None)), (0, data, 1, ("duplicate", None)), (1, data, 1, (None, None)),
        (2, data, 1, ("rounds_completed", "partial_rounds")), (3, data, 1, ("results_resent", "late")),
        (1, data, 1, ("results_resent", None)),
        (0, norm, 1, (None, None)), (1, norm, 1, (None, None)), (3, norm, 1, ("rounds_completed", "partial_rounds")),
        (2, norm, 1, ("results_resent", "late")),
        (3, data, 0, ("stale", None)),                  # round 0 = R − 1, but no round 0 was kept
        (0, data, 2, (None, None)),                     # round 2 starts; round 1's result is the shadow copy
        (2, data, 1, ("results_resent", None)),         # shadow-copy resend of round 1
        (1, data, 2, (None, None)), (3, data, 2, ("rounds_completed", "partial_rounds")),
        (1, data, 3, (None, None)), (2, data, 1, ("stale", None)),     # round 1 = R − 2: STRAGGLER from pass 1
    ]
    waiting, got, want = collections.deque(), {}, {}
    for k, (w, slot, rnd, scripted) in enumerate(script):
        kind = H.NORM if slot == norm else H.DATA
        if kind == H.NORM:
            values = norm_code(float(rng.random() * 10))
            h = H.Header(type=H.NORM, job_id=job.job_id, worker_id=w, num_workers=n, elem_bits=32, slot=slot,
                         round=rnd, offset=7, count=1, op=H.OP_MAX_U32)
            payload = values.astype(">u4").tobytes()
        else:
            z = rng.integers(0, 16, 32).astype(np.uint8)
            values = table[z].astype(np.uint8)
            h = H.Header(type=H.DATA, job_id=job.job_id, worker_id=w, num_workers=n, elem_bits=4, slot=slot,
                         round=rnd, offset=32 * rnd, count=32, op=H.OP_LOOKUP_SUM)
            payload = pack_indices(z, 4).tobytes()
        before = {"drops": dict(ps.stats.drops), **ps.stats.counters}
        out = ps.process(H.build(h, payload), ("10.0.0.1", 5000 + w))
        want[k] = reference_view(ps, before, out)
        assert want[k][:2] == scripted, (k, want[k][:2], scripted)
        where, result = model.pass1(h)
        if where == "done":
            got[k] = result
        else:
            waiting.append((k, h, values, result))
        while len(waiting) > 1:                          # one packet's first pass ahead of this one's second
            j, *rest = waiting.popleft()
            got[j] = model.pass2(*rest)
    while waiting:
        j, *rest = waiting.popleft()
        got[j] = model.pass2(*rest)
    assert got == want
    completed = [want[k][2] for k in want if want[k][0] == "rounds_completed"]
    assert [c[1] >> 24 for c in completed] == [3, 3, 3]            # quorum 3 of 4, every time
    shadow = want[12][2]
    assert shadow[0] == "unicast" and shadow[1:] == completed[0][1:]   # round 1's result, kept
