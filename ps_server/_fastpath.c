/*
 * THC-PS hot path: packet parsing, per-slot round logic, lookup-and-sum and
 * result fan-out, with batched recvmmsg/sendmmsg.
 *
 * This file implements exactly the rules of ps_server/reference.py (the
 * executable specification; tests run both on the same packet sequences and
 * require identical output).  The wire layout is proto/headers.py.
 *
 * Lookup-and-sum for 4-bit indices into 8-bit lanes uses AVX2 `pshufb` (one
 * byte shuffle looks up 32 nibbles in the 16-entry table) when the CPU has it,
 * chosen at run time, with a plain-C fallback.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <structmember.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define HDR 40
#define MAGIC 0x5448
#define VERSION 2
#define ROUND_WINDOW 1024u
#define T_DATA 1
#define T_RESULT 2
#define T_STRAGGLER 3
#define T_NORM 4
#define T_NORM_RESULT 5
#define T_NOTICE 6
#define F_RESENT 0x02
#define OP_LOOKUP_SUM 1
#define OP_FLOAT_SUM 2
#define OP_MAX_U32 3
#define MAX_WORKERS 32
#define GROUP MAX_WORKERS  /* the destination index of the job's multicast group (w_ip/w_port) */
#define BATCH 64
#define OUT_CAP 256        /* output packets queued before a flush: 44-segment GSO runs of RESULTs */
#include "../proto/udpio.h"
#include "../proto/lanes.h"

enum { C_PACKETS_IN, C_BYTES_IN, C_PACKETS_OUT, C_BYTES_OUT, C_ROUNDS, C_PARTIAL, C_RESENT,
       C_STRAGGLERS, C_NOTICES, N_COUNTERS };
static const char *counter_names[N_COUNTERS] = {
    "packets_in", "bytes_in", "packets_out", "bytes_out", "rounds_completed", "partial_rounds",
    "results_resent", "stragglers_notified", "notices"};
enum { D_MALFORMED, D_VERSION, D_JOB, D_SLOT, D_WORKER, D_UNREG, D_STALE, D_DUP, D_LATE, D_CODEC,
       D_AHEAD, N_DROPS };
static const char *drop_names[N_DROPS] = {
    "malformed", "wrong_version", "unknown_job", "slot_out_of_range", "worker_out_of_range",
    "unregistered", "stale", "duplicate", "late", "codec_error",   /* codec_error: BLOB jobs only */
    "ahead"};

/* Socket-level counters (Engine.io_stats): how the datagrams were batched, not what they were. */
enum { IO_RX_MSGS, IO_RX_COALESCED, IO_RX_SEGMENTS, IO_TX_MSGS, IO_TX_GSO, IO_TX_SEGMENTS,
       IO_GSO_FALLBACKS, N_IO };
static const char *io_names[N_IO] = {
    "rx_messages", "rx_coalesced", "rx_datagrams", "tx_messages", "tx_gso_messages", "tx_datagrams",
    "gso_fallbacks"};

typedef struct {
    uint8_t *payload;
    uint32_t len, round, bitmap, offset;
    uint16_t count;
    uint8_t k, valid;
} result_t;

typedef struct {
    uint8_t active, count;
    uint32_t round, bitmap, offset;
    uint16_t elems;
    uint8_t *acc;          /* lane-width (lookup), float32 (float sum) or uint32 (max) */
    result_t cur, prev;
} slot_t;

typedef struct {
    uint8_t hdr[HDR];
    const uint8_t *payload;
    uint32_t payload_len;
} outpkt_t;

/* The PS's slot space: every job's slots are a region [base, base + size) of one array, as
 * a switch's register arrays are shared by the jobs it serves.  An Engine claims its region
 * when it is made and clears it when it goes, so nothing of one job reaches the next. */
typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    int size;
    slot_t *slot;
    const void **owner;      /* the Engine holding each slot, NULL when free */
} SlotSpace;

static PyTypeObject SlotSpaceType;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    SlotSpace *space;        /* NULL: the engine's own slot array */
    int base;                /* first slot of the region in `space` */
    int claimed;
    uint16_t job_id;
    uint32_t nonce;
    int n, slots, norm_slots, elems, bits, lane_bits, op, quorum;
    uint32_t table[256];
    uint8_t table8[256];     /* the table as bytes (byte lanes: every entry <= g <= 255) */
    slot_t *slot;
    uint32_t w_ip[MAX_WORKERS + 1];     /* [GROUP]: the result group, when `group` */
    uint16_t w_port[MAX_WORKERS + 1];
    int group;               /* fan results out as one datagram to the group (JobConfig.result_group) */
    int notices;             /* send loss notices (ReferencePS(notices=...)) */
    uint32_t w_token[MAX_WORKERS];
    uint8_t w_reg[MAX_WORKERS];
    uint64_t counters[N_COUNTERS], drops[N_DROPS];
    /* output queue of one batch */
    outpkt_t *out;
    int n_out, cap_out;
    struct { int pkt; int dest; } *msgs;
    int n_msgs, cap_msgs;
    uint8_t *arena;          /* payload copies of the queued packets, pkt_cap bytes each */
    size_t pkt_cap;
    struct mmsghdr *mm;      /* sendmmsg scratch, cap_msgs entries */
    struct iovec *iov;
    struct sockaddr_in *sa;
    uint8_t *cmsg;           /* per-message UDP_SEGMENT control buffers, cap_msgs entries */
    int *order;              /* queued messages grouped by destination */
    int gso;                 /* send runs of equal-size datagrams to one worker as one GSO message */
    uint64_t io[N_IO];
    int avx2;
    int lanes_path;        /* proto/lanes.h: how sub-byte lanes are packed (0 scalar, 1+ BMI2) */
} Engine;

/* ------------------------------------------------------------------ kernels */

/* acc[i] (+)= table[z_i] for the count packed indices; `set` writes instead of adding (a
 * round's first contribution: no zeroing pass over the accumulator). */
static void lookup_add_scalar(uint8_t *acc, int lane_bytes, const uint8_t *in, int count, int bits,
                              const uint32_t *table, int set) {
    if (bits == 4 && lane_bytes == 1) {
        uint8_t keep = set ? 0 : 0xFF;         /* acc & keep: 0 when writing, acc when adding */
        for (int i = 0; i < count / 2; i++) {
            acc[2 * i] = (uint8_t)((acc[2 * i] & keep) + table[in[i] >> 4]);
            acc[2 * i + 1] = (uint8_t)((acc[2 * i + 1] & keep) + table[in[i] & 15]);
        }
        if (count & 1) acc[count - 1] = (uint8_t)((acc[count - 1] & keep) + table[in[count / 2] >> 4]);
        return;
    }
    if (set) memset(acc, 0, (size_t)count * (size_t)lane_bytes);
    const size_t nbytes = lanes_size((size_t)count, bits);
    for (int i = 0; i < count; i++) {
        uint32_t v = table[msb_field(in, nbytes, (size_t)i, bits)];   /* MSB-first indices */
        if (lane_bytes == 1) acc[i] += (uint8_t)v;
        else if (lane_bytes == 2) ((uint16_t *)acc)[i] += (uint16_t)v;
        else ((uint32_t *)acc)[i] += v;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void lookup_add4_avx2(uint8_t *acc, const uint8_t *in, int count, const uint8_t *table8, int set) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table8));
    const __m256i lo_mask = _mm256_set1_epi8(0x0F);
    int nbytes = count / 2, i = 0;
    for (; i + 32 <= nbytes; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + i));
        __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), lo_mask));
        __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, lo_mask));
        __m256i a = _mm256_unpacklo_epi8(hi, lo), b = _mm256_unpackhi_epi8(hi, lo);
        __m256i first = _mm256_permute2x128_si256(a, b, 0x20);
        __m256i second = _mm256_permute2x128_si256(a, b, 0x31);
        __m256i *dst = (__m256i *)(acc + 2 * i);
        if (!set) {
            first = _mm256_add_epi8(_mm256_loadu_si256(dst), first);
            second = _mm256_add_epi8(_mm256_loadu_si256(dst + 1), second);
        }
        _mm256_storeu_si256(dst, first);
        _mm256_storeu_si256(dst + 1, second);
    }
    uint8_t keep = set ? 0 : 0xFF;
    for (; i < nbytes; i++) {
        acc[2 * i] = (uint8_t)((acc[2 * i] & keep) + table8[in[i] >> 4]);
        acc[2 * i + 1] = (uint8_t)((acc[2 * i + 1] & keep) + table8[in[i] & 15]);
    }
    if (count & 1) acc[count - 1] = (uint8_t)((acc[count - 1] & keep) + table8[in[count / 2] >> 4]);
}
#endif

/* acc[i] (+)= table8[z[i]] for byte indices z: 64 a step by one byte permute (AVX-512 VBMI,
 * a table of at most 64 entries), the tail under a mask. */
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
static void lookup_bytes_vbmi(uint8_t *acc, const uint8_t *z, int count, const uint8_t *table8, int set) {
    const __m512i tab = _mm512_loadu_si512(table8);
    for (int i = 0; i < count; i += 64) {
        const __mmask64 m = count - i >= 64 ? ~0ull : (1ull << (count - i)) - 1;
        __m512i v = _mm512_permutexvar_epi8(_mm512_maskz_loadu_epi8(m, z + i), tab);
        if (!set) v = _mm512_add_epi8(v, _mm512_maskz_loadu_epi8(m, acc + i));
        _mm512_mask_storeu_epi8(acc + i, m, v);
    }
}
#endif

