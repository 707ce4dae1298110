"""The Tofino program's slot logic, step for step in Python, against the software PS.

p4/tofino/thc_tna.p4 splits bmv2's one atomic slot update into a chain of registers (round + 1,
offset, arrivals, count << 24 | bitmap, shadow copy, lane words) with 32-bit round arithmetic.
No Tofino model runs here, so this test runs the same chain as the P4 ingress does — each
function below is one RegisterAction or one block of p4/templates/tna/ingress.p4 — on random
packet sequences (loss, duplicates, late, previous, stale and far-future rounds, offset
mismatches, quorum < n) and requires the software PS's verdicts, counters and results."""
import numpy as np
import pytest

from proto import headers as H
from proto.packing import pack_indices
from ps_server.reference import ReferencePS

from p4.control import switch_job

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

    def process(self, h, values):
        """(event, extra event, output): output is None, ('straggler', round) or
        ('mcast' | 'unicast', count << 24 | bitmap, lane sums)."""
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
        first, bank = False, 2 * s + (rnd & 1)
        if rel == "new":
            first = True
            off_old = self.offset_reg.get(s, 0)
            self.offset_reg[s] = h.offset
            self.arrived_reg[s] = me
            shadow_cb = self.contrib_start(s, me_cb, keep=diff == 1)
            self.shadow_reg[s] = (shadow_cb, off_old)
            cb = me_cb
            verdict = "done" if self.job.quorum_count == 1 else "agg"
        elif rel == "same":
            if self.offset_reg.get(s, 0) != h.offset:
                verdict = "malformed"
            else:
                seen = self.arrived_reg.get(s, 0) & me
                self.arrived_reg[s] = self.arrived_reg.get(s, 0) | me
                cb = self.contrib_add(s, me_cb) if not seen else self.contrib_reg.get(s, 0)
                below_quorum = max(self.job.quorum_count - (cb >> 24), 0)   # quorum |-| count
                if not cb & me:
                    verdict = "late"
                elif seen:
                    verdict = "dup" if below_quorum else "resend"
                else:
                    verdict = "agg" if below_quorum else "done"
        elif rel == "prev":
            kept, offset = self.shadow_reg.get(s, (0, 0))
            cb = kept if offset == h.offset else 0
            verdict = "resend" if cb else "stale"
        else:
            verdict = rel
        lanes = None
        if first:
            lanes = self.acc[bank] = values.copy()
        elif verdict in ("agg", "done"):
            lanes = self.acc[bank] = self.acc[bank] + values
        elif verdict in ("resend", "late"):
            lanes = self.acc[bank]
        if verdict in ("malformed", "dup", "ahead"):
            return {"malformed": "malformed", "dup": "duplicate", "ahead": "ahead"}[verdict], None, None
        if verdict == "stale":
            return "stale", None, ("straggler", (last - 1) & M32)
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
    ps = ReferencePS(job)
    for w in range(n):
        ps.register(w, "10.0.0.1", 5000 + w)
    model = TnaSlots(job)
    table = np.asarray(job.table, dtype=np.int64)
    rng = np.random.default_rng(seed)
    rounds = np.ones(job.slots, dtype=np.int64)
    seen = set()
    for _ in range(3000):
        slot = int(rng.integers(0, job.slots))
        w = int(rng.integers(0, n))
        r = int(rounds[slot] + rng.choice([-3, -1, -1, 0, 0, 0, 0, 1, 2]))
        if rng.random() < 0.01:
            r = int(rng.choice([W, W + 1, rounds[slot] + W, rounds[slot] + W + 1, M32, 0]))
        r = max(r, 0) & M32
        if rng.random() < 0.12:
            rounds[slot] += 1
        offset = 32 * (r % 3) if rng.random() > 0.02 else 7
        z = rng.integers(0, 16, H.MAX_WORKERS).astype(np.uint8)
        h = H.Header(type=H.DATA, job_id=job.job_id, worker_id=w, num_workers=n, elem_bits=4, slot=slot,
                     round=r, offset=offset, count=32, op=H.OP_LOOKUP_SUM)
        before = {"drops": dict(ps.stats.drops), **ps.stats.counters}
        out = ps.process(H.build(h, pack_indices(z, 4).tobytes()), ("10.0.0.1", 5000 + w))
        want = reference_view(ps, before, out)
        got = model.process(h, table[z].astype(np.uint8))
        assert got == want, (slot, w, r, offset)
        seen.update(got[:2])
    assert {"rounds_completed", "results_resent", "stale", "malformed", "ahead"} <= seen
    assert ("duplicate" in seen) == (job.quorum_count > 1)       # a duplicate needs an open round
    assert ("late" in seen) == ("partial_rounds" in seen) == (job.quorum_count < n)
