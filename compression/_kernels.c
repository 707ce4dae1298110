/*
 * Worker-side THC kernels: the randomized Hadamard transform (paper §5.1) and the worker's
 * encode and decode of Alg. 3 (lines 9-16 and 19-22), each fused into one C call.
 *
 *   fwht:        normalized Walsh-Hadamard transform in place (§5.1, H of RHT = H·D·x).
 *   rht_encode:  signs D (packed random bits) + FWHT + 1/sqrt(p) + clamp to [-M, M] + grid map
 *                y = (R + M) g / 2M + unbiased stochastic rounding to table indices (App. B),
 *                written as bytes or packed b-bit, MSB first (4 bits: high nibble first).  Lines 9-16.
 *   rht_decode:  table-domain values (float Y/k, or own indices looked up in T) -> affine map
 *                m + v (M - m)/g -> FWHT + 1/sqrt(p) -> signs D.  Lines 19-22.  The 8-bit
 *                lanes' Y/k: a table of float32(b/k), divided on the AVX2 path (same values).
 *   rht_rotate:  signs D + FWHT + 1/sqrt(p), plus a carried vector: R = H·D·x + e, the rotation of
 *                a job whose D is fixed (error feedback kept in the rotated domain).  Line 9.
 *                x may come in pieces (a gradient tensor by tensor), read where they lie.
 *   quantize_ef: clamp + grid map + stochastic rounding of an already rotated block (lines 11-16),
 *                and in the same pass the block's own quantization error R − X in the rotated
 *                domain (line 22 without its RHT⁻¹).
 *   sumsq:       a block's sum of squares for its norm (§5.2), in 16 float64 lanes in a fixed order.
 *   quantize, apply_signs: the previous separate passes (kept for the "before" benchmark).
 *
 * The stochastic rounding's uniforms come from a float32 buffer or, given a 64-bit key, from
 * the counter generator of compression/stochastic.py computed in the sink (no buffer of d
 * uniforms is written or read): coordinate i of the round's padded vector takes half of
 * SplitMix64's output for counter i/2 (Steele, Lea & Flood, OOPSLA 2014), 24 bits.
 *
 * Exactness.  Every path performs the same IEEE float32 operations on every coordinate in
 * the same order: the FWHT applies its radix-2 stages h = 1, 2, 4, ... in increasing order
 * (a + b to the lower index, a - b to the upper), whatever the blocking; the scale is one
 * multiply after the last stage; no FMA contraction (-ffp-contract=off), and the AVX2 code's
 * explicit FMAs multiply by ±1, which is exact.  So the AVX-512 and AVX2 paths are bit-identical
 * to the scalar one and all are single-threaded: a worker's encode is the same bytes in every
 * process, which the exact end-to-end checks (every chunk of every round against an
 * in-process reference) need.
 *
 * Dispatch: the best path the CPU has (__builtin_cpu_supports: AVX-512 F+BW+DQ+VL, else
 * AVX2+FMA, else scalar), or the one THC_KERNELS=scalar|avx2|avx512 names at import; every
 * entry point also takes simd=0 (scalar) / 1 (AVX2) / 2 (AVX-512) / -1 (auto).  A kernel
 * without AVX-512 code (the norms' sum of squares) runs its AVX2 code at level 2.  The FWHT's
 * passes are written once (_rht_passes.h) and included for each vector width.
 * compression/thc.py holds the numpy reference these must match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define THC_HAVE_AVX2 1
#include <immintrin.h>
#else
#define THC_HAVE_AVX2 0
#endif
#include "../proto/lanes.h"

/* Paths: 0 scalar, 1 AVX2 (+FMA), 2 AVX-512 (F, BW, DQ, VL) where a kernel has such code and
 * AVX2 elsewhere (a kernel without AVX-512 code takes its AVX2 path at level 2). */
static int cpu_level = 0;    /* the best path this CPU (and build) runs */
static int auto_simd = 0;    /* what simd=-1 means: cpu_level, or less when THC_KERNELS asks */
static const char *const LEVEL_NAMES[] = {"scalar", "avx2", "avx512"};

/* ------------------------------------------------------------------ quantizer tables */

/* Per integer grid cell q in [0, g]: the table interval j it falls in, T[j] and 1/(T[j+1]-T[j]). */
typedef struct {
    int32_t iv[256];
    float lo[256], inv[256];
    float m, s, gf, yz;      /* M, g/2M, g; yz = g/2 for an all-zero round (M = 0) */
    int zero;
    /* for the shuffle path (<= 32 levels, g <= 63): iv[c] as bytes, 16 per 128-bit half and
     * each half repeated (pshufb looks up within a half); T[j] and 1/(T[j+1]-T[j]) by j */
    int shuffle, levels;
    uint8_t ivb[4][32];
    float tabj[32], invj[32];
} qtab_t;

static int qtab_init(qtab_t *q, double big_m, int g, const uint8_t *tab, Py_ssize_t levels) {
    if (levels < 2 || levels > 256 || g < 1 || g > 255 || tab[0] != 0 || tab[levels - 1] != g) return -1;
    for (Py_ssize_t i = 1; i < levels; i++)
        if (tab[i] <= tab[i - 1]) return -1;
    memset(q->iv, 0, sizeof q->iv);      /* the AVX-512 permutes load cells 0..63, whatever g */
    for (int c = 0, j = 0; c <= g; c++) {
        while (j < levels - 2 && tab[j + 1] <= c) j++;
        q->iv[c] = j;
        q->lo[c] = tab[j];
        q->inv[c] = 1.0f / (float)(tab[j + 1] - tab[j]);
    }
    q->shuffle = levels <= 32 && g <= 63;
    q->levels = (int)levels;
    memset(q->ivb, 0, sizeof q->ivb);
    memset(q->tabj, 0, sizeof q->tabj);
    memset(q->invj, 0, sizeof q->invj);
    for (int c = 0; c <= g && q->shuffle; c++) q->ivb[c >> 4][c & 15] = q->ivb[c >> 4][16 + (c & 15)] = (uint8_t)q->iv[c];
    for (Py_ssize_t j = 0; j + 1 < levels && j < 32; j++) {
        q->tabj[j] = tab[j];
        q->invj[j] = 1.0f / (float)(tab[j + 1] - tab[j]);
    }
    q->zero = !(big_m > 0);
    q->m = (float)big_m;
    q->s = q->zero ? 0.f : (float)(g / (2.0 * big_m));
    q->gf = (float)g;
    q->yz = (float)g / 2.0f;
    return 0;
}

/* ------------------------------------------------------------------ counter uniforms */

#define SM64_GAMMA 0x9e3779b97f4a7c15ULL

/* SplitMix64's output function (its mix13 finalizer). */
static inline uint64_t sm64_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform i of stream `key`: k·2^-24 with k the high (i even) or next (i odd) 24 bits of
 * SplitMix64's output number i/2 + 1 from seed `key`; exact in float32. */
static inline float cu_at(uint64_t key, uint64_t i) {
    uint64_t h = sm64_mix(key + ((i >> 1) + 1) * SM64_GAMMA);
    return (float)(uint32_t)((i & 1) ? (h >> 8) & 0xFFFFFF : h >> 40) * (1.0f / 16777216.0f);
}

/* Alg. 3 lines 12-16 for one coordinate: clamp, grid map, stochastic rounding (App. B). */
static inline uint8_t quant1(const qtab_t *q, float a, float u) {
    float y = q->yz;
    if (!q->zero) {
        a = a > -q->m ? a : -q->m;       /* the AVX2 max/min below, operand for operand */
        a = a < q->m ? a : q->m;
        y = (a + q->m) * q->s;
        y = y > 0.f ? y : 0.f;
        y = y < q->gf ? y : q->gf;
    }
    int c = (int)y;
    return (uint8_t)(q->iv[c] + (u < (y - q->lo[c]) * q->inv[c]));
}

/* ------------------------------------------------------------------ sources and sinks */

enum { IN_FLOATS, IN_SIGNS, IN_VALUES, IN_NIBBLES, IN_BYTES };
enum { EPI_SCALE, EPI_ENCODE, EPI_DECODE, EPI_ADD };

/* Coordinates [start, end) of a vector given in pieces (a model's gradients, tensor by tensor). */
typedef struct {
    const float *p;
    size_t start, end;
} piece_t;

/* What the first pass reads: x (n floats; the work buffer itself for a transform in place),
 * x·D (x given in pieces, zero-padded to the block: the pieces are read where they lie, so a
 * gradient needs no copy into one vector first), or the decoder's table-domain values
 * a = v·c − m with v a float (Y/k) or T[index]. */
