/* One vector path of the tile pass, included by fused.c once per path with
 *
 *   PATH      the path's name (a C token: plain, avx2, avx512)
 *   PATH_ISA  the function attribute that enables its instructions (empty for the baseline)
 *   VW        the lanes of one native vector: 4 (SSE2, NEON), 8 (AVX2), 16 (AVX-512)
 *   NB        native vectors whose exp is computed step by step together (a multiple of
 *             LANES / VW): NB independent chains in flight, what hides the latency
 *
 * The vector width is the only difference in the arithmetic: every element goes through the
 * same float32 operations (max/min pick, as x86's maxps/minps do, x when x is NaN), and a
 * row's sum adds vector k of columns into lane group k % (LANES / VW), so into the same 16
 * lanes in column order on every path. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, CAT(_, PATH))
#define VF CAT(vf, VW)
#define VI CAT(vi, VW)
#define VU CAT(vu, VW)
#define NVEC (LANES / VW)
#define PINLINE PATH_ISA static inline __attribute__((always_inline))

typedef float VF __attribute__((vector_size(VW * 4)));
typedef int32_t VI __attribute__((vector_size(VW * 4)));
typedef uint32_t VU __attribute__((vector_size(VW * 4)));
/* an unaligned float vector in memory (rows start anywhere; may alias the float arrays) */
typedef float CAT(VF, _mem) __attribute__((vector_size(VW * 4), aligned(4), may_alias));
#define LOAD(p) (*(const CAT(VF, _mem) *)(p))
#define STORE(p, v) (*(CAT(VF, _mem) *)(p) = (v))

PINLINE VF FN(bc)(float a) { return (VF){0} + a; }
PINLINE VU FN(bcu)(uint32_t a) { return (VU){0} + a; }
/* max(lo, x) and min(hi, x) as x86's maxps / minps order them: x where x is NaN */
#if defined(__SSE__) && VW == 4
PINLINE VF FN(max)(VF lo, VF x) { return (VF)_mm_max_ps((__m128)lo, (__m128)x); }
PINLINE VF FN(min)(VF hi, VF x) { return (VF)_mm_min_ps((__m128)hi, (__m128)x); }
#elif defined(X86_PATHS) && VW == 8
PINLINE VF FN(max)(VF lo, VF x) { return (VF)_mm256_max_ps((__m256)lo, (__m256)x); }
PINLINE VF FN(min)(VF hi, VF x) { return (VF)_mm256_min_ps((__m256)hi, (__m256)x); }
#elif defined(X86_PATHS) && VW == 16
PINLINE VF FN(max)(VF lo, VF x) { return (VF)_mm512_max_ps((__m512)lo, (__m512)x); }
PINLINE VF FN(min)(VF hi, VF x) { return (VF)_mm512_min_ps((__m512)hi, (__m512)x); }
#else
PINLINE VF FN(max)(VF lo, VF x) { VI m = lo > x; return (VF)(((VI)lo & m) | ((VI)x & ~m)); }
PINLINE VF FN(min)(VF hi, VF x) { VI m = hi < x; return (VF)(((VI)hi & m) | ((VI)x & ~m)); }
#endif

/* a vector of `a` in every lane, -0 kept (bc adds to a zero vector: -0 becomes +0), a broadcast
 * the compiler folds into the instruction that reads it */
#if defined(X86_PATHS) && VW == 16
PINLINE VF FN(splat)(float a) { return (VF)_mm512_set1_ps(a); }
#elif defined(X86_PATHS) && VW == 8
PINLINE VF FN(splat)(float a) { return (VF)_mm256_set1_ps(a); }
#elif defined(__SSE__) && VW == 4
PINLINE VF FN(splat)(float a) { return (VF)_mm_set1_ps(a); }
#else
PINLINE VF FN(splat)(float a)
{
    VF v;
    for (int lane = 0; lane < VW; lane++) v[lane] = a;
    return v;
}
#endif

/* the lanes' unsigned maximum */
#if defined(X86_PATHS) && VW == 8
PINLINE VU FN(umax)(VU a, VU b) { return (VU)_mm256_max_epu32((__m256i)a, (__m256i)b); }
#else
PINLINE VU FN(umax)(VU a, VU b) { VU m = (VU)(a > b); return (a & m) | (b & ~m); }
#endif

