"""The Tofino program (p4/tofino/thc_tna.p4) through p4lang's open-source Tofino back end:
it must compile for Tofino 1 (TNA) and Tofino 2 (T2NA), and assemble when bfas is there.
Skips with one line when p4c-barefoot is not found (p4/tools.py)."""
import pytest

from p4 import control, tools

P4C = tools.find_tool("p4c-barefoot")
BFAS = tools.find_tool("bfas")
pytestmark = pytest.mark.skipif(P4C is None, reason=f"p4c-barefoot not found on {tools.where_text()} "
                                                    f"(p4lang's p4c with its Tofino back end; see `thc p4 doctor`)")


@pytest.mark.parametrize("target", sorted(control.TOFINO_TARGETS))
def test_tna_program_compiles(tmp_path, target):
    proc = control.compile_tofino(target, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = tmp_path / target
    bfa = sorted(out.rglob("*.bfa"))
    assert bfa, f"no assembly in {out}: {sorted(p.name for p in out.rglob('*'))}"
    if BFAS:
        assembled = control.assemble_tofino(bfa[0], target)
        assert assembled.returncode == 0, (assembled.stdout + assembled.stderr)[-4000:]
