/* The per-element rules of ringmpi, written once for both compilers.
 *
 * NVRTC gets this file first in every kernel program (ringmpi.kernels.source: rules.h, common.cuh,
 * the .cu file); the C compiler includes it in _ext/fused.c, whose small vectorised entry points
 * (_fused.visible, _fused.dropout_keep, _fused.alibi_terms, ...) the CPU backends call, so the CPU
 * suite runs the very rule code the GPU kernels run.  Plain C99 that NVRTC also compiles: no CUDA
 * header, no intrinsic without its C twin (RULES_MULHI), structs read by value in C and by const
 * reference in CUDA (RULES_IN), the same member syntax in both.
 *
 * The constants these rules share with Python are not written here: the tile classes TILE_SKIP,
 * TILE_PARTIAL, TILE_FULL (ringmpi.core.masks.SKIP, PARTIAL, FULL) and Philox's PHILOX_ROUNDS,
 * PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1 (ringmpi.core.philox.cuda_defines()) come as -D
 * defines: from ringmpi.kernels.compile_options for NVRTC, from setup.py for the C compiler. */
#ifndef RINGMPI_RULES_H
#define RINGMPI_RULES_H

#if !defined(TILE_SKIP) || !defined(TILE_PARTIAL) || !defined(TILE_FULL)
#error "compile with the tile classes of ringmpi.core.masks as -D defines (TILE_SKIP, TILE_PARTIAL, TILE_FULL)"
#endif
#if !defined(PHILOX_ROUNDS) || !defined(PHILOX_M0) || !defined(PHILOX_M1) || !defined(PHILOX_W0) \
    || !defined(PHILOX_W1)
#error "compile with ringmpi.core.philox.cuda_defines() as -D defines (PHILOX_ROUNDS, PHILOX_M*, PHILOX_W*)"
#endif

#ifdef __CUDACC__
#define RULES_FN __device__ __forceinline__
#define RULES_IN(type) const type&
#define RULES_UNROLL _Pragma("unroll")
#define RULES_MULHI(a, b) __umulhi((a), (b))
#else
#include <math.h>
#include <stdbool.h>
#define RULES_FN static inline
#define RULES_IN(type) const type
#define RULES_UNROLL
#define RULES_MULHI(a, b) ((unsigned int)(((unsigned long long)(a) * (unsigned long long)(b)) >> 32))
#endif

/* ---------------------------------------------------------------- masks
 * Mask rules in global positions (see ringmpi/core/masks.py): key j is visible from query i when
 * (!has_lo || j >= i + lo_delta) && (!has_hi || j <= i + hi_delta) and, with segment ids,
 * seg_q == seg_kv.  The host folds causal, window and the bottom-right offset into
 * (has_lo, lo_delta, has_hi, hi_delta) (ScoreSpec.key_deltas / kernel_scalars).
 * masks.classify_tiles is classify_tile's NumPy twin (the CuPy backend counts tiles with it; the
 * tests hold the two together). */
typedef struct {
    const long long* q_pos;     /* (Sq,) */
    const long long* kv_pos;    /* (Skv,) */
    const long long* seg_q;     /* (B, Sq) or null */
    const long long* seg_kv;    /* (B, Skv) or null */
    const long long* q_bounds;  /* per q tile: pos (min, max) then, with segments, (B, ntiles, 2) seg (min, max) */
    const long long* kv_bounds; /* same for kv tiles */
    long long lo_delta, hi_delta;
    int has_lo, has_hi;
    double softcap;             /* score modifiers (MOD_PARAMS): the cap, 0: none */
    int head_mods;              /* bit m: modifier m of ringmpi.core.modifiers.MODIFIERS is on */
    const float* head_values;   /* (H, MAX_HEAD_MODS) their per-head values, or null */
    long long mod_offset;       /* N_kv - N_q */
} MaskArgs;

RULES_FN bool pos_visible(RULES_IN(MaskArgs) mk, long long qp, long long kp) {
    return (!mk.has_lo || kp >= qp + mk.lo_delta) && (!mk.has_hi || kp <= qp + mk.hi_delta);
}

/* Classification of one tile from the min/max of its positions and segment ids (conservative: a
 * tile called PARTIAL may turn out fully hidden, which the per-element mask then handles exactly). */
RULES_FN int classify_tile(RULES_IN(MaskArgs) mk, int b, int batch, int qt, int nqt, int kt, int nkt) {
    const long long qlo = mk.q_bounds[2 * qt], qhi = mk.q_bounds[2 * qt + 1];
    const long long klo = mk.kv_bounds[2 * kt], khi = mk.kv_bounds[2 * kt + 1];
    int state = TILE_FULL;
    (void)batch;
    if (mk.has_hi && qhi + mk.hi_delta < klo) return TILE_SKIP;
    if (mk.has_lo && qlo + mk.lo_delta > khi) return TILE_SKIP;
    if ((mk.has_lo && qhi + mk.lo_delta > klo) || (mk.has_hi && qlo + mk.hi_delta < khi)) state = TILE_PARTIAL;
    if (mk.seg_q != 0) {
        const long long* sq = mk.q_bounds + 2LL * nqt + 2LL * ((long long)b * nqt + qt);
        const long long* sk = mk.kv_bounds + 2LL * nkt + 2LL * ((long long)b * nkt + kt);
        if (sq[1] < sk[0] || sq[0] > sk[1]) return TILE_SKIP;
        if (!(sq[0] == sq[1] && sk[0] == sk[1] && sq[0] == sk[0])) state = TILE_PARTIAL;
    }
    return state;
}

