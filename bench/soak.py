"""A soak of one long-lived `thc ps` with faults: hundreds of jobs, 3–6 at a time, mixed codecs
and shapes, and a fault in every wave of jobs — a rank killed and restarted, a flood of junk
datagrams (and junk on the metrics port and the control plane), the PS stopped for longer
than its lease, a job whose keys do not fit, and the PS killed (SIGKILL) and started again.
Every job must end exact, or fail with the cause its fault names; the PS's RSS, open
descriptors and threads must stay flat (slopes per 100 jobs, within each PS incarnation);
and its Prometheus metrics must agree with the jobs' own reports.  docs/reliability.md holds
a run; tests/test_soak.py runs a short one.

    nice -n 10 .venv/bin/python bench/soak.py --jobs 500 --out /tmp/soak    # about an hour here

The PS is a real `thc ps` process with CURVE keys and `--metrics`; each job is a `thc launch`
(thc_ps.deploy.launch.run_launch) of its own name against it, its workers processes of their own,
every chunk of every round checked against the in-process reference.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pauses import free_port_pair  # noqa: E402
from bench.reliability import junk_datagram, random_frame  # noqa: E402
from thc_ps.deploy.launch import fetch_status, run_launch  # noqa: E402
from thc_ps.proto.keys import client_keys, create_keys  # noqa: E402

THC = [sys.executable, "-m", "thc_ps.deploy.cli"]
ROOT = Path(__file__).resolve().parents[1]
#: One fault per wave, in this order, round and round: a PS kill every ninth wave.
FAULTS = ("rank", "flood", "stall", "badkey", "rank", "flood", "stall", "badkey", "ps_kill")
DATA_PLANE = ("thc", "none")          # the codecs a rank rejoin and a PS restart resume
CODECS = ("thc", "thc", "none", "topk", "terngrad", "3lc", "uhc")
#: What a job that failed must say, by its fault: the cause named, not a symptom.
EXPECTED_CAUSE = {"badkey": "refused the connection", "ps_kill": "the PS restarted during"}
#: Failures a job may meet without a fault of its wave, each a documented limit named in its
#: message (docs/reliability.md, "What is not covered"): a rank of a BLOB codec's job whose lease
#: lapsed (a worker process starved past its lease on an overloaded host) cannot rejoin.
KNOWN_LIMITS = {"rejoining a running job is supported for thc and none": "a BLOB job's rank lost its lease"}


def healthz(addr) -> tuple:
    """(status, body) of a PS's /healthz at (host, port): 200 "ok" while both of its planes
    serve ("draining" during a drain), 503 otherwise."""
    try:
        with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/healthz", timeout=10) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()


@dataclass
class Job:
    """One job of the soak: its shape, its fault, and how it ended."""

    number: int
    wave: int
    name: str
    workers: int
    codec: str
    dim: int
    rounds: int
    quorum: float
    fault: str = "-"                  # the wave's fault, where it touches this job
    kill: tuple | None = None         # (rank, round) for a rank fault
    ok: bool = False
    limit: str = ""                   # a documented limit its failure named (KNOWN_LIMITS)
    exact_rounds: int = 0
    cause: str = ""                   # why it failed (its problems, or the launch's error)
    expected: bool = True             # ok, or failed with its fault's named cause
    ps_job: dict | None = field(default=None, repr=False)
    seconds: float = 0.0


class PS:
    """The `thc ps` under test: started (and restarted) on fixed ports with keys and metrics;
    its resources read from /proc, its metrics scraped."""

    def __init__(self, keys: Path, lease_s: float, log: Path):
        self.port = free_port_pair()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.mport = s.getsockname()[1]
        self.keys, self.lease_s, self.log_path = keys, lease_s, log
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0

    @property
    def shard(self) -> tuple:
        return ("127.0.0.1", self.port, self.port + 1)

    def start(self) -> None:
        self.proc = subprocess.Popen(THC + ["ps", "--bind", f"127.0.0.1:{self.port}", "--keys", str(self.keys),
                                            "--metrics", f"127.0.0.1:{self.mport}", "--lease-s", str(self.lease_s),
                                            "--stats-every", "0"],
                                     cwd=ROOT, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT)
        self.incarnation += 1
        deadline = time.monotonic() + 60
        while not fetch_status(self.shard, self.keys, 1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"thc ps did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def resources(self) -> dict:
        """The PS process's resident memory (kB), open descriptors and threads."""
        pid = self.proc.pid
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}

    def healthz(self) -> tuple:
        return healthz(("127.0.0.1", self.mport))

    def metrics(self) -> dict:
        """{(name, frozenset(labels)): value} of one scrape."""
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset({"shard": "0", **labels}.items())), 0.0)


