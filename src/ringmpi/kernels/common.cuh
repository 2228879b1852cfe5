// Shared device helpers for the ringmpi kernels (prepended to every source, after rules.h).
//
// The sources include no CUDA headers: 16-bit conversions and the tensor-core
// MMA are written in PTX, so NVRTC needs no include path.  Element kinds:
//   KIND_F16 / KIND_BF16: 16-bit storage (raw bits in unsigned short), float math
//   KIND_F32: float storage and math
//   KIND_F64: double storage and math
// Index arithmetic that can exceed 2^31 is done in long long.
//
// The constants shared with Python are not written here: NVRTC gets them as -D defines from
// ringmpi.kernels.KERNEL_DEFINES (kernels.compile_options): the element kinds KIND_* (the values
// of ringmpi.kernels.F16, BF16, F32, F64) and MAX_HEAD_MODS (ringmpi.core.modifiers.MAX_KERNEL_MODIFIERS);
// rules.h, prepended before this file, takes the tile classes and Philox's constants the same way.
#if !defined(KIND_F16) || !defined(KIND_BF16) || !defined(KIND_F32) || !defined(KIND_F64) || !defined(MAX_HEAD_MODS)
#error "compile with ringmpi.kernels.compile_options: it defines KIND_* and MAX_HEAD_MODS"
#endif

template <int KIND> struct Kind;
template <> struct Kind<KIND_F16> { typedef unsigned short storage; typedef float acc; };
template <> struct Kind<KIND_BF16> { typedef unsigned short storage; typedef float acc; };
template <> struct Kind<KIND_F32> { typedef float storage; typedef float acc; };
template <> struct Kind<KIND_F64> { typedef double storage; typedef double acc; };

// ---------------------------------------------------------------- conversions
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
#if __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    // sm_70/75 have no bfloat16 instructions: round to nearest even on the bits
    // (a NaN stays a NaN, quieted, with its sign, as ml_dtypes rounds it)
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
// Two floats packed into one 32-bit register, lo in the low half (the
// element with the smaller index), as mma.sync expects.
template <bool BF16>
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
template <bool BF16>
__device__ __forceinline__ unsigned short to_bits16(float f) {
    return BF16 ? float_to_bf16_bits(f) : float_to_half_bits(f);
}
template <bool BF16>
__device__ __forceinline__ float from_bits16(unsigned short h) {
    return BF16 ? bf16_bits_to_float(h) : half_bits_to_float(h);
}
// NaN or Inf, from the bits of a 16-bit value
template <bool BF16>
__device__ __forceinline__ bool nonfinite_bits16(unsigned short h) {
    return (h & 0x7fffu) >= (BF16 ? 0x7f80u : 0x7c00u);
}

template <int KIND> __device__ __forceinline__ typename Kind<KIND>::acc load_acc(const typename Kind<KIND>::storage* p);
template <> __device__ __forceinline__ float load_acc<KIND_F16>(const unsigned short* p) { return half_bits_to_float(*p); }
template <> __device__ __forceinline__ float load_acc<KIND_BF16>(const unsigned short* p) { return bf16_bits_to_float(*p); }
template <> __device__ __forceinline__ float load_acc<KIND_F32>(const float* p) { return *p; }
template <> __device__ __forceinline__ double load_acc<KIND_F64>(const double* p) { return *p; }

// double -> float rounded to odd: truncate, then set the last bit if inexact.
// Rounding that to a 16-bit type (>= 2 fewer bits) gives the correctly rounded
// (nearest even) 16-bit value of the double: one rounding, not two.
__device__ __forceinline__ float double_to_float_round_odd(double x) {
    const float t = __double2float_rz(x);
    return ((double)t != x && !isnan(x)) ? __uint_as_float(__float_as_uint(t) | 1u) : t;
}
template <int KIND> __device__ __forceinline__ typename Kind<KIND>::storage from_float(double x);
template <> __device__ __forceinline__ unsigned short from_float<KIND_F16>(double x) { return float_to_half_bits(double_to_float_round_odd(x)); }
template <> __device__ __forceinline__ unsigned short from_float<KIND_BF16>(double x) { return float_to_bf16_bits(double_to_float_round_odd(x)); }
template <> __device__ __forceinline__ float from_float<KIND_F32>(double x) { return (float)x; }
template <> __device__ __forceinline__ double from_float<KIND_F64>(double x) { return x; }