/* whether every lane of a comparison's result is true */
#if defined(X86_PATHS) && VW == 8
PINLINE int FN(all)(VI m) { return _mm256_movemask_ps((__m256)m) == 0xff; }
#elif defined(__SSE__) && VW == 4
PINLINE int FN(all)(VI m) { return _mm_movemask_ps((__m128)m) == 0xf; }
#else
PINLINE int FN(all)(VI m)
{
    int all = 1;
    for (int lane = 0; lane < VW; lane++) all &= m[lane] != 0;
    return all;
}
#endif

/* a * b + c rounded once (a fused multiply-add) on every path: the x86 paths' FMA instruction,
 * NEON's, else the C library's fmaf lane by lane (exact too, only slower) */
#if defined(X86_PATHS) && VW == 16
PINLINE VF FN(fma)(VF a, VF b, VF c) { return (VF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(X86_PATHS) && VW == 8
PINLINE VF FN(fma)(VF a, VF b, VF c) { return (VF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#elif defined(X86_PATHS) && VW == 4 && defined(PATH_FMA128)
PINLINE VF FN(fma)(VF a, VF b, VF c) { return (VF)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c); }
#elif defined(__aarch64__) && VW == 4
PINLINE VF FN(fma)(VF a, VF b, VF c) { return (VF)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b); }
#else
PINLINE VF FN(fma)(VF a, VF b, VF c)
{
    VF out;
    for (int lane = 0; lane < VW; lane++) out[lane] = __builtin_fmaf(a[lane], b[lane], c[lane]);
    return out;
}
#endif

/* x[0..n) = exp(x), each step over the n vectors before the next (n <= NB, a constant).
 * x = k ln2 + r with |r| <= ln2 / 2 (k by the 1.5 * 2^23 rounding trick, ln2 in two parts,
 * the first exact in k * ln2, each product fused with its sum); exp(r) = 1 + r + r^2 Q(r) with
 * Q of degree 3, a minimax fit of the relative error, evaluated by Horner's scheme in fused
 * multiply-adds (at most 2.1 ulp from exp(r) over the whole range, checked against float64 on
 * 200001 points); then exp(x) = exp(r) 2^k rounded once.  The
 * arithmetic up to exp(r) is the same on every path; 2^k is applied three ways, each the one
 * correctly rounded product exp(r) * 2^k, so every path gives the same bits:
 *   - avx512: x clamped to [-104, 88.7228394] first (-104 and -inf underflow to 0,
 *     88.7228394, the first float32 past log(FLT_MAX), and all above overflow to inf; NaN
 *     passes both clamps), then VSCALEFPS;
 *   - the others, when every k of the n vectors lies in [-125, 127] (a finite normal result:
 *     nearly always in a softmax): k added to exp(r)'s exponent field, exact;
 *   - else those n vectors again with the clamps and 2^k in two factors 2^(k >> 1) and
 *     2^(k - (k >> 1)), the first product exact, so k in [-150, 128] reaches the subnormals
 *     and overflows to inf only by the final product (NaN, +-inf and far arguments come here). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f /* 1.5 * 2^23: x * log2(e) + this rounds to an integer k */
#define EXP_LN2_HI (-0.693359375f)
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_LO (-104.0f)
#define EXP_HI 88.72283935546875f

/* exp(r) for r = x - k ln2, from x and t = x log2(e) + EXP_ROUND */
PINLINE VF FN(exp_reduced)(VF x, VF t)
{
#define bc FN(bc)
    const VF kf = t - bc(EXP_ROUND);
    VF r = FN(fma)(kf, bc(EXP_LN2_HI), x);
    r = FN(fma)(kf, bc(EXP_LN2_LO), r);
    VF q = FN(fma)(bc(0.008312530815601349f), r, bc(0.04189012199640274f));
    q = FN(fma)(q, r, bc(0.16667114198207855f));
    q = FN(fma)(q, r, bc(0.499992311000824f));
    q = FN(fma)(q, r, bc(1.0f));
    return FN(fma)(q, r, bc(1.0f));
#undef bc
}

PINLINE void FN(exp_vecs)(VF *x, const int n)
{
#define bc FN(bc)
#define bcu FN(bcu)
#define EACH _Pragma("GCC unroll 16") for (int k = 0; k < n; k++)
    VF t[NB];
#if defined(X86_PATHS) && VW == 16
    EACH x[k] = FN(min)(bc(EXP_HI), FN(max)(bc(EXP_LO), x[k]));
    EACH t[k] = FN(fma)(x[k], bc(EXP_LOG2E), bc(EXP_ROUND));
    EACH x[k] = (VF)_mm512_scalef_ps((__m512)FN(exp_reduced)(x[k], t[k]), (__m512)(t[k] - bc(EXP_ROUND)));
#else
    /* k's range: t's bits less those of EXP_ROUND - 125, unsigned, at most 252 exactly when k is
     * in [-125, 127] (NaN, +-inf and far arguments give bits far outside) */
    VF y[NB];
    VU over = bcu(0);
    EACH {
        t[k] = FN(fma)(x[k], bc(EXP_LOG2E), bc(EXP_ROUND));
        const VU u = (VU)t[k] - bcu(0x4b400000u - 125u);
        over = FN(umax)(over, u);
        /* t's integer bits are EXP_ROUND's plus k, and EXP_ROUND's low 9 bits are 0: t << 23 is k << 23 */
        y[k] = (VF)((VU)FN(exp_reduced)(x[k], t[k]) + ((VU)t[k] << 23));
    }
    if (__builtin_expect(FN(all)((VI)(over <= bcu(252u))), 1)) {
        EACH x[k] = y[k];
    } else {
        EACH {
            const VF xc = FN(min)(bc(EXP_HI), FN(max)(bc(EXP_LO), x[k]));
            const VF tc = FN(fma)(xc, bc(EXP_LOG2E), bc(EXP_ROUND));
            const VF qc = FN(exp_reduced)(xc, tc);
            const VU ni = (VU)tc - bcu(0x4b400000u), n1 = (VU)((VI)ni >> 1), n2 = ni - n1;
            x[k] = qc * (VF)((n1 + bcu(127)) << 23) * (VF)((n2 + bcu(127)) << 23);
        }
    }
#endif
#undef EACH
#undef bc
#undef bcu
}

/* tanh(x), each lane alike on every path: for |x| < 0.3 the odd Taylor polynomial to x^13 (the next
 * term is below 1e-10 relative there), else (1 - e) / (1 + e) with e = exp(-2|x|) (exp_vecs'
 * arithmetic, |e| <= 1: no overflow), the sign put back; NaN stays NaN, +-inf gives +-1.  Within a
 * few ulp of tanh (checked against float64 in tests/unit/test_tile_pass.py). */
PINLINE VF FN(tanh_vec)(VF x)
{
#define bc FN(bc)
    const VU sign = (VU)x & FN(bcu)(0x80000000u);
    const VF a = (VF)((VU)x & FN(bcu)(0x7fffffffu));
    VF e[1] = {bc(-2.0f) * a};
    FN(exp_vecs)(e, 1);
    const VF big = (bc(1.0f) - e[0]) / (bc(1.0f) + e[0]);
    const VF z = a * a;
    VF p = FN(fma)(bc(3.5920791875e-3f), z, bc(-8.8632355299e-3f)); /* 21844/6081075, -1382/155925 */
    p = FN(fma)(p, z, bc(2.1869488536e-2f));                        /* 62/2835 */
    p = FN(fma)(p, z, bc(-5.3968253968e-2f));                       /* -17/315 */
    p = FN(fma)(p, z, bc(1.3333333333e-1f));                        /* 2/15 */
    p = FN(fma)(p, z, bc(-3.3333333333e-1f));                       /* -1/3 */
    const VF small = FN(fma)(a * z, p, a);
    const VI near = (VI)(a < bc(0.3f));
    return (VF)((((VU)small & (VU)near) | ((VU)big & ~(VU)near)) | sign);
#undef bc
}

/* the logit softcap over a row: row[j] = cap * tanh((row[j] * scale) / cap), each step rounded
 * (the BLAS tiles' order); t (when given) receives the tanh, for the backward's slope 1 - t^2 */
PINLINE void FN(softcap_row)(float *row, Py_ssize_t n, float scale, float cap, float *t)
{
    const VF vs = FN(bc)(scale), vc = FN(bc)(cap);
    Py_ssize_t j = 0;
    for (; j + VW <= n; j += VW) {
        const VF th = FN(tanh_vec)((LOAD(row + j) * vs) / vc);
        if (t) STORE(t + j, th);
        STORE(row + j, th * vc);
    }
    if (j < n) {
        float buf[VW] = {0}, tb[VW];
        memcpy(buf, row + j, (n - j) * sizeof(float));
        const VF th = FN(tanh_vec)((LOAD(buf) * vs) / vc);
        STORE(tb, th);
        STORE(buf, th * vc);
        memcpy(row + j, buf, (n - j) * sizeof(float));
        if (t) memcpy(t + j, tb, (n - j) * sizeof(float));
    }
}

/* n vectors of columns: v = exp(((v * scale) + b) - shift) in place, vector k added into
 * lane group k % NVEC */
PINLINE void FN(exp_cols)(float *v, const float *b, VF scale, VF shift, VF acc[NVEC], const int n)
{
    VF x[NB];
    _Pragma("GCC unroll 16") for (int k = 0; k < n; k++) {
        x[k] = LOAD(v + k * VW) * scale;
        if (b) x[k] = x[k] + LOAD(b + k * VW);
        x[k] = x[k] - shift;
    }
    FN(exp_vecs)(x, n);
    _Pragma("GCC unroll 16") for (int k = 0; k < n; k++) {
        acc[k % NVEC] = acc[k % NVEC] + x[k];
        STORE(v + k * VW, x[k]);
    }
}

PINLINE float FN(exp_row)(float *row, Py_ssize_t cols, float scale, const float *brow, float sh)
{
    const VF vscale = FN(bc)(scale), vsh = FN(bc)(sh);
    VF acc[NVEC];
    for (int k = 0; k < NVEC; k++) acc[k] = FN(bc)(0.0f);
    Py_ssize_t j = 0;
    if (brow) {
        for (; j + NB * VW <= cols; j += NB * VW) FN(exp_cols)(row + j, brow + j, vscale, vsh, acc, NB);
        for (; j + LANES <= cols; j += LANES) FN(exp_cols)(row + j, brow + j, vscale, vsh, acc, NVEC);
    } else {
        for (; j + NB * VW <= cols; j += NB * VW) FN(exp_cols)(row + j, NULL, vscale, vsh, acc, NB);
        for (; j + LANES <= cols; j += LANES) FN(exp_cols)(row + j, NULL, vscale, vsh, acc, NVEC);
    }
    float sum = 0.0f;
    for (int k = 0; k < NVEC; k++)
        for (int lane = 0; lane < VW; lane++) sum += acc[k][lane];
    if (j < cols) {
        float buf[LANES] = {0}, bb[LANES] = {0};
        Py_ssize_t rest = cols - j;
        memcpy(buf, row + j, rest * sizeof(float));
        if (brow) memcpy(bb, brow + j, rest * sizeof(float));
        FN(exp_cols)(buf, brow ? bb : NULL, vscale, vsh, acc, NVEC);
        memcpy(row + j, buf, rest * sizeof(float));
        for (Py_ssize_t t = 0; t < rest; t++) sum += buf[t];
    }
    /* which of two NaNs an addition returns depends on how the compiler ordered its operands,
     * which differs between paths: a NaN sum is the one quiet NaN on every path */
    return sum == sum ? sum : __builtin_nanf("");
}

PATH_ISA static void FN(exp_rows)(float *s, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t ld, float scale,
                                  const float *bias, Py_ssize_t ldb, const float *shift, float *sums)
{
    for (Py_ssize_t i = 0; i < rows; i++) {
        float sum = FN(exp_row)(s + i * ld, cols, scale, bias ? bias + i * ldb : NULL, shift ? shift[i] : 0.0f);
        if (sums) sums[i] = sum;
    }
}

/* the backward's dS = (dP - dvec[i]) * P in place in dp, a subtraction then a product, each
 * rounded (as NumPy's two passes round them) */
PATH_ISA static void FN(ds_rows)(float *dp, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t ld, const float *p,
                                 Py_ssize_t ldp, const float *dvec, Py_ssize_t inc)
{
    for (Py_ssize_t i = 0; i < rows; i++) {
        float *restrict out = dp + i * ld;
        const float *restrict weights = p + i * ldp;
        const float d = dvec[i * inc];
        for (Py_ssize_t j = 0; j < cols; j++) out[j] = (out[j] - d) * weights[j];
    }
}

#ifndef EXP_ROWS_KEEP /* else the includer's next header (block_rows.h) ends the path */
#include "path_end.h"
#endif
