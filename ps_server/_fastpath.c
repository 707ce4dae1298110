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
#define F_RESENT 0x02
#define OP_LOOKUP_SUM 1
#define OP_FLOAT_SUM 2
#define OP_MAX_U32 3
#define MAX_WORKERS 32
#define BATCH 64

enum { C_PACKETS_IN, C_BYTES_IN, C_PACKETS_OUT, C_BYTES_OUT, C_ROUNDS, C_PARTIAL, C_RESENT,
       C_STRAGGLERS, N_COUNTERS };
static const char *counter_names[N_COUNTERS] = {
    "packets_in", "bytes_in", "packets_out", "bytes_out", "rounds_completed", "partial_rounds",
    "results_resent", "stragglers_notified"};
enum { D_MALFORMED, D_VERSION, D_JOB, D_SLOT, D_WORKER, D_UNREG, D_STALE, D_DUP, D_LATE, D_CODEC,
       D_AHEAD, N_DROPS };
static const char *drop_names[N_DROPS] = {
    "malformed", "wrong_version", "unknown_job", "slot_out_of_range", "worker_out_of_range",
    "unregistered", "stale", "duplicate", "late", "codec_error",   /* codec_error: BLOB jobs only */
    "ahead"};

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

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    uint16_t job_id;
    uint32_t nonce;
    int n, slots, norm_slots, elems, bits, lane_bits, op, quorum;
    uint32_t table[256];
    uint8_t table8[16];
    slot_t *slot;
    uint32_t w_ip[MAX_WORKERS];
    uint16_t w_port[MAX_WORKERS];
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
    int avx2;
} Engine;

/* ------------------------------------------------------------------ kernels */

static void lookup_add_scalar(uint8_t *acc, int lane_bytes, const uint8_t *in, int count, int bits,
                              const uint32_t *table) {
    if (bits == 4 && lane_bytes == 1) {
        for (int i = 0; i < count / 2; i++) {
            acc[2 * i] += (uint8_t)table[in[i] >> 4];
            acc[2 * i + 1] += (uint8_t)table[in[i] & 15];
        }
        if (count & 1) acc[count - 1] += (uint8_t)table[in[count / 2] >> 4];
        return;
    }
    uint32_t mask = (1u << bits) - 1;
    uint64_t bitpos = 0;
    for (int i = 0; i < count; i++, bitpos += bits) {
        /* MSB-first bitstream: read `bits` bits starting at bitpos */
        uint32_t byte = (uint32_t)(bitpos >> 3), sh = (uint32_t)(bitpos & 7);
        uint32_t window = ((uint32_t)in[byte] << 8) | (byte + 1 < (uint32_t)((count * bits + 7) / 8) ? in[byte + 1] : 0);
        uint32_t z = (window >> (16 - sh - bits)) & mask;
        uint32_t v = table[z];
        if (lane_bytes == 1) acc[i] += (uint8_t)v;
        else if (lane_bytes == 2) ((uint16_t *)acc)[i] += (uint16_t)v;
        else ((uint32_t *)acc)[i] += v;
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void lookup_add4_avx2(uint8_t *acc, const uint8_t *in, int count, const uint8_t *table8) {
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
        _mm256_storeu_si256(dst, _mm256_add_epi8(_mm256_loadu_si256(dst), first));
        _mm256_storeu_si256(dst + 1, _mm256_add_epi8(_mm256_loadu_si256(dst + 1), second));
    }
    for (; i < nbytes; i++) {
        acc[2 * i] += table8[in[i] >> 4];
        acc[2 * i + 1] += table8[in[i] & 15];
    }
    if (count & 1) acc[count - 1] += table8[in[count / 2] >> 4];
}
#endif

static void lookup_add(Engine *e, uint8_t *acc, const uint8_t *in, int count) {
#if defined(__x86_64__)
    if (e->avx2 && e->bits == 4 && e->lane_bits == 8) {
        lookup_add4_avx2(acc, in, count, e->table8);
        return;
    }
#endif
    lookup_add_scalar(acc, e->lane_bits / 8, in, count, e->bits, e->table);
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
        memcpy(r->payload, st->acc, n);
        r->len = n;
    } else if (e->lane_bits == 16) {
        for (int i = 0; i < n; i++) wr16(r->payload + 2 * i, ((uint16_t *)st->acc)[i]);
        r->len = 2 * n;
    } else {
        for (int i = 0; i < n; i++) wr32(r->payload + 4 * i, ((uint32_t *)st->acc)[i]);
        r->len = 4 * n;
    }
}

