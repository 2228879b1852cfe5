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
 * addition makes the result independent of the order of the partials.
 *
 * The loop is compiled once per vector path -- avx512 (AVX-512F + DQ: vcvttpd2qq truncates
 * a double to int64), avx2 (four doubles a vector, int64 formed from the bits of exact doubles),
 * plain (scalar C for the baseline) -- each doing those same operations per element: the same
 * integers on every path.  paths() lists those this CPU runs, use() picks one; at import the
 * widest it runs, or the one RINGMPI_CPU_VECTOR pins (ValueError where this CPU cannot).
 *
 * The split's constants (the numbers above: 2^62, 2^92, 2^30 = 2^LIMB_BITS) are not written
 * here: setup.py passes ringmpi.core.fixed_split.c_defines() as -D defines, FIXED_LIMIT_1 and
 * FIXED_LIMIT_2 (the one- and two-word ranges), FIXED_LIMB and FIXED_LIMB_INV (2^LIMB_BITS and
 * its inverse, hexadecimal literals: exact) and FIXED_LIMB_BITS. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(FIXED_LIMIT_1) || !defined(FIXED_LIMIT_2) || !defined(FIXED_LIMB) || !defined(FIXED_LIMB_INV) \
    || !defined(FIXED_LIMB_BITS)
#error "the fixed-point split's constants come from ringmpi.core.fixed_split: build through setup.py"
#endif
#if FIXED_LIMB_BITS > 31
#error "the AVX2 path holds a low word in an int32 (two_avx2): LIMB_BITS must be at most 31"
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define X86_PATHS 1
#include <immintrin.h>
#endif

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

/* ------------------------------------------------------------------ the loops, per vector path
 * Every path does add_numpy's IEEE double operations per element: y = x widened, y *= rs (HR:
 * rows given), y *= cols[c] (HC: cols given), the range test |y| < 2^62 (2^92), y zeroed where
 * it fails (that element adds nothing, its row is flagged), then truncation toward zero (one
 * word), or hi = trunc(y 2^-30), lo = trunc(y - hi 2^30) (two words).  A missing factor is not
 * multiplied by (add_numpy skips it too).  HR and HC are constants where the kernels are inlined:
 * each combination is its own loop.  Sums wrap as uint64 (NumPy's int64 addition; a signed
 * overflow would be undefined in C), so the order of the additions does not matter either. */
#ifdef __GNUC__
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif
#define WRAP_ADD(p, v) (*(p) = (int64_t)((uint64_t) * (p) + (uint64_t)(v)))
#define SCALE(y, c) (HC ? (HR ? (y) * rs : (y)) * cols[c] : (HR ? (y) * rs : (y)))

/* one element, scalar (x86-64's cvttsd2si truncates to int64 in one instruction; elsewhere the
 * compiler may vectorise the loops) */
INLINE int one_plain(int64_t *o, double y)
{
    const int in = fabs(y) < FIXED_LIMIT_1; /* false for NaN */
    WRAP_ADD(o, (int64_t)(in ? y : 0.0));
    return !in;
}

/* hi = trunc(y 2^-30) as (int64)(y 2^-30) (|hi| < 2^62; that integer's double is exact) */
INLINE int two_plain(int64_t *o, int64_t *o2, double y)
{
    const int in = fabs(y) < FIXED_LIMIT_2;
    y = in ? y : 0.0;
    const int64_t hi = (int64_t)(y * FIXED_LIMB_INV);
    WRAP_ADD(o, hi);
    WRAP_ADD(o2, (int64_t)(y - (double)hi * FIXED_LIMB));
    return !in;
}

/* A row kernel adds one row of x (C elements) into out (one word: out[c]; two: out[c], out[C + c])
 * and returns nonzero when it flagged an element. */
#define ROW_ARGS(T) int64_t *restrict out, const T *restrict x, Py_ssize_t C, double rs, const double *restrict cols, \
                    const int HR, const int HC
#define ROWS_PLAIN(T)                                                                                    \
    INLINE int row1_plain_##T(ROW_ARGS(T))                                                               \
    {                                                                                                    \
        int bad = 0;                                                                                     \
        for (Py_ssize_t c = 0; c < C; c++) bad |= one_plain(out + c, SCALE((double)x[c], c));            \
        return bad;                                                                                      \
    }                                                                                                    \
    INLINE int row2_plain_##T(ROW_ARGS(T))                                                               \
    {                                                                                                    \
        int bad = 0;                                                                                     \
        for (Py_ssize_t c = 0; c < C; c++) bad |= two_plain(out + c, out + C + c, SCALE((double)x[c], c)); \
        return bad;                                                                                      \
    }
