/* ringmpi._ext._fixed: float partial sums added exactly into integer fixed point, the
 * order-free accumulator of invariant=True (ringmpi.core.fixed_point states the math and
 * holds the NumPy twin of this loop; both give the same bits).
 *
 *   add(acc, x, rows, cols, index, bad, limbs)
 *
 * acc   int64 (A, R, limbs * C), added into: rows contiguous, any strides between them;
 * x     float32 or float64 (N, R, C), C-contiguous: N partials of R rows, C columns;
 * rows  float64 (A, R) powers of two, or None (1);  cols  float64 (C,) powers of two, or None;
 * index int64 (N,): x[n] goes to acc[index[n]] (distinct slots); None: to acc[n] when A == N,
 *       else every x[n] to acc[0] (A == 1: a sum over n);
 * bad   uint8 (A, R), or None: set to 1 for a row with an element that was NaN/Inf or out of
 *       range (that element adds nothing); without it such an element raises ValueError;
 * limbs 1: y = (x * rows) * cols rounded toward zero to int64 (|y| < 2^62; a missing factor is 1);
 *       2: hi = trunc(y * 2^-30), lo = trunc(y - hi * 2^30) added to columns c and C + c
 *          (|y| < 2^92): two int64 words, 92 bits, for float64.
 * Each step is one IEEE double operation (exact: x widens exactly, powers of two scale
 * exactly, y - hi * 2^30 is exact), so the NumPy twin gives the same integers, and integer
 * addition makes the result independent of the order of the partials. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* a buffer of ndim dims and one of formats: C-contiguous, or (strided) with a contiguous last dim */