static void swap_results(result_t *a, result_t *b) { result_t t = *a; *a = *b; *b = t; }

/* One datagram; queues output packets.  Mirrors ReferencePS.process. */
static void handle(Engine *e, const uint8_t *buf, uint32_t len, uint32_t ip, uint16_t port) {
    e->counters[C_PACKETS_IN]++;
    e->counters[C_BYTES_IN] += len;
    if (len < HDR || rd16(buf) != MAGIC) { e->drops[D_MALFORMED]++; return; }
    if (buf[2] != VERSION) { e->drops[D_VERSION]++; return; }
    int type = buf[3], worker = buf[5], nw = buf[6], ebits = buf[7], op = buf[29];
    uint16_t job = rd16(buf + 8), slot = rd16(buf + 10), count = rd16(buf + 20), plen = rd16(buf + 22);
    uint32_t round = rd32(buf + 12), offset = rd32(buf + 16), nonce = rd32(buf + 32), token = rd32(buf + 36);
    if (type < T_DATA || type > T_NORM_RESULT || plen != len - HDR) { e->drops[D_MALFORMED]++; return; }
    if (type != T_DATA && type != T_NORM) { e->drops[D_MALFORMED]++; return; }
    if (job != e->job_id || nonce != e->nonce) { e->drops[D_JOB]++; return; }
    if (worker >= e->n) { e->drops[D_WORKER]++; return; }
    if (!e->w_reg[worker] || e->w_ip[worker] != ip || e->w_port[worker] != port ||
        e->w_token[worker] != token) { e->drops[D_UNREG]++; return; }
    int lo = type == T_NORM ? e->slots : 0, hi = type == T_NORM ? e->slots + e->norm_slots : e->slots;
    if (slot < lo || slot >= hi) { e->drops[D_SLOT]++; return; }
    int ok;
    if (count == 0 || count > e->elems || nw != e->n) ok = 0;
    else if (type == T_NORM) ok = ebits == 32 && op == OP_MAX_U32 && plen == 4u * count;
    else ok = ebits == up_bits(e) && op == e->op && plen == ((uint32_t)count * up_bits(e) + 7) / 8;
    if (!ok) { e->drops[D_MALFORMED]++; return; }

    slot_t *st = &e->slot[slot];
    uint32_t bit = 1u << worker;
    const uint8_t *payload = buf + HDR;
    if ((uint64_t)round > (uint64_t)(st->active ? st->round : 0) + ROUND_WINDOW) { e->drops[D_AHEAD]++; return; }
    if (!st->active || round > st->round) {
        if (st->active && st->cur.valid && round == st->round + 1) swap_results(&st->cur, &st->prev);
        else st->prev.valid = 0;
        st->cur.valid = 0;
        st->active = 1; st->round = round; st->count = 0; st->bitmap = 0;
        st->offset = offset; st->elems = count;
        memset(st->acc, 0, (size_t)e->elems * 4);
    } else if (round == st->round) {
        if (offset != st->offset || count != st->elems) { e->drops[D_MALFORMED]++; return; }
        if (st->bitmap & bit) {
            if (st->cur.valid) { unicast_result(e, slot, &st->cur, type, worker); return; }
            e->drops[D_DUP]++;
            return;
        }
        if (st->cur.valid) {
            e->drops[D_LATE]++;
            unicast_result(e, slot, &st->cur, type, worker);
            return;
        }
    } else if (round + 1 == st->round && st->prev.valid && offset == st->prev.offset &&
               count == st->prev.count) {
        unicast_result(e, slot, &st->prev, type, worker);
        return;
    } else {
        e->drops[D_STALE]++;
        e->counters[C_STRAGGLERS]++;
        outpkt_t *o = new_out(e);
        if (!o) return;
        fill_hdr(e, o->hdr, T_STRAGGLER, 0, worker, 0, slot, st->round, offset, 0, 0, 0, 0, op);
        o->payload = NULL; o->payload_len = 0;
        queue_msg(e, (int)(o - e->out), worker);
        return;
    }

    /* aggregate */
    int first = st->count == 0;
    if (type == T_NORM) {
        uint32_t *a = (uint32_t *)st->acc;
        for (int i = 0; i < count; i++) {
            uint32_t v = rd32(payload + 4 * i);
            if (first || v > a[i]) a[i] = v;
        }
    } else if (e->op == OP_FLOAT_SUM) {
        float *a = (float *)st->acc;
        for (int i = 0; i < count; i++) {
            uint32_t u = rd32(payload + 4 * i);
            float f; memcpy(&f, &u, 4);
            a[i] = first ? f : a[i] + f;
        }
    } else {
        lookup_add(e, st->acc, payload, count);
    }
    st->bitmap |= bit;
    st->count++;
    if (st->count < e->quorum) return;
    make_result(e, st, type);
    e->counters[C_ROUNDS]++;
    if (st->count < e->n) e->counters[C_PARTIAL]++;
    int p = result_pkt(e, slot, &st->cur, type, -1);
    if (p < 0) return;
    for (int w = 0; w < e->n; w++)
        if (e->w_reg[w]) queue_msg(e, p, w);
}