/* Byte lanes from indices of b bits other than 4 (5-bit indices at g = 31, say): a tile widened
 * to one byte an index (proto/lanes.h: VBMI, BMI2 or scalar by `path`), then looked up, by
 * vpermb where the path is VBMI and the table has at most 64 entries.  Tiles are multiples of
 * 8 indices, so each starts on a byte of the payload. */
#define WIDE_TILE 512
static void lookup_add_wide(uint8_t *acc, const uint8_t *in, int count, int bits, const uint8_t *table8,
                            int set, int path) {
    uint8_t z[WIDE_TILE];
    for (int i = 0; i < count; i += WIDE_TILE) {
        const int len = count - i < WIDE_TILE ? count - i : WIDE_TILE;
        const uint8_t *src = in + (size_t)i / 8 * (size_t)bits;
        if (bits == 8) memcpy(z, src, (size_t)len);
        else lanes_widen(z, src, (size_t)len, bits, path);
#if defined(__x86_64__)
        if (path >= 2 && bits <= 6) {
            lookup_bytes_vbmi(acc + i, z, len, table8, set);
            continue;
        }
#endif
        uint8_t keep = set ? 0 : 0xFF;
        for (int k = 0; k < len; k++) acc[i + k] = (uint8_t)((acc[i + k] & keep) + table8[z[k]]);
    }
}

static void lookup_add(Engine *e, uint8_t *acc, const uint8_t *in, int count, int set) {
#if defined(__x86_64__)
    if (e->avx2 && e->bits == 4 && e->lane_bits <= 8) {
        lookup_add4_avx2(acc, in, count, e->table8, set);
        return;
    }
#endif
    if (e->bits != 4 && e->lane_bits <= 8) {
        lookup_add_wide(acc, in, count, e->bits, e->table8, set, e->lanes_path);
        return;
    }
    lookup_add_scalar(acc, e->lane_bits <= 8 ? 1 : e->lane_bits / 8, in, count, e->bits, e->table, set);
}

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return ntohl(v); }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return ntohs(v); }
static inline void wr32(uint8_t *p, uint32_t v) { v = htonl(v); memcpy(p, &v, 4); }
static inline void wr16(uint8_t *p, uint16_t v) { v = htons(v); memcpy(p, &v, 2); }

/* ------------------------------------------------------------------ engine logic */

static int up_bits(Engine *e) { return e->op == OP_LOOKUP_SUM ? e->bits : 32; }
static int down_bits(Engine *e) { return e->op == OP_LOOKUP_SUM ? e->lane_bits : 32; }

static outpkt_t *new_out(Engine *e) {
    if (e->n_out >= e->cap_out) return NULL;
    return &e->out[e->n_out++];
}

static void queue_msg(Engine *e, int pkt, int dest) {
    if (e->n_msgs >= e->cap_msgs) return;
    e->msgs[e->n_msgs].pkt = pkt;
    e->msgs[e->n_msgs].dest = dest;
    e->n_msgs++;
    e->counters[C_PACKETS_OUT]++;
    e->counters[C_BYTES_OUT] += HDR + e->out[pkt].payload_len;
}

static void fill_hdr(Engine *e, uint8_t *h, int type, int flags, int worker, int elem_bits, int slot,
                     uint32_t round, uint32_t offset, int count, uint32_t plen, uint32_t bitmap, int k,
                     int op) {
    memset(h, 0, HDR);
    wr16(h, MAGIC);
    h[2] = VERSION; h[3] = (uint8_t)type; h[4] = (uint8_t)flags; h[5] = (uint8_t)worker;
    h[6] = (uint8_t)e->n; h[7] = (uint8_t)elem_bits;
    wr16(h + 8, e->job_id); wr16(h + 10, (uint16_t)slot); wr32(h + 12, round); wr32(h + 16, offset);
    wr16(h + 20, (uint16_t)count); wr16(h + 22, (uint16_t)plen); wr32(h + 24, bitmap);
    h[28] = (uint8_t)k; h[29] = (uint8_t)op;
    wr32(h + 32, e->nonce);
}

static int result_pkt(Engine *e, int slot, result_t *r, int data_type, int dest) {
    outpkt_t *o = new_out(e);
    if (!o) return -1;
    int norm = data_type == T_NORM;
    fill_hdr(e, o->hdr, norm ? T_NORM_RESULT : T_RESULT, dest < 0 ? 0 : F_RESENT, dest < 0 ? 0 : dest,
             norm ? 32 : down_bits(e), slot, r->round, r->offset, r->count, r->len, r->bitmap, r->k,
             norm ? OP_MAX_U32 : e->op);
    int idx = (int)(o - e->out);
    uint8_t *copy = e->arena + (size_t)idx * e->pkt_cap;
    memcpy(copy, r->payload, r->len);   /* the slot may move on before the batch is sent */
    o->payload = copy;
    o->payload_len = r->len;
    return (int)(o - e->out);
}

static void unicast_result(Engine *e, int slot, result_t *r, int data_type, int dest) {
    e->counters[C_RESENT]++;
    int p = result_pkt(e, slot, r, data_type, dest);
    if (p >= 0) queue_msg(e, p, dest);
}

static void make_result(Engine *e, slot_t *st, int type) {
    result_t *r = &st->cur;
    int n = st->elems;
    r->round = st->round; r->bitmap = st->bitmap; r->offset = st->offset; r->count = (uint16_t)n;
    r->k = st->count; r->valid = 1;
    if (type == T_NORM) {
        for (int i = 0; i < n; i++) wr32(r->payload + 4 * i, ((uint32_t *)st->acc)[i]);
        r->len = 4 * n;
    } else if (e->op == OP_FLOAT_SUM) {
        for (int i = 0; i < n; i++) { uint32_t v; memcpy(&v, st->acc + 4 * i, 4); wr32(r->payload + 4 * i, v); }
        r->len = 4 * n;
    } else if (e->lane_bits == 8) {
        /* the accumulator is the payload: swap the buffers (same size) instead of copying;
         * the next round's first contribution overwrites the old payload buffer */
        uint8_t *t = r->payload; r->payload = st->acc; st->acc = t;
        r->len = n;
    } else if (e->lane_bits < 8) {
        /* sub-byte lanes (proto/lanes.h): the byte accumulator packed into the payload */
        lanes_pack(r->payload, st->acc, (size_t)n, e->lane_bits, e->lanes_path);
        r->len = (int)lanes_size((size_t)n, e->lane_bits);
    } else if (e->lane_bits == 16) {
        for (int i = 0; i < n; i++) wr16(r->payload + 2 * i, ((uint16_t *)st->acc)[i]);
        r->len = 2 * n;
    } else {
        for (int i = 0; i < n; i++) wr32(r->payload + 4 * i, ((uint32_t *)st->acc)[i]);
        r->len = 4 * n;
    }
}

static void swap_results(result_t *a, result_t *b) { result_t t = *a; *a = *b; *b = t; }

/* The header fields of one DATA/NORM datagram. */
typedef struct {
    int type, worker, nw, ebits, op;
    uint16_t job, slot, count, plen;
    uint32_t round, offset, nonce, token;
    const uint8_t *payload;
} pkt_t;

/* Validation half of docs/design.md's PS rules (ReferencePS._validate): the drop reason
 * (D_*) of a datagram that is not a well-formed, authorized DATA/NORM packet of this job,
 * or -1 with its fields in *p. */
/* The checks that need no job (ReferencePS._validate up to the job lookup): the drop reason
 * of a datagram that is not a well-formed DATA/NORM header, or -1.  The Mux runs them before
 * it looks the job id up, the Engine again for a datagram handed to it directly. */
static int header_check(const uint8_t *buf, uint32_t len) {
    if (len < HDR || rd16(buf) != MAGIC) return D_MALFORMED;
    if (buf[2] != VERSION) return D_VERSION;
    int type = buf[3];
    if (type < T_DATA || type > T_NORM_RESULT || rd16(buf + 22) != len - HDR) return D_MALFORMED;
    if (type != T_DATA && type != T_NORM) return D_MALFORMED;
    return -1;
}

static int validate(Engine *e, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, pkt_t *p,
                    int checked) {
    int bad = checked ? -1 : header_check(buf, len);     /* checked: the Mux ran it already */
    if (bad >= 0) return bad;
    p->type = buf[3]; p->worker = buf[5]; p->nw = buf[6]; p->ebits = buf[7]; p->op = buf[29];
    p->job = rd16(buf + 8); p->slot = rd16(buf + 10); p->count = rd16(buf + 20); p->plen = rd16(buf + 22);
    p->round = rd32(buf + 12); p->offset = rd32(buf + 16); p->nonce = rd32(buf + 32); p->token = rd32(buf + 36);
    p->payload = buf + HDR;
    if (p->job != e->job_id || p->nonce != e->nonce || !e->slot) return D_JOB;   /* !slot: closed */
    if (p->worker >= e->n) return D_WORKER;
    int w = p->worker;
    if (!e->w_reg[w] || e->w_ip[w] != ip || e->w_port[w] != port || e->w_token[w] != p->token) return D_UNREG;
    /* the region check: a packet's slot is relative to its job's region and must lie inside
     * it (data slots first, then norm slots), so it can never reach another job's slots */
    int norm = p->type == T_NORM;
    int lo = norm ? e->slots : 0, hi = norm ? e->slots + e->norm_slots : e->slots;
    if (p->slot < lo || p->slot >= hi) return D_SLOT;
    if (p->count == 0 || p->count > e->elems || p->nw != e->n) return D_MALFORMED;
    int ok = norm ? p->ebits == 32 && p->op == OP_MAX_U32 && p->plen == 4u * p->count
                  : p->ebits == up_bits(e) && p->op == e->op &&
                    p->plen == ((uint32_t)p->count * up_bits(e) + 7) / 8;
    return ok ? -1 : D_MALFORMED;
}

