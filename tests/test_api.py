"""The library API a training script calls (thc_ps.connect, thc_ps.hook; docs/api.md).

In-process tests use a one-rank gloo group; the multi-rank ones start torchrun on
tests/api_rank.py or examples/char_lm.py against a PS in this process."""
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thc_ps
from bench.pauses import free_port_pair
from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from thc_ps.torch import WARMUP_STEPS

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = ROOT / "tests" / "api_rank.py"
EXAMPLE = ROOT / "examples" / "char_lm.py"
#: a small char LM: seconds per run on two cores
SMALL_LM = ["--dim", "32", "--layers", "1", "--context", "16", "--batch", "4", "--text-mb", "0.3"]


def _ps(job=None) -> PSServer:
    """A PS on loopback whose control port is its data port + 1 (what HOST:PORT means)."""
    port = free_port_pair()
    return PSServer(job, ("127.0.0.1", port), control_port=port + 1).start()


@pytest.fixture
def ps():
    """A PS with no fixed job: each launch proposes its own."""
    server = _ps()
    yield server
    server.stop()


def _addr(server) -> str:
    return f"127.0.0.1:{server.data_addr[1]}"


@pytest.fixture
def group():
    """A one-rank gloo process group in this process (destroyed after the test)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def torchrun(*args, nproc=2, env=None, timeout=240, extra=()):
    """torchrun --standalone on this host; returns the CompletedProcess (output merged)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *extra, *map(str, args)]
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT)


def _ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


# ------------------------------------------------------------------ bad input, one rank

def test_connect_outside_a_process_group_is_refused_in_one_line(ps):
    with pytest.raises(ValueError, match=r"needs a torch.distributed process group: call "
                                         r"dist.init_process_group") as err:
        thc_ps.connect(ps=_addr(ps))
    assert "\n" not in str(err.value)
    assert ps.status()["jobs"] == []


def test_connect_names_what_is_missing_or_wrong(group, monkeypatch):
    monkeypatch.delenv("THC_PS", raising=False)
    with pytest.raises(ValueError, match=r"no PS address: pass connect\(ps='HOST:PORT"):
        thc_ps.connect()
    with pytest.raises(ValueError, match=r"is not HOST:PORT"):
        thc_ps.connect(ps="localhost")
    with pytest.raises(TypeError, match=r"unknown option\(s\) bitz; job options: codec, bits"):
        thc_ps.connect(ps="127.0.0.1:1", bitz=3)
    with pytest.raises(ValueError, match=r"bits must be an integer in 1..8, got 9"):
        thc_ps.connect(ps="127.0.0.1:1", bits=9)
    with pytest.raises(ValueError, match=r"takes a DistributedDataParallel model .* got Linear"):
        thc_ps.connect(torch.nn.Linear(2, 2), ps="127.0.0.1:1")


def test_a_bucket_dtype_it_cannot_take_is_refused_before_any_traffic(group, ps):
    model = torch.nn.Linear(4, 2).to(torch.complex64)
    with pytest.raises(ValueError, match=r"parameter 'module.weight' has dtype torch.complex64: the PS hook "
                                         r"takes floating-point gradients"):
        thc_ps.connect(DDP(model), ps=_addr(ps))
    assert ps.status()["jobs"] == [] and ps.stats()["registrations"] == 0


def test_a_ps_with_another_job_is_refused_naming_both_sides(group):
    fixed = _ps(JobConfig(num_workers=2))
    try:
        with pytest.raises(thc_ps.Refused, match=r"world size: the PS's job has 2 workers, this process group "
                                                 r"has 1 ranks"):
            thc_ps.connect(ps=f"127.0.0.1:{fixed.data_addr[1]}")
    finally:
        fixed.stop()
    fixed = _ps(JobConfig(num_workers=1, codec="thc"))
    try:
        with pytest.raises(thc_ps.Refused, match=r"codec: the PS has 'thc', connect\(codec='none'\)"):
            thc_ps.connect(ps=f"127.0.0.1:{fixed.data_addr[1]}", codec="none")
        assert fixed.stats()["packets_in"] == 0
    finally:
        fixed.stop()


def test_the_ps_address_and_keys_may_come_from_the_environment(group, ps, monkeypatch):
    monkeypatch.setenv("THC_PS", _addr(ps))
    with thc_ps.connect() as state:
        assert state.job.num_workers == 1 and state.rank == 0
        assert [j["job_name"] for j in ps.status()["jobs"]] == [state.job_name]
    deadline = time.monotonic() + 10
    while ps.status()["jobs"] and time.monotonic() < deadline:    # close() left: the job ends
        time.sleep(0.05)
    assert ps.status()["jobs"] == []


