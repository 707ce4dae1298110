"""The README-sample check itself (CI runs it on `make run`'s output)."""
from pathlib import Path

from tests.readme_sample import compare, deterministic_lines, floats_only, main

W = ", lost chunks 0, models identical: True"
RUN = "\n".join([
    "training cnn on Fashion-MNIST: PS + 4 workers on loopback, codec=thc (b=4, g=30, p=1/32), 3 epochs",
    "[thc] epoch 1/2: train loss 0.8506, test acc 0.8379, round 10.1 ms, up 8.10 MB, down 15.77 MB per worker" + W,
    "[thc] epoch 2/2: train loss 0.3856, test acc 0.8716, round 9.7 ms, up 8.10 MB, down 15.77 MB per worker" + W,
    "[none] epoch 1/2: train loss 0.8595, test acc 0.8302, round 8.8 ms, up 61.41 MB, down 61.41 MB per worker" + W,
    "thc: final test accuracy 0.8716, 16.2 MB up / 31.5 MB down per worker, 57 s",
    "uncompressed: final test accuracy 0.8775, 184.2 MB up / 184.2 MB down per worker, 55 s",
]) + "\n"


def test_timings_and_the_baseline_are_not_compared():
    other = RUN.replace("round 10.1 ms", "round 31.0 ms").replace(", 57 s", ", 210 s") \
        .replace("test acc 0.8302", "test acc 0.8311").replace("accuracy 0.8775", "accuracy 0.8790")
    assert compare(other, RUN) == []
    assert set(deterministic_lines(RUN)) == {"epoch 1/2", "epoch 2/2", "final"}


def test_a_changed_accuracy_or_byte_count_is_named():
    drifted = RUN.replace("test acc 0.8716", "test acc 0.8820").replace("final test accuracy 0.8716",
                                                                        "final test accuracy 0.8820")
    problems = compare(drifted, RUN)
    assert len(problems) == 2 and any("epoch 2/2" in p and "0.8820" in p for p in problems)
    assert compare(RUN.replace("up 8.10 MB", "up 8.11 MB", 1), RUN)[0].startswith("epoch 1/2")
    assert compare("", RUN) == ["the run printed no THC lines (did it fail?)"]
    sample = "\n".join(RUN.splitlines()[2:])         # a README that shows the last epoch only
    assert compare(RUN, sample) == []
    assert compare(RUN.replace("epoch 2/2", "epoch 9/9"), sample)[0] == \
        "epoch 2/2: README says ('0.3856', '0.8716', '8.10', '15.77', '0', 'True'), the run printed no such line"


def test_the_readme_has_a_sample_to_compare(tmp_path):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert "final" in deterministic_lines(readme.read_text())
    out = tmp_path / "run.txt"
    out.write_text(RUN)
    assert main([str(out), str(readme)]) in (0, 1)
    (tmp_path / "r.md").write_text(RUN)
    assert main([str(out), str(tmp_path / "r.md")]) == 0


def test_a_float_only_drift_is_told_apart_from_a_byte_change(capsys, tmp_path):
    cpu = RUN.replace("train loss 0.8506", "train loss 0.8511").replace("test acc 0.8716", "test acc 0.8722") \
        .replace("final test accuracy 0.8716", "final test accuracy 0.8722")
    assert floats_only(cpu, RUN)
    assert not floats_only(cpu.replace("up 8.10 MB", "up 8.11 MB", 1), RUN)      # a byte count moved too
    assert not floats_only(RUN, RUN)                                              # nothing differs
    assert not floats_only(RUN.replace("epoch 2/2", "epoch 9/9"), RUN)            # a line is missing
    (tmp_path / "run.txt").write_text(cpu)
    (tmp_path / "r.md").write_text(RUN)
    assert main([str(tmp_path / "run.txt"), str(tmp_path / "r.md")]) == 1
    assert "retake the sample" in capsys.readouterr().err
    (tmp_path / "run.txt").write_text(cpu.replace("down 15.77 MB", "down 15.80 MB"))
    assert main([str(tmp_path / "run.txt"), str(tmp_path / "r.md")]) == 1
    assert "retake the sample" not in capsys.readouterr().err
