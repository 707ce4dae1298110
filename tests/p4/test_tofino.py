"""The Tofino program (p4/tofino/thc_tna.p4) through p4lang's open-source Tofino back end:
it must compile for Tofino 1 (TNA) and Tofino 2 (T2NA), fit the generation's MAU stages
(each THC packet passes the ingress twice, through a recirculation port; the stages count
once) and assemble when bfas is there.  Skips with one line when p4c-barefoot is not found
(p4/tools.py)."""
import re

import pytest

from thc_ps.p4 import control, tofino_resources, tools

P4C = tools.find_tool("p4c-barefoot")
BFAS = tools.find_tool("bfas")
pytestmark = pytest.mark.skipif(P4C is None, reason=f"p4c-barefoot not found on {tools.where_text()} "
                                                    f"(p4lang's p4c with its Tofino back end; see `thc p4 doctor`)")

STAGES = {"tofino": 12, "tofino2": 20}          # MAU stages per pipe of each generation


def stages_used(bfa_text: str, gress: str) -> int:
    """1 + the highest `stage N <gress>:` section of p4c-barefoot's assembly."""
    return 1 + max((int(n) for n in re.findall(rf"^stage (\d+) {gress}:", bfa_text, re.M)), default=-1)


def _compile(target, tmp_path):
    proc = control.compile_tofino(target, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    build = tmp_path / target
    bfa = sorted(build.rglob("*.bfa"))
    assert bfa, f"no assembly in {build}: {sorted(p.name for p in build.rglob('*'))}"
    assert (build / control.TNA_P4INFO).stat().st_size > 0        # the P4Info for a P4Runtime server
    return bfa[0]


@pytest.mark.parametrize("target", ["tofino", "tofino2"])
def test_tna_program_compiles_and_fits(tmp_path, target):
    bfa = _compile(target, tmp_path)
    text = bfa.read_text()
    used = {g: stages_used(text, g) for g in ("ingress", "egress")}
    assert used["ingress"] >= 1 and used["egress"] >= 1, used
    # the compiler's resource report agrees with the assembly and with the program
    report = tofino_resources.summarize(bfa.parent)
    assert report["stages_used"] == max(used.values()), (report, used)
    registers = len(re.findall(r"\bRegister<", control.HERE.joinpath("tofino", "thc_tna.p4").read_text()))
    assert report["stateful_alus"] == registers, (report, registers)   # one SALU per register
    assert max(used.values()) <= STAGES[target], f"{target}: {used} stages used, {STAGES[target]} per pipe"
    if BFAS:
        assembled = control.assemble_tofino(bfa, target)
        assert assembled.returncode == 0, (assembled.stdout + assembled.stderr)[-4000:]


def test_stage_count_reads_the_assembly():
    text = "stage 0 ingress:\n  x\nstage 3 ingress:\nstage 0 egress:\nstage 1 egress:\n"
    assert stages_used(text, "ingress") == 4 and stages_used(text, "egress") == 2
    assert stages_used("", "ingress") == 0
