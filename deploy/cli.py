"""The `thc` command: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

from deploy import commands


def _p_arg(value: str):
    from proto.tables import parse_p
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
_count = _int_in(0, 1 << 31, "a count")


def _report_path(value: str) -> str:
    """A file the run may write at its end: its directory must exist now, not after an hour."""
    from pathlib import Path
    parent = Path(value).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return value


def _codec_list(value: str) -> tuple:
    from compression import registry
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thc", description="THC-PS: Tensor Homomorphic Compression parameter server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser("table", help="solve the optimal lookup table for (b, g, p) and print JSON",
                       description="Exact App. B optimum over all strictly increasing tables.")
    t.add_argument("--bits", type=_bits, default=4, help="bit budget b per index (1-8, default 4)")
    t.add_argument("--granularity", type=_granularity, default=30, help="granularity g (default 30)")
    t.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p, e.g. 1/32 (default)")
    t.set_defaults(func=commands.cmd_table)

    n = sub.add_parser("nmse", help="NMSE of one aggregation round of a codec, as JSON",
                       description="NMSE = ||x_hat - x_mean||^2 / ||x_mean||^2 averaged over trials "
                                   "(THC paper App. C.1 method with --copies).")
    n.add_argument("--codec", default="thc", choices=commands.nmse_codecs(), help="codec (default thc)")
    n.add_argument("--workers", type=_workers, default=2, help="number of workers n (default 2)")
    n.add_argument("--dim", type=_dim, default=1 << 20, help="gradient dimension d (default 2^20)")
    n.add_argument("--dist", default="lognormal", choices=("lognormal", "normal", "laplace"),
                   help="gradient distribution (default lognormal)")
    mode = n.add_mutually_exclusive_group()
    mode.add_argument("--copies", dest="copies", action="store_true", default=True,
                      help="one gradient copied to every worker (default, App. C.1)")
    mode.add_argument("--independent", dest="copies", action="store_false",
                      help="an independent gradient per worker")
    n.add_argument("--bits", type=_bits, default=4, help="bits per index b (default 4)")
    n.add_argument("--granularity", type=_granularity, default=30, help="granularity g (default 30)")
    n.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p (default 1/32)")
    n.add_argument("--topk", type=_float_in(0, 1, lo_open=True, hi_open=False, what="a fraction"), default=0.1, help="TopK kept fraction (default 0.1)")
    n.add_argument("--trials", type=_rounds, default=10, help="rounds averaged (default 10)")
    n.add_argument("--seed", type=_seed, default=0, help="RNG seed (default 0)")
    n.set_defaults(func=commands.cmd_nmse)

    _add_cluster_commands(sub)

    tr = sub.add_parser("train", help="train a model on Fashion-MNIST through a local PS + N workers",
                        description="Starts a PS and N worker processes on this host, trains with the "
                                    "chosen codec over UDP, prints per-epoch progress, then repeats the "
                                    "run uncompressed and prints the comparison.")
    tr.add_argument("--workers", type=_workers, default=4, help="workers (default 4)")
    tr.add_argument("--epochs", type=_int_in(1, 10000, "epochs"), default=3, help="epochs (default 3)")
    tr.add_argument("--codec", choices=commands.job_codecs(), default="thc", help="codec (default thc)")
    tr.add_argument("--bits", type=_bits, default=4, help="index bits b (default 4)")
    tr.add_argument("--granularity", type=_granularity, default=30, help="granularity g (default 30)")
    tr.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p (default 1/32)")
    tr.add_argument("--lane-bits", type=int, choices=(8, 16, 32), default=8, help="sum lane width (default 8)")
    tr.add_argument("--model", choices=("cnn", "mlp"), default="cnn", help="model (default cnn)")
    tr.add_argument("--batch", type=_int_in(1, 65536, "a batch size"), default=64, help="per-worker batch (default 64)")
    tr.add_argument("--lr", type=_float_in(0, 10, lo_open=True, hi_open=False, what="a learning rate"), default=0.05, help="SGD learning rate (default 0.05)")
    tr.add_argument("--loss", type=_probability, default=0.0, help="injected packet loss each way")
    tr.add_argument("--loss-policy", choices=("retransmit", "zero"), default="retransmit",
                    help="retransmit (nothing lost) or zero (paper §6.1)")
    tr.add_argument("--quorum", type=_quorum, default=1.0, help="partial aggregation quorum (default 1.0)")
    tr.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of a straggling round")
    tr.add_argument("--straggler-prob", type=_probability, default=0.0,
                    help="probability that a worker straggles in a round")
    tr.add_argument("--straggler-count", type=_int_in(0, 31, "a worker count"), default=0,
                    help="k random stragglers per round, all workers agree which (paper §8.3)")
    tr.add_argument("--sync-every", type=_int_in(0, 1 << 20, "epochs"), default=1, help="model sync period in epochs (0: never)")
    tr.add_argument("--ps", type=str, default="",
                    help="use a running PS at HOST:PORT[,HOST:PORT...] (implies --no-baseline)")
    tr.add_argument("--seed", type=_seed, default=0, help="seed (default 0)")
    tr.add_argument("--train-limit", type=_count, default=0, help="use only the first N training images")
    tr.add_argument("--test-limit", type=_count, default=0, help="use only the first N test images")
    tr.add_argument("--per-tensor", action="store_true",
                    help="one PS round per parameter tensor (per-layer scales, as 3LC and CASQ expect)")
    tr.add_argument("--no-baseline", action="store_true", help="skip the uncompressed comparison run")
    tr.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    tr.set_defaults(func=commands.cmd_train)

    ex = sub.add_parser("experiment", help="rerun the paper's loss/straggler/scale/bandwidth experiments",
                        description="Each writes docs/experiments/NAME.md (table) and NAME.png (plots).")
    ex.add_argument("name", choices=("loss", "stragglers", "scale", "bandwidth", "codecs"))
    ex.add_argument("--workers", type=_workers, default=None,
                    help="workers (default 4; 10 for stragglers)")
    ex.add_argument("--epochs", type=_int_in(1, 10000, "epochs"), default=3)
    ex.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    ex.add_argument("--train-limit", type=_count, default=30000, help="training images used (default 30000)")
    ex.add_argument("--test-limit", type=_count, default=5000, help="test images used (default 5000)")
    ex.add_argument("--bits", type=_bits, default=4)
    ex.add_argument("--granularity", type=_granularity, default=None, help="default 30 (20 for stragglers)")
    ex.add_argument("--p", type=_p_arg, default=None, help="default 1/32 (1/512 for stragglers)")
    ex.add_argument("--kernel-loss", action="store_true",
                    help="loss: also drop real packets with nftables between namespaces (root)")
    ex.add_argument("--delay-ms", type=_delay_ms, default=30.0, help="stragglers: delay per straggling round")
    ex.add_argument("--codecs", type=_codec_list, default=("none", "thc"),
                    help="bandwidth: comma list of codecs (default none,thc)")
    ex.add_argument("--rates", type=_rate_list, default=(100, 1000, None),
                    help="bandwidth: comma list of link rates in Mbit/s, 0 = unlimited (default 100,1000,0)")
    ex.add_argument("--per-tensor", action="store_true",
                    help="one PS round per parameter tensor (as 3LC and CASQ are meant to run)")
    ex.add_argument("--seed", type=_seed, default=0, help="seed (default 0)")
    ex.set_defaults(func=commands.cmd_experiment)

    p4 = sub.add_parser("p4", help="the P4 switch program: check tools, generate, compile, run under bmv2, "
                                   "run workers through it in Mininet",
                        description="The P4 switch program. Each action is a subcommand with its own "
                                    "options: `thc p4 ACTION --help`.")
    p4_sub = p4.add_subparsers(dest="action", required=True, metavar="ACTION")
    # options several actions share, each added only where it means something
    p4_job = argparse.ArgumentParser(add_help=False)
    p4_job.add_argument("--workers", type=_workers, default=4, help="workers (default 4)")
    p4_job.add_argument("--quorum", type=_quorum, default=1.0)
    p4_job.add_argument("--granularity", type=_granularity, default=30)
    p4_job.add_argument("--p", type=_p_arg, default="1/32")
    p4_out = argparse.ArgumentParser(add_help=False)
    p4_out.add_argument("--out", default="build/p4", help="output directory of compiled programs (default build/p4)")

    p4_doctor = p4_sub.add_parser(
        "doctor", help="find and check the P4 tools",
        description="Find and check the P4 tools (PATH, /opt/p4tools/bin, $THC_P4_TOOLS) and Debian's "
                    "mininet, nft, ethtool, ip; exit 0 when simple_switch, simple_switch_CLI and "
                    "p4c-bm2-ss work.")
    p4_doctor.add_argument("--json", action="store_true", help="one JSON document")

    p4_gen = p4_sub.add_parser(
        "gen", help="write the P4 programs from p4/gen_p4.py",
        description="Write p4/thc.p4 (v1model) and p4/tofino/thc_tna.p4 (Tofino) from p4/gen_p4.py.")
    p4_gen.add_argument("--check", action="store_true", help="only check that the committed programs are current")
    p4_gen.add_argument("--target", choices=("all", "v1model", "tna"), default="all")

    p4_build = p4_sub.add_parser(
        "build", parents=[p4_out], help="compile a P4 program",
        description="Compile p4/thc.p4 with p4c-bm2-ss (bmv2), or p4/tofino/thc_tna.p4 with p4c-barefoot "
                    "(tofino: TNA, tofino2: T2NA).")
    p4_build.add_argument("--target", choices=("bmv2", "tofino", "tofino2"), default="bmv2")

    p4_run = p4_sub.add_parser(
        "run", parents=[p4_job, p4_out], help="run the program under simple_switch and serve the workers",
        description="Start simple_switch on interfaces (or attach to a running one), program the job and "
                    "serve the workers' control plane.")
    p4_run.add_argument("--iface", action="append", default=[], metavar="PORT=IFACE",
                        help="switch port number and interface, repeatable")
    p4_run.add_argument("--worker-port", action="append", default=[], metavar="IP=PORT,MAC",
                        help="where a worker's address attaches (switch port and MAC), repeatable")
    p4_run.add_argument("--ps-ip", default="10.0.0.254", help="the address workers send to")
    p4_run.add_argument("--ps-mac", default="00:00:00:00:00:fe")
    p4_run.add_argument("--control", type=_addr, default=("0.0.0.0", 9001),
                        help="ZeroMQ control plane address (default 0.0.0.0:9001)")
    p4_run.add_argument("--thrift-port", type=_port, default=9090, help="simple_switch Thrift port (default 9090)")
    p4_run.add_argument("--attach", action="store_true",
                        help="program a simple_switch that is already running (e.g. started by Mininet) "
                             "on --thrift-port instead of compiling and starting one")

    p4_mn = p4_sub.add_parser(
        "mininet", parents=[p4_job, p4_out], help="real workers through one bmv2 switch in Mininet (root)",
        description="One bmv2 switch and N hosts running real `thc worker`s in Mininet, every chunk "
                    "checked exactly (root).")
    p4_mn.add_argument("--json", action="store_true", help="one JSON document")
    p4_mn.add_argument("--rounds", type=_rounds, default=20, help="rounds (default 20)")
    p4_mn.add_argument("--dim", type=_dim, default=4096, help="coordinates per round (default 4096)")
    p4_mn.add_argument("--loss", type=_probability, default=0.0,
                       help="packet loss each way on every host link (nftables drops; default 0)")
    p4_mn.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of a straggling round")
    p4_mn.add_argument("--straggler-rank", type=_int_in(0, 31, "a rank"), default=None,
                       help="which worker straggles (default: all)")
    p4_mn.add_argument("--loss-policy", choices=("retransmit", "zero"), default="retransmit")
    p4_mn.add_argument("--timeout-ms", type=_timeout_ms, default=200.0,
                       help="the workers' first retransmission timeout (default 200)")
    p4_mn.add_argument("--control-mode", choices=("static", "p4run"), default="static",
                       help="job preprogrammed with a registration-only control host (static), or "
                            "`thc p4 run --attach` programming it as workers register (p4run)")
    p4.set_defaults(func=commands.cmd_p4)

    b = sub.add_parser("bench", help="benchmarks: `thc bench codecs` compares every codec in one run")
    b.add_argument("what", choices=("codecs",))
    b.add_argument("--workers", type=_workers, default=4)
    b.add_argument("--dims", type=_int_in(4, 26, "log2 of a dimension"), nargs="+", default=[20, 24], help="log2 of d (default 20 24)")
    b.add_argument("--e2e-dims", type=_int_in(4, 26, "log2 of a dimension"), nargs="*", default=[20, 24],
                   help="log2 of d for the end-to-end UDP round time (default 20 24; about 3 of the "
                        "5 minutes on 2 cores are the 2^24 rounds, `--e2e-dims 20` skips them)")
    b.add_argument("--rounds", type=_rounds, default=2)
    b.add_argument("--out", default="docs", help="where codecs-table.md and codecs.png go")
    b.set_defaults(func=commands.cmd_bench)

    d = sub.add_parser("demo-nmse", help="print the NMSE comparison of all codecs (quick look)")
    d.add_argument("--workers", type=_workers, default=4)
    d.add_argument("--dim", type=_dim, default=1 << 18)
    d.add_argument("--trials", type=_rounds, default=3)
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
_quorum = _float_in(0, 1, lo_open=True, hi_open=False, what="a quorum fraction of workers")


def _addr(value: str):
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _addr_list(value: str):
    return [_addr(v.strip()) for v in value.split(",") if v.strip()]


def _job_args(p, workers_default=4, stated=False):
    """The job options.  stated=True (`thc worker`): every default is None, and the options
    given are what the worker insists on (the PS refuses it when its job differs)."""
    if stated:
        p.add_argument("--workers", type=_workers, default=None, help="number of workers n")
        p.add_argument("--codec", choices=commands.job_codecs(), default=None, help="the job's codec")
        p.add_argument("--bits", type=_bits, default=None, help="index bits b")
        p.add_argument("--granularity", type=_granularity, default=None, help="granularity g")
        p.add_argument("--p", type=_p_arg, default=None, help="support fraction p")
        p.add_argument("--lane-bits", type=int, choices=(8, 16, 32), default=None, help="sum lane bits")
        p.add_argument("--quorum", type=_quorum, default=None, help="partial aggregation quorum")
        return
    p.add_argument("--workers", type=_workers, default=workers_default,
                   help="number of workers n" + (" (without it, the PS accepts the job its first worker "
                                                 "proposes)" if workers_default is None else ""))
    p.add_argument("--codec", choices=commands.job_codecs(), default="thc",
                   help="thc (lookup-and-sum in C), none (float32 sums), or a codec the PS "
                        "decodes, sums and re-encodes")
    p.add_argument("--bits", type=_bits, default=4, help="index bits b (default 4)")
    p.add_argument("--granularity", type=_granularity, default=30, help="granularity g (default 30)")
    p.add_argument("--p", type=_p_arg, default="1/32", help="support fraction p (default 1/32)")
    p.add_argument("--lane-bits", type=int, choices=(8, 16, 32), default=8,
                   help="bits per aggregated value; n*g must fit (default 8)")
    p.add_argument("--quorum", type=_quorum, default=1.0,
                   help="fraction of workers after which a slot is multicast (default 1.0)")
    p.add_argument("--slots", type=_int_in(1, 65000, "a slot count"), default=512, help="aggregator slots (default 512)")
    p.add_argument("--seed", type=_seed, default=0, help="job seed (RHT signs, gradients)")


def _add_cluster_commands(sub):
    ps = sub.add_parser("ps", help="run one software PS process (per host)",
                        description="Software PS: UDP data plane (C engine) on ADDR:PORT, ZeroMQ "
                                    "control plane on PORT+1 (or --control-port).")
    ps.add_argument("--bind", type=_addr, default=("127.0.0.1", 9000), help="ADDR:PORT (default 127.0.0.1:9000)")
    ps.add_argument("--control-port", type=_port, default=None, help="control port (default PORT+1)")
    ps.add_argument("--shards", type=_int_in(1, 16, "a shard count"), default=1,
                    help="PS shards in this process splitting the slot space (data ports PORT, PORT+2, ...)")
    ps.add_argument("--engine", choices=("c", "python"), default="c", help="aggregation engine (default c)")
    ps.add_argument("--keys", default=None, metavar="DIR",
                    help="CURVE key directory from `thc keys DIR`: authenticated, encrypted control plane")
    ps.add_argument("--lease-s", type=_float_in(0.2, 3600, lo_open=False, hi_open=False, what="seconds"),
                    default=5.0, help="a rank without a heartbeat for this long is reported missing "
                                      "and may be claimed again (default 5)")
    ps.add_argument("--stats-every", type=_float_in(0, 86400, lo_open=False, hi_open=False, what="seconds"), default=10.0, help="seconds between stats lines (0: off)")
    _job_args(ps, workers_default=None)
    ps.set_defaults(func=commands.cmd_ps)

    w = sub.add_parser("worker", help="run one worker process: R rounds of test gradients through a PS",
                       description="Connects to a running `thc ps`, registers as --rank, runs rounds.")
    w.add_argument("--ps", type=_addr_list, required=True,
                   help="the PS data address HOST:PORT, or a comma list of shards (chunk c -> shard c mod S)")
    w.add_argument("--rank", type=_int_in(0, 31, "a rank"), default=None, help="worker id (default: $RANK from torchrun, else 0)")
    w.add_argument("--rounds", type=_rounds, default=10)
    w.add_argument("--dim", type=_dim, default=1 << 16)
    w.add_argument("--loss", type=_probability, default=0.0, help="injected loss each way")
    w.add_argument("--loss-policy", choices=("retransmit", "zero"), default="retransmit")
    w.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay before each round's data phase")
    w.add_argument("--seed", type=_seed, default=0, help="test-gradient seed (default 0)")
    w.add_argument("--control-host", default=None, help="control plane host if not the PS data host")
    w.add_argument("--control-port", type=_port, default=None, help="control port (default data port + 1)")
    w.add_argument("--bind-port", type=_any_port, default=0, help="local UDP port (default: any)")
    w.add_argument("--timeout-ms", type=_timeout_ms, default=50.0, help="first retransmission timeout")
    w.add_argument("--report", type=_report_path, default=None, help="write every round's report (digests, k, bitmaps) as JSON")
    w.add_argument("--keys", default=None, metavar="DIR",
                   help="key directory with client.key_secret and server.key (`thc keys`)")
    _job_args(w, stated=True)
    w.set_defaults(func=commands.cmd_worker)

    la = sub.add_parser("launch", help="start a PS and N workers here, run rounds, check every one",
                        description="Local cluster with an exactness check of every chunk of every "
                                    "round against an in-process reference.")
    _job_args(la)
    la.add_argument("--rounds", type=_rounds, default=10, help="rounds (default 10)")
    la.add_argument("--dim", type=_dim, default=1 << 16, help="coordinates per round (default 2^16)")
    la.add_argument("--loss", type=_probability, default=0.0, help="injected loss each way (default 0)")
    la.add_argument("--duplicate", type=_probability, default=0.0, help="injected duplicates")
    la.add_argument("--reorder", type=_probability, default=0.0, help="injected reordering")
    la.add_argument("--straggler-delay-ms", type=_delay_ms, default=0.0, help="delay of the straggler per round")
    la.add_argument("--straggler-rank", type=_int_in(0, 31, "a rank"), default=None, help="which worker straggles (default: all)")
    la.add_argument("--loss-policy", choices=("retransmit", "zero"), default="retransmit")
    la.add_argument("--timeout-ms", type=_timeout_ms, default=50.0, help="first retransmission timeout")
    la.add_argument("--engine", choices=("c", "python"), default="c")
    la.add_argument("--ps", type=str, default=None,
                    help="use a running PS at HOST:PORT (or a comma list of shards) instead of starting one")
    la.add_argument("--shards", type=_int_in(1, 16, "a shard count"), default=1, help="PS shards to start (default 1)")
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
    la.add_argument("--kill-rank", type=_int_in(0, 31, "a rank"), default=None,
                    help="fault injection: this rank's process dies at --kill-at-round")
    la.add_argument("--kill-at-round", type=_int_in(0, 1 << 30, "a round"), default=0,
                    help="the round at whose start --kill-rank dies (default 0)")
    la.add_argument("--restart-killed", action="store_true",
                    help="start a killed rank again: it rejoins the running job")
    la.add_argument("--json", action="store_true", help="print one JSON summary line")
    la.add_argument("--verbose", action="store_true", help="per-round progress from every worker")
    la.set_defaults(func=commands.cmd_launch)

    k = sub.add_parser("keys", help="make a CURVE key directory for the control plane",
                       description="Writes DIR/server.key(_secret), DIR/client.key(_secret) and "
                                   "DIR/authorized/client.key.  The PS host needs the directory "
                                   "(thc ps --keys DIR); worker hosts need client.key_secret and "
                                   "server.key (thc worker --keys DIR).")
    k.add_argument("dir", help="directory to create")
    k.set_defaults(func=commands.cmd_keys)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """Exit status: 0 success, 2 bad arguments or a refused configuration (before any
    traffic), 1 a run that failed (a check found a problem, a worker or the PS failed)."""
    import signal
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)      # a service manager's stop = Ctrl-C
    try:
        result = args.func(args)
    except ValueError as exc:
        print(f"thc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"thc {args.command}: error: {exc}", file=sys.stderr)
        return 1
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
