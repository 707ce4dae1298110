"""Generate the THC switch programs from one description, for two targets:

  v1model → p4/thc.p4               (bmv2 simple_switch; compiled and tested here)
  tna     → p4/tofino/thc_tna.p4    (Intel Tofino 1 and 2: TNA / T2NA)

Both come from the same pieces: the THC header and wire constants from proto/headers.py, the
shape, verdicts and event counters from p4/spec.py, and P4 templates under p4/templates/
(headers.p4 is shared; v1model/ and tna/ hold each target's parser, ingress, egress and
deparser).  The templates are plain P4 with `$name` placeholders (string.Template); P4 has no
loops, so only the per-lane parts — header fields, lookup tables, lane registers and their
actions — are generated here from one-lane patterns.  `thc p4 gen --check` (and a test) verifies
that the committed programs are what this module produces.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from thc_ps.p4 import spec
from thc_ps.p4.spec import LANES, PORT, SLOTS  # noqa: F401  (re-exported: the programs' shape)
from thc_ps.proto import headers as H

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"


@dataclass(frozen=True)
class Target:
    """One P4 architecture: its template pieces (in file order), the one-lane patterns that
    are repeated per lane (`$i`) or per 32-bit word of four lanes (`$w`, lanes `$l0`..`$l3`),
    where the program goes, and its slot count."""

    name: str
    output: Path
    pieces: tuple
    per_lane: dict = field(default_factory=dict)
    per_word: dict = field(default_factory=dict)
    slots: int = SLOTS


V1MODEL = Target(
    name="v1model",
    output=HERE / "thc.p4",
    pieces=("v1model/prelude.p4", "headers.p4", "v1model/metadata.p4", "v1model/parser.p4",
            "v1model/ingress.p4", "v1model/egress.p4"),
    per_lane={
        "sum_fields": "    bit<8> y$i;",
        "value_fields": "    bit<8> v$i;",
        "lane_registers": "    register<bit<8>>($banks) acc$i;",
        "lookup_tables": """\
    action set_v$i(bit<8> v) {
        meta.v$i = v;
    }
    table lut$i {
        key = { hdr.thc.job_id: exact; hdr.idx.z$i: exact; }
        actions = { set_v$i; NoAction; }
        size = $lut_entries;
        default_action = NoAction();
    }""",
        "lane_actions": """\
    action lane$i() {
        bit<8> cur;
        acc$i.read(cur, meta.reg_idx);
        bit<8> nv = (meta.add == 0) ? cur : ((meta.first == 1) ? meta.v$i : cur + meta.v$i);
        acc$i.write(meta.reg_idx, nv);
        hdr.sums.y$i = nv;
    }""",
        "apply_lookups": "                lut$i.apply();",
        "apply_lanes": "                lane$i();",
    },
)

#: Tofino: slot count of the TNA program (register SRAM is plentiful; SwitchML uses 8192 pairs).
TNA_SLOTS = 4096

TNA = Target(
    name="tna",
    output=HERE / "tofino" / "thc_tna.p4",
    pieces=("tna/prelude.p4", "headers.p4", "tna/metadata.p4", "tna/parser.p4", "tna/ingress.p4",
            "tna/egress.p4"),
    per_lane={
        "lookup_tables": """\
    action set_v$i(bit<8> v) {
        meta.in$w[$hi:$lo] = v;
    }
    table lut$i {
        key = { hdr.idx.z$i: exact; }
        actions = { set_v$i; }
        size = 16;
        default_action = set_v$i(0);
    }""",
        "apply_lookups": "                lut$i.apply();",
    },
    per_word={
        "sum_fields": "    bit<32> w$w;",
        "input_fields": "    bit<32> in$w;",
        "word_registers": """\
    // lanes $l0..$l3: four 8-bit sums in one 32-bit cell (no carry crosses a lane: n·g ≤ 255)
    Register<bit<32>, bank_index_t>($banks, 0) acc$w;
    RegisterAction<bit<32>, bank_index_t, bit<32>>(acc$w) acc${w}_set = {
        void apply(inout bit<32> cell, out bit<32> sum) {
            cell = meta.in$w;
            sum = cell;
        }
    };
    RegisterAction<bit<32>, bank_index_t, bit<32>>(acc$w) acc${w}_add = {
        void apply(inout bit<32> cell, out bit<32> sum) {
            cell = cell + meta.in$w;
            sum = cell;
        }
    };
    RegisterAction<bit<32>, bank_index_t, bit<32>>(acc$w) acc${w}_get = {
        void apply(inout bit<32> cell, out bit<32> sum) {
            sum = cell;
        }
    };""",
        "apply_set": "                        hdr.sums.w$w = acc${w}_set.execute(meta.bank_idx);",
        "apply_add": "                        hdr.sums.w$w = acc${w}_add.execute(meta.bank_idx);",
        "apply_get": "                        hdr.sums.w$w = acc${w}_get.execute(meta.bank_idx);",
    },
    slots=TNA_SLOTS,
)

TARGETS = {t.name: t for t in (V1MODEL, TNA)}


#: The IPv4 header fields the checksum covers (all but the checksum itself), in header order.
IPV4_CHECKSUMMED = ("version", "ihl", "diffserv", "total_len", "identification", "flags", "frag_offset",
                    "ttl", "protocol", "src", "dst")


def thc_header_fields() -> str:
    """The THC header's P4 fields, from thc_ps.proto.headers.FIELDS (the one wire definition)."""
    return "\n".join(f"    bit<{8 * size}> {name};" for name, size in H.FIELDS)