/* ------------------------------------------------------------------ Python type */

static void Engine_dealloc(Engine *e) {
    if (e->slot) {
        for (int i = 0; i < e->slots + e->norm_slots; i++) {
            PyMem_RawFree(e->slot[i].acc);
            PyMem_RawFree(e->slot[i].cur.payload);
            PyMem_RawFree(e->slot[i].prev.payload);
        }
        PyMem_RawFree(e->slot);
    }
    PyMem_RawFree(e->out);
    PyMem_RawFree(e->msgs);
    PyMem_RawFree(e->arena);
    PyMem_RawFree(e->mm);
    PyMem_RawFree(e->iov);
    PyMem_RawFree(e->sa);
    pthread_mutex_destroy(&e->lock);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"job_id", "num_workers", "slots", "norm_slots", "elems_per_packet",
                             "bits", "lane_bits", "op", "quorum_count", "table", "nonce", NULL};
    int job_id;
    unsigned int nonce = 0;
    PyObject *table;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiiiiiiO|I", kwlist, &job_id, &e->n, &e->slots,
                                     &e->norm_slots, &e->elems, &e->bits, &e->lane_bits, &e->op,
                                     &e->quorum, &table, &nonce))
        return -1;
    e->nonce = (uint32_t)nonce;
    if (e->n < 1 || e->n > MAX_WORKERS || e->slots < 1 || e->norm_slots < 1 || e->elems < 1 ||
        e->elems > 65535 || e->bits < 1 || e->bits > 8 ||
        (e->lane_bits != 8 && e->lane_bits != 16 && e->lane_bits != 32) || e->quorum < 1 ||
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
    for (int i = 0; i < 16; i++) e->table8[i] = (uint8_t)e->table[i];
    pthread_mutex_init(&e->lock, NULL);
    int total = e->slots + e->norm_slots;
    e->slot = PyMem_RawCalloc(total, sizeof(slot_t));
    if (!e->slot) { PyErr_NoMemory(); return -1; }
    for (int i = 0; i < total; i++) {
        e->slot[i].acc = PyMem_RawCalloc(e->elems, 4);
        e->slot[i].cur.payload = PyMem_RawCalloc(e->elems, 4);
        e->slot[i].prev.payload = PyMem_RawCalloc(e->elems, 4);
        if (!e->slot[i].acc || !e->slot[i].cur.payload || !e->slot[i].prev.payload) {
            PyErr_NoMemory();
            return -1;
        }
    }
    e->cap_out = BATCH;
    e->cap_msgs = BATCH * e->n;
    e->pkt_cap = (size_t)e->elems * 4;
    e->out = PyMem_RawCalloc(e->cap_out, sizeof(outpkt_t));
    e->msgs = PyMem_RawCalloc(e->cap_msgs, sizeof(*e->msgs));
    e->arena = PyMem_RawCalloc(e->cap_out, e->pkt_cap);
    e->mm = PyMem_RawCalloc(e->cap_msgs, sizeof(struct mmsghdr));
    e->iov = PyMem_RawCalloc(2 * (size_t)e->cap_msgs, sizeof(struct iovec));
    e->sa = PyMem_RawCalloc(e->cap_msgs, sizeof(struct sockaddr_in));
    if (!e->out || !e->msgs || !e->arena || !e->mm || !e->iov || !e->sa) { PyErr_NoMemory(); return -1; }
#if defined(__x86_64__)
    __builtin_cpu_init();
    e->avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
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

static PyObject *Engine_process(Engine *e, PyObject *args) {
    Py_buffer buf;
    const char *ip;
    int port;
    if (!PyArg_ParseTuple(args, "y*(si)", &buf, &ip, &port)) return NULL;
    struct in_addr a;
    if (inet_pton(AF_INET, ip, &a) != 1) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "bad address %s", ip);
        return NULL;
    }
    pthread_mutex_lock(&e->lock);
    handle(e, buf.buf, (uint32_t)buf.len, a.s_addr, (uint16_t)port);
    PyObject *out = drain_to_list(e);
    pthread_mutex_unlock(&e->lock);
    PyBuffer_Release(&buf);
    return out;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Send the queued outputs with one sendmmsg call (a header and a payload iovec each). */