// ---------------------------------------------------------------- math
template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000LL); }
template <typename T> __device__ __forceinline__ T pos_inf();
template <> __device__ __forceinline__ float pos_inf<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double pos_inf<double>() { return __longlong_as_double(0x7ff0000000000000LL); }

// The one four-partial dot product of the CUDA sources: x . y as four partial sums over d mod 4,
// s_k += x[d] * y[d] for d = k mod 4 in increasing d, added pairwise, (s0 + s1) + (s2 + s3).  The
// scores (and do . v) of the SIMT kernels, forward and backward alike, and invariant.cu's
// (inv_dot).  A sequential sum of 64 products of large logits rounds about twice as far from the
// exact score as the dense float32 computation the tolerance rule compares with; four partial
// sums stay within it.  Dot4 holds the partials: add() takes one group d .. d + 3 (x's values as
// arguments, so that a caller may hold them in registers: the SIMT forward reads each q value
// once for all of its keys), add_one() a single product of a tail (into s0), sum() the result.
// Every caller does its products in this one order, so all of them form a score the same bits.
template <typename T>
struct Dot4 {
    T s0, s1, s2, s3;
    __device__ __forceinline__ Dot4() : s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0)) {}
    __device__ __forceinline__ void add(T x0, T x1, T x2, T x3, const T* y) {
        s0 += x0 * y[0];
        s1 += x1 * y[1];
        s2 += x2 * y[2];
        s3 += x3 * y[3];
    }
    __device__ __forceinline__ void add_one(T x, T y) { s0 += x * y; }
    __device__ __forceinline__ T sum() const { return (s0 + s1) + (s2 + s3); }
};

