"""A round of several tensors, each cut into RHT blocks of its own (docs/protocol.md §4 step 1)
through a real PS: more blocks than one NORM packet holds go in several NORM packets, with
the same averages bit for bit as one packet; a bucket with more blocks than a NORM phase can
carry is refused before any traffic, naming the numbers."""
import numpy as np
import pytest

from thc_ps.proto.job import JobConfig
from thc_ps.ps_server.server import PSServer
from tests.helpers import ranks_against_ps
from thc_ps.worker.client import Worker
from thc_ps.worker.transport import Transport

SIZES = tuple(int(n) for n in np.random.default_rng(3).integers(1, 60, 40))   # 40 small tensors
SEED = 3


def cluster(mtu: int, n: int = 2, rounds: int = 2):
    """n ranks in threads against the C PS; per rank: each round's average, the norms it
    agreed on, and how many NORM packets each of its NORM phases sent."""
    from thc_ps.proto import headers as H
    job = JobConfig(num_workers=n, block_log2=8, seed=SEED, mtu=mtu)
    out = {r: [] for r in range(n)}

    def rank(r, t):
        w = Worker(t, seed=SEED, per_round_rng=True)
        sent, phase = [], w._run_phase
        w._run_phase = lambda kind, chunks, stream=None: (
            sent.append(len(chunks)) if kind == H.NORM else None, phase(kind, chunks, stream))[1]
        rng = np.random.default_rng([SEED, r])
        for k in range(rounds):
            g = rng.standard_normal(sum(SIZES)).astype(np.float32)
            avg = w.allreduce(g, key="g", round_no=k, segments=SIZES)
            out[r].append((avg.copy(), list(w.last.norms), sent[-1], w.norms_per_chunk))

    ranks_against_ps(job, n, rank)
    return out


def test_many_blocks_norms_go_in_several_packets_and_average_as_one():
    """40 tensors are 40 blocks: at MTU 128 a NORM packet holds 15 norms, so three packets a
    phase; at 1,500 one.  The agreed norms and the averages are the same bit for bit, and every
    rank agreed on the same norms."""
    small, big = cluster(128), cluster(1500)
    for r in small:
        for (a, na, sent_a, per_a), (b, nb, sent_b, per_b) in zip(small[r], big[r]):
            assert (per_a, sent_a, per_b, sent_b) == (15, 3, 358, 1)
            assert len(na) == len(SIZES) and na == nb
            np.testing.assert_array_equal(a, b)
    assert small[0][0][1] == small[1][0][1]                   # one maximum for every rank
    assert not np.array_equal(small[0][0][0], small[0][1][0])  # two rounds, two averages


def test_a_bucket_of_more_blocks_than_a_norm_phase_carries_is_refused_before_traffic():
    job = JobConfig(num_workers=1, block_log2=8, seed=SEED, mtu=128, norm_slots=2)
    server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
    t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, timeout_ms=200)
    try:
        w = Worker(t, seed=SEED)
        with pytest.raises(ValueError, match=r"a round of 40 tensor\(s\) makes 40 RHT blocks, more norms than a NORM "
                                             r"phase carries \(2 norm slots × 15 a packet = 30\)"):
            w.allreduce(np.ones(sum(SIZES), np.float32), segments=SIZES)
        assert w.round_no == 0
        w.allreduce(np.ones(sum(SIZES[:30]), np.float32), segments=SIZES[:30])    # 30 fit
        assert w.round_no == 1
    finally:
        t.close()
        server.stop()


def test_skipping_a_round_of_many_blocks_advances_the_slots_as_running_it():
    """A rank that fast-forwards (Worker.skip_rounds) through a round of 40 one-block tensors at
    MTU 128 advances every slot round as a rank that ran it: three NORM chunks, not one."""
    job = JobConfig(num_workers=1, block_log2=8, seed=SEED, mtu=128)
    rounds = []
    for skip in (False, True):
        server = PSServer(job, ("127.0.0.1", 0), control_port=0, engine="c").start()
        t = Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port, timeout_ms=200)
        try:
            w = Worker(t, seed=SEED)
            if skip:
                w.skip_rounds(1, sum(SIZES), SIZES)
            else:
                w.allreduce(np.ones(sum(SIZES), np.float32), segments=SIZES)
            rounds.append((t.phases.slot_round.copy(), t.phases._phase_no, w.round_no))
        finally:
            t.close()
            server.stop()
    (ran, ran_phases, ran_no), (skipped, skipped_phases, skipped_no) = rounds
    np.testing.assert_array_equal(ran, skipped)
    assert (ran_phases, ran_no) == (skipped_phases, skipped_no) == (2, 1)
    assert ran[0, job.slots:job.slots + 3].tolist() == [1, 1, 1] and ran[0, job.slots + 3] == 0


def test_the_cli_states_the_wide_mlp_s_padded_size_as_its_tensors_make_it():
    """`thc train --help` says how many coordinates the WideMLP's round carries: the layout of
    its four tensors, each cut on its own."""
    import re

    from thc_ps.compression import thc
    from thc_ps.deploy import cli
    from thc_ps.worker.training import WideMLP
    sizes = [p.numel() for p in WideMLP().parameters()]
    said = re.search(r"padded by the RHT to ([\d,]+) coordinates", _train_help(cli))
    assert int(said.group(1).replace(",", "")) == thc.make_layout(sum(sizes), segments=sizes).padded_dim


def _train_help(cli) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    return " ".join(out.getvalue().split())
