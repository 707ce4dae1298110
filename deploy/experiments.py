"""`thc experiment loss|stragglers|scale|bandwidth`: the paper's §8.3 and Fig. 6 experiments
at a scale this machine runs, each writing a markdown table, its JSON and a PNG to the directory
the caller names (`thc experiment --out`; docs/experiments/ holds the committed runs).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from thc_ps.deploy.peers import METHODS as PEER_DDP_METHODS
from thc_ps.deploy.procs import stop_gracefully
from thc_ps.deploy.train import TrainConfig, run

ROOT = Path(__file__).resolve().parents[1]


def _label(cfg: TrainConfig) -> str:
    parts = [cfg.job.codec]
    if cfg.loss:
        parts.append(f"loss {cfg.loss:g} {cfg.loss_policy}")
    if cfg.job.codec != "none":
        parts.append(f"sync/{cfg.sync_every}" if cfg.sync_every else "no sync")
    if cfg.straggler_count:
        parts.append(f"{cfg.straggler_count} stragglers, quorum {cfg.job.quorum:g}")
    return ", ".join(parts)


def _summary(label: str, doc: dict) -> dict:
    ep = doc["epochs"]
    return {"label": label, "final_test_accuracy": ep[-1]["test_accuracy"],
            "final_train_loss": ep[-1]["train_loss"],
            "mean_round_ms": sum(e["mean_round_ms"] for e in ep) / len(ep),
            "lost_chunks": sum(e["lost_chunks"] for e in ep), "seconds": doc["seconds"],
            "accuracy_by_epoch": [e["test_accuracy"] for e in ep],
            "loss_curve": [p for e in ep for p in e["loss_curve"]],
            "ps": doc.get("ps")}


def _write(name: str, title: str, command: str, notes: str, rows: list, extra_cols=(), *,
           out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}\n", f"Command: `{command}`\n", notes.strip() + "\n",
             "| run | final test acc | final train loss | mean round ms | lost chunks (all ranks) | "
             + "".join(f"{c} | " for c, _ in extra_cols) + "wall s |",
             "|---|---|---|---|---|" + "---|" * len(extra_cols) + "---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['final_test_accuracy']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['mean_round_ms']:.1f} | {r['lost_chunks']} | "
                     + "".join(f"{fn(r)} | " for _, fn in extra_cols) + f"{r['seconds']:.0f} |")
    lines.append("\nTest accuracy by epoch: " + "; ".join(
        f"{r['label']}: " + ", ".join(f"{a:.3f}" for a in r["accuracy_by_epoch"]) for r in rows))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for r in rows:
            style = "--" if r["label"].startswith("none") else "-"
            ax[0].plot(range(1, len(r["accuracy_by_epoch"]) + 1), r["accuracy_by_epoch"], style, marker="o",
                       label=r["label"])
            if r["loss_curve"]:
                xs, ys = zip(*r["loss_curve"])
                ax[1].plot(xs, ys, style, label=r["label"])
        ax[0].set(xlabel="epoch", ylabel="test accuracy", title=title)
        ax[1].set(xlabel="step", ylabel="train loss (rank 0)", yscale="log")
        for a in ax:
            a.grid(alpha=0.3)
        ax[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        lines.append(f"\n![{title}]({name}.png)")
    except ImportError:
        lines.append("\n(matplotlib missing: no plot)")
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return path


def _runs(configs, log) -> list:
    rows = []
    for i, cfg in enumerate(configs):
        label = _label(cfg)
        log(f"[{i + 1}/{len(configs)}] {label}")
        rows.append(_summary(label, run(cfg, log=lambda m: log("    " + m))))
    return rows


def loss(base: TrainConfig, command: str, log=print, kernel: bool = False, *, out: Path) -> Path:
    """Paper §8.3 / Fig. 9: loss both ways, with and without per-epoch model sync."""
    cfgs = [base.with_job(codec="none"), replace(base, sync_every=1)]
    for rate in (0.001, 0.01):
        for sync in (0, 1):
            cfgs.append(replace(base, loss=rate, loss_policy="zero", sync_every=sync))
    cfgs.append(replace(base, loss=0.01, loss_policy="retransmit", sync_every=0))
    rows = _runs(cfgs, log)
    if kernel:
        rows += _kernel_loss_rows(base, log)
    notes = f"""
{base.job.num_workers} workers, {base.model} on Fashion-MNIST ({base.train_limit or 60000} training images),
{base.epochs} epochs, THC b={base.job.bits} g={base.job.granularity} p={base.job.p}. Loss is injected in the
transport (seeded) in both directions; under `zero` a chunk whose result misses its timeout is a
zero update (paper §6.1), under `retransmit` it is resent. Model sync: rank 0's parameters are
copied to every rank at each epoch's end. The paper (§8.3) used ResNet50/CIFAR100 with 10 workers
for many epochs; here the runs are minutes long. Kernel rows (if present) drop real packets with an nftables `numgen random`
rule in a network namespace holding the workers, the PS in another namespace.
How these results compare with the paper's Fig. 9 is discussed in docs/experiments/README.md.
"""
    return _write("loss", "Packet loss and model synchronization", command, notes, rows, out=out)


def _kernel_loss_rows(base: TrainConfig, log) -> list:
    from thc_ps.deploy import netns
    rows = []
    for policy, sync in (("zero", 0), ("zero", 1), ("retransmit", 0)):
        cfg = replace(base, loss=0.0, loss_policy=policy, sync_every=sync)
        label = f"thc, kernel loss 0.01 {policy}, " + (f"sync/{sync}" if sync else "no sync")
        log(f"[kernel] {label}")
        with netns.two_hosts(loss=0.01) as net:
            # nftables sees a UDP GSO message as one packet: send single datagrams here
            doc = run_in_namespaces(net, cfg, log, env_extra={"THC_UDP_OFFLOAD": "0"})
            drops = net.nft_drops()
        row = _summary(label, doc)
        row["label"] += f" ({drops} packets dropped by nft)"
        rows.append(row)
    return rows


def ps_in_namespace(net, job, port: int, env: dict, host: int | None = None, wait: bool = True) -> subprocess.Popen:
    """`thc ps` for `job` in net.ps_ns on net.ps_ip:port (two_hosts), or on a star's host
    `host` (stdout piped), given 2 s to bind (`wait`; else the caller waits once for several)."""
    prefix, ip = (net.prefix(net.ps_ns), net.ps_ip) if host is None else (net.prefix(host), net.ips[host])
    cmd = prefix + [sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind", f"{ip}:{port}",
                                   "--workers", str(job.num_workers), "--codec", job.codec,
                                   "--bits", str(job.bits), "--granularity", str(job.granularity),
                                   "--p", job.p, "--lane-bits", str(job.lane_bits),
                                   "--quorum", str(job.quorum), "--rotation", job.rotation,
                                   "--block-log2", str(job.block_log2),
                                   "--tail-log2", str(job.tail_log2), "--stats-every", "0"]
    if job.result_group:
        cmd += ["--result-group", job.result_group]
    ps = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    if wait:
        time.sleep(2.0)
    return ps


def run_in_namespaces(net, cfg: TrainConfig, log, port: int = 9000, env_extra: dict | None = None) -> dict:
    """A PS in net.ps_ns and `thc train --ps` in net.worker_ns; returns the train JSON."""
    py, job = sys.executable, cfg.job
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    ps = ps_in_namespace(net, job, port, env)
    try:
        args = ["--workers", str(job.num_workers), "--epochs", str(cfg.epochs), "--model", cfg.model,
                "--batch", str(cfg.batch), "--lr", str(cfg.lr), "--loss-policy", cfg.loss_policy,
                "--sync-every", str(cfg.sync_every), "--seed", str(job.seed),
                "--train-limit", str(cfg.train_limit), "--test-limit", str(cfg.test_limit),
                "--codec", job.codec, "--ps", f"{net.ps_ip}:{port}", "--json"]
        if cfg.per_tensor:
            args.append("--per-tensor")
        tr = subprocess.run(net.prefix(net.worker_ns) + [py, "-m", "thc_ps.deploy.cli", "train"] + args,
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
        for line in tr.stderr.splitlines():
            if "epoch" in line:
                log("    " + line)
        if tr.returncode != 0:
            raise RuntimeError(f"training in {net.worker_ns} failed: {tr.stderr[-2000:]}")
        doc = json.loads(tr.stdout.strip().splitlines()[-1])
    finally:
        stop_gracefully(ps)
    return {"epochs": doc["epochs"], "seconds": doc["seconds"], "ps": None}


def stragglers(base: TrainConfig, command: str, log=print, delay_ms: float = 30.0, *, out: Path) -> Path:
    """Paper §8.3 / Fig. 9: k random stragglers per round, aggregate at quorum (n−k)/n."""
    n = base.job.num_workers
    cfgs = [base.with_job(codec="none"), replace(base)]
    for k in (1, 2, 3):
        cfgs.append(replace(base.with_job(quorum=(n - k) / n), straggler_count=k, straggler_delay_ms=delay_ms))
    cfgs.append(replace(base.with_job(quorum=1.0), straggler_count=1, straggler_delay_ms=delay_ms))
    rows = _runs(cfgs, log)
    rows[-1]["label"] += " (wait for all)"
    notes = f"""
{n} workers, {base.model} on Fashion-MNIST ({base.train_limit or 60000} training images), {base.epochs} epochs.
Every round the same k ranks (drawn from (seed, round)) delay their DATA phase by {delay_ms:g} ms; the PS
multicasts each slot once ⌈q·n⌉ workers contributed and the stragglers' late packets are counted
and dropped (their result comes back with the contributor count k, which every worker divides by).
The last row waits for everybody and pays the delay in round time instead. Comparison with the
paper's Fig. 9: docs/experiments/README.md.
"""
    return _write("stragglers", "Stragglers and partial aggregation", command, notes, rows,
                  extra_cols=(("partial rounds", lambda r: (r["ps"] or {}).get("partial_rounds", "-")),), out=out)


def paper_rule(n: int) -> tuple[int, int]:
    """(b, g) per worker count: the paper's 38/16/8 with 4/4/3 bits for 4/10/30 workers,
    otherwise the largest g that keeps n·g within an 8-bit lane (b = 4 while g ≥ 15)."""
    table = {4: (4, 38), 10: (4, 16), 30: (3, 8)}
    if n in table:
        return table[n]
    g = 255 // n
    return (4, g) if g >= 15 else (3, max(g, 7))


def scale(base: TrainConfig, command: str, log=print, sizes=(4, 10, 16), *, out: Path) -> Path:
    """Paper Fig. 8: more workers with the per-count (b, g) rule, against uncompressed."""
    cfgs = []
    for n in sizes:
        b, g = paper_rule(n)
        cfgs += [base.with_job(num_workers=n, codec="none"),
                 base.with_job(num_workers=n, bits=b, granularity=g, p="1/64")]
    rows = _runs(cfgs, log)
    for r, cfg in zip(rows, cfgs):
        job = cfg.job
        r["label"] = f"n={job.num_workers} " + (f"thc b={job.bits} g={job.granularity}" if job.codec == "thc" else "none")
    notes = f"""
{base.model} on Fashion-MNIST ({base.train_limit or 60000} training images split over the workers), {base.epochs}
epochs, per-worker batch {base.batch} (so the global batch grows with n), p = 1/64. (b, g) per worker
count follows the paper (38/16 for 4/10 workers with 4 bits; for other counts the largest g with
n·g ≤ 255). The paper trains ResNet50/CIFAR100 for thousands of steps with 4/10/30 workers; here 16
worker processes share two cores, so the runs are short.
"""
    return _write("scale", "Scaling the number of workers", command, notes, rows, out=out)


def bandwidth(base: TrainConfig, command: str, log=print, rates=(100, 1000, None), target: float = 0.8, *,
              out: Path,
              codecs=("none", "thc")) -> Path:
    """Paper Fig. 6: rate-limited links between the PS and worker namespaces, every codec in
    `codecs` at every rate (None = no limit); speed-ups are against `none` at the same rate."""
    from thc_ps.deploy import netns
    rows = []
    for rate in rates:
        for codec in codecs:
            cfg = base.with_job(codec=codec)
            label = f"{codec} @ {'unlimited' if rate is None else f'{rate} Mbit/s'}"
            log(f"[bandwidth {len(rows) + 1}/{len(rates) * len(codecs)}] {label}")
            with netns.two_hosts(rate_mbit=rate) as net:
                doc = run_in_namespaces(net, cfg, log)
            row = _summary(label, doc)
            row.update(codec=codec, rate=rate)
            elapsed, row["time_to_target"] = 0.0, None
            for e in doc["epochs"]:
                elapsed += e["epoch_seconds"]
                if row["time_to_target"] is None and e["test_accuracy"] >= target:
                    row["time_to_target"] = elapsed
            rows.append(row)
    for r in rows:
        ref = next((x for x in rows if x["codec"] == "none" and x["rate"] == r["rate"]), None)
        if ref is not None and r is not ref:
            r["speedup"] = ref["mean_round_ms"] / r["mean_round_ms"]
    per = " Gradients go per parameter tensor (`--per-tensor`)." if base.per_tensor else \
        " Each step sends the whole model as one bucket, for every codec."
    notes = f"""
