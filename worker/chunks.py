"""A phase's chunks and results as flat buffers, so the C phase (_batchio.phase_run) sends
from and receives into numpy arrays without a Python object per packet.
"""
from __future__ import annotations

import os
import select
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from thc_ps.compression import _kernels
from thc_ps.proto import headers as H

_SETTLED = 4                 # phase_run chunk state: settled by Python (a stashed result)
_RESULT = 2


class PackedChunks(Sequence):
    """A phase's chunks as one buffer: chunk c is (offset, count, payload) with `per` elements
    of `bits` bits each (the last may be shorter), cut without copying.  The C phase sends
    straight from the buffer; the Python phase reads chunks as (offset, count, bytes)."""

    def __init__(self, payload, total: int, bits: int, per: int):
        self.buffer = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) \
            else payload.view(np.uint8).ravel()
        n = -(-total // per) if total else 0
        self.offsets = np.arange(n, dtype=np.int64) * per
        self.counts = np.minimum(per, total - self.offsets)
        ends = self.offsets * bits // 8 + (self.counts * bits + 7) // 8
        self.poff = np.concatenate([[0], ends]).astype(np.int64)
        self.poff[:-1] = self.offsets * bits // 8
        self.offsets32, self.counts32 = self.offsets.astype(np.uint32), self.counts.astype(np.int32)
        self.total, self.bits = total, bits

    @classmethod
    def from_list(cls, chunks: list) -> PackedChunks:
        """Arbitrary [(offset, count, payload)] (a NORM phase) in the same form."""
        self = cls.__new__(cls)
        self.buffer = np.frombuffer(b"".join(bytes(p) for _, _, p in chunks) or b"\0", dtype=np.uint8)
        self.offsets = np.array([o for o, _, _ in chunks], dtype=np.int64)
        self.counts = np.array([k for _, k, _ in chunks], dtype=np.int64)
        self.poff = np.concatenate([[0], np.cumsum([len(p) for _, _, p in chunks])]).astype(np.int64)
        self.offsets32, self.counts32 = self.offsets.astype(np.uint32), self.counts.astype(np.int32)
        self.total, self.bits = int(self.counts.sum()), 0
        return self

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, c):
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        return (int(self.offsets[c]), int(self.counts[c]),
                self.buffer[self.poff[c]:self.poff[c + 1]].tobytes())

    @property
    def wire_bytes(self) -> int:
        """Bytes the phase puts on the wire once (headers included)."""
        return int(self.poff[-1]) + H.HEADER_SIZE * len(self)