static int get_view(PyObject *obj, Py_buffer *view, int writable, int ndim, const char *formats, const char *name,
                    int strided)
{
    int flags = (strided ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *f = view->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (view->ndim != ndim || strlen(f) != 1 || !strchr(formats, f[0])
        || (strided && (view->strides[ndim - 1] != view->itemsize || view->strides[0] % view->itemsize
                        || (ndim > 1 && view->strides[1] % view->itemsize)))) {
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-D array of format %s with contiguous rows", name, ndim,
                     formats);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get(PyObject *obj, Py_buffer *view, int writable, int ndim, const char *formats, const char *name)
{
    return get_view(obj, view, writable, ndim, formats, name, 0);
}

static char fmt(const Py_buffer *v)
{
    const char *f = v->format;
    return (f[0] == '<' || f[0] == '=' || f[0] == '@') ? f[1] : f[0];
}

/* One word: acc[slot(n)][r][c] += trunc(y), y = (x * rs[slot][r]) * cols[c], |y| < 2^62; trunc(y)
 * formed from two int32 halves (hi = trunc(y 2^-31), lo = trunc(y - hi 2^31)): the same integer as
 * (int64_t)y, in operations a compiler vectorises without AVX-512 (double -> int32 conversions).
 * Returns the rows flagged (a NaN/Inf or out-of-range element, which adds nothing). */
#define ONE_WORD(NAME, T)                                                                                 \
    static Py_ssize_t NAME(int64_t *acc, Py_ssize_t sa, Py_ssize_t sr, const T *x, Py_ssize_t N,          \
                           Py_ssize_t R, Py_ssize_t C, Py_ssize_t A, const int64_t *index,                \
                           const double *rows, const double *restrict cols, unsigned char *bad)           \
    {                                                                                                     \
        Py_ssize_t flagged = 0;                                                                           \
        for (Py_ssize_t n = 0; n < N; n++) {                                                              \
            const Py_ssize_t slot = index ? (Py_ssize_t)index[n] : (A == N ? n : 0);                      \
            for (Py_ssize_t r = 0; r < R; r++) {                                                          \
                const double rs = rows ? rows[slot * R + r] : 1.0;                                        \
                const T *restrict xr = x + (n * R + r) * C;                                               \
                int64_t *restrict out = acc + slot * sa + r * sr;                                         \
                int64_t any = 0;                                                                          \
                for (Py_ssize_t c = 0; c < C; c++) {                                                      \
                    double y = ((double)xr[c] * rs) * cols[c];                                            \
                    int in = fabs(y) < 0x1p62; /* false for NaN */                                        \
                    any |= ~-(int64_t)in;                                                                 \
                    y = in ? y : 0.0;                                                                     \
                    double hi = trunc(y * 0x1p-31);                                                       \
                    int32_t h = (int32_t)hi, l = (int32_t)(y - hi * 0x1p31);                              \
                    out[c] += (int64_t)h * ((int64_t)1 << 31) + (int64_t)l;                               \
                }                                                                                         \
                if (any) {                                                                                \
                    flagged++;                                                                            \
                    if (bad) bad[slot * R + r] = 1;                                                       \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        return flagged;                                                                                   \
    }

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
CLONES ONE_WORD(one_word_float, float)
CLONES ONE_WORD(one_word_double, double)

/* two words: hi = trunc(y 2^-30) (|hi| < 2^62), lo = trunc(y - hi 2^30) */
static int row_two(int64_t *out, const void *xv, int wide, Py_ssize_t at, Py_ssize_t C, double rs,
                   const double *cols)
{
    int bad = 0;
    for (Py_ssize_t c = 0; c < C; c++) {
        double y = wide ? ((const double *)xv)[at + c] : (double)((const float *)xv)[at + c];
        y = (y * rs) * cols[c];
        if (!(fabs(y) < 0x1p92)) {
            bad = 1;
            continue;
        }
        double hi = trunc(y * 0x1p-30);
        out[c] += (int64_t)hi;
        out[C + c] += (int64_t)(y - hi * 0x1p30);
    }
    return bad;
}

static PyObject *py_add(PyObject *self, PyObject *args)
{
    PyObject *ao, *xo, *ro, *co, *io, *bo;
    int limbs;
    if (!PyArg_ParseTuple(args, "OOOOOOi", &ao, &xo, &ro, &co, &io, &bo, &limbs)) return NULL;
    if (limbs != 1 && limbs != 2) {
        PyErr_SetString(PyExc_ValueError, "limbs must be 1 or 2");
        return NULL;
    }
    Py_buffer av, xv, rv, cv, iv, bv;
    int has_r = ro != Py_None, has_c = co != Py_None, has_i = io != Py_None, has_b = bo != Py_None;
    int got_a = 0, got_x = 0, got_r = 0, got_c = 0, got_i = 0, got_b = 0;
    PyObject *result = NULL;
    if (get_view(ao, &av, 1, 3, "lq", "acc", 1) < 0) goto done;
    got_a = 1;
    if (get(xo, &xv, 0, 3, "fd", "x") < 0) goto done;
    got_x = 1;
    Py_ssize_t A = av.shape[0], R = av.shape[1], N = xv.shape[0], C = xv.shape[2];
    if (av.itemsize != 8 || xv.shape[1] != R || av.shape[2] != limbs * C) {
        PyErr_SetString(PyExc_ValueError, "acc must be int64 (A, R, limbs * C) for x (N, R, C)");
        goto done;
    }
    if (has_r) {
        if (get(ro, &rv, 0, 2, "d", "rows") < 0) goto done;
        got_r = 1;
        if (rv.shape[0] != A || rv.shape[1] != R) {
            PyErr_SetString(PyExc_ValueError, "rows must be float64 (A, R)");
            goto done;
        }
    }
    if (has_c) {
        if (get(co, &cv, 0, 1, "d", "cols") < 0) goto done;
        got_c = 1;
        if (cv.shape[0] != C) {
            PyErr_SetString(PyExc_ValueError, "cols must be float64 (C,)");
            goto done;
        }
    }
    if (has_i) {
        if (get(io, &iv, 0, 1, "lq", "index") < 0) goto done;
        got_i = 1;
        if (iv.shape[0] != N || iv.itemsize != 8) {
            PyErr_SetString(PyExc_ValueError, "index must be int64 (N,)");
            goto done;
        }
        for (Py_ssize_t n = 0; n < N; n++) {
            int64_t s = ((const int64_t *)iv.buf)[n];
            if (s < 0 || s >= A) {
                PyErr_SetString(PyExc_ValueError, "index out of range");
                goto done;
            }
        }
    } else if (A != N && A != 1) {
        PyErr_SetString(PyExc_ValueError, "without index, acc must have N slots or one");
        goto done;
    }
    if (has_b) {
        if (get(bo, &bv, 1, 2, "B?", "bad") < 0) goto done;
        got_b = 1;
        if (bv.shape[0] != A || bv.shape[1] != R) {
            PyErr_SetString(PyExc_ValueError, "bad must be uint8 (A, R)");
            goto done;
        }
    }
    {
        int64_t *acc = (int64_t *)av.buf;
        const Py_ssize_t sa = av.strides[0] / 8, sr = av.strides[1] / 8;  /* acc's slot and row strides */
        const int wide = fmt(&xv) == 'd';
        const double *rows = has_r ? (const double *)rv.buf : NULL;
        const double *cols = has_c ? (const double *)cv.buf : NULL;
        const int64_t *index = has_i ? (const int64_t *)iv.buf : NULL;
        unsigned char *bad = has_b ? (unsigned char *)bv.buf : NULL;
        Py_ssize_t flagged = 0;
        /* a missing factor is 1: multiplying by 1 is exact, so every path multiplies */
        double *ones = NULL;
        if (!cols) {
            ones = (double *)PyMem_RawMalloc((size_t)(C > 0 ? C : 1) * sizeof(double));
            if (!ones) { PyErr_NoMemory(); goto done; }
            for (Py_ssize_t c = 0; c < C; c++) ones[c] = 1.0;
        }
        Py_BEGIN_ALLOW_THREADS
        const double *c_or_one = ones ? ones : cols;
        if (limbs == 1 && wide) {
            flagged = one_word_double(acc, sa, sr, (const double *)xv.buf, N, R, C, A, index, rows, c_or_one, bad);
        } else if (limbs == 1) {
            flagged = one_word_float(acc, sa, sr, (const float *)xv.buf, N, R, C, A, index, rows, c_or_one, bad);
        } else {
            for (Py_ssize_t n = 0; n < N; n++) {
                Py_ssize_t slot = index ? (Py_ssize_t)index[n] : (A == N ? n : 0);
                for (Py_ssize_t r = 0; r < R; r++) {
                    const double rs = rows ? rows[slot * R + r] : 1.0;
                    int64_t *out = acc + slot * sa + r * sr;
                    if (row_two(out, xv.buf, wide, (n * R + r) * C, C, rs, c_or_one)) {
                        flagged++;
                        if (bad) bad[slot * R + r] = 1;
                    }
                }
            }
        }
        Py_END_ALLOW_THREADS
        PyMem_RawFree(ones);
        if (flagged && !bad) {
            PyErr_Format(PyExc_ValueError, "%zd row(s) held NaN/Inf or values beyond the fixed-point range", flagged);
            goto done;
        }
        result = Py_None;
        Py_INCREF(result);
    }
done:
    if (got_b) PyBuffer_Release(&bv);
    if (got_i) PyBuffer_Release(&iv);
    if (got_c) PyBuffer_Release(&cv);
    if (got_r) PyBuffer_Release(&rv);
    if (got_x) PyBuffer_Release(&xv);
    if (got_a) PyBuffer_Release(&av);
    return result;
}

static PyMethodDef methods[] = {
    {"add", py_add, METH_VARARGS,
     "add(acc, x, rows, cols, index, bad, limbs): acc[slot] += trunc((x * rows) * cols) in int64 "
     "fixed point (see the module source); the order-free sums of invariant=True"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fixed", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fixed(void) { return PyModule_Create(&module); }
