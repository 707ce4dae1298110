"""What the compiled bmv2 program uses, read from p4c-bm2-ss's JSON: the figures of
docs/p4.md's resource table (bench/bench_p4.py prints them, tests/p4/test_docs_figures.py
holds the table to them)."""
from __future__ import annotations

import json
from pathlib import Path


def resources(json_path: Path | str) -> dict:
    """Declared match-action tables (p4c adds one `tbl_*` table per straight-line action
    call; those are counted separately), register arrays and their state bits, actions,
    conditionals, counters."""
    doc = json.loads(Path(json_path).read_text())
    regs = doc.get("register_arrays", [])
    tables = [t["name"] for p in doc.get("pipelines", []) for t in p.get("tables", [])]
    declared = [t for t in tables if not t.rsplit(".", 1)[-1].startswith("tbl_")]
    lane_regs = [r for r in regs if r["name"].rsplit(".", 1)[-1].startswith("acc")]
    return {"lanes_per_packet": len(lane_regs),
            "declared_tables": len(declared), "compiler_tables": len(tables) - len(declared),
            "lookup_tables": sum(1 for t in declared if ".lut" in t),
            "register_arrays": len(regs), "lane_registers": len(lane_regs),
            "register_bits": sum(r["size"] * r["bitwidth"] for r in regs),
            "lane_register_bits": sum(r["size"] * r["bitwidth"] for r in lane_regs),
            "actions": len(doc.get("actions", [])),
            "conditionals": sum(len(p.get("conditionals", [])) for p in doc.get("pipelines", [])),
            "counters": [c["name"] for c in doc.get("counter_arrays", [])]}
