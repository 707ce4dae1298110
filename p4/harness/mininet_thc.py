"""Mininet end-to-end: one bmv2 switch aggregates, N hosts run real `thc worker`s.

Runs under Debian's python3 (Mininet 2.3.0 lives there), inside a network namespace and a
PID namespace that the caller (deploy/mininet_run.py, `thc p4 mininet`) created, so nothing
outlives it.  From the project it imports only worker/policies.py (standard library):
the tool paths, the switch's table entries (a commands file) and the loss rules (an
nftables ruleset) come from the venv side, and the workers are started with the venv's python.

    ip netns exec NS unshare --pid --fork --kill-child --mount-proc /usr/bin/python3 \
        p4/harness/mininet_thc.py --json thc.json --commands cmds.txt \
        --simple-switch PATH --simple-switch-cli PATH --python /repo/.venv/bin/python \
        --repo /repo --out DIR

Control plane, `--control-mode`:
  static  the commands file programs the whole job; a control-plane host answers the
          workers' registrations (p4/harness/static_control.py);
  p4run   the commands file holds only L2 entries; `thc p4 run --attach` on a host in the
          switch's namespace (so it reaches the Thrift port) programs each job when its first
          worker registers, and each worker's entries when that worker registers — the path a
          user runs.  `--jobs J` runs J jobs at once (p4run only): job j's rank i on host
          j·N + i, named `job<j+1>`.

Switch control plane, `--switch-control`:
  thrift     `simple_switch` with its Thrift server; the commands file goes to
             `simple_switch_CLI`, and so do the counter reads;
  p4runtime  (p4run only) `simple_switch_grpc --no-p4` with its P4Runtime server on
             127.0.0.1:9559; `thc p4 run --attach --switch-control p4runtime` loads the program
             and writes the L2 entries (`--l2`), and `python -m thc_ps.p4.p4runtime counters` reads
             the counters in the CLI's format.

Loss (`--loss-rules FILE`): the ruleset is loaded with `nft -f` in every worker host's
namespace (real kernel drops on the host links); stragglers: `--straggler-delay-ms` for
`--straggler-rank` (or every worker when it is -1).  The last stdout line is one JSON
object: the workers' exit status and output, the switch CLI's counter output, the control
plane's output and each worker host's nftables counters.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mininet.log import setLogLevel
from mininet.net import Mininet
from mininet.node import Switch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout: runs outside the venv
from thc_ps.worker.policies import POLICIES  # noqa: E402

PS_IP, PS_MAC, PS_PORT = "10.0.0.254", "00:00:00:00:00:fe", 9000
CTRL_IP, CTRL_MAC, CTRL_PORT = "10.0.0.100", "00:00:00:00:00:64", 9001
THRIFT_PORT = 9090
GRPC_ADDR = "127.0.0.1:9559"


class Bmv2Switch(Switch):
    """A Mininet switch that is simple_switch on its interfaces (no controller, no OVS)."""

    def __init__(self, name, json_path=None, thrift_port=THRIFT_PORT, simple_switch="simple_switch", ipc=None,
                 grpc=False, **kw):
        Switch.__init__(self, name, **kw)
        self.json_path, self.thrift_port, self.binary = json_path, thrift_port, simple_switch
        self.proc = None
        self.ipc, self.grpc = ipc, grpc

    def start(self, controllers):
        args = [self.binary, "--thrift-port", str(self.thrift_port), "--device-id", "0",
                "--notifications-addr", f"ipc://{self.ipc}"]       # not /tmp/bmv2-0-...: shared by all runs
        for port, intf in self.intfs.items():
            if intf.name != "lo":
                args += ["-i", f"{port}@{intf.name}"]
                subprocess.run(["ethtool", "-K", intf.name, "tx", "off", "rx", "off"], capture_output=True)
        # simple_switch_grpc: no program until the P4Runtime control plane loads it
        args += ["--no-p4", "--", "--grpc-server-addr", GRPC_ADDR] if self.grpc else [self.json_path]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, deleteIntfs=True):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        Switch.stop(self, deleteIntfs)


def cli(binary, commands, check=True):
    out = subprocess.run([binary, "--thrift-port", str(THRIFT_PORT)], input="\n".join(commands) + "\n",
                         capture_output=True, text=True, timeout=120)
    if check and ("Error" in out.stdout or "Invalid" in out.stdout):
        raise RuntimeError("switch CLI: " + "; ".join(l for l in out.stdout.splitlines() if "Error" in l)[:500])
    return out.stdout


def wait_for_grpc(tries=75):
    import socket
    host, port = GRPC_ADDR.rsplit(":", 1)
    for _ in range(tries):
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"simple_switch_grpc did not answer on {GRPC_ADDR} within {tries * 0.2:.0f} s")


def wait_for_switch(binary, tries=75):
    for _ in range(tries):
        try:
            if "thc_config" in cli(binary, ["show_tables"], check=False):
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"simple_switch did not answer on Thrift port {THRIFT_PORT} within {tries * 0.2:.0f} s")


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--commands", required=True, help="switch CLI commands (job, workers, l2)")
    ap.add_argument("--simple-switch", required=True)
    ap.add_argument("--simple-switch-cli", required=True)
    ap.add_argument("--python", required=True, help="the venv python that runs thc")
    ap.add_argument("--repo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--quorum", type=float, default=1.0)
    ap.add_argument("--granularity", type=int, default=30)
    ap.add_argument("--p", default="1/32")
    ap.add_argument("--loss-policy", choices=POLICIES, default=POLICIES[0])
    ap.add_argument("--loss-rules", default=None, help="nftables ruleset loaded in every worker host")
    ap.add_argument("--straggler-delay-ms", type=float, default=0.0)
    ap.add_argument("--straggler-rank", type=int, default=-1, help="-1: every worker")
    ap.add_argument("--timeout-ms", type=float, default=200.0)
    ap.add_argument("--fixed-timeout", action="store_true", help="the workers' fixed-timeout rule")
    ap.add_argument("--nonce", type=int, default=0, help="static mode: the job nonce programmed")
    ap.add_argument("--tokens", default="", help="static mode: worker tokens programmed, in rank order")
    ap.add_argument("--events", type=int, default=13, help="event counters to read per block")
    ap.add_argument("--event-cells", type=int, default=16, help="counter cells per block")
    ap.add_argument("--jobs", type=int, default=1, help="jobs at once (p4run): --workers hosts each")
    ap.add_argument("--worker-timeout-s", type=float, default=600.0)
    ap.add_argument("--lease-s", type=float, required=True,
                    help="the control plane's lease of a rank (mininet_run passes SWITCH_LEASE_S)")
    ap.add_argument("--control-mode", choices=("static", "p4run"), default="static")
    ap.add_argument("--switch-control", choices=("thrift", "p4runtime"), default="thrift")
    ap.add_argument("--p4info", default="", help="the program's P4Info (p4runtime: the counter reads)")
    args = ap.parse_args()
    grpc = args.switch_control == "p4runtime"
    signal.signal(signal.SIGTERM, _terminate)
    setLogLevel("warning")
    net = Mininet(topo=None, controller=None, autoSetMacs=False, build=False)
    sw = net.addSwitch("s1", cls=Bmv2Switch, json_path=args.json, simple_switch=args.simple_switch, dpid="1",
                      ipc=os.path.join(args.out, "bmv2-notifications.ipc"), grpc=grpc)
    hosts = []
    total = args.jobs * args.workers
    for i in range(total):
        h = net.addHost(f"h{i + 1}", ip=f"10.0.0.{i + 1}/24", mac=f"00:00:00:00:00:{i + 1:02x}")
        net.addLink(h, sw, port2=i + 1)
        hosts.append(h)
    ctrl = net.addHost("h0", ip=f"{CTRL_IP}/24", mac=CTRL_MAC, inNamespace=args.control_mode == "static")
    net.addLink(ctrl, sw, port2=total + 1)
    procs = []
    try:
        net.build()
        net.start()
        for h in hosts + [ctrl]:
            h.cmd("sysctl -q -w net.ipv6.conf.all.disable_ipv6=1")
            h.cmd(f"ethtool -K {h.defaultIntf().name} tx off rx off")
        net.staticArp()
        for h in hosts:
            h.setARP(PS_IP, PS_MAC)
            if args.loss_rules:
                out = h.cmd(f"nft -f {args.loss_rules} && echo nft-ok")
                if "nft-ok" not in out:
                    raise RuntimeError(f"nft -f failed in {h.name}: {out.strip()[-300:]}")
        env = dict(os.environ, PYTHONPATH=args.repo, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env["PATH"] = os.path.dirname(args.simple_switch_cli) + os.pathsep + env.get("PATH", "")
        if grpc:
            wait_for_grpc()
        else:
            wait_for_switch(args.simple_switch_cli)
            with open(args.commands) as f:
                cli(args.simple_switch_cli, [l.strip() for l in f if l.strip()])
        job = ["--quorum", str(args.quorum), "--granularity", str(args.granularity), "--p", args.p]
        if args.control_mode == "static":
            tokens = args.tokens.split(",") if args.tokens else ["0"] * args.workers
            expect = sum((["--expect", f"10.0.0.{i + 1}:{5000 + i}:{tokens[i]}"] for i in range(args.workers)), [])
            cmd = [args.python, "-m", "thc_ps.p4.harness.static_control", "--bind", f"{CTRL_IP}:{CTRL_PORT}",
                   "--workers", str(args.workers), "--nonce", str(args.nonce),
                   "--lease-s", str(args.lease_s)] + job + expect
        else:
            attach = sum((["--worker-port", f"10.0.0.{i + 1}={i + 1},00:00:00:00:00:{i + 1:02x}"]
                          for i in range(total)), [])
            cmd = [args.python, "-m", "thc_ps.deploy.cli", "p4", "run", "--attach", "--thrift-port", str(THRIFT_PORT),
                   "--control", f"{CTRL_IP}:{CTRL_PORT}", "--workers", str(args.workers),
                   "--ps-ip", PS_IP, "--ps-mac", PS_MAC, "--switch-control", args.switch_control,
                   "--lease-s", str(args.lease_s)] + job + attach
            if grpc:        # the program and the L2 entries (workers and this host) come from the control plane
                cmd += ["--grpc-port", GRPC_ADDR.rsplit(":", 1)[1], "--out", os.path.dirname(args.json)]
                cmd += sum((["--l2", f"00:00:00:00:00:{i + 1:02x}={i + 1}"] for i in range(total)), [])
                cmd += ["--l2", f"{CTRL_MAC}={total + 1}"]
        control = ctrl.popen(cmd, cwd=args.repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(control)
        time.sleep(2.0)
        for k, h in enumerate(hosts):
            i = k % args.workers                 # rank i of job k // workers
            delay = args.straggler_delay_ms if args.straggler_rank in (-1, i) else 0.0
            report = os.path.join(args.out, f"worker{k}.json")
            name = ["--job", f"job{k // args.workers + 1}"] if args.jobs > 1 else []
            procs.append(h.popen([args.python, "-m", "thc_ps.deploy.cli", "worker", "--ps", f"{PS_IP}:{PS_PORT}",
                                  "--control-host", CTRL_IP, "--control-port", str(CTRL_PORT), *name,
                                  "--rank", str(i), "--rounds", str(args.rounds), "--dim", str(args.dim),
                                  "--bind-port", str(5000 + k), "--timeout-ms", str(args.timeout_ms),
                                  "--loss-policy", args.loss_policy, "--straggler-delay-ms", str(delay),
                                  "--report", report, *(["--fixed-timeout"] if args.fixed_timeout else [])],
                                 cwd=args.repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        results = []
        deadline = time.monotonic() + args.worker_timeout_s
        for k, p in enumerate(procs[1:]):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                late = False
            except subprocess.TimeoutExpired:       # stop it, keep what it said
                p.kill()
                out, err = p.communicate()
                late = True
            results.append({"rank": k % args.workers, "job": k // args.workers, "rc": p.returncode,
                            "timed_out": late, "stdout": out.decode()[-2000:], "stderr": err.decode()[-2000:]})
        # block 0 (no job's) and the job cells 1..J (a job's counters outlive it until its
        # cell's next job)
        if grpc:
            counters = subprocess.run([args.python, "-m", "thc_ps.p4.p4runtime", "--address", GRPC_ADDR, "--p4info",
                                       args.p4info, "--blocks", str(args.jobs + 1)], cwd=args.repo, env=env,
                                      capture_output=True, text=True, timeout=60).stdout
        else:
            counters = cli(args.simple_switch_cli, [f"counter_read ThcIngress.events {b * args.event_cells + e}"
                                                    for b in range(args.jobs + 1) for e in range(args.events)])
        nft = [h.cmd("nft list table inet thcloss") if args.loss_rules else "" for h in hosts]
        control.send_signal(signal.SIGINT)
        try:
            control_out = control.communicate(timeout=20)[0].decode()[-3000:]
        except subprocess.TimeoutExpired:
            control.kill()
            control_out = control.communicate()[0].decode()[-3000:]
        print(json.dumps({"workers": results, "counters": counters, "control": control_out, "nft": nft}))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        net.stop()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; Mininet stopped", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:     # one line for the caller; Mininet is already stopped
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
