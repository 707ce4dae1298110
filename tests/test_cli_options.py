"""`thc` options the tester's findings led to: addresses that cannot be empty, results that do
not land in the tracked docs/, and the PS's rejoin grace and the launcher's stall limit reaching
the code that uses them.  The PS and run_launch are stubbed: these check the command line."""
import subprocess
import sys
from pathlib import Path

import pytest

from thc_ps.deploy import bench_codecs, cli

ROOT = Path(__file__).resolve().parents[1]


def thc(*argv):
    return subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("argv,message", [
    (["launch", "--ps", "", "--workers", "2", "--rounds", "1", "--dim", "100"], "--ps: '' names no HOST:PORT"),
    (["launch", "--ps", ",", "--workers", "2"], "--ps: ',' names no HOST:PORT"),
    (["train", "--ps", ""], "--ps: '' names no HOST:PORT"),
    (["worker", "--ps", ""], "--ps: '' names no HOST:PORT"),
    (["p4", "run", "--control", "9001"], "--control: '9001' is not HOST:PORT (no ':PORT')"),
])
def test_an_empty_address_is_refused_before_anything_starts(argv, message):
    """Reproduction: `thc launch --ps ''` started workers and failed with "invalid literal for int()"."""
    proc = thc(*argv)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "invalid literal" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout          # not even the "launching …" line


def test_launch_passes_the_addresses_as_text(monkeypatch, capsys):
    seen = {}

    def fake_run_launch(**kw):
        seen.update(kw)
        return {"ok": True, "problems": [], "rounds": 1, "exact_rounds": 1, "mismatched_chunks": 0,
                "lost_chunks": 0, "retransmissions": 0, "mean_round_ms": 1.0, "ps": None, "away_at_end": []}

    monkeypatch.setattr("thc_ps.deploy.launch.run_launch", fake_run_launch)
    assert cli.main(["launch", "--ps", " 127.0.0.1:9000, 10.0.0.2:9002", "--workers", "2", "--rounds", "1"]) == 0
    assert seen["ps"] == "127.0.0.1:9000,10.0.0.2:9002"
    out = capsys.readouterr().out
    assert "PS counters" not in out and "None" not in out, out      # nothing to show: say nothing
    assert cli.main(["launch", "--workers", "2", "--rounds", "1"]) == 0
    assert seen["ps"] is None


def test_train_without_ps_starts_its_own(monkeypatch):
    from thc_ps.deploy import train
    seen = {}

    def fake(cfg, log, baseline):
        seen["ps"], seen["baseline"] = cfg.ps, baseline
        return {"run": {"epochs": [], "seconds": 0.0, "bytes_up": 0, "bytes_down": 0}}

    monkeypatch.setattr(train, "run_with_baseline", fake)
    monkeypatch.setattr(train, "print_comparison", lambda doc: None)
    assert cli.main(["train", "--epochs", "1"]) == 0
    assert seen == {"ps": "", "baseline": True}
    assert cli.main(["train", "--epochs", "1", "--ps", "127.0.0.1:9000"]) == 0
    assert seen == {"ps": "127.0.0.1:9000", "baseline": False}


def test_bench_codecs_does_not_write_into_docs_by_default(tmp_path, monkeypatch):
    """Reproduction: `thc bench codecs` overwrote the committed docs/codecs-table.md and codecs.png."""
    seen = []

    def fake_run(*, out, **kw):
        seen.append(Path(out))
        assert Path(out).is_dir()
        return Path(out) / "codecs-table.md"

    monkeypatch.setattr(bench_codecs, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "codecs"]) == 0
    assert cli.main(["bench", "codecs", "--out", str(tmp_path / "a" / "b")]) == 0
    assert seen == [tmp_path / "thc-results" / "bench-codecs", tmp_path / "a" / "b"]
    help_text = " ".join(dict(_subcommands(cli.build_parser()))["bench codecs"].format_help().split())
    assert "default: ./thc-results/bench-codecs" in help_text


def test_bench_codecs_writes_its_files_only_into_out(tmp_path):
    """The table and the plot go to the directory given, and docs/ stays as committed."""
    rows = [{"dim": 1 << 12, "codec": c, "homomorphic": True, "ratio_up": 8.0, "ratio_down": 4.0, "bits_up": 4.0,
             "bits_down": 8.0, "nmse_lognormal": 0.01, "nmse_normal": 0.01, "encode_mcoord_s": 1.0,
             "decode_mcoord_s": 1.0, "ps_ms": 1.0} for c in ("thc", "none")]
    before = _git_status("docs")
    path = bench_codecs.write_doc(rows, 2, tmp_path)
    assert path == tmp_path / "codecs-table.md" and path.read_text().count("| 2^12 |") == 2
    assert _git_status("docs") == before


def _git_status(where):
    return subprocess.run(["git", "status", "--porcelain", where], cwd=ROOT, capture_output=True, text=True).stdout


def _subcommands(parser, prefix=""):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from _subcommands(sub, prefix + name + " ")


class _FakePS:
    made = []

    def __init__(self, job, addr, **kw):
        self.addr, self.kw, self.control_port = addr, kw, kw.get("control_port") or addr[1] + 1
        _FakePS.made.append(self)

    def start(self):
        return self

    def wait(self, timeout=None):
        return True                        # stopped at once: the loop ends

    def stats(self):
        return {"packets_in": 0}

    def stop(self):
        pass


