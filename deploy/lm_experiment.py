"""`thc experiment lm`: the library example's model under link caps.

The character-level transformer language model of examples/char_lm.py (its model, text and
batches, imported from the file a user copies) trained by N ranks, each a host namespace of
its own behind a link of the given rate (deploy/netns.py star), with DDP's fp32 all-reduce,
PyTorch's fp16_compress_hook, the THC DDP hook (worker/ddp_hook.py) and THC-PS through the
library API (`thc_ps.connect`, a PS shard on every rank's host by default: the colocated
layout of the peers experiment).  Every method starts from the same seed and draws the same
batches.  The measure is the training time (evaluations left out) until rank 0's validation
loss first reaches a target, as the peers experiment's is for accuracy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from thc_ps.deploy.procs import die_with_parent, each_report, stop_gracefully
from thc_ps.deploy.peers import spawned_ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "char_lm.py"
#: The methods, DDP's then THC-PS's, in table order.
METHODS = ("ddp-fp32", "ddp-fp16", "thc-hook", "thc-ps")
#: Where THC-PS's shards run: one on every rank's host, or one PS on a host of its own.
LAYOUTS = ("colocated", "ps-host")
PS_PORT = 9000


@dataclass(frozen=True)
class LMConfig:
    """One run's training: the example's model and optimizer, its defaults unless given."""

    ranks: int = 4
    steps: int = 300
    batch: int = 16
    context: int = 64
    dim: int = 128
    layers: int = 4
    lr: float = 2e-3
    seed: int = 0
    text_mb: float = 4.0
    eval_every: int = 25
    rotation: str | None = None     # THC-PS's job rotation (None: the library's default)
    warmup_steps: int | None = None  # THC-PS's float16 warm-up steps (None: the library's default)
    layout: str = "colocated"       # where THC-PS's shards run (LAYOUTS)


def example():
    """examples/char_lm.py as a module (it is a script a user copies, not a package)."""
    spec = importlib.util.spec_from_file_location("thc_char_lm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_main(method: str, cfg: LMConfig, rank: int, port: int, q, net, ps: str) -> None:
    die_with_parent()
    import hashlib

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from thc_ps.deploy.peers import AllReduceCounter, join_group, make_hook
    join_group(rank, cfg.ranks, port, net)
    state = None
    try:
        ex = example()
        torch.manual_seed(cfg.seed)
        data = ex.text_bytes(cfg.text_mb)
        train, val = data[:len(data) * 9 // 10], data[len(data) * 9 // 10:]
        model = ex.CharLM(cfg.context, cfg.dim, cfg.layers, heads=4)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        counter = AllReduceCounter()
        if method == "thc-ps":
            import thc_ps
            state = thc_ps.connect(ddp, ps=ps, **({"rotation": cfg.rotation} if cfg.rotation else {}),
                                   **({} if cfg.warmup_steps is None else {"warmup_steps": cfg.warmup_steps}))
        else:
            hook_state, hook = make_hook(method, cfg.ranks, rank, cfg.seed, 0)
            ddp.register_comm_hook(hook_state, hook)
            counter.install()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        vx, vy = ex.batch(val, 64, cfg.context, seed=12345)

        def val_loss() -> float:
            model.eval()
            with torch.no_grad():
                loss = F.cross_entropy(model(vx).reshape(-1, 256), vy.reshape(-1)).item()
            model.train()
            return loss
        curve, train_s, losses = [], 0.0, []
        since = time.perf_counter()
        for step in range(cfg.steps):
            x, y = ex.batch(train, cfg.batch, cfg.context, seed=cfg.seed * 1_000_003 + rank * 7919 + step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                train_s += time.perf_counter() - since           # the clock stops while evaluating
                curve.append((round(train_s, 3), step + 1, val_loss()))
                since = time.perf_counter()
        if state is not None:
            up, down = state.totals["bytes_up"] / cfg.steps, state.totals["bytes_down"] / cfg.steps
            round_ms = 1e3 * state.totals["seconds"] / cfg.steps
        else:
            up = down = counter.payload / cfg.steps * 2 * (cfg.ranks - 1) / cfg.ranks
            round_ms = None
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        q.put(("done", rank, {"curve": curve, "train_seconds": train_s, "step_ms": 1e3 * train_s / cfg.steps,
                              "up_per_step": up, "down_per_step": down, "round_ms": round_ms,
                              "train_loss": float(np.mean(losses[-50:])), "digest": digest,
                              "params": sum(p.numel() for p in model.parameters())}))
    except Exception as exc:           # reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if state is not None:
            state.close()
        dist.destroy_process_group()


def run_method(method: str, cfg: LMConfig, net=None, ps: str = "", timeout_s: float = 3600) -> dict:
    """Train with `method` (rank i in net.hosts[i], or on loopback); rank 0's report, and
    whether every rank ended with the same parameters."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    done = {}
    with spawned_ranks(_rank_main, cfg.ranks, lambda r, port, q: (method, cfg, r, port, q, net, ps)) as (procs, q):
        for kind, rank, body in each_report(q, procs, timeout_s, what=f"{method} rank"):
            if kind == "error":
                raise RuntimeError(f"{method}: rank {rank} failed: {body}")
            done[rank] = body
    return {**done[0], "replicas_identical": len({d["digest"] for d in done.values()}) == 1}


