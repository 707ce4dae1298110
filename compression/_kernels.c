/*
 * Worker-side THC kernels (paper Alg. 3 lines 12-16), fused in one pass each:
 *   quantize:    clamp R to [-M, M], map to the grid y = (R + M) g / 2M, and round
 *                stochastically to the two neighbouring table values (unbiased).
 *   apply_signs: multiply by the Rademacher diagonal D given as packed random bits
 *                (bit i of the stream, MSB first, set = -1), by flipping sign bits.
 * compression/thc.py holds the numpy reference these must match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

/* quantize(r: float32 buf, M: float, g: int, table: bytes (2^b values), uniforms: float32 buf,
 *          out: uint8 buf) */
static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer r, t, u, o;
    double big_m;
    int g;
    if (!PyArg_ParseTuple(args, "y*diy*y*w*", &r, &big_m, &g, &t, &u, &o)) return NULL;
    Py_ssize_t n = r.len / 4;
    int levels = (int)t.len;
    const uint8_t *tab = t.buf;
    if (u.len / 4 < n || o.len < n || levels < 2 || levels > 256 || g < 1 || g > 255 ||
        tab[0] != 0 || tab[levels - 1] != g) {
        PyBuffer_Release(&r); PyBuffer_Release(&t); PyBuffer_Release(&u); PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "quantize: inconsistent buffer sizes or table");
        return NULL;
    }
    /* per integer grid cell q in [0, g]: interval index, its lower value and 1/width */
    uint8_t iv[256];
    float lo[256], inv[256];
    for (int q = 0, j = 0; q <= g; q++) {
        while (j < levels - 2 && tab[j + 1] <= q) j++;
        iv[q] = (uint8_t)j;
        lo[q] = tab[j];
        inv[q] = 1.0f / (float)(tab[j + 1] - tab[j]);
    }
    const float *rv = r.buf, *uv = u.buf;
    uint8_t *out = o.buf;
    Py_BEGIN_ALLOW_THREADS
    if (big_m > 0) {
        const float m = (float)big_m, s = (float)(g / (2.0 * big_m)), gf = (float)g;
        for (Py_ssize_t i = 0; i < n; i++) {
            float a = rv[i];
            a = a < -m ? -m : (a > m ? m : a);
            float y = (a + m) * s;
            y = y < 0.f ? 0.f : (y > gf ? gf : y);
            int q = (int)y;
            out[i] = (uint8_t)(iv[q] + (uv[i] < (y - lo[q]) * inv[q]));
        }
    } else {
        const float y = (float)g / 2.0f;
        int q = (int)y;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint8_t)(iv[q] + (uv[i] < (y - lo[q]) * inv[q]));
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&r); PyBuffer_Release(&t); PyBuffer_Release(&u); PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* apply_signs(x: float32 writable buf, bits: bytes): x[i] = -x[i] where bit i is set. */
static PyObject *apply_signs(PyObject *self, PyObject *args) {
    Py_buffer x, b;
    if (!PyArg_ParseTuple(args, "w*y*", &x, &b)) return NULL;
    Py_ssize_t n = x.len / 4;
    if (b.len * 8 < n) {
        PyBuffer_Release(&x); PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "apply_signs: not enough sign bits");
        return NULL;
    }
    uint32_t *v = x.buf;
    const uint8_t *bits = b.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        v[i] ^= (uint32_t)((bits[i >> 3] >> (7 - (i & 7))) & 1u) << 31;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x); PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* fwht(x: float32 writable buf): normalized Walsh-Hadamard transform in place, length a power
 * of two.  Radix-2 butterflies in a fixed order, single-threaded: the result is bit-identical
 * in every process, which the exactness checks against an in-process reference rely on.
 * Stages with stride < 2^11 run block by block so each block stays in L1/L2. */
static void fwht_block(float *x, size_t n, size_t h_from, size_t h_to) {
    for (size_t h = h_from; h < h_to; h <<= 1)
        for (size_t i = 0; i < n; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

static PyObject *fwht(PyObject *self, PyObject *args) {
    Py_buffer x;
    if (!PyArg_ParseTuple(args, "w*", &x)) return NULL;
    size_t n = (size_t)x.len / 4;
    if (n == 0 || (n & (n - 1))) {
        PyBuffer_Release(&x);
        PyErr_SetString(PyExc_ValueError, "fwht: length must be a power of two");
        return NULL;
    }
    float *v = x.buf;
    Py_BEGIN_ALLOW_THREADS
    const size_t blk = n < 2048 ? n : 2048;
    for (size_t s = 0; s < n; s += blk) fwht_block(v + s, blk, 1, blk);
    fwht_block(v, n, blk, n);
    const float scale = (float)(1.0 / sqrt((double)n));
    for (size_t i = 0; i < n; i++) v[i] *= scale;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fwht", fwht, METH_VARARGS, "normalized in-place fast Walsh-Hadamard transform (deterministic)"},
    {"quantize", quantize, METH_VARARGS, "fused clamp + grid map + stochastic rounding to table indices"},
    {"apply_signs", apply_signs, METH_VARARGS, "multiply by the Rademacher diagonal given as packed bits"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kernels", "THC worker kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&moduledef); }