typedef struct {
    int kind;
    const float *x;
    const piece_t *pc;       /* IN_SIGNS: the pieces, in order, the first from 0 */
    size_t npc;
    size_t *cur;             /* IN_SIGNS: the piece the last read found (reads go up the block) */
    const uint8_t *signs;
    const uint8_t *idx;
    float tabf[256];
    float divk;              /* IN_BYTES: tabf[b] is float32(b) / divk for every b (0: not so) */
    float c, m;
} in_t;

/* What the last pass writes (after the 1/sqrt(p) scale): the block into dst (EPI_SCALE),
 * table indices (bytes or packed nibbles), the decoded coordinates times D into dst (first
 * ndst only), or the block plus a carried vector into dst (EPI_ADD).  dst may be the work
 * buffer the transform runs in (in place) or another vector. */
typedef struct {
    int kind;
    float scale;
    const qtab_t *q;
    const float *u;          /* the uniforms, or NULL: the counter stream (ukey, from ubase) */
    uint64_t ukey, ubase;
    uint8_t *out;
    int packed;
    const uint8_t *signs;
    float *dst;
    size_t ndst;             /* EPI_DECODE: the coordinates of dst written */
    const float *carry;      /* EPI_ADD: added after the scale (NULL: nothing) */
} epi_t;

/* What quantize_ef works with besides the quantizer: the uniforms, the index sink and the
 * own-value map a = T[z]·c − m of the residual. */
typedef struct {
    const float *u;
    uint64_t ukey, ubase;
    uint8_t *out;
    int packed;              /* 0: a byte an index; b in 1..8: b-bit indices MSB first (4: nibbles) */
    float *resid;            /* NULL: no residual */
    float tabf[256];
    int levels;
    float c, m;
} qef_t;

static inline uint32_t sign_bit(const uint8_t *bits, size_t i) {
    return (uint32_t)((bits[i >> 3] >> (7 - (i & 7))) & 1u) << 31;
}

static inline float flip(float v, uint32_t bit) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u ^= bit;
    memcpy(&v, &u, 4);
    return v;
}

/* Coordinates [i, i + len) of the pieced x: a pointer into its piece when they lie in one,
 * else copied into t (zeros past the last piece). */
static inline const float *xspan(const in_t *in, size_t i, size_t len, float *t) {
    size_t k = *in->cur;
    if (k >= in->npc || in->pc[k].start > i) k = 0;
    while (k < in->npc && in->pc[k].end <= i) k++;
    *in->cur = k;
    if (k < in->npc && i + len <= in->pc[k].end) return in->pc[k].p + (i - in->pc[k].start);
    for (size_t j = 0; j < len; j++) {
        while (k < in->npc && in->pc[k].end <= i + j) k++;
        t[j] = k < in->npc ? in->pc[k].p[i + j - in->pc[k].start] : 0.f;
    }
    return t;
}

static inline float in1(const in_t *in, size_t i) {
    switch (in->kind) {
    case IN_SIGNS: {
        float t;
        return flip(*xspan(in, i, 1, &t), sign_bit(in->signs, i));
    }
    case IN_VALUES: return in->x[i] * in->c - in->m;
    case IN_NIBBLES: return in->tabf[(in->idx[i >> 1] >> ((i & 1) ? 0 : 4)) & 15] * in->c - in->m;
    case IN_BYTES: return in->tabf[in->idx[i]] * in->c - in->m;
    default: return in->x[i];
    }
}

/* ------------------------------------------------------------------ scalar FWHT (reference) */

/* Radix-2 butterflies in a fixed order; stages with stride < 2^11 run block by block so each
 * block stays in L1/L2.  This is the kernel every other path must equal bit for bit. */
static void fwht_stages_scalar(float *x, size_t n, size_t h_from, size_t h_to) {
    for (size_t h = h_from; h < h_to; h <<= 1)
        for (size_t i = 0; i < n; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

static inline float fwht_scale(size_t n) { return (float)(1.0 / sqrt((double)n)); }

static void fwht_scalar(float *v, size_t n) {
    const size_t blk = n < 2048 ? n : 2048;
    for (size_t s = 0; s < n; s += blk) fwht_stages_scalar(v + s, blk, 1, blk);
    fwht_stages_scalar(v, n, blk, n);
    const float scale = fwht_scale(n);
    for (size_t i = 0; i < n; i++) v[i] *= scale;
}

/* source -> scalar FWHT -> sink, three plain loops (the fallback without AVX2). */
static void rht_scalar(float *w, size_t n, const in_t *in, const epi_t *e) {
    if (in->kind != IN_FLOATS || in->x != w)
        for (size_t i = 0; i < n; i++) w[i] = in1(in, i);
    fwht_scalar(w, n);
    switch (e->kind) {
    case EPI_ENCODE:
#define U_AT(i) (e->u ? e->u[i] : cu_at(e->ukey, e->ubase + (i)))
        if (e->packed)
            for (size_t i = 0; i < n; i += 2)
                e->out[i >> 1] = (uint8_t)(quant1(e->q, w[i], U_AT(i)) << 4 | quant1(e->q, w[i + 1], U_AT(i + 1)));
        else
            for (size_t i = 0; i < n; i++) e->out[i] = quant1(e->q, w[i], U_AT(i));
#undef U_AT
        break;
    case EPI_DECODE:
        for (size_t i = 0; i < e->ndst; i++) e->dst[i] = flip(w[i], sign_bit(e->signs, i));
        break;
    case EPI_ADD:
        for (size_t i = 0; i < n; i++) e->dst[i] = e->carry ? w[i] + e->carry[i] : w[i];
        break;
    default:
        if (e->dst != w) memcpy(e->dst, w, n * 4);
        break;
    }
}

static inline int log2_of(size_t v) {
    int m = 0;
    while (((size_t)1 << m) < v) m++;
    return m;
}


/* ------------------------------------------------------------------ AVX2 FWHT */

#if THC_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* Cache blocking (all in place in the block's buffer w; the passes are in _rht_passes.h, for
 * this path and the AVX-512 one alike):
 *  - low chunks of LOW_FLOATS (in L2): each L1 piece of L1_FLOATS gets stages 1..32 in
 *    registers (64-float leaves, which read the source; 128-float leaves and stages 1..64 on
 *    AVX-512), then radix-8 passes up to the piece;
 *    then radix-8 passes over the chunk up to the chunk; the leaves prefetch the next chunk's
 *    source;
 *  - above the low chunks, levels of <= TOP_BITS stages, depth first (a level's chunks are
 *    finished before its own stages run, so a chunk of a middle level is still in L3).  A level
 *    of <= 3 stages is one radix pass in place over its chunk, 8 vectors from rows a level's
 *    chunk apart (8 long sequential streams, which the hardware prefetchers follow), unless its
 *    sink adds a carried vector; that level, and a level of more stages, runs strip by strip
 *    (rows x cols of <= STRIP_FLOATS), all its stages on one strip before the next, so data
 *    beyond a cache is read and written once per level: the first pass reads the strip's rows
 *    into a contiguous buffer (prefetching the next strip), the others run there, and the strip
 *    goes back row by row (run_stages).
 * The last pass of the transform writes the sink (scale, then indices / decoded values /
 * + carry), so no pass over the block follows the transform.  Tuned on the 2-core EPYC
 * (Zen 3: 32 KiB L1d, 512 KiB L2, 32 MiB L3) against fht-cpu at 2^20 and 2^24
 * (docs/bench.md, "Walsh–Hadamard transform"); on the Zen 5 host (48 KiB L1d, 1 MiB L2)
 * larger pieces, chunks and strips did not pay (docs/bench-history.md, "2026-11-29, evening"). */
static size_t L1_FLOATS = 1 << 12, LOW_FLOATS = 1 << 15, STRIP_FLOATS = 1 << 11;
static int TOP_BITS = 3;
#define STRIP_MAX (1 << 14)
#ifndef LOW_PREFETCH
#define LOW_PREFETCH 1        /* a low chunk's leaves prefetch the next chunk's source */
#endif
#define AI inline __attribute__((always_inline))
#define SINK_NONE (-1)        /* a pass that is not the last: plain stores */

/* Stages h = 1, 2, 4 inside one register: v·(±1) + permuted v in one FMA.  The product by
 * ±1 is exact, so the FMA rounds once exactly like the scalar a + b (lower lane, as b + a)
 * and a − b (upper lane, as −b + a): the same IEEE results, bit for bit. */
static inline __m256 inreg_avx2(__m256 v) {
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));
    v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));
    return v;
}