def test_close_leaves_no_thread_handler_or_job_behind(group, ps):
    """A long-lived process may connect many times: each close() ends the hook's and the
    transport's threads, gives SIGTERM and the signal wakeup fd back, and leaves the job."""
    import threading
    before = {t.name for t in threading.enumerate()}
    for _ in range(3):
        state = thc_ps.connect(ps=_addr(ps))
        assert signal.getsignal(signal.SIGTERM) == state._on_sigterm
        state.close()
    time.sleep(0.3)
    assert {t.name for t in threading.enumerate()} <= before
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
    assert sys.excepthook is sys.__excepthook__ or "thc" not in getattr(sys.excepthook, "__qualname__", "")
    assert ps.status()["jobs"] == [] or all(not j["live"] for j in ps.status()["jobs"])


def test_job_and_transport_options_reach_the_job(group, ps):
    with thc_ps.connect(ps=_addr(ps), bits=2, granularity=40, rotation="job", loss_policy="zero",
                        timeout_ms=20, job_name="opts") as state:
        assert (state.job.bits, state.job.granularity, state.job.rotation, state.job.lane_bits) == (2, 40, "job", 6)
        assert state.transport.policy == "zero" and state.job_name == "opts"
        job = next(j for j in ps.status()["jobs"] if j["job_name"] == "opts")
        assert job["num_workers"] == 1


def test_the_job_name_comes_from_torchrun_and_a_launch_token():
    env = {"TORCHELASTIC_RUN_ID": "a1b2 c3/d4", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert thc_ps.default_job_name("0123456789abcdef", env) == "a1b2-c3-d4.r2.01234567"
    assert thc_ps.default_job_name("feedfacecafebeef", {}) == "torch.r0.feedface"
    long = thc_ps.default_job_name("f" * 16, {"TORCHELASTIC_RUN_ID": "x" * 100})
    assert len(long) <= 64


def test_the_first_steps_warm_up_over_the_process_group(group, ps):
    """connect(warmup_steps=2): the first two steps' buckets never reach the PS; each comes
    back as PyTorch's fp16_compress_hook leaves it (over this one-rank group: the gradient
    rounded to float16), and the bytes are the float16 payload's.  The third step is a PS
    round.  The step count is in state_dict: a state saved after one step, loaded into a
    fresh launch, warms up one step more, not two."""
    import numpy as np

    from tests.test_ps_hook import FakeBucket
    rng = np.random.default_rng(3)
    g = [torch.from_numpy(rng.normal(0, 1, 5000).astype(np.float32)) for _ in range(3)]
    with thc_ps.connect(ps=_addr(ps), warmup_steps=2) as state:
        for s in range(2):
            out = thc_ps.hook(state, FakeBucket(0, g[s].clone())).wait()
            assert torch.equal(out, g[s].half().float())
            assert state.totals["rounds"] == 0 and state.totals["warmup_steps"] == s + 1
        assert state.totals["bytes_up"] == state.totals["bytes_down"] == 0    # one rank: a ring moves nothing
        assert state.worker.round_no == 0                   # the warm-up used no allreduce number
        out = thc_ps.hook(state, FakeBucket(0, g[2].clone())).wait()
        assert state.totals["rounds"] == 1 and state.totals["warmup_steps"] == 2
        assert state.worker.round_no == 1 and state.worker.error_feedback is False   # docs/protocol.md §4 step 8
        assert state.totals["bytes_up"] > 5000 * 4 // 8 and not torch.equal(out, g[2].half().float())
    with thc_ps.connect(ps=_addr(ps), warmup_steps=2) as state:
        thc_ps.hook(state, FakeBucket(0, g[0].clone())).wait()
        saved = state.state_dict()
    with thc_ps.connect(ps=_addr(ps), warmup_steps=2) as state:
        state.load_state_dict(saved)
        assert torch.equal(thc_ps.hook(state, FakeBucket(0, g[1].clone())).wait(), g[1].half().float())
        thc_ps.hook(state, FakeBucket(0, g[2].clone())).wait()
        assert state.totals["rounds"] == 1 and state.totals["warmup_steps"] == 2
    step8 = " ".join((ROOT / "docs" / "protocol.md").read_text().split("8. **Error feedback in the rotated")[1]
                     .split("\n\n")[0].split())
    assert ("keeps none unless given `error_feedback=True`" in step8) == (not thc_ps.torch.ERROR_FEEDBACK)
    assert f"first `warmup_steps` steps ({WARMUP_STEPS}) send nothing to the PS" in step8
    with pytest.raises(ValueError, match=r"warmup_steps=\.\.\.\) takes an integer 0 or more, got -1"):
        thc_ps.connect(ps=_addr(ps), warmup_steps=-1)


def test_ranks_that_warm_up_for_different_steps_are_refused(ps, tmp_path):
    """Two ranks giving connect() different warmup_steps would all-reduce against a PS round:
    both are refused before any traffic, each naming both ranks' numbers."""
    res = torchrun(RANK_SCRIPT, "--ps", _addr(ps), "--warmup-steps", "3,4", "--steps", "2",
                   "--out", tmp_path / "r.json")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and not (tmp_path / "r.json").exists()
    assert out.count("different warmup_steps: rank 0 3, rank 1 4") >= 2, out[-3000:]
    assert ps.status()["jobs"] == [] or all(j["stats"]["rounds_completed"] == 0 for j in ps.status()["jobs"])


def test_memory_stays_flat_over_many_steps(group, ps):
    """The hook keeps no per-round record unless asked: RSS after 2,000 steps within 8 MiB of
    RSS after 200 (a report per step kept grows 1 byte per parameter per step: 18 MB here;
    the sign diagonals of past rounds, 2 KiB a round, kept up to 32 MiB: 3.5 MB)."""
    import numpy as np
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)                        # 10,100 parameters: one bucket
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 100), torch.randn(8, 100)

    def rss():
        return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("VmRSS:")))
    with thc_ps.connect(ddp, ps=_addr(ps)) as state:
        marks = {}
        for step in range(1, 2001):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if step in (200, 2000):
                marks[step] = rss()
        warm = state.warmup_steps
        assert warm == WARMUP_STEPS > 0 and state.totals["warmup_steps"] == warm
        assert state.totals["rounds"] == 2000 - warm and state.take_reports() == []
        assert state.totals["bytes_up"] > 2000 * 10_100 * 4 // 8       # 4-bit indices went out
    assert marks[2000] - marks[200] < 8 * 1024, marks
    assert np.isfinite(model.weight.detach().numpy()).all()


