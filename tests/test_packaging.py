"""What the project installs: its own packages under one name (thc_ps), and a `p4` folder
that coexists with P4Runtime's `p4`."""
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tests_and_bench_are_not_installed_packages():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.split(".")[0] in ("tests", "bench")]
    assert {f"thc_ps.{p}" for p in ("compression", "deploy", "p4", "proto", "ps_server", "worker")} \
        <= set(packages)
    assert not [p for p in packages if p.split(".")[0] != "thc_ps"]      # one import name: thc_ps


def test_p4_package_and_p4runtime_import_together():
    """Our top-level p4/ extends its path, so P4Runtime's `p4.v1` (PyPI p4runtime) and our
    `thc_ps.p4.control` both import, whichever `p4` directory comes first on sys.path."""
    import importlib.util
    try:
        protobuf = importlib.util.find_spec("google.protobuf") is not None
    except ModuleNotFoundError:          # no `google` package at all
        protobuf = False
    if not protobuf or not any((Path(p) / "p4" / "v1").is_dir() for p in sys.path if p):
        pytest.skip("p4runtime is not installed (pip install p4runtime)")
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    code = "import thc_ps.p4.control, thc_ps.p4.harness.static_control, p4.v1.p4runtime_pb2; print('ok')"
    for cwd in (ROOT, "/"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)
        assert proc.stdout.strip() == "ok", (cwd, proc.stderr[-2000:])


def test_thc_ps_p4_is_this_projects_p4_folder():
    """thc_ps.p4 is the checkout's p4/ folder (the generator and control plane), from the
    root and from elsewhere."""
    code = "import thc_ps.p4.gen_p4 as g; print(g.__file__)"
    for cwd in (ROOT, "/"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
        assert proc.returncode == 0 and Path(proc.stdout.strip()) == ROOT / "p4" / "gen_p4.py", proc.stderr
