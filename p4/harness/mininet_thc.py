"""Mininet end-to-end: one bmv2 switch aggregates, four hosts run real `thc worker`s.

Runs under Debian's python3 (Mininet 2.3.0 lives there), inside a network namespace the
caller created, so nothing is left behind in the machine's own namespace.  It imports
nothing from the project: the switch's table entries come precomputed in a commands file
(from the venv side), and the workers are started with the venv's python.

    ip netns exec NS /usr/bin/python3 p4/harness/mininet_thc.py --json thc.json \
        --commands cmds.txt --python /repo/.venv/bin/python --repo /repo --out DIR

Control plane, `--control-mode`:
  static  the commands file programs the whole job; a control-plane host answers the
          workers' registrations (p4/harness/static_control.py);
  p4run   the commands file holds only L2 entries; `thc p4 run --attach` on a host in the
          switch's namespace (so it reaches the Thrift port) programs the job, and each
          worker's entries when that worker registers — the path a user runs.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from mininet.net import Mininet
from mininet.node import Switch
from mininet.log import setLogLevel

PS_IP, PS_MAC, PS_PORT = "10.0.0.254", "00:00:00:00:00:fe", 9000
CTRL_IP, CTRL_PORT = "10.0.0.100", 9001


class Bmv2Switch(Switch):
    """A Mininet switch that is simple_switch on its interfaces (no controller, no OVS)."""

    def __init__(self, name, json_path=None, thrift_port=9090, simple_switch="simple_switch", **kw):
        Switch.__init__(self, name, **kw)
        self.json_path, self.thrift_port, self.binary = json_path, thrift_port, simple_switch
        self.proc = None

    def start(self, controllers):
        args = [self.binary, "--thrift-port", str(self.thrift_port), "--device-id", "0"]
        for port, intf in self.intfs.items():
            if intf.name != "lo":
                args += ["-i", f"{port}@{intf.name}"]
                subprocess.run(["ethtool", "-K", intf.name, "tx", "off", "rx", "off"], capture_output=True)
        args.append(self.json_path)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, deleteIntfs=True):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
        Switch.stop(self, deleteIntfs)


def cli(binary, thrift_port, commands):
    out = subprocess.run([binary, "--thrift-port", str(thrift_port)], input="\n".join(commands) + "\n",
                         capture_output=True, text=True, timeout=120)
    if "Error" in out.stdout or "Invalid" in out.stdout:
        raise RuntimeError("switch CLI: " + "; ".join(l for l in out.stdout.splitlines() if "Error" in l)[:500])
    return out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--commands", required=True, help="switch CLI commands (job, workers, l2)")
    ap.add_argument("--python", required=True, help="the venv python that runs thc")
    ap.add_argument("--repo", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tools", default="/opt/p4tools/bin")
    ap.add_argument("--control-mode", choices=("static", "p4run"), default="static")
    args = ap.parse_args()
    setLogLevel("warning")
    ss = shutil.which("simple_switch") or os.path.join(args.tools, "simple_switch")
    sscli = shutil.which("simple_switch_CLI") or os.path.join(args.tools, "simple_switch_CLI")
    net = Mininet(topo=None, controller=None, autoSetMacs=False, build=False)
    sw = net.addSwitch("s1", cls=Bmv2Switch, json_path=args.json, simple_switch=ss, dpid="1")
    hosts = []
    for i in range(args.workers):
        h = net.addHost(f"h{i + 1}", ip=f"10.0.0.{i + 1}/24", mac=f"00:00:00:00:00:{i + 1:02x}")
        net.addLink(h, sw, port2=i + 1)
        hosts.append(h)
    ctrl = net.addHost("h0", ip=f"{CTRL_IP}/24", mac="00:00:00:00:00:64",
                       inNamespace=args.control_mode == "static")
    net.addLink(ctrl, sw, port2=args.workers + 1)
    net.build()
    net.start()
    procs = []
    try:
        for h in hosts + [ctrl]:
            h.cmd("sysctl -q -w net.ipv6.conf.all.disable_ipv6=1")
            h.cmd(f"ethtool -K {h.defaultIntf().name} tx off rx off")
        net.staticArp()
        for h in hosts:
            h.setARP(PS_IP, PS_MAC)
        for _ in range(50):
            try:
                if "thc_config" in cli(sscli, 9090, ["show_tables"]):
                    break
            except Exception:
                pass
            time.sleep(0.2)
        with open(args.commands) as f:
            cli(sscli, 9090, [l.strip() for l in f if l.strip()])
        env = dict(os.environ, PYTHONPATH=args.repo, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        if args.control_mode == "static":
            expect = sum((["--expect", f"10.0.0.{i + 1}:{5000 + i}"] for i in range(args.workers)), [])
            cmd = [args.python, "-m", "p4.harness.static_control", "--bind", f"{CTRL_IP}:{CTRL_PORT}",
                   "--workers", str(args.workers)] + expect
        else:
            attach = sum((["--worker-port", f"10.0.0.{i + 1}={i + 1},00:00:00:00:00:{i + 1:02x}"]
                          for i in range(args.workers)), [])
            cmd = [args.python, "-m", "deploy.cli", "p4", "run", "--attach", "--thrift-port", "9090",
                   "--control", f"{CTRL_IP}:{CTRL_PORT}", "--workers", str(args.workers),
                   "--ps-ip", PS_IP, "--ps-mac", PS_MAC] + attach
        env["PATH"] = args.tools + os.pathsep + env.get("PATH", "")
        control = ctrl.popen(cmd, cwd=args.repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(control)
        time.sleep(2.0)
        for i, h in enumerate(hosts):
            report = os.path.join(args.out, f"worker{i}.json")
            procs.append(h.popen([args.python, "-m", "deploy.cli", "worker", "--ps", f"{PS_IP}:{PS_PORT}",
                                  "--control-host", CTRL_IP, "--control-port", str(CTRL_PORT),
                                  "--rank", str(i), "--rounds", str(args.rounds), "--dim", str(args.dim),
                                  "--bind-port", str(5000 + i), "--timeout-ms", "200", "--report", report],
                                 cwd=args.repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        results = []
        for i, p in enumerate(procs[1:]):
            out, err = p.communicate(timeout=600)
            results.append({"rank": i, "rc": p.returncode, "stdout": out.decode()[-2000:],
                            "stderr": err.decode()[-2000:]})
        counters = cli(sscli, 9090, [f"counter_read ThcIngress.events {k}" for k in range(12)])
        control.send_signal(signal.SIGINT)
        try:
            control_out = control.communicate(timeout=20)[0].decode()[-3000:]
        except subprocess.TimeoutExpired:
            control.kill()
            control_out = control.communicate()[0].decode()[-3000:]
        print(json.dumps({"workers": results, "counters": counters, "control": control_out}))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        net.stop()


if __name__ == "__main__":
    sys.exit(main())