static void flush(Engine *e, int fd) {
    struct mmsghdr *mm = e->mm;
    struct sockaddr_in *sa = e->sa;
    int n = e->n_msgs;
    for (int m = 0; m < n; m++) {
        int p = e->msgs[m].pkt, w = e->msgs[m].dest;
        memset(&sa[m], 0, sizeof sa[m]);
        sa[m].sin_family = AF_INET;
        sa[m].sin_addr.s_addr = e->w_ip[w];
        sa[m].sin_port = htons(e->w_port[w]);
        struct iovec *iov = e->iov + 2 * m;
        iov[0].iov_base = e->out[p].hdr; iov[0].iov_len = HDR;
        iov[1].iov_base = (void *)e->out[p].payload; iov[1].iov_len = e->out[p].payload_len;
        memset(&mm[m], 0, sizeof mm[m]);
        mm[m].msg_hdr.msg_name = &sa[m];
        mm[m].msg_hdr.msg_namelen = sizeof sa[m];
        mm[m].msg_hdr.msg_iov = iov;
        mm[m].msg_hdr.msg_iovlen = 2;
    }
    int sent = 0, tries = 0;
    while (sent < n && tries++ < 100) {
        int r = sendmmsg(fd, mm + sent, n - sent, 0);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOBUFS) continue;
            break;   /* e.g. ECONNREFUSED from a worker that left: drop the rest */
        }
        sent += r;
    }
    e->n_out = e->n_msgs = 0;
}

static PyObject *Engine_serve(Engine *e, PyObject *args) {
    int fd, duration_ms;
    if (!PyArg_ParseTuple(args, "ii", &fd, &duration_ms)) return NULL;
    const size_t cap = 65536;
    uint8_t *rx = PyMem_RawMalloc(BATCH * cap);
    if (!rx) return PyErr_NoMemory();
    long handled = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct mmsghdr mm[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in sa[BATCH];
    double deadline = now_ms() + duration_ms;
    for (;;) {
        double left = deadline - now_ms();
        if (left <= 0) break;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)(left + 1));
        if (pr < 0) { if (errno == EINTR) continue; err = errno; break; }
        if (pr == 0) break;
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = rx + i * cap; iov[i].iov_len = cap;
            memset(&mm[i], 0, sizeof mm[i]);
            mm[i].msg_hdr.msg_iov = &iov[i]; mm[i].msg_hdr.msg_iovlen = 1;
            mm[i].msg_hdr.msg_name = &sa[i]; mm[i].msg_hdr.msg_namelen = sizeof sa[i];
        }
        int r = recvmmsg(fd, mm, BATCH, MSG_DONTWAIT, NULL);
        if (r < 0) { if (errno == EAGAIN || errno == EINTR || errno == ECONNREFUSED) continue; err = errno; break; }
        pthread_mutex_lock(&e->lock);
        for (int i = 0; i < r; i++) {
            handle(e, rx + i * cap, mm[i].msg_len, sa[i].sin_addr.s_addr, ntohs(sa[i].sin_port));
            if (e->n_out >= e->cap_out) flush(e, fd);
        }
        flush(e, fd);
        pthread_mutex_unlock(&e->lock);
        handled += r;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(rx);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLong(handled);
}