def thc_job(cfg: LMConfig):
    """THC-PS's job: the one the ranks' connect() would propose to a PS without a fixed job
    (the library's defaults, the rotation if given)."""
    from thc_ps.torch import ERROR_FEEDBACK, job_proposal
    return job_proposal(cfg.ranks, {"rotation": cfg.rotation} if cfg.rotation else {}, ERROR_FEEDBACK)


def _ps_shards(net, cfg: LMConfig) -> tuple[list, str]:
    """THC-PS's shards in the star (started, not yet waited for) and the `ps` text they make."""
    from thc_ps.deploy.experiments import ps_in_namespace
    hosts = list(range(cfg.ranks)) if cfg.layout == "colocated" else [cfg.ranks]
    job = thc_job(cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = [ps_in_namespace(net, job, PS_PORT, env, host=h, wait=False) for h in hosts]
    return servers, ",".join(f"{net.ips[h]}:{PS_PORT}" for h in hosts)


def lm(cfg: LMConfig, command: str, log=print, *, out: Path, rates=(100, 1000), methods=METHODS,
       target: float = 2.5, layouts=("colocated",)) -> Path:
    """Every method under every capped rate (Mbit/s), THC-PS in each of `layouts`: writes
    lm.md and lm.json to `out` (made first, so a bad path is refused before any run)."""
    from dataclasses import replace

    from thc_ps.deploy import netns
    bad = [m for m in methods if m not in METHODS] + [lay for lay in layouts if lay not in LAYOUTS]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a method ({', '.join(METHODS)}) or layout ({', '.join(LAYOUTS)}) "
                         f"of the lm experiment")
    if not all(rates):
        raise ValueError("the lm experiment runs under capped rates only (THC-PS's shards need the star's "
                         "hosts): give rates above 0")
    out.mkdir(parents=True, exist_ok=True)
    runs = [(m, lay) for m in methods for lay in (layouts if m == "thc-ps" else ("ring",))]
    rows, total, k = [], len(rates) * len(runs), 0
    for rate in rates:
        with netns.star(cfg.ranks + 1, rate_mbit=rate) as net:      # the last host: a PS host of its own
            for m, lay in runs:
                k += 1
                log(f"[lm {k}/{total}] {m}{'' if lay == 'ring' else f' ({lay})'}, {_link(rate)}")
                servers, ps = ([], "")
                if m == "thc-ps":
                    servers, ps = _ps_shards(net, replace(cfg, layout=lay))
                    time.sleep(2.0)
                try:
                    doc = run_method(m, cfg, net, ps)
                finally:
                    for s in servers:
                        stop_gracefully(s, timeout=10)
                hit = next((sec for sec, _, loss in doc["curve"] if loss <= target), None)
                row = {"method": m, "model": "char-lm", "params": doc["params"], "rate_mbit": rate,
                       "layout": lay, "time_to_target": hit,
                       "steps_to_target": next((st for _, st, loss in doc["curve"] if loss <= target), None),
                       "final_val_loss": doc["curve"][-1][2], "train_loss": doc["train_loss"],
                       "step_ms": doc["step_ms"], "round_ms": doc["round_ms"], "up_per_step": doc["up_per_step"],
                       "down_per_step": doc["down_per_step"], "curve": doc["curve"],
                       "replicas_identical": doc["replicas_identical"]}
                rows.append(row)
                log(f"    val loss {row['final_val_loss']:.4f}, step {row['step_ms']:.0f} ms, "
                    f"time to {target:g}: {'-' if hit is None else f'{hit:.1f} s'}")
    (out / "lm.json").write_text(json.dumps({"config": asdict(cfg), "target": target, "rows": rows}, indent=1))
    path = out / "lm.md"
    path.write_text(_table(rows, cfg, command, target))
    return path


