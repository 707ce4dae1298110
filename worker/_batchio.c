/* Worker-side batched datagram I/O: one sendmmsg for a window of packets, one recvmmsg for
 * whatever results are waiting (UDP GRO batches split into their datagrams), and phase_run,
 * a whole phase (window, retransmit timers, results) in C with the GIL released.  The worker's loop was one Python call (and one select) per
 * datagram; this moves the per-packet system-call work into C with the GIL released.
 *
 *   send_many(fd, packets, ip, port) -> (sent, refused)
 *       packets: list of bytes-like.  Sends in order with sendmmsg until done or the socket
 *       would block.  `sent` counts packets handed to the kernel or lost to an error the
 *       datagram path treats as loss (ECONNREFUSED from an earlier ICMP, EPERM from a
 *       netfilter drop rule); `refused` counts those losses.  sent < len(packets) means the
 *       socket buffer is full: wait for POLLOUT and call again with the rest.
 *   recv_many(fd, max_packets, max_size) -> list of (bytes, (ip, port))
 *       Non-blocking recvmmsg until max_packets or nothing more is queued.  A datagram longer
 *       than max_size comes back cut to max_size, so the caller's parser rejects it (its
 *       payload length no longer matches) and counts it.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#include "../proto/udpio.h"
#define RX_CAP 65536

static PyObject *send_many(PyObject *self, PyObject *args) {
    int fd, port;
    const char *ip;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iOsi", &fd, &seq, &ip, &port)) return NULL;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (port < 0 || port > 65535 || inet_pton(AF_INET, ip, &sa.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "send_many: bad IPv4 destination %s:%d", ip, port);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "send_many: packets must be a sequence of bytes");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof *bufs);
    struct mmsghdr *mm = PyMem_Calloc(n ? n : 1, sizeof *mm);
    struct iovec *iov = PyMem_Calloc(n ? n : 1, sizeof *iov);
    Py_ssize_t held = 0, sent = 0, refused = 0;
    int err = 0;
    if (!bufs || !mm || !iov) { PyErr_NoMemory(); goto done; }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &bufs[held], PyBUF_SIMPLE) < 0) goto done;
        iov[held].iov_base = bufs[held].buf;
        iov[held].iov_len = (size_t)bufs[held].len;
        mm[held].msg_hdr.msg_iov = &iov[held];
        mm[held].msg_hdr.msg_iovlen = 1;
        mm[held].msg_hdr.msg_name = &sa;
        mm[held].msg_hdr.msg_namelen = sizeof sa;
    }
    Py_BEGIN_ALLOW_THREADS
    while (sent < n) {
        Py_ssize_t want = n - sent < BATCH ? n - sent : BATCH;
        int r = sendmmsg(fd, mm + sent, (unsigned)want, MSG_DONTWAIT);
        if (r > 0) { sent += r; continue; }
        if (r == 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) break;
        if (errno == EINTR) continue;
        if (errno == ECONNREFUSED || errno == EPERM) { sent++; refused++; continue; }
        err = errno;
        break;
    }
    Py_END_ALLOW_THREADS
    if (err) { errno = err; PyErr_SetFromErrno(PyExc_OSError); }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs); PyMem_Free(mm); PyMem_Free(iov);
    Py_DECREF(fast);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(nn)", sent, refused);
}

/* The segment size of a UDP GRO batch (its UDP_GRO control message), 0 for a lone datagram. */
static uint32_t gro_size(struct msghdr *h) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int v;
            memcpy(&v, CMSG_DATA(c), sizeof v);
            return v > 0 ? (uint32_t)v : 0;
        }
    return 0;
}