def make_jobs(rng, wave: int, first: int, count: int, fault: str) -> list:
    """`count` jobs of random shapes for a wave; the fault's victim where it has one."""
    jobs = []
    for k in range(count):
        workers = int(rng.integers(2, 5))
        codec = str(rng.choice(CODECS))
        dim = int(rng.choice([1000, 4096, 20000, 65536]))
        quorum = float(rng.choice([1.0, 0.75])) if workers == 4 and codec in DATA_PLANE else 1.0
        jobs.append(Job(first + k, wave, f"soak-{first + k}", workers, codec, dim, int(rng.integers(6, 16)), quorum))
    if fault == "rank":
        victim = next((j for j in jobs if j.codec in DATA_PLANE), jobs[0])
        if victim.codec not in DATA_PLANE:         # a rank rejoins a data-plane codec's job
            victim.codec = "thc"
        victim.fault = "rank"
        victim.kill = (int(rng.integers(0, victim.workers)), int(rng.integers(1, victim.rounds - 1)))
    elif fault == "badkey":
        jobs[-1].fault = "badkey"
    else:
        for j in jobs:
            j.fault = fault
            if fault in ("stall", "ps_kill"):
                # long enough for the fault to land mid-job on a quiet host too (it waits for a
                # job to report two rounds; 6 rounds at 30 ms could end between two polls)
                j.rounds += 40
    return jobs


def run_job(job: Job, ps: PS, keys: Path, bad_keys: Path) -> None:
    """One `thc launch` against the PS; fills in how it ended."""
    t0 = time.monotonic()
    try:
        doc = run_launch(workers=job.workers, rounds=job.rounds, dim=job.dim, codec=job.codec, quorum=job.quorum,
                         ps=f"127.0.0.1:{ps.port}", job_name=job.name, seed=job.number,
                         keys=str(bad_keys if job.fault == "badkey" else keys), kill=job.kill,
                         restart=job.kill is not None, straggler_delay_ms=30.0, result_group="")
        job.ok = bool(doc["ok"]) and doc["exact_rounds"] == job.rounds
        job.exact_rounds, job.ps_job = doc["exact_rounds"], doc.get("ps_job")
        job.cause = "; ".join(doc["problems"])
    except Exception as exc:            # a launch that could not run: its cause, as it said it
        job.cause = f"{type(exc).__name__}: {exc}"
    job.seconds = time.monotonic() - t0
    classify(job)


def classify(job: Job) -> None:
    """Whether a job ended as it may: exact, or failed with its fault's named cause, or with a
    documented limit named in its message (`limit`)."""
    want = EXPECTED_CAUSE.get(job.fault)
    job.expected = job.ok if want is None or (job.fault == "ps_kill" and job.codec in DATA_PLANE) \
        else (job.ok or want in job.cause)
    job.limit = "" if job.ok else next((v for k, v in KNOWN_LIMITS.items() if k in job.cause), "")
    if job.limit and not job.expected:
        job.expected = True


def flood(ps: PS, keys: Path, stop: threading.Event, counts: dict, seed: int) -> None:
    """Junk at every door while the wave runs: datagrams at the data plane, random frames
    (with valid keys) at the control plane, malformed HTTP at the metrics port."""
    rng = np.random.default_rng(seed)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def req():
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = client_keys(keys)
        sock.connect(f"tcp://127.0.0.1:{ps.port + 1}")
        return sock

    ctl = req()
    try:
        while not stop.is_set() and counts["datagrams"] < 60_000:
            for _ in range(200):
                udp.sendto(junk_datagram(rng), ("127.0.0.1", ps.port))
            counts["datagrams"] += 200
            ctl.send(random_frame(rng))
            if ctl.poll(10_000):
                ctl.recv()
                counts["control_answered"] += 1
            else:                       # a REQ socket waits for its reply: a new one asks next
                ctl.close(0)
                ctl = req()
            counts["control_sent"] += 1
            with socket.create_connection(("127.0.0.1", ps.mport), timeout=5) as c:
                c.sendall(rng.bytes(int(rng.integers(1, 400))) + b"\r\n\r\n")
                c.settimeout(5)
                try:
                    c.recv(256)
                except OSError:
                    pass
            counts["http_junk"] += 1
            time.sleep(0.01)
    finally:
        udp.close()
        ctl.close(0)


