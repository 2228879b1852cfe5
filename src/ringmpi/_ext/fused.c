/* ringmpi._fused: the CPU tile's elementwise passes, each in one sweep (float32).
 *
 *   exp_tile:  s[i, j] = exp(((s[i, j] * scale) + bias[i, j]) - shift[i]),   sums[i] = sum_j s[i, j]
 *   ds_tile:   dp[i, j] = (dp[i, j] - dvec[i]) * p[i, j]                     (the backward's dS)
 *
 * each step rounded to float32 in NumPy's order (compiled with -ffp-contract=off),
 * bias, shift and sums optional.  A row's sum adds its elements into LANES partial
 * sums (element j into lane j % LANES, in column order), then the lanes in order
 * 0..LANES-1, then the tail's elements in column order: fixed for a row's length (a NaN
 * sum is the one quiet NaN: which NaN a sum of several would give depends on the compiler).
 * exp is a polynomial (max error 1 ulp, see exp_rows.h): exp(-inf) = 0, exp(+inf) = inf,
 * NaN stays NaN, overflow gives inf, subnormal results are kept, so the NumPy path's
 * finiteness checks see what they saw with np.exp.  An element depends on that element
 * alone, a sum on its row alone.
 *
 * The pass is compiled once per vector path (AVX-512, AVX2, the baseline: SSE2 or NEON), from
 * one source (exp_rows.h) with the vector width as its parameter; every path does the same
 * float32 operations in the same order: the same bits on each.  paths() lists those this
 * CPU runs, use() picks one (ringmpi.backends.tile_pass chooses the fastest at first use,
 * or the one RINGMPI_CPU_VECTOR pins). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define X86_PATHS 1
#include <immintrin.h>
#endif
#define LANES 16 /* a row's sum adds into this many lanes, on every path */

#define PATH plain
#define PATH_ISA
#define VW 4
#define NB 8
#include "exp_rows.h"
#ifdef X86_PATHS
#define PATH avx2
#define PATH_ISA __attribute__((target("avx2")))
#define VW 8
#define NB 8
#include "exp_rows.h"
#define PATH avx512
#define PATH_ISA __attribute__((target("avx512f")))
#define VW 16
#define NB 4
#include "exp_rows.h"
#endif

typedef void (*exp_rows_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, float, const float *, Py_ssize_t,
                            const float *, float *);
typedef void (*ds_rows_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, const float *,
                           Py_ssize_t);

/* the paths, widest first; a path runs where the CPU has its extension */
static const struct {
    const char *name;
    exp_rows_fn exp_rows;
    ds_rows_fn ds_rows;
} PATHS[] = {
#ifdef X86_PATHS
    {"avx512", exp_rows_avx512, ds_rows_avx512},
    {"avx2", exp_rows_avx2, ds_rows_avx2},
#endif
    {"plain", exp_rows_plain, ds_rows_plain},
};
#define N_PATHS ((int)(sizeof PATHS / sizeof PATHS[0]))

static int cpu_runs(int i)
{
#ifdef X86_PATHS
    __builtin_cpu_init();
    if (PATHS[i].exp_rows == exp_rows_avx512) return __builtin_cpu_supports("avx512f");
    if (PATHS[i].exp_rows == exp_rows_avx2) return __builtin_cpu_supports("avx2");
#endif
    (void)i;
    return 1; /* the baseline */
}

static int current = -1; /* index into PATHS, set at import */

/* a writable (or, for inputs, readable) float32 2-D buffer with unit column stride */
static int get2d(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t *rows, Py_ssize_t *cols,
                 Py_ssize_t *ld)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->ndim != 2 || strcmp(view->format, "f") != 0 || view->strides[1] != 4 || view->strides[0] % 4) {
        PyErr_SetString(PyExc_ValueError, "expected a 2-D float32 array with contiguous rows");
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->shape[0];
    *cols = view->shape[1];
    *ld = view->strides[0] / 4;
    return 0;
}