ROWS_PLAIN(float)
ROWS_PLAIN(double)

/* The vector paths, each from the same kernels (below) over its own few operations on a vector of
 * W doubles: dv (doubles), iv (int64), ok (the lanes in range so far):
 *   y_P_T(x, c, vr, cols, HR, HC)    y for columns c .. c + W - 1 (vr: rs in every lane)
 *   one_P(y, lim, &ok)               trunc(y) where in range, else 0 (and ok updated)
 *   two_P(y, lim, &ok, &hi, &lo)     the two words where in range, else 0
 *   iload_P, istore_P, iadd_P        int64 vectors (unaligned) */
#ifdef X86_PATHS
/* AVX-512 (F + DQ): eight doubles a vector; vcvttpd2qq truncates to int64, vcvtqq2pd converts an
 * integer back exactly */
#define ISA_avx512 __attribute__((target("avx512f,avx512dq")))
#define W_avx512 8
typedef __m512d dv_avx512;
typedef __m512i iv_avx512;
typedef __mmask8 ok_avx512;
ISA_avx512 INLINE __m512d set1_avx512(double v) { return _mm512_set1_pd(v); }
ISA_avx512 INLINE __mmask8 ok_init_avx512(void) { return 0xFF; }
ISA_avx512 INLINE int ok_all_avx512(__mmask8 ok) { return _cvtmask8_u32(ok) == 0xFF; }
ISA_avx512 INLINE __m512d scale_avx512(__m512d y, __m512d vr, const double *cols, Py_ssize_t c, const int HR,
                                       const int HC)
{
    if (HR) y = _mm512_mul_pd(y, vr);
    if (HC) y = _mm512_mul_pd(y, _mm512_loadu_pd(cols + c));
    return y;
}
ISA_avx512 INLINE __m512d y_avx512_float(const float *x, Py_ssize_t c, __m512d vr, const double *cols, const int HR,
                                         const int HC)
{
    return scale_avx512(_mm512_cvtps_pd(_mm256_loadu_ps(x + c)), vr, cols, c, HR, HC);
}
ISA_avx512 INLINE __m512d y_avx512_double(const double *x, Py_ssize_t c, __m512d vr, const double *cols,
                                          const int HR, const int HC)
{
    return scale_avx512(_mm512_loadu_pd(x + c), vr, cols, c, HR, HC);
}
ISA_avx512 INLINE __m512i one_avx512(__m512d y, __m512d lim, __mmask8 *ok)
{
    const __mmask8 in = _mm512_cmp_pd_mask(_mm512_abs_pd(y), lim, _CMP_LT_OQ);
    *ok = _kand_mask8(*ok, in);
    return _mm512_maskz_cvttpd_epi64(in, y);
}
ISA_avx512 INLINE void two_avx512(__m512d y, __m512d lim, __mmask8 *ok, __m512i *hi, __m512i *lo)
{
    const __mmask8 in = _mm512_cmp_pd_mask(_mm512_abs_pd(y), lim, _CMP_LT_OQ);
    *ok = _kand_mask8(*ok, in);
    y = _mm512_maskz_mov_pd(in, y);
    *hi = _mm512_cvttpd_epi64(_mm512_mul_pd(y, _mm512_set1_pd(FIXED_LIMB_INV)));
    *lo = _mm512_cvttpd_epi64(_mm512_sub_pd(y, _mm512_mul_pd(_mm512_cvtepi64_pd(*hi), _mm512_set1_pd(FIXED_LIMB))));
}
ISA_avx512 INLINE __m512i iload_avx512(const int64_t *p) { return _mm512_loadu_si512(p); }
ISA_avx512 INLINE void istore_avx512(int64_t *p, __m512i v) { _mm512_storeu_si512(p, v); }
ISA_avx512 INLINE __m512i iadd_avx512(__m512i a, __m512i b) { return _mm512_add_epi64(a, b); }

/* AVX2: four doubles a vector.  Without a double -> int64 conversion, an integer-valued t
 * (|t| < 2^62) becomes int64 through the exponent-bias trick: h = floor(t 2^-32) (|h| <= 2^30),
 * l = t - h 2^32 (exact, 0 <= l < 2^32); h + 1.5 2^52 and l + 2^52 are exact and hold h mod 2^32
 * and l in the low 32 bits of their IEEE bits, so int64(t) is those of h shifted up 32 bits,
 * blended with those of l.  trunc(y) is that of y rounded toward zero. */