static inline __m256 signmask_avx2(const uint8_t *bits) {
    const __m256i sel = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[0]), sel), sel);
    return _mm256_castsi256_ps(_mm256_slli_epi32(m, 31));
}

/* 8 table values T[idx] as floats: two 8-entry permutes and a blend for tables of <= 16. */
static inline __m256 lookup16(const float *tabf, __m256i idx) {
    __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tabf), idx);
    __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tabf + 8), idx);
    __m256i sel = _mm256_slli_epi32(idx, 28);          /* bit 3 -> sign bit for blendv */
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(sel));
}

/* lookup16 over 32 entries: bit 4 of the index picks the upper half (5-bit indices). */
static inline __m256 lookup32(const float *tabf, __m256i idx) {
    __m256i sel = _mm256_slli_epi32(idx, 27);          /* bit 4 -> sign bit for blendv */
    return _mm256_blendv_ps(lookup16(tabf, idx), lookup16(tabf + 16, idx), _mm256_castsi256_ps(sel));
}

static AI __m256 in_avx2(const in_t *in, const int kind, size_t i) {
    const __m256 c = _mm256_set1_ps(in->c), m = _mm256_set1_ps(in->m);
    switch (kind) {
    case IN_VALUES:
        return _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(in->x + i), c), m);
    case IN_NIBBLES: {
        uint32_t word;
        memcpy(&word, in->idx + (i >> 1), 4);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word),
                                                         _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24)),
                                       _mm256_set1_epi32(15));
        return _mm256_sub_ps(_mm256_mul_ps(lookup16(in->tabf, idx), c), m);
    }
    case IN_BYTES: {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in->idx + i)));
        __m256 v = in->divk > 0.f ? _mm256_div_ps(_mm256_cvtepi32_ps(idx), _mm256_set1_ps(in->divk))
                                  : _mm256_i32gather_ps(in->tabf, idx, 4);
        return _mm256_sub_ps(_mm256_mul_ps(v, c), m);
    }
    default:
        return _mm256_loadu_ps(in->x + i);
    }
}

/* quant1's clamp and grid map on one vector a of any width into y (P: the intrinsics' prefix,
 * _mm256 or _mm512), operand for operand: y = clamp((clamp(a, −M, M) + M)·s, 0, g). */
#define GRID_MAP(P, q, a, y)                                                    \
    do {                                                                        \
        if ((q)->zero) {                                                        \
            y = P##_set1_ps((q)->yz);                                           \
        } else {                                                                \
            a = P##_min_ps(P##_max_ps(a, P##_set1_ps(-(q)->m)), P##_set1_ps((q)->m)); \
            y = P##_mul_ps(P##_add_ps(a, P##_set1_ps((q)->m)), P##_set1_ps((q)->s)); \
            y = P##_min_ps(P##_max_ps(y, P##_setzero_ps()), P##_set1_ps((q)->gf)); \
        }                                                                       \
    } while (0)

/* quant1 on 8 lanes: the same max/min/add/mul/sub/compare, indices as int32. */
static inline __m256i quant8(const qtab_t *q, __m256 a, __m256 u) {
    __m256 y;
    GRID_MAP(_mm256, q, a, y);
    __m256i c = _mm256_cvttps_epi32(y), iv;
    __m256 lo, inv;
    if (q->shuffle) {     /* pshufb/permute lookups instead of three gathers */
        __m256i idx = _mm256_or_si256(c, _mm256_set1_epi32((int)0x80808000));   /* other bytes -> 0 */
        __m256i b4 = _mm256_slli_epi32(c, 3), b5 = _mm256_slli_epi32(c, 2);       /* bits 4, 5 -> bit 7 */
        iv = _mm256_blendv_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q->ivb[0]), idx),
                                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q->ivb[1]), idx), b4);
        if (q->gf > 31.f) {
            __m256i hi = _mm256_blendv_epi8(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q->ivb[2]), idx),
                                            _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)q->ivb[3]), idx), b4);
            iv = _mm256_blendv_epi8(iv, hi, b5);
        }
        lo = q->levels <= 16 ? lookup16(q->tabj, iv) : lookup32(q->tabj, iv);
        inv = q->levels <= 16 ? lookup16(q->invj, iv) : lookup32(q->invj, iv);
    } else {
        lo = _mm256_i32gather_ps(q->lo, c, 4);
        inv = _mm256_i32gather_ps(q->inv, c, 4);
        iv = _mm256_i32gather_epi32(q->iv, c, 4);
    }
    __m256 up = _mm256_cmp_ps(u, _mm256_mul_ps(_mm256_sub_ps(y, lo), inv), _CMP_LT_OQ);
    return _mm256_sub_epi32(iv, _mm256_castps_si256(up));     /* true = -1 */
}

/* Low 64 bits of a·b per 64-bit lane (AVX2 has no 64-bit multiply): three 32x32 products. */
static inline __m256i mul64(__m256i a, __m256i b_lo, __m256i b_hi) {
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b_lo), _mm256_slli_epi64(cross, 32));
}

/* cu_at for i..i+7: four SplitMix64 outputs, one per even-odd pair (scalar when i is odd). */
static inline __m256 cu8(uint64_t key, uint64_t i) {
    if (i & 1) {
        float t[8];
        for (int k = 0; k < 8; k++) t[k] = cu_at(key, i + k);
        return _mm256_loadu_ps(t);
    }
    const uint64_t z0 = key + ((i >> 1) + 1) * SM64_GAMMA;
    __m256i z = _mm256_add_epi64(_mm256_set1_epi64x((long long)z0),
                                 _mm256_setr_epi64x(0, (long long)SM64_GAMMA, (long long)(2 * SM64_GAMMA),
                                                    (long long)(3 * SM64_GAMMA)));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
    z = mul64(z, _mm256_set1_epi64x(0x1ce4e5b9LL), _mm256_set1_epi64x(0xbf58476dLL));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
    z = mul64(z, _mm256_set1_epi64x(0x133111ebLL), _mm256_set1_epi64x(0x94d049bbLL));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    /* 32-bit lanes 2k, 2k+1 <- the high and the next 24 bits of output k: bytes 5-7 and 1-3 of
     * the 64-bit lane, each with a zero byte above (one byte shuffle) */
    __m256i k24 = _mm256_shuffle_epi8(z, _mm256_setr_epi8(5, 6, 7, -1, 1, 2, 3, -1, 13, 14, 15, -1, 9, 10, 11, -1,
                                                           5, 6, 7, -1, 1, 2, 3, -1, 13, 14, 15, -1, 9, 10, 11, -1));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(k24), _mm256_set1_ps(1.0f / 16777216.0f));
}

/* 8 indices (int32 lanes) into out at coordinate i: packed nibbles (pair 2k, 2k+1 -> z0 << 4 | z1)
 * or one byte each. */
static inline void store_idx8(uint8_t *out, int packed, size_t i, __m256i z) {
    if (packed) {   /* pair (2k, 2k+1) -> low byte of 64-bit lane k: z0 << 4 | z1 */
        __m256i t = _mm256_or_si256(_mm256_slli_epi64(z, 4), _mm256_srli_epi64(z, 32));
        t = _mm256_shuffle_epi8(t, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                    0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
        uint32_t word = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(t)) |
                        (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(t, 1)) << 16;
        memcpy(out + (i >> 1), &word, 4);
    } else {
        __m256i t = _mm256_shuffle_epi8(z, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
        uint64_t word = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(t)) |
                        (uint64_t)(uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(t, 1)) << 32;
        memcpy(out + i, &word, 8);
    }
}

/* The encode sink's 8 lanes: quant8 with the uniforms of coordinates i.., stored as indices. */
static AI void encode_avx2(const epi_t *e, size_t i, __m256 v) {
    store_idx8(e->out, e->packed, i, quant8(e->q, v, e->u ? _mm256_loadu_ps(e->u + i) : cu8(e->ukey, e->ubase + i)));
}

static AI void store_first_avx2(float *dst, __m256 v, size_t k) {
    float t[8];
    _mm256_storeu_ps(t, v);
    memcpy(dst, t, k * 4);
}

#define V __m256
#define VW 8
#define VP _mm256
#define NS(name) name##_avx2
#include "_rht_passes.h"

/* 32 indices (four int32 vectors, coordinates i .. i+31 in order, each < 16 when packed) into
 * out as store_idx8 writes them: one saturating pack to bytes, the 128-bit halves' dwords put
 * back in coordinate order, then (packed) each pair 2k, 2k+1 -> z0·16 + z1 by one byte
 * multiply-add: the nibble pairs of store_idx8 in one 16-byte store instead of four. */