static PyObject *Engine_stats(Engine *e, PyObject *noargs) {
    PyObject *d = PyDict_New(), *drops = PyDict_New();
    pthread_mutex_lock(&e->lock);
    for (int i = 0; i < N_COUNTERS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(e->counters[i]);
        PyDict_SetItemString(d, counter_names[i], v);
        Py_DECREF(v);
    }
    for (int i = 0; i < N_DROPS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(e->drops[i]);
        PyDict_SetItemString(drops, drop_names[i], v);
        Py_DECREF(v);
    }
    pthread_mutex_unlock(&e->lock);
    PyDict_SetItemString(d, "drops", drops);
    Py_DECREF(drops);
    return d;
}

static PyMethodDef Engine_methods[] = {
    {"register", (PyCFunction)Engine_register, METH_VARARGS, "register(worker_id, ip, port, token=0): bind a worker to its source address and token"},
    {"unregister", (PyCFunction)Engine_unregister, METH_VARARGS, "unregister(worker_id): forget a worker (left or lease expired)"},
    {"process", (PyCFunction)Engine_process, METH_VARARGS, "process(datagram, (ip, port)) -> [(bytes, (ip, port))]"},
    {"serve", (PyCFunction)Engine_serve, METH_VARARGS, "serve(fd, duration_ms) -> packets handled (GIL released)"},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "counters and drops by reason"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ps_server._fastpath.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_doc = "C aggregation engine mirroring ps_server.reference.ReferencePS",
};

/* lookup_accumulate(acc, packed, table, bits, force_scalar=False): acc[i] += table[z_i] for the
 * indices packed in `packed`; acc is a writable buffer of uint8/16/32 lanes (itemsize = lane). */
static PyObject *lookup_accumulate(PyObject *self, PyObject *args) {
    Py_buffer acc, in;
    PyObject *table;
    int bits, force_scalar = 0;
    if (!PyArg_ParseTuple(args, "w*y*Oi|p", &acc, &in, &table, &bits, &force_scalar)) return NULL;
    uint32_t t[256] = {0};
    uint8_t t8[16];
    PyObject *seq = PySequence_Fast(table, "table must be a sequence");
    if (!seq) { PyBuffer_Release(&acc); PyBuffer_Release(&in); return NULL; }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && i < 256; i++)
        t[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    for (int i = 0; i < 16; i++) t8[i] = (uint8_t)t[i];
    int lane = (int)acc.itemsize;
    Py_ssize_t count = acc.len / lane;
    if ((lane != 1 && lane != 2 && lane != 4) || bits < 1 || bits > 8 || in.len * 8 < count * bits) {
        PyBuffer_Release(&acc); PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "bad lane width, bits or input length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!force_scalar && bits == 4 && lane == 1 && __builtin_cpu_supports("avx2"))
        lookup_add4_avx2(acc.buf, in.buf, (int)count, t8);
    else
#endif
        lookup_add_scalar(acc.buf, lane, in.buf, (int)count, bits, t);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&acc);
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

/* udp_blast(fd, ip, port, payload, count, batch=64, gso_segments=0) -> datagrams sent.
 * Transport benchmark: sendmmsg batches; with gso_segments > 0 each message carries that many
 * copies of the payload and the kernel cuts it (UDP_SEGMENT), the DPDK-less batching path. */
static PyObject *udp_blast(PyObject *self, PyObject *args) {
    int fd, port, batch = 64, gso = 0;
    const char *ip;
    Py_buffer pl;
    long long count;
    if (!PyArg_ParseTuple(args, "isiy*L|ii", &fd, &ip, &port, &pl, &count, &batch, &gso)) return NULL;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1 || batch < 1 || batch > 1024 || gso < 0 || gso > 64 ||
        pl.len < 1 || (gso && pl.len * gso > 65000)) {
        PyBuffer_Release(&pl);
        PyErr_SetString(PyExc_ValueError, "udp_blast: bad address, batch or gso size");
        return NULL;
    }
    int segs = gso ? gso : 1;
    size_t msg_len = (size_t)pl.len * segs;
    uint8_t *buf = PyMem_RawMalloc(msg_len);
    struct mmsghdr *mm = PyMem_RawCalloc(batch, sizeof *mm);
    struct iovec *iov = PyMem_RawCalloc(batch, sizeof *iov);
    if (!buf || !mm || !iov) { PyMem_RawFree(buf); PyMem_RawFree(mm); PyMem_RawFree(iov); PyBuffer_Release(&pl); return PyErr_NoMemory(); }
    for (int i = 0; i < segs; i++) memcpy(buf + (size_t)i * pl.len, pl.buf, pl.len);
    if (gso) {
        int seg = (int)pl.len;
        if (setsockopt(fd, SOL_UDP, UDP_SEGMENT, &seg, sizeof seg) < 0) {
            PyMem_RawFree(buf); PyMem_RawFree(mm); PyMem_RawFree(iov); PyBuffer_Release(&pl);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    for (int i = 0; i < batch; i++) {
        iov[i].iov_base = buf; iov[i].iov_len = msg_len;
        mm[i].msg_hdr.msg_iov = &iov[i]; mm[i].msg_hdr.msg_iovlen = 1;
        mm[i].msg_hdr.msg_name = &sa; mm[i].msg_hdr.msg_namelen = sizeof sa;
    }
    long long sent = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (sent < count) {
        long long left = (count - sent + segs - 1) / segs;
        int n = left < batch ? (int)left : batch;
        int r = sendmmsg(fd, mm, n, 0);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOBUFS || errno == ECONNREFUSED) continue;
            err = errno;
            break;
        }
        sent += (long long)r * segs;
    }
    Py_END_ALLOW_THREADS
    if (gso) { int zero = 0; setsockopt(fd, SOL_UDP, UDP_SEGMENT, &zero, sizeof zero); }
    PyMem_RawFree(buf); PyMem_RawFree(mm); PyMem_RawFree(iov); PyBuffer_Release(&pl);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLongLong(sent);
}