static void straggler_notice(Engine *e, slot_t *st, const pkt_t *p) {
    e->drops[D_STALE]++;
    e->counters[C_STRAGGLERS]++;
    outpkt_t *o = new_out(e);
    if (!o) return;
    fill_hdr(e, o->hdr, T_STRAGGLER, 0, p->worker, 0, p->slot, st->round, p->offset, 0, 0, 0, 0, p->op);
    o->payload = NULL; o->payload_len = 0;
    queue_msg(e, (int)(o - e->out), p->worker);
}

/* A NOTICE to rank w for data slot s (ReferencePS._notice) if s's open round is one short of
 * its quorum without w and w contributed to the next slot (0 after the last) at the round
 * after s's: a worker sends a phase's chunks in order on consecutive slots, so w's packet
 * for s was lost (or overtaken). */
static void notice(Engine *e, int s, int w) {
    slot_t *st = &e->slot[s], *nxt = &e->slot[(s + 1) % e->slots];
    if (!st->active || st->cur.valid || st->count != e->quorum - 1 || (st->bitmap >> w & 1) || !e->w_reg[w])
        return;
    if (!nxt->active || !(nxt->bitmap >> w & 1) || nxt->round != st->round + (uint32_t)(s == e->slots - 1))
        return;
    e->counters[C_NOTICES]++;
    outpkt_t *o = new_out(e);
    if (!o) return;
    fill_hdr(e, o->hdr, T_NOTICE, 0, w, 0, s, st->round, st->offset, st->elems, 0, st->bitmap, st->count, e->op);
    o->payload = NULL; o->payload_len = 0;
    queue_msg(e, (int)(o - e->out), w);
}

/* After rank w's DATA contribution to slot s (ReferencePS._notices): the slot before for w,
 * and s for each rank it lacks once it is one short of its quorum. */
static void notices(Engine *e, slot_t *st, const pkt_t *p) {
    if (!e->notices || p->type != T_DATA) return;
    notice(e, p->slot ? p->slot - 1 : e->slots - 1, p->worker);
    if (!st->cur.valid && st->count == e->quorum - 1)
        for (int w = 0; w < e->n; w++) notice(e, p->slot, w);
}

/* Round half of the rules (ReferencePS._round_step): one row of docs/design.md's table per
 * branch.  Returns 1 when the packet is to be aggregated, 0 when it was answered or dropped. */
static int round_step(Engine *e, slot_t *st, const pkt_t *p) {
    uint32_t bit = 1u << p->worker;
    if ((uint64_t)p->round > (uint64_t)(st->active ? st->round : 0) + ROUND_WINDOW) {  /* ahead */
        e->drops[D_AHEAD]++;
        return 0;
    }
    if (!st->active || p->round > st->round) {                     /* r > R: new round */
        if (st->active && st->cur.valid && p->round == st->round + 1) swap_results(&st->cur, &st->prev);
        else st->prev.valid = 0;
        st->cur.valid = 0;
        st->active = 1; st->round = p->round; st->count = 0; st->bitmap = 0;
        st->offset = p->offset; st->elems = p->count;
        return 1;                       /* aggregate() writes the first contribution over acc */
    }
    if (p->round == st->round) {
        if (p->offset != st->offset || p->count != st->elems) { e->drops[D_MALFORMED]++; return 0; }
        if (st->bitmap & bit) {                                    /* duplicate */
            if (st->cur.valid) unicast_result(e, p->slot, &st->cur, p->type, p->worker);
            else e->drops[D_DUP]++;
            return 0;
        }
        if (st->cur.valid) {                                       /* late */
            e->drops[D_LATE]++;
            unicast_result(e, p->slot, &st->cur, p->type, p->worker);
            return 0;
        }
        return 1;                                                  /* r = R, new worker */
    }
    if (p->round + 1 == st->round && st->prev.valid && p->offset == st->prev.offset &&
        p->count == st->prev.count) {                              /* r = R − 1: shadow copy */
        unicast_result(e, p->slot, &st->prev, p->type, p->worker);
        return 0;
    }
    straggler_notice(e, st, p);                                    /* stale */
    return 0;
}

/* r = R, new worker: add the contribution; at quorum, the result to every registered worker. */
static void aggregate(Engine *e, slot_t *st, const pkt_t *p) {
    int first = st->count == 0, count = p->count;
    if (p->type == T_NORM) {
        uint32_t *a = (uint32_t *)st->acc;
        for (int i = 0; i < count; i++) {
            uint32_t v = rd32(p->payload + 4 * i);
            if (first || v > a[i]) a[i] = v;
        }
    } else if (e->op == OP_FLOAT_SUM) {
        float *a = (float *)st->acc;
        for (int i = 0; i < count; i++) {
            uint32_t u = rd32(p->payload + 4 * i);
            float f; memcpy(&f, &u, 4);
            a[i] = first ? f : a[i] + f;
        }
    } else {
        lookup_add(e, st->acc, p->payload, count, first);
    }
    st->bitmap |= 1u << p->worker;
    st->count++;
    if (st->count < e->quorum) return;
    make_result(e, st, p->type);
    e->counters[C_ROUNDS]++;
    if (st->count < e->n) e->counters[C_PARTIAL]++;
    int r = result_pkt(e, p->slot, &st->cur, p->type, -1);
    if (r < 0) return;
    if (e->group) { queue_msg(e, r, GROUP); return; }
    for (int w = 0; w < e->n; w++)
        if (e->w_reg[w]) queue_msg(e, r, w);
}

/* One datagram; queues output packets.  Mirrors ReferencePS.process. */
static void handle(Engine *e, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, int checked) {
    e->counters[C_PACKETS_IN]++;
    e->counters[C_BYTES_IN] += len;
    pkt_t p;
    int drop = validate(e, buf, len, ip, port, &p, checked);
    if (drop >= 0) { e->drops[drop]++; return; }
    slot_t *st = &e->slot[p.slot];
    if (round_step(e, st, &p)) {
        aggregate(e, st, &p);
        notices(e, st, &p);
    }
}

/* A received message that may be a UDP GRO batch: `seg` > 0 is the kernel's segment size,
 * and every seg bytes (the last segment may be shorter) is one datagram, handled exactly as
 * a lone one (proto.headers.split_segments).  Flushes to `fd` (>= 0) whenever the output
 * queue fills. */
static void handle_segments(Engine *e, const uint8_t *buf, uint32_t len, uint32_t seg, uint32_t ip,
                            uint16_t port, int fd);

/* ------------------------------------------------------------------ Python type */

/* Free the slots' buffers and give the region back, cleared (under e->lock when the engine
 * may be serving); the engine answers nothing after it. */
static void release_slots(Engine *e) {
    if (!e->slot) return;
    for (int i = 0; i < e->slots + e->norm_slots; i++) {
        PyMem_RawFree(e->slot[i].acc);
        PyMem_RawFree(e->slot[i].cur.payload);
        PyMem_RawFree(e->slot[i].prev.payload);
    }
    if (e->space) {
        pthread_mutex_lock(&e->space->lock);
        memset(e->slot, 0, (size_t)(e->slots + e->norm_slots) * sizeof(slot_t));
        for (int i = 0; i < e->slots + e->norm_slots; i++) e->space->owner[e->base + i] = NULL;
        pthread_mutex_unlock(&e->space->lock);
    } else {
        PyMem_RawFree(e->slot);
    }
    e->slot = NULL;
}

/* close(): the job ended; its region is free for the next job at once */
static PyObject *Engine_close(Engine *e, PyObject *noargs) {
    pthread_mutex_lock(&e->lock);
    release_slots(e);
    pthread_mutex_unlock(&e->lock);
    Py_RETURN_NONE;
}

