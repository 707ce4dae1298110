"""Benchmark scripts run from a checkout as their docstrings say (reproduction: bench_p4.py
stopped with `ModuleNotFoundError: No module named 'tests'` unless PYTHONPATH was set)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench_p4.py", "bench_breakeven.py", "pauses.py"])
def test_script_help_runs_from_anywhere(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
