/* ringmpi._fused: the CPU tile's elementwise passes, each in one sweep (float32), and the compiled
 * forward block op.
 *
 *   exp_tile:  s[i, j] = exp(((s[i, j] * scale) + bias[i, j]) - shift[i]),   sums[i] = sum_j s[i, j]
 *   ds_tile:   dp[i, j] = (dp[i, j] - dvec[i]) * p[i, j]                     (the backward's dS)
 *   fwd_chunk: one packed key chunk folded into the online softmax of a run of query rows
 *              (block_rows.h: Q K^T, mask, row max, exp with row sums, P V, no call out between)
 *   fma_peak:  the core's float32 FMA peak at a path's vector width (the benchmark's yardstick)
 *   visible, classify, dropout_keep, alibi_terms, softcap, philox_word0: the per-element rules of
 *              kernels/rules.h (the very code the CUDA kernels run) over a block, for the NumPy
 *              backend's tiles and the tests
 *
 * each step rounded to float32 in NumPy's order (compiled with -ffp-contract=off; the one fused
 * multiply-adds are those written as such), bias, shift and sums optional.  A row's sum adds its
 * elements into LANES partial sums (element j into lane j % LANES, in column order), then the lanes
 * in order 0..LANES-1, then the tail's elements in column order: fixed for a row's length (a NaN
 * sum is the one quiet NaN: which NaN a sum of several would give depends on the compiler).
 * exp is a polynomial in fused multiply-adds (max error 2.1 ulp, see exp_rows.h): exp(-inf) = 0,
 * exp(+inf) = inf, NaN stays NaN, overflow gives inf, subnormal results are kept, so the NumPy
 * path's finiteness checks see what they saw with np.exp.  An element depends on that element
 * alone, a sum on its row alone.
 *
 * The passes are compiled once per vector path (AVX-512, AVX2 + FMA, the baseline: SSE2 or NEON,
 * whose x86 build runs its 128-bit FMA twin where the CPU has FMA), from one source (exp_rows.h,
 * block_rows.h) with the vector width as its parameter; every path does the same float32
 * operations in the same order: the same bits on each.  The block op needs FMA instructions: the
 * plain path has it only where the CPU has FMA (has_block()).  paths() lists the paths this CPU
 * runs, use() picks one (ringmpi.backends.tile_pass chooses the fastest at first use, or the one
 * RINGMPI_CPU_VECTOR pins). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <limits.h>
#include <time.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define X86_PATHS 1
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#define LANES 16 /* a row's sum adds into this many lanes, on every path */
#include "rules.h" /* kernels/rules.h: setup.py adds its folder and its -D defines */
#include "chunk_mask.h"

#define PATH plain
#define PATH_ISA
#define VW 4
#define NB 8
#include "exp_rows.h"
#ifdef X86_PATHS
/* the plain path again with 128-bit FMA instructions, which it runs where the CPU has them:
 * the same bits (a fused multiply-add is one rounding either way), without a C library call
 * per lane; with the block op, which needs FMA instructions to be worth running */
#define EXP_ROWS_KEEP 1
#define PATH plainfma
#define PATH_ISA __attribute__((target("fma")))
#define PATH_FMA128 1
#define VW 4
#define NB 8
#include "exp_rows.h"
#define QK_MR 4
#define PV_MR 4
#define PV_NV 2
#define BQ 48
#include "block_rows.h"
#undef PATH_FMA128
#define PATH avx2
#define PATH_ISA __attribute__((target("avx2,fma")))
#define VW 8
#define NB 8
#include "exp_rows.h"
#define QK_MR 6
#define PV_MR 6
#define PV_NV 2
#define BQ 48
#include "block_rows.h"
#define PATH avx512
#define PATH_ISA __attribute__((target("avx512f")))
#define VW 16
#define NB 4
#include "exp_rows.h"
#define QK_MR 8
#define PV_MR 6
#define PV_NV 4
#define BQ 48
#include "block_rows.h"
#undef EXP_ROWS_KEEP
#endif

typedef void (*exp_rows_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, float, const float *, Py_ssize_t,
                            const float *, float *);
typedef void (*ds_rows_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, const float *,
                           Py_ssize_t);
typedef void (*scores_fn)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, Py_ssize_t,
                          float *, Py_ssize_t, float *);
typedef void (*scores_packed_fn)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t,
                                 float *, Py_ssize_t, Py_ssize_t, float *);
typedef void (*scores_max_fn)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, float *,
                              float *);
typedef void (*pair_forward_fn)(const float *, Py_ssize_t, const float *, Py_ssize_t, Py_ssize_t, const float *,
                                Py_ssize_t, const float *, float, float *, float *, float *);
typedef void (*pair_backward_fn)(const float *, const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                                 const float *, const float *, const float *, const float *, const float *, float,
                                 float *, float *, float *, float *, float *);
typedef void (*pair_products_fn)(const float *, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, Py_ssize_t,
                                 float *, int, float *);
typedef void (*fwd_chunk_fn)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t,
                             const float *, Py_ssize_t, float *, Py_ssize_t, Py_ssize_t, float *, float *, float,
                             const ScoreMods *, const ChunkMask *, const DropoutRow *, float *);
typedef void (*bwd_chunk_fn)(const float *, Py_ssize_t, const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                             const float *, Py_ssize_t, const float *, Py_ssize_t, Py_ssize_t, const float *,
                             const float *, float *, Py_ssize_t, float *, Py_ssize_t, float *, Py_ssize_t, float,
                             const ScoreMods *, const ChunkMask *, const DropoutRow *, float *);

/* the paths, widest first; a path runs where the CPU has its extension */
static struct {
    const char *name;
    exp_rows_fn exp_rows;
    ds_rows_fn ds_rows;
    fwd_chunk_fn fwd_chunk; /* the forward block op, or NULL where the path has no FMA */
    scores_fn scores;       /* its Q K^T alone (the backward's scores on the BLAS tiles) */
    scores_packed_fn scores_packed; /* the same from keys already packed in panels */
    scores_max_fn scores_max;       /* the rows' largest scores from packed keys, none stored */
    pair_products_fn pair_products; /* invariant=True's per-pair products */
    pair_forward_fn pair_forward;   /* its second pass over a stack of pairs, fused */
    pair_backward_fn pair_backward; /* its backward over a stack of pairs, fused */
    bwd_chunk_fn bwd_chunk; /* the backward block op */
    int bq;                 /* its strip rows */
} PATHS[] = {
#ifdef X86_PATHS
    {"avx512", exp_rows_avx512, ds_rows_avx512, fwd_chunk_avx512, scores_avx512, scores_packed_avx512,
     scores_max_avx512, pair_products_avx512, pair_forward_avx512,
     pair_backward_avx512, bwd_chunk_avx512, 48},
    {"avx2", exp_rows_avx2, ds_rows_avx2, fwd_chunk_avx2, scores_avx2, scores_packed_avx2,
     scores_max_avx2, pair_products_avx2, pair_forward_avx2, pair_backward_avx2, bwd_chunk_avx2, 48},
#endif
    {"plain", exp_rows_plain, ds_rows_plain, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0},
};
#define N_PATHS ((int)(sizeof PATHS / sizeof PATHS[0]))