/* udp_drain(fd, idle_ms, max_ms, batch=64, gro=False, seg_size=0) -> (datagrams, bytes):
 * recvmmsg until idle for idle_ms or max_ms elapsed.  With gro, coalesced messages count as
 * bytes / seg_size datagrams. */
static PyObject *udp_drain(PyObject *self, PyObject *args) {
    int fd, idle_ms, max_ms, batch = 64, gro = 0, seg = 0;
    if (!PyArg_ParseTuple(args, "iii|ipi", &fd, &idle_ms, &max_ms, &batch, &gro, &seg)) return NULL;
    if (batch < 1 || batch > 1024) { PyErr_SetString(PyExc_ValueError, "batch"); return NULL; }
    if (gro) {
        int one = 1;
        if (setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    }
    const size_t cap = 65536;
    uint8_t *rx = PyMem_RawMalloc(cap * batch);
    struct mmsghdr *mm = PyMem_RawCalloc(batch, sizeof *mm);
    struct iovec *iov = PyMem_RawCalloc(batch, sizeof *iov);
    if (!rx || !mm || !iov) { PyMem_RawFree(rx); PyMem_RawFree(mm); PyMem_RawFree(iov); return PyErr_NoMemory(); }
    long long pkts = 0, bytes = 0;
    Py_BEGIN_ALLOW_THREADS
    double end = now_ms() + max_ms;
    while (now_ms() < end) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, idle_ms) <= 0) break;
        for (int i = 0; i < batch; i++) {
            iov[i].iov_base = rx + i * cap; iov[i].iov_len = cap;
            memset(&mm[i], 0, sizeof mm[i]);
            mm[i].msg_hdr.msg_iov = &iov[i]; mm[i].msg_hdr.msg_iovlen = 1;
        }
        int r = recvmmsg(fd, mm, batch, MSG_DONTWAIT, NULL);
        if (r <= 0) continue;
        for (int i = 0; i < r; i++) {
            bytes += mm[i].msg_len;
            pkts += (gro && seg > 0) ? (mm[i].msg_len + seg - 1) / seg : 1;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(rx); PyMem_RawFree(mm); PyMem_RawFree(iov);
    return Py_BuildValue("(LL)", pkts, bytes);
}

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
    {"udp_blast", udp_blast, METH_VARARGS, "benchmark sender: sendmmsg batches, optional UDP GSO"},
    {"udp_drain", udp_drain, METH_VARARGS, "benchmark receiver: recvmmsg batches, optional UDP GRO"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_fastpath", "THC-PS C hot path", -1, module_methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
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
