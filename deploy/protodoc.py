"""The generated tables of docs/protocol.md, from the definitions both ends use.

docs/protocol.md is prose with generated blocks between the markers

    <!-- generated: NAME -->
    …
    <!-- end generated -->

`python -m thc_ps.deploy.protodoc --write` regenerates them in place; `--check` exits 1 when the
document differs from what the code says (tests/test_protocol_doc.py runs the check).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np

from thc_ps.proto import control
from thc_ps.proto import headers as H
from thc_ps.proto.job import JobConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"

#: What each header field means (the layout itself comes from headers.FIELDS).
HEADER_MEANINGS = {
    "magic": "0x5448 (\"TH\")",
    "version": f"{H.VERSION}; any other value is dropped as `wrong_version`",
    "type": "packet type (table below)",
    "flags": "bit 0x01 RETRANSMIT: a worker's resend; bit 0x02 RESENT: a PS unicast of a kept result",
    "worker_id": "DATA/NORM: the sender's rank; unicast replies: the addressee; fan-out RESULTs: 0",
    "num_workers": "n as the sender believes it; the PS drops a DATA/NORM whose n differs (`malformed`)",
    "elem_bits": "DATA: index bits b (32 for float32, 8 for BLOB); RESULT: lane bits (32 for float32 sums, "
                 "8 for BLOB); NORM and NORM_RESULT: 32; STRAGGLER and NOTICE: 0",
    "job_id": "the job's id (`job.job_id` of the config reply)",
    "slot": "aggregator index: data slots 0..S−1, norm slots S..S+S_norm−1",
    "round": "the slot's round number (slots and rounds, below)",
    "offset": "coordinate offset of the first element in the tensor (BLOB: byte offset in the codec payload)",
    "count": "elements in the payload (BLOB: payload bytes after the 8-byte sub-header)",
    "payload_len": "bytes after the header; must equal the datagram's length − 40",
    "bitmap": "RESULT/NORM_RESULT: contributors, bit i = rank i; NOTICE: the slot's contributors so far; "
              "0 in DATA/NORM",
    "contributors": "RESULT/NORM_RESULT: k, the number of contributors (the worker divides by k); NOTICE: "
                    "the slot's so far; 0 in DATA/NORM",
    "op": "element operation (table below); must be the job's",
    "reserved": "0",
    "nonce": "the job's random 32-bit identity (config reply `nonce`); every packet of either direction carries it",
    "token": "DATA/NORM: the sender's random 32-bit registration token (config reply `token`); replies: 0",
}

#: What each control request field means (the types and ranges come from control.SCHEMA).
REQUEST_FIELDS = {
    "worker_id": "the rank",
    "data_addr": "the worker's UDP source address and port, exactly as the PS will see them",
    "job_name": "the job's name (default `default`); one name, one job: a name no running or "
                "queued job has starts a new job beside the running ones (or queues it while the slot "
                "space is full); a registration naming a running (or queued) job joins it, and is "
                "refused, naming every differing field, when its `expect` disagrees with that job",
    "launch": "a token every rank of one launch shares (the library API draws it on rank 0 and "
              "broadcasts it over the process group); the registration that starts a job records "
              "it, and a registration under that job's name (running or queued) with another token "
              "is refused: two launches given one name never share a job; absent: not checked",
    "expect": "JobConfig fields (names as in the job table) the worker insists on; a mismatch with "
              "the job it would join or start is refused naming each differing field; `job_id` and "
              "`slots` are the PS's to assign and never differ",
    "job": "a whole JobConfig map, proposed to a PS started without a job; needed only by a "
           "registration that starts a job (the first of its name); a joining one may leave it out, "
           "and if sent it is not compared (state what matters in `expect`)",
    "rejoin": "true: only join a running job in which this rank held a place (a restarted rank, or "
              "one whose lease expired)",
    "session": "the 16-byte secret of the config reply; every request for a rank carries it",
    "progress": "the step the worker is on, 0-based, as the application counts steps (`thc launch`: "
                "the allreduce it is starting, the number of rounds once done; `thc train`: the "
                "training step); absent until the worker has one (the status shows −1); a restarted "
                "or lapsed rank reads the others' from `status`",
    "name": "barrier name: `start`, `end`, `sync-E` (after epoch E's model sync)",
    "round": "sync_put/sync_get: the model-sync round (the epoch)",
    "blob": "the sync source's model state (float32 parameters, the application's layout)",
    "phase": "the number of phases this worker completed (resume after a PS restart)",
}

#: Each request's reply (hand-written: replies are built by the PS, not validated).
REPLIES = {
    "register": "`config` (fields below)",
    "heartbeat": "`status` (renews the lease)",
    "status": "`status`: with worker_id and session, that rank's job; without, the only running "
              "job's fields (if one runs) and every job under `jobs` / `queued`",
    "leave": "`ok`; the job ends when every rank left or lost its lease",
    "barrier": "`ok`, once every live rank arrived and at least ⌈q·n⌉ are live; `error` with code "
               "`job_stalled` when it cannot complete",
    "sync_put": "`ok` from the sync source (the lowest live rank that is not rejoining); from any "
                "other rank `error` with code `refused`, naming the source",
    "sync_get": "`sync` {blob}, once the source put that round",
    "resume": "`resume` {phase, max_phase}, once all n ranks asked",
    "stats": "`stats` {stats}: the PS's counters",
    "shutdown": "`ok`, then the PS stops (without CURVE keys: only from 127.0.0.0/8)",
    "drain": "`ok`, then the PS admits no new job and stops once its running jobs end (without CURVE "
             "keys: only from 127.0.0.0/8)",
}

#: The config reply (the PS's answer to `register`).
CONFIG_REPLY = {
    "type": ("str", "`config`"),
    "job": ("map", "the job (JobConfig fields, table below)"),
    "nonce": ("int 0..2^32−1", "the job's identity; goes in every data packet"),
    "token": ("int 0..2^32−1", "this registration's data-plane token; goes in every DATA/NORM packet"),
    "session": ("bin, 16 bytes", "the secret every later request for this rank carries"),
    "job_number": ("int ≥ 1", "the PS's count of jobs so far (names the job in messages)"),
    "job_name": ("str", "the job's name"),
    "lease_s": ("float", "the lease: send a heartbeat at least every lease_s / 5 seconds"),
    "data_port": ("int", "the PS's UDP port"),
    "rejoin": ("bool", "true when this registration took over a rank that had left or died"),
    "incarnation": ("int 0..2^32−1", "the PS process's random identity; changes when it restarts"),
}

#: The status reply (to `status` and `heartbeat`).
STATUS_REPLY = {
    "type": ("str", "`status`"),
    "job_number": ("int or nil", "the asking rank's job (or the only running one); nil when there is "
                                 "none (then the job fields below are absent)"),
    "incarnation": ("int", "as in the config reply"),
    "job_name": ("str", "the job's name"),
    "job_id": ("int", "the job id in its packets (the PS gives each running job its own)"),
    "codec": ("str", "the job's codec"),
    "region": ("map", "{base, data, norm}: the job's slots in the PS's slot space; packets address "
                      "slots 0..data−1 (DATA) and data..data+norm−1 (NORM) of the region"),
    "num_workers": ("int", "n"),
    "live": ("array of int", "the live ranks"),
    "missing": ("array of map", "{rank, why, rejoin_s?}: ranks never registered, or dead; `rejoin_s` is "
                                "the seconds left of a dead rank's rejoin grace (0: past it)"),
    "progress": ("map str → int", "each live rank's last reported `progress` (keys are decimal ranks); "
                                  "−1 for a rank that has reported none"),
    "barriers": ("map str → array of int", "each open barrier's arrived ranks"),
    "sync_source": ("int or nil", "the rank whose `sync_put` is accepted"),
    "rejoin_grace_s": ("float", "how long a dead rank may come back before a job that needs it fails"),
    "age_s": ("float", "seconds since the job started"),
    "stalled": ("str, only when set", "why the job can no longer complete (names the missing ranks)"),
    "jobs": ("array of map", "every running job: the job fields above and `stats` (its counters); this "
                             "and the next four only in the reply to a status without a session"),
    "queued": ("array of map", "{job_name, slots, waiting_s, ranks}: jobs waiting for slots, oldest first"),
    "slot_space": ("int", "the slots all running jobs share"),
    "slots_free": ("int", "slots no running job holds"),
    "draining": ("bool", "the PS admits no new job and stops once the running ones end (`drain`)"),
}

#: The STATUS_REPLY fields only a status without a session gets (the PS-wide listing).
STATUS_LISTING = ("jobs", "queued", "slot_space", "slots_free", "draining")

#: JobConfig fields (the `job` map): meaning; types come from the dataclass.
JOB_FIELDS = {
    "num_workers": "n, 1..32 (the bitmap's width)",
    "job_id": "the header's job_id (the PS assigns one no other running job has)",
    "codec": "`thc`, `none` (float32 sums), or a BLOB codec the PS decodes, sums and re-encodes",
    "bits": "b, bits per THC table index",
    "granularity": "g: the table's values lie on 0..g",
    "p": "the table's support fraction, a fraction in text (`1/32`)",
    "lane_bits": "width of one aggregated THC value in RESULT: 1..8 (packed like indices), 16 or 32; "
                 "n·g must fit (a job built with 0 gets the narrowest that does, 7 bits for 4 ranks at "
                 "g = 30: the wire only ever carries the width)",
    "seed": "the job's seed: the RHT sign diagonals, and the test gradients of `thc launch`",
    "slots": "S, data slots: what the job asks for; the PS's config reply has what admission granted",
    "norm_slots": "S_norm, norm slots (numbered S..S+S_norm−1)",
    "mtu": "the path MTU the packet geometry is computed for",
    "elems_per_packet": "elements a DATA/RESULT (or BLOB bytes a fragment) carries at most",
    "quorum": "q: a slot's result goes out once ⌈q·n⌉ ranks contributed",
    "block_log2": "RHT blocks are 2^block_log2 coordinates (a tensor's rest in smaller ones: `tail_log2`)",
    "tail_log2": "what a tensor has beyond its whole blocks is cut into power-of-two blocks of at least "
                 "2^tail_log2 coordinates (§4 step 1)",
    "table": "THC: the 2^b table values T[0..2^b−1] (must equal the solver's for (b, g, p))",
    "codec_params": "keyword parameters of a BLOB codec",
    "rotation": "`round`: the RHT sign diagonals of allreduce r are drawn for r (§4 step 3, THC's Alg. 3); "
                "`job`: every allreduce uses those of r = 0, so a worker may keep its error feedback rotated",
    "result_group": "`ADDR:PORT`, an IPv4 multicast group: the software PS sends each result (RESULT, NORM_RESULT, "
                    "BLOB fragment) once, to it, and the workers join it; resent results stay unicast; "
                    "`\"\"`: one copy per worker. Two running jobs never share one",
}


def _table(head: list, rows: list) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def header_table() -> str:
    rows, off = [], 0
    for name, size in H.FIELDS:
        rows.append((off, size, f"`{name}`", HEADER_MEANINGS[name]))
        off += size
    return _table(["offset", "bytes", "field", "meaning"], rows) + \
        f"\n\nHeader size {H.HEADER_SIZE} bytes; every field unsigned, big-endian (network order)."


def constants() -> str:
    rows = [("packet types", ", ".join(f"{v} {n}" for v, n in sorted(H.TYPE_NAMES.items()))),
            ("ops", ", ".join(f"{v} {n}" for v, n in sorted(H.OP_NAMES.items()))),
            ("flags", f"0x{H.F_RETRANSMIT:02x} RETRANSMIT, 0x{H.F_RESENT:02x} RESENT"),
            ("magic, version", f"0x{H.MAGIC:04x}, {H.VERSION}"),
            ("ranks per job", f"1..{H.MAX_WORKERS}"),
            ("round window", f"a DATA/NORM round more than {H.ROUND_WINDOW} ahead of its slot's is dropped"),
            ("default MTU", f"{H.DEFAULT_MTU} (payload budget {H.payload_budget()} bytes after IPv4, UDP "
                            f"and the {H.HEADER_SIZE}-byte header)")]
    return _table(["what", "value"], rows)


def geometry() -> str:
    rows = []
    for codec, bits, lanes in (("thc", 4, 7), ("thc", 4, 8), ("thc", 4, 16), ("thc", 4, 32), ("thc", 2, 8),
                               ("none", 4, 8), ("topk", 4, 8)):
        job = JobConfig(num_workers=2, codec=codec, bits=bits, lane_bits=lanes,
                        granularity=min(30, (1 << lanes) // 2 - 1))
        per = job.elems_per_packet
        rows.append((codec, job.up_bits, job.down_bits if not job.blob else "8 (bytes)", per,
                     job.up_payload_len(per), job.down_payload_len(per) if not job.blob else job.up_payload_len(per)))
    return _table(["codec", "up bits/element", "down bits/element", "elements per packet",
                   "DATA payload bytes", "RESULT payload bytes"], rows)


def norm_examples() -> str:
    values = np.array([0.0, 1.0, 2.5, 1e-30, -0.0, -1.0, float("inf")], dtype=np.float32)
    codes = H.float_to_ordered(values)
    rows = [(f"{v!r}".replace("np.float32(", "").rstrip(")"), f"0x{v.view(np.uint32):08x}", f"0x{c:08x}")
            for v, c in zip(values, codes)]
    return _table(["float32", "IEEE bits", "NORM code (on the wire, big-endian)"], rows)


def requests() -> str:
    rows = []
    for kind, spec in control.SCHEMA.items():
        fields_ = "; ".join(f"`{name}`{'' if required else '?'}: {check.describe} — {REQUEST_FIELDS[name]}"
                            for name, (required, check) in spec.items()) or "—"
        rows.append((f"`{kind}`", fields_, REPLIES[kind]))
    return _table(["request", "fields (`?` optional): msgpack type — meaning", "reply"], rows)


def error_codes() -> str:
    return _table(["code", "what the worker does"], [(f"`{c}`", m) for c, m in control.ERROR_CODES.items()])


def _reply_table(spec: dict) -> str:
    return _table(["field", "type", "meaning"], [(f"`{k}`", t, m) for k, (t, m) in spec.items()])


def job_fields() -> str:
    defaults = JobConfig(num_workers=4)
    rows = []
    for f in fields(JobConfig):
        t = f.type if isinstance(f.type, str) else f.type.__name__
        t = {"tuple": "array of int", "dict": "map", "str": "str", "int": "int", "float": "float"}.get(t, t)
        d = getattr(defaults, f.name)
        shown = "(derived)" if f.name in ("table", "elems_per_packet") else "—" if f.name == "num_workers" \
            else f"`{d}`" if not isinstance(d, dict) and d != "" else "`{}`" if d == {} else '`""`'
        rows.append((f"`{f.name}`", t, shown, JOB_FIELDS[f.name]))
    return _table(["field", "type", "default", "meaning"], rows)


def thc_numbers() -> str:
    """t_p and the table of the default job, to the last bit (docs/protocol.md §4)."""
    from thc_ps.proto.tables import parse_p, solve_table, t_p
    job = JobConfig(num_workers=1)
    tab = np.asarray(solve_table(job.bits, job.granularity, job.p).values, dtype=np.float32)
    w = np.float32(1.0) / (tab[1:] - tab[:-1])
    tp = t_p(parse_p(job.p))
    rows = [(f"t_p for p = {job.p} (float64)", f"{tp!r} ({tp.hex()})"),
            (f"T for b = {job.bits}, g = {job.granularity}, p = {job.p}", ", ".join(str(int(v)) for v in tab)),
            ("w_i = float32(1/(T[i+1] − T[i])), IEEE bits", ", ".join(f"0x{v.view(np.uint32):08x}" for v in w))]
    return _table(["what", "value"], rows)


def stream_example(seed: int = 0, rank: int = 0, round_no: int = 0, count: int = 6) -> str:
    """The stochastic-rounding key of (seed, rank, round) and its first uniforms (§5)."""
    from thc_ps.compression.stochastic import counter_uniforms, key_from
    key = key_from(np.random.default_rng(np.random.SeedSequence([seed, rank, round_no, 0x52])))
    u = counter_uniforms(key, count)
    rows = [("K", f"0x{key:016x}")]
    rows += [(f"u_{k}", f"{int(v * 2.0 ** 24)} · 2^−24 = {float(v)!r}") for k, v in enumerate(u)]
    return _table(["value", ""], rows)


BLOCKS = {
    "header": header_table, "constants": constants, "geometry": geometry, "norm": norm_examples,
    "requests": requests, "errors": error_codes, "config": lambda: _reply_table(CONFIG_REPLY),
    "status": lambda: _reply_table(STATUS_REPLY), "job": job_fields, "thc": thc_numbers,
    "streams": stream_example,
}
_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """`text` with every generated block replaced by what the code says now."""
    def fill(m):
        if m.group(2) not in BLOCKS:
            raise KeyError(f"docs/protocol.md names an unknown generated block {m.group(2)!r}")
        return m.group(1) + BLOCKS[m.group(2)]() + "\n" + m.group(4)
    return _BLOCK.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate or check docs/protocol.md's generated tables.")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if the document is out of date")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.write:
        DOC.write_text(new)
        return 0
    if new != text:
        print(f"{DOC} is out of date: run `python -m thc_ps.deploy.protodoc --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
