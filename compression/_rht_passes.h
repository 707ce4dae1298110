/*
 * The SIMD FWHT's passes (compression/_kernels.c, "AVX2 FWHT" says the blocking), written
 * once for any vector width and included once per instruction set, inside that set's target
 * pragma.  The includer defines (the header undefines the macros at its end):
 *   V, VW, VP        the float vector type, its lanes (8: AVX2, 16: AVX-512) and its
 *                    intrinsics' prefix (_mm256, _mm512);
 *   NS(name)         the instruction set's suffix on every function here;
 *   NS(inreg)(v)     the stages h = 1 .. VW/2 inside one vector;
 *   NS(signmask)(bits)  VW sign bits (the packed diagonal from coordinate i) as a float xor mask;
 *   NS(in)(in, kind, i)  VW coordinates of the source from i;
 *   NS(encode)(e, i, v)  the indices of VW scaled coordinates into e's sink;
 *   NS(store_first)(dst, v, k)  the first k < VW lanes of v to dst.
 * A leaf is 8 vectors, LEAF coordinates (stages 1 .. LEAF/2 in registers).  Every width
 * performs the same float32 operations on every coordinate in the same stage order, so every
 * instantiation is bit-identical to the scalar FWHT.
 */

#define VCAT_(a, b) a##b
#define VCAT(a, b) VCAT_(a, b)
#define VOP(op) VCAT(VP, op)          /* VOP(_add_ps): _mm256_add_ps or _mm512_add_ps */
#define LEAF (8 * VW)
#define VLOADU VOP(_loadu_ps)
#define VLOADA VOP(_load_ps)
#define VSTOREU VOP(_storeu_ps)
#define VSTOREA VOP(_store_ps)
#define VADD VOP(_add_ps)
#define VSUB VOP(_sub_ps)
#define VXOR VOP(_xor_ps)

/* The sink of the last pass (kind a constant: SINK_NONE stores v at p): after the scale,
 * indices, the decoded coordinates times D (the first ndst only), or + the carry. */
static AI void NS(epi)(const epi_t *e, const int kind, float *p, size_t i, V v) {
    if (kind == SINK_NONE) {
        VSTOREU(p, v);
        return;
    }
    v = VOP(_mul_ps)(v, VOP(_set1_ps)(e->scale));
    switch (kind) {
    case EPI_ENCODE:
        NS(encode)(e, i, v);
        break;
    case EPI_DECODE:
        v = VXOR(v, NS(signmask)(e->signs + (i >> 3)));
        if (i + VW <= e->ndst) VSTOREU(e->dst + i, v);
        else if (i < e->ndst) NS(store_first)(e->dst + i, v, e->ndst - i);
        break;
    case EPI_ADD:
        VSTOREU(e->dst + i, e->carry ? VADD(v, VLOADU(e->carry + i)) : v);
        break;
    default:
        VSTOREU(e->dst + i, v);
    }
}

static inline void NS(bf)(V *a, V *b) {
    V t = *a;
    *a = VADD(t, *b);
    *b = VSUB(t, *b);
}

static inline void NS(radix)(V *r, const int nst) {
    if (nst >= 1) { NS(bf)(r + 0, r + 1); if (nst >= 2) { NS(bf)(r + 2, r + 3); } if (nst >= 3) { NS(bf)(r + 4, r + 5); NS(bf)(r + 6, r + 7); } }
    if (nst >= 2) { NS(bf)(r + 0, r + 2); NS(bf)(r + 1, r + 3); if (nst >= 3) { NS(bf)(r + 4, r + 6); NS(bf)(r + 5, r + 7); } }
    if (nst >= 3) { NS(bf)(r + 0, r + 4); NS(bf)(r + 1, r + 5); NS(bf)(r + 2, r + 6); NS(bf)(r + 3, r + 7); }
}

/* Stages 1 .. LEAF/2 of the LEAF coordinates from i, read from the source (kind a constant),
 * into dst: the stages inside a register, then three across the 8 registers. */