def test_a_saved_state_of_another_launch_is_refused(group, ps):
    with thc_ps.connect(ps=_addr(ps)) as state:
        saved = state.state_dict()
        assert saved["ranks"] is not None and saved["ranks"][0]["worker"]["rank"] == 0
        with pytest.raises(ValueError, match=r"of 2 ranks, this launch has 1"):
            state.load_state_dict({**saved, "ranks": saved["ranks"] * 2})
        with pytest.raises(ValueError, match=r"no rank passed a saved THC-PS state"):
            state.load_state_dict(None)
        # saved before the job had tail_log2 (its residuals are of another block layout)
        older = [{**r, "worker": {**r["worker"], "job": {k: v for k, v in r["worker"]["job"].items()
                                                         if k != "tail_log2"}}} for r in saved["ranks"]]
        with pytest.raises(ValueError, match=r"another job configuration: tail_log2: saved None, this job 12"):
            state.load_state_dict({**saved, "ranks": older})
    with thc_ps.connect(ps=_addr(ps), bits=2) as other:      # saved: the library's 5 bits at g = 31
        with pytest.raises(ValueError, match=r"another job configuration: bits: saved 5, this job 2; "
                                             r"granularity: saved 31, this job 30"):
            other.load_state_dict(saved)


# ------------------------------------------------------------------ several ranks (torchrun)

def test_the_example_trains_through_the_ps_like_plain_ddp(ps, tmp_path):
    """torchrun --standalone --nproc-per-node 2 runs the example a few steps against a PS:
    replicas identical, and the same seed on plain DDP ends within 5% of its validation loss
    (2.1% apart after 100 steps when this was written: THC's 4-bit gradients lag a little)."""
    args = [EXAMPLE, *SMALL_LM, "--steps", "100", "--eval-every", "50"]
    thc = _ok(torchrun(*args, "--ps", _addr(ps), "--out", tmp_path / "thc.json"))
    _ok(torchrun(*args, "--no-thc", "--out", tmp_path / "ddp.json"))
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("thc.json", "ddp.json"))
    assert "replicas identical: True" in thc and a["replicas_identical"] and b["replicas_identical"]
    # one bucket (the model is under 1 MiB): a round a step once the warm-up's steps are done
    assert a["thc"]["warmup_steps"] == WARMUP_STEPS and a["thc"]["rounds"] == 100 - WARMUP_STEPS
    assert abs(a["val_loss"] - b["val_loss"]) < 0.05 * b["val_loss"], (a, b)
    assert b["thc"] is None