static inline void store_idx32(uint8_t *out, int packed, size_t i, __m256i z0, __m256i z1, __m256i z2, __m256i z3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(z0, z1), _mm256_packus_epi32(z2, z3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (packed) {
        __m256i w = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x0110));
        w = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
        _mm_storeu_si128((__m128i *)(out + (i >> 1)), _mm256_castsi256_si128(w));
    } else {
        _mm256_storeu_si256((__m256i *)(out + i), b);
    }
}

/* quant8 on coordinates i .. i+7 of x, and their residual x − (T[z]·c − m) (in place when
 * resid is x: the 8 values are read before they are written). */
static AI __m256i quant_ef8(const float *x, size_t i, const qtab_t *q, const qef_t *f, __m256 c, __m256 m) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256i z = quant8(q, v, f->u ? _mm256_loadu_ps(f->u + i) : cu8(f->ukey, f->ubase + i));
    if (f->resid) {
        __m256 t = f->levels <= 16 ? lookup16(f->tabf, z) : f->levels <= 32 ? lookup32(f->tabf, z)
                                                                            : _mm256_i32gather_ps(f->tabf, z, 4);
        _mm256_storeu_ps(f->resid + i, _mm256_sub_ps(v, _mm256_sub_ps(_mm256_mul_ps(t, c), m)));
    }
    return z;
}

/* quantize_ef on 8 coordinates at a time (n a multiple of 8): quant8, the indices as encode_avx2
 * stores them (32 to a store while 32 remain: an index is < 256, and < 16 when packed), then
 * x − (T[z]·c − m) in the scalar loop's operations. */
static void quant_ef_avx2(const float *x, size_t n, const qtab_t *q, const qef_t *f) {
    const __m256 c = _mm256_set1_ps(f->c), m = _mm256_set1_ps(f->m);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i z0 = quant_ef8(x, i, q, f, c, m), z1 = quant_ef8(x, i + 8, q, f, c, m);
        __m256i z2 = quant_ef8(x, i + 16, q, f, c, m), z3 = quant_ef8(x, i + 24, q, f, c, m);
        store_idx32(f->out, f->packed, i, z0, z1, z2, z3);
    }
    for (; i < n; i += 8)
        store_idx8(f->out, f->packed, i, quant_ef8(x, i, q, f, c, m));
}
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------ AVX-512: the quantizer and the FWHT */

#if THC_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")

/* cu_at for i..i+15 (i even): eight SplitMix64 outputs, one per even-odd pair, the 64-bit
 * multiplies in one instruction each (AVX-512DQ), the halves taken as cu8 takes them. */
static inline __m512 cu16(uint64_t key, uint64_t i) {
    const uint64_t z0 = key + ((i >> 1) + 1) * SM64_GAMMA;
    const __m512i steps = _mm512_setr_epi64(0, (long long)SM64_GAMMA, (long long)(2 * SM64_GAMMA),
                                            (long long)(3 * SM64_GAMMA), (long long)(4 * SM64_GAMMA),
                                            (long long)(5 * SM64_GAMMA), (long long)(6 * SM64_GAMMA),
                                            (long long)(7 * SM64_GAMMA));
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64((long long)z0), steps);
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64((long long)0xbf58476d1ce4e5b9ULL));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64((long long)0x94d049bb133111ebULL));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    const __m512i take = _mm512_broadcast_i32x4(_mm_setr_epi8(5, 6, 7, -1, 1, 2, 3, -1, 13, 14, 15, -1, 9, 10, 11, -1));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(z, take)), _mm512_set1_ps(1.0f / 16777216.0f));
}

/* The 16 uniforms of coordinates i..i+15: from the buffer u, or the counter stream `key`
 * from base + i (cu_at one by one when that is odd). */
static inline __m512 u16(const float *u, uint64_t key, uint64_t base, size_t i) {
    if (u) return _mm512_loadu_ps(u + i);
    const uint64_t at = base + i;
    if (!(at & 1)) return cu16(key, at);
    float t[16];
    for (int k = 0; k < 16; k++) t[k] = cu_at(key, at + k);
    return _mm512_loadu_ps(t);
}

/* quant8 on 16 lanes, operand for operand.  For tables of <= 32 levels and g <= 63 the
 * interval of a cell comes from two-table permutes (32 cells each) and T[j], 1/(T[j+1]-T[j])
 * from one two-table permute each (bit 4 of j picks the table); otherwise from gathers. */
static inline __m512i quant16(const qtab_t *q, __m512 a, __m512 u) {
    __m512 y;
    GRID_MAP(_mm512, q, a, y);
    __m512i c = _mm512_cvttps_epi32(y), iv;
    __m512 lo, inv;
    if (q->shuffle) {
        iv = _mm512_permutex2var_epi32(_mm512_loadu_si512(q->iv), c, _mm512_loadu_si512(q->iv + 16));
        if (q->gf > 31.f) {
            __m512i hi = _mm512_permutex2var_epi32(_mm512_loadu_si512(q->iv + 32), c, _mm512_loadu_si512(q->iv + 48));
            iv = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(c, _mm512_set1_epi32(31)), iv, hi);
        }
        lo = _mm512_permutex2var_ps(_mm512_loadu_ps(q->tabj), iv, _mm512_loadu_ps(q->tabj + 16));
        inv = _mm512_permutex2var_ps(_mm512_loadu_ps(q->invj), iv, _mm512_loadu_ps(q->invj + 16));
    } else {
        lo = _mm512_i32gather_ps(c, q->lo, 4);
        inv = _mm512_i32gather_ps(c, q->inv, 4);
        iv = _mm512_i32gather_epi32(c, q->iv, 4);
    }
    __mmask16 up = _mm512_cmp_ps_mask(u, _mm512_mul_ps(_mm512_sub_ps(y, lo), inv), _CMP_LT_OQ);
    return _mm512_mask_add_epi32(iv, up, iv, _mm512_set1_epi32(1));
}

/* 16 indices (int32 lanes) into out at coordinate i as store_idx8 writes them: packed, pair
 * (2k, 2k+1) -> z0 << 4 | z1 in the low byte of 64-bit lane k, narrowed to 8 bytes; else one
 * byte each. */
static inline void store_idx16(uint8_t *out, int packed, size_t i, __m512i z) {
    if (packed) {
        __m512i t = _mm512_or_si512(_mm512_slli_epi64(z, 4), _mm512_srli_epi64(z, 32));
        _mm_storel_epi64((__m128i *)(out + (i >> 1)), _mm512_cvtepi64_epi8(t));
    } else {
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(z));
    }
}

/* Stages h = 1, 2, 4, 8 inside one register, as inreg_avx2 (one FMA by ±1 a stage, exact):
 * the partners of stages 4 and 8 are the neighbouring 128- and 256-bit quarters. */
static inline __m512 inreg_avx512(__m512 v) {
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));
    return v;
}

/* The sign bits of 16 coordinates from bits (two bytes, the first coordinate in bit 7 of the
 * first) as a float xor mask. */
static inline __m512 signmask_avx512(const uint8_t *bits) {
    const __m512i sel = _mm512_setr_epi32(0x80, 0x40, 0x20, 0x10, 0x8, 0x4, 0x2, 0x1, 0x8000, 0x4000, 0x2000, 0x1000,
                                          0x800, 0x400, 0x200, 0x100);
    __mmask16 k = _mm512_test_epi32_mask(_mm512_set1_epi32(bits[0] | bits[1] << 8), sel);
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(k, _mm512_set1_epi32((int)0x80000000)));
}

/* in_avx2 on 16 lanes: the same loads, lookups and multiply-subtract. */
static AI __m512 in_avx512(const in_t *in, const int kind, size_t i) {
    const __m512 c = _mm512_set1_ps(in->c), m = _mm512_set1_ps(in->m);
    switch (kind) {
    case IN_VALUES:
        return _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(in->x + i), c), m);
    case IN_NIBBLES: {      /* byte k/2 to lane k, the high nibble to even k */
        __m128i b = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(in->idx + (i >> 1))),
                                     _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(b),
                                                         _mm512_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0)),
                                       _mm512_set1_epi32(15));
        return _mm512_sub_ps(_mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_loadu_ps(in->tabf)), c), m);
    }
    case IN_BYTES: {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(in->idx + i)));
        __m512 v = in->divk > 0.f ? _mm512_div_ps(_mm512_cvtepi32_ps(idx), _mm512_set1_ps(in->divk))
                                  : _mm512_i32gather_ps(idx, in->tabf, 4);
        return _mm512_sub_ps(_mm512_mul_ps(v, c), m);
    }
    default:
        return _mm512_loadu_ps(in->x + i);
    }
}