static void Engine_dealloc(Engine *e) {
    release_slots(e);
    Py_XDECREF((PyObject *)e->space);
    PyMem_RawFree(e->out);
    PyMem_RawFree(e->msgs);
    PyMem_RawFree(e->arena);
    PyMem_RawFree(e->mm);
    PyMem_RawFree(e->iov);
    PyMem_RawFree(e->sa);
    PyMem_RawFree(e->cmsg);
    PyMem_RawFree(e->order);
    pthread_mutex_destroy(&e->lock);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* Claim slots [base, base + total) of `space` for `e`; refuses a region outside the space or
 * overlapping another engine's. */
static int claim_region(Engine *e, SlotSpace *space, int base, int total) {
    if (base < 0 || base + total > space->size) {
        PyErr_Format(PyExc_ValueError, "region %d..%d does not fit the slot space of %d slots",
                     base, base + total - 1, space->size);
        return -1;
    }
    pthread_mutex_lock(&space->lock);
    for (int i = base; i < base + total; i++)
        if (space->owner[i]) {
            pthread_mutex_unlock(&space->lock);
            PyErr_Format(PyExc_ValueError, "region %d..%d overlaps another job's region at slot %d",
                         base, base + total - 1, i);
            return -1;
        }
    for (int i = base; i < base + total; i++) space->owner[i] = e;
    memset(space->slot + base, 0, (size_t)total * sizeof(slot_t));
    pthread_mutex_unlock(&space->lock);
    Py_INCREF(space);
    e->space = space;
    e->base = base;
    e->slot = space->slot + base;
    return 0;
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"job_id", "num_workers", "slots", "norm_slots", "elems_per_packet",
                             "bits", "lane_bits", "op", "quorum_count", "table", "nonce", "space",
                             "base", "group_ip", "group_port", "notices", NULL};
    int job_id, base = 0, group_port = 0;
    e->notices = 1;
    unsigned int nonce = 0;
    const char *group_ip = "";
    PyObject *table, *space = Py_None;
    if (e->out) {
        PyErr_SetString(PyExc_RuntimeError, "an Engine is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiiiiiiO|IOisip", kwlist, &job_id, &e->n, &e->slots,
                                     &e->norm_slots, &e->elems, &e->bits, &e->lane_bits, &e->op,
                                     &e->quorum, &table, &nonce, &space, &base, &group_ip, &group_port,
                                     &e->notices))
        return -1;
    if (group_port != 0) {
        struct in_addr g;
        if (group_port < 1 || group_port > 65535 || inet_pton(AF_INET, group_ip, &g) != 1 ||
            (ntohl(g.s_addr) >> 28) != 0xE) {
            PyErr_SetString(PyExc_ValueError, "group_ip must be an IPv4 multicast address and group_port in 1..65535");
            return -1;
        }
        e->w_ip[GROUP] = g.s_addr; e->w_port[GROUP] = (uint16_t)group_port; e->group = 1;
    }
    if (space != Py_None && !PyObject_TypeCheck(space, &SlotSpaceType)) {
        PyErr_SetString(PyExc_TypeError, "space must be a SlotSpace or None");
        return -1;
    }
    e->nonce = (uint32_t)nonce;
    if (e->n < 1 || e->n > MAX_WORKERS || e->slots < 1 || e->norm_slots < 1 || e->elems < 1 ||
        e->elems > 65535 || e->bits < 1 || e->bits > 8 ||
        e->lane_bits < 1 || (e->lane_bits > 8 && e->lane_bits != 16 && e->lane_bits != 32) || e->quorum < 1 ||
        e->quorum > e->n || (e->op != OP_LOOKUP_SUM && e->op != OP_FLOAT_SUM)) {
        PyErr_SetString(PyExc_ValueError, "invalid engine parameters");
        return -1;
    }
    e->job_id = (uint16_t)job_id;
    PyObject *seq = PySequence_Fast(table, "table must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t tn = PySequence_Fast_GET_SIZE(seq);
    if (e->op == OP_LOOKUP_SUM && tn != (1 << e->bits)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "table must have 2^bits entries");
        return -1;
    }
    memset(e->table, 0, sizeof e->table);
    for (Py_ssize_t i = 0; i < tn && i < 256; i++)
        e->table[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (PyErr_Occurred()) return -1;
    for (int i = 0; i < 256; i++) e->table8[i] = (uint8_t)e->table[i];
    pthread_mutex_init(&e->lock, NULL);
    int total = e->slots + e->norm_slots;
    if (space != Py_None) {
        if (claim_region(e, (SlotSpace *)space, base, total) < 0) return -1;
    } else {
        e->slot = PyMem_RawCalloc(total, sizeof(slot_t));
        if (!e->slot) { PyErr_NoMemory(); return -1; }
    }
    for (int i = 0; i < total; i++) {
        e->slot[i].acc = PyMem_RawCalloc(e->elems, 4);
        e->slot[i].cur.payload = PyMem_RawCalloc(e->elems, 4);
        e->slot[i].prev.payload = PyMem_RawCalloc(e->elems, 4);
        if (!e->slot[i].acc || !e->slot[i].cur.payload || !e->slot[i].prev.payload) {
            PyErr_NoMemory();
            return -1;
        }
    }
    e->cap_out = OUT_CAP;
    e->cap_msgs = OUT_CAP * e->n;
    e->pkt_cap = (size_t)e->elems * 4;
    e->out = PyMem_RawCalloc(e->cap_out, sizeof(outpkt_t));
    e->msgs = PyMem_RawCalloc(e->cap_msgs, sizeof(*e->msgs));
    e->arena = PyMem_RawCalloc(e->cap_out, e->pkt_cap);
    e->mm = PyMem_RawCalloc(e->cap_msgs, sizeof(struct mmsghdr));
    e->iov = PyMem_RawCalloc(2 * (size_t)e->cap_msgs, sizeof(struct iovec));
    e->sa = PyMem_RawCalloc(e->cap_msgs, sizeof(struct sockaddr_in));
    e->cmsg = PyMem_RawCalloc(e->cap_msgs, CMSG_SEG_SPACE);
    e->order = PyMem_RawCalloc(e->cap_msgs, sizeof(int));
    e->gso = 1;
    if (!e->out || !e->msgs || !e->arena || !e->mm || !e->iov || !e->sa || !e->cmsg || !e->order) {
        PyErr_NoMemory();
        return -1;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    e->avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    e->lanes_path = lanes_best_path();
#endif
    return 0;
}

static PyObject *Engine_register(Engine *e, PyObject *args) {
    long long w, port, token = 0;
    const char *ip;
    if (!PyArg_ParseTuple(args, "LsL|L", &w, &ip, &port, &token)) return NULL;
    struct in_addr a;
    if (w < 0 || w >= e->n || inet_pton(AF_INET, ip, &a) != 1 || port < 0 || port > 65535 ||
        token < 0 || token > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "bad registration: worker %lld at %s:%lld", w, ip, port);
        return NULL;
    }
    pthread_mutex_lock(&e->lock);
    e->w_ip[w] = a.s_addr; e->w_port[w] = (uint16_t)port; e->w_token[w] = (uint32_t)token; e->w_reg[w] = 1;
    pthread_mutex_unlock(&e->lock);
    Py_RETURN_NONE;
}

static PyObject *Engine_unregister(Engine *e, PyObject *args) {
    long long w;
    if (!PyArg_ParseTuple(args, "L", &w)) return NULL;
    if (w < 0 || w >= e->n) { PyErr_Format(PyExc_ValueError, "worker %lld out of range", w); return NULL; }
    pthread_mutex_lock(&e->lock);
    e->w_reg[w] = 0; e->w_token[w] = 0;
    pthread_mutex_unlock(&e->lock);
    Py_RETURN_NONE;
}

static PyObject *dest_tuple(Engine *e, int w) {
    char s[INET_ADDRSTRLEN];
    struct in_addr a = {.s_addr = e->w_ip[w]};
    inet_ntop(AF_INET, &a, s, sizeof s);
    return Py_BuildValue("(si)", s, (int)e->w_port[w]);
}

/* Build the Python list of (bytes, (ip, port)) of the queued outputs. */
static PyObject *drain_to_list(Engine *e) {
    PyObject *list = PyList_New(0);
    for (int m = 0; list && m < e->n_msgs; m++) {
        outpkt_t *o = &e->out[e->msgs[m].pkt];
        PyObject *b = PyBytes_FromStringAndSize(NULL, HDR + o->payload_len);
        if (!b) { Py_CLEAR(list); break; }
        memcpy(PyBytes_AS_STRING(b), o->hdr, HDR);
        if (o->payload_len) memcpy(PyBytes_AS_STRING(b) + HDR, o->payload, o->payload_len);
        PyObject *item = Py_BuildValue("(NN)", b, dest_tuple(e, e->msgs[m].dest));
        if (!item || PyList_Append(list, item) < 0) { Py_XDECREF(item); Py_CLEAR(list); break; }
        Py_DECREF(item);
    }
    e->n_out = e->n_msgs = 0;
    return list;
}

static void flush(Engine *e, int fd);

static void handle_segments(Engine *e, const uint8_t *buf, uint32_t len, uint32_t seg, uint32_t ip,
                            uint16_t port, int fd) {
    if (seg == 0 || seg >= len) seg = len ? len : 1;
    uint32_t off = 0;
    do {
        uint32_t n = len - off < seg ? len - off : seg;
        handle(e, buf + off, n, ip, port, 0);
        e->io[IO_RX_SEGMENTS]++;
        if (fd >= 0 && e->n_out >= e->cap_out) flush(e, fd);
        off += n;
    } while (off < len);
}

static int parse_addr(const char *ip, uint32_t *out) {
    struct in_addr a;
    if (inet_pton(AF_INET, ip, &a) != 1) {
        PyErr_Format(PyExc_ValueError, "bad address %s", ip);
        return -1;
    }
    *out = a.s_addr;
    return 0;
}

/* process()'s arguments (datagram, (ip, port)): the datagram's buffer (the caller releases
 * it), the source address as text and as a network-order IPv4 address, and the port */
typedef struct {
    Py_buffer buf;
    const char *ip;
    uint32_t addr;
    int port;
} datagram_args;

/* -1 with the exception set when `args` are not (datagram, (ip, port)) */
static int process_args(PyObject *args, datagram_args *d) {
    if (!PyArg_ParseTuple(args, "y*(si)", &d->buf, &d->ip, &d->port)) return -1;
    if (parse_addr(d->ip, &d->addr) < 0) { PyBuffer_Release(&d->buf); return -1; }
    return 0;
}

static PyObject *Engine_process(Engine *e, PyObject *args) {
    datagram_args d;
    if (process_args(args, &d) < 0) return NULL;
    pthread_mutex_lock(&e->lock);
    handle(e, d.buf.buf, (uint32_t)d.buf.len, d.addr, (uint16_t)d.port, 0);
    PyObject *out = drain_to_list(e);
    pthread_mutex_unlock(&e->lock);
    PyBuffer_Release(&d.buf);
    return out;
}

/* process_segments(buffer, seg_size, (ip, port)): a GRO batch as serve() handles it. */
static PyObject *Engine_process_segments(Engine *e, PyObject *args) {
    Py_buffer buf;
    const char *ip;
    int port, seg;
    uint32_t a;
    if (!PyArg_ParseTuple(args, "y*i(si)", &buf, &seg, &ip, &port)) return NULL;
    if (seg < 0 || parse_addr(ip, &a) < 0) {
        PyBuffer_Release(&buf);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative segment size");
        return NULL;
    }
    PyObject *all = PyList_New(0);
    pthread_mutex_lock(&e->lock);
    uint32_t len = (uint32_t)buf.len, step = (seg == 0 || (uint32_t)seg >= len) ? (len ? len : 1) : (uint32_t)seg;
    uint32_t off = 0;
    do {   /* one segment at a time so the output list keeps every reply (no socket to flush to) */
        uint32_t n = len - off < step ? len - off : step;
        handle_segments(e, (const uint8_t *)buf.buf + off, n, 0, a, (uint16_t)port, -1);
        PyObject *part = drain_to_list(e);
        if (!part || !all) { Py_XDECREF(part); Py_CLEAR(all); break; }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(part); i++) PyList_Append(all, PyList_GET_ITEM(part, i));
        Py_DECREF(part);
        off += n;
    } while (off < len);
    e->io[IO_RX_MSGS]++;
    if (step < len) e->io[IO_RX_COALESCED]++;
    pthread_mutex_unlock(&e->lock);
    PyBuffer_Release(&buf);
    return all;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* sendmmsg until every message is out; returns the index of the first message the kernel
 * refused with EIO/EINVAL (UDP GSO not available on the route), or n. */
static int send_all(int fd, struct mmsghdr *mm, int n) {
    int sent = 0, tries = 0;
    while (sent < n && tries++ < 100) {
        int r = sendmmsg(fd, mm + sent, n - sent, 0);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOBUFS) continue;
            if ((errno == EIO || errno == EINVAL || errno == EOPNOTSUPP) && mm[sent].msg_hdr.msg_controllen)
                return sent;
            /* e.g. ECONNREFUSED from a worker that left, EPERM from a drop rule: that message is lost */
            sent++;
            continue;
        }
        sent += r;
    }
    return n;
}

