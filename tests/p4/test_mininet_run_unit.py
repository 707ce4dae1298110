"""Pieces of `thc p4 mininet` that need no switch: the verdict, the loss ruleset, the
counters parsed, the switch commands for each control mode."""
import subprocess

import pytest

from thc_ps.deploy import mininet_run
from thc_ps.p4 import tools
from thc_ps.p4.control import EVENTS, parse_events, switch_job


def doc(**kw):
    base = {"rounds": 5, "exact_rounds": 5, "mismatched_chunks": 0, "lost_chunks": 0, "policy": "retransmit"}
    return {**base, **kw}


def test_verdict():
    assert mininet_run.failed(doc()) is None
    assert "differ" in mininet_run.failed(doc(mismatched_chunks=1, exact_rounds=4))
    assert "lost" in mininet_run.failed(doc(lost_chunks=3))
    # under the zero policy a lost chunk is expected (zeros), a wrong one still fails
    assert mininet_run.failed(doc(lost_chunks=3, exact_rounds=5, policy="zero")) is None
    assert mininet_run.failed(doc(mismatched_chunks=2, policy="zero")) is not None


def test_loss_ruleset_drops_both_ways_at_the_rate():
    text = mininet_run.loss_ruleset(0.05)
    assert text.count("numgen random mod 1000000 < 50000 counter drop") == 2
    assert "udp dport 9000" in text and "udp sport 9000" in text


@pytest.mark.skipif(tools.system_tool("nft") is None, reason="nft (Debian nftables) not installed")
@pytest.mark.root
def test_loss_ruleset_is_valid_nftables(tmp_path):
    f = tmp_path / "loss.nft"
    f.write_text(mininet_run.loss_ruleset(0.3))
    proc = subprocess.run([tools.system_tool("nft"), "-c", "-f", str(f)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_nft_drop_counters_are_summed():
    listing = ("table inet thcloss {\n chain output {\n  udp dport 9000 numgen random mod 1000000 < 20000 "
               "counter packets 7 bytes 700 drop\n }\n chain input {\n  udp sport 9000 numgen random mod "
               "1000000 < 20000 counter packets 5 bytes 600 drop\n }\n}\n")
    assert mininet_run.nft_dropped(listing) == 12 and mininet_run.nft_dropped("") == 0


def test_switch_counters_parsed_in_both_cli_formats():
    old = "\n".join(f"RuntimeCmd: events[{i}]= BYTES: {i * 10}, packets={i}" for i in range(len(EVENTS)))
    new = "\n".join(f"RuntimeCmd: ThcIngress.events[{i}]= ({i * 10} bytes, {i} packets)" for i in range(len(EVENTS)))
    assert parse_events(old) == parse_events(new) == {e: i for i, e in enumerate(EVENTS)}
    with pytest.raises(RuntimeError):
        parse_events(old.splitlines()[0])
    two = old + "\n" + new          # block 0, then a job cell's block: summed event by event
    assert parse_events(two, blocks=2) == {e: 2 * i for i, e in enumerate(EVENTS)}
    with pytest.raises(RuntimeError):
        parse_events(old, blocks=2)


def test_switch_commands_per_control_mode():
    job = switch_job(3)
    static = mininet_run.switch_commands(job, "static")
    p4run = mininet_run.switch_commands(job, "p4run")
    assert all(c.startswith("table_add ThcIngress.l2") for c in p4run) and len(p4run) == 3 + 1
    assert static[:len(p4run)] == p4run
    assert sum("ThcIngress.workers" in c for c in static) == 3
    assert any(c.startswith("table_add ThcIngress.thc_config") for c in static)
    two = mininet_run.switch_commands(job, "p4run", jobs=2)     # every host of both jobs + the control host
    assert len(two) == 6 + 1 and "table_add ThcIngress.l2 ThcIngress.forward 6 => 6" in two   # MAC ...:06 → port 6


def test_static_mode_is_programmed_through_thrift():
    """A switch programmed in advance gets the harness's CLI commands: asking for P4Runtime with
    it is refused before anything starts; auto picks Thrift and says why."""
    assert mininet_run.switch_control("auto", "static") == \
        ("thrift", "--control-mode static programs the switch through the Thrift CLI")
    with pytest.raises(ValueError, match="needs --control-mode p4run"):
        mininet_run.run(workers=2, switch="p4runtime")


def test_refuses_bad_configurations_before_anything_starts():
    with pytest.raises(ValueError):
        mininet_run.run(workers=9)                      # 9 x g=30 overflows the 8-bit lane
    with pytest.raises(ValueError, match="straggler-rank"):
        mininet_run.run(workers=2, straggler_rank=2)
    with pytest.raises(ValueError, match="needs --control-mode p4run"):
        mininet_run.run(workers=2, jobs=2)
    with pytest.raises(ValueError, match="--jobs must be in 1..8"):
        mininet_run.run(workers=2, jobs=9, control="p4run")


def test_summary_names_the_straggler_and_the_switch_drops():
    sw = {name: 0 for name in EVENTS}
    sw.update(rounds_completed=5, malformed=2)
    full = doc(chunks_per_round=3, retransmissions=1, timeouts=1, straggler_notices=0, packets_sent=60,
               kernel_drops=0, mean_round_ms=12.5, packets_per_s=0, switch=sw, workers=4, dim=4096,
               loss=0.0, quorum=1.0, straggler_delay_ms=5.0, straggler_rank=2, netns_left=False,
               seconds=3.3)
    text = mininet_run.summary_text(full)
    assert text.splitlines()[0].endswith("straggler delay 5.0 ms (rank 2)")
    assert "drops {'malformed': 2}" in text and "rounds_completed 5" in text
    assert "(15 chunk rounds)" in text and text.endswith("3.3 s")
    assert "(all workers)" in mininet_run.summary_text({**full, "straggler_rank": None})


def test_switch_experiment_refuses_an_out_it_cannot_write_before_any_run(capsys, monkeypatch):
    """A bad --out is refused at once, naming it: the runs' minutes are not lost to it."""
    from thc_ps.deploy import switch_experiment
    monkeypatch.setattr(switch_experiment, "choose_control", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exc:
        switch_experiment.main(["--out", "/proc/no-such-dir/switch"])
    assert exc.value.code == 2 and "--out /proc/no-such-dir/switch: No such file or directory" in capsys.readouterr().err
