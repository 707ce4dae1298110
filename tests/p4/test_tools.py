"""p4/tools.py and `thc p4 doctor` with fake tool directories (no p4lang tools needed), and
the Makefile's installation of the Debian test packages with a fake apt-get."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from thc_ps.deploy import cli
from thc_ps.p4 import tools

ROOT = Path(__file__).resolve().parents[2]


def _tool(d: Path, name: str, body: str, mode: int = 0o755) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(mode)
    return p


def fake_tools(d: Path, *, ss_version=None, p4c_version=None, cli_ok=True, skip=()) -> Path:
    """simple_switch, simple_switch_CLI, p4c-bm2-ss that answer --version/--help like p4lang's."""
    ss_version = ss_version or tools.TESTED["simple_switch"]
    p4c_version = p4c_version or tools.TESTED["p4c-bm2-ss"]
    if "simple_switch" not in skip:
        _tool(d, "simple_switch", f'[ "$1" = --version ] && echo "{ss_version}-abcdef" && exit 0; exit 3')
    if "simple_switch_CLI" not in skip:
        _tool(d, "simple_switch_CLI", 'echo "usage: simple_switch_CLI [--thrift-port THRIFT_PORT]"' if cli_ok else
              'echo "Traceback (most recent call last):" >&2\n'
              'echo "ModuleNotFoundError: No module named \'runtime_CLI\'" >&2; exit 1')
    if "p4c-bm2-ss" not in skip:
        _tool(d, "p4c-bm2-ss", f'echo p4c-bm2-ss; echo "Version {p4c_version} (SHA: 0000)"')
    return d


def path_without_p4_tools(first: Path) -> str:
    """`first`, then the directories of $PATH that hold none of the P4 tools: a test's fake
    tools are then the only ones found, however the real ones were installed (on PATH, in
    /opt/p4tools/bin or under $THC_P4_TOOLS)."""
    names = [s.name for s in tools.SPECS] + ["simple_switch_grpc"]
    keep = [p for p in os.environ["PATH"].split(os.pathsep)
            if p and not any((Path(p) / n).exists() for n in names)]
    return os.pathsep.join([str(first), *keep])


def where(d: Path) -> dict:
    """Search only `d` (as PATH): no /opt/p4tools/bin, no $THC_P4_TOOLS."""
    return {"path": str(d), "system_dir": None, "env": {}}


def test_search_order_path_then_system_dir_then_env(tmp_path):
    a, b, c = tmp_path / "path", tmp_path / "opt", tmp_path / "env"
    for d in (a, b, c):
        _tool(d, "simple_switch", "true")
    env = {"THC_P4_TOOLS": str(c)}
    assert tools.find_tool("simple_switch", path=str(a), system_dir=str(b), env=env) == str(a / "simple_switch")
    assert tools.find_tool("simple_switch", path="", system_dir=str(b), env=env) == str(b / "simple_switch")
    assert tools.find_tool("simple_switch", path="", system_dir=str(tmp_path / "none"), env=env) == \
        str(c / "simple_switch")
    assert tools.find_tool("simple_switch", path="", system_dir=None, env={}) is None


def test_non_executable_is_not_a_tool(tmp_path):
    _tool(tmp_path, "p4c-bm2-ss", "true", mode=0o644)
    assert tools.find_tool("p4c-bm2-ss", **where(tmp_path)) is None
    assert tools.missing_tools("p4c-bm2-ss", "simple_switch", **where(tmp_path)) == ["p4c-bm2-ss", "simple_switch"]


