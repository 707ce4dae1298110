"""SKCompress (Jiang et al.), sparse key–value gradient codec; readings in docs/codec-skcompress.md.

Values (paper §4): sign separation (§4.2 Solution 1), exact equal-population quantile splits
per side (docs/codec-skcompress.md note 3.3), bucket midpoints as values, ranks grouped in G = q/r (§4.2
Solution 2), one MinMaxSketch per (side, group): s hash rows of t_g = ⌈0.2·n_g⌉ cells, insert
keeps the minimum, query takes the maximum (never overestimates), cells Huffman-coded (§4.3,
canonical code, docs/codec-skcompress.md note 3.7).
Keys (paper §5): per (side, group) delta keys, interval encoding with the adaptive prefix
(§5.2): m_int ∈ {2,4,8,16}, fixed (A) or Huffman (B) prefix, chosen by exact bit count.
Container (docs/codec-skcompress.md note 4): little-endian integers, MSB-first bit streams, padded to a byte.
"""
from __future__ import annotations

import heapq
import struct

import numpy as np

from thc_ps.compression.codec import Codec, CodecError, Context

try:
    from thc_ps.compression import _bitstream      # built by `pip install`
except ImportError:                         # pragma: no cover - Python reference decoder
    _bitstream = None

MAGIC = b"SKC1"
HEADER = struct.Struct("<4sBBBBQIHHQ")            # 32 bytes
F_HUFFMAN, F_ADAPTIVE, F_EXACT = 0x02, 0x04, 0x08
GOLDEN = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- bit streams