static int cpu_runs(int i)
{
#ifdef X86_PATHS
    __builtin_cpu_init();
    if (PATHS[i].exp_rows == exp_rows_avx512) return __builtin_cpu_supports("avx512f");
    if (PATHS[i].exp_rows == exp_rows_avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    (void)i;
    return 1; /* the baseline */
}

static int current = -1; /* index into PATHS, set at import */

/* the plain path's FMA build where the CPU has FMA (see plainfma above) */
static void plain_uses_fma(void)
{
#ifdef X86_PATHS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("fma")) {
        PATHS[N_PATHS - 1].exp_rows = exp_rows_plainfma;
        PATHS[N_PATHS - 1].ds_rows = ds_rows_plainfma; /* the same arithmetic (no FMA in dS) */
        PATHS[N_PATHS - 1].fwd_chunk = fwd_chunk_plainfma;
        PATHS[N_PATHS - 1].scores = scores_plainfma;
        PATHS[N_PATHS - 1].scores_packed = scores_packed_plainfma;
        PATHS[N_PATHS - 1].scores_max = scores_max_plainfma;
        PATHS[N_PATHS - 1].pair_products = pair_products_plainfma;
        PATHS[N_PATHS - 1].pair_forward = pair_forward_plainfma;
        PATHS[N_PATHS - 1].pair_backward = pair_backward_plainfma;
        PATHS[N_PATHS - 1].bwd_chunk = bwd_chunk_plainfma;
        PATHS[N_PATHS - 1].bq = 48;
    }
#endif
}

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

/* a 1-D contiguous buffer of `n` items of `format` (NULL for None) */
static int get1d(PyObject *obj, Py_buffer *view, const char *format, Py_ssize_t n, int writable, const char *what)
{
    if (obj == Py_None) { view->obj = NULL; view->buf = NULL; return 0; }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 1 || strcmp(view->format, format) != 0 || view->shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous (%zd,) array of format %s", what, n, format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
}

/* 1 where the path in use has the compiled block op (its entry `fn` is not NULL), else 0 with
 * ValueError set */
static int has_block_op(const void *fn)
{
    if (fn) return 1;
    PyErr_Format(PyExc_ValueError, "the %s path has no compiled block op (no FMA instructions)", PATHS[current].name);
    return 0;
}

/* dropout's (k0, k1, row, threshold, rescale, q_pos, kv_pos) or None into *dr, its two position arrays
 * held in views[0..1] (released by the caller): 0, or -1 with an exception set */
static int get_dropout(PyObject *obj, Py_ssize_t nq, Py_ssize_t nk, DropoutRow *dr, Py_buffer *views)
{
    memset(dr, 0, sizeof *dr);
    if (obj == Py_None) return 0;
    PyObject *qpo, *kpo;
    if (!PyArg_ParseTuple(obj, "IIIKfOO", &dr->k0, &dr->k1, &dr->row, &dr->threshold, &dr->rescale, &qpo, &kpo))
        return -1;
    if (get1d(qpo, &views[0], "l", nq, 0, "dropout q_pos") < 0 ||
        get1d(kpo, &views[1], "l", nk, 0, "dropout kv_pos") < 0)
        return -1;
    if (!views[0].buf || !views[1].buf) {
        PyErr_SetString(PyExc_ValueError, "dropout needs the rows' and keys' positions");
        return -1;
    }
    dr->qpos = (const int64_t *)views[0].buf;
    dr->kvpos = (const int64_t *)views[1].buf;
    dr->on = 1;
    return 0;
}

/* what fwd_chunk and bwd_chunk (`who`, in the errors) take alike: lo, hi (nq,) and kvpos (nk,) int64, all or
 * none; seg_q (nq,) and seg_kv (nk,) int64, both or neither; the ALiBi rows' and keys' float64 positions
 * (needed where slope != 0); dropout.  Into views[0..8] (released by the caller), *mk, *md, *dr: 0, or -1
 * with an exception set */
static int get_chunk_terms(const char *who, Py_ssize_t nq, Py_ssize_t nk, PyObject *loo, PyObject *hio,
                           PyObject *kvo, PyObject *sqo, PyObject *sko, float cap, float slope, PyObject *aqo,
                           PyObject *ako, PyObject *dro, Py_buffer *views, ChunkMask *mk, ScoreMods *md,
                           DropoutRow *dr)
{
    if (get1d(loo, &views[0], "l", nq, 0, "lo") < 0 || get1d(hio, &views[1], "l", nq, 0, "hi") < 0 ||
        get1d(kvo, &views[2], "l", nk, 0, "kvpos") < 0)
        return -1;
    if ((views[0].buf == NULL) != (views[2].buf == NULL) || (views[1].buf == NULL) != (views[2].buf == NULL)) {
        PyErr_Format(PyExc_ValueError, "%s: lo, hi and kvpos go together", who);
        return -1;
    }
    if (get1d(sqo, &views[3], "l", nq, 0, "seg_q") < 0 || get1d(sko, &views[4], "l", nk, 0, "seg_kv") < 0)
        return -1;
    if ((views[3].buf == NULL) != (views[4].buf == NULL)) {
        PyErr_Format(PyExc_ValueError, "%s: seg_q and seg_kv go together", who);
        return -1;
    }
    *mk = chunk_mask((const int64_t *)views[0].buf, (const int64_t *)views[1].buf, (const int64_t *)views[2].buf,
                     (const int64_t *)views[3].buf, (const int64_t *)views[4].buf, nk);
    if (get1d(aqo, &views[5], "d", nq, 0, "alibi_q") < 0 || get1d(ako, &views[6], "d", nk, 0, "alibi_kv") < 0)
        return -1;
    if (slope != 0.0f && (!views[5].buf || !views[6].buf)) {
        PyErr_Format(PyExc_ValueError, "%s: ALiBi needs the rows' and keys' float64 positions", who);
        return -1;
    }
    *md = (ScoreMods){cap, slope, (const double *)views[5].buf, (const double *)views[6].buf};
    return get_dropout(dro, nq, nk, dr, &views[7]);
}

/* a block op's call: CALL (an expression reading `scratch`, `floats` floats 64-byte aligned) run without the
 * GIL, then `out` = None; `out` unchanged, MemoryError set, where there is no scratch */
#define CALL_WITH_SCRATCH(out, floats, CALL)                                                                  \
    do {                                                                                                     \
        float *scratch = NULL;                                                                               \
        if (posix_memalign((void **)&scratch, 64, sizeof(float) * (floats))) {                               \
            PyErr_NoMemory();                                                                                \
            break;                                                                                           \
        }                                                                                                    \
        Py_BEGIN_ALLOW_THREADS                                                                               \
        CALL;                                                                                                \
        Py_END_ALLOW_THREADS                                                                                 \
        free(scratch);                                                                                       \
        Py_INCREF(Py_None);                                                                                  \
        (out) = Py_None;                                                                                     \
    } while (0)

