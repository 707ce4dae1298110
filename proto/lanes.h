/* Sub-byte RESULT lanes of the wire contract (docs/protocol.md §2, proto/packing.py): sums of
 * L bits, 1 <= L <= 7, packed MSB first exactly as DATA's indices are (lane i in bits
 * [i*L, (i+1)*L) counting from the most significant bit of byte 0; the last byte's unused low
 * bits 0).  The PS packs a slot's byte accumulator into a payload (ps_server/_fastpath.c); the
 * worker widens a payload back to one byte a lane before its decode (compression/_kernels.c).
 *
 * Each has the same bytes three ways: scalar; BMI2 (pext/pdep, 8 lanes a step: a group of 8
 * lanes is L whole bytes); and, for the widening, AVX-512 VBMI (a byte permute and a
 * multishift, 64 lanes a step).  Values above L bits are masked, never spilled into a
 * neighbour. */
#ifndef THC_PROTO_LANES_H
#define THC_PROTO_LANES_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Bytes that `count` L-bit lanes occupy. */
static inline size_t lanes_size(size_t count, int L) { return (count * (size_t)L + 7) / 8; }

/* The L-bit mask in every byte of a 64-bit word. */
static inline uint64_t lanes_mask64(int L) { return 0x0101010101010101ull * ((1u << L) - 1); }

static void lanes_pack_scalar(uint8_t *dst, const uint8_t *src, size_t count, int L) {
    const uint32_t m = (1u << L) - 1;
    uint32_t acc = 0;
    int nb = 0;
    size_t o = 0;
    for (size_t i = 0; i < count; i++) {
        acc = (acc << L) | (src[i] & m);
        nb += L;
        if (nb >= 8) { nb -= 8; dst[o++] = (uint8_t)(acc >> nb); }
    }
    if (nb) dst[o] = (uint8_t)(acc << (8 - nb));
}

/* Field i of L bits (1..8) of an MSB-first stream of nbytes bytes: DATA's indices and sub-byte
 * lanes alike (the PS's generic index lookup reads them so too). */
static inline uint32_t msb_field(const uint8_t *src, size_t nbytes, size_t i, int L) {
    size_t bit = i * (size_t)L, byte = bit >> 3;
    uint32_t w = ((uint32_t)src[byte] << 8) | (byte + 1 < nbytes ? src[byte + 1] : 0);
    return (w >> (16 - (bit & 7) - (size_t)L)) & ((1u << L) - 1);
}

static void lanes_widen_scalar(uint8_t *dst, const uint8_t *src, size_t count, int L) {
    const size_t nbytes = lanes_size(count, L);
    for (size_t i = 0; i < count; i++) dst[i] = (uint8_t)msb_field(src, nbytes, i, L);
}

#if defined(__x86_64__)
/* Groups of 8 lanes with pext: the group's bytes reversed put lane 0 on top, pext keeps each
 * byte's low L bits (lane 0 the top L of the 8L), shifted to the word's top and stored
 * big-endian; a group's 8-byte store spills into the next group's bytes, which that group then
 * writes, so the last group (and any whose store would pass the payload's end) is the scalar
 * loop's. */
__attribute__((target("bmi2")))
static void lanes_pack_bmi2(uint8_t *dst, const uint8_t *src, size_t count, int L) {
    const uint64_t m = lanes_mask64(L);
    const size_t groups = count / 8, nbytes = lanes_size(count, L);
    size_t q = 0;
    for (; q + 1 < groups && (size_t)L * q + 8 <= nbytes; q++) {
        uint64_t v;
        memcpy(&v, src + 8 * q, 8);
        v = __builtin_bswap64(_pext_u64(__builtin_bswap64(v), m) << (64 - 8 * L));
        memcpy(dst + (size_t)L * q, &v, 8);
    }
    lanes_pack_scalar(dst + (size_t)L * q, src + 8 * q, count - 8 * q, L);
}

/* The inverse: a group's L bytes (read as 8, big-endian) shifted down to its 8L bits, pdep
 * spreads them into the low L bits of 8 bytes (lane 0 in the top byte), reversed to lane
 * order.  Groups whose 8-byte read would pass the payload's end take the scalar loop. */
__attribute__((target("bmi2")))
static void lanes_widen_bmi2(uint8_t *dst, const uint8_t *src, size_t count, int L) {
    const uint64_t m = lanes_mask64(L);
    const size_t nbytes = lanes_size(count, L);
    size_t q = 0;
    for (; 8 * q + 8 <= count && (size_t)L * q + 8 <= nbytes; q++) {
        uint64_t v;
        memcpy(&v, src + (size_t)L * q, 8);
        v = __builtin_bswap64(_pdep_u64(__builtin_bswap64(v) >> (64 - 8 * L), m));
        memcpy(dst + 8 * q, &v, 8);
    }
    lanes_widen_scalar(dst + 8 * q, src + (size_t)L * q, count - 8 * q, L);
}

/* 64 lanes (8L bytes) a step: vpermb gathers, for each 64-bit word k, the bytes L*k..L*k+7
 * reversed (the group's bits from bit 63 down), vpmultishiftqb takes lane j's 8 bits from
 * bit 64 - L*(j+1), and the mask keeps L of them.  Masked loads stop at the payload's end
 * (bytes past it read as 0) and a masked store at the last lane. */
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void lanes_widen_vbmi(uint8_t *dst, const uint8_t *src, size_t count, int L) {
    uint8_t perm[64], shift[64];
    for (int k = 0; k < 8; k++)
        for (int i = 0; i < 8; i++) {
            perm[8 * k + i] = (uint8_t)(L * k + 7 - i);
            shift[8 * k + i] = (uint8_t)(64 - L * (i + 1));
        }
    const __m512i P = _mm512_loadu_si512(perm), S = _mm512_loadu_si512(shift);
    const __m512i M = _mm512_set1_epi8((char)((1u << L) - 1));
    const size_t nbytes = lanes_size(count, L);
    for (size_t i = 0, b = 0; i < count; i += 64, b += 8 * (size_t)L) {
        size_t have = nbytes - b, left = count - i;
        __mmask64 lm = have >= 64 ? ~0ull : (1ull << have) - 1;
        __mmask64 sm = left >= 64 ? ~0ull : (1ull << left) - 1;
        __m512i v = _mm512_maskz_loadu_epi8(lm, src + b);
        v = _mm512_and_si512(_mm512_multishift_epi64_epi8(S, _mm512_permutexvar_epi8(P, v)), M);
        _mm512_mask_storeu_epi8(dst + i, sm, v);
    }
}
#endif

/* The paths a caller may ask for: 0 scalar, 1 BMI2, 2 AVX-512 VBMI (widening; packing takes
 * its BMI2 path there), each only where the CPU has it. */
static inline int lanes_best_path(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi"))
        return 2;
    if (__builtin_cpu_supports("bmi2")) return 1;
#endif
    return 0;
}

static inline void lanes_pack(uint8_t *dst, const uint8_t *src, size_t count, int L, int path) {
#if defined(__x86_64__)
    if (path >= 1) { lanes_pack_bmi2(dst, src, count, L); return; }
#endif
    lanes_pack_scalar(dst, src, count, L);
}

static inline void lanes_widen(uint8_t *dst, const uint8_t *src, size_t count, int L, int path) {
#if defined(__x86_64__)
    if (path >= 2) { lanes_widen_vbmi(dst, src, count, L); return; }
    if (path >= 1) { lanes_widen_bmi2(dst, src, count, L); return; }
#endif
    lanes_widen_scalar(dst, src, count, L);
}
#endif
