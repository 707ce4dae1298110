/*
 * Entropy-coded bit streams of the sparse codecs, decoded sequentially in C (a symbol's
 * position depends on every code before it, so numpy cannot vectorize the scan).
 *
 *   canonical_huffman_decode(stream: bytes, lengths: uint8 per symbol, out: int64 buffer)
 *       -> bits consumed.  Codes are canonical (shorter first, then by symbol) and MSB
 *       first, as compression/skcompress.py writes them (SKCompress §4.3); out receives
 *       len(out) symbols.  ValueError on a stream that runs out or holds no valid code.
 * compression/skcompress.py keeps the Python reference this must match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAXLEN 32

static PyObject *canonical_huffman_decode(PyObject *self, PyObject *args) {
    Py_buffer in, lens, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &in, &lens, &out)) return NULL;
    const uint8_t *len = lens.buf, *bits = in.buf;
    const Py_ssize_t nsym = lens.len, count = out.len / (Py_ssize_t)sizeof(int64_t);
    const uint64_t nbits = (uint64_t)in.len * 8;
    int64_t *dst = out.buf;
    uint32_t cnt[MAXLEN + 1] = {0}, first[MAXLEN + 1] = {0}, base[MAXLEN + 1] = {0};
    int32_t *sorted = PyMem_Malloc((nsym ? nsym : 1) * sizeof *sorted);
    const char *err = NULL;
    uint64_t p = 0;
    int maxlen = 0;
    if (!sorted) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t s = 0; s < nsym; s++) {
        if (len[s] > MAXLEN) { err = "code length above 32"; goto done; }
        if (len[s]) { cnt[len[s]]++; if (len[s] > maxlen) maxlen = len[s]; }
    }
    if (maxlen == 0) { if (count) err = "empty Huffman table"; goto done; }
    /* symbols ordered by (length, symbol); first[l] = first code of length l */
    {
        uint32_t at = 0, code = 0;
        for (int l = 1; l <= maxlen; l++) {
            code = (code + cnt[l - 1]) << 1;
            first[l] = code;
            base[l] = at;
            at += cnt[l];
        }
        uint32_t fill[MAXLEN + 1];
        memcpy(fill, base, sizeof fill);
        for (Py_ssize_t s = 0; s < nsym; s++)
            if (len[s]) sorted[fill[len[s]]++] = (int32_t)s;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && !err; i++) {
        uint32_t c = 0;
        int l = 0;
        for (;;) {
            if (p >= nbits || l >= maxlen) { err = "bad Huffman stream"; break; }
            c = (c << 1) | ((bits[p >> 3] >> (7 - (p & 7))) & 1u);
            p++;
            l++;
            if (cnt[l] && c >= first[l] && c - first[l] < cnt[l]) {
                dst[i] = sorted[base[l] + (c - first[l])];
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(sorted);
    PyBuffer_Release(&in);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&out);
    if (PyErr_Occurred()) return NULL;
    if (err) { PyErr_SetString(PyExc_ValueError, err); return NULL; }
    return PyLong_FromUnsignedLongLong(p);
}

static PyMethodDef methods[] = {
    {"canonical_huffman_decode", canonical_huffman_decode, METH_VARARGS,
     "decode len(out) canonical-Huffman symbols (MSB-first stream); returns bits consumed"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_bitstream",
                                       "sequential entropy decoders of the sparse codecs", -1, methods};

PyMODINIT_FUNC PyInit__bitstream(void) { return PyModule_Create(&moduledef); }