def pack_fields(values: np.ndarray, lengths: np.ndarray) -> bytes:
    """Concatenate values[i] in lengths[i] bits (≤ 57), MSB first, zero-padded to a byte."""
    values = np.asarray(values, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return b""
    span = int(lengths.max())
    shifts = np.arange(span - 1, -1, -1, dtype=np.uint64)
    bits = ((values[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8)
    valid = np.arange(span)[None, :] >= (span - lengths)[:, None]
    return np.packbits(bits[valid]).tobytes()


def read_fields(buf: bytes, lengths: np.ndarray, start_bit: int = 0) -> np.ndarray:
    """Inverse of pack_fields for known lengths (≤ 56): a 64-bit window per field."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, np.uint64)
    offs = start_bit + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    end = start_bit + int(lengths.sum())
    if end > 8 * len(buf):
        raise CodecError("SKCompress: bit stream truncated")
    data = np.frombuffer(buf + b"\x00" * 8, dtype=np.uint8)
    byte = offs // 8
    word = np.zeros(lengths.size, np.uint64)
    for j in range(8):
        word = (word << np.uint64(8)) | data[byte + j].astype(np.uint64)
    word = word << (offs % 8).astype(np.uint64)
    return word >> (np.uint64(64) - lengths.astype(np.uint64))


def huffman_lengths(freq: np.ndarray, cap: int = 24) -> np.ndarray:
    """Huffman code lengths (heap on frequency, §4.3); one symbol gets length 1; None if > cap."""
    syms = [i for i in range(freq.size) if freq[i] > 0]
    lengths = np.zeros(freq.size, np.int64)
    if len(syms) == 1:
        lengths[syms[0]] = 1
        return lengths
    heap = [(int(freq[s]), i, [s]) for i, s in enumerate(syms)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        f1, _, a = heapq.heappop(heap)
        f2, _, b = heapq.heappop(heap)
        for s in a + b:
            lengths[s] += 1
        heapq.heappush(heap, (f1 + f2, tie, a + b))
        tie += 1
    return lengths if lengths.max() <= cap else None


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes from code lengths (shorter first, then by symbol)."""
    codes = np.zeros(lengths.size, np.uint64)
    order = sorted((int(l), s) for s, l in enumerate(lengths) if l > 0)
    code, prev = 0, 0
    for l, s in order:
        code <<= (l - prev)
        codes[s] = code
        code += 1
        prev = l
    return codes


def huffman_decode(buf: bytes, lengths: np.ndarray, count: int) -> np.ndarray:
    """Decode `count` canonical-Huffman symbols: the C scan of compression/_bitstream.c,
    or the Python reference below when the extension is not built."""
    if _bitstream is None:
        return huffman_decode_py(buf, lengths, count)
    lengths = np.asarray(lengths)
    if lengths.size and (lengths.min() < 0 or lengths.max() > 32):
        raise CodecError("SKCompress: Huffman code length out of range")
    out = np.empty(count, np.int64)
    try:
        _bitstream.canonical_huffman_decode(bytes(buf), lengths.astype(np.uint8).tobytes(), out)
    except ValueError as exc:
        raise CodecError(f"SKCompress: {exc}") from None
    return out


def huffman_decode_py(buf: bytes, lengths: np.ndarray, count: int) -> np.ndarray:
    """Decode `count` canonical-Huffman symbols (sequential, table of first codes)."""
    order = sorted((int(l), s) for s, l in enumerate(lengths) if l > 0)
    if not order:
        if count:
            raise CodecError("SKCompress: empty Huffman table")
        return np.zeros(0, np.int64)
    maxlen = order[-1][0]
    first, index, syms = {}, {}, [s for _, s in order]
    code, prev, pos = 0, 0, 0
    for l, _ in order:
        code <<= (l - prev)
        if l not in first:
            first[l], index[l] = code, pos
        code += 1
        pos += 1
        prev = l
    counts = {l: sum(1 for ll, _ in order if ll == l) for l in first}
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8)).tolist()
    out = np.empty(count, np.int64)
    p = 0
    nb = len(bits)
    for i in range(count):
        c, l = 0, 0
        while True:
            if p >= nb or l >= maxlen:
                raise CodecError("SKCompress: bad Huffman stream")
            c = (c << 1) | bits[p]
            p += 1
            l += 1
            if l in first and first[l] <= c < first[l] + counts[l]:
                out[i] = syms[index[l] + c - first[l]]
                break
    return out


# ----------------------------------------------------------------------------- keys (§5)

def interval_counts(delta: np.ndarray, b: int) -> np.ndarray:
    """c = ⌈bitlen(Δ)/b⌉ intervals per delta (bitlen(0) = 1)."""
    nbits = np.maximum(1, np.floor(np.log2(np.maximum(delta, 1))).astype(np.int64) + 1)
    nbits = np.where(delta >= 1, nbits, 1)
    return -(-nbits // b)


def choose_key_scheme(delta: np.ndarray) -> tuple:
    """(bits, m_int, scheme, code lengths or None): the exact minimum over 8 candidates (§5.2)."""
    best = None
    n = delta.size
    for m_int in (2, 4, 8, 16):
        b = 32 // m_int
        c = interval_counts(delta, b)
        if c.size and c.max() > m_int:
            continue
        payload = b * int(c.sum())
        fixed = payload + n * (m_int.bit_length() - 1)
        cand = [(fixed, m_int, "A", None)]
        freq = np.bincount(c - 1, minlength=m_int) if n else np.zeros(m_int, np.int64)
        lens = huffman_lengths(freq) if n else None
        if lens is not None:
            cand.append((payload + int((freq * lens).sum()) + 5 * m_int, m_int, "B", lens))
        for x in cand:
            if best is None or x[0] < best[0]:
                best = x
    return best


def encode_keys(keys: np.ndarray, force: tuple | None = None) -> bytes:
    """Key block; `force` = (m_int, "A") pins the scheme (the §5.1 base is (4, "A"))."""
    delta = np.diff(keys, prepend=0).astype(np.int64) if keys.size else np.zeros(0, np.int64)
    if force is None:
        _, m_int, scheme, lens = choose_key_scheme(delta)
    else:
        m_int, scheme = force
        lens = huffman_lengths(np.bincount(interval_counts(delta, 32 // m_int) - 1, minlength=m_int)) \
            if scheme == "B" else None
    b = 32 // m_int
    c = interval_counts(delta, b)
    param = ((m_int.bit_length() - 2) << 6) | (0x20 if scheme == "B" else 0)
    head = bytes([param])
    if scheme == "B":
        head += bytes(lens.astype(np.uint8).tolist())
        codes = canonical_codes(lens)
        prefix = pack_fields(codes[c - 1], lens[c - 1])
    else:
        prefix = pack_fields((c - 1).astype(np.uint64), np.full(c.size, m_int.bit_length() - 1))
    payload = pack_fields(delta.astype(np.uint64), c * b)
    return head + struct.pack("<II", len(prefix), len(payload)) + prefix + payload


def decode_keys(buf: bytes, pos: int, n: int) -> tuple[np.ndarray, int]:
    if pos + 1 > len(buf):
        raise CodecError("SKCompress: truncated key block")
    param = buf[pos]
    m_int = 1 << ((param >> 6) + 1)
    scheme_b = bool(param & 0x20)
    pos += 1
    lens = None
    if scheme_b:
        lens = np.frombuffer(buf, dtype=np.uint8, count=m_int, offset=pos).astype(np.int64)
        pos += m_int
    if pos + 8 > len(buf):
        raise CodecError("SKCompress: truncated key block")
    np_, nl = struct.unpack_from("<II", buf, pos)
    pos += 8
    prefix, payload = buf[pos:pos + np_], buf[pos + np_:pos + np_ + nl]
    if len(prefix) != np_ or len(payload) != nl:
        raise CodecError("SKCompress: truncated key streams")
    pos += np_ + nl
    if scheme_b:
        c = huffman_decode(prefix, lens, n) + 1
    else:
        c = read_fields(prefix, np.full(n, m_int.bit_length() - 1)).astype(np.int64) + 1
    if c.size and c.max() > m_int:
        raise CodecError("SKCompress: interval count above m_int")
    delta = read_fields(payload, c * (32 // m_int)).astype(np.int64)
    if n > 1 and np.any(delta[1:] == 0):
        raise CodecError("SKCompress: repeated key")
    return np.cumsum(delta), pos


# ----------------------------------------------------------------------------- values (§4)

def splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64)
    z = z + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sketch_columns(keys: np.ndarray, row: int, t: int, seed: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        base = keys.astype(np.uint64) + np.uint64(((row + 1) * GOLDEN + seed) & M64)
        return (splitmix64(base) % np.uint64(t)).astype(np.int64)


def minmax_build(keys: np.ndarray, ranks: np.ndarray, s: int, t: int, top: int, seed: int) -> np.ndarray:
    """Insert: every cell keeps the minimum rank hashed into it (§4.2, Fig. 5)."""
    table = np.full((s, t), top, dtype=np.int64)
    touched = np.zeros((s, t), bool)
    for i in range(s):
        cols = sketch_columns(keys, i, t, seed)
        np.minimum.at(table[i], cols, ranks)
        touched[i, cols] = True
    if touched.any() and not touched.all():           # docs/codec-skcompress.md note 3.7: untouched → most frequent
        table[~touched] = np.bincount(table[touched]).argmax()
    return table


def minmax_query(table: np.ndarray, keys: np.ndarray, seed: int) -> np.ndarray:
    """Query: the maximum over rows (every candidate ≤ the true rank)."""
    s, t = table.shape
    return np.max([table[i, sketch_columns(keys, i, t, seed)] for i in range(s)], axis=0)


def quantile_splits(mag: np.ndarray, q: int) -> np.ndarray:
    """q + 1 exact equal-population split values of the magnitudes (§4.1 Step 1)."""
    srt = np.sort(mag)
    idx = (np.arange(q) * srt.size) // q
    return np.append(srt[idx], srt[-1]).astype(np.float64)


def bucket_ranks(mag: np.ndarray, sp: np.ndarray) -> np.ndarray:
    return np.clip(np.searchsorted(sp, mag, side="right") - 1, 0, sp.size - 2)


# ----------------------------------------------------------------------------- message

def encode(keys, vals, dim: int, *, q: int = 256, r: int = 8, s: int = 2, colratio: float = 0.2,
           seed: int = 0) -> bytes:
    """Compress a sparse gradient (strictly increasing keys < 2^32, nonzero finite values)."""
    keys = np.asarray(keys, dtype=np.int64)
    vals = np.asarray(vals, dtype=np.float64)
    if keys.size and (keys.min() < 0 or keys.max() >= 1 << 32 or np.any(np.diff(keys) <= 0)):
        raise ValueError("SKCompress: keys must be strictly increasing uint32")
    if not np.all(np.isfinite(vals)):
        raise ValueError("SKCompress: NaN or Inf in the gradient")
    nz = vals != 0
    keys, vals = keys[nz], vals[nz]
    g = max(1, q // r)
    log2g = max(1, (g - 1).bit_length())
    out = [HEADER.pack(MAGIC, 1, F_HUFFMAN | F_ADAPTIVE | F_EXACT, s, log2g, dim, keys.size, q, 0, seed)]
    d = keys.size
    neg = vals < 0
    n_neg = int(neg.sum())
    q_neg = min(n_neg, max(1 if n_neg else 0, round(q * n_neg / d))) if d else 0
    q_pos = min(d - n_neg, max(1 if d - n_neg else 0, q - q_neg)) if d else 0
    for side_mask, q_s in ((neg, q_neg), (~neg, q_pos)):
        k_side, mag = keys[side_mask], np.abs(vals[side_mask])
        if k_side.size == 0:
            out.append(struct.pack("<HH", 0, 0))
            continue
        sp = quantile_splits(mag, q_s)
        mids = (sp[:-1] + sp[1:]) / 2
        rank = bucket_ranks(mag, sp)
        groups = rank // g
        present = np.unique(groups)
        out.append(struct.pack("<HH", q_s, present.size) + mids.astype("<f8").tobytes())
        for grp in present:
            sel = groups == grp
            kg, rr = k_side[sel], rank[sel] - grp * g
            t = max(1, int(np.ceil(colratio * kg.size)))
            table = minmax_build(kg, rr, s, t, g - 1, seed)
            cells = table.ravel()
            lens = huffman_lengths(np.bincount(cells, minlength=g))
            if lens is None:
                lens = np.full(g, log2g)
            bits = pack_fields(canonical_codes(lens)[cells], lens[cells])
            out.append(struct.pack("<HII", int(grp), kg.size, t) + bytes(lens.astype(np.uint8).tolist())
                       + struct.pack("<I", len(bits)) + bits + encode_keys(kg))
    return b"".join(out)


def decode(msg: bytes):
    """(keys int64 sorted, values float64, dim) of one message; CodecError when malformed."""
    if len(msg) < HEADER.size:
        raise CodecError("SKCompress message shorter than its header")
    magic, ver, flags, s, log2g, dim, d, q, _, seed = HEADER.unpack_from(msg)
    if magic != MAGIC or ver != 1 or not 1 <= s <= 16 or not 1 <= log2g <= 16:
        raise CodecError("SKCompress: bad header")
    g = 1 << log2g
    pos = HEADER.size
    all_k, all_v = [], []
    for sign in (-1.0, 1.0):
        if pos + 4 > len(msg):
            raise CodecError("SKCompress: truncated side block")
        q_s, ngroups = struct.unpack_from("<HH", msg, pos)
        pos += 4
        if pos + 8 * q_s > len(msg):
            raise CodecError("SKCompress: truncated midpoints")
        mids = np.frombuffer(msg, dtype="<f8", count=q_s, offset=pos)
        pos += 8 * q_s
        for _ in range(ngroups):
            if pos + 10 + g + 4 > len(msg):
                raise CodecError("SKCompress: truncated group block")
            grp, n_g, t = struct.unpack_from("<HII", msg, pos)
            pos += 10
            lens = np.frombuffer(msg, dtype=np.uint8, count=g, offset=pos).astype(np.int64)
            pos += g
            (nbytes,) = struct.unpack_from("<I", msg, pos)
            pos += 4
            if t == 0 or t > 4 * n_g + 1 or pos + nbytes > len(msg) or n_g > d:
                raise CodecError("SKCompress: inconsistent group sizes")
            cells = huffman_decode(msg[pos:pos + nbytes], lens, s * t)
            pos += nbytes
            kg, pos = decode_keys(msg, pos, n_g)
            rank = grp * g + minmax_query(cells.reshape(s, t), kg, seed)
            if rank.size and rank.max() >= q_s:
                raise CodecError("SKCompress: rank beyond the side's buckets")
            all_k.append(kg)
            all_v.append(sign * mids[rank])
    if pos != len(msg):
        raise CodecError("SKCompress: trailing bytes")
    keys = np.concatenate(all_k) if all_k else np.zeros(0, np.int64)
    vals = np.concatenate(all_v) if all_v else np.zeros(0)
    if keys.size != d or (keys.size and keys.max() >= max(dim, 1)):
        raise CodecError("SKCompress: key count or range disagrees with the header")
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], vals[order]
    if np.any(np.diff(keys) <= 0):
        raise CodecError("SKCompress: duplicate keys across groups")
    return keys, vals, dim


class SKCompressCodec(Codec):
    """Sparse gradients in (the nonzeros of a dense vector), the same out; decode–sum–re-encode."""

    name = "skcompress"
    homomorphic = False

    def __init__(self, q: int = 256, r: int = 8, s: int = 2, colratio: float = 0.2, seed: int = 0):
        if q < 2 or r < 1 or q % r or s < 1 or not 0 < colratio:
            raise ValueError("SKCompress needs q >= 2, r dividing q, s >= 1, colratio > 0")
        self.q, self.r, self.s, self.colratio, self.seed = q, r, s, colratio, seed

    def _encode_dense(self, x: np.ndarray) -> bytes:
        keys = np.flatnonzero(x)
        return encode(keys, np.asarray(x, dtype=np.float64)[keys], x.size, q=self.q, r=self.r, s=self.s,
                      colratio=self.colratio, seed=self.seed)

    def _dense(self, payload: bytes, dim: int) -> np.ndarray:
        keys, vals, d = decode(payload)
        if d != dim:
            raise CodecError(f"SKCompress message is for dimension {d}, expected {dim}")
        out = np.zeros(dim, np.float64)
        out[keys] = vals
        return out

    def encode(self, x, state, rng, ctx: Context) -> bytes:
        return self._encode_dense(np.asarray(x))

    def aggregate(self, payloads, ps_state, ctx: Context) -> bytes:
        return self._encode_dense(self.decoded_mean(payloads, ctx, dense=self._dense))

    def decode(self, payload, ctx: Context) -> np.ndarray:
        return self._dense(payload, ctx.dim).astype(np.float32)