def test_require_names_where_a_missing_tool_comes_from(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        tools.require("p4c-bm2-ss", **where(tmp_path))
    assert "p4lang's p4c" in str(exc.value) and "THC_P4_TOOLS" in str(exc.value)
    with pytest.raises(FileNotFoundError, match="behavioral-model"):
        tools.require("simple_switch_CLI", **where(tmp_path))


def by_name(report):
    return {t.name: t for t in report["tools"]}


def test_doctor_complete_with_tested_versions(tmp_path):
    d = fake_tools(tmp_path)
    report = tools.doctor(**where(d))
    t = by_name(report)
    assert report["bmv2_complete"]
    for name in tools.BMV2_HALF:
        assert t[name].status == "ok" and t[name].path == str(d / name)
    assert t["simple_switch"].version == tools.TESTED["simple_switch"]
    assert t["p4c-bm2-ss"].version == tools.TESTED["p4c-bm2-ss"]
    assert t["p4c-barefoot"].status == "missing" and t["p4c-barefoot"].optional
    text = tools.doctor_text(report).splitlines()
    assert len(text) == len(tools.SPECS) + 2            # one line per tool, the verdict, P4Runtime
    assert text[0].startswith("simple_switch ") and str(d / "simple_switch") in text[0]
    assert "tests ran with this version" in text[0]
    assert "optional" in text[3] and "p4c#readme" in text[3]
    assert "complete" in text[-2] and "incomplete" not in text[-2]
    assert t["simple_switch_grpc"].status == "missing" and t["simple_switch_grpc"].optional
    assert text[-1].startswith("P4Runtime control plane: unavailable (simple_switch_grpc is missing")


def test_doctor_reports_simple_switch_grpc_and_the_p4runtime_control_plane(tmp_path):
    """simple_switch_grpc is optional: found, it makes the P4Runtime control plane ready (the
    client library is this venv's); missing, the bmv2 half is still complete."""
    from thc_ps.p4.p4runtime import client_problem
    d = fake_tools(tmp_path)
    _tool(d, "simple_switch_grpc", f'[ "$1" = --version ] && echo "{tools.TESTED["simple_switch"]}-abc" && exit 0; exit 3')
    report = tools.doctor(**where(d))
    grpc = by_name(report)["simple_switch_grpc"]
    assert grpc.status == "ok" and grpc.path == str(d / "simple_switch_grpc") and report["bmv2_complete"]
    assert report["p4runtime"] == client_problem()
    doc = tools.doctor_json(report)
    assert doc["p4runtime_ready"] is (client_problem() == "")
    line = tools.doctor_text(report).splitlines()[-1]
    assert line == ("P4Runtime control plane: ready (the default of `thc p4`)" if not client_problem()
                    else f"P4Runtime control plane: unavailable ({client_problem()}); `thc p4` uses Thrift")


def test_doctor_reports_an_untested_version_but_stays_complete(tmp_path):
    report = tools.doctor(**where(fake_tools(tmp_path, ss_version="1.11.0", p4c_version="1.2.3.0")))
    t = by_name(report)
    assert report["bmv2_complete"]
    assert (t["simple_switch"].status, t["simple_switch"].version) == ("untested-version", "1.11.0")
    assert t["p4c-bm2-ss"].status == "untested-version"
    assert f"tests ran with {tools.TESTED['p4c-bm2-ss']}" in t["p4c-bm2-ss"].line()


def test_doctor_cli_whose_python_modules_do_not_import_is_broken(tmp_path):
    report = tools.doctor(**where(fake_tools(tmp_path, cli_ok=False)))
    t = by_name(report)["simple_switch_CLI"]
    assert not report["bmv2_complete"]
    assert t.status == "broken" and "runtime_CLI" in t.line()


def test_doctor_missing_compiler_names_its_source(tmp_path):
    report = tools.doctor(**where(fake_tools(tmp_path, skip=("p4c-bm2-ss",))))
    line = by_name(report)["p4c-bm2-ss"].line()
    assert not report["bmv2_complete"]
    assert "missing" in line and "https://github.com/p4lang/p4c#readme" in line
    assert "p4c-bm2-ss" in tools.doctor_text(report).splitlines()[-2]


def test_doctor_bfas_takes_the_version_of_its_compiler(tmp_path):
    """bfas has no --version: it is found by its usage line and reports p4c-barefoot's
    version; an assembler without a usage line is broken."""
    d, version = fake_tools(tmp_path), tools.TESTED["p4c-barefoot"]
    _tool(d, "p4c-barefoot", f'echo "Version {version}"')
    _tool(d, "bfas", 'echo "No assembly file specified"; echo "usage: bfas [-l:Mo:gqtvh] file..."; exit 0')
    got = by_name(tools.doctor(**where(d)))
    assert got["bfas"].status == "ok" and got["bfas"].version == tools.TESTED["bfas"]
    _tool(d, "bfas", 'echo "Segmentation fault" >&2; exit 139')
    assert by_name(tools.doctor(**where(d)))["bfas"].status == "broken"


def test_doctor_debian_tools_name_their_packages(tmp_path):
    report = tools.doctor(python=str(tmp_path / "no-python3"), **where(tmp_path))
    assert by_name(report)["mininet"].status == "missing"
    assert "Debian package mininet" in by_name(report)["mininet"].line()
    specs = {s.name: s for s in tools.SPECS}
    for name, pkg in (("nft", "nftables"), ("ethtool", "ethtool"), ("ip", "iproute2")):
        assert f"Debian package {pkg}" in tools._status(specs[name], None, None).line()


def exit_code(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("complete", [True, False])
def test_thc_p4_doctor_exit_status_and_json(tmp_path, monkeypatch, capsys, complete):
    d = fake_tools(tmp_path, skip=() if complete else ("simple_switch",))
    monkeypatch.setenv("PATH", path_without_p4_tools(d) if complete else str(d))
    monkeypatch.setattr(tools, "SYSTEM_DIR", str(tmp_path / "no-such-dir"))
    monkeypatch.delenv("THC_P4_TOOLS", raising=False)
    assert exit_code(["p4", "doctor"]) == (0 if complete else 1)
    text = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in text[:len(tools.SPECS)]] == [s.name for s in tools.SPECS]
    assert text[-1].startswith("P4Runtime control plane: ")
    assert exit_code(["p4", "doctor", "--json"]) == (0 if complete else 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["bmv2_complete"] is complete
    ss = next(t for t in doc["tools"] if t["name"] == "simple_switch")
    assert ss["usable"] is complete and (ss["path"] == str(d / "simple_switch")) is complete


# ---------------------------------------------------------------- Makefile: Debian test packages

def make_test_deps(tmp_path, installed, uid="0", stale_lists=True):
    """`make test-deps` with fake dpkg-query/apt-get/id; returns (make result, apt-get calls)."""
    fake = tmp_path / "bin"
    log = tmp_path / "apt.log"
    _tool(fake, "id", f'echo {uid}')
    _tool(fake, "dpkg-query", 'for p in ' + " ".join(installed) +
          '; do [ "$p" = "$3" ] && { printf "install ok installed"; exit 0; }; done; exit 1')
    _tool(fake, "apt-get", f'echo "$*" >> {log}\n'
          + (f'[ "$1" = install ] && ! grep -q "^update" {log} && exit 100\n' if stale_lists else "")
          + 'exit 0')
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "test-deps"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def test_make_installs_missing_debian_packages_without_recommends(tmp_path):
    proc, calls = make_test_deps(tmp_path, installed=("mininet", "iproute2"))
    assert proc.returncode == 0, proc.stderr
    install = "install -y -q --no-install-recommends nftables ethtool"
    assert calls == [install, "update -q", install]      # apt-get update only after a failure


def test_make_installs_nothing_when_everything_is_there(tmp_path):
    proc, calls = make_test_deps(tmp_path, installed=("mininet", "nftables", "ethtool", "iproute2"))
    assert proc.returncode == 0 and calls == [] and proc.stdout.strip() == ""


def test_make_as_non_root_names_the_command_and_goes_on(tmp_path):
    proc, calls = make_test_deps(tmp_path, installed=("nftables", "ethtool", "iproute2"), uid="1000")
    assert proc.returncode == 0 and calls == []
    assert "apt-get install --no-install-recommends mininet" in proc.stdout


# ---------------------------------------------------------------- thc p4 ACTION: nested subcommands

@pytest.mark.parametrize("argv", [
    ["p4", "gen", "--rounds", "3"],              # a mininet option
    ["p4", "doctor", "--iface", "1=veth1"],      # a run option
    ["p4", "build", "--check"],                  # a gen option
    ["p4", "run", "--loss", "0.1"],              # a mininet option
    ["p4", "mininet", "--attach"],               # a run option
    ["p4", "gen", "--target", "tofino"],         # a build target, not a generator target
    ["p4"],                                      # no action
])
def test_thc_p4_actions_refuse_other_actions_options(argv, capsys):
    assert exit_code(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("action, own, foreign", [
    ("doctor", {"--json"}, {"--check", "--iface", "--rounds", "--target"}),
    ("gen", {"--check", "--target"}, {"--json", "--iface", "--rounds", "--out"}),
    ("build", {"--target", "--out"}, {"--check", "--iface", "--rounds", "--workers"}),
    ("run", {"--iface", "--attach", "--workers", "--thrift-port", "--grpc-port", "--l2", "--switch-control"},
     {"--check", "--rounds", "--loss"}),
    ("mininet", {"--rounds", "--loss", "--workers", "--json", "--switch-control"},
     {"--check", "--iface", "--attach", "--grpc-port"}),
])
def test_thc_p4_action_help_lists_only_its_options(action, own, foreign, capsys):
    assert exit_code(["p4", action, "--help"]) == 0
    words = set(capsys.readouterr().out.replace("[", " ").replace("]", " ").split())
    assert own <= words and not foreign & words


def test_thc_p4_gen_check_and_tofino_build_without_the_compiler(tmp_path, monkeypatch, capsys):
    assert exit_code(["p4", "gen", "--check"]) == 0
    assert "thc_tna.p4 is up to date" in capsys.readouterr().out
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(tools, "SYSTEM_DIR", str(tmp_path / "no-such-dir"))
    monkeypatch.delenv("THC_P4_TOOLS", raising=False)
    assert exit_code(["p4", "build", "--target", "tofino2", "--out", str(tmp_path)]) == 1
    assert "p4c-barefoot not found" in capsys.readouterr().err


def test_a_switch_whose_cli_cannot_import_its_modules_says_so(tmp_path, monkeypatch):
    """Reproduction: with `python3` on PATH lacking bmv2's thrift modules (an activated venv),
    every switch test erred "simple_switch did not start (Thrift port never answered)": the
    switch had started; its CLI's interpreter was what was broken."""
    import shutil

    from thc_ps.p4 import control
    d = tmp_path / "bin"
    _tool(d, "simple_switch", "sleep 30")
    cli_path = d / "simple_switch_CLI"
    # as bmv2 installs it, importing a module this python3 lacks (runtime_CLI itself may be
    # there: Debian's python3 first on PATH has bmv2's)
    cli_path.write_text("#!/usr/bin/env python3\nimport thc_test_no_such_runtime_CLI\n")
    cli_path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError) as exc:
        control.start_switch(tmp_path / "thc.json", {}, thrift_port=1)
    msg = str(exc.value)
    assert msg.startswith(f"simple_switch started, but {cli_path} cannot talk to it: ")
    assert "No module named 'thc_test_no_such_runtime_CLI'" in msg and "Thrift port never answered" not in msg
    assert f"in python3 ({shutil.which('python3')} on PATH)" in msg and "PATH=/usr/bin:$PATH" in msg
    line = by_name(tools.doctor(**where(d)))["simple_switch_CLI"].line()     # the doctor says the same
    assert "broken" in line and f"in python3 ({shutil.which('python3')} on PATH)" in line


def test_the_switch_control_plane_is_chosen_and_explained(tmp_path, monkeypatch, capsys):
    """auto: P4Runtime where simple_switch_grpc (and the client library) are found, else Thrift
    with the reason; asked for by name, P4Runtime without simple_switch_grpc is an error
    naming it, before any switch starts."""
    from thc_ps.p4.control import choose_control
    from thc_ps.p4.p4runtime import client_problem
    d = fake_tools(tmp_path)
    monkeypatch.setenv("PATH", path_without_p4_tools(d))    # no real simple_switch_grpc, wherever it is
    monkeypatch.setattr(tools, "SYSTEM_DIR", str(tmp_path / "no-such-dir"))
    monkeypatch.delenv("THC_P4_TOOLS", raising=False)
    kind, why = choose_control("auto")
    assert kind == "thrift" and why.startswith("no P4Runtime: simple_switch_grpc (PATH, ")
    assert choose_control("thrift") == ("thrift", "asked for")
    with pytest.raises(FileNotFoundError, match="the P4Runtime control plane needs simple_switch_grpc"):
        choose_control("p4runtime")
    assert exit_code(["p4", "run", "--attach", "--worker-port", "10.0.0.1=1,00:00:00:00:00:01",
                      "--switch-control", "p4runtime"]) == 1     # a missing tool, as `thc p4 build`'s
    assert "thc p4: error: the P4Runtime control plane needs simple_switch_grpc" in capsys.readouterr().err
    _tool(d, "simple_switch_grpc", "true")
    if not client_problem():
        assert choose_control("auto") == ("p4runtime", "simple_switch_grpc and the P4Runtime client are there")


def test_fake_tools_shadow_real_ones_wherever_they_are(tmp_path, monkeypatch):
    """The reproduction: with bmv2 + PI on PATH, a real simple_switch_grpc later on PATH made
    choose_control("auto") pick P4Runtime in the test of the Thrift fallback."""
    real = tmp_path / "real"
    _tool(real, "simple_switch_grpc", "true")
    _tool(real, "simple_switch", "true")
    fakes = fake_tools(tmp_path / "fake")
    monkeypatch.setenv("PATH", f"{fakes}{os.pathsep}{real}{os.pathsep}{os.environ['PATH']}")
    path = path_without_p4_tools(fakes).split(os.pathsep)
    assert path[0] == str(fakes) and str(real) not in path
    assert tools.find_tool("simple_switch_grpc", path=os.pathsep.join(path), system_dir=None, env={}) is None


def test_p4testgen_without_a_version_of_its_own_takes_that_of_its_build(tmp_path):
    """p4testgen wants a target even for --version, and a build from a tree without git tags
    prints "Version <null>": its version is that of the p4c-bm2-ss of the same build (a tree
    with CMakeCache.txt, or one install directory), never of a p4c from elsewhere."""
    spec = next(s for s in tools.SPECS if s.name == "p4testgen")
    body = '[ "$1 $2 $3 $4 $5" = "--target bmv2 --arch v1model --version" ] && echo "Version <null>" && exit 0; exit 1'
    build = tmp_path / "build"
    (build / "CMakeCache.txt").parent.mkdir(parents=True)
    (build / "CMakeCache.txt").write_text("")
    _tool(build / "backends" / "p4tools", "p4testgen", body)
    fake_tools(build, skip=("simple_switch", "simple_switch_CLI"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "p4testgen").symlink_to(build / "backends" / "p4tools" / "p4testgen")
    (bindir / "p4c-bm2-ss").symlink_to(build / "p4c-bm2-ss")
    st = tools.check(spec, **where(bindir))
    assert (st.status, st.version) == ("ok", tools.TESTED["p4c-bm2-ss"])
    elsewhere = tmp_path / "other"
    fake_tools(elsewhere, p4c_version="1.2.4.0", skip=("simple_switch", "simple_switch_CLI"))
    (bindir / "p4c-bm2-ss").unlink()
    (bindir / "p4c-bm2-ss").symlink_to(elsewhere / "p4c-bm2-ss")
    st = tools.check(spec, **where(bindir))
    assert st.status == "untested-version" and st.version is None
    _tool(bindir, "p4testgen-broken", "exit 1")
    (bindir / "p4testgen").unlink()
    (bindir / "p4testgen").symlink_to(bindir / "p4testgen-broken")
    st = tools.check(spec, **where(bindir))
    assert st.status == "broken" and "--version failed" in st.detail
