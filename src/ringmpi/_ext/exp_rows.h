/* One vector path of the tile pass, included by fused.c once per path with
 *
 *   PATH      the path's name (a C token: plain, avx2, avx512)
 *   PATH_ISA  the function attribute that enables its instructions (empty for the baseline)
 *   VW        the lanes of one native vector: 4 (SSE2, NEON), 8 (AVX2), 16 (AVX-512)
 *
 * The vector width is the only difference between the paths: each processes LANES (16)
 * columns at a time as LANES / VW native vectors, so every element goes through the same
 * float32 operations and every row sum adds into the same 16 lanes in the same order. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, CAT(_, PATH))
#define VF CAT(vf, VW)
#define VI CAT(vi, VW)
#define NVEC (LANES / VW)
#define PINLINE PATH_ISA static inline __attribute__((always_inline))

typedef float VF __attribute__((vector_size(VW * 4)));
typedef int32_t VI __attribute__((vector_size(VW * 4)));

PINLINE VF FN(bc)(float a) { return (VF){0} + a; }
PINLINE VI FN(bci)(int32_t a) { return (VI){0} + a; }
PINLINE VF FN(sel)(VI m, VF a, VF b) { return (VF)(((VI)a & m) | ((VI)b & ~m)); }

PINLINE VF FN(exp_poly)(VF x)
{
#define bc FN(bc)
#define bci FN(bci)
#define sel FN(sel)
    /* x = n ln2 + r, |r| <= ln2 / 2; exp(r) by a degree-6 polynomial; 2^n by exponent bits */
    VF xc = sel(x > bc(88.72283905206835f), bc(88.72283905206835f), x);
    xc = sel(xc < bc(-103.0f), bc(-103.0f), xc);
    /* round to nearest by the 1.5 * 2^23 trick */
    VF n = (xc * bc(1.44269504088896341f) + bc(12582912.0f)) - bc(12582912.0f);
    VF r = xc - n * bc(0.693359375f);
    r = r - n * bc(-2.12194440e-4f);
    VF p = bc(1.9875691500e-4f);
    p = p * r + bc(1.3981999507e-3f);
    p = p * r + bc(8.3334519073e-3f);
    p = p * r + bc(4.1665795894e-2f);
    p = p * r + bc(1.6666665459e-1f);
    p = p * r + bc(5.0000001201e-1f);
    p = p * (r * r) + r + bc(1.0f);
    /* 2^n in two factors: n in [-149, 128] reaches the subnormals without overflowing one */
    VI ni = __builtin_convertvector(n, VI);
    VI n1 = ni >> 1, n2 = ni - n1;
    VF y = p * (VF)((n1 + bci(127)) << 23) * (VF)((n2 + bci(127)) << 23);
    y = sel(x > bc(88.72283905206835f), bc(INFINITY), y);
    y = sel(x < bc(-103.972077083991796f), bc(0.0f), y);
    return sel(x != x, x, y);
#undef bc
#undef bci
#undef sel
}

/* LANES columns: v = exp(((v * scale) + b) - shift) in place, added into the lanes' sums */
PINLINE void FN(exp_lanes)(float *v, const float *b, VF scale, VF shift, VF acc[NVEC])
{
    for (int k = 0; k < NVEC; k++) {
        VF x, bk;
        memcpy(&x, v + k * VW, sizeof x);
        x = x * scale;
        if (b) {
            memcpy(&bk, b + k * VW, sizeof bk);
            x = x + bk;
        }
        x = FN(exp_poly)(x - shift);
        acc[k] = acc[k] + x;
        memcpy(v + k * VW, &x, sizeof x);
    }
}

/* one row, LANES columns at a time, the tail through a padded copy (so every element gets
 * the same arithmetic); returns the row's sum: the lanes 0..LANES-1, then the tail's columns */
PINLINE float FN(exp_row)(float *row, Py_ssize_t cols, float scale, const float *brow, float sh)
{
    const VF vscale = FN(bc)(scale), vsh = FN(bc)(sh);
    VF acc[NVEC];
    for (int k = 0; k < NVEC; k++) acc[k] = FN(bc)(0.0f);
    Py_ssize_t j = 0;
    if (brow)
        for (; j + LANES <= cols; j += LANES) FN(exp_lanes)(row + j, brow + j, vscale, vsh, acc);
    else
        for (; j + LANES <= cols; j += LANES) FN(exp_lanes)(row + j, NULL, vscale, vsh, acc);
    float sum = 0.0f;
    for (int k = 0; k < NVEC; k++)
        for (int lane = 0; lane < VW; lane++) sum += acc[k][lane];
    if (j < cols) {
        float buf[LANES] = {0}, bb[LANES] = {0};
        Py_ssize_t rest = cols - j;
        memcpy(buf, row + j, rest * sizeof(float));
        if (brow) memcpy(bb, brow + j, rest * sizeof(float));
        FN(exp_lanes)(buf, brow ? bb : NULL, vscale, vsh, acc);
        memcpy(row + j, buf, rest * sizeof(float));
        for (Py_ssize_t t = 0; t < rest; t++) sum += buf[t];
    }
    return sum;
}

PATH_ISA static void FN(exp_rows)(float *s, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t ld, float scale,
                                  const float *bias, Py_ssize_t ldb, const float *shift, float *sums)
{
    for (Py_ssize_t i = 0; i < rows; i++) {
        float sum = FN(exp_row)(s + i * ld, cols, scale, bias ? bias + i * ldb : NULL, shift ? shift[i] : 0.0f);
        if (sums) sums[i] = sum;
    }
}

#undef FN
#undef VF
#undef VI
#undef NVEC
#undef PINLINE
#undef CAT
#undef CAT_
#undef PATH
#undef PATH_ISA
#undef VW
