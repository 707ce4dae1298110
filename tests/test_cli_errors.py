"""What the `thc` command says when something is off: the reproductions of an independent
tester's findings (each failed before its fix)."""
import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.pauses import free_port_pair
from thc_ps.deploy import cli, experiments
from thc_ps.ps_server.server import PSServer

ROOT = Path(__file__).resolve().parents[1]


def thc(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "thc_ps.deploy.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv,message", [
    (["launch", "--kill-at-round", "5"], "--kill-at-round needs --kill-rank"),
    (["launch", "--restart-killed"], "--restart-killed needs --kill-rank"),
    (["train", "--ps", "garbage"], "--ps: 'garbage' is not HOST:PORT (no ':PORT')"),
    (["train", "--ps", "host:http"], "port 'http' is not a number"),
    (["launch", "--ps", ":9000"], "no host before ':'"),
    (["ps", "--bind", "127.0.0.1:99999"], "port 99999 is out of range 1..65535 in '127.0.0.1:99999'"),
    (["launch", "--result-group", "10.0.0.1:5000"], "10.0.0.1 is not a multicast address"),
    (["worker", "--ps", "127.0.0.1:9000", "--result-group", "239.1.2.3"], "must be ADDRESS:PORT"),
    (["train", "--result-group", "239.1.2.3:0"], "the port must be in 1..65535"),
    (["ps", "--result-group", "auto"], "auto is for thc launch and thc train, which start their own PS"),
])
def test_bad_arguments_say_what_is_wrong(argv, message):
    proc = thc(*argv)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "invalid literal" not in proc.stderr


def test_a_busy_port_names_the_plane_and_the_address():
    port = free_port_pair()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", port))
        proc = thc("ps", "--bind", f"127.0.0.1:{port}")
    assert proc.returncode == 1
    assert f"cannot bind the data plane udp://127.0.0.1:{port}: Address already in use" in proc.stderr
    port = free_port_pair()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        proc = thc("ps", "--bind", f"127.0.0.1:{port}")
    assert proc.returncode == 1
    assert f"cannot bind the control plane tcp://127.0.0.1:{port + 1}: Address already in use" in proc.stderr


def _all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_help_shows_defaults_as_typed():
    """Reproduction: --help showed ('127.0.0.1', 9000), ('none', 'thc'), (100, 1000, None)."""
    shown = 0
    for parser in _all_parsers(cli.build_parser()):
        text = parser.format_help()
        assert "(default: (" not in text and "(default: [" not in text, parser.prog
        assert "None)" not in text.replace("(default: None)", ""), parser.prog
        shown += text.count("(default:")
    assert shown > 100
    ps_help = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["ps"].format_help().split())
    assert "(default: 127.0.0.1:9000)" in ps_help


def test_launch_against_a_running_ps_prints_its_counters():
    """Reproduction: `thc launch --ps …` printed `PS counters: None` and its JSON had "ps": null."""
    port = free_port_pair()
    server = PSServer(None, ("127.0.0.1", port), control_port=port + 1).start()
    try:
        proc = thc("launch", "--ps", f"127.0.0.1:{port}", "--workers", "2", "--rounds", "3", "--dim", "2000")
        assert proc.returncode == 0, proc.stderr
        assert "PS counters: None" not in proc.stdout and "'rounds_completed':" in proc.stdout
        proc = thc("launch", "--ps", f"127.0.0.1:{port}", "--workers", "2", "--rounds", "3", "--dim", "2000",
                   "--json")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        assert doc["ps"]["jobs_started"] == 2 and doc["ps"]["rounds_completed"] > 0
    finally:
        server.stop()


def test_an_idle_ps_prints_its_stats_only_when_they_change():
    """Reproduction: an idle `thc ps` printed the same stats line every --stats-every seconds."""
    port = free_port_pair()
    proc = subprocess.Popen([sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"127.0.0.1:{port}",
                             "--stats-every", "0.2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert sum(line.startswith("stats shard 0:") for line in out.splitlines()) == 1, out
    assert sum(line.startswith("final stats shard 0:") for line in out.splitlines()) == 1, out


def test_experiments_write_where_the_user_says(tmp_path, monkeypatch):
    """Reproduction: a quick `thc experiment` run overwrote the committed docs/experiments/."""
    seen = []
    monkeypatch.setattr(experiments, "loss", lambda *a, out, **kw: seen.append(out) or out / "loss.md")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["experiment", "loss"]) == 0
    assert cli.main(["experiment", "loss", "--out", str(tmp_path / "mine")]) == 0
    assert seen == [tmp_path / "thc-results" / "loss", tmp_path / "mine"]
    doc = {"epochs": [{"test_accuracy": 0.5, "train_loss": 1.0, "mean_round_ms": 2.0, "lost_chunks": 0,
                       "loss_curve": [(1, 1.0)]}], "seconds": 3.0}
    before = subprocess.run(["git", "status", "--porcelain", "docs/experiments"], cwd=ROOT,
                            capture_output=True, text=True).stdout
    path = experiments._write("x", "t", "c", "n", [experiments._summary("a", doc)], out=tmp_path / "w")
    after = subprocess.run(["git", "status", "--porcelain", "docs/experiments"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    assert before == after
    assert path == tmp_path / "w" / "x.md" and (tmp_path / "w" / "x.json").exists()