/* encode_avx2 on 16 lanes. */
static AI void encode_avx512(const epi_t *e, size_t i, __m512 v) {
    store_idx16(e->out, e->packed, i, quant16(e->q, v, u16(e->u, e->ukey, e->ubase, i)));
}

static AI void store_first_avx512(float *dst, __m512 v, size_t k) {
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << k) - 1), v);
}

#define V __m512
#define VW 16
#define VP _mm512
#define NS(name) name##_avx512
#include "_rht_passes.h"

/* quantize_ef on 16 coordinates at a time (n a multiple of 16): quant16, the indices as
 * store_idx8 writes them (packed: pair 2k, 2k+1 -> z0 << 4 | z1, one byte per 64-bit lane),
 * then x − (T[z]·c − m) in the scalar loop's operations. */
static void quant_ef_avx512(const float *x, size_t n, const qtab_t *q, const qef_t *f) {
    const __m512 c = _mm512_set1_ps(f->c), m = _mm512_set1_ps(f->m);
    const int small = f->levels <= 32;
    const __m512 tab_lo = _mm512_loadu_ps(f->tabf), tab_hi = _mm512_loadu_ps(f->tabf + 16);
    for (size_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512i z = quant16(q, v, u16(f->u, f->ukey, f->ubase, i));
        store_idx16(f->out, f->packed, i, z);
        if (f->resid) {
            __m512 t = small ? _mm512_permutex2var_ps(tab_lo, z, tab_hi) : _mm512_i32gather_ps(z, f->tabf, 4);
            _mm512_storeu_ps(f->resid + i, _mm512_sub_ps(v, _mm512_sub_ps(_mm512_mul_ps(t, c), m)));
        }
    }
}
#pragma GCC pop_options
#endif

/* One entry for every path; n a power of two. */
static void rht_run(int simd, float *w, size_t n, const in_t *in, epi_t *e) {
    e->scale = fwht_scale(n);
#if THC_HAVE_AVX2
    if (simd >= 2 && n >= 256) {     /* the sink is a pass after the leaves: two leaves at least */
        rht_avx512(w, n, in, e);
        return;
    }
    if (simd && n >= 128) {
        rht_avx2(w, n, in, e);
        return;
    }
#endif
    rht_scalar(w, n, in, e);
}

/* Alg. 3 lines 11-16 on a rotated block, and its own error R − X (line 22 in the rotated
 * domain): per coordinate z = quant1(x, u), then x − (T[z]·c − m), c = float32(2M/g) and
 * m = float32(M) — the decode of the worker's own indices with k = 1, operation for operation. */
static void quant_ef_scalar(const float *x, size_t n, const qtab_t *q, const qef_t *f) {
    for (size_t i = 0; i < n; i++) {
        uint8_t z = quant1(q, x[i], f->u ? f->u[i] : cu_at(f->ukey, f->ubase + i));
        if (f->packed) {
            if (i & 1) f->out[i >> 1] = (uint8_t)(f->out[i >> 1] | z);
            else f->out[i >> 1] = (uint8_t)(z << 4);
        } else {
            f->out[i] = z;
        }
        if (f->resid) f->resid[i] = x[i] - (f->tabf[z] * f->c - f->m);
    }
}

/* The sub-byte packing path of a kernel level: BMI2 from AVX2 up where the CPU has it, scalar
 * at level 0 (THC_KERNELS=scalar runs no instruction beyond the base ISA). */
static int lanes_best = 0;   /* lanes_best_path(), taken once at import */
static int pack_path(int simd) {
    return simd >= 2 ? lanes_best : (simd == 1 && lanes_best >= 1 ? 1 : 0);
}

static void quant_ef_run(int simd, const float *x, size_t n, const qtab_t *q, const qef_t *f);

/* Indices of b bits other than nibbles (f->packed = b, b != 4): a tile of them as bytes, then
 * packed MSB first (proto/lanes.h, the wire's index packing); each tile but the last is a
 * multiple of 8 coordinates, so its bytes are whole and the next tile starts on a byte. */
#define QEF_TILE 2048
static void quant_ef_bits(int simd, const float *x, size_t n, const qtab_t *q, const qef_t *f) {
    uint8_t z[QEF_TILE];
    const int b = f->packed, path = pack_path(simd);
    qef_t t = *f;
    t.packed = 0;
    t.out = z;
    for (size_t i = 0; i < n; i += QEF_TILE) {
        const size_t len = n - i < QEF_TILE ? n - i : QEF_TILE;
        quant_ef_run(simd, x + i, len, q, &t);
        if (b == 8) memcpy(f->out + i, z, len);
        else lanes_pack(f->out + i / 8 * (size_t)b, z, len, b, path);
        if (t.u) t.u += len;
        t.ubase += len;
        if (t.resid) t.resid += len;
    }
}

/* The widest path the level allows on the longest prefix it takes (a multiple of its 16 or 8
 * lanes), the rest on the next narrower one, from that coordinate on (the same streams and
 * sinks, offset). */
static void quant_ef_run(int simd, const float *x, size_t n, const qtab_t *q, const qef_t *f) {
    if (f->packed && f->packed != 4) {
        quant_ef_bits(simd, x, n, q, f);
        return;
    }
    size_t done = 0;
#if THC_HAVE_AVX2
    if (simd >= 2) quant_ef_avx512(x, done = n & ~(size_t)15, q, f);
    else if (simd) quant_ef_avx2(x, done = n & ~(size_t)7, q, f);
#endif
    if (!simd) quant_ef_scalar(x, done = n, q, f);
    if (done == n) return;
    qef_t rest = *f;
    if (rest.u) rest.u += done;
    rest.ubase += done;
    rest.out += f->packed ? done >> 1 : done;
    if (rest.resid) rest.resid += done;
    quant_ef_run(simd >= 2 ? 1 : 0, x + done, n - done, q, &rest);
}

/* ------------------------------------------------------------------ block norm (sum of squares) */

/* Σ x_i² of a block, defined to the bit whatever the build (docs/protocol.md §4 step 2): 16
 * float64 partial sums, S_k = Σ x_i² over i ≡ k (mod 16) added in increasing i, then
 * S_0 + S_1 + … + S_15 added in that order.  A float32 square is exact in float64, so a fused
 * multiply-add rounds exactly like the separate multiply and add: FMA or not, AVX2 or scalar,
 * the result is the same; numpy's float32 dot (BLAS) would round in an order of its own. */
#define SUMSQ_LANES 16

static double sumsq_finish(const double *acc, const float *x, size_t i, size_t n) {
    double lane[SUMSQ_LANES], s = 0.0;
    memcpy(lane, acc, sizeof lane);
    for (; i < n; i++) lane[i % SUMSQ_LANES] += (double)x[i] * (double)x[i];
    for (int k = 0; k < SUMSQ_LANES; k++) s += lane[k];
    return s;
}

static double sumsq_scalar(const float *x, size_t n) {
    double acc[SUMSQ_LANES] = {0};
    size_t i = 0;
    for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)
        for (int k = 0; k < SUMSQ_LANES; k++) acc[k] += (double)x[i + k] * (double)x[i + k];
    return sumsq_finish(acc, x, i, n);
}

#if THC_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
static double sumsq_avx2(const float *x, size_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;      /* lanes 0-3, 4-7, 8-11, 12-15 */
    size_t i = 0;
    for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v0)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v0, 1));
        __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(v1)), d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(v1, 1));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(d0, d0));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(d1, d1));
        a2 = _mm256_add_pd(a2, _mm256_mul_pd(d2, d2));
        a3 = _mm256_add_pd(a3, _mm256_mul_pd(d3, d3));
    }
    double acc[SUMSQ_LANES];
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2);
    _mm256_storeu_pd(acc + 12, a3);
    return sumsq_finish(acc, x, i, n);
}
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------ Python entry points */

static int pick_simd(int simd) {
    if (simd < 0) return auto_simd;
    if (simd > 2) {
        PyErr_Format(PyExc_ValueError, "simd=%d: expected -1 (auto), 0 (scalar), 1 (AVX2) or 2 (AVX-512)", simd);
        return -1;
    }
    if (simd > cpu_level) {
        PyErr_Format(PyExc_RuntimeError, "simd=%d: this CPU (or build) has no %s", simd,
                     simd == 2 ? "AVX-512 (F, BW, DQ, VL)" : "AVX2");
        return -1;
    }
    return simd;
}

