"""Benchmark scripts run from a checkout as their docstrings say (reproduction: bench_p4.py
stopped with `ModuleNotFoundError: No module named 'tests'` unless PYTHONPATH was set)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench_p4.py", "bench_breakeven.py", "pauses.py", "bench_jobs.py", "bench_rto.py",
                                    "round_cpu.py", "bench_rotation.py", "bench_loss.py", "bench_tensor_error.py",
                                    "bench_support.py", "bench_widths.py"])
def test_script_help_runs_from_anywhere(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_bench_jobs_runs_concurrent_jobs_and_compares_them(tmp_path):
    """A small bench_jobs run: 1 and 2 jobs on one PS, every job started and ended, the ratio
    line printed (the numbers themselves are docs/bench.md's, from a full run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_jobs.py"), "--phases", "2",
                           "--dim-log2", "14", "--jobs", "1", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 jobs at once:" in proc.stdout and "x 1 job(s) alone" in proc.stdout
    assert "jobs started 3, ended 3" in proc.stdout, proc.stdout


def test_bench_rto_runs_both_timers_and_writes_its_table(tmp_path):
    """A small bench_rto run on loopback: the fixed and the adaptive timer side by side at
    0% and 5% loss, every round exact, the table and the JSON written to --out."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_rto.py"), "--paths", "loopback",
                           "--rounds", "3", "--dim", "16384", "--out", str(tmp_path / "rto")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "rto" / "rto.json").read_text())
    got = [(r["loss"], r["timer"]) for r in doc["rows"]]
    assert got == [(0.0, "fixed"), (0.0, "adaptive"), (0.05, "fixed"), (0.05, "adaptive")]
    assert all(r["exact_rounds"] == 3 for r in doc["rows"])
    assert all(r["path_drops"] > 0 for r in doc["rows"] if r["loss"])     # injected drops counted
    assert "| loopback | 5% | adaptive | 3/3 |" in (tmp_path / "rto" / "rto.md").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="bench_loss runs each job in a network namespace (root)")
def test_bench_loss_takes_each_ratio_against_the_lossless_run_of_its_checkout(tmp_path):
    """A small bench_loss run (transport path): lossless runs before and after the lossy one,
    whose ratio is to their mean; the injected drops and the namespace's own kernel drops are
    counted; the table and the JSON go to --out."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_loss.py"), "--paths", "transport", "--reps",
                           "1", "--rounds", "3", "--dim", "20000", "--losses", "0.05", "--out", str(tmp_path / "l")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "l" / "loss.json").read_text())["rows"]
    assert [r["loss"] for r in rows] == [0.0, 0.05, 0.0] and all(r["exact"] == 3 for r in rows)
    ms = [r["mean_round_ms"] for r in rows]
    assert rows[1]["ratio"] == pytest.approx(2 * ms[1] / (ms[0] + ms[2]))
    assert rows[0]["ratio"] == pytest.approx(2 * ms[0] / (ms[0] + ms[2]))
    assert rows[0]["dropped"] == 0 and rows[1]["dropped"] > 0 and rows[1]["resends_per_loss"] > 0
    assert "| transport | this | 0.05 | 1/1 |" in (tmp_path / "l" / "loss.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_loss.py"), "--losses", "0", "--out",
                          str(tmp_path / "x")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--losses must be probabilities in (0, 1)" in bad.stderr


def test_bench_loss_runs_each_checkouts_own_code(tmp_path):
    """`--trees`: a checkout from before the thc_ps package runs its own `deploy.cli`, not the
    thc_ps an editable install finds elsewhere; a tree with no `thc` module of its own is
    refused, naming the module it would have run."""
    sys.path.insert(0, str(ROOT))
    from bench.bench_loss import cli_module
    assert cli_module(ROOT) == "thc_ps.deploy.cli"
    old = tmp_path / "old"
    (old / "deploy").mkdir(parents=True)
    (old / "deploy" / "__init__.py").write_text("")
    (old / "deploy" / "cli.py").write_text("")
    assert cli_module(old) == "deploy.cli"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=f"{empty} has no `thc` module of its own"):
        cli_module(empty)