/* fwd_chunk(q, kp, vp, nk, o, m, l, scale, lo, hi, kvpos[, seg_q, seg_kv, softcap, alibi, dropout]); alibi:
 * None or (slope, alibi_q, alibi_kv) (at most 16 arguments: CPython 3.11 keeps every 20-argument call's
 * tuple) */
static PyObject *py_fwd_chunk(PyObject *self, PyObject *args)
{
    PyObject *qo, *kpo, *vpo, *oo, *mo, *lo_, *loo, *hio, *kvo, *sqo = Py_None, *sko = Py_None, *alo = Py_None,
             *aqo = Py_None, *ako = Py_None, *dro = Py_None;
    Py_ssize_t nk;
    float scale, cap = 0.0f, slope = 0.0f;
    if (!PyArg_ParseTuple(args, "OOOnOOOfOOO|OOfOO", &qo, &kpo, &vpo, &nk, &oo, &mo, &lo_, &scale, &loo, &hio, &kvo,
                          &sqo, &sko, &cap, &alo, &dro))
        return NULL;
    if (alo != Py_None && !PyArg_ParseTuple(alo, "fOO", &slope, &aqo, &ako)) return NULL;
    fwd_chunk_fn fn = PATHS[current].fwd_chunk;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[15];
    memset(v, 0, sizeof v);
    Py_ssize_t nq, dim, ldq, dk, kbp, ldk, nkr, dvp, ldv, oq, dv, ldo;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &nq, &dim, &ldq) < 0) return NULL;
    if (get2d(kpo, &v[1], 0, &dk, &kbp, &ldk) < 0) goto done;
    if (get2d(vpo, &v[2], 0, &nkr, &dvp, &ldv) < 0) goto done;
    if (get2d(oo, &v[3], 1, &oq, &dv, &ldo) < 0) goto done;
    /* kp: the keys' panels, (panels * D, 32) contiguous; vp: (>= nk, dvp) contiguous, dvp % 16 == 0 */
    if (kbp != 32 || ldk != 32 || dim < 1 || dk % dim || dk / dim * 32 < nk || nk < 1 || ldv != dvp || dvp % 16 ||
        nkr < nk || dv > dvp || oq != nq) {
        PyErr_SetString(PyExc_ValueError, "fwd_chunk: operand shapes do not match");
        goto done;
    }
    if (get1d(mo, &v[4], "f", nq, 1, "m") < 0 || get1d(lo_, &v[5], "f", nq, 1, "l") < 0) goto done;
    if (!v[4].buf || !v[5].buf) {
        PyErr_SetString(PyExc_ValueError, "fwd_chunk: m and l are required");
        goto done;
    }
    ChunkMask mk;
    ScoreMods md;
    DropoutRow dr;
    if (get_chunk_terms("fwd_chunk", nq, nk, loo, hio, kvo, sqo, sko, cap, slope, aqo, ako, dro, &v[6], &mk, &md,
                        &dr) < 0)
        goto done;
    const Py_ssize_t bq = PATHS[current].bq, kbpad = (nk + 31) / 32 * 32;
    CALL_WITH_SCRATCH(out, bq * (kbpad + dim + dvp + 1) + kbpad,
                      fn((const float *)v[0].buf, ldq, nq, dim, (const float *)v[1].buf, nk, (const float *)v[2].buf,
                         dvp, (float *)v[3].buf, ldo, dv, (float *)v[4].buf, (float *)v[5].buf, scale, &md, &mk, &dr,
                         scratch));
done:
    release(v, 15);
    return out;
}

/* scores(q, k, out): out = q k^T with fwd_chunk's arithmetic */
static PyObject *py_scores(PyObject *self, PyObject *args)
{
    PyObject *qo, *ko, *so;
    if (!PyArg_ParseTuple(args, "OOO", &qo, &ko, &so)) return NULL;
    scores_fn fn = PATHS[current].scores;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    Py_ssize_t nq, dim, ldq, nk, dk, ldk, sr, sc, lds;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &nq, &dim, &ldq) < 0) return NULL;
    if (get2d(ko, &v[1], 0, &nk, &dk, &ldk) < 0) goto done;
    if (get2d(so, &v[2], 1, &sr, &sc, &lds) < 0) goto done;
    if (dk != dim || sr != nq || sc != nk) {
        PyErr_SetString(PyExc_ValueError, "scores: operand shapes do not match");
        goto done;
    }
    const Py_ssize_t bq = PATHS[current].bq, kbpad = (nk + 31) / 32 * 32;
    CALL_WITH_SCRATCH(out, kbpad * dim + bq * (dim + kbpad),
                      fn((const float *)v[0].buf, ldq, nq, dim, (const float *)v[1].buf, ldk, nk, (float *)v[2].buf,
                         lds, scratch));
done:
    release(v, 3);
    return out;
}

/* scores_packed(q, kp, out, tile): out = q K^T from keys packed in panels, kp (panels * D, 32) as
 * fwd_chunk's; tile 0: out (nq, nk) with nk <= panels * 32; tile > 0: out (nk / tile * nq, tile)
 * contiguous, one (nq, tile) block per run of tile keys */
static PyObject *py_scores_packed(PyObject *self, PyObject *args)
{
    PyObject *qo, *kpo, *so;
    Py_ssize_t tile;
    if (!PyArg_ParseTuple(args, "OOOn", &qo, &kpo, &so, &tile)) return NULL;
    scores_packed_fn fn = PATHS[current].scores_packed;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    Py_ssize_t nq, dim, ldq, dk, kw, ldk, sr, sc, lds, nk;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &nq, &dim, &ldq) < 0) return NULL;
    if (get2d(kpo, &v[1], 0, &dk, &kw, &ldk) < 0) goto done;
    if (get2d(so, &v[2], 1, &sr, &sc, &lds) < 0) goto done;
    nk = tile > 0 && nq > 0 ? sr / nq * sc : sc;
    if (kw != 32 || ldk != 32 || dim < 1 || dk % dim || tile < 0 || nq < 1 || dk / dim * 32 < nk ||
        (tile == 0 && sr != nq) || (tile > 0 && (sc != tile || lds != tile || sr % nq || tile % 32))) {
        PyErr_SetString(PyExc_ValueError, "scores_packed: operand shapes do not match");
        goto done;
    }
    const Py_ssize_t bq = PATHS[current].bq, kbpad = (nk + 31) / 32 * 32;
    CALL_WITH_SCRATCH(out, bq * (dim + kbpad),
                      fn((const float *)v[0].buf, ldq, nq, dim, (const float *)v[1].buf, nk, (float *)v[2].buf, lds,
                         tile, scratch));
done:
    release(v, 3);
    return out;
}

/* scores_max(q, kp, rowmax): rowmax (nq,) = each row's largest score of q K^T, K packed in whole
 * panels as scores_packed's kp (nk = panels * 32); NaN where a row met one */