PS and {base.job.num_workers} workers in two network namespaces joined by a veth pair with a token-bucket
rate limit on both ends (`tc qdisc ... tbf`), {base.model} on Fashion-MNIST
({base.train_limit or 60000} images), {base.epochs} epochs.{per} "time to {target:.0%}" is the
training time (sum of epoch times) until rank 0's test accuracy first reaches {target:.0%}; "-"
means it never did. Speed-ups compare mean round times with `none` at the same rate. The
paper's Fig. 6 runs VGG16 at 25/40/100 Gbit/s; here the links are slower and the model is
small. Discussion: docs/experiments/README.md.
"""
    path = _write("bandwidth", "Bandwidth-limited links", command, notes, rows, extra_cols=(
        ("round speed-up vs none", lambda r: f"{r['speedup']:.2f}x" if "speedup" in r else "-"),
        (f"time to {target:.0%} (s)", lambda r: f"{r['time_to_target']:.0f}" if r.get("time_to_target") else "-")),
        out=out)
    if len(codecs) > 2:
        _bandwidth_bars(rows, rates, codecs, path)
    return path


def _bandwidth_bars(rows: list, rates, codecs, md_path: Path) -> None:
    """Grouped bars: mean round time per codec at each rate (log scale), appended to the doc."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(codecs)
    for k, codec in enumerate(codecs):
        ys = [next(r["mean_round_ms"] for r in rows if r["codec"] == codec and r["rate"] == rate)
              for rate in rates]
        ax.bar([i + k * width for i in range(len(rates))], ys, width, label=codec)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rates))],
                  ["unlimited" if r is None else f"{r} Mbit/s" for r in rates])
    ax.set(ylabel="mean round ms (log)", yscale="log", title="Round time per codec and link rate")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(md_path.with_name("bandwidth-rounds.png"), dpi=100)
    with md_path.open("a") as f:
        f.write("\n![Round time per codec and link rate](bandwidth-rounds.png)\n")


