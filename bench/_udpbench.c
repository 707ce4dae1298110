/* Benchmark-only UDP helpers (bench/bench_transport.py): a sender that blasts one payload with
 * sendmmsg batches, optionally as UDP GSO messages, and a receiver that drains with recvmmsg,
 * optionally with UDP GRO.  Not part of the data path (ps_server/_fastpath.c, worker/_batchio.c). */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

#include "../proto/udpio.h"

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

static PyMethodDef module_methods[] = {
    {"udp_blast", udp_blast, METH_VARARGS, "benchmark sender: sendmmsg batches, optional UDP GSO"},
    {"udp_drain", udp_drain, METH_VARARGS, "benchmark receiver: recvmmsg batches, optional UDP GRO"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_udpbench", "benchmark-only UDP blaster and drain", -1, module_methods};

PyMODINIT_FUNC PyInit__udpbench(void) { return PyModule_Create(&moduledef); }