def _constants(kind: str, names, values=None) -> str:
    values = range(len(names)) if values is None else values
    return "\n".join(f"const {kind} {name} = {value};" for name, value in zip(names, values))


def _repeat(pattern: str, substitutions: list) -> str:
    template = Template(pattern)
    return "\n".join(template.substitute(s) for s in substitutions)


def substitutions(target: Target, lanes: int = LANES, port: int = PORT) -> dict:
    """Every `$name` the target's templates use."""
    if lanes % 4:
        raise ValueError("lanes must be a multiple of 4 (four lanes per 32-bit word on Tofino)")
    banks = 2 * target.slots
    values = {
        "lanes": lanes, "slots": target.slots, "banks": banks, "port": port,
        "max_jobs": spec.MAX_JOBS, "max_members": spec.MAX_JOBS * spec.MAX_RANKS,
        "lut_entries": 16 * spec.MAX_JOBS, "event_counters": (spec.MAX_JOBS + 1) * spec.EVENT_CELLS,
        "magic": f"{H.MAGIC:#06x}", "version": H.VERSION, "header_bytes": H.HEADER_SIZE,
        "round_window": H.ROUND_WINDOW, "f_resent": H.F_RESENT,
        "op_lookup_sum": H.OP_LOOKUP_SUM, "op_max_u32": H.OP_MAX_U32,
        "idx_bytes": lanes // 2, "sum_bytes": lanes, "words": lanes // 4,
        "event_cells": spec.EVENT_CELLS,
        "type_constants": _constants("bit<8>", [f"T_{name}" for name in H.TYPE_NAMES.values()],
                                     H.TYPE_NAMES.keys()),
        "verdict_constants": _constants("verdict_t", [f"V_{v}" for v in spec.VERDICTS]),
        "event_constants": _constants("event_t", [spec.event_constant(e) for e in spec.EVENTS]),
        "thc_fields": thc_header_fields(),
        "parse_states": (TEMPLATES / "parse_states.p4").read_text().rstrip("\n"),
        "ipv4_checksum_fields": ",\n".join(f"            hdr.ipv4.{name}" for name in IPV4_CHECKSUMMED),
        "idx_fields": _repeat("    bit<4> z$i;", [{"i": i} for i in range(lanes)]),
    }
    lane_subs = [{"i": i, "banks": banks, "lut_entries": values["lut_entries"], "w": i // 4,
                  "hi": 31 - 8 * (i % 4), "lo": 24 - 8 * (i % 4)}
                 for i in range(lanes)]
    for name, pattern in target.per_lane.items():
        values[name] = _repeat(pattern, lane_subs)
    word_subs = [{"w": w, "banks": banks, **{f"l{k}": 4 * w + k for k in range(4)}}
                 for w in range(lanes // 4)]
    for name, pattern in target.per_word.items():
        values[name] = _repeat(pattern, word_subs)
    return values


def generate(target: str | Target = "v1model", lanes: int = LANES, port: int = PORT) -> str:
    """The program text for a target (pure: nothing is written or changed)."""
    target = TARGETS[target] if isinstance(target, str) else target
    values = substitutions(target, lanes, port)
    pieces = [Template((TEMPLATES / piece).read_text()).substitute(values) for piece in target.pieces]
    return "\n".join(piece.rstrip("\n") + "\n" for piece in pieces)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="generate p4/thc.p4 (v1model) and p4/tofino/thc_tna.p4 (TNA)")
    ap.add_argument("--check", action="store_true", help="fail if a committed program differs from the generator")
    ap.add_argument("--target", choices=("all", *TARGETS), default="all")
    args = ap.parse_args(argv)
    stale = []
    for target in TARGETS.values():
        if args.target not in ("all", target.name):
            continue
        text = generate(target)
        rel = target.output.relative_to(HERE.parent) if target.output.is_relative_to(HERE.parent) \
            else target.output
        if args.check:
            same = target.output.exists() and target.output.read_text() == text
            print(f"{rel} is up to date" if same else f"{rel} differs from p4/gen_p4.py output")
            if not same:
                stale.append(str(rel))
        else:
            target.output.write_text(text)
            print(f"wrote {rel}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