static int is_pow2(size_t n) { return n && !(n & (n - 1)); }

static PyObject *fail(Py_buffer **bufs, int nbufs, const char *msg) {
    for (int i = 0; i < nbufs; i++)
        if (bufs[i]->obj) PyBuffer_Release(bufs[i]);
    if (msg) PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static void release(Py_buffer **bufs, int nbufs) {
    for (int i = 0; i < nbufs; i++)
        if (bufs[i]->obj) PyBuffer_Release(bufs[i]);
}

/* Run with the GIL released, then release the buffers. */
static PyObject *run_released(int simd, float *w, size_t n, const in_t *in, epi_t *e, Py_buffer **bufs, int nbufs) {
    Py_BEGIN_ALLOW_THREADS
    rht_run(simd, w, n, in, e);
    Py_END_ALLOW_THREADS
    release(bufs, nbufs);
    Py_RETURN_NONE;
}

/* The uniforms argument of rht_encode and quantize_ef: a float32 buffer (into u), or a tuple
 * (key, base) of the counter stream; 0 on success, -1 with the Python error set. */
static int get_uniforms(PyObject *uobj, Py_buffer *u, unsigned long long *ukey, unsigned long long *ubase) {
    if (PyTuple_Check(uobj)) return PyArg_ParseTuple(uobj, "KK", ukey, ubase) ? 0 : -1;
    return PyObject_GetBuffer(uobj, u, PyBUF_SIMPLE);
}

/* x as pieces: a float32 buffer, or a tuple or list of them (concatenated).  Fills px (one
 * Py_buffer per piece, PyMem_Malloc'd) and pc; returns the total length in floats, or -1 with
 * the Python error set.  drop_pieces releases them. */
typedef struct {
    Py_buffer *b;
    piece_t *pc;
    size_t n;
} pieces_t;

static void drop_pieces(pieces_t *ps) {
    for (size_t k = 0; k < ps->n; k++)
        if (ps->b[k].obj) PyBuffer_Release(&ps->b[k]);
    PyMem_Free(ps->b);
    PyMem_Free(ps->pc);
    ps->b = NULL;
    ps->pc = NULL;
    ps->n = 0;
}

static Py_ssize_t get_pieces(PyObject *obj, pieces_t *ps) {
    PyObject *seq = PyTuple_Check(obj) || PyList_Check(obj) ? PySequence_Fast(obj, "pieces") : NULL;
    const size_t n = seq ? (size_t)PySequence_Fast_GET_SIZE(seq) : 1;
    ps->b = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    ps->pc = PyMem_Calloc(n ? n : 1, sizeof(piece_t));
    ps->n = n;
    size_t total = 0;
    if (!ps->b || !ps->pc) {
        PyErr_NoMemory();
        goto bad;
    }
    for (size_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(seq ? PySequence_Fast_GET_ITEM(seq, k) : obj, &ps->b[k], PyBUF_C_CONTIGUOUS) < 0) goto bad;
        if (ps->b[k].itemsize != 4 || ps->b[k].len % 4) {
            PyErr_SetString(PyExc_ValueError, "x: every piece must be float32");
            goto bad;
        }
        ps->pc[k] = (piece_t){.p = ps->b[k].buf, .start = total, .end = total + (size_t)ps->b[k].len / 4};
        total = ps->pc[k].end;
    }
    Py_XDECREF(seq);
    return (Py_ssize_t)total;
bad:
    Py_XDECREF(seq);
    drop_pieces(ps);
    return -1;
}

/* fwht(x: float32 writable buf, simd=-1): normalized FWHT in place (length a power of two). */
static PyObject *py_fwht(PyObject *self, PyObject *args) {
    Py_buffer x = {0};
    int simd = -1;
    if (!PyArg_ParseTuple(args, "w*|i", &x, &simd)) return NULL;
    Py_buffer *bufs[] = {&x};
    size_t n = (size_t)x.len / 4;
    if (!is_pow2(n)) return fail(bufs, 1, "fwht: length must be a power of two");
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 1, NULL);
    in_t in = {.kind = IN_FLOATS, .x = x.buf};
    epi_t e = {.kind = EPI_SCALE, .dst = x.buf};
    return run_released(simd, x.buf, n, &in, &e, bufs, 1);
}

/* The `packed` argument of rht_encode and quantize_ef: 0 (a byte an index) or b in 1..8
 * (b-bit indices MSB first) for n indices of a table of `levels`, into `out_len` bytes; the
 * packed indices must end on a byte (the next block or span starts on one). */
static int packing_ok(int packed, size_t n, Py_ssize_t levels, Py_ssize_t out_len) {
    if (packed == 0) return (size_t)out_len >= n;
    return packed >= 1 && packed <= 8 && levels <= (1 << packed) && (n * (size_t)packed) % 8 == 0 &&
           (size_t)out_len >= n * (size_t)packed / 8;
}

/* rht_encode(x: float32 buf (n <= p values, zero-padded to p), p, signs: bytes, M, g,
 *            table: bytes, uniforms, out: uint8 buf, packed: 0 or bits,
 *            work: float32 writable buf (>= p), simd=-1)
 * uniforms: a float32 buf of >= p values, or (key, base): the counter stream `key` from its
 * uniform number `base` on (the block's offset in the round's padded vector).  Indices of b
 * bits other than 4 are quantized from the scaled transform in the work buffer by the
 * quantize_ef pass (the same operations on the same values as the fused sink). */
static PyObject *py_rht_encode(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, sg = {0}, t = {0}, u = {0}, o = {0}, w = {0};
    Py_ssize_t p;
    double big_m;
    int g, packed, simd = -1;
    PyObject *uobj;
    unsigned long long ukey = 0, ubase = 0;
    if (!PyArg_ParseTuple(args, "y*ny*diy*Ow*iw*|i", &x, &p, &sg, &big_m, &g, &t, &uobj, &o, &packed, &w, &simd))
        return NULL;
    Py_buffer *bufs[] = {&x, &sg, &t, &u, &o, &w};
    if (get_uniforms(uobj, &u, &ukey, &ubase) < 0) return fail(bufs, 6, NULL);
    size_t n = (size_t)p;
    if (!is_pow2(n) || (size_t)x.len / 4 > n || (size_t)sg.len * 8 < n || (u.obj && (size_t)u.len / 4 < n) ||
        (size_t)w.len / 4 < n || !packing_ok(packed, n, t.len, o.len))
        return fail(bufs, 6, "rht_encode: inconsistent buffer sizes");
    qtab_t q;
    if (qtab_init(&q, big_m, g, t.buf, t.len) < 0) return fail(bufs, 6, "rht_encode: bad table");
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 6, NULL);
    piece_t one = {.p = x.buf, .start = 0, .end = (size_t)x.len / 4};
    size_t cur = 0;
    in_t in = {.kind = IN_SIGNS, .pc = &one, .npc = 1, .cur = &cur, .signs = sg.buf};
    if (packed == 0 || packed == 4) {
        epi_t e = {.kind = EPI_ENCODE, .q = &q, .u = u.obj ? u.buf : NULL, .ukey = ukey, .ubase = ubase,
                   .out = o.buf, .packed = packed};
        return run_released(simd, w.buf, n, &in, &e, bufs, 6);
    }
    epi_t e = {.kind = EPI_SCALE, .dst = w.buf};
    qef_t f = {.u = u.obj ? u.buf : NULL, .ukey = ukey, .ubase = ubase, .out = o.buf, .packed = packed};
    Py_BEGIN_ALLOW_THREADS
    rht_run(simd, w.buf, n, &in, &e);
    quant_ef_run(simd, w.buf, n, &q, &f);
    Py_END_ALLOW_THREADS
    release(bufs, 6);
    Py_RETURN_NONE;
}

/* k when tab[b] == float32(b) / float32(k) for every byte b (the 8-bit lanes' Y/k of
 * thc.decode_lanes: numpy's float64 b/k rounded to float32, which is the correctly rounded
 * float32 quotient, tests/test_kernels.py checks every b and k), else 0.  The AVX2 source then
 * divides instead of gathering from the table, with the same values. */
static float lanes_divisor(const float *tab) {
    if (!(tab[1] > 0.f)) return 0.f;
    const float k = (float)lrint(1.0 / tab[1]);
    if (!(k >= 1.f && k <= 65536.f)) return 0.f;
    for (int b = 0; b < 256; b++)
        if (tab[b] != (float)b / k) return 0.f;
    return k;
}