/* Visibility of one (query row, key column) of a tile that needs masking; rows past Sq are treated
 * as visible (they are computed but never stored), columns past Skv are hidden. */
RULES_FN bool elem_visible(RULES_IN(MaskArgs) mk, int b, int row, int col, int Sq, int Skv) {
    if (col >= Skv) return false;
    if (row >= Sq) return true;
    if (!pos_visible(mk, mk.q_pos[row], mk.kv_pos[col])) return false;
    if (mk.seg_q != 0 && mk.seg_q[(long long)b * Sq + row] != mk.seg_kv[(long long)b * Skv + col]) return false;
    return true;
}

/* Whether (row, col) is part of a query's sum, for the careful (non-finite) paths: a real query
 * row, a real key column, visible under the mask.  need_mask is false only for fully visible tiles
 * within Skv. */
RULES_FN bool pair_visible(RULES_IN(MaskArgs) mk, bool need_mask, int b, int row, int col, int Sq, int Skv) {
    return row < Sq && col < Skv && (!need_mask || elem_visible(mk, b, row, col, Sq, Skv));
}

/* ---------------------------------------------------------------- score modifiers
 * The logit softcap (c = 0: none, the caller tests it): s -> c * tanh(s / c), slope
 * d(modified) / d(s) = 1 - tanh(s / c)^2.  ALiBi (modifiers.Alibi, case 0 of modifier_term):
 * s -> s - slope_h * |i + offset - j| (the distance exact in integers, then in the compute type),
 * slope 1. */
RULES_FN long long alibi_distance(long long qp, long long kp, long long offset) {
    long long dist = qp + offset - kp;
    return dist < 0 ? -dist : dist;
}
RULES_FN float alibi_score_f(float value, long long qp, long long kp, long long offset, float s) {
    return s - value * (float)alibi_distance(qp, kp, offset);
}
RULES_FN double alibi_score_d(double value, long long qp, long long kp, long long offset, double s) {
    return s - value * (double)alibi_distance(qp, kp, offset);
}
RULES_FN float softcap_score_f(float s, float cap, float* slope) {
    const float t = tanhf(s / cap), capped = cap * t;
    *slope = 1.0f - t * t;
    return capped;
}
RULES_FN double softcap_score_d(double s, double cap, double* slope) {
    const double t = tanh(s / cap), capped = cap * t;
    *slope = 1.0 - t * t;
    return capped;
}
#ifdef __cplusplus
RULES_FN float alibi_score(float value, long long qp, long long kp, long long offset, float s) {
    return alibi_score_f(value, qp, kp, offset, s);
}
RULES_FN double alibi_score(double value, long long qp, long long kp, long long offset, double s) {
    return alibi_score_d(value, qp, kp, offset, s);
}
RULES_FN float softcap_score(float s, float cap, float* slope) { return softcap_score_f(s, cap, slope); }
RULES_FN double softcap_score(double s, double cap, double* slope) { return softcap_score_d(s, cap, slope); }
#endif

/* ---------------------------------------------------------------- dropout
 * Philox 4x32-10 (Random123) and the keep rule of ringmpi/core/dropout.py, bit for bit: key
 * (seed lo, seed hi); counter (j lo, i lo, (i >> 32) | (j >> 32) << 16,
 * (batch_offset + b) * heads + head_offset + h) for query position i and key position j; kept iff
 * output word 0 >= threshold = ceil(p * 2^32).  A kept weight is multiplied by rescale = 1 / (1 - p)
 * (rounded to the compute type on the host).  The row sum l (and so lse) is taken before the
 * factor: dropout changes what reaches P V, never the softmax denominator. */
RULES_FN unsigned int philox4x32_10_word0(unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
                                          unsigned int k0, unsigned int k1) {
    RULES_UNROLL
    for (int r = 0; r < PHILOX_ROUNDS; ++r) {
        if (r) { /* the key is bumped between rounds */
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const unsigned int hi0 = RULES_MULHI(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        const unsigned int hi1 = RULES_MULHI(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return c0;
}

typedef struct {
    int on;
    unsigned int k0, k1;
    unsigned long long threshold;
    long long heads, batch_offset, head_offset;
} DropoutArgs;

RULES_FN bool dropout_keep(RULES_IN(DropoutArgs) dr, int b, int h, long long i, long long j) {
    const unsigned long long ui = (unsigned long long)i, uj = (unsigned long long)j;
    const unsigned int row = (unsigned int)((dr.batch_offset + b) * dr.heads + dr.head_offset + h);
    const unsigned int word = philox4x32_10_word0((unsigned int)uj, (unsigned int)ui,
                                                  (unsigned int)((ui >> 32) | ((uj >> 32) << 16)), row,
                                                  dr.k0, dr.k1);
    return (unsigned long long)word >= dr.threshold;
}

#endif /* RINGMPI_RULES_H */