/* Send the queued outputs.  Datagrams to one worker go out in queue order; with GSO a run of
 * equal-size datagrams to one worker (a fan-out of consecutive results, a batch of replies)
 * is one message with a UDP_SEGMENT control message, the last one of a run may be shorter;
 * all messages leave in one sendmmsg.  Without GSO (or if the kernel refuses it, which turns
 * it off for this engine) every datagram is its own message. */
static void flush(Engine *e, int fd) {
    int n = e->n_msgs;
    if (n == 0) { e->n_out = 0; return; }
    int k = 0;
    for (int w = 0; w <= e->n; w++) {           /* stable grouping by destination, the group last */
        int d = w < e->n ? w : GROUP;
        for (int m = 0; m < n; m++)
            if (e->msgs[m].dest == d) e->order[k++] = m;
    }
    for (;;) {
        int nm = 0, iv = 0;
        uint32_t seg = 0, bytes = 0, segs = 0;
        int open = 0, prev_w = -1;
        for (int j = 0; j < k; j++) {
            int m = e->order[j], p = e->msgs[m].pkt, w = e->msgs[m].dest;
            uint32_t len = HDR + e->out[p].payload_len;
            int join = e->gso && open && w == prev_w && segs < GSO_MAX_SEGS && bytes + len <= GSO_MAX_BYTES &&
                       len <= seg;
            if (!join) {
                struct sockaddr_in *sa = &e->sa[nm];
                memset(sa, 0, sizeof *sa);
                sa->sin_family = AF_INET;
                sa->sin_addr.s_addr = e->w_ip[w];
                sa->sin_port = htons(e->w_port[w]);
                memset(&e->mm[nm], 0, sizeof e->mm[nm]);
                e->mm[nm].msg_hdr.msg_name = sa;
                e->mm[nm].msg_hdr.msg_namelen = sizeof *sa;
                e->mm[nm].msg_hdr.msg_iov = e->iov + iv;
                nm++;
                seg = len; bytes = 0; segs = 0; open = 1; prev_w = w;
            }
            struct msghdr *h = &e->mm[nm - 1].msg_hdr;
            e->iov[iv].iov_base = e->out[p].hdr; e->iov[iv].iov_len = HDR; iv++;
            e->iov[iv].iov_base = (void *)e->out[p].payload; e->iov[iv].iov_len = e->out[p].payload_len; iv++;
            h->msg_iovlen += 2;
            bytes += len; segs++;
            if (len < seg) open = 0;          /* a shorter datagram ends a GSO run */
            if (segs > 1) set_gso_segment(h, e->cmsg + (size_t)(nm - 1) * CMSG_SEG_SPACE, seg);
        }
        int done = send_all(fd, e->mm, nm);
        if (done >= nm) {
            e->io[IO_TX_MSGS] += nm;
            e->io[IO_TX_SEGMENTS] += k;
            for (int i = 0; i < nm; i++) if (e->mm[i].msg_hdr.msg_iovlen > 2) e->io[IO_TX_GSO]++;
            break;
        }
        /* GSO refused: send the rest as plain datagrams and stop using it */
        e->gso = 0;
        e->io[IO_GSO_FALLBACKS]++;
        int first = 0;
        for (int i = 0; i < done; i++) first += (int)e->mm[i].msg_hdr.msg_iovlen / 2;
        e->io[IO_TX_MSGS] += done;
        e->io[IO_TX_SEGMENTS] += first;
        memmove(e->order, e->order + first, (size_t)(k - first) * sizeof(int));
        k -= first;
    }
    e->n_out = e->n_msgs = 0;
}

/* The receive loop of Engine.serve and Mux.serve: recvmmsg batches with the GIL released
 * (the caller releases it); with gro the socket gets UDP_GRO and each message's segments
 * (its UDP_GRO control message gives the size) go to `segment` one by one; `flush` sends
 * what a batch queued.  Returns the datagrams handled; stops early when `stop` says so. */
typedef struct {
    void (*segment)(void *ctx, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, int fd);
    void (*flush)(void *ctx, int fd);
    int (*stop)(void *ctx);
    void *ctx;
    uint64_t *io;            /* IO_RX_* counters */
    pthread_mutex_t *io_lock;
} rx_t;

static long rx_loop(int fd, int duration_ms, uint8_t *rx, size_t cap, rx_t *h, int *err) {
    struct mmsghdr mm[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in sa[BATCH];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctl[BATCH];
    long handled = 0;
    double deadline = now_ms() + duration_ms;
    for (;;) {
        double left = deadline - now_ms();
        if (left <= 0) break;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)(left + 1));
        if (pr < 0) { if (errno == EINTR) continue; *err = errno; break; }
        if (pr == 0) break;
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = rx + i * cap; iov[i].iov_len = cap;
            memset(&mm[i], 0, sizeof mm[i]);
            mm[i].msg_hdr.msg_iov = &iov[i]; mm[i].msg_hdr.msg_iovlen = 1;
            mm[i].msg_hdr.msg_name = &sa[i]; mm[i].msg_hdr.msg_namelen = sizeof sa[i];
            mm[i].msg_hdr.msg_control = ctl[i].buf; mm[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        int r = recvmmsg(fd, mm, BATCH, MSG_DONTWAIT, NULL);
        if (r < 0) { if (errno == EAGAIN || errno == EINTR || errno == ECONNREFUSED) continue; *err = errno; break; }
        for (int i = 0; i < r; i++) {
            uint32_t seg = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&mm[i].msg_hdr); c; c = CMSG_NXTHDR(&mm[i].msg_hdr, c))
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                    int v; memcpy(&v, CMSG_DATA(c), sizeof v);
                    seg = v > 0 ? (uint32_t)v : 0;
                }
            const uint8_t *buf = rx + i * cap;
            uint32_t len = mm[i].msg_len, step = (seg == 0 || seg >= len) ? (len ? len : 1) : seg, off = 0, n = 0;
            do {    /* every segment exactly as a lone datagram (proto.headers.split_segments) */
                uint32_t part = len - off < step ? len - off : step;
                h->segment(h->ctx, buf + off, part, sa[i].sin_addr.s_addr, ntohs(sa[i].sin_port), fd);
                off += part; n++;
            } while (off < len);
            pthread_mutex_lock(h->io_lock);
            h->io[IO_RX_MSGS]++;
            h->io[IO_RX_SEGMENTS] += n;
            if (n > 1) h->io[IO_RX_COALESCED]++;
            pthread_mutex_unlock(h->io_lock);
            handled += n;
        }
        h->flush(h->ctx, fd);
        if (h->stop && h->stop(h->ctx)) break;
    }
    return handled;
}

/* One datagram under the engine's lock, flushing to fd when the output queue is full;
 * `checked`: its header passed header_check already. */
