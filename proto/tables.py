"""Optimal THC lookup tables (paper §5.3 and App. B).

Both ends must agree on the table T: the worker maps grid values to indices
with T⁻¹, the PS (software or switch) maps indices back with T before summing.
That is why the solver lives in ``proto``.

The App. B problem: choose integers 0 = T[0] < … < T[2^b−1] = g that minimize

    ∫_{−t_p}^{t_p} Σ_z P(a, z)·(a − v(T[z]))² φ(a) da,   v(i) = −t_p + i·2t_p/g,

where P is unbiased stochastic rounding between the two neighbouring table
values (optimal for a fixed table, App. B).  For a in [u, w] between two
consecutive table values the rounding variance is (a − u)(w − a), so the
objective is a sum of per-interval costs

    C(u, w) = ∫_u^w (a − u)(w − a) φ(a) da
            = −m2 + (u + w)·m1 − u·w·m0

with the truncated-normal moments m0 = Φ(w) − Φ(u), m1 = φ(u) − φ(w),
m2 = m0 + u·φ(u) − w·φ(w) (closed forms, no quadrature).  An additive cost
over consecutive table values is solved exactly by dynamic programming over
(levels used, last grid point) in O(2^b·g²) — no symmetry assumption, so the
asymmetric optima of even g are found.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist

import numpy as np

#: The authors' published table for (b=4, g=30, p=1/32) (docs/prior-art.md §1.4); data, kept
#: as a fixture to compare objectives against.
PUBLISHED_4_30_32 = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)

_STD_NORMAL = NormalDist()


def parse_p(value: str | float | Fraction) -> Fraction:
    """Parse a support fraction p given as '1/32', '0.03125' or a number; 0 < p < 1."""
    try:
        frac = Fraction(value).limit_denominator(1 << 20) if not isinstance(value, Fraction) else value
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"p must be a fraction like 1/32 or a number in (0, 1), got {value!r}") from exc
    if not 0 < frac < 1:
        raise ValueError(f"p must lie strictly between 0 and 1, got {value!r}")
    return frac


def t_p(p: float | Fraction) -> float:
    """Clamping threshold t_p = Φ⁻¹(1 − p/2) (paper §5.2)."""
    return _STD_NORMAL.inv_cdf(1.0 - float(p) / 2.0)


def check_table_params(bits: int, granularity: int) -> None:
    """Refuse (b, g) pairs for which no strictly increasing table exists."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    levels = 1 << bits
    if granularity < levels - 1:
        raise ValueError(
            f"granularity g={granularity} is below 2^b-1={levels - 1}: a strictly increasing "
            f"table of {levels} values in 0..g does not exist")


def _grid_moments(g: int, tp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = -tp + np.arange(g + 1, dtype=np.float64) * (2.0 * tp / g)
    cdf = np.array([_STD_NORMAL.cdf(x) for x in v])
    pdf = np.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)
    return v, cdf, pdf


def interval_costs(g: int, tp: float) -> np.ndarray:
    """Matrix C[i, j] = ∫_{v_i}^{v_j} (a − v_i)(v_j − a) φ(a) da for i < j, +inf elsewhere."""
    v, cdf, pdf = _grid_moments(g, tp)
    u, w = v[:, None], v[None, :]
    m0 = cdf[None, :] - cdf[:, None]
    m1 = pdf[:, None] - pdf[None, :]
    m2 = m0 + (v * pdf)[:, None] - (v * pdf)[None, :]
    cost = -m2 + (u + w) * m1 - u * w * m0
    iu = np.triu_indices(g + 1, k=1)
    out = np.full((g + 1, g + 1), np.inf)
    out[iu] = np.maximum(cost[iu], 0.0)
    return out


def objective(table, granularity: int, p) -> float:
    """App. B objective of a given strictly increasing integer table."""
    t = np.asarray(table, dtype=np.int64)
    if t[0] != 0 or t[-1] != granularity or np.any(np.diff(t) <= 0):
        raise ValueError(f"table must increase strictly from 0 to g={granularity}: {list(t)}")
    costs = interval_costs(granularity, t_p(parse_p(p)))
    return float(costs[t[:-1], t[1:]].sum())


def _dp_solve(levels: int, g: int, costs: np.ndarray) -> list[int]:
    """Exact minimum of Σ C[T[k], T[k+1]] over strictly increasing T with T[0]=0, T[-1]=g."""
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    parents = []
    for _ in range(levels - 1):
        total = best[:, None] + costs          # total[i, j]: previous point i, new point j
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(g + 1)]
        parents.append(arg)
    table = [g]
    for arg in reversed(parents):
        table.append(int(arg[table[-1]]))
    return table[::-1]


@dataclass(frozen=True)
class Table:
    """A solved lookup table and the facts both ends need to agree on."""

    bits: int
    granularity: int
    p: Fraction
    t_p: float
    values: tuple[int, ...]
    objective: float

    def as_array(self, dtype=np.int64) -> np.ndarray:
        return np.asarray(self.values, dtype=dtype)

    def to_json(self) -> dict:
        return {"bits": self.bits, "granularity": self.granularity, "p": str(self.p),
                "t_p": self.t_p, "table": list(self.values), "objective": self.objective}


@functools.lru_cache(maxsize=4096)
def _solve_cached(bits: int, granularity: int, p: Fraction) -> Table:
    tp = t_p(p)
    costs = interval_costs(granularity, tp)
    levels = 1 << bits
    table = _dp_solve(levels, granularity, costs)
    obj = float(costs[table[:-1], table[1:]].sum())
    # The objective is symmetric, so a mirrored table ties; return the lexicographically
    # smaller of the two so the result does not depend on float noise.
    mirror = [granularity - x for x in reversed(table)]
    mobj = float(costs[mirror[:-1], mirror[1:]].sum())
    if abs(mobj - obj) <= 1e-12 * max(obj, 1e-300) and mirror < table:
        table, obj = mirror, mobj
    return Table(bits, granularity, p, tp, tuple(table), obj)


def solve_table(bits: int, granularity: int, p) -> Table:
    """Optimal table for (b, g, p) (App. B), exact over all strictly increasing tables; cached."""
    check_table_params(bits, granularity)
    return _solve_cached(int(bits), int(granularity), parse_p(p))


def identity_table(bits: int) -> Table:
    """The uniform (Alg. 1) table: g = 2^b − 1 and T = identity."""
    levels = 1 << bits
    return Table(bits, levels - 1, Fraction(0), float("nan"), tuple(range(levels)), float("nan"))


def lower_interval_index(table: np.ndarray) -> np.ndarray:
    """For each integer grid point q in 0..g, the index j of the table interval [T[j], T[j+1])
    that contains q (q = g maps to the last interval).  The worker's T⁻¹ step uses it."""
    table = np.asarray(table, dtype=np.int64)
    g = int(table[-1])
    q = np.arange(g + 1)
    idx = np.searchsorted(table, q, side="right") - 1
    return np.minimum(idx, len(table) - 2).astype(np.int64)