def main_command(argv) -> str:
    return "thc experiment " + " ".join(shlex.quote(a) for a in argv)


CODEC_ORDER = ("none", "thc", "topk", "terngrad", "3lc", "skcompress", "fastsgd", "casq")


def codecs(base: TrainConfig, command: str, log=print, sparse_steps: int = 60, *, out: Path) -> Path:
    """Every codec on the sparse (SKCompress/FastSGD) and the dense workload, fixed budgets."""
    from thc_ps.deploy import sparse_lr
    sparse_rows, dense_rows = [], []
    for name in CODEC_ORDER:
        log(f"[sparse LR] {name}")
        sparse_rows.append(sparse_lr.run(sparse_lr.SparseLRConfig(codec=name, workers=base.job.num_workers,
                                                                  steps=sparse_steps, seed=base.job.seed)))
    for name in CODEC_ORDER:
        log(f"[dense {base.model}] {name}")
        doc = run(base.with_job(codec=name), log=lambda m: log("    " + m))
        dense_rows.append({"codec": name, **_summary(name, doc),
                           "bytes_up": doc["bytes_up"], "bytes_down": doc["bytes_down"]})
    out.mkdir(parents=True, exist_ok=True)
    base_up = next(r["bytes_up"] for r in sparse_rows if r["codec"] == "none")
    lines = ["# Codecs on the papers' workloads\n", f"Command: `{command}`\n",
             "## Sparse logistic regression (SKCompress/FastSGD workload)\n",
             f"Generated KDD-like data: {sparse_rows[0]['features']:,} features with Zipf({sparse_rows[0]['zipf']}) "
             f"frequencies, {sparse_rows[0]['active']} active features per sample, {sparse_rows[0]['samples']:,} "
             f"samples (80/20 split); {base.job.num_workers} workers × batch {sparse_rows[0]['batch']}, Adam, "
             f"{sparse_steps} steps. Bytes are rank 0's, all steps.\n",
             "| codec | test loss | test acc | bytes up | bytes down | up ratio vs float32 | round ms |",
             "|---|---|---|---|---|---|---|"]
    for r in sparse_rows:
        lines.append(f"| {r['codec']} | {r['test_loss']:.4f} | {r['test_accuracy']:.4f} | {r['bytes_up']:,} | "
                     f"{r['bytes_down']:,} | {base_up / max(r['bytes_up'], 1):.1f} | {r['mean_round_ms']:.0f} |")
    lines += ["", f"## Dense: {base.model} on Fashion-MNIST ({base.train_limit or 60000} images, {base.epochs} "
              f"epoch(s), {base.job.num_workers} workers)\n",
              "| codec | final test acc | final train loss | MB up | MB down | round ms |", "|---|---|---|---|---|---|"]
    for r in dense_rows:
        lines.append(f"| {r['codec']} | {r['final_test_accuracy']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['bytes_up'] / 1e6:.1f} | {r['bytes_down'] / 1e6:.1f} | {r['mean_round_ms']:.1f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for r in sparse_rows:
            ax[0].scatter(r["bytes_up"], r["test_loss"])
            ax[0].annotate(r["codec"], (r["bytes_up"], r["test_loss"]))
        ax[0].set(xscale="log", xlabel="bytes up (rank 0)", ylabel="test loss", title="sparse LR")
        for r in dense_rows:
            ax[1].scatter(r["bytes_up"], r["final_test_accuracy"])
            ax[1].annotate(r["codec"], (r["bytes_up"], r["final_test_accuracy"]))
        ax[1].set(xscale="log", xlabel="bytes up per worker", ylabel="test accuracy", title=f"dense {base.model}")
        fig.tight_layout()
        fig.savefig(out / "codecs.png", dpi=100)
        lines.append("\n![codecs on both workloads](codecs.png)")
    except ImportError:
        pass
    path = out / "codecs.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "codecs.json").write_text(json.dumps({"sparse": sparse_rows, "dense": dense_rows}, indent=1,
                                                default=str))
    return path