static AI void NS(leaf)(float *dst, size_t i, const in_t *in, const int kind) {
    V r[8];
    if (kind == IN_SIGNS) {
        float t[LEAF];
        const float *x = xspan(in, i, LEAF, t);
        for (int k = 0; k < 8; k++)
            r[k] = NS(inreg)(VXOR(VLOADU(x + VW * k), NS(signmask)(in->signs + ((i + VW * k) >> 3))));
    } else {
        for (int k = 0; k < 8; k++) r[k] = NS(inreg)(NS(in)(in, kind, i + VW * k));
    }
    NS(radix)(r, 3);
    for (int k = 0; k < 8; k++) VSTOREU(dst + VW * k, r[k]);
}

/* nst (1..3) stages of strides h, 2h, ... on the `size` floats at src, written to dst (which
 * may be src) or to the sink (kind a constant), src[j] being coordinate ibase + j. */
static AI void NS(lpass_n)(const float *src, float *dst, size_t ibase, size_t size, size_t h, const int nst,
                       const epi_t *e, const int ek) {
    const size_t span = h << nst;
    for (size_t g = 0; g < size; g += span)
        for (size_t j = g; j < g + h; j += VW) {
            V r[8];
            for (int k = 0; k < (1 << nst); k++) r[k] = VLOADU(src + j + k * h);
            NS(radix)(r, nst);
            for (int k = 0; k < (1 << nst); k++) NS(epi)(e, ek, dst + j + k * h, ibase + j + k * h, r[k]);
        }
}

#define LPASS_EK(ek)                                                          \
    do {                                                                      \
        if (nst == 1) NS(lpass_n)(src, dst, ibase, size, h, 1, e, ek);        \
        else if (nst == 2) NS(lpass_n)(src, dst, ibase, size, h, 2, e, ek);   \
        else NS(lpass_n)(src, dst, ibase, size, h, 3, e, ek);                 \
    } while (0)

static void NS(lpass)(const float *src, float *dst, size_t ibase, size_t size, size_t h, int nst, const epi_t *e) {
    switch (e ? e->kind : SINK_NONE) {
    case EPI_ENCODE: LPASS_EK(EPI_ENCODE); break;
    case EPI_DECODE: LPASS_EK(EPI_DECODE); break;
    case EPI_ADD: LPASS_EK(EPI_ADD); break;
    case EPI_SCALE: LPASS_EK(EPI_SCALE); break;
    default: LPASS_EK(SINK_NONE); break;
    }
}

/* Stages h .. size/2 of the `size` floats at buf (coordinates ibase on) in passes of <= 3
 * stages, the short one first, in place; the last pass writes dst, or the sink `e`. */
static void NS(lstages)(float *buf, float *dst, size_t ibase, size_t size, size_t h, const epi_t *e) {
    for (int m = log2_of(size / h); m > 0;) {
        const int nst = m % 3 ? m % 3 : 3;
        NS(lpass)(buf, m == nst ? dst : buf, ibase, size, h, nst, m == nst ? e : NULL);
        h <<= nst;
        m -= nst;
    }
}

/* Every stage of the low chunk w[base, base + size) (size >= LEAF), in place: L1 piece by
 * L1 piece the leaves, which read the source, and the piece's stages; then the chunk's
 * stages above the piece.  `e`: the sink of the last pass, given when the chunk is the whole
 * block. */
static AI void NS(low_n)(float *w, size_t base, size_t size, const in_t *in, const int ik, const epi_t *e, size_t n) {
    const size_t piece = size < L1_FLOATS ? size : L1_FLOATS;
    const int pf = LOW_PREFETCH && base + 2 * size <= n && ik != IN_SIGNS;
    for (size_t s = base; s < base + size; s += piece) {
        for (size_t i = s; i < s + piece; i += LEAF) {
            if (pf) {       /* the next chunk's source, one chunk ahead, into L2 */
                const char *q = ik == IN_BYTES ? (const char *)(in->idx + i + size)
                                : ik == IN_NIBBLES ? (const char *)(in->idx + ((i + size) >> 1))
                                                   : (const char *)(in->x + i + size);
                const int lines = ik == IN_BYTES    ? LEAF / 64
                                  : ik == IN_NIBBLES ? (LEAF >= 128 ? LEAF / 128 : (i & 64) == 0)
                                                     : LEAF / 16;
                for (int l = 0; l < lines; l++) _mm_prefetch(q + 64 * l, _MM_HINT_T1);
            }
            NS(leaf)(w + i, i, in, ik);
        }
        NS(lstages)(w + s, w + s, s, piece, LEAF, piece == size ? e : NULL);
    }
    if (piece < size) NS(lstages)(w + base, w + base, base, size, piece, e);
}

