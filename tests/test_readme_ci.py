"""CI's README drift check: it runs where it should and catches the stale claim the tester found."""
import re
from pathlib import Path

from tests.readme_sample import compare, deterministic_lines, main

ROOT = Path(__file__).resolve().parents[1]
W = ", lost chunks 0, models identical: True"
# what `make run` printed on 2026-11-27 (the README's sample then; a fixture for the checker,
# not today's sample, which CI checks against a real run), timings as printed that day
TODAY = "\n".join([
    ".venv/bin/thc train",
    "training cnn on Fashion-MNIST: PS + 4 workers on loopback, codec=thc (b=4, g=30, p=1/32), 3 epochs",
    "[thc] epoch 1/3: train loss 0.8515, test acc 0.8406, round 9.8 ms, up 8.10 MB, down 15.77 MB per worker" + W,
    "[thc] epoch 2/3: train loss 0.3821, test acc 0.8704, round 10.6 ms, up 8.10 MB, down 15.77 MB per worker" + W,
    "[thc] epoch 3/3: train loss 0.3053, test acc 0.8799, round 11.7 ms, up 8.10 MB, down 15.77 MB per worker" + W,
    "[none] epoch 3/3: train loss 0.3144, test acc 0.8810, round 6.7 ms, up 61.41 MB, down 61.41 MB per worker" + W,
    "",
    "thc: final test accuracy 0.8799, 24.3 MB up / 47.3 MB down per worker, 54 s",
    "uncompressed: final test accuracy 0.8810, 184.2 MB up / 184.2 MB down per worker, 50 s",
]) + "\n"


def _commands(script: str) -> list[str]:
    return [line.split("#")[0].strip() for line in script.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command_first_then_checks_the_sample():
    cmds = _commands((ROOT / ".ci" / "run").read_text())
    assert "set -euo pipefail" in cmds                     # a failed make run (through tee) fails CI
    makes = [c for c in cmds if c.startswith("make ")]
    assert makes[0] == "make test" and re.fullmatch(r'make run \| tee "\$out"', makes[1]), makes
    check = cmds.index('.venv/bin/python tests/readme_sample.py "$out" README.md')
    assert check > cmds.index(makes[1])
    readme = (ROOT / "README.md").read_text()
    assert "make run " in readme and "make test " in readme.split("```")[1]


def test_the_stale_claim_the_tester_found_is_named():
    """The README said the THC run gives 0.8678; the run printed another accuracy."""
    stale = TODAY.replace("test acc 0.8799", "test acc 0.8678").replace("accuracy 0.8799", "accuracy 0.8678")
    problems = compare(TODAY, stale)
    assert len(problems) == 2
    assert problems[-1].startswith("final: README says ('0.8678'") and "'0.8799'" in problems[-1]


def test_only_the_final_accuracy_differs(tmp_path):
    run = tmp_path / "run.txt"
    run.write_text(TODAY.replace("final test accuracy 0.8799", "final test accuracy 0.8820"))
    readme = tmp_path / "README.md"
    readme.write_text("```\n" + TODAY + "```\n")
    assert main([str(run), str(readme)]) == 1
    run.write_text(TODAY.replace(", 54 s", ", 385 s").replace("0.8810", "0.8771"))   # time, baseline: not compared
    assert main([str(run), str(readme)]) == 0


def test_the_readme_sample_is_a_whole_thc_run():
    lines = deterministic_lines((ROOT / "README.md").read_text())
    assert {"epoch 1/3", "epoch 2/3", "epoch 3/3", "final"} <= set(lines)
    assert lines["final"][0] == lines["epoch 3/3"][1]         # the summary repeats the last epoch's accuracy
