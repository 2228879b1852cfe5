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

/* x[0..n) = exp(x), each step over the n vectors before the next (n <= NB, a constant).
 * x = k ln2 + r with |r| <= ln2 / 2 (k by the 1.5 * 2^23 rounding trick, read back from
 * its bits; ln2 in two parts, the first exact in k * ln2); exp(r) = 1 + r + r^2 Q(r) with Q
 * of degree 4, a minimax fit (relative error 5e-9 with its float32 coefficients, evaluated
 * by Estrin's scheme); 2^k in two factors, so k in [-150, 128] reaches the subnormals and
 * overflows to inf only by the final product.  x is clamped to [-104, 88.7228394]: -104
 * (and -inf) underflow to 0, 88.7228394, the first float32 past log(FLT_MAX), and all above
 * (+inf) to inf; NaN passes both clamps and the arithmetic unchanged. */
PINLINE void FN(exp_vecs)(VF *x, const int n)
{
#define bc FN(bc)
#define bcu FN(bcu)
#define EACH _Pragma("GCC unroll 16") for (int k = 0; k < n; k++)
    VF xc[NB], t[NB], r[NB], r2[NB], q[NB], b[NB];
    VU ni[NB];
    EACH xc[k] = FN(min)(bc(88.72283935546875f), FN(max)(bc(-104.0f), x[k]));
    EACH t[k] = xc[k] * bc(1.44269504088896341f) + bc(12582912.0f);
    EACH ni[k] = (VU)t[k] - bcu(0x4b400000u);
    EACH t[k] = t[k] - bc(12582912.0f);
    EACH r[k] = xc[k] - t[k] * bc(0.693359375f);
    EACH r[k] = r[k] - t[k] * bc(-2.12194440e-4f);
    EACH r2[k] = r[k] * r[k];
    EACH q[k] = r[k] * bc(0.008368747308850288f) + bc(0.04166839271783829f);
    EACH b[k] = r[k] * bc(0.1666651964187622f) + bc(0.4999999403953552f);
    EACH q[k] = r2[k] * bc(0.00138145184610039f) + q[k];
    EACH q[k] = r2[k] * q[k] + b[k];
    EACH q[k] = r2[k] * q[k] + r[k] + bc(1.0f);
    EACH {
        VU n1 = (VU)((VI)ni[k] >> 1), n2 = ni[k] - n1;
        x[k] = q[k] * (VF)((n1 + bcu(127)) << 23) * (VF)((n2 + bcu(127)) << 23);
    }
#undef EACH
#undef bc
#undef bcu
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

#undef FN
#undef VF
#undef VI
#undef VU
#undef LOAD
#undef STORE
#undef NVEC
#undef PINLINE
#undef CAT
#undef CAT_
#undef PATH
#undef PATH_ISA
#undef VW
#undef NB
