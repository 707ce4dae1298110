"""Does the README's sample output still say what `make run` prints?

The THC run is deterministic on one machine: its per-epoch train loss, test accuracy, bytes
and lost chunks, and its final accuracy, must be the README's to the printed digit.  Round
times, wall times and the uncompressed baseline (float sums in arrival order) vary and are
not compared.  CI runs `make run` and then this script on its output:

    python tests/readme_sample.py RUN_OUTPUT [README.md]

Exit 0 when they agree, 1 naming every line that differs.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

EPOCH = re.compile(r"^\[thc\] epoch (\d+)/(\d+): train loss ([\d.]+), test acc ([\d.]+), round [\d.]+ ms, "
                   r"up ([\d.]+) MB, down ([\d.]+) MB per worker, lost chunks (\d+), models identical: (\w+)")
FINAL = re.compile(r"^thc: final test accuracy ([\d.]+), ([\d.]+) MB up / ([\d.]+) MB down per worker")
#: leading fields of each line that are losses and accuracies: another CPU's float rounding moves
#: them; the rest (bytes, lost chunks, the model check) must not move
FLOAT_FIELDS = {"epoch": 2, "final": 1}


def deterministic_lines(text: str) -> dict:
    """{key: fields} of the THC lines whose numbers do not depend on timing."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        m = EPOCH.match(line)
        if m:
            out[f"epoch {m.group(1)}/{m.group(2)}"] = m.groups()[2:]
        m = FINAL.match(line)
        if m:
            out["final"] = m.groups()
    return out


def compare(run_output: str, readme: str) -> list[str]:
    """The differences, as lines a person can act on ([] when the sample is current)."""
    got, want = deterministic_lines(run_output), deterministic_lines(readme)
    if not want:
        return ["the README has no THC sample lines to compare"]
    if not got:
        return ["the run printed no THC lines (did it fail?)"]
    return [f"{key}: README says {want[key]}, the run printed {got.get(key, 'no such line')}"
            for key in _drifted(got, want)]


def _drifted(got: dict, want: dict) -> list[str]:
    return [key for key in sorted(want) if got.get(key) != want[key]]


def floats_only(run_output: str, readme: str) -> bool:
    """Whether every line that differs differs only in its losses and accuracies (what another
    CPU's float rounding changes) while its byte counts, lost chunks and model check agree."""
    got, want = deterministic_lines(run_output), deterministic_lines(readme)
    differ = _drifted(got, want)
    if not differ or any(key not in got for key in differ):
        return False
    return all(got[k][FLOAT_FIELDS[k.split()[0]]:] == want[k][FLOAT_FIELDS[k.split()[0]]:] for k in differ)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    readme = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / "README.md")
    run_text, readme_text = Path(argv[0]).read_text(), readme.read_text()
    problems = compare(run_text, readme_text)
    for p in problems:
        print(f"README sample drifted: {p}", file=sys.stderr)
    if problems and floats_only(run_text, readme_text):
        print("(only losses and accuracies moved, the byte counts did not: the THC lines repeat exactly "
              "on one machine, but torch rounds differently on another CPU; if the code did not change, "
              "retake the sample on this machine)", file=sys.stderr)
    if not problems:
        print("README sample matches the run")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