#define ISA_avx2 __attribute__((target("avx2")))
#define W_avx2 4
typedef __m256d dv_avx2;
typedef __m256i iv_avx2;
typedef __m256d ok_avx2;
ISA_avx2 INLINE __m256d set1_avx2(double v) { return _mm256_set1_pd(v); }
ISA_avx2 INLINE __m256d ok_init_avx2(void) { return _mm256_castsi256_pd(_mm256_set1_epi64x(-1)); }
ISA_avx2 INLINE int ok_all_avx2(__m256d ok) { return _mm256_movemask_pd(ok) == 0xF; }
ISA_avx2 INLINE __m256d scale_avx2(__m256d y, __m256d vr, const double *cols, Py_ssize_t c, const int HR, const int HC)
{
    if (HR) y = _mm256_mul_pd(y, vr);
    if (HC) y = _mm256_mul_pd(y, _mm256_loadu_pd(cols + c));
    return y;
}
ISA_avx2 INLINE __m256d y_avx2_float(const float *x, Py_ssize_t c, __m256d vr, const double *cols, const int HR,
                                     const int HC)
{
    return scale_avx2(_mm256_cvtps_pd(_mm_loadu_ps(x + c)), vr, cols, c, HR, HC);
}
ISA_avx2 INLINE __m256d y_avx2_double(const double *x, Py_ssize_t c, __m256d vr, const double *cols, const int HR,
                                      const int HC)
{
    return scale_avx2(_mm256_loadu_pd(x + c), vr, cols, c, HR, HC);
}
ISA_avx2 INLINE __m256i int_avx2(__m256d t)
{
    const __m256d h = _mm256_round_pd(_mm256_mul_pd(t, _mm256_set1_pd(0x1p-32)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256d l = _mm256_sub_pd(t, _mm256_mul_pd(h, _mm256_set1_pd(0x1p32)));
    const __m256i hb = _mm256_castpd_si256(_mm256_add_pd(h, _mm256_set1_pd(0x1.8p52)));
    const __m256i lb = _mm256_castpd_si256(_mm256_add_pd(l, _mm256_set1_pd(0x1p52)));
    return _mm256_blend_epi32(_mm256_slli_epi64(hb, 32), lb, 0x55);
}
ISA_avx2 INLINE __m256d trunc_avx2(__m256d v) { return _mm256_round_pd(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
/* y and its lanes in range (all ones where |y| < lim; none for NaN) */
ISA_avx2 INLINE __m256d in_avx2(__m256d y, __m256d lim, __m256d *ok)
{
    const __m256d in = _mm256_cmp_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), y), lim, _CMP_LT_OQ);
    *ok = _mm256_and_pd(*ok, in);
    return in;
}
ISA_avx2 INLINE __m256i one_avx2(__m256d y, __m256d lim, __m256d *ok)
{
    return int_avx2(trunc_avx2(_mm256_and_pd(y, in_avx2(y, lim, ok))));
}
/* lo = trunc(y - hi 2^30), |lo| < 2^30: by vcvttpd2dq */
ISA_avx2 INLINE void two_avx2(__m256d y, __m256d lim, __m256d *ok, __m256i *hi, __m256i *lo)
{
    y = _mm256_and_pd(y, in_avx2(y, lim, ok));
    const __m256d h = trunc_avx2(_mm256_mul_pd(y, _mm256_set1_pd(FIXED_LIMB_INV)));
    *hi = int_avx2(h);
    *lo = _mm256_cvtepi32_epi64(_mm256_cvttpd_epi32(_mm256_sub_pd(y, _mm256_mul_pd(h, _mm256_set1_pd(FIXED_LIMB)))));
}
ISA_avx2 INLINE __m256i iload_avx2(const int64_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ISA_avx2 INLINE void istore_avx2(int64_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
ISA_avx2 INLINE __m256i iadd_avx2(__m256i a, __m256i b) { return _mm256_add_epi64(a, b); }

#define COUNT_FLAGGED(T)                                                                                 \
    /* how many of the N rows x[n * step : n * step + C] hold an element beyond lim (or NaN) */           \
    static Py_ssize_t count_flagged_##T(const T *x, Py_ssize_t step, Py_ssize_t N, Py_ssize_t C, double rs, \
                                        const double *cols, int HR, int HC, double lim)                  \
    {                                                                                                    \
        Py_ssize_t count = 0;                                                                            \
        for (Py_ssize_t n = 0; n < N; n++)                                                               \
            for (Py_ssize_t c = 0; c < C; c++)                                                           \
                if (!(fabs(SCALE((double)x[n * step + c], c)) < lim)) {                                  \
                    count++;                                                                             \
                    break;                                                                               \
                }                                                                                        \
        return count;                                                                                    \
    }
COUNT_FLAGGED(float)
COUNT_FLAGGED(double)

/* the kernels of a vector path P, for partials of type T:
 *   row1/row2  one row into out, the row's tail (C % W) scalar;
 *   sum1/sum2  every partial into one slot (A == 1, no index): for each row, column blocks held in
 *              registers across the N partials, so the slot is loaded and stored once a call. */
#define VECTOR_KERNELS(P, T)                                                                             \
    ISA_##P INLINE int row1_##P##_##T(ROW_ARGS(T))                                                       \
    {                                                                                                    \
        const dv_##P vr = set1_##P(rs), lim = set1_##P(FIXED_LIMIT_1);                                   \
        ok_##P ok = ok_init_##P();                                                                       \
        Py_ssize_t c = 0;                                                                                \
        _Pragma("GCC unroll 4")                                                                          \
        for (; c + W_##P <= C; c += W_##P)                                                               \
            istore_##P(out + c, iadd_##P(iload_##P(out + c), one_##P(y_##P##_##T(x, c, vr, cols, HR, HC), lim, &ok))); \
        int bad = !ok_all_##P(ok);                                                                       \
        for (; c < C; c++) bad |= one_plain(out + c, SCALE((double)x[c], c));                            \
        return bad;                                                                                      \
    }                                                                                                    \
    ISA_##P INLINE int row2_##P##_##T(ROW_ARGS(T))                                                       \
    {                                                                                                    \
        const dv_##P vr = set1_##P(rs), lim = set1_##P(FIXED_LIMIT_2);                                   \
        ok_##P ok = ok_init_##P();                                                                       \
        Py_ssize_t c = 0;                                                                                \
        _Pragma("GCC unroll 2")                                                                          \
        for (; c + W_##P <= C; c += W_##P) {                                                             \
            iv_##P hi, lo;                                                                               \
            two_##P(y_##P##_##T(x, c, vr, cols, HR, HC), lim, &ok, &hi, &lo);                            \
            istore_##P(out + c, iadd_##P(iload_##P(out + c), hi));                                       \
            istore_##P(out + C + c, iadd_##P(iload_##P(out + C + c), lo));                               \
        }                                                                                                \
        int bad = !ok_all_##P(ok);                                                                       \
        for (; c < C; c++) bad |= two_plain(out + c, out + C + c, SCALE((double)x[c], c));               \
        return bad;                                                                                      \
    }                                                                                                    \
    ISA_##P INLINE Py_ssize_t sum1_##P##_##T(SUM_ARGS(T))                                                \
    {                                                                                                    \
        const dv_##P lim = set1_##P(FIXED_LIMIT_1);                                                      \
        const Py_ssize_t step = R * C;                                                                   \
        Py_ssize_t flagged = 0;                                                                          \
        for (Py_ssize_t r = 0; r < R; r++) {                                                             \
            const double rs = HR ? rows[r] : 1.0;                                                        \
            const dv_##P vr = set1_##P(rs);                                                              \
            int64_t *out = acc + r * sr;                                                                 \
            const T *xr = x + r * C;                                                                     \
            ok_##P ok = ok_init_##P();                                                                   \
            Py_ssize_t c = 0;                                                                            \
            for (; c + 4 * W_##P <= C; c += 4 * W_##P) {                                                 \
                iv_##P a0 = iload_##P(out + c), a1 = iload_##P(out + c + W_##P);                         \
                iv_##P a2 = iload_##P(out + c + 2 * W_##P), a3 = iload_##P(out + c + 3 * W_##P);         \
                for (Py_ssize_t n = 0; n < N; n++) {                                                     \
                    const T *xn = xr + n * step;                                                         \
                    a0 = iadd_##P(a0, one_##P(y_##P##_##T(xn, c, vr, cols, HR, HC), lim, &ok));          \
                    a1 = iadd_##P(a1, one_##P(y_##P##_##T(xn, c + W_##P, vr, cols, HR, HC), lim, &ok));  \
                    a2 = iadd_##P(a2, one_##P(y_##P##_##T(xn, c + 2 * W_##P, vr, cols, HR, HC), lim, &ok)); \
                    a3 = iadd_##P(a3, one_##P(y_##P##_##T(xn, c + 3 * W_##P, vr, cols, HR, HC), lim, &ok)); \
                }                                                                                        \
                istore_##P(out + c, a0);                                                                 \
                istore_##P(out + c + W_##P, a1);                                                         \
                istore_##P(out + c + 2 * W_##P, a2);                                                     \
                istore_##P(out + c + 3 * W_##P, a3);                                                     \
            }                                                                                            \
            for (; c + W_##P <= C; c += W_##P) {                                                         \
                iv_##P a0 = iload_##P(out + c);                                                          \
                for (Py_ssize_t n = 0; n < N; n++)                                                       \
                    a0 = iadd_##P(a0, one_##P(y_##P##_##T(xr + n * step, c, vr, cols, HR, HC), lim, &ok)); \
                istore_##P(out + c, a0);                                                                 \
            }                                                                                            \
            int row_bad = !ok_all_##P(ok);                                                               \
            for (; c < C; c++)                                                                           \
                for (Py_ssize_t n = 0; n < N; n++) row_bad |= one_plain(out + c, SCALE((double)xr[n * step + c], c)); \
            if (row_bad) {                                                                               \
                flagged += count_flagged_##T(xr, step, N, C, rs, cols, HR, HC, FIXED_LIMIT_1);           \
                if (bad) bad[r] = 1;                                                                     \
            }                                                                                            \
        }                                                                                                \
        return flagged;                                                                                  \
    }                                                                                                    \
    ISA_##P INLINE Py_ssize_t sum2_##P##_##T(SUM_ARGS(T))                                                \
    {                                                                                                    \
        const dv_##P lim = set1_##P(FIXED_LIMIT_2);                                                      \
        const Py_ssize_t step = R * C;                                                                   \
        Py_ssize_t flagged = 0;                                                                          \
        for (Py_ssize_t r = 0; r < R; r++) {                                                             \
            const double rs = HR ? rows[r] : 1.0;                                                        \
            const dv_##P vr = set1_##P(rs);                                                              \
            int64_t *out = acc + r * sr;                                                                 \
            const T *xr = x + r * C;                                                                     \
            ok_##P ok = ok_init_##P();                                                                   \
            Py_ssize_t c = 0;                                                                            \
            for (; c + 2 * W_##P <= C; c += 2 * W_##P) {                                                 \
                iv_##P h0 = iload_##P(out + c), h1 = iload_##P(out + c + W_##P);                         \
                iv_##P l0 = iload_##P(out + C + c), l1 = iload_##P(out + C + c + W_##P);                 \
                for (Py_ssize_t n = 0; n < N; n++) {                                                     \
                    const T *xn = xr + n * step;                                                         \
                    iv_##P hi, lo;                                                                       \
                    two_##P(y_##P##_##T(xn, c, vr, cols, HR, HC), lim, &ok, &hi, &lo);                   \
                    h0 = iadd_##P(h0, hi);                                                               \
                    l0 = iadd_##P(l0, lo);                                                               \
                    two_##P(y_##P##_##T(xn, c + W_##P, vr, cols, HR, HC), lim, &ok, &hi, &lo);           \
                    h1 = iadd_##P(h1, hi);                                                               \
                    l1 = iadd_##P(l1, lo);                                                               \
                }                                                                                        \
                istore_##P(out + c, h0);                                                                 \
                istore_##P(out + c + W_##P, h1);                                                         \
                istore_##P(out + C + c, l0);                                                             \
                istore_##P(out + C + c + W_##P, l1);                                                     \
            }                                                                                            \
            for (; c + W_##P <= C; c += W_##P) {                                                         \
                iv_##P h0 = iload_##P(out + c), l0 = iload_##P(out + C + c);                             \
                for (Py_ssize_t n = 0; n < N; n++) {                                                     \
                    iv_##P hi, lo;                                                                       \
                    two_##P(y_##P##_##T(xr + n * step, c, vr, cols, HR, HC), lim, &ok, &hi, &lo);        \
                    h0 = iadd_##P(h0, hi);                                                               \
                    l0 = iadd_##P(l0, lo);                                                               \
                }                                                                                        \
                istore_##P(out + c, h0);                                                                 \
                istore_##P(out + C + c, l0);                                                             \
            }                                                                                            \
            int row_bad = !ok_all_##P(ok);                                                               \
            for (; c < C; c++)                                                                           \
                for (Py_ssize_t n = 0; n < N; n++)                                                       \
                    row_bad |= two_plain(out + c, out + C + c, SCALE((double)xr[n * step + c], c));      \
            if (row_bad) {                                                                               \
                flagged += count_flagged_##T(xr, step, N, C, rs, cols, HR, HC, FIXED_LIMIT_2);           \
                if (bad) bad[r] = 1;                                                                     \
            }                                                                                            \
        }                                                                                                \
        return flagged;                                                                                  \
    }
#define SUM_ARGS(T) int64_t *restrict acc, Py_ssize_t sr, const T *restrict x, Py_ssize_t N, Py_ssize_t R, \
                    Py_ssize_t C, const double *restrict rows, const double *restrict cols, unsigned char *bad, \
                    const int HR, const int HC
VECTOR_KERNELS(avx512, float)
VECTOR_KERNELS(avx512, double)
VECTOR_KERNELS(avx2, float)
VECTOR_KERNELS(avx2, double)
#endif

/* ------------------------------------------------------------------ the partials' loop
 * acc[slot(n)][r] += row(x[n][r]) for every partial n and row r, or a vector path's sum kernel
 * where every partial goes to one slot; one loop per combination of rows/cols given.  Returns
 * the rows flagged (partial n's row r counts once, as in add_numpy). */
#define LOOP(ROW, HR, HC)                                                                                \
    for (Py_ssize_t n = 0; n < N; n++) {                                                                 \
        const Py_ssize_t slot = index ? (Py_ssize_t)index[n] : (A == N ? n : 0);                         \
        for (Py_ssize_t r = 0; r < R; r++) {                                                             \
            if (ROW(acc + slot * sa + r * sr, x + (n * R + r) * C, C, HR ? rows[slot * R + r] : 1.0, cols, HR, HC)) { \
                flagged++;                                                                               \
                if (bad) bad[slot * R + r] = 1;                                                          \
            }                                                                                            \
        }                                                                                                \
    }
#define SUM(KERNEL, HR, HC) flagged = KERNEL(acc, sr, x, N, R, C, rows, cols, bad, HR, HC);
#define BY_FACTORS(M, K)                                                                                 \
    if (rows && cols) {                                                                                  \
        M(K, 1, 1)                                                                                       \
    } else if (rows) {                                                                                   \
        M(K, 1, 0)                                                                                       \
    } else if (cols) {                                                                                   \
        M(K, 0, 1)                                                                                       \
    } else {                                                                                             \
        M(K, 0, 0)                                                                                       \
    }
#define DRIVE_ARGS int64_t *acc, Py_ssize_t sa, Py_ssize_t sr, const void *xv, Py_ssize_t N, Py_ssize_t R, \
                   Py_ssize_t C, Py_ssize_t A, const int64_t *index, const double *rows, const double *cols, \
                   unsigned char *bad
typedef Py_ssize_t (*drive_fn)(DRIVE_ARGS);

#define DRIVE_PLAIN(NAME, T, ROW)                                                                        \
    static Py_ssize_t NAME(DRIVE_ARGS)                                                                   \
    {                                                                                                    \
        const T *x = (const T *)xv;                                                                      \
        Py_ssize_t flagged = 0;                                                                          \
        BY_FACTORS(LOOP, ROW)                                                                            \
        return flagged;                                                                                  \
    }
DRIVE_PLAIN(one_plain_float, float, row1_plain_float)
DRIVE_PLAIN(one_plain_double, double, row1_plain_double)
DRIVE_PLAIN(two_plain_float, float, row2_plain_float)
DRIVE_PLAIN(two_plain_double, double, row2_plain_double)

#ifdef X86_PATHS
/* rows narrower than a vector take the scalar loop (the vector loop's tests would only cost); the
 * sum kernels run on AVX-512 (with AVX2's 16 registers they measured no faster than the rows) */
#define SUMS_avx512 1
#define SUMS_avx2 0
#define DRIVE_VECTOR(NAME, P, T, ROW, SUM_KERNEL, PLAIN)                                                 \
    ISA_##P static Py_ssize_t NAME(DRIVE_ARGS)                                                           \
    {                                                                                                    \
        if (C < W_##P) return PLAIN(acc, sa, sr, xv, N, R, C, A, index, rows, cols, bad);                \
        const T *x = (const T *)xv;                                                                      \
        Py_ssize_t flagged = 0;                                                                          \
        if (SUMS_##P && !index && A == 1 && N > 1) {                                                     \
            BY_FACTORS(SUM, SUM_KERNEL)                                                                  \
        } else {                                                                                         \
            BY_FACTORS(LOOP, ROW)                                                                        \
        }                                                                                                \
        return flagged;                                                                                  \
    }
#define DRIVES(P)                                                                                        \
    DRIVE_VECTOR(one_##P##_float, P, float, row1_##P##_float, sum1_##P##_float, one_plain_float)         \
    DRIVE_VECTOR(one_##P##_double, P, double, row1_##P##_double, sum1_##P##_double, one_plain_double)    \
    DRIVE_VECTOR(two_##P##_float, P, float, row2_##P##_float, sum2_##P##_float, two_plain_float)         \
    DRIVE_VECTOR(two_##P##_double, P, double, row2_##P##_double, sum2_##P##_double, two_plain_double)
DRIVES(avx512)
DRIVES(avx2)
#endif

/* the paths, widest first: [limbs - 1][x is float64] */
static const struct {
    const char *name;
    drive_fn fn[2][2];
} PATHS[] = {
#ifdef X86_PATHS
    {"avx512", {{one_avx512_float, one_avx512_double}, {two_avx512_float, two_avx512_double}}},
    {"avx2", {{one_avx2_float, one_avx2_double}, {two_avx2_float, two_avx2_double}}},
#endif
    {"plain", {{one_plain_float, one_plain_double}, {two_plain_float, two_plain_double}}},
};
#define N_PATHS ((int)(sizeof PATHS / sizeof PATHS[0]))

static int cpu_runs(int i)
{
#ifdef X86_PATHS
    __builtin_cpu_init();
    if (PATHS[i].fn[0][0] == one_avx512_float)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    if (PATHS[i].fn[0][0] == one_avx2_float) return __builtin_cpu_supports("avx2");
#endif
    (void)i;
    return 1; /* the baseline */
}

static int current = -1; /* index into PATHS, set at import */

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
        Py_BEGIN_ALLOW_THREADS
        flagged = PATHS[current].fn[limbs - 1][wide](acc, sa, sr, xv.buf, N, R, C, A, index, rows, cols, bad);
        Py_END_ALLOW_THREADS
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

#define PATHS_OF "the fixed-point sums"
#include "vector_paths.h"

/* the split's constants this build was compiled with (the tests hold them to fixed_split's) */
static PyObject *py_constants(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{sdsdsdsdsi}", "FIXED_LIMIT_1", FIXED_LIMIT_1, "FIXED_LIMIT_2", FIXED_LIMIT_2, "FIXED_LIMB",
                         FIXED_LIMB, "FIXED_LIMB_INV", FIXED_LIMB_INV, "FIXED_LIMB_BITS", FIXED_LIMB_BITS);
}

static PyMethodDef methods[] = {
    {"add", py_add, METH_VARARGS,
     "add(acc, x, rows, cols, index, bad, limbs): acc[slot] += trunc((x * rows) * cols) in int64 "
     "fixed point (see the module source); the order-free sums of invariant=True"},
    {"paths", py_paths, METH_NOARGS, "paths(): the vector paths this CPU runs, best first ('avx512', 'avx2', 'plain')"},
    {"path", py_path, METH_NOARGS, "path(): the vector path add runs"},
    {"use", py_use, METH_VARARGS, "use(name): add runs the vector path ``name`` (ValueError where this CPU cannot)"},
    {"constants", py_constants, METH_NOARGS,
     "constants(): the fixed-point split's -D defines this module was built with (ringmpi.core.fixed_split)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fixed", NULL, -1, methods};

/* the widest path the CPU runs, or the one RINGMPI_CPU_VECTOR pins (ValueError where it cannot) */
PyMODINIT_FUNC PyInit__fixed(void)
{
    use_widest();
    const char *pinned = getenv("RINGMPI_CPU_VECTOR");
    if (pinned && pinned[0] && use_path(pinned) < 0) return NULL;
    return PyModule_Create(&module);
}