def _link(rate: float) -> str:
    return "loopback" if not rate else (f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")


#: Where THC-PS's aggregation runs in a capped star (`thc experiment peers --layouts`).
LAYOUTS = {
    "ps-host": "one PS on a host of its own, each result sent to each worker",
    "ps-group": "one PS on a host of its own, each result sent once to a multicast group that the "
                "bridge delivers to every worker host",
    "colocated": "a PS shard on every worker host (BytePS's colocated servers), each worker's chunks "
                 "spread over all shards",
    "colocated-group": "a shard on every worker host, each sending its results once to the multicast group",
}
#: The layouts `thc experiment peers` runs unless told (the committed run's).
DEFAULT_LAYOUTS = ("ps-host", "ps-group", "colocated")
#: The result group of the "ps-group" layout (administratively scoped, inside our namespaces).
PEER_GROUP = "239.255.79.1:47079"
PS_PORT, GLOO_PORT = 9000, 29500
#: THC-PS's methods in the peers experiment: rounds after backward, or in DDP's hook.
PS_METHODS = {"thc-ps": "after-backward", "thc-ps-hook": "hook"}
#: Every method of the peers experiment, DDP's (deploy/peers.py) then THC-PS's, in table order.
PEER_METHODS = (*PEER_DDP_METHODS, *PS_METHODS)


def _params(model: str) -> int:
    from thc_ps.worker.training import MODELS
    return sum(p.numel() for p in MODELS[model]().parameters())


def _ps_cfg(base: TrainConfig, m: str, layout: str, net) -> tuple[TrainConfig, list]:
    """THC-PS's training config for method `m` in `layout`, and the PS hosts it needs (star
    host indices; none on loopback, where `run` starts its own PS).  No model sync: under the
    retransmit policy every rank decodes the same sums, so replicas stay identical without it
    (each run checks that), and DDP's runs have none either."""
    cfg = replace(base.with_job(codec="thc", result_group=PEER_GROUP if layout.endswith("group") else ""),
                  grad_sync=PS_METHODS[m], sync_every=0)
    if net is None:
        return replace(cfg, job=replace(cfg.job, result_group="")), []
    n = base.job.num_workers
    hosts = list(range(n)) if layout.startswith("colocated") else [n]
    return replace(cfg, ps=",".join(f"{net.ips[h]}:{PS_PORT}" for h in hosts), rank_netns=tuple(net.hosts[:n]),
                   rendezvous=f"{net.ips[0]}:{GLOO_PORT}"), hosts


def _peer_row(base: TrainConfig, m: str, log, target: float, net=None, layout: str = "ps-host") -> dict:
    """One method's training (under `net`, a netns.Star with a host per rank and one for the
    PS, or on loopback) as a peers row, with the bytes each host's link carried per step."""
    from thc_ps.deploy import netns
    from thc_ps.deploy import peers as P
    links0 = netns.link_bytes(net) if net is not None else None
    if m in PS_METHODS:
        cfg, ps_hosts = _ps_cfg(base, m, layout, net)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        servers = [ps_in_namespace(net, cfg.job, PS_PORT, env, host=h, wait=False) for h in ps_hosts]
        try:
            if servers:
                time.sleep(2.0)
            doc = run(cfg, log=lambda s: log("    " + s))
        finally:
            for ps in servers:
                stop_gracefully(ps, timeout=10)
        ep = [{"epoch": e["epoch"], "test_accuracy": e["test_accuracy"], "steps": e["steps"],
               "step_ms": 1e3 * e["train_epoch_seconds"] / max(e["steps"], 1),
               "train_seconds": e["train_seconds"], "accuracy_curve": e["accuracy_curve"],
               "up_per_step": e["bytes_up"] / max(e["steps"], 1),
               "down_per_step": e["bytes_down"] / max(e["steps"], 1),
               "round_ms": e["mean_round_ms"], "phase_ms": e["mean_phase_ms"]} for e in doc["epochs"]]
        identical = doc["final_params_identical"]
    else:
        layout = "ring"
        doc = P.run_peer(m, base, log=lambda s: log("    " + s), net=net)
        ep = [{**e, "up_per_step": e["wire_per_step"], "down_per_step": e["wire_per_step"]}
              for e in doc["epochs"]]
        identical = doc["replicas_identical"]
    steps = sum(e["steps"] for e in ep)
    walls = [e["train_seconds"] for e in ep]
    curve = ep[-1]["accuracy_curve"]          # (training seconds, step, test accuracy), evaluations left out
    hit = next((sec for sec, _, acc in curve if acc >= target), None)
    row = {"method": m, "layout": layout if net is not None or m not in PS_METHODS else "loopback",
           "params": _params(base.model), "final_test_accuracy": ep[-1]["test_accuracy"],
           # the last epoch's: PowerSGD's first epoch is its uncompressed warm-up
           "up_per_step": float(ep[-1]["up_per_step"]), "down_per_step": float(ep[-1]["down_per_step"]),
           "up_by_epoch": [e["up_per_step"] for e in ep],
           "step_ms": float(np.mean([e["step_ms"] for e in ep])), "time_to_target": hit,
           "accuracy_by_epoch": [e["test_accuracy"] for e in ep], "wall_by_epoch": walls,
           "accuracy_curve": [[round(sec, 3), st, acc] for sec, st, acc in curve],
           "steps_to_target": next((st for _, st, acc in curve if acc >= target), None),
           "replicas_identical": bool(identical)}
    if net is not None:
        links = [((t1 - t0) / steps, (r1 - r0) / steps)
                 for (t0, r0), (t1, r1) in zip(links0, netns.link_bytes(net))]
        row["link_bytes_per_step"] = [[round(t), round(r)] for t, r in links]     # [sent, received] per host
        row["max_link_bytes_per_step"] = round(max(max(t, r) for t, r in links))
        if net.rate_mbit:
            # the least time a step's bytes need on the busiest link at the cap
            row["wire_ms"] = row["max_link_bytes_per_step"] * 8 / (net.rate_mbit * 1e3)
    if m in PS_METHODS:
        # time in the step's rounds (codec, phases, waiting; with the hook, overlapping backward),
        # and of it in the transport's phases (the wire and waiting for the other ranks)
        row["round_ms"] = float(np.mean([e["round_ms"] for e in ep]))
        row["phase_ms"] = float(np.mean([e["phase_ms"] for e in ep]))
    return row


def _ring_bytes(params: int, n: int) -> float:
    """What a ring all-reduce of fp32 gradients puts on each rank's link each way: 2(n−1)/n · 4d."""
    return 2 * (n - 1) / n * 4 * params


def _peer_runs(methods, layouts, rate) -> list:
    """(method, layout) pairs of one rate: THC-PS's methods once per layout under a cap (the
    layouts differ only in where bytes cross links), once on loopback."""
    return [(m, lay) for m in methods for lay in ((layouts if rate else ("ps-host",)) if m in PS_METHODS
                                                    else ("ring",))]


def peers(base: TrainConfig, command: str, log=print, target: float = 0.8, *, out: Path,
          methods=PEER_METHODS, rates=(0,), layouts=DEFAULT_LAYOUTS) -> Path:
    """"Why not DDP's own hooks?": the same training (model, seed, shards, optimizer) under DDP
    with a plain fp32 all-reduce, fp16_compress_hook, PowerSGD rank 1 and 4, the THC hook, and
    THC-PS (rounds after backward, `thc-ps`, or overlapped in DDP's hook, `thc-ps-hook`; in each
    of `layouts` under a cap), under each link rate in `rates` (Mbit/s; 0: loopback, else a host
    namespace per rank and one for the PS on a bridge, every link limited to the rate both
    ways: netns.star); final accuracy, bytes per step each way per worker and on each host's
    link, step time and time to `target` accuracy.  Writes peers.md, peers.json and peers.png."""
    from thc_ps.deploy import netns
    unknown = [lay for lay in layouts if lay not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    rows = []
    runs = [(rate, m, lay) for rate in rates for m, lay in _peer_runs(methods, layouts, rate)]
    for rate in rates:
        with (netns.star(base.job.num_workers + 1, rate_mbit=rate) if rate else contextlib.nullcontext()) as net:
            for m, lay in _peer_runs(methods, layouts, rate):
                k = runs.index((rate, m, lay)) + 1
                log(f"[peers {k}/{len(runs)}] {m}{'' if lay in ('ring', 'ps-host') and not rate else f' ({lay})'}, "
                    f"{_link(rate)}")
                row = {**_peer_row(base, m, log, target, net, layout=lay), "rate_mbit": rate}
                rows.append(row)
                if "max_link_bytes_per_step" in row:
                    log(f"    busiest host link: {row['max_link_bytes_per_step'] / 1e6:.2f} MB per step "
                        f"(the fp32 ring: {_ring_bytes(row['params'], base.job.num_workers) / 1e6:.2f} MB)")
    out.mkdir(parents=True, exist_ok=True)
    n = base.job.num_workers
    params = rows[0]["params"] if rows else _params(base.model)
    capped = [r for r in rates if r]
    where = ("on loopback" if not capped else
             f"under {', '.join(_link(r) for r in rates)} links: at a capped rate every rank, and a PS host, "
             f"is a network namespace of its own on one bridge, its link limited to the rate both ways "
             f"(a token bucket at each end), so DDP's ring and THC-PS cross links of the same rate")
    lines = ["# DDP's own hooks beside THC\n", f"Command: `{command}`\n",
             f"{n} ranks {where}; {base.model} ({params:,} parameters) on Fashion-MNIST "
             f"({base.train_limit or 60000} images), {base.epochs} epochs, seed {base.job.seed}, the same "
             f"shards and optimizer for every method. \"up/down bytes/step\" are per worker per step in the last "
             f"epoch (PowerSGD runs its first epoch uncompressed, as its warm-up): for DDP what a ring "
             f"all-reduce puts on a rank's link (2(n−1)/n × the payload each hook hands to all_reduce), for "
             f"THC-PS the datagrams to and from the PS. \"busiest link/step\" is measured: the most bytes "
             f"one host's link carried in one direction per step (the kernel's interface counters, headers "
             f"and control traffic included); the fp32 ring's 2(n−1)/n · 4d is "
             f"{_ring_bytes(params, n) / 1e6:.2f} MB. \"time to {target:.0%}\" is the training time "
             f"(wall time of the steps, model syncs included, evaluations left out) until rank 0's test accuracy, "
             f"measured every {base.eval_every or 'epoch'}{' steps' if base.eval_every else ''} and at each "
             f"epoch's end, first reaches it (\"-\": never); \"step ms\" is that training time per step.\n",
             "THC-PS layouts: " + "; ".join(f"`{k}`: {v}" for k, v in LAYOUTS.items() if k in layouts)
             + ". `thc-ps` runs its rounds after backward, `thc-ps-hook` in DDP's communication hook "
               "(each bucket while backward goes on)"
             + (". THC-PS's job has one rotation (`--rotation job`: the same RHT signs every round, error "
                "feedback kept rotated, two transforms a worker step instead of three; docs/design.md).\n"
                if base.job.rotation == "job" else ".\n"),
             "\"wire ms\" is the least time the busiest link needs for a step's bytes at the cap; \"in rounds "
             "ms\" THC-PS's time per step inside its rounds (codec, phases and waiting for the other ranks; "
             "with the hook, overlapping backward), \"in phases ms\" the part of it in the transport's phases "
             "(the wire and waiting for the other ranks): a step is the model's compute (step − in rounds), "
             "the codec and its Python (in rounds − in phases), the wire and the waiting (in phases − wire).\n",
             "| link | method | layout | final test acc | up bytes/step | down bytes/step | busiest link/step | "
             f"wire ms | step ms | in rounds ms | in phases ms | time to {target:.0%} (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttt = f"{r['time_to_target']:.1f}" if r["time_to_target"] is not None else "-"
        busiest = f"{r['max_link_bytes_per_step']:,}" if "max_link_bytes_per_step" in r else "-"
        wire = f"{r['wire_ms']:.1f}" if "wire_ms" in r else "-"
        rounds = f"{r['round_ms']:.1f}" if "round_ms" in r else "-"
        phases = f"{r['phase_ms']:.1f}" if "phase_ms" in r else "-"
        lines.append(f"| {_link(r['rate_mbit'])} | {r['method']} | {r['layout']} | {r['final_test_accuracy']:.4f} | "
                     f"{r['up_per_step']:,.0f} | {r['down_per_step']:,.0f} | {busiest} | {wire} | "
                     f"{r['step_ms']:.1f} | {rounds} | {phases} | {ttt} |")
    lines += _speedups(rows, target)
    lines.append(plot_peers(rows, rates, target, out / "peers.png"))
    path = out / "peers.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "peers.json").write_text(json.dumps(rows, indent=1))
    return path


def plot_peers(rows: list, rates, target: float, png: Path) -> str:
    """Accuracy against training time, a panel per rate, from peers rows (peers.json); returns
    the markdown line that shows it.  THC-PS through the hook is dashed; a colour per method
    and layout (tab20: more than ten lines stay apart)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n(matplotlib missing: no plot)"
    labels = list(dict.fromkeys(r["method"] + ("" if r["layout"] in ("ring", "loopback") else f" ({r['layout']})")
                                for r in rows))
    colours = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(rates), figsize=(7 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for r in (r for r in rows if r["rate_mbit"] == rate):
            label = r["method"] + ("" if r["layout"] in ("ring", "loopback") else f" ({r['layout']})")
            pts = r["accuracy_curve"]
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", label=label,
                    color=colours[labels.index(label) % len(colours)],
                    ls="--" if r["method"] == "thc-ps-hook" else "-")
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="training time (s), evaluations left out", ylabel="test accuracy", title=_link(rate))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Accuracy against training time")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return f"\n![Accuracy against training time]({png.name})"


def _speedups(rows: list, target: float) -> list:
    """Per rate: each THC-PS run's time to target against DDP fp32's, fp16's and the THC hook's."""
    lines = []
    for rate in sorted({r["rate_mbit"] for r in rows}, key=lambda v: v or 0):
        here = [r for r in rows if r["rate_mbit"] == rate]
        ref = {r["method"]: r["time_to_target"] for r in here if r["method"] not in PS_METHODS}
        for r in (r for r in here if r["method"] in PS_METHODS):
            t = r["time_to_target"]
            vs = [f"{ref[m] / t:.2f}x vs {m}" if t and ref.get(m) else f"- vs {m}"
                  for m in ("ddp-fp32", "ddp-fp16", "thc-hook") if m in ref]
            if vs:
                if not lines:
                    lines = ["", f"Time to {target:.0%} of THC-PS against DDP's methods (greater is sooner):", ""]
                lines.append(f"- {_link(rate)}, {r['method']} ({r['layout']}): " + ", ".join(vs))
    return lines
