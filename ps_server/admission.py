"""Admission: which region of the PS's slot space a new job gets (docs/design.md, "Many jobs
on one PS").  Pure functions over the regions held; the PS process keeps the state.

A job asks for `data` aggregation slots (its `--slots`) plus `norm` NORM slots.  It gets

* what it asks for when that fits, capped at its **fair share** of the space,
  ⌊S / (k + 1)⌋ for a space of S slots with k jobs running;
* else, when the space is contended, the largest free region, if that holds its **floor**
  (its norm slots and min(data, MIN_DATA_SLOTS) data slots);
* else nothing: the job waits in the queue (first come, first served) until a running job
  ends.  A running job keeps its region until it ends: admission never takes slots back.

Why not ATP's policy: ATP (NSDI '21) hashes every packet to a switch aggregator shared by
all jobs and falls back to the PS on a collision.  Here regions are fixed for a job's
lifetime: a THC round has no second aggregation path to fall back to, and a fixed region
keeps the per-packet check to one comparison (slot < size) in the C engine and the switch.
"""
from __future__ import annotations

from dataclasses import dataclass

#: The fewest data slots a job is admitted with when the space is contended: below this a
#: worker's window (one packet in flight per slot) leaves the round trip idle most of the time.
MIN_DATA_SLOTS = 16
#: The default slot space: 8 jobs of the default 512 + 16 slots fit whole.
DEFAULT_SLOT_SPACE = 4224


@dataclass(frozen=True)
class Region:
    """A job's slots: [base, base + data) aggregate DATA, the next `norm` take NORM packets."""

    base: int
    data: int
    norm: int

    @property
    def size(self) -> int:
        return self.data + self.norm

    @property
    def end(self) -> int:
        return self.base + self.size


def free_gaps(held: list, space: int) -> list:
    """The free stretches [(base, length)] of a space of `space` slots, lowest base first."""
    gaps, at = [], 0
    for r in sorted(held, key=lambda r: r.base):
        if r.base > at:
            gaps.append((at, r.base - at))
        at = max(at, r.end)
    if at < space:
        gaps.append((at, space - at))
    return gaps


def fair_share(space: int, running: int) -> int:
    """Slots a new job may take when `running` jobs hold regions: ⌊S / (k + 1)⌋."""
    return space // (running + 1)


def floor(data: int, norm: int) -> int:
    """The smallest region a job asking for `data` + `norm` slots is admitted with."""
    return norm + min(data, MIN_DATA_SLOTS)


def grant(data: int, norm: int, held: list, space: int) -> Region | None:
    """The region a job asking for `data` + `norm` slots gets beside the regions `held`, or
    None (it waits).  The first free stretch that holds the whole grant is used (first fit),
    else the largest one."""
    if data < 1 or norm < 1:
        raise ValueError("a job needs at least one data slot and one norm slot")
    want = min(data + norm, max(fair_share(space, len(held)), floor(data, norm)))
    gaps = free_gaps(held, space)
    fits = [g for g in gaps if g[1] >= want]
    if fits:
        return Region(fits[0][0], want - norm, norm)
    base, length = max(gaps, key=lambda g: g[1], default=(0, 0))
    if length >= floor(data, norm):
        return Region(base, length - norm, norm)
    return None


def why_waiting(data: int, norm: int, held: dict, space: int) -> str:
    """Why a job of `data` + `norm` slots cannot be admitted, naming what holds the space
    (`held`: {job description: Region})."""
    gaps = free_gaps(list(held.values()), space)
    largest = max((g[1] for g in gaps), default=0)
    holders = ", ".join(f"{name} holds {r.size} at {r.base}" for name, r in held.items()) or "nothing"
    return (f"the slot space is full: this job needs at least {floor(data, norm)} slots "
            f"({norm} norm + {min(data, MIN_DATA_SLOTS)} data) and the largest free region is "
            f"{largest} of {space} ({holders})")
