"""The tree is clean under the ruff rule set of pyproject.toml ([tool.ruff])."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


def test_ruff_is_clean():
    proc = subprocess.run(_ruff() + ["check", "--output-format", "concise", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-1000:]


def test_ruff_config_has_the_agreed_rules():
    import tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert {"E", "F", "W", "B", "UP", "C90"} <= set(cfg["lint"]["select"])
    assert cfg["lint"]["mccabe"]["max-complexity"] <= 25
