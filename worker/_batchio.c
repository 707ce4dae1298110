/* Worker-side batched datagram I/O: one sendmmsg for a window of packets, one recvmmsg for
 * whatever results are waiting.  The worker's loop was one Python call (and one select) per
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
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#define BATCH 64

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

static PyObject *recv_many(PyObject *self, PyObject *args) {
    int fd, maxp, cap;
    if (!PyArg_ParseTuple(args, "iii", &fd, &maxp, &cap)) return NULL;
    if (maxp < 1 || maxp > 4096 || cap < 1 || cap > 65536) {
        PyErr_SetString(PyExc_ValueError, "recv_many: max_packets must be in 1..4096, max_size in 1..65536");
        return NULL;
    }
    uint8_t *rx = PyMem_RawMalloc((size_t)cap * BATCH);
    struct mmsghdr mm[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
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
            PyObject *item = Py_BuildValue("(y#(si))", (const char *)iov[i].iov_base,
                                           (Py_ssize_t)mm[i].msg_len, host, (int)ntohs(from[i].sin_port));
            if (!item || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                PyMem_RawFree(rx);
                return NULL;
            }
            Py_DECREF(item);
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

static PyMethodDef methods[] = {
    {"send_many", send_many, METH_VARARGS, "send_many(fd, packets, ip, port) -> (sent, refused)"},
    {"recv_many", recv_many, METH_VARARGS, "recv_many(fd, max_packets, max_size) -> [(bytes, (ip, port))]"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_batchio",
                                       "worker-side batched UDP I/O (sendmmsg/recvmmsg)", -1, methods};

PyMODINIT_FUNC PyInit__batchio(void) { return PyModule_Create(&moduledef); }