static void engine_take(Engine *e, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, int fd,
                        int checked) {
    pthread_mutex_lock(&e->lock);
    handle(e, buf, len, ip, port, checked);
    if (fd >= 0 && e->n_out >= e->cap_out) flush(e, fd);
    pthread_mutex_unlock(&e->lock);
}

static void engine_segment(void *ctx, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, int fd) {
    engine_take(ctx, buf, len, ip, port, fd, 0);
}

static void engine_flush(void *ctx, int fd) {
    Engine *e = ctx;
    pthread_mutex_lock(&e->lock);
    flush(e, fd);
    pthread_mutex_unlock(&e->lock);
}

#define SERVE_CAP 65536      /* the receive buffer of serve(): BATCH datagrams of up to 64 KiB */

/* serve()'s arguments (fd, duration_ms, gro=True, gso=True) and its receive buffer, with UDP
 * GRO on the socket as asked (a kernel without it: plain datagrams); NULL with the exception
 * set when the arguments or the memory fail.  The caller frees the buffer. */
static uint8_t *serve_begin(PyObject *args, int *fd, int *duration_ms, int *gso) {
    int gro = 1;
    *gso = 1;
    if (!PyArg_ParseTuple(args, "ii|pp", fd, duration_ms, &gro, gso)) return NULL;
    uint8_t *rx = PyMem_RawMalloc(BATCH * SERVE_CAP);
    if (!rx) { PyErr_NoMemory(); return NULL; }
    int on = gro ? 1 : 0;
    setsockopt(*fd, SOL_UDP, UDP_GRO, &on, sizeof on);
    return rx;
}

/* serve(fd, duration_ms, gro=True, gso=True) -> datagrams handled: this engine alone on the
 * socket (a PS of several jobs serves through a Mux). */
static PyObject *Engine_serve(Engine *e, PyObject *args) {
    int fd, duration_ms, gso;
    uint8_t *rx = serve_begin(args, &fd, &duration_ms, &gso);
    if (!rx) return NULL;
    pthread_mutex_lock(&e->lock);
    if (!gso) e->gso = 0;
    pthread_mutex_unlock(&e->lock);
    long handled = 0;
    int err = 0;
    rx_t h = {engine_segment, engine_flush, NULL, e, e->io, &e->lock};
    Py_BEGIN_ALLOW_THREADS
    handled = rx_loop(fd, duration_ms, rx, SERVE_CAP, &h, &err);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(rx);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLong(handled);
}

/* {name: count} of the socket batching counters io[first..last] (the caller holds their lock) */
static PyObject *io_dict(const uint64_t *io, int first, int last) {
    PyObject *d = PyDict_New();
    for (int i = first; d && i <= last; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(io[i]);
        PyDict_SetItemString(d, io_names[i], v);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *Engine_io_stats(Engine *e, PyObject *noargs) {
    pthread_mutex_lock(&e->lock);
    PyObject *d = io_dict(e->io, 0, N_IO - 1);
    PyObject *g = PyBool_FromLong(e->gso);
    if (d) PyDict_SetItemString(d, "gso", g);
    Py_DECREF(g);
    pthread_mutex_unlock(&e->lock);
    return d;
}

/* {name: count} of n counters (n <= N_COUNTERS), and the drops by reason under "drops", both
 * copied under `lock` (the dict is built after it is released): the stats() of Engine and Mux */
static PyObject *stats_dict(pthread_mutex_t *lock, const char **names, const uint64_t *counters, int n,
                            const uint64_t *drop_counters) {
    uint64_t counts[N_COUNTERS], drop_counts[N_DROPS];
    pthread_mutex_lock(lock);
    memcpy(counts, counters, (size_t)n * sizeof *counts);
    memcpy(drop_counts, drop_counters, sizeof drop_counts);
    pthread_mutex_unlock(lock);
    PyObject *d = PyDict_New(), *drops = PyDict_New();
    if (!d || !drops) { Py_XDECREF(d); Py_XDECREF(drops); return NULL; }
    for (int i = 0; i < n + N_DROPS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(i < n ? counts[i] : drop_counts[i - n]);
        if (v) PyDict_SetItemString(i < n ? d : drops, i < n ? names[i] : drop_names[i - n], v);
        Py_XDECREF(v);
    }
    PyDict_SetItemString(d, "drops", drops);
    Py_DECREF(drops);
    return d;
}

static PyObject *Engine_stats(Engine *e, PyObject *noargs) {
    return stats_dict(&e->lock, counter_names, e->counters, N_COUNTERS, e->drops);
}

/* region() -> (base, size): the engine's slots in its SlotSpace (base 0: its own array) */
static PyObject *Engine_region(Engine *e, PyObject *noargs) {
    return Py_BuildValue("(ii)", e->base, e->slots + e->norm_slots);
}

/* The Python type of the _fastpath object NAME: its struct NAME, NAME_init, NAME_dealloc and
 * NAME_methods; further slots (tp_members) follow DOC. */
#define FASTPATH_TYPE(NAME, DOC, ...)                  \
    static PyTypeObject NAME##Type = {                 \
        PyVarObject_HEAD_INIT(NULL, 0)                 \
        .tp_name = "ps_server._fastpath." #NAME,       \
        .tp_basicsize = sizeof(NAME),                  \
        .tp_flags = Py_TPFLAGS_DEFAULT,                \
        .tp_new = PyType_GenericNew,                   \
        .tp_init = (initproc)NAME##_init,              \
        .tp_dealloc = (destructor)NAME##_dealloc,      \
        .tp_methods = NAME##_methods,                  \
        .tp_doc = DOC,                                 \
        __VA_ARGS__                                    \
    }

/* A method table entry: T_name as T.name */
#define METHOD(T, name, flags, doc) {#name, (PyCFunction)T##_##name, flags, doc}

/* The methods of a datagram handler, which an Engine and a Mux both are (process, serve,
 * stats, io_stats), closing the method table of T. */
#define HANDLER_METHODS(T, serve_doc, stats_doc, io_doc)                                              \
    METHOD(T, process, METH_VARARGS, "process(datagram, (ip, port)) -> [(bytes, (ip, port))]"),      \
    METHOD(T, serve, METH_VARARGS, "serve(fd, duration_ms, gro=True, gso=True) -> " serve_doc),      \
    METHOD(T, stats, METH_NOARGS, stats_doc),                                                        \
    METHOD(T, io_stats, METH_NOARGS, io_doc),                                                        \
    {NULL, NULL, 0, NULL}

static PyMethodDef Engine_methods[] = {
    METHOD(Engine, region, METH_NOARGS, "(base, size) of the engine's slots"),
    METHOD(Engine, close, METH_NOARGS, "close(): free the engine's slots (the job ended)"),
    METHOD(Engine, register, METH_VARARGS, "register(worker_id, ip, port, token=0): bind a worker to its source address and token"),
    METHOD(Engine, unregister, METH_VARARGS, "unregister(worker_id): forget a worker (left or lease expired)"),
    METHOD(Engine, process_segments, METH_VARARGS, "process_segments(buffer, seg_size, (ip, port)) -> [(bytes, (ip, port))]: a UDP GRO batch, each segment one datagram"),
    HANDLER_METHODS(Engine, "datagrams handled (GIL released)", "counters and drops by reason",
                    "socket batching counters (GRO/GSO)")};

FASTPATH_TYPE(Engine, "C aggregation engine mirroring ps_server.reference.ReferencePS");

/* ------------------------------------------------------------------ SlotSpace */

static void SlotSpace_dealloc(SlotSpace *sp) {
    PyMem_RawFree(sp->slot);
    PyMem_RawFree(sp->owner);
    pthread_mutex_destroy(&sp->lock);
    Py_TYPE(sp)->tp_free((PyObject *)sp);
}

static int SlotSpace_init(SlotSpace *sp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"size", NULL};
    int size;
    if (sp->slot) { PyErr_SetString(PyExc_RuntimeError, "a SlotSpace is initialized once"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i", kwlist, &size)) return -1;
    if (size < 1 || size > 65536) {
        PyErr_Format(PyExc_ValueError, "a slot space holds 1..65536 slots (the 16-bit slot field), got %d", size);
        return -1;
    }
    pthread_mutex_init(&sp->lock, NULL);
    sp->size = size;
    sp->slot = PyMem_RawCalloc(size, sizeof(slot_t));
    sp->owner = PyMem_RawCalloc(size, sizeof(void *));
    if (!sp->slot || !sp->owner) { PyErr_NoMemory(); return -1; }
    return 0;
}

/* used() -> slots held by engines; the rest is free */
static PyObject *SlotSpace_used(SlotSpace *sp, PyObject *noargs) {
    long used = 0;
    pthread_mutex_lock(&sp->lock);
    for (int i = 0; i < sp->size; i++) used += sp->owner[i] != NULL;
    pthread_mutex_unlock(&sp->lock);
    return PyLong_FromLong(used);
}

/* slot_state(i) -> (active, round, bitmap, count): one slot's round state, for the isolation
 * tests (a job's traffic must leave every slot outside its region as it was) */
static PyObject *SlotSpace_slot_state(SlotSpace *sp, PyObject *args) {
    int i;
    if (!PyArg_ParseTuple(args, "i", &i)) return NULL;
    if (i < 0 || i >= sp->size) { PyErr_Format(PyExc_IndexError, "slot %d out of range", i); return NULL; }
    pthread_mutex_lock(&sp->lock);
    slot_t st = sp->slot[i];
    pthread_mutex_unlock(&sp->lock);
    return Py_BuildValue("(iIIi)", st.active, st.round, st.bitmap, st.count);
}

static PyMethodDef SlotSpace_methods[] = {
    {"used", (PyCFunction)SlotSpace_used, METH_NOARGS, "slots held by engines"},
    {"slot_state", (PyCFunction)SlotSpace_slot_state, METH_VARARGS, "slot_state(i) -> (active, round, bitmap, count)"},
    {NULL, NULL, 0, NULL}};

static PyMemberDef SlotSpace_members[] = {
    {"size", T_INT, offsetof(SlotSpace, size), READONLY, "slots in the space"},
    {NULL, 0, 0, 0, NULL}};

FASTPATH_TYPE(SlotSpace, "SlotSpace(size): the PS's slots, shared by the jobs' engines in disjoint regions",
              .tp_members = SlotSpace_members);

/* ------------------------------------------------------------------ Mux */

/* Several jobs on one socket: each datagram goes to the engine of its job id (the switch's
 * job table does the same).  A C Engine handles it here, with the GIL released; the
 * datagrams of a job served by a Python engine (ReferencePS: the decode–sum–re-encode
 * codecs) are handed back to the caller.  A datagram of no job is counted here under the
 * reason an engine would have given (ps_server.engine.JobTable is the Python twin). */
#define MAX_JOBS 64
enum { M_PACKETS_IN, M_BYTES_IN, N_MUX };

typedef struct {
    uint16_t job;
    uint16_t port;
    uint32_t ip, len;
    uint8_t *data;
} pending_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;        /* the table; held by serve for a whole batch */
    pthread_mutex_t io_lock;
    int n;
    uint16_t ids[MAX_JOBS];
    PyObject *obj[MAX_JOBS];     /* owned references */
    Engine *eng[MAX_JOBS];       /* NULL: a Python engine */
    uint64_t counters[N_MUX], drops[N_DROPS], io[N_IO];
    pending_t *pend;
    int n_pend, cap_pend;
    int ready;
} Mux;

static PyTypeObject MuxType;

static int mux_find(Mux *m, uint16_t job) {
    for (int i = 0; i < m->n; i++) if (m->ids[i] == job) return i;
    return -1;
}

static void mux_drop(Mux *m, int reason, uint32_t len) {
    m->counters[M_PACKETS_IN]++;
    m->counters[M_BYTES_IN] += len;
    m->drops[reason]++;
}

static void mux_segment(void *ctx, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port, int fd) {
    Mux *m = ctx;
    int bad = header_check(buf, len);
    if (bad >= 0) { mux_drop(m, bad, len); return; }
    uint16_t job = rd16(buf + 8);
    int j = mux_find(m, job);
    if (j < 0) { mux_drop(m, D_JOB, len); return; }
    if (m->eng[j]) { engine_take(m->eng[j], buf, len, ip, port, fd, 1); return; }
    if (m->n_pend >= m->cap_pend) {
        int cap = m->cap_pend ? 2 * m->cap_pend : 256;
        pending_t *p = PyMem_RawRealloc(m->pend, (size_t)cap * sizeof(pending_t));
        if (!p) { mux_drop(m, D_MALFORMED, len); return; }     /* out of memory: lost, counted */
        m->pend = p; m->cap_pend = cap;
    }
    uint8_t *copy = PyMem_RawMalloc(len);
    if (!copy) { mux_drop(m, D_MALFORMED, len); return; }
    memcpy(copy, buf, len);
    m->pend[m->n_pend++] = (pending_t){job, port, ip, len, copy};
}

static void mux_flush(void *ctx, int fd) {
    Mux *m = ctx;
    for (int j = 0; j < m->n; j++) if (m->eng[j]) engine_flush(m->eng[j], fd);
}

static int mux_stop(void *ctx) { return ((Mux *)ctx)->n_pend > 0; }   /* Python has work */

static int Mux_init(Mux *m, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {NULL};
    if (m->ready) { PyErr_SetString(PyExc_RuntimeError, "a Mux is initialized once"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "", kwlist)) return -1;
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_init(&m->io_lock, NULL);
    m->ready = 1;
    return 0;
}

static void Mux_dealloc(Mux *m) {
    for (int j = 0; j < m->n; j++) Py_DECREF(m->obj[j]);
    for (int i = 0; i < m->n_pend; i++) PyMem_RawFree(m->pend[i].data);
    PyMem_RawFree(m->pend);
    if (m->ready) { pthread_mutex_destroy(&m->lock); pthread_mutex_destroy(&m->io_lock); }
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* add(job_id, engine): route the job's datagrams to `engine` (a C Engine or any object with
 * process(datagram, addr)) */
static PyObject *Mux_add(Mux *m, PyObject *args) {
    int job;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iO", &job, &obj)) return NULL;
    if (job < 0 || job > 0xFFFF) { PyErr_Format(PyExc_ValueError, "job id %d does not fit 16 bits", job); return NULL; }
    int is_c = PyObject_TypeCheck(obj, &EngineType);
    if (is_c && ((Engine *)obj)->job_id != job) {
        PyErr_Format(PyExc_ValueError, "the engine serves job id %d, not %d", ((Engine *)obj)->job_id, job);
        return NULL;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->lock);
    Py_END_ALLOW_THREADS
    if (mux_find(m, (uint16_t)job) >= 0) err = 1;
    else if (m->n >= MAX_JOBS) err = 2;
    else {
        Py_INCREF(obj);
        m->ids[m->n] = (uint16_t)job; m->obj[m->n] = obj; m->eng[m->n] = is_c ? (Engine *)obj : NULL;
        m->n++;
    }
    pthread_mutex_unlock(&m->lock);
    if (err == 1) { PyErr_Format(PyExc_ValueError, "job id %d is already served", job); return NULL; }
    if (err == 2) { PyErr_Format(PyExc_ValueError, "at most %d jobs at once", MAX_JOBS); return NULL; }
    Py_RETURN_NONE;
}

/* remove(job_id): the job's datagrams count as unknown_job from now on */
static PyObject *Mux_remove(Mux *m, PyObject *args) {
    int job;
    if (!PyArg_ParseTuple(args, "i", &job)) return NULL;
    PyObject *gone = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->lock);
    Py_END_ALLOW_THREADS
    int j = mux_find(m, (uint16_t)job);
    if (j >= 0) {
        gone = m->obj[j];
        m->n--;
        m->ids[j] = m->ids[m->n]; m->obj[j] = m->obj[m->n]; m->eng[j] = m->eng[m->n];
    }
    pthread_mutex_unlock(&m->lock);
    if (!gone) { PyErr_Format(PyExc_KeyError, "job id %d is not served", job); return NULL; }
    Py_DECREF(gone);
    Py_RETURN_NONE;
}