@pytest.mark.parametrize("rotation,warmup,feedback", [("round", 0, "on"), ("job", 0, "on"), ("job", 8, "off"),
                                                      ("job", 6, "on")])
def test_a_checkpoint_round_trip_is_bit_for_bit(ps, tmp_path, rotation, warmup, feedback):
    """k steps, a checkpoint, k more in fresh processes: the same parameters, bit for bit, as
    2k steps without a stop (the error feedback, the random stream and the round count
    carry over; the first resumed step runs in the saved bucket layout).  With a warm-up
    of 8 steps the checkpoint falls inside it: the resumed launch warms up 2 steps more, not 8;
    with 6, on its last step: the resumed launch's first round runs in the bucket layout the
    warm-up's last step had (DDP's rebuilt one), as the launch without a stop does."""
    common = [RANK_SCRIPT, "--ps", _addr(ps), "--rotation", rotation, "--ckpt-every", "6",
              "--warmup-steps", str(warmup), "--error-feedback", feedback]
    _ok(torchrun(*common, "--steps", "12", "--out", tmp_path / "whole.json"))
    _ok(torchrun(*common, "--steps", "6", "--ckpt", tmp_path / "ck", "--out", tmp_path / "first.json"))
    _ok(torchrun(*common, "--steps", "12", "--ckpt", tmp_path / "ck", "--out", tmp_path / "rest.json"))
    whole, rest = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "rest.json"))
    assert rest["first"] == 6 and rest["rotation"] == rotation
    assert whole["totals"]["warmup_steps"] == warmup and rest["totals"]["warmup_steps"] == warmup
    assert rest["totals"]["rounds"] == whole["totals"]["rounds"] == 12 - warmup
    assert whole["identical"] and rest["identical"]
    assert rest["digest"] == whole["digest"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_buckets_are_averaged_exactly(ps, tmp_path, dtype):
    """A model in half precision hands DDP's hook half-precision buckets: with float sums
    (codec none) the averaged gradients equal the average of the ranks' own, rounded once."""
    out = tmp_path / "r.json"
    _ok(torchrun(RANK_SCRIPT, "--ps", _addr(ps), "--codec", "none", "--dtype", dtype, "--steps", "3",
                 "--check-average", "--warmup-steps", "0", "--out", out))
    doc = json.loads(out.read_text())
    assert doc["checked"]["equal"], doc["checked"]
    assert doc["identical"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA buckets (copied through "
                                                         "pinned host memory) are not tested here")
def test_cuda_buckets_go_through_pinned_host_memory(group, ps):
    model = torch.nn.Linear(16, 4).cuda()
    ddp = DDP(model)
    with thc_ps.connect(ddp, ps=_addr(ps), codec="none", warmup_steps=0) as state:
        ddp(torch.randn(4, 16, device="cuda")).sum().backward()
        assert all(t.is_pinned() for t in state._staging.values())


def test_two_launches_with_one_job_name_never_share_a_job(ps, tmp_path):
    """The second launch under a name a running launch holds is refused at once, on every
    rank, naming the name; the first goes on."""
    first = _torchrun_bg(RANK_SCRIPT, "--ps", _addr(ps), "--job-name", "shared", "--steps", "1000000",
                         "--out", tmp_path / "a.json")
    try:
        def shared():
            return next((j for j in ps.status()["jobs"] if j["job_name"] == "shared"), None)
        deadline = time.monotonic() + 120
        while not (shared() and len(shared()["live"]) == 2):
            assert time.monotonic() < deadline and first.poll() is None, "the first launch never ran"
            time.sleep(0.1)
        second = torchrun(RANK_SCRIPT, "--ps", _addr(ps), "--job-name", "shared", "--steps", "2",
                          "--out", tmp_path / "b.json")
        out = second.stdout + second.stderr
        assert second.returncode != 0
        assert out.count("job 'shared' on this PS belongs to another launch") >= 2, out[-3000:]   # both ranks
        assert "give this one another job_name" in out
        before = shared()["stats"]["rounds_completed"]
        time.sleep(1.0)
        assert first.poll() is None and len(shared()["live"]) == 2
        assert shared()["stats"]["rounds_completed"] > before
    finally:
        _stop(first)


def _worker_pids(agent: int) -> dict:
    """LOCAL_RANK -> pid of the ranks a torchrun agent started (its children, each in a
    session of its own)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent and b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = int(proc.name)
    return out


def _kill_rank_after_checkpoint(proc, ckpt: Path, rank: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (ckpt / "last.pt").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    pid = _worker_pids(proc.pid).get(rank)
    assert pid is not None, "rank's process not found"
    os.kill(pid, signal.SIGKILL)


# torchrun shares its rendezvous store with the ranks; a restarted rank may then read the
# previous attempt's gloo address and fail to connect (pytorch/pytorch#135712; docs/api.md)
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun_bg(*args, extra=()):
    """torchrun --standalone in the background, in a session of its own (`_stop` ends it all)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *extra,
           *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **RESTARTABLE}, start_new_session=True)