static PyObject *py_exp_tile(PyObject *self, PyObject *args)
{
    PyObject *so, *bo, *ho, *uo = Py_None;
    float scale;
    if (!PyArg_ParseTuple(args, "OfOO|O", &so, &scale, &bo, &ho, &uo)) return NULL;
    Py_buffer sv, bv, hv, uv;
    Py_ssize_t rows, cols, ld, br, bc, ldb = 0;
    if (get2d(so, &sv, 1, &rows, &cols, &ld) < 0) return NULL;
    const float *bias = NULL, *shift = NULL;
    float *sums = NULL;
    int has_b = bo != Py_None, has_h = ho != Py_None, has_u = uo != Py_None;
    if (has_b) {
        if (get2d(bo, &bv, 0, &br, &bc, &ldb) < 0) { PyBuffer_Release(&sv); return NULL; }
        if (br != rows || bc != cols) {
            PyErr_SetString(PyExc_ValueError, "bias shape differs from the tile's");
            PyBuffer_Release(&bv); PyBuffer_Release(&sv); return NULL;
        }
        bias = (const float *)bv.buf;
    }
    if (has_h) {
        if (PyObject_GetBuffer(ho, &hv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
        if (hv.ndim != 1 || strcmp(hv.format, "f") != 0 || hv.shape[0] != rows) {
            PyErr_SetString(PyExc_ValueError, "shift must be a contiguous (rows,) float32 array");
            PyBuffer_Release(&hv); goto fail;
        }
        shift = (const float *)hv.buf;
    }
    if (has_u) {
        if (PyObject_GetBuffer(uo, &uv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) goto fail_h;
        if (uv.ndim != 1 || strcmp(uv.format, "f") != 0 || uv.shape[0] != rows) {
            PyErr_SetString(PyExc_ValueError, "sums must be a writable contiguous (rows,) float32 array");
            PyBuffer_Release(&uv); goto fail_h;
        }
        sums = (float *)uv.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    PATHS[current].exp_rows((float *)sv.buf, rows, cols, ld, scale, bias, ldb, shift, sums);
    Py_END_ALLOW_THREADS
    if (has_u) PyBuffer_Release(&uv);
    if (has_h) PyBuffer_Release(&hv);
    if (has_b) PyBuffer_Release(&bv);
    PyBuffer_Release(&sv);
    Py_RETURN_NONE;
fail_h:
    if (has_h) PyBuffer_Release(&hv);
fail:
    if (has_b) PyBuffer_Release(&bv);
    PyBuffer_Release(&sv);
    return NULL;
}

static PyObject *py_ds_tile(PyObject *self, PyObject *args)
{
    PyObject *dpo, *po, *vo;
    if (!PyArg_ParseTuple(args, "OOO", &dpo, &po, &vo)) return NULL;
    Py_buffer dv, pv, vv;
    Py_ssize_t rows, cols, ld, pr, pc, ldp;
    if (get2d(dpo, &dv, 1, &rows, &cols, &ld) < 0) return NULL;
    if (get2d(po, &pv, 0, &pr, &pc, &ldp) < 0) { PyBuffer_Release(&dv); return NULL; }
    if (pr != rows || pc != cols) {
        PyErr_SetString(PyExc_ValueError, "p's shape differs from dp's");
        goto fail;
    }
    if (PyObject_GetBuffer(vo, &vv, PyBUF_STRIDES | PyBUF_FORMAT) < 0) goto fail;
    if (vv.ndim != 1 || strcmp(vv.format, "f") != 0 || vv.shape[0] != rows || vv.strides[0] % 4) {
        PyErr_SetString(PyExc_ValueError, "dvec must be a (rows,) float32 array");
        PyBuffer_Release(&vv);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    PATHS[current].ds_rows((float *)dv.buf, rows, cols, ld, (const float *)pv.buf, ldp, (const float *)vv.buf,
                           vv.strides[0] / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vv);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&dv);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&pv);
    PyBuffer_Release(&dv);
    return NULL;
}

#define PATHS_OF "the tile pass"
#include "vector_paths.h"

static PyMethodDef methods[] = {
    {"exp_tile", py_exp_tile, METH_VARARGS,
     "exp_tile(s, scale, bias, shift, sums=None): s = exp(s * scale + bias - shift[:, None]) in place, "
     "float32 (bias a same-shape array or None, shift a (rows,) array or None); sums, a (rows,) "
     "array, receives the rows' sums of the result"},
    {"ds_tile", py_ds_tile, METH_VARARGS,
     "ds_tile(dp, p, dvec): dp = (dp - dvec[:, None]) * p in place, float32, each step rounded"},
    {"paths", py_paths, METH_NOARGS, "paths(): the vector paths this CPU runs, best first ('avx512', 'avx2', 'plain')"},
    {"path", py_path, METH_NOARGS, "path(): the vector path exp_tile runs"},
    {"use", py_use, METH_VARARGS, "use(name): exp_tile runs the vector path ``name`` (ValueError where this CPU cannot)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void)
{
    use_widest();
    return PyModule_Create(&module);
}