class PhaseResults(Sequence):
    """A C phase's results: chunk c's result is (Header, payload) or None when lost, and the
    payloads lie back to back in `lanes` (chunk c at roff[c]) for whole-vector use; sub-byte
    lanes as they came (`byte_lanes` widens them for the decode)."""

    def __init__(self, chunks: PackedChunks, down_bits: int):
        n = len(chunks)
        self.bits = down_bits
        self.state = np.zeros(n, np.int8)
        self.headers = np.zeros(n * H.HEADER_SIZE, np.uint8)
        self.roff = np.concatenate([[0], np.cumsum((chunks.counts * down_bits + 7) // 8)]).astype(np.int64)
        self.coff = np.concatenate([[0], np.cumsum(chunks.counts)]).astype(np.int64)   # lanes before chunk c
        self.lanes = np.empty(int(self.roff[-1]), np.uint8)
        self.lengths = np.zeros(n, np.int32)
        self._wide: np.ndarray | None = None

    def byte_lanes(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The lanes of 8 bits or fewer as one byte each, chunk c's at coff[c]: `lanes` itself
        for 8-bit lanes; narrower ones of chunks lo..hi-1 widened in C (proto/lanes.h) into a
        vector kept for the others (a pipelined round widens block by block)."""
        if self.bits == 8:
            return self.lanes
        if self.bits > 8:
            raise ValueError(f"{self.bits}-bit lanes are not bytes")
        if self._wide is None:
            self._wide = np.empty(int(self.coff[-1]), np.uint8)
        _kernels.widen_lanes(self.lanes, self.roff, self.coff, lo, len(self) if hi is None else hi,
                             self.bits, self._wide)
        return self._wide

    def settle(self, c: int, h: H.Header, payload: bytes) -> None:
        """Chunk c's result found before sending (a stashed read-ahead result)."""
        room = int(self.roff[c + 1] - self.roff[c])
        h = H.Header(**H.header_dict(h))
        self.headers[c * H.HEADER_SIZE:(c + 1) * H.HEADER_SIZE] = np.frombuffer(h.pack(), np.uint8)
        self.lanes[self.roff[c]:self.roff[c] + min(room, len(payload))] = \
            np.frombuffer(payload, np.uint8)[:room]
        self.lengths[c] = len(payload)
        self.state[c] = _SETTLED

    def ok(self) -> np.ndarray:
        return (self.state == _RESULT) | (self.state == _SETTLED)

    def common_k(self, lo: int, hi: int) -> int | None:
        """k when chunks [lo, hi) all came back whole with the same number of contributors
        (their lanes are then Y of one k), else None."""
        st = self.state[lo:hi]
        if not ((st == _RESULT) | (st == _SETTLED)).all():
            return None
        k = self.headers.reshape(-1, H.HEADER_SIZE)[lo:hi, 28]
        if (k != k[0]).any() or (self.lengths[lo:hi] != np.diff(self.roff[lo:hi + 1])).any():
            return None
        return int(k[0])

    def _field(self, off: int, size: int) -> np.ndarray:
        rows = self.headers.reshape(-1, H.HEADER_SIZE)[:, off:off + size]
        return rows[:, 0] if size == 1 else rows.copy().view(f">u{size}").ravel()

    @property
    def contributors(self) -> np.ndarray:
        return np.where(self.ok(), self._field(28, 1), 0)

    @property
    def bitmaps(self) -> np.ndarray:
        return np.where(self.ok(), self._field(24, 4), 0)

    def payload(self, c: int) -> np.ndarray:
        room = int(self.roff[c + 1] - self.roff[c])
        return self.lanes[self.roff[c]:self.roff[c] + min(room, int(self.lengths[c]))]

    def digests(self) -> list:
        """crc32 of each chunk's result payload (0 for a lost chunk), for the exact checks."""
        starts = self.roff[:-1]
        ends = starts + np.minimum(np.diff(self.roff), self.lengths)
        lanes = memoryview(self.lanes)
        return [zlib.crc32(lanes[a:b]) if ok else 0
                for a, b, ok in zip(starts.tolist(), ends.tolist(), self.ok().tolist())]

    def __len__(self) -> int:
        return len(self.state)

    def __getitem__(self, c):
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        if not self.ok()[c]:
            return None
        h, _ = H.parse(self.headers[c * H.HEADER_SIZE:(c + 1) * H.HEADER_SIZE].tobytes()
                       + bytes(int(self.lengths[c])))
        return h, self.payload(c).tobytes()


class ChunkStream:
    """A phase's chunks made while the phase runs: a producer thread fills the phase's
    buffer in order and says, after each piece, how many leading chunks are ready; the C
    phase sends only those and wakes on this stream's eventfd when more are.  A reader on a
    third thread can wait for a prefix of the chunks to be answered (`wait_answered`: the C
    phase signals a second eventfd) and read their results (`results`) while later chunks
    are still on the wire.

    Nothing on the wire changes: the same chunks, the same slots and rounds, only sent as
    soon as each is made (docs/design.md, "A round as a pipeline").

    P's slots (_batchio.c): READY, the producer's eventfd, then WATCH, ANSWERED, NOTIFIED and
    the reader's eventfd."""

    READY = 19                  # P's index of the count of chunks ready (_batchio.c P_READY)
    WATCH, ANSWERED = READY + 2, READY + 3

    def __init__(self, nchunks: int):
        self.n = nchunks
        self.ready = 0
        self.error: BaseException | None = None
        self.results: PhaseResults | None = None
        self.evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.donefd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._P = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = threading.Event()
        self._over = False

    def p_fields(self) -> list:
        """The values P starts with from index READY on (the phase appends them)."""
        return [self.ready, self.evfd, 0, 0, 0, self.donefd]

    def advance(self, ready: int) -> None:
        """The first `ready` chunks can be sent."""
        with self._lock:
            self.ready = min(max(ready, self.ready), self.n)
            if self._P is not None:
                self._P[self.READY] = self.ready
            if self.evfd >= 0:
                os.eventfd_write(self.evfd, 1)
        if self.ready >= self.n:
            self._done.set()

    def fail(self, exc: BaseException) -> None:
        """The producer failed: the phase stops waiting for chunks and raises `exc`."""
        self.error = exc
        self._done.set()
        with self._lock:
            if self.evfd >= 0:
                os.eventfd_write(self.evfd, 1)

    def attach(self, P: np.ndarray, results: PhaseResults) -> None:
        """The phase starts with P (whose fields from READY on are `p_fields()`)."""
        with self._lock:
            self._P = P
            P[self.READY] = self.ready
            self.results = results
        self._started.set()

    def check(self) -> None:
        """Raise the producer's error, if it failed."""
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float | None = None) -> None:
        """Until every chunk is made (the Python phase and a resumed phase send whole)."""
        self._done.wait(timeout)
        self.check()

    def wait_answered(self, hi: int, recheck_s: float = 0.005) -> bool:
        """Block until chunks [0, hi) have all been answered (a result, or lost): True; False
        when the phase ended first (`end`).  Sleeps in select() on the phase's signal (GIL
        released); `recheck_s` bounds a wake-up lost between the two threads."""
        while not self._started.is_set():
            if self._over:
                return False
            self._started.wait(recheck_s)
        P = self._P
        P[self.WATCH] = hi
        while P[self.ANSWERED] < hi:
            if self._over:
                return False
            ready, _, _ = select.select([self.donefd], [], [], recheck_s)
            if ready:
                try:
                    os.eventfd_read(self.donefd)
                except BlockingIOError:
                    pass
        return True

    def end(self) -> None:
        """The phase is over (or failed): a reader waiting in `wait_answered` returns False."""
        self._over = True
        with self._lock:
            if self.donefd >= 0:
                os.eventfd_write(self.donefd, 1)

    def close(self) -> None:
        with self._lock:
            for fd in (self.evfd, self.donefd):
                if fd >= 0:
                    os.close(fd)
            self.evfd = self.donefd = -1
