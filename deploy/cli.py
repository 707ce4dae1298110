"""The `thc` command: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

from thc_ps.deploy import commands
from thc_ps.deploy import experiments
from thc_ps.deploy import train as train_mod
from thc_ps.p4.control import CONTROLS as SWITCH_CONTROLS
from thc_ps.p4.control import SWITCH_LEASE_S
from thc_ps.proto.job import (AUTO_GROUP, DEFAULT_BLOCK_LOG2, DEFAULT_ROTATION, DEFAULT_TAIL_LOG2, LANE_AUTO,
                              MAX_BLOCK_LOG2, ROTATIONS)
from thc_ps.proto.packing import LANE_WIDTHS


def _p_arg(value: str):
    from thc_ps.proto.tables import parse_p
    try:
        return parse_p(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_in(lo: int, hi: int, what: str = "an integer"):
    """argparse type for an integer in [lo, hi], with a message naming the range."""
    def parse(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} in {lo}..{hi}, got {value!r}")
        return v
    return parse


_port = _int_in(1, 65535, "a port number")
_bits = _int_in(1, 8, "bits per index")
_granularity = _int_in(1, 65535, "a granularity")
_workers = _int_in(1, 32, "a worker count (the bitmap is 32 bits)")
_dim = _int_in(1, 1 << 28, "a dimension")
_rounds = _int_in(1, 1 << 30, "a round count")
_any_port = _int_in(0, 65535, "a port number (0: any)")
_seed = _int_in(0, (1 << 63) - 1, "a seed")
_block_log2 = _int_in(0, MAX_BLOCK_LOG2, "log2 of the RHT block")
_tail_log2 = _int_in(0, MAX_BLOCK_LOG2, "log2 of the finest RHT block of a tensor's tail")
_count = _int_in(0, 1 << 31, "a count")


def _lane_bits(value: str) -> int:
    """argparse type for JobConfig.lane_bits: 1..8, 16, 32, or auto (LANE_AUTO)."""
    if value == "auto":
        return LANE_AUTO
    if value not in {str(w) for w in LANE_WIDTHS}:
        raise argparse.ArgumentTypeError(f"{value!r} is not a lane width: choose 1..8, 16, 32 or auto")
    return int(value)


def _rotation(value: str) -> str:
    """argparse type for JobConfig.rotation (thc_ps.proto.job.ROTATIONS)."""
    if value not in ROTATIONS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a rotation: choose {' or '.join(ROTATIONS)}")
    return value


def result_group_arg(value: str) -> str:
    """argparse type for JobConfig.result_group: "" or an IPv4 multicast ADDR:PORT (also the
    benchmarks' group options)."""
    from thc_ps.proto.job import parse_group
    if value == AUTO_GROUP:
        raise argparse.ArgumentTypeError("auto is for thc launch and thc train, which start their own PS; "
                                         "name a group (ADDR:PORT) or leave the option out")
    try:
        parse_group(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _choice_list(what: str, choices: tuple):
    """argparse type: a comma list of `choices` (in the order given, no repeats)."""
    def parse(value: str) -> tuple:
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        bad = [v for v in items if v not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else value!r} is not a {what}; choose from "
                                             f"{', '.join(choices)}")
        return tuple(dict.fromkeys(items))
    return parse


def _result_group_or_auto(value: str) -> str:
    """argparse type for the result group of a command that may start its own PS: also "auto"."""
    return value if value == AUTO_GROUP else result_group_arg(value)


def _report_path(value: str) -> str:
    """A file the run may write at its end: its directory must exist now, not after an hour."""
    from pathlib import Path
    parent = Path(value).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return value


def _codec_list(value: str) -> tuple:
    from thc_ps.compression import registry
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in registry.names()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown codec(s) {', '.join(unknown) or value!r}; "
                                         f"choose from {', '.join(registry.names())}")
    return names


def _rate_list(value: str) -> tuple:
    rates = []
    for v in value.split(","):
        try:
            r = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected Mbit/s numbers separated by commas, got {value!r}") from None
        if r < 0:
            raise argparse.ArgumentTypeError(f"a link rate cannot be negative: {v}")
        rates.append(None if r == 0 else (int(r) if r == int(r) else r))
    return tuple(rates)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default printed by the formatter, except where there is none to print
    (None: decided later, e.g. by the PS; flags; an empty repeatable option or string)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default in ([], "") \
                or action.nargs == 0:
            return action.help
        if isinstance(action.default, (list, tuple)):     # as typed: values separated by spaces
            return f"{action.help} (default: {' '.join(map(str, action.default))})"
        return super()._get_help_string(action)


def _command(sub, name, **kwargs):
    """A subcommand whose help shows the defaults."""
    return sub.add_parser(name, formatter_class=_Formatter, **kwargs)