def test_bench_rotation_times_both_rotations_and_writes_its_json(tmp_path):
    """A small bench_rotation run: both rotations (the job's from the bucket and from the
    tensors) timed on the same steps, the ratio and the job step's floor printed and the JSON
    written where --json says; the sweeps' bytes are the model's for this d."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_rotation.py"), "--dim", "5000",
                           "--block-log2", "11", "--steps", "3", "--json", str(tmp_path / "rot.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "rot.json").read_text())
    assert set(doc["cpu_ms"]) == {"round", "job, bucket", "job, pieces"} and all(v > 0 for v in doc["cpu_ms"].values())
    # 5000 cut as the WideMLP's tensors (4931, 6, 62, 1), each in blocks of 2^11 of its own:
    # 2048 + 2048 + 835 padded to 1024 | 8 | 64 | 1
    p = 5120 + 8 + 64 + 1
    assert sum(s["bytes"] for s in doc["job_sweeps"]) == 4 * 5000 + 4 * p + 12 * p + 4 * p + 8 * p + p // 2 + 5 * p + 8 * p
    assert doc["job_floor_ms"] > 0 and "round / job, pieces CPU:" in proc.stdout and "floor" in proc.stdout


def test_background_load_runs_niced_hogs_and_stops_them():
    import time

    from bench.common import background_load
    with background_load(2, 1, compile=1) as procs:
        assert len(procs) == 4
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.getpriority(os.PRIO_PROCESS, p.pid) != 19 for p in procs):
            time.sleep(0.05)
        assert all(p.is_alive() and os.getpriority(os.PRIO_PROCESS, p.pid) == 19 for p in procs)
    assert not any(p.is_alive() for p in procs)
    groups = {p.pid for p in procs}     # nothing alive is left of a hog's group (its cc runs)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _live_in_groups(groups):
        time.sleep(0.1)
    assert not _live_in_groups(groups)


def test_background_load_in_sessions_of_their_own():
    """--background-session: each hog leads a session of its own (so, under autogroup, a
    scheduling group of its own), still at nice 19, and goes when the block ends."""
    import time

    from bench.common import background_load
    with background_load(1, compile=1, session=True) as procs:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.getsid(p.pid) != p.pid or
                                                   os.getpriority(os.PRIO_PROCESS, p.pid) != 19 for p in procs):
            time.sleep(0.05)
        assert all(os.getsid(p.pid) == p.pid != os.getsid(0) for p in procs)
        assert all(os.getpriority(os.PRIO_PROCESS, p.pid) == 19 for p in procs)
    assert not any(p.is_alive() for p in procs)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _live_in_groups({p.pid for p in procs}):
        time.sleep(0.1)
    assert not _live_in_groups({p.pid for p in procs})


def _live_in_groups(groups: set) -> list:
    """Processes (not zombies) whose process group is one of `groups`."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            live.append(int(stat.parent.name))
    return live