def _stop(proc) -> str:
    """End a background torchrun and its ranks (each in a session of its own); returns what it
    printed."""
    for pid in _worker_pids(proc.pid).values():
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate(timeout=30)[0]


def test_an_elastic_restart_finishes_from_the_checkpoint(ps, tmp_path):
    """torchrun --max-restarts 1, rank 1 killed after the first checkpoint: the launch
    restarts from it, joins the PS as one new job and ends with the parameters a run
    without the kill has, bit for bit (no step between checkpoint and kill is lost twice)."""
    args = [EXAMPLE, *SMALL_LM, "--ps", _addr(ps), "--steps", "60", "--ckpt-every", "10", "--eval-every", "30"]
    _ok(torchrun(*args, "--out", tmp_path / "whole.json"))
    proc = _torchrun_bg(*args, "--ckpt", tmp_path / "ck", "--out", tmp_path / "restarted.json",
                        extra=["--max-restarts=1"])
    try:
        _kill_rank_after_checkpoint(proc, tmp_path / "ck")
        out, _ = proc.communicate(timeout=240)
    finally:
        _stop(proc)
    assert proc.returncode == 0, out[-4000:]
    whole, again = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "restarted.json"))
    assert "steps 0..60" in out and any(f"steps {k}..60" in out for k in range(10, 60, 10)), out[-3000:]
    assert again["replicas_identical"] and again["digest"] == whole["digest"]
    names = [line for line in out.splitlines() if "THC-PS job" in line]
    assert len(names) == 2 and ".r0." in names[0] and ".r1." in names[1]


def test_without_restarts_a_killed_rank_is_named(ps, tmp_path):
    """Without --max-restarts torchrun ends the launch: it names the failed rank, and the
    surviving rank says which job and round it was in when it ended (torchrun's SIGTERM, or
    gloo's error when the peer's socket closed first)."""
    args = [EXAMPLE, *SMALL_LM, "--ps", _addr(ps), "--steps", "400", "--ckpt-every", "5", "--eval-every", "100"]
    proc = _torchrun_bg(*args, "--ckpt", tmp_path / "ck")
    try:
        _kill_rank_after_checkpoint(proc, tmp_path / "ck")
        out, _ = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in out or "local_rank: 1" in out, out[-3000:]
    note = next((line for line in out.splitlines() if line.startswith("thc_ps: rank 0 ")), "")
    assert re.match(r"thc_ps: rank 0 (stopped by SIGTERM|ended by \w+) in job '.*', round \d+", note), out[-3000:]


def test_lightning_trains_through_the_ps(ps, tmp_path):
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")
    script = ROOT / "tests" / "api_lightning.py"
    out = tmp_path / "l.json"
    _ok(torchrun(script, "--ps", _addr(ps), "--steps", "8", "--out", out))
    doc = json.loads(out.read_text())
    assert doc["identical"] and doc["warmup_steps"] == 2 and doc["rounds"] >= 6 and doc["bytes_up"] > 0


