/* exp_rows.h built three ways on an AVX2 CPU: the plain path (4 lanes, 8 vectors), the avx2
 * path (8 lanes, 8 vectors) and the avx512 path's width and block (16 lanes, 4 vectors) with
 * AVX2 instructions and the generic max/min.  The same bits from all three (exp, row sums,
 * dS) for 1..300 columns, with and without a bias, non-finite values and the clamps' edges:
 * what the avx512 path computes, checked on a CPU without AVX-512 (tests/test_vector_paths.py). */
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define X86_PATHS 1
#define PATH plain
#define PATH_ISA
#define VW 4
#define NB 8
#include "exp_rows.h"
#define PATH avx2
#define PATH_ISA __attribute__((target("avx2,fma")))
#define VW 8
#define NB 8
#include "exp_rows.h"
#undef X86_PATHS
#define PATH wide
#define PATH_ISA __attribute__((target("avx2,fma")))
#define VW 16
#define NB 4
#include "exp_rows.h"

typedef void (*exp_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, float, const float *, Py_ssize_t, const float *,
                       float *);
typedef void (*ds_fn)(float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, const float *, Py_ssize_t, const float *,
                      Py_ssize_t);

enum { R = 7, LD = 300, N = R * LD };

int main(void)
{
    static const exp_fn exps[3] = {exp_rows_plain, exp_rows_avx2, exp_rows_wide};
    static const ds_fn dss[3] = {ds_rows_plain, ds_rows_avx2, ds_rows_wide};
    static float x[N], bias[N], shift[R], out[3][N], ds[3][N], sums[3][R];
    uint32_t state = 12345;
    for (int i = 0; i < N; i++) {
        state = state * 1664525u + 1013904223u;
        x[i] = ((float)(state >> 8) / 16777216.0f - 0.5f) * 250.0f;
        bias[i] = (state & 3) == 0 ? -INFINITY : 0.0f;
    }
    x[5] = NAN;
    x[17] = INFINITY;
    x[40] = -INFINITY;
    x[LD + 3] = 88.72283935546875f;
    x[LD + 4] = -104.0f;
    x[LD + 5] = -103.97207f;
    for (int i = 0; i < R; i++) shift[i] = 0.5f * (float)i;
    int differ = 0;
    for (int cols = 1; cols <= LD; cols++) {
        for (int f = 0; f < 3; f++) {
            memcpy(out[f], x, sizeof x);
            exps[f](out[f], R, cols, LD, 0.37f, cols % 2 ? bias : NULL, LD, shift, sums[f]);
            memcpy(ds[f], x, sizeof x);
            dss[f](ds[f], R, cols, LD, out[f], LD, shift, 1);
        }
        for (int f = 1; f < 3; f++)
            if (memcmp(out[0], out[f], sizeof out[0]) || memcmp(sums[0], sums[f], sizeof sums[0]) ||
                memcmp(ds[0], ds[f], sizeof ds[0])) {
                printf("%d columns: build %d differs from the plain path\n", cols, f);
                differ = 1;
            }
    }
    if (!differ) printf("SAME BITS\n");
    return differ;
}
