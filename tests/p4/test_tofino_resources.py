"""p4/tofino_resources.summarize on a small report of the compiler's shape (no compiler needed)."""
import json

from thc_ps.p4 import tofino_resources


def _stage(n, tables, srams, tcams, salus, gateways):
    return {"stage_number": n,
            "logical_tables": {"ids": [{"id": i, "table_name": f"t{i}"} for i in range(tables)], "size": 16},
            "rams": {"nRows": 8, "nColumns": 10, "srams": [{"row": 0, "column": c} for c in range(srams)]},
            "tcams": {"nRows": 12, "nColumns": 2, "tcams": [{"row": r, "column": 0} for r in range(tcams)]},
            "map_rams": {"nRows": 8, "nUnits": 6, "maprams": []},
            "meter_alus": {"nAlus": 4, "meters": [{"id": i} for i in range(salus)]},
            "gateways": {"nRows": 8, "nUnits": 2, "gateways": [{"row": 0}] * gateways}}


def test_summary_sums_the_stages_and_counts_used_phv(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    stages = [_stage(0, 3, 5, 2, 1, 1), _stage(1, 0, 0, 0, 0, 0), _stage(2, 1, 2, 0, 3, 0)]
    (logs / "resources.json").write_text(json.dumps({"resources": {"mau": {"nStages": 12, "mau_stages": stages}}}))
    (logs / "phv.json").write_text(json.dumps({"containers": [
        {"bit_width": 8, "slices": [{"x": 1}]}, {"bit_width": 8, "slices": []},
        {"bit_width": 32, "slices": [{"x": 1}]}, {"bit_width": 16, "slices": [{"x": 1}]}]}))
    got = tofino_resources.summarize(tmp_path)
    assert got["stages_used"] == 3 and got["stages"] == 12      # the empty stage 1 is inside the chain
    assert (got["srams"], got["tcams"], got["stateful_alus"], got["logical_tables"], got["gateways"]) == \
        (7, 2, 4, 4, 1)
    assert got["srams_available"] == 240 and got["stateful_alus_available"] == 12
    assert got["phv_containers_used"] == {8: 1, 16: 1, 32: 1}
    # `thc p4 build --target tofino` prints it in one line; without a report it prints nothing
    from thc_ps.deploy.commands import _print_tofino_resources
    _print_tofino_resources(tmp_path)
    _print_tofino_resources(tmp_path / "missing")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"3 of 12 MAU stages, 7 SRAM and 2 TCAM blocks, 4 stateful ALUs ({tmp_path}/logs/resources.json)"]