def _link(rate) -> str:
    return "loopback" if not rate else (f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")


def _table(rows: list, cfg: LMConfig, command: str, target: float) -> str:
    params = rows[0]["params"] if rows else 0
    every = "after every step" if cfg.eval_every == 1 else f"every {cfg.eval_every} steps"
    from thc_ps.torch import ERROR_FEEDBACK, WARMUP_STEPS
    job, warmup = thc_job(cfg), WARMUP_STEPS if cfg.warmup_steps is None else cfg.warmup_steps
    lines = ["# The library example under link caps\n", f"Command: `{command}`\n",
             f"examples/char_lm.py's transformer language model ({params:,} parameters, {cfg.layers} layers of "
             f"width {cfg.dim}, context {cfg.context}) on {cfg.text_mb:g} MB of the Python standard library's "
             f"source, {cfg.ranks} ranks, {cfg.steps} steps of {cfg.batch} sequences a rank, AdamW lr {cfg.lr:g}, "
             f"seed {cfg.seed}: the same batches for every method. Each rank is a network namespace behind a "
             f"link of the rate, both ways; THC-PS runs through `thc_ps.connect` (rotation "
             f"`{cfg.rotation or 'the default'}`) with a PS shard on every rank's host (`colocated`) or one PS on a host "
             f"of its own (`ps-host`). \"time to {target:g}\" is the training time (evaluations left "
             f"out) until rank 0's validation loss, measured {every}, first reaches "
             f"{target:g}, and \"steps to {target:g}\" the step it did so at; \"up/down bytes/step\" are per "
             f"rank: for DDP what a ring all-reduce puts on a rank's link (2(n−1)/n × the payload), for "
             f"THC-PS the datagrams to and from the shards and, in the library's warm-up steps (the first "
             f"{warmup}, float16 over the process group), the ring's bytes. THC-PS's job: b = {job.bits}, "
             f"g = {job.granularity}, p = {job.p}, {'' if ERROR_FEEDBACK else 'no '}error feedback.\n",
             f"| link | method | layout | final val loss | up bytes/step | down bytes/step | step ms | in rounds ms | "
             f"steps to {target:g} | time to {target:g} (s) | replicas identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttt = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        reached = "-" if r.get("steps_to_target") is None else f"{r['steps_to_target']}"
        rounds = "-" if r["round_ms"] is None else f"{r['round_ms']:.1f}"
        lines.append(f"| {_link(r['rate_mbit'])} | {r['method']} | {r['layout']} | {r['final_val_loss']:.4f} | "
                     f"{r['up_per_step']:,.0f} | {r['down_per_step']:,.0f} | {r['step_ms']:.0f} | {rounds} | "
                     f"{reached} | {ttt} | {r['replicas_identical']} |")
    lines.append("")
    for rate in sorted({r["rate_mbit"] for r in rows}):
        at = {r["method"]: r for r in rows if r["rate_mbit"] == rate and r["method"] != "thc-ps"}
        ps = min((r for r in rows if r["rate_mbit"] == rate and r["method"] == "thc-ps" and r["time_to_target"]),
                 key=lambda r: r["time_to_target"], default=None)
        if ps is None or ps["time_to_target"] is None:
            continue
        said = [f"{at[m]['time_to_target'] / ps['time_to_target']:.2f}× sooner than {m}"
                for m in ("ddp-fp32", "ddp-fp16", "thc-hook") if m in at and at[m]["time_to_target"]]
        if said:
            lines.append(f"At {_link(rate)} THC-PS ({ps['layout']}) reached {target:g} " + ", ".join(said) + ".")
    return "\n".join(lines) + "\n"