def test_bench_floor_small_run_prints_the_table_and_the_threads(tmp_path):
    """A small bench_floor run with --timeline and --fanout both: the codecs' rows (THC with
    each fan-out), each worker's steps, the CPU by thread of the workers and of the PS, and a PS
    CPU counted inside the rounds that is a number, not nan.  A plain round with one rotation
    per job hands nothing to the error-feedback helper (its quantizer made the residual), so
    no worker thread but the caller's works in it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_floor.py"), "--dim-log2", "16",
                           "--rounds", "2", "--timeline", "--fanout", "both"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "rank 3 " in out and "CPU ms per round by thread (schedstat):" in out
    worker = next(line for line in out.splitlines() if line.strip().startswith("a worker (mean of the ranks"))
    assert "MainThread" in worker and "thc-feedback" not in out and "_data_loop" in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["thc"], ["thc-mcast"], ["none"])}
    assert set(rows) == {"thc", "thc-mcast", "none"}
    for row in ("thc", "thc-mcast"):
        ps_cpu = float(rows[row][8])           # codec, round, x floor, x alone, median, x, x, workers CPU, PS CPU
        assert ps_cpu == ps_cpu and ps_cpu > 0
        assert f"{row}: median round / the lock-step floor's own wall time" in out
    assert "thc (result group 239.255.77.1:47077): round ms per worker" in out


def test_thread_kinds_and_the_ps_cpu_inside_rounds():
    sys.path.insert(0, str(ROOT))
    from bench.bench_floor import _in_rounds, _thread_kind
    assert _thread_kind("thc-block_1") == "thc-block"
    assert _thread_kind("Thread-3 (_data_loop)") == "_data_loop"
    assert _thread_kind("ZMQbg/IO/0") == "ZMQbg/IO"
    assert _thread_kind("MainThread") == "MainThread"
    # (CPU, run-queue) readings: round 1 from the first start (1.0, 0.1) to the last end
    # (1.5, 0.4); round 2 (2.0, 0.5) → (2.2, 0.6); round 3 never ended
    seen = [(1, 0, (1.1, 0.2)), (1, 0, (1.0, 0.1)), (1, 1, (1.4, 0.3)), (1, 1, (1.5, 0.4)),
            (2, 0, (2.0, 0.5)), (2, 1, (2.2, 0.6)), (3, 0, (3.0, 0.7))]
    cpu, runq = _in_rounds(seen, 3)
    assert abs(cpu - (0.5 + 0.2) / 2) < 1e-12 and abs(runq - (0.3 + 0.1) / 2) < 1e-12
    assert all(v != v for v in _in_rounds([], 2))                         # nan: nothing seen


def test_bench_floor_repeat_summary_and_its_check(tmp_path):
    """--repeat's summary is the median of the runs' ratios (not of the rounds), every run
    listed; --repeat 0 is refused before anything runs."""
    sys.path.insert(0, str(ROOT))
    from bench.bench_floor import summarize_runs
    line = summarize_runs([{"median_ms": 300.0, "floor_ms": 200.0, "lockstep_wall_ms": 250.0},
                           {"median_ms": 390.0, "floor_ms": 300.0, "lockstep_wall_ms": 300.0},
                           {"median_ms": 280.0, "floor_ms": 250.0, "lockstep_wall_ms": 280.0}])
    assert line == ("thc over 3 runs: median round / floor = 1.30 (runs: 1.50, 1.30, 1.12); median round / "
                    "lock-step wall = 1.20 (runs: 1.20, 1.30, 1.00); median round, ms = 300.0 (runs: 300.0, 390.0, 280.0)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_floor.py"), "--repeat", "0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--repeat must be at least 1, got 0" in proc.stderr


def test_round_cpu_groups_perf_samples_inside_the_rounds_window():
    """round_cpu.py: perf script lines parsed, samples outside the rounds' window left out,
    each sample in its group (PS by pid, codec by library, idle as pid 0), and the codec's
    share with its bound."""
    sys.path.insert(0, str(ROOT))
    from bench.round_cpu import breakdown, parse_perf_script, report
    lines = [
        "  4242/4242  100.500000:      7f00 pass (/work/compression/_kernels.cpython-311-x86_64-linux-gnu.so)",
        "  4243/4250  100.600000:      7f01 FLOAT_add_X86_V3 (/v/numpy/_multiarray_umath.cpython-311.so)",
        "  4243/4243  100.700000:  ffffffff81 _copy_to_iter ([kernel.kallsyms])",
        "  4000/4001  100.800000:      7f02 lookup_add4_avx2 (/work/ps_server/_fastpath.cpython-311.so)",
        "     0/0     100.900000:  ffffffff82 pv_native_safe_halt ([kernel.kallsyms])",
        "  4242/4242  101.000000:      7f03 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)",
        "  4242/4242   99.000000:      7f04 pass (/work/compression/_kernels.cpython-311-x86_64-linux-gnu.so)",
        "  5555/5555  100.950000:      7f05 main (/usr/bin/cc1)",
        "\tffffffff81 some_callchain_line",
    ]
    rows = parse_perf_script(lines)
    assert len(rows) == 8 and rows[0] == (4242, 4242, 100.5, "pass", "_kernels.cpython-311-x86_64-linux-gnu.so")
    n, groups, symbols = breakdown(rows, (100.0, 101.5), ps_pid=4000, worker_pids={4242, 4243})
    assert n == 7                                         # the sample at 99 s is before the rounds
    assert groups == {"codec: C kernels": 1, "codec: numpy": 1, "workers: kernel": 1, "PS": 1, "idle": 1,
                      "workers: Python": 1, "other processes": 1}
    assert symbols["PS"]["lookup_add4_avx2"] == 1
    text = report(n, groups, symbols)
    assert "codec share s = 28.6%" in text and "1/s = 3.50x the floor" in text
    assert "no samples" in report(0, groups, symbols)


def test_round_cpu_refuses_bad_arguments_and_a_missing_perf(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = str(ROOT / "bench" / "round_cpu.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--rounds", "0"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rounds and --workers must be at least 1" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--result-group", "10.0.0.1:5000"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--result-group" in proc.stderr and "not a multicast address" in proc.stderr
    env["PATH"] = str(tmp_path)                           # no perf there
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path / "o")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "needs perf (Debian: linux-perf) on PATH" in proc.stderr


def test_bench_floor_makes_no_gradient_while_a_round_runs():
    """Every rank meets the others after a timed round before it makes its next gradient: no
    rank's gradient making (~0.3 s of CPU at 2^24) overlaps another rank's round."""
    sys.path.insert(0, str(ROOT))
    from bench.bench_floor import run_rounds
    d = run_rounds("thc", 1 << 12, 3, 4, quiet=True)
    marks = d["marks"]                                  # rank -> [(start, end, gradient made from)]
    assert sorted(marks) == [0, 1, 2] and all(len(m) == 4 for m in marks.values())
    for r in range(1, 4):
        last_end = max(m[r - 1][1] for m in marks.values())
        first_made = min(m[r][2] for m in marks.values())
        assert first_made >= last_end, (r, first_made - last_end)
    for m in marks.values():
        assert all(made <= start < end for start, end, made in m)


def test_bench_support_finds_the_narrow_support_biased(tmp_path):
    """bench_support.py at the example LM's first gradients, two p's and two tables, four
    draws each: a row per table and p where --out says, the wider support with the smaller
    bias and a mean closer to the average's scale, 5-bit indices with less noise; a bad p or
    table is refused naming it."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = str(ROOT / "bench" / "bench_support.py")
    proc = subprocess.run([sys.executable, script, "--steps", "0", "--draws", "4", "--p", "1/32,1/512",
                           "--tables", "4:30,5:31", "--out", str(tmp_path / "s.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    narrow, wide, _, five = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert (narrow["p"], wide["p"], five["p"]) == ("1/32", "1/512", "1/512")
    assert (wide["bits"], five["bits"], five["granularity"]) == (4, 5, 31)
    assert wide["bias2"] < narrow["bias2"] / 4 and narrow["scale"] < wide["scale"] <= 1.01
    assert all(0 < r["noise"] < 1 for r in (narrow, wide, five))
    assert five["noise"] < 0.6 * wide["noise"]
    for args, said in ((["--p", "2"], "--p '2'"), (["--tables", "5:20"], "'5:20'")):
        bad = subprocess.run([sys.executable, script, *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr


def test_bench_widths_runs_both_widths_block_by_block(tmp_path):
    """bench_widths.py, two rounds a width: a row per width where --out says, 5-bit indices
    a quarter more bytes than 4-bit ones and pipelined as they are (the C kernels pack them
    block by block); a bad width is refused naming it."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = str(ROOT / "bench" / "bench_widths.py")
    proc = subprocess.run([sys.executable, script, "--rounds", "2", "--out", str(tmp_path / "w.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    four, five = json.loads((tmp_path / "w.json").read_text())["rows"]
    assert (four["bits"], four["granularity"], five["bits"], five["granularity"]) == (4, 30, 5, 31)
    assert five["bytes_up"] * 4 == four["bytes_up"] * 5 and four["pipelines"] and five["pipelines"]
    assert all(r["worker_ms"] > 0 and r["ps_ms"] > 0 for r in (four, five))
    bad = subprocess.run([sys.executable, script, "--widths", "4:30,9:300"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'9:300'" in bad.stderr, bad.stderr


def test_bench_tensor_error_writes_a_row_per_tensor(tmp_path):
    """bench_tensor_error.py without training steps, two workers: one row per parameter tensor
    of the example LM, both errors finite and positive, the JSON where --out says."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_tensor_error.py"), "--steps", "0",
                           "--workers", "2", "--out", str(tmp_path / "e.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert len(rows) == 54 and rows[-1]["tensor"] == "head.bias"
    assert all(0 < r["one_vector"] < 10 and 0 < r["per_tensor"] < 10 for r in rows)
    assert "per tensor: relative error per tensor" in proc.stdout