// x . y over d < n by Dot4; x and y hold zeros from n up to the next multiple of 4 (the padded
// head dims are multiples of 8).
template <typename T>
__device__ __forceinline__ T dot4(const T* x, const T* y, int n) {
    Dot4<T> acc;
    for (int d = 0; d < n; d += 4) acc.add(x[d], x[d + 1], x[d + 2], x[d + 3], y + d);
    return acc.sum();
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
// The online softmax's running maximum propagates NaN as NumPy's np.maximum does
// (fmaxf would drop it), so max_logit agrees between backends: a row that saw a
// NaN score has m = NaN (its o and lse are NaN either way).
__device__ __forceinline__ float max_acc(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ double max_acc(double a, double b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ bool finite_acc(float x) { return isfinite(x); }
__device__ __forceinline__ bool finite_acc(double x) { return isfinite(x); }

// ---------------------------------------------------------------- non-finite values
// A masked key is not part of a query's sum, not even through NaN or Inf.
// Scores are masked by selection (s = -inf), so P = 0 there; the products
// that sum over keys or queries (P V, P^T dO, dS^T Q, dS K) would still add
// 0 * NaN.  Kernels scan the tiles they load (__syncthreads_or) and, only
// for a tile that holds a NaN/Inf, add a product only for a visible
// (query, key) pair (visible_add, pair_visible); the clean path is unchanged.
// A visible pair adds w * x even when its weight underflowed to 0, so a
// visible key's NaN/Inf reaches the query (0 * NaN = NaN), as in NumPy.
template <typename T>
__device__ __forceinline__ T visible_add(T acc, bool visible, T w, T x) { return visible ? acc + w * x : acc; }

// ---------------------------------------------------------------- masks
// The mask rules (MaskArgs, pos_visible, classify_tile, elem_visible, pair_visible) are rules.h's,
// shared with the CPU code (_ext/fused.c).

// Kernel parameters for the mask (scalars typed on the host: np.int32 flags,
// np.int64 deltas); seg_q / seg_kv are dummies when has_seg is 0.
#define MASK_PARAMS                                                                  \
    const long long* __restrict__ q_pos, const long long* __restrict__ kv_pos,      \
    const long long* __restrict__ seg_q, const long long* __restrict__ seg_kv,      \
    const long long* __restrict__ q_bounds, const long long* __restrict__ kv_bounds, \
    int has_seg, int has_lo, long long lo_delta, int has_hi, long long hi_delta
#define MASK_INIT(mk)                                                                     \
    MaskArgs mk;                                                                          \
    mk.q_pos = q_pos; mk.kv_pos = kv_pos;                                                 \
    mk.seg_q = has_seg ? seg_q : 0; mk.seg_kv = has_seg ? seg_kv : 0;                     \
    mk.q_bounds = q_bounds; mk.kv_bounds = kv_bounds;                                     \
    mk.lo_delta = lo_delta; mk.hi_delta = hi_delta; mk.has_lo = has_lo; mk.has_hi = has_hi

// ---------------------------------------------------------------- score modifiers
// A visible score s = scale * q.k of query row `row`, key column `col` becomes,
// in this order (modify_score, the one place the kernels apply them):
//  * logit softcap (ScoreSpec.softcap, a float64 launch scalar; c = 0: none):
//    c * tanh(s / c), slope 1 - tanh(s / c)^2;
//  * the modifiers with per-head data (ringmpi.core.modifiers.MODIFIERS, bit m
//    of head_mods), in their order: s + term_m(value_h, i, j), i = q_pos[row],
//    j = kv_pos[col] (global positions), slope 1; modifier_term below states
//    each one's term.  A value of 0 leaves the score as it is (the term is skipped).
// The slope is d(modified) / d(s): the backward multiplies dS by it.  Kernels
// fetch a head's values once (head_values) and test them once (score_modified),
// so a call without modifiers runs the same operations as before.  The values
// pointer is a dummy when head_mods is 0.
#define MOD_PARAMS double softcap, int head_mods, const float* __restrict__ head_vals, long long mod_offset
#define MOD_INIT(mk) mk.softcap = softcap; mk.head_mods = head_mods; mk.head_values = head_mods ? head_vals : 0; \
    mk.mod_offset = mod_offset

// One query head's values of the per-head modifiers (0 for a modifier that is off).
template <typename T>
struct HeadValues {
    T v[MAX_HEAD_MODS];
};

template <typename T>
__device__ __forceinline__ HeadValues<T> head_values(const MaskArgs& mk, int h) {
    HeadValues<T> hv;
#pragma unroll
    for (int m = 0; m < MAX_HEAD_MODS; ++m)
        hv.v[m] = ((mk.head_mods >> m) & 1) ? (T)mk.head_values[h * MAX_HEAD_MODS + m] : T(0);
    return hv;
}

// Whether any modifier changes this head's scores (cap c, the head's values).
template <typename T>
__device__ __forceinline__ bool score_modified(T cap, const HeadValues<T>& hv) {
    bool any = cap != T(0);
#pragma unroll
    for (int m = 0; m < MAX_HEAD_MODS; ++m) any = any || hv.v[m] != T(0);
    return any;
}

// Modifier m's score of query position qp, key position kp (offset = N_kv - N_q), from s
// and the head's value; one case per entry of ringmpi.core.modifiers.MODIFIERS.
template <typename T>
__device__ __forceinline__ T modifier_term(int m, T value, long long qp, long long kp, long long offset, T s) {
    switch (m) {
    case 0:  // ALiBi (modifiers.Alibi): s - slope_h * |i + offset - j| (rules.h)
        return alibi_score(value, qp, kp, offset, s);
    default:
        return s;
    }
}

// The modified score of (row, col) and, in *slope, its derivative; rows and
// columns past Sq / Skv get no per-head term (they are hidden or never stored).
template <typename T>
__device__ __forceinline__ T modify_score(const MaskArgs& mk, T cap, const HeadValues<T>& hv, int row, int col,
                                          int Sq, int Skv, T s, T* slope) {
    T d = T(1);
    if (cap != T(0)) s = softcap_score(s, cap, &d);  // rules.h
    if (row < Sq && col < Skv) {
#pragma unroll
        for (int m = 0; m < MAX_HEAD_MODS; ++m)
            if (hv.v[m] != T(0)) s = modifier_term<T>(m, hv.v[m], mk.q_pos[row], mk.kv_pos[col], mk.mod_offset, s);
    }
    *slope = d;
    return s;
}

// ---------------------------------------------------------------- dropout
// The rule (Philox, DropoutArgs, dropout_keep) is rules.h's.
// Kernel parameters (typed on the host by ringmpi.dropout: int32 on, uint32 key
// words, uint64 threshold, the compute type's rescale, int64 heads and offsets),
// after MASK_PARAMS; drop_on = 0 switches dropout off.
#define DROPOUT_PARAMS(T)                                                              \
    int drop_on, unsigned int drop_k0, unsigned int drop_k1, unsigned long long drop_threshold, \
    const T drop_rescale, long long drop_heads, long long drop_b0, long long drop_h0
#define DROPOUT_INIT(dr)                                                                 \
    DropoutArgs dr;                                                                      \
    dr.on = drop_on; dr.k0 = drop_k0; dr.k1 = drop_k1; dr.threshold = drop_threshold;   \
    dr.heads = drop_heads; dr.batch_offset = drop_b0; dr.head_offset = drop_h0

// The factor of weight (row, col) of a block (local indices): rescale when kept,
// 0 when dropped or outside the block.
template <typename T>
__device__ __forceinline__ T dropout_factor(const DropoutArgs& dr, T rescale, const MaskArgs& mk, int b, int h,
                                            int row, int col, int Sq, int Skv) {
    if (row >= Sq || col >= Skv) return T(0);
    return dropout_keep(dr, b, h, mk.q_pos[row], mk.kv_pos[col]) ? rescale : T(0);
}

// ---------------------------------------------------------------- tensor cores
// D (16x8 f32) += A (16x16) * B (16x8), f16 or bf16 inputs.  Fragment layout
// (PTX ISA, mma.m16n8k16), g = lane / 4, c = lane % 4:
//   a[0]: (row g,   cols 2c, 2c+1)   a[1]: (row g+8, cols 2c, 2c+1)
//   a[2]: (row g,   cols 2c+8, +9)   a[3]: (row g+8, cols 2c+8, +9)
//   b[0]: (rows 2c, 2c+1, col g)     b[1]: (rows 2c+8, 2c+9, col g)
//   d[0], d[1]: (row g, cols 2c, 2c+1)   d[2], d[3]: (row g+8, cols 2c, 2c+1)
template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, const unsigned int* a, const unsigned int* b) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// 32-bit read of two consecutive 16-bit elements in shared memory
// (the index must be even; every row stride used here is even).
__device__ __forceinline__ unsigned int lds32(const unsigned short* base, int idx) {
    return *reinterpret_cast<const unsigned int*>(base + idx);
}

// ---------------------------------------------------------------------------
// Block-kernel grid: (tiles, Y, Z).  blockIdx.x is the tile; the (batch, head)
// row is  row = blockIdx.z * gridDim.y + blockIdx.y  (Y, Z <= 65535, see
// ringmpi.kernels.split_rows).  Rows >= the row count (at most Z - 1 CTAs of
// the last z slice) return at once, before any barrier.
__device__ __forceinline__ int cta_row() { return (int)(blockIdx.z * gridDim.y + blockIdx.y); }