static PyObject *py_scores_max(PyObject *self, PyObject *args)
{
    PyObject *qo, *kpo, *mo;
    if (!PyArg_ParseTuple(args, "OOO", &qo, &kpo, &mo)) return NULL;
    scores_max_fn fn = PATHS[current].scores_max;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    Py_ssize_t nq, dim, ldq, dk, kw, ldk;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &nq, &dim, &ldq) < 0) return NULL;
    if (get2d(kpo, &v[1], 0, &dk, &kw, &ldk) < 0) goto done;
    if (kw != 32 || ldk != 32 || dim < 1 || nq < 1 || dk % dim) {
        PyErr_SetString(PyExc_ValueError, "scores_max: operand shapes do not match");
        goto done;
    }
    if (get1d(mo, &v[2], "f", nq, 1, "rowmax") < 0) goto done;
    if (!v[2].buf) {
        PyErr_SetString(PyExc_ValueError, "scores_max: rowmax must be an array");
        goto done;
    }
    const Py_ssize_t bq = PATHS[current].bq;
    CALL_WITH_SCRATCH(out, bq * dim,
                      fn((const float *)v[0].buf, ldq, nq, dim, (const float *)v[1].buf, dk / dim * 32,
                         (float *)v[2].buf, scratch));
done:
    release(v, 3);
    return out;
}

/* pair_forward(q, kp, v, shift, scale, out, sums): a query tile q (t, D) against the n key tiles of kp
 * (packed panels, t keys each) with their values v (n * t, w): sums (n * t,) and out (n * t, w) as
 * block_rows.h's pair_forward makes them */
static PyObject *py_pair_forward(PyObject *self, PyObject *args)
{
    PyObject *qo, *kpo, *vo, *ho, *oo, *so;
    float scale;
    if (!PyArg_ParseTuple(args, "OOOOfOO", &qo, &kpo, &vo, &ho, &scale, &oo, &so)) return NULL;
    pair_forward_fn fn = PATHS[current].pair_forward;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[6];
    memset(v, 0, sizeof v);
    Py_ssize_t t, dim, ldq, dk, kw, ldk, vr, w, ldv, orow, ow, ldo;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &t, &dim, &ldq) < 0) return NULL;
    if (get2d(kpo, &v[1], 0, &dk, &kw, &ldk) < 0 || get2d(vo, &v[2], 0, &vr, &w, &ldv) < 0 ||
        get2d(oo, &v[3], 1, &orow, &ow, &ldo) < 0)
        goto done;
    if (t < 1 || dim < 1 || t % 32 || ldq != dim || kw != 32 || ldk != 32 || dk % (t * dim / 32) || w < 1 ||
        ldv != w || vr != dk / (t * dim / 32) * t || orow != vr || ow != w || ldo != w) {
        PyErr_SetString(PyExc_ValueError, "pair_forward: operand shapes do not match");
        goto done;
    }
    const Py_ssize_t n = vr / t;
    if (get1d(ho, &v[4], "f", t, 0, "shift") < 0 || get1d(so, &v[5], "f", n * t, 1, "sums") < 0) goto done;
    if (!v[4].buf || !v[5].buf) {
        PyErr_SetString(PyExc_ValueError, "pair_forward: shift and sums are required");
        goto done;
    }
    const Py_ssize_t bq = PATHS[current].bq, wp = (w + 15) / 16 * 16;
    CALL_WITH_SCRATCH(out, t * t + bq * dim + bq * t + 2 * t * wp + 16,
                      fn((const float *)v[0].buf, dim, (const float *)v[1].buf, n, t, (const float *)v[2].buf, w,
                         (const float *)v[4].buf, scale, (float *)v[3].buf, (float *)v[5].buf, scratch));
done:
    release(v, 6);
    return out;
}

/* pair_backward(qs, dos, kp, vp, k, lse, dvec, scale, outv, outq, outk, sums): n query tiles qs (n * t, D),
 * dos (n * t, D_v) against one key tile (kp, vp: its K, V in panels; k (t, D)): block_rows.h's
 * pair_backward into outv (n * t, D_v), outq, outk (n * t, D) and sums (n * t,) */
static PyObject *py_pair_backward(PyObject *self, PyObject *args)
{
    PyObject *qo, *doo, *kpo, *vpo, *ko, *lo_, *dvo, *ovo, *oqo, *oko, *so;
    float scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOfOOOO", &qo, &doo, &kpo, &vpo, &ko, &lo_, &dvo, &scale, &ovo, &oqo, &oko, &so))
        return NULL;
    pair_backward_fn fn = PATHS[current].pair_backward;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[11];
    memset(v, 0, sizeof v);
    Py_ssize_t qr, dim, ldq, dr, dv, ldd, kpr, kpw, ldkp, vpr, vpw, ldvp, kr, kc, ldk, vr_, vc, ldov, qr2, qc2, ldoq,
        kr2, kc2, ldok;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &qr, &dim, &ldq) < 0) return NULL;
    if (get2d(doo, &v[1], 0, &dr, &dv, &ldd) < 0 || get2d(kpo, &v[2], 0, &kpr, &kpw, &ldkp) < 0 ||
        get2d(vpo, &v[3], 0, &vpr, &vpw, &ldvp) < 0 || get2d(ko, &v[4], 0, &kr, &kc, &ldk) < 0 ||
        get2d(ovo, &v[7], 1, &vr_, &vc, &ldov) < 0 || get2d(oqo, &v[8], 1, &qr2, &qc2, &ldoq) < 0 ||
        get2d(oko, &v[9], 1, &kr2, &kc2, &ldok) < 0)
        goto done;
    const Py_ssize_t t = kr;
    if (t < 1 || t % 32 || dim < 1 || dv < 1 || ldq != dim || ldd != dv || qr % t || dr != qr || kc != dim ||
        ldk != dim || kpw != 32 || ldkp != 32 || kpr != t / 32 * dim || vpw != 32 || ldvp != 32 ||
        vpr != t / 32 * dv || vr_ != qr || vc != dv || ldov != dv || qr2 != qr || qc2 != dim || ldoq != dim ||
        kr2 != qr || kc2 != dim || ldok != dim) {
        PyErr_SetString(PyExc_ValueError, "pair_backward: operand shapes do not match");
        goto done;
    }
    if (get1d(lo_, &v[5], "f", qr, 0, "lse") < 0 || get1d(dvo, &v[6], "f", qr, 0, "dvec") < 0 ||
        get1d(so, &v[10], "f", qr, 1, "sums") < 0)
        goto done;
    if (!v[5].buf || !v[6].buf || !v[10].buf) {
        PyErr_SetString(PyExc_ValueError, "pair_backward: lse, dvec and sums are required");
        goto done;
    }
    const Py_ssize_t bq = PATHS[current].bq, wmax = dim > dv ? dim : dv, wp = (wmax + 15) / 16 * 16;
    CALL_WITH_SCRATCH(out, 2 * t * t + bq * wmax + bq * t + 2 * t * wp + 16,
                      fn((const float *)v[0].buf, (const float *)v[1].buf, qr / t, t, dim, dv, (const float *)v[2].buf,
                         (const float *)v[3].buf, (const float *)v[4].buf, (const float *)v[5].buf,
                         (const float *)v[6].buf, scale, (float *)v[7].buf, (float *)v[8].buf, (float *)v[9].buf,
                         (float *)v[10].buf, scratch));