def test_two_nodes_in_namespaces_join_one_ps_job(tmp_path):
    """Two "nodes" and a PS host, each a network namespace: torchrun's c10d rendezvous
    across them, 2 × 2 ranks, one PS job, replicas identical at the end.  (In a namespace
    the host name resolves to the host's address, not the namespace's: each node names its
    own address, --local-addr, and the first is told it holds the rendezvous, is_host=1.)"""
    from thc_ps.deploy import netns
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.star(3) as net:
        ps_proc = subprocess.Popen([*net.prefix(0), sys.executable, "-m", "thc_ps.deploy.cli", "ps", "--bind",
                                    f"{net.ips[0]}:9000"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        nodes = []
        try:
            time.sleep(1.0)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": net.ifname}
            for node in (0, 1):
                cmd = [*net.prefix(node + 1), sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                       "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={net.ips[1]}:29400",
                       "--rdzv-id=thc-netns", f"--rdzv-conf=is_host={int(node == 0)}",
                       f"--local-addr={net.ips[node + 1]}", str(EXAMPLE), *SMALL_LM, "--steps", "20", "--eval-every", "10",
                       "--ps", f"{net.ips[0]}:9000", "--out", str(tmp_path / f"node{node}.json")]
                nodes.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True, env=env))
            outs = [n.communicate(timeout=240)[0] for n in nodes]
            for n, out in zip(nodes, outs):
                assert n.returncode == 0, out[-3000:]
        finally:
            for p in nodes + [ps_proc]:
                if p.poll() is None:
                    p.terminate()
            ps_log = ps_proc.communicate(timeout=30)[0]
    docs = [json.loads(p.read_text()) for p in tmp_path.glob("node*.json")]   # the node of global rank 0
    assert len(docs) == 1 and docs[0]["replicas_identical"]
    started = [line for line in ps_log.splitlines() if "started: n=4" in line]
    assert len(started) == 1, ps_log[-3000:]
    assert ps_log.count("registered rank") == 4


def test_the_api_reference_states_the_options_and_defaults_the_code_has():
    """docs/api.md's tables of job and transport options: the names connect() takes, and for
    each job option the default JobConfig gives (the lane: the narrowest that fits)."""
    import dataclasses
    import inspect

    from thc_ps.torch import JOB_OPTIONS, TRANSPORT_OPTIONS
    from thc_ps.worker.transport import Transport
    text = (ROOT / "docs" / "api.md").read_text()

    def table(header: str) -> dict:
        block = text[text.index(f"| {header} |"):].split("\n\n")[0].splitlines()[2:]
        return {re.match(r"\| `(\w+)` \| ([^|]*) \|", row).group(1): re.match(r"\| `(\w+)` \| ([^|]*) \|", row)
                .group(2).strip() for row in block}
    jobs = table("job option")
    assert list(jobs) == list(JOB_OPTIONS)
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(JobConfig) if f.name != "num_workers"}
    said = {"none": "", "{}": {}, "narrowest that fits": 0}
    from thc_ps.torch import P_WITHOUT_FEEDBACK, TABLE_WITHOUT_FEEDBACK
    assert jobs["p"] == f"`{defaults['p']}`, `{P_WITHOUT_FEEDBACK}` without error feedback"
    for name in ("bits", "granularity"):
        assert jobs[name] == f"{defaults[name]}, {TABLE_WITHOUT_FEEDBACK[name]} without error feedback", name
    for name in ("p", "bits", "granularity"):
        jobs[name] = jobs[name].split(",")[0]
    for name, cell in jobs.items():
        want = defaults[name]
        got = said.get(cell, cell.strip("`"))
        assert str(got) == str(want), (name, cell, want)
    args = table("argument")
    params = inspect.signature(thc_ps.connect).parameters
    assert list(args) == [n for n in params if n != "options"]
    for name in ("error_feedback", "warmup_steps", "keep_reports", "notes"):
        assert args[name] == f"`{params[name].default}`", (name, args[name])
    transports = table("transport option")
    assert list(transports) == list(TRANSPORT_OPTIONS)
    from thc_ps.torch import TRANSPORT_NAMES
    assert {TRANSPORT_NAMES.get(o, o) for o in TRANSPORT_OPTIONS} <= set(inspect.signature(Transport).parameters)


def test_a_script_with_its_own_worker_and_proto_modules_imports_thc_ps(tmp_path):
    """A training script beside its own worker.py and proto.py (first on sys.path) still gets
    the project's packages through thc_ps, and its own modules stay its own."""
    (tmp_path / "worker.py").write_text("MINE = 'worker'\n")
    (tmp_path / "proto.py").write_text("MINE = 'proto'\n")
    (tmp_path / "train.py").write_text(
        "import thc_ps, thc_ps.torch, worker, proto\n"
        "from thc_ps.worker.ps_hook import PSHookState\n"
        "assert thc_ps.connect is thc_ps.torch.connect\n"
        "print(worker.MINE, proto.MINE, PSHookState.__module__)\n")
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["worker", "proto", "thc_ps.worker.ps_hook"]