static PyObject *recv_many(PyObject *self, PyObject *args) {
    int fd, maxp, cap;
    if (!PyArg_ParseTuple(args, "iii", &fd, &maxp, &cap)) return NULL;
    if (maxp < 1 || maxp > 4096 || cap < 1 || cap > 65536) {
        PyErr_SetString(PyExc_ValueError, "recv_many: max_packets must be in 1..4096, max_size in 1..65536");
        return NULL;
    }
    int max_size = cap;
    cap = RX_CAP;        /* room for a GRO batch; a segment longer than max_size is cut below */
    uint8_t *rx = PyMem_RawMalloc((size_t)cap * BATCH);
    struct mmsghdr mm[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctl[BATCH];
    PyObject *out = PyList_New(0);
    if (!rx || !out) { PyMem_RawFree(rx); Py_XDECREF(out); return PyErr_NoMemory(); }
    int got_total = 0, err = 0;
    while (got_total < maxp) {
        int want = maxp - got_total < BATCH ? maxp - got_total : BATCH;
        for (int i = 0; i < want; i++) {
            memset(&mm[i], 0, sizeof mm[i]);
            iov[i].iov_base = rx + (size_t)i * cap;
            iov[i].iov_len = (size_t)cap;
            mm[i].msg_hdr.msg_iov = &iov[i];
            mm[i].msg_hdr.msg_iovlen = 1;
            mm[i].msg_hdr.msg_name = &from[i];
            mm[i].msg_hdr.msg_namelen = sizeof from[i];
            mm[i].msg_hdr.msg_control = ctl[i].buf;
            mm[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        int r;
        Py_BEGIN_ALLOW_THREADS
        r = recvmmsg(fd, mm, (unsigned)want, MSG_DONTWAIT, NULL);
        Py_END_ALLOW_THREADS
        if (r < 0) {
            if (errno == EINTR || errno == ECONNREFUSED) continue;   /* ICMP of an earlier send */
            if (errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
            break;
        }
        if (r == 0) break;
        for (int i = 0; i < r; i++) {
            char host[INET_ADDRSTRLEN];
            inet_ntop(AF_INET, &from[i].sin_addr, host, sizeof host);
            uint32_t len = mm[i].msg_len, seg = gro_size(&mm[i].msg_hdr);
            if (seg == 0 || seg >= len) seg = len ? len : 1;
            uint32_t off = 0;
            do {   /* each segment of a GRO batch is one datagram (proto.headers.split_segments) */
                uint32_t n = len - off < seg ? len - off : seg;
                PyObject *item = Py_BuildValue("(y#(si))", (const char *)iov[i].iov_base + off,
                                               (Py_ssize_t)(n < (uint32_t)max_size ? n : (uint32_t)max_size),
                                               host, (int)ntohs(from[i].sin_port));
                if (!item || PyList_Append(out, item) < 0) {
                    Py_XDECREF(item);
                    Py_DECREF(out);
                    PyMem_RawFree(rx);
                    return NULL;
                }
                Py_DECREF(item);
                off += n;
            } while (off < len);
        }
        got_total += r;
        if (r < want) break;
    }
    PyMem_RawFree(rx);
    if (err) {
        Py_DECREF(out);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return out;
}

/* ------------------------------------------------------------------ a whole phase in C
 *
 * phase_run(fd, budget_ms, P, T, dests, ch_sh, ch_slot, ch_round, ch_off, ch_count, poff,
 *           payload, hdr, state, deadline, tmo, sent, done, inflight, tries, fast, fanned, pend, res_hdr,
 *           lanes, roff, res_len, slot_round, counters, extras) -> (status, chunk)
 *
 * The loop of PhaseEngine._run_phase_python (worker/phases.py) with the GIL released:
 * fill the window (each new chunk's header written into hdr[c] and sent with the payload
 * slice as a second iovec, runs to one shard as UDP GSO messages), receive every queued
 * result (GRO batches split into datagrams), match results to pending chunks, find lost
 * chunks by the order of results (worker/rto.py) and by their timers, and resend them or
 * lose them under the retransmit/zero policy, a timer backing off exponentially.  Every array is
 * owned by the Python caller, so the phase state survives a return: the call comes back
 * after `budget_ms` (status 1) for the caller to look at a restarted PS, heartbeats and
 * the stall warning, and is called again; status 0 = every chunk has a result or is lost,
 * 2 = chunk `chunk` used up max_retries (the caller raises the error naming the cause).
 * Results that are not for a pending chunk and that PhaseEngine._keep would keep (a later
 * round of a slot, a BLOB fragment) are appended to `extras` as (shard, bytes).
 *
 * P (int64): type, want_type, job_id, worker_id, num_workers, elem_bits, op, nchunks,
 *            window, nslots, nshards, zero_policy, max_retries, gso, next_c, npending, finished,
 *            spin_us, the result group's socket (-1: none; results are read from both), then
 *            `ready` and an eventfd (-1: none) for a phase whose chunks are made while it runs
 *            (worker/chunks.py ChunkStream): only chunks below P[P_READY] are sent; the
 *            producer raises it and writes the eventfd, which wakes the wait; then, for a
 *            reader of the results on another thread: the chunk count it waits for, the
 *            answered prefix (every chunk below it has a result or is lost), the count last
 *            signalled, and its eventfd (-1: none), written when the prefix reaches the count;
 *            then injected loss (worker/datagrams.py Faults, drawn here): the probabilities of
 *            dropping an outgoing and an incoming datagram as thresholds in units of 2^-32, and
 *            the SplitMix64 state the draws come from (kept by the caller between calls)
 * T (float64): RetransmitTimer.T (worker/rto.py): floor, cap, adaptive, reorder window,
 *              the order rule's wait, the first timeout, then each shard's scale (seconds
 *              per chunk in flight; 0: not measured yet)
 * sent, done (float64), inflight (int32): each chunk's first send and answer times and the
 *              chunks in flight when it was sent, itself included (RetransmitTimer's samples)
 * fast (float64): when the order rule makes a chunk due (0: not found lost; -1: used up; -2:
 *              held by the probe rule until its shard answers again, RetransmitPolicy.hold)
 * fanned (int64, per shard): the latest chunk a fan-out result answered (-1: none)
 * dests (int64, nshards x 4): IPv4 address (network order), port, nonce, token
 * state (int8): 0 not sent, 1 pending, 2 result, 3 lost, 4 settled by the caller (stash)
 * counters (int64): see PHASE_COUNTERS in worker/phases.py
 */
enum { P_TYPE, P_WANT, P_JOB, P_WORKER, P_NW, P_EBITS, P_OP, P_N, P_WINDOW, P_NSLOTS, P_NSHARDS,
       P_ZERO, P_MAXRETRIES, P_GSO, P_NEXT, P_NPENDING, P_FINISHED, P_SPIN_US, P_GFD, P_READY, P_EVFD,
       P_WATCH, P_ANSWERED, P_NOTIFIED, P_DONEFD, P_DROP_OUT, P_DROP_IN, P_RNG, P_COUNT };
enum { K_SENT, K_RECV, K_BYTES_SENT, K_BYTES_RECV, K_RETRANS, K_TIMEOUTS, K_LOST, K_STRAGGLER,
       K_BAD, K_FAST, K_NOTICES, K_DROPPED_OUT, K_DROPPED_IN, K_GSO_MSGS, K_GRO_BATCHES, K_COUNT };
enum { T_FLOOR, T_CAP, T_ADAPTIVE, T_REORDER, T_ORDER, T_FIRST, T_SCALES };    /* RetransmitTimer.T */
enum { S_NEW, S_PENDING, S_RESULT, S_LOST, S_SETTLED };

#define HDR 40
#define MAGIC 0x5448
#define VERSION 2
#define T_RESULT 2
#define T_STRAGGLER 3
#define T_NORM_RESULT 5
#define T_NOTICE 6
#define OP_BLOB 4
#define F_RETRANSMIT 0x01
#define F_RESENT 0x02
#define HELD (-2.0)              /* fast[c] of a chunk the probe rule holds */

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return ntohl(v); }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return ntohs(v); }
static inline void wr32(uint8_t *p, uint32_t v) { v = htonl(v); memcpy(p, &v, 4); }
static inline void wr16(uint8_t *p, uint16_t v) { v = htons(v); memcpy(p, &v, 2); }

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

typedef struct {
    int fd;
    int64_t *P, *dests, *counters, *slot_round;
    double *T, *deadline, *tmo, *sent, *done, *fast;
    int64_t *fanned;
    int *answered, *oldest;      /* per shard, this pass: the latest chunk answered, the oldest pending */
    int32_t *sh, *slot, *tries, *pend, *res_len, *inflight;
    uint32_t *round, *off;
    int32_t *count;
    int64_t *poff, *roff;
    const uint8_t *payload;
    uint8_t *hdr, *res_hdr, *lanes;
    int8_t *state;
    PyObject *extras;
    /* send scratch */
    struct mmsghdr *mm;
    struct iovec *iov;
    struct sockaddr_in *sa;
    char *cmsg;
    int cap;
} phase_t;


/* An injected loss: the next SplitMix64 draw (Steele, Lea & Flood, OOPSLA 2014) below the
 * threshold P[which] (a probability in units of 2^-32; 0: never, no draw). */
static int inject_drop(phase_t *ph, int which) {
    if (ph->P[which] <= 0) return 0;
    uint64_t z = (uint64_t)ph->P[P_RNG] + 0x9E3779B97F4A7C15ull;
    ph->P[P_RNG] = (int64_t)z;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (int64_t)(z >> 32) < ph->P[which];
}

static void write_header(phase_t *ph, int c) {
    int64_t *P = ph->P;
    uint8_t *h = ph->hdr + (size_t)c * HDR;
    int64_t *d = ph->dests + 4 * ph->sh[c];
    uint32_t plen = (uint32_t)(ph->poff[c + 1] - ph->poff[c]);
    memset(h, 0, HDR);
    wr16(h, MAGIC);
    h[2] = VERSION; h[3] = (uint8_t)P[P_TYPE]; h[5] = (uint8_t)P[P_WORKER]; h[6] = (uint8_t)P[P_NW];
    h[7] = (uint8_t)P[P_EBITS];
    wr16(h + 8, (uint16_t)P[P_JOB]); wr16(h + 10, (uint16_t)ph->slot[c]); wr32(h + 12, ph->round[c]);
    wr32(h + 16, ph->off[c]); wr16(h + 20, (uint16_t)ph->count[c]); wr16(h + 22, (uint16_t)plen);
    h[29] = (uint8_t)P[P_OP];
    wr32(h + 32, (uint32_t)d[2]); wr32(h + 36, (uint32_t)d[3]);
}

/* sendmmsg of the given chunks, in order; runs of equal-size packets to one shard become GSO
 * messages when P[P_GSO].  A full socket buffer is waited out (bounded), ECONNREFUSED and
 * EPERM lose the message (timeouts handle it), a refused GSO message turns GSO off and the
 * batch is sent again without it. */
static void send_chunks(phase_t *ph, int *cs, int n) {
    int64_t *P = ph->P;
    int kept = 0;
    for (int i = 0; i < n; i++) {       /* counted as sent, then the injected losses left out */
        int c = cs[i];
        ph->counters[K_SENT]++;
        ph->counters[K_BYTES_SENT] += HDR + (ph->poff[c + 1] - ph->poff[c]);
        if (inject_drop(ph, P_DROP_OUT)) ph->counters[K_DROPPED_OUT]++;
        else cs[kept++] = c;
    }
    n = kept;
    int start = 0;
    while (start < n) {
        int nm = 0, iv = 0, first = start;
        uint32_t seg = 0, bytes = 0, segs = 0;
        int open = 0, prev = -1, j = start;
        for (; j < n; j++) {
            int c = cs[j];
            uint32_t len = HDR + (uint32_t)(ph->poff[c + 1] - ph->poff[c]);
            int join = P[P_GSO] && open && ph->sh[c] == prev && segs < GSO_MAX_SEGS &&
                       bytes + len <= GSO_MAX_BYTES && len <= seg;
            if (!join) {
                if (nm == ph->cap) break;
                int64_t *d = ph->dests + 4 * ph->sh[c];
                struct sockaddr_in *sa = &ph->sa[nm];
                memset(sa, 0, sizeof *sa);
                sa->sin_family = AF_INET;
                sa->sin_addr.s_addr = (uint32_t)d[0];
                sa->sin_port = htons((uint16_t)d[1]);
                memset(&ph->mm[nm], 0, sizeof ph->mm[nm]);
                ph->mm[nm].msg_hdr.msg_name = sa;
                ph->mm[nm].msg_hdr.msg_namelen = sizeof *sa;
                ph->mm[nm].msg_hdr.msg_iov = ph->iov + iv;
                nm++;
                seg = len; bytes = 0; segs = 0; open = 1; prev = ph->sh[c];
            }
            struct msghdr *h = &ph->mm[nm - 1].msg_hdr;
            ph->iov[iv].iov_base = ph->hdr + (size_t)c * HDR; ph->iov[iv].iov_len = HDR; iv++;
            ph->iov[iv].iov_base = (void *)(ph->payload + ph->poff[c]);
            ph->iov[iv].iov_len = (size_t)(ph->poff[c + 1] - ph->poff[c]); iv++;
            h->msg_iovlen += 2;
            bytes += len; segs++;
            if (len < seg) open = 0;
            if (segs > 1) set_gso_segment(h, ph->cmsg + (size_t)(nm - 1) * CMSG_SEG_SPACE, seg);
        }
        int sent = 0, waits = 0, refused_gso = 0;
        while (sent < nm) {
            int r = sendmmsg(ph->fd, ph->mm + sent, (unsigned)(nm - sent), MSG_DONTWAIT);
            if (r > 0) { sent += r; continue; }
            if (r < 0 && errno == EINTR) continue;
            if (r == 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
                if (waits++ >= 1000) break;
                struct pollfd pfd = {.fd = ph->fd, .events = POLLOUT};
                poll(&pfd, 1, 10);
                continue;
            }
            if ((errno == EIO || errno == EINVAL || errno == EOPNOTSUPP) && ph->mm[sent].msg_hdr.msg_controllen) {
                refused_gso = 1;
                break;
            }
            sent++;          /* ECONNREFUSED (earlier ICMP), EPERM (netfilter drop rule): lost */
        }
        for (int i = 0; i < sent; i++)
            if (ph->mm[i].msg_hdr.msg_iovlen > 2) ph->counters[K_GSO_MSGS]++;
        if (refused_gso) {
            P[P_GSO] = 0;
            int done = 0;
            for (int i = 0; i < sent; i++) done += (int)ph->mm[i].msg_hdr.msg_iovlen / 2;
            start = first + done;
            continue;
        }
        start = j;
    }
}

/* RetransmitTimer.first_timeout (worker/rto.py): a chunk sent to shard s with k chunks
 * in flight waits clamp(scale_s * k, floor, cap); before scale_s is measured the floor,
 * at least the first timeout when k > 1; the floor under the fixed rule. */
static inline double rto_first(const double *T, int s, int64_t k) {
    if (T[T_ADAPTIVE] == 0) return T[T_FLOOR];
    if (T[T_SCALES + s] == 0) return k > 1 && T[T_FIRST] > T[T_FLOOR] ? T[T_FIRST] : T[T_FLOOR];
    double t = T[T_SCALES + s] * (double)k;
    return t < T[T_FLOOR] ? T[T_FLOOR] : t > T[T_CAP] ? T[T_CAP] : t;
}

static void settle(phase_t *ph, int c, int state) {
    int key = ph->sh[c] * (int)ph->P[P_NSLOTS] + ph->slot[c];
    if (ph->pend[key] == c) { ph->pend[key] = -1; ph->P[P_NPENDING]--; }
    /* release: a reader on another thread that sees the state sees the result's bytes */
    __atomic_store_n(&ph->state[c], (int8_t)state, __ATOMIC_RELEASE);
    ph->P[P_FINISHED]++;
    if (state == S_LOST) ph->counters[K_LOST]++;
}

/* Advance the answered prefix; signal the reader once it reaches the count it waits for. */
static void mark_answered(phase_t *ph, int n) {
    int64_t *P = ph->P;
    if (P[P_DONEFD] < 0) return;
    int64_t w = P[P_ANSWERED];
    while (w < n && ph->state[w] >= S_RESULT) w++;
    __atomic_store_n(&P[P_ANSWERED], w, __ATOMIC_SEQ_CST);
    int64_t watch = __atomic_load_n(&P[P_WATCH], __ATOMIC_SEQ_CST);
    if (watch > P[P_NOTIFIED] && w >= watch) {
        uint64_t one = 1;
        if (write((int)P[P_DONEFD], &one, sizeof one) < 0) { /* a full counter is still readable */ }
        P[P_NOTIFIED] = watch;
    }
}

/* One received datagram from (ip, port) (Datagrams._parse and PhaseEngine._recv, then the
 * match of the phase loop).
 * Returns -1 when it must be kept for later (extras, needs the GIL), else 0. */
static int accept_one(phase_t *ph, const uint8_t *b, uint32_t len, uint32_t ip, uint16_t port, int *shard_out) {
    int64_t *P = ph->P;
    ph->counters[K_RECV]++;
    ph->counters[K_BYTES_RECV] += len;
    if (inject_drop(ph, P_DROP_IN)) { ph->counters[K_DROPPED_IN]++; return 0; }
    int shard = -1;
    for (int s = 0; s < P[P_NSHARDS]; s++)
        if ((uint32_t)ph->dests[4 * s] == ip && (uint16_t)ph->dests[4 * s + 1] == port) { shard = s; break; }
    if (len < HDR || rd16(b) != MAGIC || b[2] != VERSION || b[3] < 1 || b[3] > T_NOTICE ||
        rd16(b + 22) != len - HDR) { ph->counters[K_BAD]++; return 0; }
    if (shard < 0 || rd16(b + 8) != (uint16_t)P[P_JOB] || rd32(b + 32) != (uint32_t)ph->dests[4 * shard + 2]) {
        ph->counters[K_BAD]++;
        return 0;
    }
    int type = b[3], op = b[29], slot = rd16(b + 10);
    uint32_t round = rd32(b + 12);
    int c = slot < P[P_NSLOTS] ? ph->pend[shard * (int)P[P_NSLOTS] + slot] : -1;
    if (type == P[P_WANT] && op != OP_BLOB && c >= 0 && round == ph->round[c]) {
        memcpy(ph->res_hdr + (size_t)c * HDR, b, HDR);
        int64_t room = ph->roff[c + 1] - ph->roff[c];
        uint32_t plen = len - HDR;
        memcpy(ph->lanes + ph->roff[c], b + HDR, plen < room ? plen : (size_t)room);
        ph->res_len[c] = (int32_t)plen;
        ph->done[c] = mono_s();
        if (!(b[4] & F_RESENT) && c > ph->fanned[shard]) ph->fanned[shard] = c;   /* the order rule's evidence */
        if (c > ph->answered[shard]) ph->answered[shard] = c;                     /* releases held chunks */
        settle(ph, c, S_RESULT);
        return 0;
    }
    if (type == T_RESULT || type == T_NORM_RESULT) {
        /* PhaseEngine._keep: BLOB fragments and later rounds of a slot are kept, the rest ignored */
        if (op != OP_BLOB && (slot >= P[P_NSLOTS] || (int64_t)round <= ph->slot_round[shard * P[P_NSLOTS] + slot]))
            return 0;
        *shard_out = shard;
        return -1;
    }
    if (type == T_STRAGGLER) {
        ph->counters[K_STRAGGLER]++;
        if (c >= 0 && round > ph->round[c]) settle(ph, c, S_LOST);
        return 0;
    }
    if (type == T_NOTICE) {      /* RetransmitPolicy.noticed: the PS lacks this chunk */
        if (c >= 0 && round == ph->round[c] && ph->state[c] == S_PENDING) {
            ph->counters[K_NOTICES]++;
            double at = mono_s() + ph->T[T_REORDER], f = ph->fast[c];   /* a held chunk too */
            if (f != -1) ph->fast[c] = f > 0 && f < at ? f : at;
        }
        return 0;
    }
    ph->counters[K_BAD]++;
    return 0;
}

/* Every result queued on `fd` (the worker's socket or its result group's), in recvmmsg
 * batches of 8 (GRO batches split into datagrams), through accept_one; what Python keeps goes
 * to ph->extras with the GIL taken back for it.  Returns 0, an errno, or -1 (a Python error). */
static int drain(phase_t *ph, int fd, uint8_t *rx, PyThreadState **ts) {
    int err = 0;
    for (;;) {
        struct mmsghdr mm[8];
        struct iovec iov[8];
        struct sockaddr_in from[8];
        union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctl[8];
        for (int i = 0; i < 8; i++) {
            memset(&mm[i], 0, sizeof mm[i]);
            iov[i].iov_base = rx + (size_t)i * RX_CAP; iov[i].iov_len = RX_CAP;
            mm[i].msg_hdr.msg_iov = &iov[i]; mm[i].msg_hdr.msg_iovlen = 1;
            mm[i].msg_hdr.msg_name = &from[i]; mm[i].msg_hdr.msg_namelen = sizeof from[i];
            mm[i].msg_hdr.msg_control = ctl[i].buf; mm[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        int r = recvmmsg(fd, mm, 8, MSG_DONTWAIT, NULL);
        if (r < 0) {
            if (errno == EINTR || errno == ECONNREFUSED) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
            return err;
        }
        for (int i = 0; i < r; i++) {
            uint32_t len = mm[i].msg_len, seg = gro_size(&mm[i].msg_hdr);
            if (seg == 0 || seg >= len) seg = len ? len : 1;
            else ph->counters[K_GRO_BATCHES]++;
            uint32_t o = 0;
            do {
                uint32_t m = len - o < seg ? len - o : seg;
                const uint8_t *b = (const uint8_t *)iov[i].iov_base + o;
                int shard = -1;
                if (accept_one(ph, b, m, from[i].sin_addr.s_addr, ntohs(from[i].sin_port), &shard) < 0) {
                    PyEval_RestoreThread(*ts);
                    PyObject *item = Py_BuildValue("(iy#)", shard, (const char *)b, (Py_ssize_t)m);
                    if (!item || PyList_Append(ph->extras, item) < 0) err = -1;
                    Py_XDECREF(item);
                    *ts = PyEval_SaveThread();
                }
                o += m;
            } while (o < len && err != -1);
        }
        if (r < 8 || err) return err;
    }
}

#define GETBUF(i, b, flags) if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, i), &b, flags) < 0) goto fail;

static PyObject *phase_run(PyObject *self, PyObject *args) {
    enum { A_FD, A_BUDGET, A_P, A_T, A_DESTS, A_SH, A_SLOT, A_ROUND, A_OFF, A_COUNT, A_POFF, A_PAYLOAD,
           A_HDR, A_STATE, A_DEADLINE, A_TMO, A_SENT, A_DONE, A_INFLIGHT, A_TRIES, A_FAST, A_FANNED, A_PEND,
           A_RES_HDR, A_LANES, A_ROFF, A_RES_LEN, A_SLOT_ROUND, A_COUNTERS, A_EXTRAS, A_N };
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != A_N) {
        PyErr_SetString(PyExc_TypeError, "phase_run: wrong number of arguments");
        return NULL;
    }
    Py_buffer bufs[A_N];
    int held[A_N] = {0};
    PyObject *ret = NULL;
    phase_t ph = {0};
    ph.fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(args, A_FD));
    double budget = PyFloat_AsDouble(PyTuple_GET_ITEM(args, A_BUDGET)) / 1e3;
    ph.extras = PyTuple_GET_ITEM(args, A_EXTRAS);
    if (PyErr_Occurred() || !PyList_Check(ph.extras)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "phase_run: extras must be a list");
        return NULL;
    }
    for (int i = A_P; i < A_EXTRAS; i++) {
        int flags = (i == A_PAYLOAD || i == A_DESTS || i == A_SH || i == A_SLOT || i == A_ROUND || i == A_OFF ||
                     i == A_COUNT || i == A_POFF || i == A_ROFF || i == A_SLOT_ROUND) ? PyBUF_SIMPLE : PyBUF_WRITABLE;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, i), &bufs[i], flags) < 0) goto fail;
        held[i] = 1;
    }
    ph.P = bufs[A_P].buf; ph.T = bufs[A_T].buf; ph.dests = bufs[A_DESTS].buf;
    ph.sh = bufs[A_SH].buf; ph.slot = bufs[A_SLOT].buf; ph.round = bufs[A_ROUND].buf; ph.off = bufs[A_OFF].buf;
    ph.count = bufs[A_COUNT].buf; ph.poff = bufs[A_POFF].buf; ph.payload = bufs[A_PAYLOAD].buf;
    ph.hdr = bufs[A_HDR].buf; ph.state = bufs[A_STATE].buf; ph.deadline = bufs[A_DEADLINE].buf;
    ph.tmo = bufs[A_TMO].buf; ph.sent = bufs[A_SENT].buf; ph.done = bufs[A_DONE].buf;
    ph.inflight = bufs[A_INFLIGHT].buf; ph.tries = bufs[A_TRIES].buf; ph.pend = bufs[A_PEND].buf;
    ph.fast = bufs[A_FAST].buf; ph.fanned = bufs[A_FANNED].buf;
    ph.res_hdr = bufs[A_RES_HDR].buf; ph.lanes = bufs[A_LANES].buf; ph.roff = bufs[A_ROFF].buf;
    ph.res_len = bufs[A_RES_LEN].buf; ph.slot_round = bufs[A_SLOT_ROUND].buf; ph.counters = bufs[A_COUNTERS].buf;
    int64_t *P = ph.P;
    int n = (int)P[P_N];
    if (bufs[A_P].len < P_COUNT * 8 || bufs[A_COUNTERS].len < K_COUNT * 8 ||
        bufs[A_T].len < (Py_ssize_t)(T_SCALES + P[P_NSHARDS]) * 8 ||
        bufs[A_FAST].len < (Py_ssize_t)n * 8 || bufs[A_FANNED].len < (Py_ssize_t)P[P_NSHARDS] * 8 ||
        bufs[A_SENT].len < (Py_ssize_t)n * 8 || bufs[A_DONE].len < (Py_ssize_t)n * 8 ||
        bufs[A_INFLIGHT].len < (Py_ssize_t)n * 4 || bufs[A_TMO].len < (Py_ssize_t)n * 8 ||
        bufs[A_DEADLINE].len < (Py_ssize_t)n * 8 || bufs[A_TRIES].len < (Py_ssize_t)n * 4 ||
        bufs[A_STATE].len < n || bufs[A_HDR].len < (Py_ssize_t)n * HDR || bufs[A_RES_HDR].len < (Py_ssize_t)n * HDR ||
        bufs[A_POFF].len < (Py_ssize_t)(n + 1) * 8 || bufs[A_ROFF].len < (Py_ssize_t)(n + 1) * 8 ||
        bufs[A_PEND].len < (Py_ssize_t)(P[P_NSHARDS] * P[P_NSLOTS]) * 4 ||
        bufs[A_DESTS].len < (Py_ssize_t)P[P_NSHARDS] * 32 || (n && (ph.poff[n] > bufs[A_PAYLOAD].len ||
        ph.roff[n] > bufs[A_LANES].len))) {
        PyErr_SetString(PyExc_ValueError, "phase_run: inconsistent array sizes");
        goto fail;
    }
    ph.cap = (int)P[P_WINDOW] + 1;
    if (ph.cap < n + 1 && ph.cap < 2 * BATCH) ph.cap = 2 * BATCH;
    ph.mm = PyMem_RawCalloc(ph.cap, sizeof *ph.mm);
    ph.iov = PyMem_RawCalloc(2 * (size_t)ph.cap * 1, sizeof *ph.iov);
    ph.sa = PyMem_RawCalloc(ph.cap, sizeof *ph.sa);
    ph.cmsg = PyMem_RawCalloc(ph.cap, CMSG_SEG_SPACE);
    int *batch = PyMem_RawCalloc(ph.cap, sizeof(int));
    uint8_t *rx = PyMem_RawMalloc((size_t)RX_CAP * 8);
    int32_t *pending_list = PyMem_RawCalloc(ph.cap, sizeof(int32_t));
    ph.answered = PyMem_RawCalloc(2 * (size_t)P[P_NSHARDS], sizeof(int));
    ph.oldest = ph.answered ? ph.answered + P[P_NSHARDS] : NULL;
    if (!ph.mm || !ph.iov || !ph.sa || !ph.cmsg || !batch || !rx || !pending_list || !ph.answered) {
        PyMem_RawFree(batch); PyMem_RawFree(rx); PyMem_RawFree(pending_list); PyMem_RawFree(ph.answered);
        PyErr_NoMemory();
        goto fail_free;
    }
    int status = 1, give_up = -1, err = 0;
    PyThreadState *ts = PyEval_SaveThread();
    double end = mono_s() + budget;
    for (;;) {
        double now = mono_s();
        /* fill the window: chunks enter in order while their (shard, slot) is free */
        int nb = 0;
        int64_t ready = __atomic_load_n(&P[P_READY], __ATOMIC_ACQUIRE);   /* another thread raises it */
        if (ready > n) ready = n;
        while (P[P_NEXT] < ready && P[P_NPENDING] < P[P_WINDOW] && nb < ph.cap) {
            int c = (int)P[P_NEXT];
            if (ph.state[c] == S_SETTLED) { P[P_NEXT]++; continue; }
            int key = ph.sh[c] * (int)P[P_NSLOTS] + ph.slot[c];
            if (ph.pend[key] >= 0) break;
            P[P_NEXT]++;
            write_header(&ph, c);
            ph.pend[key] = c;
            P[P_NPENDING]++;
            ph.state[c] = S_PENDING;
            ph.inflight[c] = (int32_t)P[P_NPENDING];
            ph.tmo[c] = rto_first(ph.T, ph.sh[c], P[P_NPENDING]);
            ph.deadline[c] = now + ph.tmo[c];
            ph.sent[c] = now;
            ph.tries[c] = 0;
            ph.fast[c] = 0;
            batch[nb++] = c;
        }
        if (nb) send_chunks(&ph, batch, nb);
        if (P[P_FINISHED] >= n) { mark_answered(&ph, n); status = 0; break; }
        /* wait for results until the earliest deadline (or the budget) */
        int np = 0;
        double first = 1e300;
        for (int s = 0; s < P[P_NSHARDS]; s++) ph.answered[s] = -1;
        for (int k = 0; k < P[P_NSHARDS] * P[P_NSLOTS]; k++)
            if (ph.pend[k] >= 0) {
                int c = ph.pend[k];
                pending_list[np++] = c;
                if (ph.deadline[c] < first) first = ph.deadline[c];
                if (ph.fast[c] > 0 && ph.fast[c] < first) first = ph.fast[c];
                if (np == ph.cap) break;
            }
        now = mono_s();
        if (now >= end) break;
        double wait = (np ? first : now + ph.T[T_FLOOR]) - now;
        if (wait > end - now) wait = end - now;
        struct pollfd pfd[3] = {{.fd = ph.fd, .events = POLLIN}, {.fd = (int)P[P_GFD], .events = POLLIN},
                                {.fd = (int)P[P_EVFD], .events = POLLIN}};
        int nfd = P[P_GFD] >= 0 ? 2 : 1;
        int evf = -1;                            /* the producer's eventfd, while chunks are to come */
        if (P[P_EVFD] >= 0 && ready < n) {
            if (nfd == 1) pfd[1] = pfd[2];
            evf = nfd++;
        }
        int pr = 0;
        if (P[P_SPIN_US] > 0 && wait > 0) {      /* bounded busy-poll before sleeping */
            double spin_end = now + (double)P[P_SPIN_US] * 1e-6;
            if (spin_end > now + wait) spin_end = now + wait;
            double t = now;
            do pr = poll(pfd, nfd, 0); while (pr == 0 && (t = mono_s()) < spin_end);
            if (pr == 0) wait -= t - now;        /* the spin took part of the wait */
        }
        if (pr == 0) pr = poll(pfd, nfd, wait > 0 ? (int)(wait * 1e3 + 0.999) : 0);
        if (pr < 0 && errno != EINTR) { err = errno; break; }
        for (int f = 0; pr > 0 && f < nfd && !err; f++) {
            if (!pfd[f].revents) continue;
            if (f == evf) {                      /* more chunks are ready: clear it, fill the window */
                uint64_t v;
                if (read(pfd[f].fd, &v, sizeof v) < 0 && errno != EAGAIN) err = errno;
                continue;
            }
            err = drain(&ph, pfd[f].fd, rx, &ts);
        }
        if (err) break;
        /* losses (RetransmitPolicy): found by the order of results (a later chunk's fan-out
         * came first: due a reorder window later, once) or by the timer; resent (the timer
         * backing off) or lost (zero policy) */
        now = mono_s();
        nb = 0;
        for (int s = 0; s < P[P_NSHARDS]; s++) ph.oldest[s] = n;
        for (int i = 0; i < np; i++) {
            int c = pending_list[i];
            if (ph.state[c] == S_PENDING && c < ph.oldest[ph.sh[c]]) ph.oldest[ph.sh[c]] = c;
        }
        for (int i = 0; i < np; i++) {
            int c = pending_list[i], s = ph.sh[c];
            if (ph.state[c] != S_PENDING) continue;
            if (ph.fast[c] == HELD && ph.answered[s] >= 0) {           /* RetransmitPolicy.release */
                int after = c - ph.answered[s];
                ph.fast[c] = 0;
                ph.deadline[c] = now + rto_first(ph.T, s, after > 1 ? after : 1);
            }
            if ((ph.fast[c] == 0 || ph.fast[c] == HELD) && c < ph.fanned[s]) ph.fast[c] = now + ph.T[T_ORDER];
            int timer = ph.deadline[c] <= now, ordered = ph.fast[c] > 0 && ph.fast[c] <= now;
            if (!timer && !ordered) continue;
            if (timer && !ordered && !P[P_ZERO] && c != ph.oldest[s]) {   /* RetransmitPolicy.hold */
                ph.fast[c] = HELD;
                ph.deadline[c] = 1e300;
                continue;
            }
            ph.counters[timer ? K_TIMEOUTS : K_FAST]++;
            ph.fast[c] = -1;
            if (P[P_ZERO]) { settle(&ph, c, S_LOST); continue; }
            if (ph.tries[c] >= P[P_MAXRETRIES]) { give_up = c; break; }
            ph.hdr[(size_t)c * HDR + 4] |= F_RETRANSMIT;
            batch[nb++] = c;
            ph.counters[K_RETRANS]++;
            if (timer) {
                double t = ph.tmo[c] * 2;
                ph.tmo[c] = t < ph.T[T_CAP] ? t : ph.T[T_CAP];
            }
            ph.deadline[c] = now + ph.tmo[c];
            ph.tries[c]++;
        }
        mark_answered(&ph, n);
        if (nb) send_chunks(&ph, batch, nb);     /* resends count as sent packets, as in Python */
        if (give_up >= 0) { status = 2; break; }
        if (P[P_FINISHED] >= n) { status = 0; break; }
        if (mono_s() >= end) break;
    }
    PyEval_RestoreThread(ts);
    PyMem_RawFree(batch); PyMem_RawFree(rx); PyMem_RawFree(pending_list); PyMem_RawFree(ph.answered);
    if (err == -1) goto fail_free;
    if (err) { errno = err; PyErr_SetFromErrno(PyExc_OSError); goto fail_free; }
    ret = Py_BuildValue("(ii)", status, give_up);
fail_free:
    PyMem_RawFree(ph.mm); PyMem_RawFree(ph.iov); PyMem_RawFree(ph.sa); PyMem_RawFree(ph.cmsg);
fail:
    for (int i = 0; i < A_N; i++) if (held[i]) PyBuffer_Release(&bufs[i]);
    return ret;
}

static PyMethodDef methods[] = {
    {"send_many", send_many, METH_VARARGS, "send_many(fd, packets, ip, port) -> (sent, refused)"},
    {"recv_many", recv_many, METH_VARARGS, "recv_many(fd, max_packets, max_size) -> [(bytes, (ip, port))]"},
    {"phase_run", phase_run, METH_VARARGS, "phase_run(fd, budget_ms, ...) -> (status, chunk): a phase's window, timers and results in C (see the comment in _batchio.c)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_batchio",
                                       "worker-side batched UDP I/O (sendmmsg/recvmmsg)", -1, methods};

PyMODINIT_FUNC PyInit__batchio(void) { return PyModule_Create(&moduledef); }
