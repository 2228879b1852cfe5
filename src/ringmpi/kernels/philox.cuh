// Dropout on the attention weights (prepended to every source after common.cuh).
//
// Philox 4x32-10 (Random123) and the keep rule of ringmpi/core/dropout.py, bit for
// bit: key (seed lo, seed hi); counter (j lo, i lo, (i >> 32) | (j >> 32) << 16,
// (batch_offset + b) * heads + head_offset + h) for query position i and key
// position j; kept iff output word 0 >= threshold = ceil(p * 2^32).  A kept
// weight is multiplied by rescale = 1 / (1 - p) (rounded to the compute type on
// the host).  The row sum l (and so lse) is taken before the factor: dropout
// changes what reaches P V, never the softmax denominator.

__device__ __forceinline__ unsigned int philox4x32_10_word0(unsigned int c0, unsigned int c1, unsigned int c2,
                                                            unsigned int c3, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {  // the key is bumped between rounds
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return c0;
}

struct DropoutArgs {
    int on;
    unsigned int k0, k1;
    unsigned long long threshold;
    long long heads, batch_offset, head_offset;
};

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

__device__ __forceinline__ bool dropout_keep(const DropoutArgs& dr, int b, int h, long long i, long long j) {
    const unsigned long long ui = (unsigned long long)i, uj = (unsigned long long)j;
    const unsigned int row = (unsigned int)((dr.batch_offset + b) * dr.heads + dr.head_offset + h);
    const unsigned int word = philox4x32_10_word0((unsigned int)uj, (unsigned int)ui,
                                                  (unsigned int)((ui >> 32) | ((uj >> 32) << 16)), row,
                                                  dr.k0, dr.k1);
    return (unsigned long long)word >= dr.threshold;
}

// The factor of weight (row, col) of a block (local indices): rescale when kept,
// 0 when dropped or outside the block.
template <typename T>
__device__ __forceinline__ T dropout_factor(const DropoutArgs& dr, T rescale, const MaskArgs& mk, int b, int h,
                                            int row, int col, int Sq, int Skv) {
    if (row >= Sq || col >= Skv) return T(0);
    return dropout_keep(dr, b, h, mk.q_pos[row], mk.kv_pos[col]) ? rescale : T(0);
}