/* rht_decode(src, kind, c, m, p, signs: bytes, table: bytes, out: float32 writable buf (<= p),
 *            work: float32 writable buf (>= p) or None when out holds p values, simd=-1)
 * kind 0: src float32 values v; 1: packed 4-bit indices (v = T[z]); 2: byte indices;
 * 3: bytes b with table = 256 float32 values (v = table[b], e.g. 8-bit lanes to Y/k).
 * a = v·c − m, then FWHT, 1/sqrt(p), signs; the first len(out) coordinates are written. */
static PyObject *py_rht_decode(PyObject *self, PyObject *args) {
    Py_buffer s = {0}, sg = {0}, t = {0}, o = {0}, w = {0};
    PyObject *wobj;
    int kind, simd = -1;
    double c, m;
    Py_ssize_t p;
    if (!PyArg_ParseTuple(args, "y*iddny*y*w*O|i", &s, &kind, &c, &m, &p, &sg, &t, &o, &wobj, &simd)) return NULL;
    Py_buffer *bufs[] = {&s, &sg, &t, &o, &w};
    if (wobj != Py_None && PyObject_GetBuffer(wobj, &w, PyBUF_WRITABLE) < 0) return fail(bufs, 5, NULL);
    size_t n = (size_t)p, nout = (size_t)o.len / 4;
    size_t need = kind == 0 ? 4 * n : kind == 1 ? (n + 1) / 2 : n;
    const int ftab = kind == 3;          /* byte source, table of 256 float32 values */
    if (ftab) kind = 2;
    float *work = w.obj ? w.buf : (nout == n ? o.buf : NULL);
    if (!is_pow2(n) || kind < 0 || kind > 3 || (size_t)s.len < need || (size_t)sg.len * 8 < n || nout > n ||
        !work || (w.obj && (size_t)w.len / 4 < n) || (kind == 1 && t.len > 16) || (kind && t.len < 2) ||
        (ftab && t.len != 1024))
        return fail(bufs, 5, "rht_decode: inconsistent buffer sizes");
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 5, NULL);
    in_t in = {.kind = kind == 0 ? IN_VALUES : kind == 1 ? IN_NIBBLES : IN_BYTES, .signs = sg.buf,
               .x = s.buf, .idx = s.buf, .c = (float)c, .m = (float)m};
    memset(in.tabf, 0, sizeof in.tabf);
    if (ftab) memcpy(in.tabf, t.buf, 1024);
    else for (Py_ssize_t i = 0; i < t.len; i++) in.tabf[i] = ((const uint8_t *)t.buf)[i];
    in.divk = ftab ? lanes_divisor(in.tabf) : 0.f;
    epi_t e = {.kind = EPI_DECODE, .signs = sg.buf, .dst = o.buf, .ndst = nout};
    return run_released(simd, work, n, &in, &e, bufs, 5);
}

/* rht_rotate(x, p, signs: bytes, carry: float32 buf (>= p values) or None,
 *            out: float32 writable buf (>= p), simd=-1)
 * x: n <= p float32 values, zero-padded to p: one buffer, or a tuple or list of buffers read
 * as their concatenation (a gradient tensor by tensor; none may overlap out).
 * out = (1/sqrt(p))·H·(D x) + carry (the product first, then the sum), in out's first p floats. */
static PyObject *py_rht_rotate(PyObject *self, PyObject *args) {
    Py_buffer sg = {0}, cy = {0}, o = {0};
    Py_ssize_t p;
    PyObject *xobj, *cobj;
    int simd = -1;
    if (!PyArg_ParseTuple(args, "Ony*Ow*|i", &xobj, &p, &sg, &cobj, &o, &simd)) return NULL;
    Py_buffer *bufs[] = {&sg, &cy, &o};
    pieces_t xs = {0};
    const Py_ssize_t nx = get_pieces(xobj, &xs);
    if (nx < 0) return fail(bufs, 3, NULL);
    if (cobj != Py_None && PyObject_GetBuffer(cobj, &cy, PyBUF_SIMPLE) < 0) {
        drop_pieces(&xs);
        return fail(bufs, 3, NULL);
    }
    size_t n = (size_t)p;
    if (!is_pow2(n) || (size_t)nx > n || (size_t)sg.len * 8 < n || (cy.obj && (size_t)cy.len / 4 < n) ||
        (size_t)o.len / 4 < n) {
        drop_pieces(&xs);
        return fail(bufs, 3, "rht_rotate: inconsistent buffer sizes");
    }
    if ((simd = pick_simd(simd)) < 0) {
        drop_pieces(&xs);
        return fail(bufs, 3, NULL);
    }
    size_t cur = 0;
    in_t in = {.kind = IN_SIGNS, .pc = xs.pc, .npc = xs.n, .cur = &cur, .signs = sg.buf};
    epi_t e = {.kind = EPI_ADD, .dst = o.buf, .carry = cy.obj ? cy.buf : NULL};
    Py_BEGIN_ALLOW_THREADS
    rht_run(simd, o.buf, n, &in, &e);
    Py_END_ALLOW_THREADS
    drop_pieces(&xs);
    release(bufs, 3);
    Py_RETURN_NONE;
}

/* quantize_ef(x: float32 buf (n values, already rotated), M, g, table: bytes, uniforms,
 *             out: uint8 buf, packed: 0 or bits, resid: float32 writable buf (>= n) or None, simd=-1)
 * uniforms as rht_encode's.  Indices as rht_encode writes them for the same rotated values;
 * resid[i] = x[i] − (T[z_i]·c − m), c = float32(2M/g), m = float32(M). */
static PyObject *py_quantize_ef(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, t = {0}, u = {0}, o = {0}, r = {0};
    double big_m;
    int g, packed, simd = -1;
    PyObject *uobj, *robj;
    unsigned long long ukey = 0, ubase = 0;
    if (!PyArg_ParseTuple(args, "y*diy*Ow*iO|i", &x, &big_m, &g, &t, &uobj, &o, &packed, &robj, &simd)) return NULL;
    Py_buffer *bufs[] = {&x, &t, &u, &o, &r};
    if (get_uniforms(uobj, &u, &ukey, &ubase) < 0) return fail(bufs, 5, NULL);
    if (robj != Py_None && PyObject_GetBuffer(robj, &r, PyBUF_WRITABLE) < 0) return fail(bufs, 5, NULL);
    size_t n = (size_t)x.len / 4;
    if (n == 0 || (u.obj && (size_t)u.len / 4 < n) || !packing_ok(packed, n, t.len, o.len) ||
        (r.obj && (size_t)r.len / 4 < n))
        return fail(bufs, 5, "quantize_ef: inconsistent buffer sizes");
    qtab_t q;
    if (qtab_init(&q, big_m, g, t.buf, t.len) < 0) return fail(bufs, 5, "quantize_ef: bad table");
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 5, NULL);
    qef_t f = {.u = u.obj ? u.buf : NULL, .ukey = ukey, .ubase = ubase, .out = o.buf, .packed = packed,
               .resid = r.obj ? r.buf : NULL, .levels = (int)t.len,
               .c = (float)(2.0 * big_m / g), .m = (float)big_m};
    memset(f.tabf, 0, sizeof f.tabf);
    for (Py_ssize_t i = 0; i < t.len; i++) f.tabf[i] = ((const uint8_t *)t.buf)[i];
    Py_BEGIN_ALLOW_THREADS
    quant_ef_run(simd, x.buf, n, &q, &f);
    Py_END_ALLOW_THREADS
    release(bufs, 5);
    Py_RETURN_NONE;
}

/* quantize(r: float32 buf, M, g, table: bytes, uniforms: float32 buf, out: uint8 buf):
 * the separate quantizer pass of the previous pipeline (scalar). */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    Py_buffer r = {0}, t = {0}, u = {0}, o = {0};
    double big_m;
    int g;
    if (!PyArg_ParseTuple(args, "y*diy*y*w*", &r, &big_m, &g, &t, &u, &o)) return NULL;
    Py_buffer *bufs[] = {&r, &t, &u, &o};
    Py_ssize_t n = r.len / 4;
    qtab_t q;
    if (u.len / 4 < n || o.len < n || qtab_init(&q, big_m, g, t.buf, t.len) < 0)
        return fail(bufs, 4, "quantize: inconsistent buffer sizes or table");
    const float *rv = r.buf, *uv = u.buf;
    uint8_t *out = o.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) out[i] = quant1(&q, rv[i], uv[i]);
    Py_END_ALLOW_THREADS
    release(bufs, 4);
    Py_RETURN_NONE;
}