done:
    release(v, 11);
    return out;
}

/* pair_products(a, b, out, trans): a (n * t, t), b (n * t, w) or (t, w) (one b for every pair),
 * out (n * t, w), each C-contiguous: out[j] = a[j] b[j] (trans 0) or a[j]^T b[j] (trans 1) per pair
 * of t rows (block_rows.h's pair_products) */
static PyObject *py_pair_products(PyObject *self, PyObject *args)
{
    PyObject *ao, *bo, *oo;
    int trans;
    if (!PyArg_ParseTuple(args, "OOOp", &ao, &bo, &oo, &trans)) return NULL;
    pair_products_fn fn = PATHS[current].pair_products;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    Py_ssize_t ar, t, lda, br, w, ldb, orow, ow, ldo;
    PyObject *out = NULL;
    if (get2d(ao, &v[0], 0, &ar, &t, &lda) < 0) return NULL;
    if (get2d(bo, &v[1], 0, &br, &w, &ldb) < 0) goto done;
    if (get2d(oo, &v[2], 1, &orow, &ow, &ldo) < 0) goto done;
    if (t < 1 || w < 1 || lda != t || ldb != w || ldo != w || ar % t || orow != ar || ow != w ||
        (br != ar && br != t)) {
        PyErr_SetString(PyExc_ValueError, "pair_products: operand shapes do not match");
        goto done;
    }
    const Py_ssize_t n = ar / t, wp = (w + 15) / 16 * 16;
    CALL_WITH_SCRATCH(out, 2 * t * wp + 16,
                      fn((const float *)v[0].buf, n, t, (const float *)v[1].buf, br == ar && n > 1 ? t * w : 0, w,
                         (float *)v[2].buf, trans, scratch));
done:
    release(v, 3);
    return out;
}

/* bwd_chunk(q, do, k, v, lse, dvec, dq, dk, dv, scale, lo, hi, kvpos[, seg_q, seg_kv, softcap, alibi, dropout]) */
static PyObject *py_bwd_chunk(PyObject *self, PyObject *args)
{
    PyObject *qo, *doo, *ko, *vo, *lseo, *dveco, *dqo, *dko, *dvo, *loo, *hio, *kvo, *sqo = Py_None, *sko = Py_None,
             *alo = Py_None, *aqo = Py_None, *ako = Py_None, *dro = Py_None;
    float scale, cap = 0.0f, slope = 0.0f;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOfOOO|OOfOO", &qo, &doo, &ko, &vo, &lseo, &dveco, &dqo, &dko, &dvo, &scale,
                          &loo, &hio, &kvo, &sqo, &sko, &cap, &alo, &dro))
        return NULL;
    if (alo != Py_None && !PyArg_ParseTuple(alo, "fOO", &slope, &aqo, &ako)) return NULL;
    bwd_chunk_fn fn = PATHS[current].bwd_chunk;
    if (!has_block_op(fn)) return NULL;
    Py_buffer v[18];
    memset(v, 0, sizeof v);
    Py_ssize_t nq, dim, ldq, r1, dvd, lddo, nk, c2, ldk, r3, c3, ldv, r4, c4, lddq, r5, c5, lddk, r6, c6, lddv;
    PyObject *out = NULL;
    if (get2d(qo, &v[0], 0, &nq, &dim, &ldq) < 0) return NULL;
    if (get2d(doo, &v[1], 0, &r1, &dvd, &lddo) < 0 || get2d(ko, &v[2], 0, &nk, &c2, &ldk) < 0 ||
        get2d(vo, &v[3], 0, &r3, &c3, &ldv) < 0 || get2d(dqo, &v[4], 1, &r4, &c4, &lddq) < 0 ||
        get2d(dko, &v[5], 1, &r5, &c5, &lddk) < 0 || get2d(dvo, &v[6], 1, &r6, &c6, &lddv) < 0)
        goto done;
    if (r1 != nq || c2 != dim || r3 != nk || c3 != dvd || r4 != nq || c4 != dim || r5 != nk || c5 != dim ||
        r6 != nk || c6 != dvd || nk < 1) {
        PyErr_SetString(PyExc_ValueError, "bwd_chunk: operand shapes do not match");
        goto done;
    }
    if (get1d(lseo, &v[7], "f", nq, 0, "lse") < 0 || get1d(dveco, &v[8], "f", nq, 0, "dvec") < 0) goto done;
    if (!v[7].buf || !v[8].buf) {
        PyErr_SetString(PyExc_ValueError, "bwd_chunk: lse and dvec are required");
        goto done;
    }
    ChunkMask mk;
    ScoreMods md;
    DropoutRow dr;
    if (get_chunk_terms("bwd_chunk", nq, nk, loo, hio, kvo, sqo, sko, cap, slope, aqo, ako, dro, &v[9], &mk, &md,
                        &dr) < 0)
        goto done;
    const Py_ssize_t bq = PATHS[current].bq, kbp = (nk + 31) / 32 * 32, dpd = (dim + 15) / 16 * 16,
                     dpv = (dvd + 15) / 16 * 16;
    CALL_WITH_SCRATCH(out, kbp * (dim + dvd + 2 * dpd + dpv) + bq * (3 * kbp + 2 * dpd + dpv),
                      fn((const float *)v[0].buf, ldq, (const float *)v[1].buf, lddo, nq, dim, dvd,
                         (const float *)v[2].buf, ldk, (const float *)v[3].buf, ldv, nk, (const float *)v[7].buf,
                         (const float *)v[8].buf, (float *)v[4].buf, lddq, (float *)v[5].buf, lddk, (float *)v[6].buf,
                         lddv, scale, &md, &mk, &dr, scratch));
done:
    release(v, 18);
    return out;
}

/* ------------------------------------------------------------------ the rules of kernels/rules.h
 * Each entry point runs one rule of rules.h over a block of (query, key) positions, into a C-contiguous
 * output the caller allocates: the NumPy backend's masks, dropout and ALiBi terms are these. */

