// Finalisation of the online-softmax state, the backward row dot product,
// and bfloat16 conversions (CuPy has no bfloat16 dtype: bf16 data lives in
// uint16 arrays).

// o (B, Sq, H, D) in OUT_KIND = o_acc / l; lse (B, H, Sq) = m + log l.
// Rows with l == 0 saw no key: o = 0, lse = -inf; a NaN l gives NaN o and lse.  One thread per element
// of o_acc (B, H, Sq, D), grid-stride.
template <int ACC_KIND, int OUT_KIND>
__global__ void ringmpi_finalize(const typename Kind<ACC_KIND>::acc* __restrict__ o_acc,
                                 const typename Kind<ACC_KIND>::acc* __restrict__ m,
                                 const typename Kind<ACC_KIND>::acc* __restrict__ l,
                                 typename Kind<OUT_KIND>::storage* __restrict__ o,
                                 typename Kind<ACC_KIND>::acc* __restrict__ lse, int B, int H, int Sq, int D) {
    typedef typename Kind<ACC_KIND>::acc T;
    const long long total = (long long)B * H * Sq * D;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(idx % D);
        const long long row = idx / D;  // (b * H + h) * Sq + s
        const int s = (int)(row % Sq);
        const long long bh = row / Sq;
        const int h = (int)(bh % H), b = (int)(bh / H);
        const T lr = l[row];
        const bool seen = lr != T(0);  // a NaN sum (the row saw NaN/Inf) gives NaN, never "saw no key"
        const T val = seen ? o_acc[idx] / lr : T(0);
        o[(((long long)b * Sq + s) * H + h) * D + d] = from_float<OUT_KIND>((double)val);
        if (d == 0) lse[row] = seen ? m[row] + log_acc(lr) : neg_inf<T>();
    }
}

// dvec (B, H, Sq) = rowsum(do * o) over D, both (B, H, Sq, D) in the compute
// type.  One warp per row.
template <int ACC_KIND>
__global__ void ringmpi_rowdot(const typename Kind<ACC_KIND>::acc* __restrict__ x,
                               const typename Kind<ACC_KIND>::acc* __restrict__ y,
                               typename Kind<ACC_KIND>::acc* __restrict__ out, long long rows, int D) {
    typedef typename Kind<ACC_KIND>::acc T;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
         row += warps) {
        T acc = T(0);
        for (int d = lane; d < D; d += 32) acc += x[row * D + d] * y[row * D + d];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) out[row] = acc;
    }
}

// Elementwise conversion between kinds (used for bfloat16, which CuPy's
// astype cannot do), round to nearest even.
template <int IN_KIND, int OUT_KIND>
__global__ void ringmpi_convert(const typename Kind<IN_KIND>::storage* __restrict__ x,
                                typename Kind<OUT_KIND>::storage* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = from_float<OUT_KIND>((double)load_acc<IN_KIND>(x + i));
}
