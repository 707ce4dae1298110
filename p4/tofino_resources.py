"""A summary of p4c-barefoot's resource report (`pipe/logs/resources.json` and
`pipe/logs/phv.json`, written with `-g`): what docs/p4.md's Tofino table lists."""
from __future__ import annotations

import json
from pathlib import Path


def summarize(pipe_dir: Path | str) -> dict:
    """Stages used of the device's, SRAM / TCAM / map-RAM blocks, stateful ALUs, logical
    tables and gateways (each summed over the stages), and PHV containers used by bit width."""
    pipe = Path(pipe_dir)
    res = json.loads((pipe / "logs" / "resources.json").read_text())["resources"]
    stages = res["mau"]["mau_stages"]
    used = [s for s in stages if s["logical_tables"]["ids"]]
    total = {
        "stages_used": 1 + max((s["stage_number"] for s in used), default=-1),
        "stages": res["mau"]["nStages"],
        "srams": sum(len(s["rams"]["srams"]) for s in stages),
        "srams_available": sum(s["rams"]["nRows"] * s["rams"]["nColumns"] for s in stages),
        "tcams": sum(len(s["tcams"]["tcams"]) for s in stages),
        "tcams_available": sum(s["tcams"]["nRows"] * s["tcams"]["nColumns"] for s in stages),
        "map_rams": sum(len(s["map_rams"]["maprams"]) for s in stages),
        "stateful_alus": sum(len(s["meter_alus"]["meters"]) for s in stages),
        "stateful_alus_available": sum(s["meter_alus"]["nAlus"] for s in stages),
        "logical_tables": sum(len(s["logical_tables"]["ids"]) for s in stages),
        "gateways": sum(len(s["gateways"]["gateways"]) for s in stages),
    }
    phv_file = pipe / "logs" / "phv.json"
    if phv_file.exists():
        containers = json.loads(phv_file.read_text())["containers"]
        by_width: dict = {}
        for c in containers:
            if c.get("slices"):
                by_width[c["bit_width"]] = by_width.get(c["bit_width"], 0) + 1
        total["phv_containers_used"] = dict(sorted(by_width.items()))
    return total
