"""The `thc` command: JSON shapes and argument errors."""
import json

import pytest

from thc_ps.deploy.cli import main


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
    from thc_ps.deploy.cli import build_parser
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


def _subcommands(parser):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subcommands(sub):
                    yield f"{name} {inner}", subsub


def test_every_option_has_help_and_no_hand_typed_default():
    """Every option of every subcommand says what it is; defaults come from the formatter, so
    no help text spells one out that could go stale."""
    import re

    from thc_ps.deploy.cli import build_parser
    seen = 0
    for name, sub in _subcommands(build_parser()):
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            seen += 1
            assert action.help, f"thc {name} {action.option_strings[0]} has no help"
            if action.default is not None:
                assert not re.search(r"\(default", action.help), (name, action.option_strings[0])
    assert seen > 140


def test_every_default_in_help_is_what_the_user_would_type():
    """Reproduction: --help showed ('127.0.0.1', 9000), ('none', 'thc') and (100, 1000, None).
    Every default the help of every command (nested ones too) shows is text that, typed back
    after its option, gives the value the command uses when the option is left out."""
    import argparse
    import re

    from thc_ps.deploy.cli import build_parser
    needed = {"worker": ["--ps", "127.0.0.1:9000"], "status": ["--ps", "127.0.0.1:9000"],
              "experiment": ["loss"], "keys": ["somewhere"]}
    parser, checked = build_parser(), 0
    for name, sub in [("", parser), *_subcommands(parser)]:
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            continue                                  # `thc p4`, `thc bench`: only their actions run
        words = name.split() + needed.get(name, [])
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0 or action.default is None:
                continue                              # None: the help says in words what happens
            shown = re.search(r"\(default: (.*)\)$", sub._get_formatter()._expand_help(action))
            if shown is None:
                continue
            text = shown.group(1)
            assert not re.search(r"[()\[\]']|None", text), f"thc {name} {action.option_strings[0]}: {text}"
            typed = parser.parse_args(words + [action.option_strings[0], *text.split()])
            left_out = parser.parse_args(words)
            assert getattr(typed, action.dest) == getattr(left_out, action.dest), (name, action.option_strings[0])
            checked += 1
    assert checked > 100
    ps = " ".join(dict(_subcommands(parser))["ps"].format_help().split())
    assert "(default: 127.0.0.1:9000)" in ps


def test_job_options_are_declared_once_and_shared():
    """--workers/--bits/--granularity/--p/--lane-bits/--quorum/--seed come from one table with
    one help text each; the commands differ only in their defaults."""
    from thc_ps.deploy.cli import JOB_OPTIONS, build_parser
    subs = dict(_subcommands(build_parser()))
    for cmd in ("ps", "launch", "train", "nmse", "experiment", "worker", "p4 run", "p4 mininet"):
        for action in subs[cmd]._actions:
            opt = action.option_strings[0][2:] if action.option_strings else None
            if opt in JOB_OPTIONS:
                assert action.help.startswith(JOB_OPTIONS[opt]["help"]) or cmd in ("ps", "experiment"), (cmd, opt)
    args = build_parser().parse_args(["nmse"])
    assert (args.workers, args.bits, args.granularity, args.seed) == (2, 4, 30, 0)
    args = build_parser().parse_args(["launch"])
    assert (args.workers, args.lane_bits, args.quorum) == (4, 0, 1.0)          # 0: the narrowest that fits
    args = build_parser().parse_args(["worker", "--ps", "127.0.0.1:9000", "--bits", "3"])
    assert (args.workers, args.bits, args.granularity, args.lane_bits, args.quorum) == (None, 3, None, None, None)


def test_loss_policy_choices_are_the_transports():
    from thc_ps.deploy.cli import build_parser
    from thc_ps.worker.transport import POLICIES
    subs = dict(_subcommands(build_parser()))
    for cmd in ("train", "launch", "worker", "p4 mininet"):
        action = next(a for a in subs[cmd]._actions if "--loss-policy" in a.option_strings)
        assert tuple(action.choices) == POLICIES and action.default == POLICIES[0]


def test_version_and_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("thc ")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "codecs", "--loss", "0.1"])          # `thc bench codecs` has no --loss
    assert exc.value.code == 2 and "--loss" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "loud", "table"])
    assert exc.value.code == 2


def test_log_level_reaches_the_loggers(capsys):
    import logging
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []
    try:
        assert main(["--log-level", "debug", "table", "--bits", "2", "--granularity", "3"]) == 0
        assert logging.getLogger("thc_ps.ps_server.server").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_the_lane_follows_the_job_unless_given(capsys):
    """A job's size is whatever torchrun says: left unset, the lane is the narrowest that holds
    n·g (its bit length to 8 ranks at g = 30: 5 bits for 1 rank, 7 for 4; 16 beyond 8 ranks);
    a width too narrow is refused naming the options that fix it."""
    from thc_ps.deploy.cli import build_parser
    from thc_ps.proto.job import JobConfig
    assert [JobConfig(num_workers=n).lane_bits for n in (1, 4, 5, 8, 9, 32)] == [5, 7, 8, 8, 16, 16]
    assert JobConfig(num_workers=32, granularity=3000).lane_bits == 32
    assert JobConfig(num_workers=9, lane_bits=32).lane_bits == 32
    with pytest.raises(ValueError, match=r"lower the granularity to at most 7 \(--granularity, granularity=\) "
                                         r"or widen the lane to 16 bits \(--lane-bits 16, lane_bits="):
        JobConfig(num_workers=32, lane_bits=8)
    assert build_parser().parse_args(["train", "--lane-bits", "auto"]).lane_bits == 0
    assert build_parser().parse_args(["train", "--lane-bits", "16"]).lane_bits == 16
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "--lane-bits", "12"])
    assert exc.value.code == 2 and "'12' is not a lane width: choose 1..8, 16, 32 or auto" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "--lane-bits", "7"]).lane_bits == 7