/* a C-contiguous buffer of `n` items of `format` (None -> buf NULL when `optional`) */
static int get_items(PyObject *obj, Py_buffer *view, const char *format, Py_ssize_t n, int writable, int optional,
                const char *what)
{
    if (obj == Py_None && optional) { view->obj = NULL; view->buf = NULL; return 0; }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (strcmp(view->format, format) != 0 || view->len != n * view->itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous array of %zd items of format %s", what, n, format);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* the length of a 1-D int64 array */
static Py_ssize_t positions(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->ndim != 1 || strcmp(view->format, "l") != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous 1-D int64 array", what);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return view->shape[0];
}

/* a rule's block: q_pos and kv_pos (1-D int64, nq and nk long) into pos[0] and pos[1], and out (nq * nk
 * writable items of `format`) into *out_view; -1 with the error set (the caller releases the views) */
static int rule_block(PyObject *qo, PyObject *ko, PyObject *oo, const char *format, Py_buffer pos[2],
                      Py_buffer *out_view, Py_ssize_t *nq, Py_ssize_t *nk)
{
    if ((*nq = positions(qo, &pos[0], "q_pos")) < 0 || (*nk = positions(ko, &pos[1], "kv_pos")) < 0) return -1;
    return get_items(oo, out_view, format, *nq * *nk, 1, 0, "out");
}

/* out[i * nk + j] = RULE (an expression in query i and key j) over the block, the GIL released: RULE
 * reads only the C values its entry point set up */
#define EACH_PAIR(type, out, nq, nk, RULE)                                                                   \
    do {                                                                                                    \
        type *const pair_out_ = (type *)(out);                                                              \
        Py_BEGIN_ALLOW_THREADS                                                                              \
        for (Py_ssize_t i = 0; i < (nq); i++)                                                               \
            for (Py_ssize_t j = 0; j < (nk); j++) pair_out_[i * (nk) + j] = (RULE);                         \
        Py_END_ALLOW_THREADS                                                                                \
    } while (0)

/* visible(q_pos, kv_pos, seg_q, seg_kv, has_lo, lo_delta, has_hi, hi_delta, out): out[i, j] =
 * elem_visible of query i and key j (seg_q, seg_kv: one batch entry's ids, or None) */
static PyObject *py_visible(PyObject *self, PyObject *args)
{
    PyObject *qo, *ko, *sqo, *sko, *oo;
    int has_lo, has_hi;
    long long lo_delta, hi_delta;
    if (!PyArg_ParseTuple(args, "OOOOiLiLO", &qo, &ko, &sqo, &sko, &has_lo, &lo_delta, &has_hi, &hi_delta, &oo))
        return NULL;
    Py_buffer v[5];
    memset(v, 0, sizeof v);
    PyObject *out = NULL;
    Py_ssize_t nq, nk;
    if (rule_block(qo, ko, oo, "?", v, &v[4], &nq, &nk) < 0) goto done;
    if ((sqo == Py_None) != (sko == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "visible: seg_q and seg_kv go together");
        goto done;
    }
    if (get_items(sqo, &v[2], "l", nq, 0, 1, "seg_q") < 0 || get_items(sko, &v[3], "l", nk, 0, 1, "seg_kv") < 0)
        goto done;
    if (nq > INT_MAX || nk > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "visible: a block of at most 2^31 - 1 rows and columns");
        goto done;
    }
    MaskArgs mk;
    memset(&mk, 0, sizeof mk);
    mk.q_pos = (const long long *)v[0].buf;
    mk.kv_pos = (const long long *)v[1].buf;
    mk.seg_q = (const long long *)v[2].buf;
    mk.seg_kv = (const long long *)v[3].buf;
    mk.has_lo = has_lo, mk.lo_delta = lo_delta, mk.has_hi = has_hi, mk.hi_delta = hi_delta;
    EACH_PAIR(bool, v[4].buf, nq, nk, elem_visible(mk, 0, (int)i, (int)j, (int)nq, (int)nk));
    out = Py_None;
    Py_INCREF(out);
done:
    release(v, 5);
    return out;
}

/* classify(q_bounds, kv_bounds, nqt, nkt, batch, has_seg, has_lo, lo_delta, has_hi, hi_delta, out): out
 * ((batch if has_seg else 1), nqt, nkt) int8 = classify_tile of each tile (bounds: masks.tile_bounds) */
static PyObject *py_classify(PyObject *self, PyObject *args)
{
    PyObject *qo, *ko, *oo;
    int nqt, nkt, batch, has_seg, has_lo, has_hi;
    long long lo_delta, hi_delta;
    if (!PyArg_ParseTuple(args, "OOiiiiiLiLO", &qo, &ko, &nqt, &nkt, &batch, &has_seg, &has_lo, &lo_delta, &has_hi,
                          &hi_delta, &oo))
        return NULL;
    if (nqt < 0 || nkt < 0 || batch < 1) {
        PyErr_SetString(PyExc_ValueError, "classify: tile counts >= 0 and batch >= 1");
        return NULL;
    }
    const Py_ssize_t entries = has_seg ? batch : 1;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    PyObject *out = NULL;
    if (get_items(qo, &v[0], "l", 2 * (Py_ssize_t)nqt * (1 + (has_seg ? batch : 0)), 0, 0, "q_bounds") < 0 ||
        get_items(ko, &v[1], "l", 2 * (Py_ssize_t)nkt * (1 + (has_seg ? batch : 0)), 0, 0, "kv_bounds") < 0 ||
        get_items(oo, &v[2], "b", entries * nqt * nkt, 1, 0, "out") < 0)
        goto done;
    static const long long no_segments = 0;
    MaskArgs mk;
    memset(&mk, 0, sizeof mk);
    mk.q_bounds = (const long long *)v[0].buf;
    mk.kv_bounds = (const long long *)v[1].buf;
    mk.seg_q = has_seg ? &no_segments : 0; /* classify_tile asks only whether there are segment ids */
    mk.has_lo = has_lo, mk.lo_delta = lo_delta, mk.has_hi = has_hi, mk.hi_delta = hi_delta;
    signed char *cls = (signed char *)v[2].buf;
    for (Py_ssize_t b = 0; b < entries; b++)
        for (int qt = 0; qt < nqt; qt++)
            for (int kt = 0; kt < nkt; kt++)
                cls[(b * nqt + qt) * nkt + kt] = (signed char)classify_tile(mk, (int)b, batch, qt, nqt, kt, nkt);
    out = Py_None;
    Py_INCREF(out);
done:
    release(v, 3);
    return out;
}

/* dropout_keep(q_pos, kv_pos, k0, k1, threshold, heads, batch_offset, head_offset, b, h, out): out[i, j]
 * = dropout_keep of query head h of batch entry b at query i, key j */
static PyObject *py_dropout_keep(PyObject *self, PyObject *args)
{
    PyObject *qo, *ko, *oo;
    unsigned int k0, k1;
    unsigned long long threshold;
    long long heads, b0, h0;
    int b, h;
    if (!PyArg_ParseTuple(args, "OOIIKLLLiiO", &qo, &ko, &k0, &k1, &threshold, &heads, &b0, &h0, &b, &h, &oo))
        return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    PyObject *out = NULL;
    Py_ssize_t nq, nk;
    if (rule_block(qo, ko, oo, "?", v, &v[2], &nq, &nk) < 0) goto done;
    DropoutArgs dr;
    dr.on = 1, dr.k0 = k0, dr.k1 = k1, dr.threshold = threshold;
    dr.heads = heads, dr.batch_offset = b0, dr.head_offset = h0;
    const long long *qp = (const long long *)v[0].buf, *kp = (const long long *)v[1].buf;
    EACH_PAIR(bool, v[2].buf, nq, nk, dropout_keep(dr, b, h, qp[i], kp[j]));
    out = Py_None;
    Py_INCREF(out);
done:
    release(v, 3);
    return out;
}

/* alibi_terms(q_pos, kv_pos, offset, slope, out): out[i, j] = ALiBi's additive term of query i, key j in
 * out's type (float32 or float64): alibi_score of the score -0.0, which is -slope * |i + offset - j| with
 * the sign of its zero as NumPy's (dist * -slope) has it, so s + term == alibi_score(s) bit for bit */
static PyObject *py_alibi_terms(PyObject *self, PyObject *args)
{
    PyObject *qo, *ko, *oo;
    long long offset;
    double slope;
    if (!PyArg_ParseTuple(args, "OOLdO", &qo, &ko, &offset, &slope, &oo)) return NULL;
    Py_buffer v[3];
    memset(v, 0, sizeof v);
    PyObject *out = NULL;
    const int f64 = PyObject_GetBuffer(oo, &v[2], PyBUF_FORMAT) == 0 && strcmp(v[2].format, "d") == 0;
    if (v[2].obj) { PyBuffer_Release(&v[2]); v[2].obj = NULL; }
    PyErr_Clear();
    Py_ssize_t nq, nk;
    if (rule_block(qo, ko, oo, f64 ? "d" : "f", v, &v[2], &nq, &nk) < 0) goto done;
    const long long *qp = (const long long *)v[0].buf, *kp = (const long long *)v[1].buf;
    const float slope_f = (float)slope;
    if (f64)
        EACH_PAIR(double, v[2].buf, nq, nk, alibi_score_d(slope, qp[i], kp[j], offset, -0.0));
    else
        EACH_PAIR(float, v[2].buf, nq, nk, alibi_score_f(slope_f, qp[i], kp[j], offset, -0.0f));
    out = Py_None;
    Py_INCREF(out);
done:
    release(v, 3);
    return out;
}

/* softcap(s, cap, slope): s = softcap_score(s) in place, float32 or float64 (C-contiguous); slope, a
 * same-shape array or None, receives the derivative */
static PyObject *py_softcap(PyObject *self, PyObject *args)
{
    PyObject *so, *do_;
    double cap;
    if (!PyArg_ParseTuple(args, "OdO", &so, &cap, &do_)) return NULL;
    Py_buffer v[2];
    memset(v, 0, sizeof v);
    PyObject *out = NULL;
    if (PyObject_GetBuffer(so, &v[0], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return NULL;
    const int f64 = strcmp(v[0].format, "d") == 0;
    if (!f64 && strcmp(v[0].format, "f") != 0) {
        PyErr_SetString(PyExc_ValueError, "softcap: s must be float32 or float64");
        goto done;
    }
    const Py_ssize_t n = v[0].len / v[0].itemsize;
    if (get_items(do_, &v[1], f64 ? "d" : "f", n, 1, 1, "slope") < 0) goto done;
    if (f64) {
        double *s = (double *)v[0].buf, *d = (double *)v[1].buf, scratch;
        for (Py_ssize_t i = 0; i < n; i++) s[i] = softcap_score_d(s[i], cap, d ? &d[i] : &scratch);
    } else {
        float *s = (float *)v[0].buf, *d = (float *)v[1].buf, scratch;
        for (Py_ssize_t i = 0; i < n; i++) s[i] = softcap_score_f(s[i], (float)cap, d ? &d[i] : &scratch);
    }
    out = Py_None;
    Py_INCREF(out);
done:
    release(v, 2);
    return out;
}

/* philox_word0(c0, c1, c2, c3, k0, k1): word 0 of Philox 4x32-10 (rules.h) of one counter and key */
static PyObject *py_philox_word0(PyObject *self, PyObject *args)
{
    unsigned int c0, c1, c2, c3, k0, k1;
    if (!PyArg_ParseTuple(args, "IIIIII", &c0, &c1, &c2, &c3, &k0, &k1)) return NULL;
    return PyLong_FromUnsignedLong(philox4x32_10_word0(c0, c1, c2, c3, k0, k1));
}

static PyObject *py_has_block(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(PATHS[current].fwd_chunk != NULL);
}

#define PATHS_OF "the tile pass"
#include "vector_paths.h"

/* ------------------------------------------------------------------ the FMA peak
 * A loop of PEAK_CHAINS independent multiply-adds per vector width (the core's float32 peak:
 * what the benchmark judges every result against).  avx512: 512-bit FMAs, avx2: 256-bit
 * FMAs, plain: 128-bit FMAs where the plain path runs its FMA build (plainfma: the CPU has
 * FMA), else 128-bit multiplies and adds (2 FLOPs per lane per pair: the baseline has no
 * FMA).  Returns the seconds of `iters` rounds; a round is PEAK_CHAINS vectors x 2 FLOPs x width. */
#define PEAK_CHAINS 12
static volatile float peak_sink;

static double now_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#ifdef X86_PATHS
__attribute__((target("avx512f"))) static void peak_avx512(long iters)
{
    __m512 acc[PEAK_CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    }
    float sum = 0;
    for (int c = 0; c < PEAK_CHAINS; c++) sum += _mm512_reduce_add_ps(acc[c]);
    peak_sink = sum;
}

__attribute__((target("avx2,fma"))) static void peak_avx2(long iters)
{
    __m256 acc[PEAK_CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    }
    float sum = 0;
    for (int c = 0; c < PEAK_CHAINS; c++)
        for (int lane = 0; lane < 8; lane++) sum += acc[c][lane];
    peak_sink = sum;
}

__attribute__((target("fma"))) static void peak_fma128(long iters)
{
    __m128 acc[PEAK_CHAINS];
    const __m128 a = _mm_set1_ps(0.999999f), b = _mm_set1_ps(1e-6f);
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm_set1_ps((float)c);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm_fmadd_ps(acc[c], a, b);
    }
    float sum = 0;
    for (int c = 0; c < PEAK_CHAINS; c++)
        for (int lane = 0; lane < 4; lane++) sum += acc[c][lane];
    peak_sink = sum;
}
#endif

static void peak_plain(long iters)
{
    typedef float v4 __attribute__((vector_size(16)));
    v4 acc[PEAK_CHAINS];
    const v4 a = (v4){0} + 0.999999f, b = (v4){0} + 1e-6f;
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = (v4){0} + (float)c;
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = acc[c] * a + b;
    }
    float sum = 0;
    for (int c = 0; c < PEAK_CHAINS; c++)
        for (int lane = 0; lane < 4; lane++) sum += acc[c][lane];
    peak_sink = sum;
}

static PyObject *py_fma_peak(PyObject *self, PyObject *args)
{
    const char *name;
    long iters;
    if (!PyArg_ParseTuple(args, "sl", &name, &iters)) return NULL;
    int saved = current;
    if (use_path(name) < 0) return NULL;
    int path = current;
    current = saved;
    void (*loop)(long) = peak_plain;
    int width = 4;
#ifdef X86_PATHS
    if (PATHS[path].exp_rows == exp_rows_avx512) loop = peak_avx512, width = 16;
    if (PATHS[path].exp_rows == exp_rows_avx2) loop = peak_avx2, width = 8;
    if (PATHS[path].exp_rows == exp_rows_plainfma) loop = peak_fma128;
#endif
    double seconds;
    Py_BEGIN_ALLOW_THREADS
    double start = now_seconds();
    loop(iters);
    seconds = now_seconds() - start;
    Py_END_ALLOW_THREADS
    return Py_BuildValue("dd", seconds, 2.0 * PEAK_CHAINS * width * (double)iters);
}

static PyMethodDef methods[] = {
    {"exp_tile", py_exp_tile, METH_VARARGS,
     "exp_tile(s, scale, bias, shift, sums=None): s = exp(s * scale + bias - shift[:, None]) in place, "
     "float32 (bias a same-shape array or None, shift a (rows,) array or None); sums, a (rows,) "
     "array, receives the rows' sums of the result"},
    {"ds_tile", py_ds_tile, METH_VARARGS,
     "ds_tile(dp, p, dvec): dp = (dp - dvec[:, None]) * p in place, float32, each step rounded"},
    {"paths", py_paths, METH_NOARGS, "paths(): the vector paths this CPU runs, best first ('avx512', 'avx2', 'plain')"},
    {"fwd_chunk", py_fwd_chunk, METH_VARARGS,
     "fwd_chunk(q, kp, vp, nk, o, m, l, scale, lo, hi, kvpos[, seg_q, seg_kv, softcap, alibi, dropout]): "
     "fold one packed key "
     "chunk into the online softmax state (o, m, l) of the query rows q (see block_rows.h; lo, hi, kvpos: int64 "
     "position bounds and key positions, or None; seg_q, seg_kv: int64 segment ids of the rows and keys, or None; "
     "softcap: the logit cap, 0 for none; alibi: None or (this head's slope, the rows' positions plus N_kv - N_q, "
     "the keys' positions), the positions float64; dropout: (k0, k1, row, threshold, "
     "rescale, q_pos, kv_pos) as rules.h's dropout_keep takes them, or None)"},
    {"scores", py_scores, METH_VARARGS,
     "scores(q, k, out): out = q k^T, float32, each score the block op's chain of fused multiply-adds"},
    {"scores_packed", py_scores_packed, METH_VARARGS,
     "scores_packed(q, kp, out, tile): out = q K^T as scores() gives it, the keys packed as fwd_chunk's kp; "
     "tile > 0: out (nk / tile * nq, tile), one (nq, tile) block per run of tile keys"},
    {"scores_max", py_scores_max, METH_VARARGS,
     "scores_max(q, kp, rowmax): rowmax = each row's largest score of q K^T (scores_packed's scores, none "
     "stored), K packed in whole panels; NaN where a row met one"},
    {"pair_forward", py_pair_forward, METH_VARARGS,
     "pair_forward(q, kp, v, shift, scale, out, sums): invariant=True's second pass over a stack of tile pairs of "
     "one query tile, fused: per pair its scores, exp(scale s - shift) with the row sums, and P V, bit for bit "
     "scores_packed, exp_tile and pair_products one after the other"},
    {"pair_backward", py_pair_backward, METH_VARARGS,
     "pair_backward(qs, dos, kp, vp, k, lse, dvec, scale, outv, outq, outk, sums): invariant=True's backward "
     "over a stack of tile pairs of one key tile, fused: per pair dV, dQ, dK partials and P's row sums, bit for "
     "bit the scores, exp, products and dS passes one after the other"},
    {"pair_products", py_pair_products, METH_VARARGS,
     "pair_products(a, b, out, trans): per pair of t rows, out[j] = a[j] b[j] (or a[j]^T b[j] with trans), "
     "a (n * t, t), b (n * t, w) or (t, w) shared, each element one chain of fused multiply-adds in order"},
    {"bwd_chunk", py_bwd_chunk, METH_VARARGS,
     "bwd_chunk(q, do, k, v, lse, dvec, dq, dk, dv, scale, lo, hi, kvpos[, seg_q, seg_kv, softcap, alibi, dropout]): "
     "add one key "
     "chunk's terms to dq and the chunk's dk, dv (FlashAttention-2 order, see block_rows.h; lse the forward's, "
     "+inf on rows that saw nothing; lo, hi, kvpos: int64 position bounds and key positions, or None; seg_q, "
     "seg_kv: int64 segment ids of the rows and keys, or None; softcap: the logit cap, 0 for none; alibi, "
     "dropout: as fwd_chunk's)"},
    {"visible", py_visible, METH_VARARGS,
     "visible(q_pos, kv_pos, seg_q, seg_kv, has_lo, lo_delta, has_hi, hi_delta, out): out (bool, (nq, nk)) = "
     "rules.h's elem_visible of each (query, key) (seg_q, seg_kv: one batch entry's int64 ids, or None)"},
    {"classify", py_classify, METH_VARARGS,
     "classify(q_bounds, kv_bounds, nqt, nkt, batch, has_seg, has_lo, lo_delta, has_hi, hi_delta, out): out (int8, "
     "(batch or 1, nqt, nkt)) = rules.h's classify_tile of each tile (bounds as masks.tile_bounds lays them out)"},
    {"dropout_keep", py_dropout_keep, METH_VARARGS,
     "dropout_keep(q_pos, kv_pos, k0, k1, threshold, heads, batch_offset, head_offset, b, h, out): out (bool, "
     "(nq, nk)) = rules.h's dropout_keep of each (query, key)"},
    {"alibi_terms", py_alibi_terms, METH_VARARGS,
     "alibi_terms(q_pos, kv_pos, offset, slope, out): out (float32 or float64, (nq, nk)) = ALiBi's additive term "
     "(rules.h's alibi_score of -0.0)"},
    {"softcap", py_softcap, METH_VARARGS,
     "softcap(s, cap, slope): s = cap tanh(s / cap) in place (rules.h's softcap_score), slope (or None) = "
     "its derivative"},
    {"philox_word0", py_philox_word0, METH_VARARGS,
     "philox_word0(c0, c1, c2, c3, k0, k1): word 0 of rules.h's Philox 4x32-10"},
    {"has_block", py_has_block, METH_NOARGS, "has_block(): whether the path in use has the compiled block op"},
    {"fma_peak", py_fma_peak, METH_VARARGS,
     "fma_peak(path, rounds): (seconds, FLOPs) of a loop of independent float32 multiply-adds at the "
     "vector width of ``path`` (the core's peak; the path in use is unchanged)"},
    {"path", py_path, METH_NOARGS, "path(): the vector path exp_tile runs"},
    {"use", py_use, METH_VARARGS, "use(name): exp_tile runs the vector path ``name`` (ValueError where this CPU cannot)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void)
{
    plain_uses_fma();
    use_widest();
    return PyModule_Create(&module);
}
