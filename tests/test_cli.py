"""The `thc` command: JSON shapes and argument errors."""
import json

import pytest

from deploy.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_json(capsys):
    rc, out, _ = run(capsys, "table", "--bits", "4", "--granularity", "30", "--p", "1/32")
    doc = json.loads(out)
    assert rc == 0
    assert set(doc) == {"bits", "granularity", "p", "t_p", "table", "objective"}
    assert doc["table"][0] == 0 and doc["table"][-1] == 30 and len(doc["table"]) == 16
    assert doc["p"] == "1/32"


def test_nmse_json(capsys):
    rc, out, _ = run(capsys, "nmse", "--codec", "thc", "--workers", "3", "--dim", "4096",
                     "--dist", "normal", "--independent", "--trials", "2")
    doc = json.loads(out)
    assert rc == 0
    assert {"codec", "nmse", "bits_up", "bits_down", "workers", "dim"} <= set(doc)
    assert doc["workers"] == 3 and doc["copies"] is False and 0 < doc["nmse"] < 0.1


def test_bad_arguments_explain_themselves(capsys):
    with pytest.raises(SystemExit):
        main(["nmse", "--workers", "0"])
    assert "in 1..32" in capsys.readouterr().err
    rc, _, err = run(capsys, "table", "--bits", "4", "--granularity", "10")
    assert rc == 2 and "granularity" in err
    with pytest.raises(SystemExit):
        main(["table", "--p", "2"])
    assert "between 0 and 1" in capsys.readouterr().err


def test_experiment_codec_and_rate_lists():
    from deploy.cli import build_parser
    args = build_parser().parse_args(["experiment", "bandwidth", "--codecs", "none,thc,3lc", "--rates", "100,2.5,0"])
    assert args.codecs == ("none", "thc", "3lc") and args.rates == (100, 2.5, None)
    defaults = build_parser().parse_args(["experiment", "bandwidth"])
    assert defaults.codecs == ("none", "thc") and defaults.rates == (100, 1000, None)


@pytest.mark.parametrize("flag,value,message", [("--codecs", "none,bogus", "unknown codec"),
                                                ("--codecs", ",", "unknown codec"),
                                                ("--rates", "100,x", "Mbit/s numbers"),
                                                ("--rates", "-5", "cannot be negative")])
def test_experiment_list_errors(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        main(["experiment", "bandwidth", flag, value])
    assert message in capsys.readouterr().err