def test_ps_rejoin_grace_reaches_the_ps(monkeypatch, capsys):
    import thc_ps.ps_server.server
    monkeypatch.setattr(thc_ps.ps_server.server, "PSServer", _FakePS)
    _FakePS.made = []
    assert cli.main(["ps", "--bind", "127.0.0.1:9100", "--rejoin-grace-s", "2.5", "--lease-s", "1"]) == 0
    assert cli.main(["ps", "--bind", "127.0.0.1:9100", "--shards", "2"]) == 0
    assert [(s.addr, s.kw["rejoin_grace_s"], s.kw["lease_s"]) for s in _FakePS.made] == [
        (("127.0.0.1", 9100), 2.5, 1.0), (("127.0.0.1", 9100), 30.0, 5.0), (("127.0.0.1", 9102), 30.0, 5.0)]
    assert "final stats shard 1:" in capsys.readouterr().out


def test_launch_rejoin_grace_and_stall_reach_run_launch(monkeypatch, capsys):
    seen = {}

    def fake_run_launch(**kw):
        seen.update(kw)
        return {"ok": True, "problems": [], "rounds": 2, "exact_rounds": 2, "mismatched_chunks": 0,
                "lost_chunks": 0, "retransmissions": 0, "mean_round_ms": 1.0, "ps": {"rounds_completed": 2},
                "away_at_end": []}

    monkeypatch.setattr("thc_ps.deploy.launch.run_launch", fake_run_launch)
    assert cli.main(["launch", "--workers", "2", "--rounds", "2"]) == 0
    assert (seen["rejoin_grace_s"], seen["stall_s"], seen["lease_s"]) == (None, 180.0, None)
    assert "PS counters (its lifetime totals, every job so far): {'rounds_completed': 2}" in \
        capsys.readouterr().out
    assert cli.main(["launch", "--workers", "2", "--rounds", "2", "--rejoin-grace-s", "0", "--stall-s", "7.5"]) == 0
    assert (seen["rejoin_grace_s"], seen["stall_s"], seen["ps_wait_s"]) == (0.0, 7.5, None)
    assert cli.main(["launch", "--workers", "2", "--rounds", "2", "--ps-wait-s", "7"]) == 0
    assert seen["ps_wait_s"] == 7.0


@pytest.mark.parametrize("argv,message", [
    (["ps", "--rejoin-grace-s", "-1"], "expected seconds in [0, 86400], got '-1'"),
    (["ps", "--rejoin-grace-s", "90000"], "expected seconds in [0, 86400]"),
    (["launch", "--rejoin-grace-s", "x"], "expected seconds, got 'x'"),
    (["launch", "--stall-s", "0"], "expected seconds in (0, 86400], got '0'"),
    (["launch", "--stall-s", "nan"], "expected seconds in (0, 86400]"),
    (["worker", "--ps", "127.0.0.1:9000", "--ps-wait-s", "0"], "expected seconds in [1, 86400], got '0'"),
])
def test_grace_and_stall_are_range_checked(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_grace_and_stall_say_what_they_do():
    subs = dict(_subcommands(cli.build_parser()))
    ps = " ".join(subs["ps"].format_help().split())
    assert "--rejoin-grace-s" in ps and "may rejoin within this long" in ps and "(default: 30.0)" in ps
    launch = " ".join(subs["launch"].format_help().split())
    assert "--rejoin-grace-s" in launch and "--stall-s" in launch and "(default: 180.0)" in launch
    assert "naming the ranks behind" in launch


def test_block_and_tail_log2_reach_the_job_and_a_worker_stating_another_is_refused():
    """`--block-log2` and `--tail-log2` are job options: `thc launch` runs exact rounds with
    them, and they are different layouts (d = 100 000 in blocks of 2^14 pads to 100 352
    coordinates; in 2^16 + 2^15 + 2^12 to 102 400 with the default tail; in one block of 2^20
    to 131 072 with --tail-log2 20, so more bytes go up); a worker that states another block
    size or tail is refused by the PS, naming the field."""
    import json
    up = {}
    for k, tail in (("14", "12"), ("20", "12"), ("20", "20")):
        proc = thc("launch", "--workers", "2", "--rounds", "2", "--dim", "100000", "--block-log2", k,
                   "--tail-log2", tail, "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["exact_rounds"] == 2 and doc["mismatched_chunks"] == 0
        up[k, tail] = doc["bytes_up_per_round"]
    assert up["14", "12"] < up["20", "12"] < up["20", "20"]
    assert 1.25 < up["20", "20"] / up["20", "12"] < 1.30          # 131 072 / 102 400 = 1.28, headers aside
    from thc_ps.ps_server.server import PSServer
    from thc_ps.proto.job import JobConfig
    server = PSServer(JobConfig(num_workers=1, block_log2=14), ("127.0.0.1", 0), control_port=0).start()
    try:
        for option, value, why in (("--block-log2", "16", "block_log2: PS has 14, worker expects 16"),
                                   ("--tail-log2", "8", "tail_log2: PS has 12, worker expects 8")):
            proc = thc("worker", "--ps", f"127.0.0.1:{server.data_addr[1]}", "--control-port",
                       str(server.control_port), "--rank", "0", "--rounds", "1", "--dim", "1000", option, value)
            assert proc.returncode != 0 and why in proc.stderr, proc.stderr
    finally:
        server.stop()


@pytest.mark.parametrize("command", ["ps", "launch", "train", "worker"])
def test_block_and_tail_log2_are_range_checked(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--block-log2", "27"])
    assert exc.value.code == 2 and "expected log2 of the RHT block in 0..26, got '27'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--tail-log2", "-1"])
    assert exc.value.code == 2 and "expected log2 of the finest RHT block of a tensor's tail in 0..26, got '-1'" \
        in capsys.readouterr().err