/* The handed-back datagrams as [(job_id, bytes, (ip, port))]; clears them. */
static PyObject *mux_take_pending(Mux *m) {
    PyObject *list = PyList_New(0);
    for (int i = 0; i < m->n_pend; i++) {
        pending_t *p = &m->pend[i];
        char s[INET_ADDRSTRLEN];
        struct in_addr a = {.s_addr = p->ip};
        inet_ntop(AF_INET, &a, s, sizeof s);
        PyObject *item = list ? Py_BuildValue("(iy#(si))", (int)p->job, (const char *)p->data,
                                              (Py_ssize_t)p->len, s, (int)p->port) : NULL;
        if (list && (!item || PyList_Append(list, item) < 0)) Py_CLEAR(list);
        Py_XDECREF(item);
        PyMem_RawFree(p->data);
    }
    m->n_pend = 0;
    return list;
}

/* serve(fd, duration_ms, gro=True, gso=True) -> (datagrams handled, [(job_id, bytes, (ip, port))]):
 * the datagrams of Python-served jobs are returned (serve returns as soon as there are some) */
static PyObject *Mux_serve(Mux *m, PyObject *args) {
    int fd, duration_ms, gso;
    uint8_t *rx = serve_begin(args, &fd, &duration_ms, &gso);
    if (!rx) return NULL;
    long handled = 0;
    int err = 0;
    rx_t h = {mux_segment, mux_flush, mux_stop, m, m->io, &m->io_lock};
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&m->lock);
    for (int j = 0; j < m->n; j++)
        if (m->eng[j] && !gso) { pthread_mutex_lock(&m->eng[j]->lock); m->eng[j]->gso = 0; pthread_mutex_unlock(&m->eng[j]->lock); }
    /* the table may change between calls, never during one: add/remove wait for a batch */
    pthread_mutex_unlock(&m->lock);
    double deadline = now_ms() + duration_ms;
    while (!err && m->n_pend == 0) {
        double left = deadline - now_ms();
        if (left <= 0) break;
        pthread_mutex_lock(&m->lock);
        handled += rx_loop(fd, left < 10 ? (int)left + 1 : 10, rx, SERVE_CAP, &h, &err);
        pthread_mutex_unlock(&m->lock);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(rx);
    PyObject *pending = mux_take_pending(m);
    if (err) { Py_XDECREF(pending); errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    if (!pending) return NULL;
    return Py_BuildValue("(lN)", handled, pending);
}

/* process(datagram, (ip, port)) -> [(bytes, (ip, port))]: one datagram as serve() handles it
 * (a Python engine's process() is called) */
static PyObject *Mux_process(Mux *m, PyObject *args) {
    datagram_args d;
    if (process_args(args, &d) < 0) return NULL;
    const uint8_t *b = d.buf.buf;
    uint32_t len = (uint32_t)d.buf.len;
    PyObject *out = NULL, *py = NULL;
    Engine *e = NULL;
    pthread_mutex_lock(&m->lock);
    int bad = header_check(b, len), j = -1;
    if (bad < 0) {
        j = mux_find(m, rd16(b + 8));
        if (j < 0) bad = D_JOB;
    }
    if (bad >= 0) mux_drop(m, bad, len);
    else if (m->eng[j]) e = m->eng[j];
    else { py = m->obj[j]; Py_INCREF(py); }
    pthread_mutex_unlock(&m->lock);
    if (e) {
        pthread_mutex_lock(&e->lock);
        handle(e, b, len, d.addr, (uint16_t)d.port, 1);
        out = drain_to_list(e);
        pthread_mutex_unlock(&e->lock);
    } else if (py) {
        out = PyObject_CallMethod(py, "process", "y#(si)", (const char *)b, (Py_ssize_t)len, d.ip, d.port);
        Py_DECREF(py);
    } else {
        out = PyList_New(0);
    }
    PyBuffer_Release(&d.buf);
    return out;
}

/* stats() -> the counters of datagrams no job received: packets_in, bytes_in, drops */
static PyObject *Mux_stats(Mux *m, PyObject *noargs) {
    static const char *names[N_MUX] = {"packets_in", "bytes_in"};
    return stats_dict(&m->io_lock, names, m->counters, N_MUX, m->drops);
}

static PyObject *Mux_io_stats(Mux *m, PyObject *noargs) {
    pthread_mutex_lock(&m->io_lock);
    PyObject *d = io_dict(m->io, IO_RX_MSGS, IO_RX_SEGMENTS);
    pthread_mutex_unlock(&m->io_lock);
    return d;
}

static PyObject *Mux_jobs(Mux *m, PyObject *noargs) {
    pthread_mutex_lock(&m->lock);
    PyObject *list = PyList_New(m->n);
    for (int j = 0; list && j < m->n; j++) PyList_SET_ITEM(list, j, PyLong_FromLong(m->ids[j]));
    pthread_mutex_unlock(&m->lock);
    return list;
}

static PyMethodDef Mux_methods[] = {
    METHOD(Mux, add, METH_VARARGS, "add(job_id, engine): serve a job"),
    METHOD(Mux, remove, METH_VARARGS, "remove(job_id): stop serving a job"),
    METHOD(Mux, jobs, METH_NOARGS, "the job ids served"),
    HANDLER_METHODS(Mux, "(handled, [(job_id, bytes, (ip, port))] for Python engines)",
                    "counters of datagrams no job received", "receive batching counters")};

FASTPATH_TYPE(Mux, "Mux(): the jobs of one PS socket, each datagram to its job's engine");

/* lookup_accumulate(acc, packed, table, bits, force_scalar=False, set=False, path=-1): acc[i] +=
 * table[z_i] (with set: acc[i] = table[z_i], a round's first contribution) for the indices
 * packed in `packed`; acc is a writable buffer of uint8/16/32 lanes (itemsize = lane).  The
 * engine's kernels: AVX2 nibbles for 4 bits, the widened tiles for other widths into byte lanes
 * (`path` as pack_lanes', -1 the engine's), the generic loop with force_scalar. */
static PyObject *lookup_accumulate(PyObject *self, PyObject *args) {
    Py_buffer acc, in;
    PyObject *table;
    int bits, force_scalar = 0, set = 0, path = -1;
    if (!PyArg_ParseTuple(args, "w*y*Oi|ppi", &acc, &in, &table, &bits, &force_scalar, &set, &path)) return NULL;
    uint32_t t[256] = {0};
    uint8_t t8[256];
    PyObject *seq = PySequence_Fast(table, "table must be a sequence");
    if (!seq) { PyBuffer_Release(&acc); PyBuffer_Release(&in); return NULL; }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && i < 256; i++)
        t[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    for (int i = 0; i < 256; i++) t8[i] = (uint8_t)t[i];
    int lane = (int)acc.itemsize, best = lanes_best_path();
    Py_ssize_t count = acc.len / lane;
    if ((lane != 1 && lane != 2 && lane != 4) || bits < 1 || bits > 8 || in.len * 8 < count * bits ||
        path < -1 || path > best) {
        PyBuffer_Release(&acc); PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "bad lane width, bits, input length or path");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!force_scalar && bits == 4 && lane == 1 && __builtin_cpu_supports("avx2"))
        lookup_add4_avx2(acc.buf, in.buf, (int)count, t8, set);
    else
#endif
    if (!force_scalar && bits != 4 && lane == 1)
        lookup_add_wide(acc.buf, in.buf, (int)count, bits, t8, set, path < 0 ? best : path);
    else
        lookup_add_scalar(acc.buf, lane, in.buf, (int)count, bits, t, set);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&acc);
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

