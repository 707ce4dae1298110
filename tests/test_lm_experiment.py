"""`thc experiment lm` (deploy/lm_experiment.py): the library example's model under link caps."""
import json

import pytest

from thc_ps.deploy import lm_experiment as lm

# one warm-up step (the library's 10 would leave no PS round in 6 steps)
TINY = lm.LMConfig(ranks=2, steps=6, batch=2, context=16, dim=16, layers=1, text_mb=0.2, eval_every=3, warmup_steps=1)


def test_bad_methods_layouts_and_rates_are_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match=r"'powersgd-1' is not a method \(ddp-fp32, ddp-fp16, thc-hook, thc-ps\)"):
        lm.lm(TINY, "cmd", out=tmp_path / "a", methods=("powersgd-1",))
    with pytest.raises(ValueError, match=r"'ps-group' is not a method .* or layout \(colocated, ps-host\)"):
        lm.lm(TINY, "cmd", out=tmp_path / "a", layouts=("ps-group",))
    with pytest.raises(ValueError, match=r"capped rates only"):
        lm.lm(TINY, "cmd", out=tmp_path / "a", rates=(0,))
    assert not (tmp_path / "a").exists()


def test_the_example_is_what_the_experiment_trains():
    ex = lm.example()
    model = ex.CharLM(16, 16, 1, heads=4)
    assert sum(p.numel() for p in model.parameters()) > 0 and ex.text_bytes(0.01).numel() == 10_000


def test_ddp_and_thc_ps_rows_under_a_cap(tmp_path):
    """fp16 DDP and THC-PS (colocated shards, through thc_ps.connect) under a 100 Mbit/s cap:
    one row each, the columns peers.json has, replicas identical, THC-PS's bytes below fp16's."""
    from thc_ps.deploy import netns
    why = netns.unavailable(need_tc=True)
    if why:
        pytest.skip(why)
    path = lm.lm(TINY, "thc experiment lm (test)", out=tmp_path, rates=(100,), methods=("ddp-fp16", "thc-ps"),
                 target=9.0)
    doc = json.loads((tmp_path / "lm.json").read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"ddp-fp16", "thc-ps"}
    for r in rows.values():
        assert {"method", "model", "params", "rate_mbit", "time_to_target"} <= set(r)
        assert r["replicas_identical"] and r["rate_mbit"] == 100 and len(r["curve"]) == 2
        assert r["time_to_target"] is not None           # a loss of 9 is met at the first evaluation
    assert rows["thc-ps"]["layout"] == "colocated" and rows["thc-ps"]["round_ms"] > 0
    assert rows["thc-ps"]["up_per_step"] < rows["ddp-fp16"]["up_per_step"]
    assert rows["thc-ps"]["steps_to_target"] == 3                # the first evaluation, after step 3
    row = next(line for line in path.read_text().splitlines() if line.startswith("| 100 Mbit/s | thc-ps | colocated |"))
    assert row.split(" | ")[-3:-1] == ["3", f"{rows['thc-ps']['time_to_target']:.1f}"]     # steps to, time to
    from thc_ps.torch import P_WITHOUT_FEEDBACK, TABLE_WITHOUT_FEEDBACK
    assert "warm-up steps (the first 1, float16" in path.read_text()          # TINY's, not the library's 10
    b, g = TABLE_WITHOUT_FEEDBACK["bits"], TABLE_WITHOUT_FEEDBACK["granularity"]
    assert f"b = {b}, g = {g}, p = {P_WITHOUT_FEEDBACK}, no error feedback" in path.read_text()