static void NS(low)(float *w, size_t base, size_t size, const in_t *in, const epi_t *e, size_t n) {
    switch (in->kind) {
    case IN_SIGNS: NS(low_n)(w, base, size, in, IN_SIGNS, e, n); break;
    case IN_VALUES: NS(low_n)(w, base, size, in, IN_VALUES, e, n); break;
    case IN_NIBBLES: NS(low_n)(w, base, size, in, IN_NIBBLES, e, n); break;
    case IN_BYTES: NS(low_n)(w, base, size, in, IN_BYTES, e, n); break;
    default: NS(low_n)(w, base, size, in, IN_FLOATS, e, n); break;
    }
}

/* The strip's rows of buf (cols floats each, aligned) out to xs (rows h0 apart) through the
 * sink, row by row (kind a constant); row r column j is coordinate ibase + r·h0 + j. */
static AI void NS(strip_out_n)(const float *buf, float *xs, size_t ibase, size_t h0, size_t rows, size_t cols,
                           const epi_t *e, const int ek) {
    for (size_t r = 0; r < rows; r++)
        for (size_t j = 0; j < cols; j += VW)
            NS(epi)(e, ek, xs + r * h0 + j, ibase + r * h0 + j, VLOADA(buf + r * cols + j));
}

static void NS(strip_out)(const float *buf, float *xs, size_t ibase, size_t h0, size_t rows, size_t cols,
                      const epi_t *e) {
    switch (e ? e->kind : SINK_NONE) {
    case EPI_ENCODE: NS(strip_out_n)(buf, xs, ibase, h0, rows, cols, e, EPI_ENCODE); break;
    case EPI_DECODE: NS(strip_out_n)(buf, xs, ibase, h0, rows, cols, e, EPI_DECODE); break;
    case EPI_ADD: NS(strip_out_n)(buf, xs, ibase, h0, rows, cols, e, EPI_ADD); break;
    case EPI_SCALE: NS(strip_out_n)(buf, xs, ibase, h0, rows, cols, e, EPI_SCALE); break;
    default: NS(strip_out_n)(buf, xs, ibase, h0, rows, cols, e, SINK_NONE); break;
    }
}

/* The first nst (1..3) stages of a strip (row strides 1, 2, 4 of `rows` rows h0 floats
 * apart in x, cols floats each) into the contiguous buf (rows cols apart), prefetching the
 * next strip's line of each row read (pf floats on) and of the carried vector pc, if any. */
static AI void NS(strip_in_n)(const float *xs, size_t h0, float *buf, size_t rows, const int nst, size_t cols, size_t pf,
                          const float *pc) {
    for (size_t ihi = 0; ihi < rows; ihi += (size_t)1 << nst)
        for (size_t j = 0; j < cols; j += VW) {
            V r[8];
            if (pf && !(j & 15))
                for (int k = 0; k < (1 << nst); k++) {
                    _mm_prefetch((const char *)(xs + (ihi + k) * h0 + j + pf), _MM_HINT_T0);
                    if (pc) _mm_prefetch((const char *)(pc + (ihi + k) * h0 + j + pf), _MM_HINT_T0);
                }
            for (int k = 0; k < (1 << nst); k++) r[k] = VLOADU(xs + (ihi + k) * h0 + j);
            NS(radix)(r, nst);
            for (int k = 0; k < (1 << nst); k++) VSTOREA(buf + (ihi + k) * cols + j, r[k]);
        }
}