def _running(ps: PS, keys: Path, names: set, threads: list, timeout: float = 120.0) -> bool:
    """Until a job of `names` reports two rounds done (a fault then lands mid-job)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        doc = fetch_status(ps.shard, keys, 2.0) or {}
        if any(j["job_name"] in names and min(j["progress"].values(), default=-1) >= 2 for j in doc.get("jobs", [])):
            return True
        time.sleep(0.1)
    return False


def run_wave(wave: int, jobs: list, fault: str, ps: PS, keys: Path, bad_keys: Path, seed: int) -> dict:
    """Start the wave's jobs together, inject its fault, wait for all; what the fault did."""
    threads = [threading.Thread(target=run_job, args=(j, ps, keys, bad_keys)) for j in jobs]
    for t in threads:
        t.start()
    did = {"fault": fault}
    if fault in ("stall", "ps_kill") and _running(ps, keys, {j.name for j in jobs}, threads):
        if fault == "stall":
            stop_s = ps.lease_s + 2.0
            os.kill(ps.proc.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(ps.proc.pid, signal.SIGCONT)
            did["stopped_s"] = stop_s
        else:
            ps.kill()
            time.sleep(1.0)
            ps.start()
            did["restarted"] = True
    stop, counts = threading.Event(), dict.fromkeys(("datagrams", "control_sent", "control_answered",
                                                     "http_junk"), 0)
    junk = None
    if fault == "flood":
        junk = threading.Thread(target=flood, args=(ps, keys, stop, counts, seed + wave))
        junk.start()
    for t in threads:
        t.join()
    stop.set()
    if junk is not None:
        junk.join(30)
        did.update(counts)
    return did


def slope_per_100(samples: list, key: str, warm: int) -> float:
    """The growth of `key` per 100 jobs within PS incarnations (a pooled least-squares slope
    with one intercept per incarnation), leaving out each incarnation's first `warm` waves."""
    by: dict = {}
    for s in samples:
        by.setdefault(s["incarnation"], []).append(s)
    sxy = sxx = 0.0
    for rows in by.values():
        rows = rows[warm:]
        if len(rows) < 2:
            continue
        x = np.array([r["jobs"] for r in rows], float)
        y = np.array([r[key] for r in rows], float)
        sxy += float(((x - x.mean()) * (y - y.mean())).sum())
        sxx += float(((x - x.mean()) ** 2).sum())
    return 100.0 * sxy / sxx if sxx else 0.0


def check_metrics(before: dict, after: dict, jobs: list, did: dict) -> list:
    """What the metrics must say after a wave that no PS restart cut: no job series left, and
    the totals moved by what the jobs report (rounds exactly; a stall by its length; a flood
    by the datagrams it sent, counted and dropped)."""
    problems = []
    done = {j.name for j in jobs if j.ok}      # a failed job may stay on the PS until its leases lapse
    left = sorted({dict(k[1]).get("job_name") for k in after if k[0].startswith("thc_job_")} & done)
    if left:
        problems.append(f"job series left after the wave: {left}")
    if did.get("restarted"):
        return problems
    delta = lambda name: total(after, name) - total(before, name)
    reached = [j for j in jobs if j.fault != "badkey"]
    failed = sum(not j.ok for j in reached)
    if delta("thc_ps_jobs_started_total") != len(reached) or \
            not len(reached) - failed <= delta("thc_ps_jobs_ended_total") <= len(reached):
        problems.append(f"jobs started/ended moved by {delta('thc_ps_jobs_started_total'):g}/"
                        f"{delta('thc_ps_jobs_ended_total'):g}, {len(reached)} jobs ran")
    reported = [j.ps_job for j in reached if j.ps_job]
    if failed:                          # a failed job's counters are not all in its report
        did["unchecked_rounds"] = True
    elif len(reported) == len(reached):
        rounds = sum(p["rounds_completed"] for p in reported)
        if delta("thc_ps_rounds_completed_total") != rounds:
            problems.append(f"rounds completed moved by {delta('thc_ps_rounds_completed_total'):g}, the jobs "
                            f"report {rounds}")
    elif did.get("stopped_s"):          # a job that ended during the stop asked a stopped PS (5 s)
        did["unreported"] = len(reached) - len(reported)
    else:
        problems.append(f"{len(reached) - len(reported)} jobs reported no PS counters")
    if did.get("stopped_s"):            # the stop, and any control step that kept the PS busy (a codec's import)
        did["excused_s"] = round(delta("thc_ps_stall_seconds_excused_total"), 2)
        if did["excused_s"] < did["stopped_s"] - 0.5:
            problems.append(f"a {did['stopped_s']:g} s stop excused only {did['excused_s']:.1f} s")
    if did.get("datagrams"):
        dropped = sum(total(after, "thc_ps_drops_total", reason=r) - total(before, "thc_ps_drops_total", reason=r)
                      for r in ("malformed", "wrong_version", "unknown_job", "unregistered", "slot_out_of_range",
                                "worker_out_of_range"))
        if not 0.5 * did["datagrams"] <= dropped <= did["datagrams"] + 1000:
            problems.append(f"{did['datagrams']} junk datagrams sent, {dropped:g} dropped as junk")
        did["dropped_as_junk"] = dropped
    return problems


def run(jobs: int = 500, seed: int = 53, lease_s: float = 5.0, max_minutes: float = 120.0, out: Path | None = None,
        min_wave: int = 3, max_wave: int = 6, warm: int = 2, faults: tuple = FAULTS, log=print) -> dict:
    """The soak; returns its summary (`ok` when every job ended as its fault allows, the
    metrics agreed after every wave, and descriptors and threads did not grow)."""
    rng = np.random.default_rng(seed)
    tmp = Path(tempfile.mkdtemp(prefix="thc-soak-"))
    keys, bad_keys = create_keys(tmp / "keys"), create_keys(tmp / "other-keys")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    ps = PS(keys, lease_s, (out or tmp) / "ps.log")
    ps.start()
    all_jobs, samples, waves, problems = [], [], [], []
    t0 = time.monotonic()
    try:
        wave = 0
        while len(all_jobs) < jobs and time.monotonic() - t0 < 60 * max_minutes:
            fault = faults[wave % len(faults)]
            count = min(int(rng.integers(min_wave, max_wave + 1)), jobs - len(all_jobs))
            batch = make_jobs(rng, wave, len(all_jobs) + 1, max(count, 1), fault)
            before = ps.metrics()
            did = run_wave(wave, batch, fault, ps, keys, bad_keys, seed)
            time.sleep(0.5)             # the last leave reaches the PS; the junk's connections close
            all_jobs += batch
            # at rest, before the scrape (whose request has a thread of its own meanwhile)
            samples.append({"wave": wave, "jobs": len(all_jobs), "incarnation": ps.incarnation, **ps.resources()})
            after = ps.metrics()
            wrong = check_metrics(before, after, batch, did)
            health = ps.healthz()
            if health != (200, "ok"):
                wrong.append(f"/healthz said {health}")
            unexpected = [j for j in batch if not j.expected]
            problems += [f"wave {wave}: {w}" for w in wrong]
            problems += [f"job {j.number} ({j.codec}, fault {j.fault}): {j.cause or 'not exact'}" for j in unexpected]
            waves.append({**did, "wave": wave, "jobs": [j.number for j in batch], "metrics_problems": wrong})
            log(f"wave {wave:3d} {fault:8s} jobs {batch[0].number}-{batch[-1].number}: "
                + ", ".join(f"{j.codec}/{j.workers}{'' if j.ok else ' FAILED' if not j.expected else ' failed (' + j.fault + ')'}"
                            for j in batch)
                + f"; rss {samples[-1]['rss_kb'] / 1024:.1f} MB, fds {samples[-1]['fds']}, threads "
                  f"{samples[-1]['threads']}" + (f"; METRICS: {wrong}" if wrong else ""))
            wave += 1
    finally:
        ps.stop()
    summary = summarize(all_jobs, samples, waves, problems, time.monotonic() - t0, warm)
    summary["command"] = " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("soak.py") else None
    if out is not None:
        (out / "soak.json").write_text(json.dumps({"summary": summary, "jobs": [asdict(j) for j in all_jobs],
                                                    "samples": samples, "waves": waves}, indent=1, default=str))
    return summary


def summarize(jobs: list, samples: list, waves: list, problems: list, seconds: float, warm: int) -> dict:
    slopes = {k: slope_per_100(samples, k, warm) for k in ("rss_kb", "fds", "threads")}
    by_inc: dict = {}
    for s in samples:
        by_inc.setdefault(s["incarnation"], []).append(s)
    spread = {k: max((max(r[k] for r in rows[warm:]) - min(r[k] for r in rows[warm:])
                      for rows in by_inc.values() if len(rows) > warm), default=0) for k in ("fds", "threads")}
    faults = {}
    for j in jobs:
        if j.fault != "-":
            f = faults.setdefault(j.fault, {"jobs": 0, "exact": 0, "failed_as_expected": 0, "failed_at_a_limit": 0,
                                            "unexpected": 0})
            f["jobs"] += 1
            f["exact" if j.ok else "failed_as_expected" if j.expected and not j.limit else
              "failed_at_a_limit" if j.limit else "unexpected"] += 1
    flat = spread["fds"] <= 2 and spread["threads"] <= 1
    if not flat:
        problems = problems + [f"descriptors or threads grew within an incarnation: {spread}"]
    limits: dict = {}
    for j in jobs:
        if j.limit:
            limits[j.limit] = limits.get(j.limit, 0) + 1
    return {"ok": not problems, "problems": problems, "jobs": len(jobs), "waves": len(waves),
            "failed_at_a_limit": limits,
            "seconds": round(seconds, 1), "exact": sum(j.ok for j in jobs),
            "failed_as_expected": sum(j.expected and not j.ok and not j.limit for j in jobs),
            "unexpected": sum(not j.expected for j in jobs),
            "rounds": sum(j.rounds for j in jobs if j.ok), "codecs": sorted({j.codec for j in jobs}),
            "faults": faults, "ps_incarnations": max((s["incarnation"] for s in samples), default=0),
            "slopes_per_100_jobs": {k: round(v, 2) for k, v in slopes.items()},
            "spread_within_incarnation": spread,
            "first": samples[0] if samples else None, "last": samples[-1] if samples else None,
            "junk_datagrams": sum(w.get("datagrams", 0) for w in waves),
            "stopped_s": sum(w.get("stopped_s", 0) for w in waves)}


def resummarize(doc: dict, warm: int = 2) -> dict:
    """A run's summary from its soak.json: the jobs classified again (`classify`), the wave
    and resource checks as they were recorded."""
    fields = {f for f in Job.__dataclass_fields__}
    jobs = [Job(**{k: v for k, v in j.items() if k in fields}) for j in doc["jobs"]]
    for j in jobs:
        classify(j)
    problems = [f"wave {w['wave']}: {p}" for w in doc["waves"] for p in w["metrics_problems"]]
    problems += [f"job {j.number} ({j.codec}, fault {j.fault}): {j.cause or 'not exact'}" for j in jobs if not j.expected]
    summary = summarize(jobs, doc["samples"], doc["waves"], problems, doc["summary"]["seconds"], warm)
    summary["command"] = doc["summary"].get("command")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--lease-s", type=float, default=5.0, help="the PS's lease (a stop lasts it + 2 s)")
    ap.add_argument("--max-minutes", type=float, default=120.0, help="start no wave after this long")
    ap.add_argument("--out", type=Path, default=None, help="directory for soak.json and the PS's log")
    ap.add_argument("--faults", default=",".join(FAULTS), help="the waves' faults, in turn (rank, flood, stall, "
                                                               "badkey, ps_kill, - for none)")
    ap.add_argument("--wave", default="3,6", help="jobs per wave: least,most")
    ap.add_argument("--summarize", type=Path, default=None, metavar="SOAK_JSON",
                    help="print the summary of a run's soak.json again, under today's rules, and exit")
    args = ap.parse_args(argv)
    if args.summarize is not None:
        summary = resummarize(json.loads(args.summarize.read_text()))
        print(json.dumps(summary, indent=1))
        return 0 if summary["ok"] else 1
    lo, hi = (int(v) for v in args.wave.split(","))
    summary = run(args.jobs, args.seed, args.lease_s, args.max_minutes, args.out, lo, hi,
                  faults=tuple(f.strip() for f in args.faults.split(",")))
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