/* apply_signs(x: float32 writable buf, bits: bytes): x[i] = -x[i] where bit i is set. */
static PyObject *py_apply_signs(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, b = {0};
    if (!PyArg_ParseTuple(args, "w*y*", &x, &b)) return NULL;
    Py_buffer *bufs[] = {&x, &b};
    size_t n = (size_t)x.len / 4;
    if ((size_t)b.len * 8 < n) return fail(bufs, 2, "apply_signs: not enough sign bits");
    float *v = x.buf;
    const uint8_t *bits = b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) v[i] = flip(v[i], sign_bit(bits, i));
    Py_END_ALLOW_THREADS
    release(bufs, 2);
    Py_RETURN_NONE;
}

/* sumsq(x: float32 buf, simd=-1) -> float: Σ x_i² in the lane order above (a float64). */
static PyObject *py_sumsq(PyObject *self, PyObject *args) {
    Py_buffer x = {0};
    int simd = -1;
    if (!PyArg_ParseTuple(args, "y*|i", &x, &simd)) return NULL;
    Py_buffer *bufs[] = {&x};
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 1, NULL);
    const float *v = x.buf;
    size_t n = (size_t)x.len / 4;
    double s;
    Py_BEGIN_ALLOW_THREADS
#if THC_HAVE_AVX2
    s = simd ? sumsq_avx2(v, n) : sumsq_scalar(v, n);
#else
    s = sumsq_scalar(v, n);
#endif
    Py_END_ALLOW_THREADS
    release(bufs, 1);
    return PyFloat_FromDouble(s);
}

/* widen_lanes(src, roff, coff, lo, hi, bits, out, simd=-1): chunks lo..hi-1 of a phase's
 * sub-byte RESULT lanes (chunk c's payload at src[roff[c]:], its coff[c+1] - coff[c] lanes)
 * widened to one byte a lane at out[coff[c]:] (proto/lanes.h), for the lanes decode.  The
 * path follows the kernel level: AVX-512 with VBMI, else BMI2 at level 1 and up, else scalar. */
static PyObject *py_widen_lanes(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, roff = {0}, coff = {0}, out = {0};
    Py_ssize_t lo, hi;
    int bits, simd = -1;
    if (!PyArg_ParseTuple(args, "y*y*y*nniw*|i", &src, &roff, &coff, &lo, &hi, &bits, &out, &simd)) return NULL;
    Py_buffer *bufs[] = {&src, &roff, &coff, &out};
    if ((simd = pick_simd(simd)) < 0) return fail(bufs, 4, NULL);
    const int64_t *ro = roff.buf, *co = coff.buf;
    Py_ssize_t n = roff.len / 8 - 1;
    if (bits < 1 || bits > 7 || coff.len != roff.len || lo < 0 || hi > n || lo > hi)
        return fail(bufs, 4, "widen_lanes: bits must be 1..7 and lo..hi chunks of roff/coff");
    for (Py_ssize_t c = lo; c < hi; c++)
        if (co[c] < 0 || co[c + 1] < co[c] || co[c + 1] > out.len || ro[c] < 0 ||
            ro[c] + (int64_t)lanes_size((size_t)(co[c + 1] - co[c]), bits) > src.len)
            return fail(bufs, 4, "widen_lanes: a chunk lies outside its buffer");
    const int path = pack_path(simd);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t c = lo; c < hi; c++)
        lanes_widen((uint8_t *)out.buf + co[c], (const uint8_t *)src.buf + ro[c], (size_t)(co[c + 1] - co[c]),
                    bits, path);
    Py_END_ALLOW_THREADS
    release(bufs, 4);
    Py_RETURN_NONE;
}

/* _tune(l1, low, top_bits, strip) -> the previous (l1, low, top_bits, strip): the AVX2 FWHT's
 * blocking, for benchmarks and for the tests that run every level layout at small sizes. */
static PyObject *py_tune(PyObject *self, PyObject *args) {
    Py_ssize_t l1, l2, strip;
    int tb;
    if (!PyArg_ParseTuple(args, "nnin", &l1, &l2, &tb, &strip)) return NULL;
#if THC_HAVE_AVX2
    if (l1 < 128 || l2 < l1 || !is_pow2((size_t)l1) || !is_pow2((size_t)l2) || tb < 1 || (1 << tb) * 16 > STRIP_MAX ||
        strip < 16 || strip > STRIP_MAX || !is_pow2((size_t)strip)) {
        PyErr_SetString(PyExc_ValueError, "_tune: bad sizes");
        return NULL;
    }
    PyObject *old = Py_BuildValue("nnin", (Py_ssize_t)L1_FLOATS, (Py_ssize_t)LOW_FLOATS, TOP_BITS,
                                  (Py_ssize_t)STRIP_FLOATS);
    L1_FLOATS = (size_t)l1; LOW_FLOATS = (size_t)l2; TOP_BITS = tb; STRIP_FLOATS = (size_t)strip;
    return old;
#else
    return Py_BuildValue("nnin", l1, l2, tb, strip);
#endif
}

static PyObject *py_simd(PyObject *self, PyObject *args) { return PyUnicode_FromString(LEVEL_NAMES[auto_simd]); }
static PyObject *py_has_avx2(PyObject *self, PyObject *args) { return PyBool_FromLong(cpu_level >= 1); }
static PyObject *py_has_avx512(PyObject *self, PyObject *args) { return PyBool_FromLong(cpu_level >= 2); }

static PyMethodDef methods[] = {
    {"fwht", py_fwht, METH_VARARGS, "fwht(x, simd=-1): normalized in-place fast Walsh-Hadamard transform (deterministic)"},
    {"rht_encode", py_rht_encode, METH_VARARGS, "fused signs + FWHT + clamp + stochastic quantization (+ b-bit packing)"},
    {"rht_decode", py_rht_decode, METH_VARARGS, "fused table-domain values + inverse RHT"},
    {"rht_rotate", py_rht_rotate, METH_VARARGS, "signs + FWHT + scale, plus a carried vector (the rotated residual)"},
    {"quantize_ef", py_quantize_ef, METH_VARARGS, "quantize a rotated block to table indices, with its rotated-domain residual"},
    {"quantize", py_quantize, METH_VARARGS, "clamp + grid map + stochastic rounding to table indices (separate pass)"},
    {"widen_lanes", py_widen_lanes, METH_VARARGS, "widen_lanes(src, roff, coff, lo, hi, bits, out, simd=-1): sub-byte RESULT lanes to bytes"},
    {"sumsq", py_sumsq, METH_VARARGS, "sumsq(x, simd=-1): sum of squares of float32 values in 16 float64 lanes (the block norm)"},
    {"apply_signs", py_apply_signs, METH_VARARGS, "multiply by the Rademacher diagonal given as packed bits"},
    {"_tune", py_tune, METH_VARARGS, "benchmarks and tests: (L1 piece, low chunk, top level bits, strip floats) -> the previous"},
    {"simd", py_simd, METH_NOARGS, "the path simd=-1 takes: 'avx512', 'avx2' or 'scalar'"},
    {"has_avx2", py_has_avx2, METH_NOARGS, "whether simd=1 is available"},
    {"has_avx512", py_has_avx512, METH_NOARGS, "whether simd=2 (AVX-512 where a kernel has it) is available"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kernels", "THC worker kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#if THC_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) cpu_level = 1;
    if (cpu_level && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        cpu_level = 2;
#endif
    lanes_best = lanes_best_path();
    /* THC_KERNELS=scalar|avx2|avx512 forces a path; one this CPU lacks, or another word, is an
     * error at import (not a silent fallback to the numpy code) */
    const char *env = getenv("THC_KERNELS");
    auto_simd = cpu_level;
    if (env && *env) {
        int want = -1;
        for (int k = 0; k < 3; k++)
            if (strcmp(env, LEVEL_NAMES[k]) == 0) want = k;
        if (want < 0) {
            PyErr_Format(PyExc_ValueError, "THC_KERNELS=%s: expected scalar, avx2 or avx512", env);
            return NULL;
        }
        if (want > cpu_level) {
            PyErr_Format(PyExc_RuntimeError, "THC_KERNELS=%s: this CPU (or build) has no %s (its best path is %s)", env,
                         want == 2 ? "AVX-512 (F, BW, DQ, VL)" : "AVX2", LEVEL_NAMES[cpu_level]);
            return NULL;
        }
        auto_simd = want;
    }
    return PyModule_Create(&moduledef);
}