/* Stages h0 <= h < h1 of x[0, n) (n a multiple of h1).  Up to 3 of them: one radix pass in
 * place, chunk by chunk (rows h0 apart, 8 vectors at once).  More, or a sink adding a carried
 * vector: strip by strip; the first pass of a strip (rows h0 apart x cols) reads its rows, at
 * most 8 at once, into a contiguous buffer, the strip's other stages run there in L1, and it
 * goes back row by row through the sink (if any).  Rows h0 apart share cache sets (all of
 * them in L1 and in L2 when h0 is a multiple of 64 KiB): a pass writing 8 rows at once beside
 * 8 rows of the carried vector evicts its own lines; row by row, the lines of a row are
 * consecutive. */
static void NS(run_stages)(float *x, size_t ibase, size_t n, size_t h0, size_t h1, const epi_t *e) {
    static __thread float buf[STRIP_MAX] __attribute__((aligned(64)));
    const size_t rows = h1 / h0;
    const int m = log2_of(rows), nst = m % 3 ? m % 3 : 3;
    if (m <= 3 && !(e && e->kind == EPI_ADD && e->carry)) {
        for (size_t b = 0; b < n; b += h1) NS(lpass)(x + b, x + b, ibase + b, h1, h0, m, e);
        return;
    }
    size_t cols = (STRIP_FLOATS < STRIP_MAX ? STRIP_FLOATS : STRIP_MAX) / rows;
    if (cols < 16) cols = 16;
    if (cols > h0) cols = h0;
    const float *carry = e && e->kind == EPI_ADD ? e->carry : NULL;
    for (size_t b = 0; b < n; b += h1)
        for (size_t c = 0; c < h0; c += cols) {
            float *xs = x + b + c;
            const size_t ib = ibase + b + c, pf = c + cols < h0 ? cols : 0;
            const float *pc = carry ? carry + ib : NULL;
            if (nst == 1) NS(strip_in_n)(xs, h0, buf, rows, 1, cols, pf, pc);
            else if (nst == 2) NS(strip_in_n)(xs, h0, buf, rows, 2, cols, pf, pc);
            else NS(strip_in_n)(xs, h0, buf, rows, 3, cols, pf, pc);
            if (m > nst) NS(lstages)(buf, buf, 0, rows * cols, cols << nst, NULL);   /* strides cols·2^s */
            NS(strip_out)(buf, xs, ib, h0, rows, cols, e);
        }
}

/* All stages below bounds[k] of the chunk w[base, base + bounds[k]): the chunks of the level
 * below first, then this level's stages strip by strip.  Only the top level has a sink. */
static void NS(rht_level)(float *w, size_t base, const size_t *bounds, int k, int top, const in_t *in, const epi_t *e) {
    if (k == 0) {
        NS(low)(w, base, bounds[0], in, e, bounds[top]);
        return;
    }
    for (size_t b = base; b < base + bounds[k]; b += bounds[k - 1]) NS(rht_level)(w, b, bounds, k - 1, top, in, NULL);
    NS(run_stages)(w + base, base, bounds[k], bounds[k - 1], bounds[k], e);
}

/* source -> FWHT of n >= 2·LEAF coordinates in w -> sink: low chunks of LOW_FLOATS, then as
 * few levels of <= TOP_BITS stages as cover the rest. */
static void NS(rht)(float *w, size_t n, const in_t *in, const epi_t *e) {
    size_t bounds[64];
    int k = 0;
    bounds[0] = n < LOW_FLOATS ? n : LOW_FLOATS;
    int rest = log2_of(n / bounds[0]);
    const int levels = (rest + TOP_BITS - 1) / TOP_BITS;
    for (int i = 0; i < levels; i++) {
        const int step = rest / (levels - i);
        bounds[k + 1] = bounds[k] << step;
        rest -= step;
        k++;
    }
    NS(rht_level)(w, 0, bounds, k, k, in, e);
}

#undef LPASS_EK
#undef VCAT_
#undef VCAT
#undef VOP
#undef LEAF
#undef VLOADU
#undef VLOADA
#undef VSTOREU
#undef VSTOREA
#undef VADD
#undef VSUB
#undef VXOR
#undef V
#undef VW
#undef VP
#undef NS
