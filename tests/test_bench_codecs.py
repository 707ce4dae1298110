"""`thc bench codecs` on a tiny dimension: one row per registered codec, sane columns."""
from thc_ps.compression import registry
from thc_ps.deploy import bench_codecs


def test_bench_codecs_table_has_every_codec(tmp_path):
    path = bench_codecs.run(workers=2, dims=(1 << 12,), e2e_dims=(1 << 12,), rounds=1, out=tmp_path,
                            log=lambda m: None)
    rows = [line.strip("|").split("|") for line in path.read_text().splitlines()[2:] if line.startswith("|")]
    by_codec = {r[1].strip(): [c.strip() for c in r] for r in rows}
    assert set(by_codec) == set(registry.names())
    thc, none = by_codec["thc"], by_codec["none"]
    assert (thc[3], thc[4], thc[5]) == ("8.0", "4.0", "4.00")          # 4-bit up, 8-bit lanes down
    assert none[7] == "0" and float(thc[7]) < 0.05                     # NMSE: exact vs THC's
    assert all(r[12] != "-" and float(r[12]) > 0 for r in by_codec.values())   # UDP round measured