/* pack_lanes(lanes: uint8 values, bits, path=-1) -> bytes: the RESULT payload of sub-byte lanes
 * (proto/lanes.h) as the engine packs it; path 0 scalar, 1 BMI2, -1 the engine's (the tests
 * hold every path to proto/packing.py's bytes). */
static PyObject *py_pack_lanes(PyObject *self, PyObject *args) {
    Py_buffer in;
    int bits, path = -1;
    if (!PyArg_ParseTuple(args, "y*i|i", &in, &bits, &path)) return NULL;
    int best = lanes_best_path();
    if (bits < 1 || bits > 7 || path > best || path < -1) {
        PyBuffer_Release(&in);
        PyErr_Format(PyExc_ValueError, "pack_lanes: bits must be 1..7 and path -1..%d, got %d and %d", best, bits, path);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)lanes_size((size_t)in.len, bits));
    if (out) lanes_pack((uint8_t *)PyBytes_AS_STRING(out), in.buf, (size_t)in.len, bits, path < 0 ? best : path);
    PyBuffer_Release(&in);
    return out;
}

static PyObject *py_lanes_path(PyObject *self, PyObject *noargs) { return PyLong_FromLong(lanes_best_path()); }

static PyObject *has_avx2(PyObject *self, PyObject *noargs) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2"));
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef module_methods[] = {
    {"lookup_accumulate", lookup_accumulate, METH_VARARGS, "acc += table[unpack(packed)] (kernel benchmark hook)"},
    {"has_avx2", has_avx2, METH_NOARGS, "whether the AVX2 kernel is used"},
    {"pack_lanes", py_pack_lanes, METH_VARARGS, "pack_lanes(lanes, bits, path=-1): sub-byte RESULT lanes as the engine packs them"},
    {"lanes_path", py_lanes_path, METH_NOARGS, "the best sub-byte lane path here: 0 scalar, 1 BMI2, 2 AVX-512 VBMI"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_fastpath", "THC-PS C hot path", -1, module_methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&SlotSpaceType) < 0 || PyType_Ready(&MuxType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    Py_INCREF(&SlotSpaceType);
    Py_INCREF(&MuxType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0
        || PyModule_AddObject(m, "SlotSpace", (PyObject *)&SlotSpaceType) < 0
        || PyModule_AddObject(m, "Mux", (PyObject *)&MuxType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* the wire contract as this engine compiled it, tested equal to proto.headers and to
       ps_server.reference's DROP_REASONS and COUNTERS (tests/test_wire.py) */
    PyObject *drops = PyTuple_New(N_DROPS), *counters = PyTuple_New(N_COUNTERS);
    if (!drops || !counters) goto fail;
    for (int i = 0; i < N_DROPS; i++) PyTuple_SET_ITEM(drops, i, PyUnicode_FromString(drop_names[i]));
    for (int i = 0; i < N_COUNTERS; i++) PyTuple_SET_ITEM(counters, i, PyUnicode_FromString(counter_names[i]));
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HDR) < 0 || PyModule_AddIntConstant(m, "MAGIC", MAGIC) < 0
        || PyModule_AddIntConstant(m, "VERSION", VERSION) < 0
        || PyModule_AddIntConstant(m, "ROUND_WINDOW", ROUND_WINDOW) < 0
        || PyModule_AddIntConstant(m, "MAX_WORKERS", MAX_WORKERS) < 0
        || PyModule_AddIntConstant(m, "DATA", T_DATA) < 0 || PyModule_AddIntConstant(m, "RESULT", T_RESULT) < 0
        || PyModule_AddIntConstant(m, "STRAGGLER", T_STRAGGLER) < 0
        || PyModule_AddIntConstant(m, "NORM", T_NORM) < 0
        || PyModule_AddIntConstant(m, "NORM_RESULT", T_NORM_RESULT) < 0
        || PyModule_AddIntConstant(m, "NOTICE", T_NOTICE) < 0
        || PyModule_AddIntConstant(m, "F_RESENT", F_RESENT) < 0
        || PyModule_AddIntConstant(m, "OP_LOOKUP_SUM", OP_LOOKUP_SUM) < 0
        || PyModule_AddIntConstant(m, "OP_FLOAT_SUM", OP_FLOAT_SUM) < 0
        || PyModule_AddIntConstant(m, "OP_MAX_U32", OP_MAX_U32) < 0)
        goto fail;
    if (PyModule_AddObject(m, "DROP_REASONS", drops) < 0) goto fail;
    drops = NULL;
    if (PyModule_AddObject(m, "COUNTERS", counters) < 0) goto fail;
    return m;
fail:
    Py_XDECREF(drops);
    Py_XDECREF(counters);
    Py_DECREF(m);
    return NULL;
}