#: The job options shared by ps, launch, worker, train, nmse, experiment and table: one
#: declaration each (type, range check, help); each command picks its subset and defaults.
JOB_OPTIONS = {
    "workers": dict(type=None, help="number of workers n (at most 32: the contributor bitmap's width)"),
    "bits": dict(type=None, help="bits b per table index"),
    "granularity": dict(type=None, help="granularity g: the table's values lie on the grid 0..g"),
    "p": dict(type=None, help="support fraction p (the table covers all but p of the normal), e.g. 1/32"),
    "lane-bits": dict(type=None, metavar="{1..8,16,32,auto}",
                      help="bits per aggregated value; n*g must fit (auto: the narrowest lane that holds it, "
                           "7 bits for 4 workers at g=30)"),
    "quorum": dict(type=None, help="fraction of the workers after which a slot's result is sent "
                                   "(partial aggregation)"),
    "seed": dict(type=None, help="the job's seed (RHT signs; test gradients)"),
    "block-log2": dict(type=None, help="log2 of the RHT block: a tensor is rotated in blocks of "
                                       "2^k coordinates (THC's artifact: 23; docs/bench.md \"RHT block size\")"),
    "tail-log2": dict(type=None, help="log2 of the finest RHT block: what a tensor has beyond its whole blocks "
                                      "is cut into power-of-two blocks of at least 2^k coordinates, so it is "
                                      "padded by less than 2^k (a value >= --block-log2: one block padded to "
                                      "the next power of two; docs/protocol.md section 4 step 1)"),
    "rotation": dict(type=None, help="round: a fresh RHT sign diagonal every round (THC's Alg. 3); job: one "
                                     "for the whole job, so error feedback stays rotated and a worker's step "
                                     "runs two transforms instead of three (docs/design.md \"One rotation per job\")"),
    "result-group": dict(type=None, metavar="ADDR:PORT",
                         help="IPv4 multicast group the PS sends each result to, once, instead of once per "
                              "worker (the workers join it; docs/design.md \"Result fan-out\"); empty: per worker"),
}
#: --result-group of the commands that may start their own PS (launch, train)
LOCAL_GROUP = dict(result_group=AUTO_GROUP, helps={"result_group": JOB_OPTIONS["result-group"]["help"] + (
    "; auto: a fresh group on loopback when this command starts the PS, none with --ps")})
JOB_DEFAULTS = {"workers": 4, "bits": 4, "granularity": 30, "p": "1/32", "lane-bits": "auto", "quorum": 1.0,
                "seed": 0, "block-log2": DEFAULT_BLOCK_LOG2,
                "tail-log2": DEFAULT_TAIL_LOG2, "rotation": DEFAULT_ROTATION, "result-group": ""}


def _job_types() -> dict:
    return {"workers": _workers, "bits": _bits, "granularity": _granularity, "p": _p_arg, "lane-bits": _lane_bits,
            "quorum": _quorum, "seed": _seed, "block-log2": _block_log2, "tail-log2": _tail_log2,
            "rotation": _rotation,
            "result-group": result_group_arg}


def job_parent(*names, stated: bool = False, helps: dict | None = None, **defaults) -> argparse.ArgumentParser:
    """A parent parser with the job options `names` (default: all of JOB_OPTIONS).

    Defaults are JOB_DEFAULTS unless given (keyword with "_" for "-", e.g. lane_bits=16).
    stated=True (`thc worker`): every default is None, and the options given are what the
    worker insists on (the PS refuses it when its job differs).  A fresh parser per command,
    so one command's defaults never leak into another's."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("job options")
    types = _job_types()
    for name in names or JOB_OPTIONS:
        spec = dict(JOB_OPTIONS[name])
        spec["type"] = spec["type"] or types[name]
        key = name.replace("-", "_")
        spec["default"] = None if stated else defaults.get(key, JOB_DEFAULTS[name])
        if name == "result-group" and spec["default"] == AUTO_GROUP:
            spec["type"] = _result_group_or_auto
        spec["help"] = (helps or {}).get(key, spec["help"])
        if stated:
            spec["help"] += " (stated: the PS must run the same; without it, the PS's)"
        group.add_argument(f"--{name}", **spec)
    return parent


def _codec_arg(p, stated: bool = False):
    if stated:
        p.add_argument("--codec", choices=commands.job_codecs(), default=None,
                       help="the job's codec (stated: the PS must run the same)")
        return
    p.add_argument("--codec", choices=commands.job_codecs(), default="thc",
                   help="thc (lookup-and-sum in C), none (float32 sums), or a codec the PS "
                        "decodes, sums and re-encodes")


def _slots_arg(p):
    p.add_argument("--slots", type=_int_in(1, 65000, "a slot count"), default=512,
                   help="aggregator slots a job asks for (a contended PS may grant fewer)")


def _job_name(value: str) -> str:
    from thc_ps.proto import control
    try:
        control.SCHEMA["register"]["job_name"][1]("--job", value)
    except control.ControlError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {value!r}") from None
    return value


def _job_arg(p, default_help: str):
    p.add_argument("--job", type=_job_name, default=None, metavar="NAME",
                   help="the job's name on the PS: workers of one name form one job, other names run "
                        f"beside it ({default_help})")


def _running_ps_args(p, ps_help: str, keys_help: str) -> None:
    """The options of a command that talks to a running PS: where (--ps, --control-port) and
    with which keys (--keys)."""
    p.add_argument("--ps", type=_addr_list, required=True, help=ps_help)
    p.add_argument("--control-port", type=_port, default=None, help="control port (default data port + 1)")
    p.add_argument("--keys", default=None, metavar="DIR", help=keys_help)


def _slot_space() -> int:
    from thc_ps.ps_server.admission import DEFAULT_SLOT_SPACE
    return DEFAULT_SLOT_SPACE


def _policies():
    from thc_ps.worker.transport import POLICIES
    return POLICIES


def _model_arg(p):
    p.add_argument("--model", choices=("cnn", "mlp", "mlp-wide"), default="cnn",
                   help="model (mlp-wide: 784-2600-10, 2.07 M parameters, padded by the RHT to "
                        "2,072,592 coordinates, each tensor in blocks of its own)")


def _policy_arg(p):
    p.add_argument("--loss-policy", choices=_policies(), default=_policies()[0],
                   help="retransmit (nothing lost) or zero (a lost chunk is a zero update, paper §6.1)")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("thc-ps")
    except Exception:   # a source checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thc", description="THC-PS: Tensor Homomorphic Compression parameter server.",
        formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="log messages at this level and above, on stderr (default: info for "
                             "`thc ps`, warning otherwise)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = _command(sub, "table", help="solve the optimal lookup table for (b, g, p) and print JSON",
                 description="Exact App. B optimum over all strictly increasing tables.",
                 parents=[job_parent("bits", "granularity", "p")])
    t.set_defaults(func=commands.cmd_table)

    n = _command(sub, "nmse", help="NMSE of one aggregation round of a codec, as JSON",
                 description="NMSE = ||x_hat - x_mean||^2 / ||x_mean||^2 averaged over trials "
                             "(THC paper App. C.1 method with --copies).",
                 parents=[job_parent("workers", "bits", "granularity", "p", "seed", "block-log2", "tail-log2",
                                     workers=2)])
    n.add_argument("--codec", default="thc", choices=commands.nmse_codecs(), help="codec")
    n.add_argument("--dim", type=_dim, default=1 << 20, help="gradient dimension d")
    n.add_argument("--dist", default="lognormal", choices=("lognormal", "normal", "laplace"),
                   help="gradient distribution")
    mode = n.add_mutually_exclusive_group()
    mode.add_argument("--copies", dest="copies", action="store_true", default=True,
                      help="one gradient copied to every worker (the default, App. C.1)")
    mode.add_argument("--independent", dest="copies", action="store_false",
                      help="an independent gradient per worker")
    n.add_argument("--topk", type=_float_in(0, 1, lo_open=True, hi_open=False, what="a fraction"), default=0.1,
                   help="TopK kept fraction")
    n.add_argument("--trials", type=_rounds, default=10, help="rounds averaged")
    n.set_defaults(func=commands.cmd_nmse)

    _add_cluster_commands(sub)

    tr = _command(sub, "train", help="train a model on Fashion-MNIST through a local PS + N workers",
                  description="Starts a PS and N worker processes on this host, trains with the "
                              "chosen codec over UDP, prints per-epoch progress, then repeats the "
                              "run uncompressed and prints the comparison.",
                  parents=[job_parent(**LOCAL_GROUP)])
    tr.add_argument("--epochs", type=_int_in(1, 10000, "epochs"), default=3, help="epochs")
    tr.add_argument("--codec", choices=commands.job_codecs(), default="thc", help="codec")
    _model_arg(tr)
    tr.add_argument("--batch", type=_int_in(1, 65536, "a batch size"), default=64, help="per-worker batch")
    tr.add_argument("--lr", type=_float_in(0, 10, lo_open=True, hi_open=False, what="a learning rate"),
                    default=0.05, help="SGD learning rate")
    tr.add_argument("--loss", type=_probability, default=0.0, help="injected packet loss each way")
    _policy_arg(tr)
    tr.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of a straggling round")
    tr.add_argument("--straggler-prob", type=_probability, default=0.0,
                    help="probability that a worker straggles in a round")
    tr.add_argument("--straggler-count", type=_int_in(0, 31, "a worker count"), default=0,
                    help="k random stragglers per round, all workers agree which (paper §8.3)")
    tr.add_argument("--sync-every", type=_int_in(0, 1 << 20, "epochs"), default=1,
                    help="model sync period in epochs (0: never)")
    tr.add_argument("--ps", type=_addr_text, default=None,
                    help="use a running PS at HOST:PORT[,HOST:PORT...] (implies --no-baseline)")
    _job_arg(tr, "with --ps; default: a fresh name per run")
    tr.add_argument("--keys", default=None, metavar="DIR",
                    help="key directory (`thc keys`): the PS this starts and the workers use CURVE; with "
                         "--ps, the running PS's keys (client.key_secret and server.key)")
    tr.add_argument("--train-limit", type=_count, default=0, help="use only the first N training images (0: all)")
    tr.add_argument("--test-limit", type=_count, default=0, help="use only the first N test images (0: all)")
    tr.add_argument("--per-tensor", action="store_true",
                    help="one PS round per parameter tensor (per-layer scales, as 3LC and CASQ expect)")
    tr.add_argument("--grad-sync", choices=train_mod.GRAD_SYNC, default=train_mod.TrainConfig.grad_sync,
                    help="hook: each DDP bucket goes to the PS while backward goes on (overlapped); "
                         "after-backward: one round per model once backward ends; auto: the hook only for a "
                         "model whose gradients fill more than one bucket (--bucket-cap-mb), and never with "
                         "--per-tensor or --restart-killed")
    tr.add_argument("--bucket-cap-mb", type=_float_in(0, 16384, lo_open=True, hi_open=False, what="a size in MB"),
                    default=train_mod.TrainConfig.bucket_cap_mb,
                    help="DDP's bucket size with the hook, as DDP's own bucket_cap_mb")
    tr.add_argument("--no-baseline", action="store_true", help="skip the uncompressed comparison run")
    tr.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    tr.set_defaults(func=commands.cmd_train)

    ex = _command(sub, "experiment", help="rerun the paper's loss/straggler/scale/bandwidth experiments, "
                                           "the codec comparison, or DDP's own hooks beside THC (peers)",
                  description="Each writes NAME.md (table), NAME.json and NAME.png (plots) to --out.",
                  parents=[job_parent("workers", "bits", "granularity", "p", "seed", "rotation",
                                      workers=None, granularity=None, p=None,
                                      helps={"workers": "workers (default 4; 10 for stragglers)",
                                             "granularity": "granularity g (default 30; 20 for stragglers)",
                                             "p": "support fraction p (default 1/32; 1/512 for stragglers)"})])
    ex.add_argument("name", choices=("loss", "stragglers", "scale", "bandwidth", "codecs", "peers", "lm"),
                    help="which experiment (lm: the library example's transformer language model under "
                         "link caps, docs/experiments/lm.md)")
    ex.add_argument("--epochs", type=_int_in(1, 10000, "epochs"), default=3, help="epochs per training run")
    _model_arg(ex)
    ex.add_argument("--train-limit", type=_count, default=30000, help="training images used")
    ex.add_argument("--test-limit", type=_count, default=5000, help="test images used")
    ex.add_argument("--kernel-loss", action="store_true",
                    help="loss: also drop real packets with nftables between namespaces (root)")
    ex.add_argument("--delay-ms", type=_delay_ms, default=30.0, help="stragglers: delay per straggling round")
    ex.add_argument("--codecs", type=_codec_list, default="none,thc",
                    help="bandwidth: comma list of codecs")
    ex.add_argument("--rates", type=_rate_list, default="100,1000,0",
                    help="bandwidth: comma list of link rates in Mbit/s, 0 = unlimited")
    ex.add_argument("--peer-rates", type=_rate_list, default=None,
                    help="peers, lm: comma list of link rates in Mbit/s, 0 = loopback (peers only); a capped "
                         "rate puts every rank and the PS in a host namespace of its own behind a link of that "
                         "rate (root) (default: peers 0, lm 100,1000)")
    ex.add_argument("--layouts", type=_choice_list("layout", tuple(experiments.LAYOUTS)), default=None,
                    help="peers, lm: where THC-PS aggregates under a capped rate, a comma list of "
                         + ", ".join(experiments.LAYOUTS) + " (docs/experiments/peers.md; default: peers "
                         + ",".join(experiments.DEFAULT_LAYOUTS) + "; lm colocated)")
    ex.add_argument("--methods", type=_choice_list("method", experiments.PEER_METHODS), default=None,
                    help="peers: a comma list of " + ", ".join(experiments.PEER_METHODS) + " (default: all); "
                         "lm: of ddp-fp32, ddp-fp16, thc-hook, thc-ps (default: all four)")
    ex.add_argument("--steps", type=_int_in(1, 1 << 20, "steps"), default=300, help="lm: training steps")
    ex.add_argument("--target-loss", type=_float_in(0, 10, lo_open=True, hi_open=False, what="a loss"),
                    default=2.2, help="lm: the validation loss whose time is compared")
    ex.add_argument("--target", type=_float_in(0, 1, lo_open=True, hi_open=False, what="an accuracy"),
                    default=0.8, help="peers, bandwidth: the test accuracy whose time is compared")
    ex.add_argument("--eval-every", type=_int_in(0, 1 << 20, "steps"), default=0,
                    help="peers: test accuracy every N steps as well as at each epoch's end (0: epochs only), "
                         "so that the time to --target is not rounded up to an epoch; lm: rank 0's validation "
                         "loss every N steps (0: every 25), so that the time to --target-loss is not rounded "
                         "up to N steps")
    ex.add_argument("--per-tensor", action="store_true",
                    help="one PS round per parameter tensor (as 3LC and CASQ are meant to run)")
    ex.add_argument("--out", default=None, metavar="DIR",
                    help="where NAME.md, NAME.json and the plots go (default: ./thc-results/NAME; "
                         "`--out docs/experiments` regenerates the committed results)")
    ex.set_defaults(func=commands.cmd_experiment)

    p4 = _command(sub, "p4", help="the P4 switch program: check tools, generate, compile, test with p4testgen, "
                                  "run under bmv2, run workers through it in Mininet",
                  description="The P4 switch program. Each action is a subcommand with its own "
                              "options: `thc p4 ACTION --help`.")
    p4_sub = p4.add_subparsers(dest="action", required=True, metavar="ACTION")
    # options several actions share, each added only where it means something
    p4_job = job_parent("workers", "quorum", "granularity", "p")
    p4_out = argparse.ArgumentParser(add_help=False)
    p4_out.add_argument("--out", default="build/p4", help="output directory of compiled programs")
    p4_switch = argparse.ArgumentParser(add_help=False)
    p4_switch.add_argument("--switch-control", choices=("auto",) + SWITCH_CONTROLS, default="auto",
                           help="how the switch is programmed: p4runtime (simple_switch_grpc) or thrift "
                                "(simple_switch_CLI); auto: p4runtime where simple_switch_grpc and the P4Runtime "
                                "client are there, else thrift (the choice and why are printed)")

    p4_lease = argparse.ArgumentParser(add_help=False)
    p4_lease.add_argument("--lease-s", type=_float_in(0.2, 3600, lo_open=False, hi_open=False, what="seconds"),
                          default=SWITCH_LEASE_S,
                          help="a rank without a heartbeat for this long is reported missing (longer than "
                               "`thc ps`'s 5 s: bmv2 carries the control plane's TCP in the queues THC's "
                               "packets fill, and with 8 workers a heartbeat waited 5 s)")

    p4_doctor = _command(
        p4_sub, "doctor", help="find and check the P4 tools",
        description="Find and check the P4 tools (PATH, /opt/p4tools/bin, $THC_P4_TOOLS) and Debian's "
                    "mininet, nft, ethtool, ip; exit 0 when simple_switch, simple_switch_CLI and "
                    "p4c-bm2-ss work.")
    p4_doctor.add_argument("--json", action="store_true", help="one JSON document")

    p4_gen = _command(
        p4_sub, "gen", help="write the P4 programs from p4/gen_p4.py",
        description="Write p4/thc.p4 (v1model) and p4/tofino/thc_tna.p4 (Tofino) from p4/gen_p4.py.")
    p4_gen.add_argument("--check", action="store_true", help="only check that the committed programs are current")
    p4_gen.add_argument("--target", choices=("all", "v1model", "tna"), default="all",
                        help="which program: v1model (bmv2), tna (Tofino) or both")

    p4_build = _command(
        p4_sub, "build", parents=[p4_out], help="compile a P4 program",
        description="Compile p4/thc.p4 with p4c-bm2-ss (bmv2), or p4/tofino/thc_tna.p4 with p4c-barefoot "
                    "(tofino: TNA, tofino2: T2NA).")
    p4_build.add_argument("--target", choices=("bmv2", "tofino", "tofino2"), default="bmv2",
                          help="compiler back end: bmv2 (p4c-bm2-ss), tofino or tofino2 (p4c-barefoot)")

    p4_tg = _command(
        p4_sub, "testgen", help="p4testgen's input/output tests of a program, replayed against the software PS",
        description="Run p4testgen on p4/thc.p4 (bmv2) or p4/tofino/thc_tna.p4 (tofino, tofino2) with a fixed "
                    "seed, aiming at statement coverage; write its tests and the coverage reached to --out; "
                    "replay every test against the software PS (ps_server/reference.py) and, with --switch, "
                    "run the bmv2 tests on simple_switch (root). Exit 1 when a test diverges or fails.")
    p4_tg.add_argument("--target", choices=("bmv2", "tofino", "tofino2"), default="bmv2",
                       help="bmv2: p4/thc.p4 (v1model, STF tests); tofino, tofino2: p4/tofino/thc_tna.p4 "
                            "(TNA, T2NA; PTF tests)")
    p4_tg.add_argument("--max-tests", type=_int_in(1, 1 << 20, "tests"), default=100,
                       help="at most this many tests (p4testgen stops earlier at full statement coverage)")
    p4_tg.add_argument("--seed", type=_int_in(0, (1 << 32) - 1, "a seed"), default=1, help="p4testgen's seed")
    p4_tg.add_argument("--out", default=None, metavar="DIR",
                       help="where the tests, testgen.json and replay.json go (default: build/p4/testgen/TARGET; "
                            "a directory with committed files is refused)")
    p4_tg.add_argument("--tables", choices=("job", "free"), default="job",
                       help="job: the program's tables hold two real jobs (bmv2) or one (tofino) as const "
                            "entries, written by the control plane's code, so the tests reach their slots; "
                            "free: p4testgen chooses every entry (most are entries no job writes)")
    p4_tg.add_argument("--port-ranges", default=None, metavar="LOW:HIGH[,...]",
                       help="the ports p4testgen may choose for input and output (default: 0:15, and the "
                            "recirculation port 68 for tofino; tofino with 0:15 gives first passes only)")
    p4_tg.add_argument("--program", default=None, metavar="P4",
                       help="another program for the same target (default: the committed one)")
    p4_tg.add_argument("--no-replay", action="store_true", help="only generate")
    p4_tg.add_argument("--switch", action="store_true",
                       help="bmv2: also run every test on simple_switch (root: veth pairs)")

    p4_run = _command(
        p4_sub, "run", parents=[p4_job, p4_out, p4_switch, p4_lease],
        help="run the program under simple_switch and serve the workers",
        description="Start simple_switch on interfaces (or attach to a running one) and serve the "
                    "workers' control plane: each job (workers of one --job name) gets a region of the "
                    "switch's slots and is programmed when its first worker registers, removed when it "
                    "ends; up to 8 jobs run at once, more wait in a queue.")
    p4_run.add_argument("--iface", action="append", default=[], metavar="PORT=IFACE",
                        help="switch port number and interface, repeatable")
    p4_run.add_argument("--worker-port", action="append", default=[], metavar="IP=PORT,MAC",
                        help="where a worker's address attaches (switch port and MAC), repeatable")
    p4_run.add_argument("--ps-ip", default="10.0.0.254", help="the address workers send to")
    p4_run.add_argument("--ps-mac", default="00:00:00:00:00:fe", help="the MAC address workers send to")
    p4_run.add_argument("--control", type=_addr, default="0.0.0.0:9001",
                        help="ZeroMQ control plane address HOST:PORT")
    p4_run.add_argument("--thrift-port", type=_port, default=9090, help="simple_switch Thrift port")
    p4_run.add_argument("--grpc-port", type=_port, default=None,
                        help="simple_switch_grpc's P4Runtime port on 127.0.0.1 (default: a free one for the switch "
                             "this starts, 9559 with --attach)")
    p4_run.add_argument("--l2", action="append", default=[], metavar="MAC=PORT",
                        help="a plain forwarding entry (non-THC traffic) the control plane writes, repeatable "
                             "(P4Runtime loads the program, so the switch starts with none)")
    p4_run.add_argument("--attach", action="store_true",
                        help="program a simple_switch that is already running (e.g. started by Mininet) "
                             "on --thrift-port instead of compiling and starting one")

    p4_mn = _command(
        p4_sub, "mininet", parents=[p4_job, p4_out, p4_switch, p4_lease],
        help="real workers through one bmv2 switch in Mininet (root)",
        description="One bmv2 switch and N hosts running real `thc worker`s in Mininet, every chunk "
                    "checked exactly (root).")
    p4_mn.add_argument("--json", action="store_true", help="one JSON document")
    p4_mn.add_argument("--rounds", type=_rounds, default=20, help="rounds")
    p4_mn.add_argument("--dim", type=_dim, default=4096, help="coordinates per round")
    p4_mn.add_argument("--loss", type=_probability, default=0.0,
                       help="packet loss each way on every host link (nftables drops)")
    p4_mn.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of a straggling round")
    p4_mn.add_argument("--straggler-rank", type=_int_in(0, 31, "a rank"), default=None,
                       help="which worker straggles (default: all)")
    _policy_arg(p4_mn)
    p4_mn.add_argument("--timeout-ms", type=_timeout_ms, default=200.0, help="the workers' " + TIMEOUT_HELP)
    _fixed_timeout_arg(p4_mn)
    p4_mn.add_argument("--control-mode", choices=("static", "p4run"), default="static",
                       help="job preprogrammed with a registration-only control host (static), or "
                            "`thc p4 run --attach` programming it as workers register (p4run)")
    p4_mn.add_argument("--jobs", type=_int_in(1, 8, "jobs"), default=1,
                       help="jobs at once, --workers hosts each, sharing the switch (needs --control-mode "
                            "p4run)")
    p4.set_defaults(func=commands.cmd_p4)

    b = _command(sub, "bench", help="benchmarks: `thc bench codecs` compares every codec in one run")
    bsub = b.add_subparsers(dest="what", metavar="BENCH", required=True)
    bc = _command(bsub, "codecs", help="every codec side by side: ratios, NMSE, speed, PS time, UDP round time",
                  parents=[job_parent("workers")])
    bc.add_argument("--dims", type=_int_in(4, 26, "log2 of a dimension"), nargs="+", default=[20, 24],
                    help="log2 of d")
    bc.add_argument("--e2e-dims", type=_int_in(4, 26, "log2 of a dimension"), nargs="*", default=[20, 24],
                    help="log2 of d for the end-to-end UDP round time (about 3 of the 5 minutes on 2 "
                         "cores are the 2^24 rounds, `--e2e-dims 20` skips them)")
    bc.add_argument("--rounds", type=_rounds, default=2, help="rounds per measurement")
    bc.add_argument("--out", default=None, metavar="DIR",
                    help="where codecs-table.md and codecs.png go (default: ./thc-results/bench-codecs; "
                         "`--out docs` regenerates the committed table)")
    bc.set_defaults(func=commands.cmd_bench)

    d = _command(sub, "demo-nmse", help="print the NMSE comparison of all codecs (quick look)",
                 parents=[job_parent("workers")])
    d.add_argument("--dim", type=_dim, default=1 << 18, help="gradient dimension d")
    d.add_argument("--trials", type=_rounds, default=3, help="rounds averaged")
    d.set_defaults(func=commands.cmd_demo_nmse)
    return parser


def _float_in(lo: float, hi: float, *, lo_open: bool, hi_open: bool, what: str):
    """argparse type for a float in an interval, with a message naming the interval."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(value: str) -> float:
        try:
            v = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
        if v != v or (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            raise argparse.ArgumentTypeError(f"expected {what} in {interval}, got {value!r}")
        return v
    return parse


_probability = _float_in(0, 1, lo_open=False, hi_open=True, what="a probability")
_delay_ms = _float_in(0, 60000, lo_open=False, hi_open=False, what="milliseconds")
_timeout_ms = _float_in(1, 60000, lo_open=False, hi_open=False, what="milliseconds")
TIMEOUT_HELP = ("the first retransmission timeout until the path is measured; then the timeout follows the "
                "measured round trips, at least 1 ms (see --fixed-timeout); most losses are found without it")


def _fixed_timeout_arg(parser) -> None:
    parser.add_argument("--fixed-timeout", action="store_true",
                        help="start every chunk's timer at --timeout-ms instead of the round trip "
                             "measured on the path (the rule before the adaptive timer, for comparison)")


def _error_feedback_arg(parser) -> None:
    parser.add_argument("--error-feedback", action="store_true",
                        help="codec thc: every rank keeps its error feedback (THC Alg. 3 line 22; with --rotation "
                             "job in the rotated domain, docs/protocol.md §4 step 8), so a round's encoding adds "
                             "the rank's residual of the round before; thc launch's exact check replays it "
                             "(without it the test gradients are encoded alone, e = 0)")


def _ps_wait_arg(parser) -> None:
    parser.add_argument("--ps-wait-s", type=_float_in(1, 86400, lo_open=False, hi_open=False, what="seconds"),
                        default=None, help="how long a worker waits for a PS that answers nothing (a "
                                           "restarted or stalled PS comes back within it) before it "
                                           "gives up (default 60)")


_quorum = _float_in(0, 1, lo_open=True, hi_open=False, what="a quorum fraction of workers")


def _addr(value: str):
    """HOST:PORT → (host, port), with a message that says what is wrong."""
    from thc_ps.proto.addresses import parse_addr
    try:
        return parse_addr(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _addr_list(value: str):
    from thc_ps.proto.addresses import parse_addrs
    try:
        return parse_addrs(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _addr_text(value: str) -> str:
    """HOST:PORT[,HOST:PORT…], checked, as the text the run takes ("host:port,host:port")."""
    return ",".join(f"{h}:{p}" for h, p in _addr_list(value))


def _add_cluster_commands(sub):
    ps = _command(sub, "ps", help="run one software PS process (per host)",
                  description="Software PS: UDP data plane (C engine) on ADDR:PORT, ZeroMQ "
                              "control plane on PORT+1 (or --control-port).",
                  parents=[job_parent(workers=None, helps={
                      "workers": "number of workers n (without it, the PS accepts the job its first "
                                 "worker proposes)"})])
    _codec_arg(ps)
    _slots_arg(ps)
    ps.add_argument("--bind", type=_addr, default="127.0.0.1:9000", help="ADDR:PORT of the data plane")
    ps.add_argument("--control-port", type=_port, default=None, help="control port (default PORT+1)")
    ps.add_argument("--shards", type=_int_in(1, 16, "a shard count"), default=1,
                    help="PS shards in this process splitting the slot space (data ports PORT, PORT+2, ...)")
    ps.add_argument("--engine", choices=("c", "python"), default="c", help="aggregation engine")
    ps.add_argument("--slot-space", type=_int_in(1, 65536, "a slot count"), default=_slot_space(),
                    help="slots shared by the jobs running at once: each gets a region of them, what "
                         "it asks for or a fair share (docs/design.md, \"Many jobs on one PS\")")
    ps.add_argument("--keys", default=None, metavar="DIR",
                    help="CURVE key directory from `thc keys DIR`: authenticated, encrypted control plane")
    ps.add_argument("--lease-s", type=_float_in(0.2, 3600, lo_open=False, hi_open=False, what="seconds"),
                    default=5.0, help="a rank without a heartbeat for this long is reported missing "
                                      "and may be claimed again")
    ps.add_argument("--rejoin-grace-s", type=_float_in(0, 86400, lo_open=False, hi_open=False, what="seconds"),
                    default=30.0, help="a rank whose lease expired may rejoin within this long; after it, "
                                       "a job that needs the rank fails naming it")
    ps.add_argument("--stats-every", type=_float_in(0, 86400, lo_open=False, hi_open=False, what="seconds"),
                    default=10.0, help="seconds between stats lines (0: off)")
    ps.add_argument("--metrics", type=_addr, default=None, metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (totals and per running job) "
                         "and /healthz (200 while the PS serves)")
    ps.set_defaults(func=commands.cmd_ps)

    w = _command(sub, "worker", help="run one worker process: R rounds of test gradients through a PS",
                 description="Connects to a running `thc ps`, registers as --rank, runs rounds. The "
                             "job options given are what it insists on.",
                 parents=[job_parent("workers", "bits", "granularity", "p", "lane-bits", "quorum",
                                     "block-log2", "tail-log2", "rotation", "result-group", stated=True)])
    _codec_arg(w, stated=True)
    _running_ps_args(w, "the PS data address HOST:PORT, or a comma list of S shards (a DATA phase's chunks go "
                        "in runs of up to 64, run j to shard j mod S; NORM phases and barriers to the first; "
                        "docs/protocol.md §9)",
                     "key directory with client.key_secret and server.key (`thc keys`)")
    w.add_argument("--rank", type=_int_in(0, 31, "a rank"), default=None,
                   help="worker id (default: $RANK from torchrun, else 0)")
    w.add_argument("--rounds", type=_rounds, default=10, help="rounds")
    w.add_argument("--dim", type=_dim, default=1 << 16, help="coordinates per round")
    w.add_argument("--loss", type=_probability, default=0.0, help="injected loss each way")
    _policy_arg(w)
    w.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay before each round's data phase")
    # not stated: the seed of the test gradients, and of the job when this worker proposes it
    w.add_argument("--seed", type=_seed, default=0, help=JOB_OPTIONS["seed"]["help"])
    w.add_argument("--control-host", default=None, help="control plane host if not the PS data host")
    w.add_argument("--bind-port", type=_any_port, default=0, help="local UDP port (0: any)")
    w.add_argument("--timeout-ms", type=_timeout_ms, default=50.0, help=TIMEOUT_HELP)
    _fixed_timeout_arg(w)
    _ps_wait_arg(w)
    w.add_argument("--report", type=_report_path, default=None,
                   help="write every round's report (digests, k, bitmaps) as JSON")
    _error_feedback_arg(w)
    _job_arg(w, "default: \"default\", the name every thc worker without --job shares")
    w.set_defaults(func=commands.cmd_worker)

    la = _command(sub, "launch", help="start a PS and N workers here, run rounds, check every one",
                  description="Local cluster with an exactness check of every chunk of every "
                              "round against an in-process reference.",
                  parents=[job_parent(**LOCAL_GROUP)])
    _codec_arg(la)
    _slots_arg(la)
    la.add_argument("--rounds", type=_rounds, default=10, help="rounds")
    la.add_argument("--dim", type=_dim, default=1 << 16, help="coordinates per round")
    la.add_argument("--loss", type=_probability, default=0.0, help="injected loss each way")
    la.add_argument("--duplicate", type=_probability, default=0.0, help="injected duplicates")
    la.add_argument("--reorder", type=_probability, default=0.0, help="injected reordering")
    la.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of the straggler per round")
    la.add_argument("--straggler-rank", type=_int_in(0, 31, "a rank"), default=None,
                    help="which worker straggles (default: all)")
    _policy_arg(la)
    la.add_argument("--timeout-ms", type=_timeout_ms, default=50.0, help=TIMEOUT_HELP)
    _fixed_timeout_arg(la)
    _ps_wait_arg(la)
    la.add_argument("--engine", choices=("c", "python"), default="c", help="the started PS's aggregation engine")
    la.add_argument("--ps", type=_addr_text, default=None,
                    help="use a running PS at HOST:PORT (or a comma list of shards) instead of starting one")
    la.add_argument("--shards", type=_int_in(1, 16, "a shard count"), default=1, help="PS shards to start")
    la.add_argument("--serve-shard", type=_addr_text, default=None, metavar="ADDR:PORT",
                    help="also run this host's PS shard of the job at ADDR:PORT, one of --ps's (colocated "
                         "shards: every host lists all shards in --ps and serves its own)")
    la.add_argument("--local-workers", "--nproc-per-node", dest="local_workers",
                    type=_workers, default=None,
                    help="how many of the job's ranks this host runs (default: all of them)")
    ranks = la.add_mutually_exclusive_group()
    ranks.add_argument("--rank-base", type=_int_in(0, 31, "a rank"), default=None,
                       help="first rank this host runs (default 0)")
    ranks.add_argument("--node-rank", type=_int_in(0, 31, "a node rank"), default=None,
                       help="torchrun's spelling: this host runs ranks node_rank × local_workers onwards")
    la.add_argument("--keys", default=None, metavar="DIR",
                    help="key directory (`thc keys`): the started PS and the workers use CURVE")
    la.add_argument("--lease-s", type=_float_in(0.2, 3600, lo_open=False, hi_open=False, what="seconds"),
                    default=None, help="lease of the PS this starts (default 5)")
    la.add_argument("--rejoin-grace-s", type=_float_in(0, 86400, lo_open=False, hi_open=False, what="seconds"),
                    default=None, help="rejoin grace of the PS this starts (default 30)")
    la.add_argument("--stall-s", type=_float_in(0, 86400, lo_open=True, hi_open=False, what="seconds"),
                    default=180.0, help="stop the job when no worker started a round for this long, "
                                        "naming the ranks behind")
    la.add_argument("--kill-rank", type=_int_in(0, 31, "a rank"), default=None,
                    help="fault injection: this rank's process dies at --kill-at-round")
    la.add_argument("--kill-at-round", type=_int_in(0, 1 << 30, "a round"), default=None,
                    help="the round at whose start --kill-rank dies (default 0)")
    la.add_argument("--restart-killed", action="store_true",
                    help="start a killed rank again: it rejoins the running job")
    la.add_argument("--json", action="store_true", help="print one JSON summary line")
    la.add_argument("--verbose", action="store_true", help="per-round progress from every worker")
    _error_feedback_arg(la)
    _job_arg(la, "with --ps; default: a fresh name per launch, or \"default\" when this host runs a "
                 "share of the ranks")
    la.set_defaults(func=commands.cmd_launch)

    st = _command(sub, "status", help="the jobs a running PS serves: running and queued, with their "
                                      "workers, slot regions, rounds and counters",
                  description="Asks a running `thc ps` (its control plane) for its jobs; exits 1 when "
                              "it does not answer.")
    _running_ps_args(st, "the PS data address HOST:PORT, or a comma list of shards",
                     "key directory (`thc keys`) of a PS run with --keys")
    st.add_argument("--timeout-s", type=_float_in(0.1, 600, lo_open=False, hi_open=False, what="seconds"),
                    default=3.0, help="how long to wait for the answer")
    st.add_argument("--json", action="store_true", help="the status reply as JSON (a list for several shards)")
    st.add_argument("--drain", action="store_true",
                    help="first tell the PS (every shard) to drain: admit no new job, refuse the queued "
                         "ones (code draining), let the running jobs finish, then exit 0 (as SIGUSR1 does)")
    st.set_defaults(func=commands.cmd_status)

    k = _command(sub, "keys", help="make a CURVE key directory for the control plane",
                 description="Writes DIR/server.key(_secret), DIR/client.key(_secret) and "
                             "DIR/authorized/client.key.  The PS host needs the directory "
                             "(thc ps --keys DIR); worker hosts need client.key_secret and "
                             "server.key (thc worker --keys DIR).")
    k.add_argument("dir", help="directory to create")
    k.set_defaults(func=commands.cmd_keys)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """Exit status: 0 success, 2 bad arguments or a refused configuration (before any
    traffic), 1 a run that failed (a check found a problem, a worker or the PS failed)."""
    import signal
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or ("info" if args.command == "ps" else "warning")).upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(message)s" if args.log_level is None else "%(levelname)s %(name)s: %(message)s")
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    old = signal.signal(signal.SIGTERM, _sigterm)    # a service manager's stop = Ctrl-C
    try:
        return _run(args)
    finally:                                         # main() called in-process leaves no handler
        signal.signal(signal.SIGTERM, old)


def _run(args) -> int:
    if args.command in ("ps", "worker", "launch", "train"):
        from thc_ps.deploy import hostload
        hostload.warn_in_background(f"thc {args.command}")   # other sessions' CPU-bound load, once
    try:
        result = args.func(args)
    except ValueError as exc:
        print(f"thc {args.command}: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False) and args.command in ("launch", "train"):
            # a --json run always ends with its JSON line, a refused one too
            print(json.dumps({"ok": False, "refused": True, "problems": [str(exc)]}))
        return 2
    except (OSError, RuntimeError) as exc:
        if not (getattr(args, "json", False) and isinstance(getattr(exc, "doc", None), dict)):
            print(f"thc {args.command}: error: {exc}", file=sys.stderr)
            return 1
        result = exc.doc        # a launch no worker reported to: its --json line all the same
    except KeyboardInterrupt:
        print(f"thc {args.command}: interrupted", file=sys.stderr)
        return 130
    if isinstance(result, int):
        return result
    if isinstance(result, dict):
        print(json.dumps(result))
        if result.get("ok") is False:
            for problem in result.get("problems", []):
                print(f"thc {args.command}: {problem}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
