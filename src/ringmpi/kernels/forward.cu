// Forward block kernels: fold one visiting K/V block into the online-softmax
// state (o_acc, m, l) of the resident queries, in place.  Same arithmetic as
// NumpyBackend.forward_block, with s = (q k^T) * scale:
//   m_new = max(m, rowmax(s)); shift = (m_new == -inf) ? 0 : m_new
//   p = exp(s - shift); alpha = exp(m - shift)
//   l = l * alpha + rowsum(p); o_acc = o_acc * alpha + p @ v; m = m_new
// Layouts: q (B, H, Sq, D); o_acc (B, H, Sq, Dv); m, l (B, H, Sq); k (B, Hkv, Skv, D);
// v (B, Hkv, Skv, Dv); kv head of query head h is h / (H / Hkv).  Grid: (q tiles, B * H).
// The value head dim Dv may differ from D: DVP (default DP) is its padded bucket.

// Shape parameters; nqt / nkt count q / kv tiles in the kernel's tile sizes.
struct FwdArgs {
    int B, H, Hkv, Sq, Skv, D, nqt, nkt, Dv;
};
#define FWD_SHAPE_PARAMS int B, int H, int Hkv, int Sq, int Skv, int D, int nqt, int nkt, int Dv
#define FWD_SHAPE_INIT(a) const FwdArgs a = {B, H, Hkv, Sq, Skv, D, nqt, nkt, Dv}

// ---------------------------------------------------------------------------
// Tensor-core kernel for f16 / bf16 K/V: 4 warps, 64 query rows (16 per warp),
// 64-key tiles, mma.m16n8k16 with float accumulation.  DP: head dim rounded up to a
// multiple of 32 (zero padded), D <= DP at run time.  q (float) is rounded to
// the K/V dtype in shared memory; the scale multiplies the float product.
// The tile sizes FWD_MMA_BM, FWD_MMA_BN (and FWD_SIMT_BM below) are ringmpi.kernels.TILE_DEFINES,
// -D defines of compile_options, the numbers the launch planning uses.
#if !defined(FWD_MMA_BM) || !defined(FWD_MMA_BN) || !defined(FWD_SIMT_BM)
#error "compile with ringmpi.kernels.compile_options: it defines the tile sizes (kernels.TILE_DEFINES)"
#endif

// The products p * v of the V elements that are NaN/Inf (stored as 0 in the
// tile for the MMA), added for visible keys only: o[row][d] += p[row][key] *
// v[key][d].  p of a key lives in one lane of the row's quad (shuffled over);
// the loop runs uniformly over the tile's keys, only for a tile with such values.
template <int NT, int DT, bool BF16>
__device__ __forceinline__ void fwd_mma_add_bad_v(float (*o)[4], const float (*s)[4],
                                                  const unsigned short* __restrict__ v, long long vbase,
                                                  int k0, int row0, int row1, int g, int c, int lane,
                                                  bool need_mask, const MaskArgs& mk, int b, const FwdArgs& a) {
    for (int cc = 0; cc < NT * 8; ++cc) {
        const int key = k0 + cc, nt = cc >> 3, owner = (lane & ~3) | ((cc & 7) >> 1), e_lo = cc & 1;
        float mine0 = 0.f, mine1 = 0.f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t == nt) {
                mine0 = e_lo ? s[t][1] : s[t][0];
                mine1 = e_lo ? s[t][3] : s[t][2];
            }
        }
        const float p0 = __shfl_sync(0xffffffffu, mine0, owner);
        const float p1 = __shfl_sync(0xffffffffu, mine1, owner);
        if (key >= a.Skv) continue;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int d = dt * 8 + 2 * c + (e & 1);
                if (d >= a.Dv) continue;
                const unsigned short bits = v[vbase + (long long)key * a.Dv + d];
                if ((bits & 0x7fffu) < (BF16 ? 0x7f80u : 0x7c00u)) continue;
                const int row = e < 2 ? row0 : row1;
                if (need_mask && !elem_visible(mk, b, row, key, a.Sq, a.Skv)) continue;
                const float vd = BF16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
                o[dt][e] += (e < 2 ? p0 : p1) * vd;
            }
        }
    }
}

template <int DP, bool BF16, int DVP = DP>
__global__ void __launch_bounds__(128) ringmpi_forward_mma(
    const float* __restrict__ q, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, float* __restrict__ o_acc,
    float* __restrict__ m_state, float* __restrict__ l_state, const float scale, MASK_PARAMS,
    MOD_PARAMS, DROPOUT_PARAMS(float), FWD_SHAPE_PARAMS) {
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    FWD_SHAPE_INIT(a);
    const float cap = (float)mk.softcap;
    constexpr int BM = FWD_MMA_BM, BN = FWD_MMA_BN;
    constexpr int QS = DP + 8;   // row stride (elements) of Qs and Ks
    constexpr int VS = BN + 8;   // row stride of Vt (V transposed: [d][key])
    constexpr int NT = BN / 8;   // n-tiles of S
    constexpr int DT = DVP / 8;  // n-tiles of O
    constexpr int DL = DP > DVP ? DP : DVP;  // columns loaded per K/V row
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned short* Qs = reinterpret_cast<unsigned short*>(smem_raw);
    unsigned short* Ks = Qs + BM * QS;
    unsigned short* Vt = Ks + BN * QS;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int qt = blockIdx.x, bh = cta_row();
    if (bh >= a.B * a.H) return;  // padding CTA of the last z slice
    const int b = bh / a.H, h = bh % a.H;
    const HeadValues<float> hv = head_values<float>(mk, h);
    const int hk = h / (a.H / a.Hkv);
    const int q0 = qt * BM;
    const long long qbase = ((long long)bh * a.Sq) * a.D;
    const long long obase = ((long long)bh * a.Sq) * a.Dv;
    const long long kvbase = ((long long)b * a.Hkv + hk) * (long long)a.Skv * a.D;
    const long long vbase = ((long long)b * a.Hkv + hk) * (long long)a.Skv * a.Dv;

    for (int idx = tid; idx < BM * DP; idx += 128) {
        const int r = idx / DP, d = idx % DP;
        float x = 0.f;
        if (q0 + r < a.Sq && d < a.D) x = q[qbase + (long long)(q0 + r) * a.D + d];
        Qs[r * QS + d] = to_bits16<BF16>(x);
    }

    // this thread's two rows: r0 = warp*16 + g, r1 = r0 + 8
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
    float m_r[2], l_r[2];
    float o[DT][4];
    m_r[0] = row0 < a.Sq ? m_state[(long long)bh * a.Sq + row0] : neg_inf<float>();
    m_r[1] = row1 < a.Sq ? m_state[(long long)bh * a.Sq + row1] : neg_inf<float>();
    l_r[0] = row0 < a.Sq ? l_state[(long long)bh * a.Sq + row0] : 0.f;
    l_r[1] = row1 < a.Sq ? l_state[(long long)bh * a.Sq + row1] : 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = e < 2 ? row0 : row1;
            const int d = dt * 8 + 2 * c + (e & 1);
            o[dt][e] = (row < a.Sq && d < a.Dv) ? o_acc[obase + (long long)row * a.Dv + d] : 0.f;
        }
    }

    bool touched = false;
    for (int kt = 0; kt < a.nkt; ++kt) {
        const int state = classify_tile(mk, b, a.B, qt, a.nqt, kt, a.nkt);
        if (state == TILE_SKIP) continue;
        touched = true;
        const int k0 = kt * BN;
        const bool need_mask = state == TILE_PARTIAL || k0 + BN > a.Skv;
        __syncthreads();  // previous tile's Ks / Vt fully consumed
        int bad_v = 0;
        for (int idx = tid; idx < BN * DL; idx += 128) {
            const int r = idx / DL, d = idx % DL;
            unsigned short kx = 0, vx = 0;
            if (k0 + r < a.Skv) {
                if (d < a.D) kx = k[kvbase + (long long)(k0 + r) * a.D + d];
                if (d < a.Dv) vx = v[vbase + (long long)(k0 + r) * a.Dv + d];
                if ((vx & 0x7fffu) >= (BF16 ? 0x7f80u : 0x7c00u)) {  // NaN/Inf: its product is added below
                    bad_v = 1;
                    vx = 0;
                }
            }
            if (d < DP) Ks[r * QS + d] = kx;
            if (d < DVP) Vt[d * VS + r] = vx;
        }
        const bool careful = __syncthreads_or(bad_v);

        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        const unsigned short* Qw = Qs + (warp * 16) * QS;
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
            unsigned int af[4];
            af[0] = lds32(Qw, g * QS + kk * 16 + 2 * c);
            af[1] = lds32(Qw, (g + 8) * QS + kk * 16 + 2 * c);
            af[2] = lds32(Qw, g * QS + kk * 16 + 2 * c + 8);
            af[3] = lds32(Qw, (g + 8) * QS + kk * 16 + 2 * c + 8);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned int bf[2];
                bf[0] = lds32(Ks, (nt * 8 + g) * QS + kk * 16 + 2 * c);
                bf[1] = lds32(Ks, (nt * 8 + g) * QS + kk * 16 + 2 * c + 8);
                mma16816<BF16>(s[nt], af, bf);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
        if (score_modified(cap, hv)) {
            float unused;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[nt][e] = modify_score(mk, cap, hv, e < 2 ? row0 : row1, k0 + nt * 8 + 2 * c + (e & 1),
                                            a.Sq, a.Skv, s[nt][e], &unused);
        }
        if (need_mask) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = e < 2 ? row0 : row1;
                    const int col = k0 + nt * 8 + 2 * c + (e & 1);
                    if (!elem_visible(mk, b, row, col, a.Sq, a.Skv)) s[nt][e] = neg_inf<float>();
                }
            }
        }
        // online softmax, rows r0 (e = 0, 1) and r1 (e = 2, 3); a row's 4
        // values per n-tile live in the 4 lanes of one quad
        float alpha[2], shift[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = neg_inf<float>();
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = max_acc(mx, max_acc(s[nt][2 * i], s[nt][2 * i + 1]));
            mx = max_acc(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = max_acc(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = max_acc(m_r[i], mx);
            shift[i] = m_new == neg_inf<float>() ? 0.f : m_new;
            alpha[i] = expf(m_r[i] - shift[i]);
            m_r[i] = m_new;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = expf(s[nt][e] - shift[e >> 1]);
                rs[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
            l_r[i] = l_r[i] * alpha[i] + rs[i];
        }
        if (dr.on) {  // dropout after the row sums: l keeps every weight
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = e < 2 ? row0 : row1;
                    const int col = k0 + nt * 8 + 2 * c + (e & 1);
                    s[nt][e] *= dropout_factor(dr, drop_rescale, mk, b, h, row, col, a.Sq, a.Skv);
                }
            }
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }
        // O += P V: the S accumulator layout of n-tiles (2j, 2j+1) is the A
        // fragment layout of k-step j
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned int af[4];
            af[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
            af[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
            af[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            af[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                unsigned int bf[2];
                bf[0] = lds32(Vt, (dt * 8 + g) * VS + kk * 16 + 2 * c);
                bf[1] = lds32(Vt, (dt * 8 + g) * VS + kk * 16 + 2 * c + 8);
                mma16816<BF16>(o[dt], af, bf);
            }
        }
        if (careful) fwd_mma_add_bad_v<NT, DT, BF16>(o, s, v, vbase, k0, row0, row1, g, c, lane, need_mask, mk, b, a);
    }
    if (!touched) return;
    if (c == 0) {
        if (row0 < a.Sq) { m_state[(long long)bh * a.Sq + row0] = m_r[0]; l_state[(long long)bh * a.Sq + row0] = l_r[0]; }
        if (row1 < a.Sq) { m_state[(long long)bh * a.Sq + row1] = m_r[1]; l_state[(long long)bh * a.Sq + row1] = l_r[1]; }
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = e < 2 ? row0 : row1;
            const int d = dt * 8 + 2 * c + (e & 1);
            if (row < a.Sq && d < a.Dv) o_acc[obase + (long long)row * a.Dv + d] = o[dt][e];
        }
    }
}

// ---------------------------------------------------------------------------
// SIMT kernel for every dtype (the exact path for float32 and float64):
// 128 threads, FWD_SIMT_BM query rows, 4 threads per row; key tiles of BN rows.
// Shared tiles hold the compute type; D <= DP at run time.

template <int DP, int KIND, int BN, int DVP = DP>
__global__ void __launch_bounds__(128) ringmpi_forward_simt(
    const typename Kind<KIND>::acc* __restrict__ q, const typename Kind<KIND>::storage* __restrict__ k,
    const typename Kind<KIND>::storage* __restrict__ v, typename Kind<KIND>::acc* __restrict__ o_acc,
    typename Kind<KIND>::acc* __restrict__ m_state, typename Kind<KIND>::acc* __restrict__ l_state,
    const typename Kind<KIND>::acc scale, MASK_PARAMS, MOD_PARAMS, DROPOUT_PARAMS(typename Kind<KIND>::acc),
    FWD_SHAPE_PARAMS) {
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    FWD_SHAPE_INIT(a);
    typedef typename Kind<KIND>::acc T;
    const T cap = (T)mk.softcap;
    constexpr int BM = FWD_SIMT_BM, TPR = 4;
    constexpr int RS = DP + 1;   // row stride of Qs, Ks
    constexpr int VRS = DVP + 1; // row stride of Vs
    constexpr int PS = BN + 1;   // row stride of Ps
    constexpr int NC = BN / TPR; // score columns per thread
    constexpr int ND = DVP / TPR; // output columns per thread
    constexpr int DL = DP > DVP ? DP : DVP;  // columns loaded per K/V row
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* Ks = Qs + BM * RS;
    T* Vs = Ks + BN * RS;
    T* Ps = Vs + BN * VRS;

    const int tid = threadIdx.x, r = tid / TPR, j = tid % TPR;
    const int qt = blockIdx.x, bh = cta_row();
    if (bh >= a.B * a.H) return;  // padding CTA of the last z slice
    const int b = bh / a.H, h = bh % a.H;
    const HeadValues<T> hv = head_values<T>(mk, h);
    const int hk = h / (a.H / a.Hkv);
    const int q0 = qt * BM, row = q0 + r;
    const long long qbase = ((long long)bh * a.Sq) * a.D;
    const long long obase = ((long long)bh * a.Sq) * a.Dv;
    const long long kvbase = ((long long)b * a.Hkv + hk) * (long long)a.Skv * a.D;
    const long long vbase = ((long long)b * a.Hkv + hk) * (long long)a.Skv * a.Dv;

    for (int idx = tid; idx < BM * DP; idx += 128) {
        const int rr = idx / DP, d = idx % DP;
        Qs[rr * RS + d] = (q0 + rr < a.Sq && d < a.D) ? q[qbase + (long long)(q0 + rr) * a.D + d] : T(0);
    }
    T m_r = row < a.Sq ? m_state[(long long)bh * a.Sq + row] : neg_inf<T>();
    T l_r = row < a.Sq ? l_state[(long long)bh * a.Sq + row] : T(0);
    T o[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const int d = j + TPR * i;
        o[i] = (row < a.Sq && d < a.Dv) ? o_acc[obase + (long long)row * a.Dv + d] : T(0);
    }

    bool touched = false;
    for (int kt = 0; kt < a.nkt; ++kt) {
        const int state = classify_tile(mk, b, a.B, qt, a.nqt, kt, a.nkt);
        if (state == TILE_SKIP) continue;
        touched = true;
        const int k0 = kt * BN;
        const bool need_mask = state == TILE_PARTIAL || k0 + BN > a.Skv;
        __syncthreads();
        int bad_v = 0;
        for (int idx = tid; idx < BN * DL; idx += 128) {
            const int rr = idx / DL, d = idx % DL;
            T kx = T(0), vx = T(0);
            if (k0 + rr < a.Skv) {
                if (d < a.D) kx = load_acc<KIND>(k + kvbase + (long long)(k0 + rr) * a.D + d);
                if (d < a.Dv) vx = load_acc<KIND>(v + vbase + (long long)(k0 + rr) * a.Dv + d);
                bad_v |= !finite_acc(vx);
            }
            if (d < DP) Ks[rr * RS + d] = kx;
            if (d < DVP) Vs[rr * VRS + d] = vx;
        }
        const bool careful = __syncthreads_or(bad_v);  // a NaN/Inf in this V tile

        // the scores: common.cuh's dot4(q row, key row, D) for each of the thread's NC keys (Dot4:
        // per key the same partials, products and order as dot4), with the key loop inside the
        // column loop, so that each q value is read once for all NC keys
        Dot4<T> dots[NC];
        for (int d = 0; d < a.D; d += 4) {
            const T q0v = Qs[r * RS + d], q1v = Qs[r * RS + d + 1], q2v = Qs[r * RS + d + 2],
                    q3v = Qs[r * RS + d + 3];
#pragma unroll
            for (int i = 0; i < NC; ++i) dots[i].add(q0v, q1v, q2v, q3v, Ks + (j + TPR * i) * RS + d);
        }
        T s[NC];
#pragma unroll
        for (int i = 0; i < NC; ++i) s[i] = dots[i].sum();
        T mx = neg_inf<T>();
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            s[i] *= scale;
            if (score_modified(cap, hv)) {
                T unused;
                s[i] = modify_score(mk, cap, hv, row, k0 + j + TPR * i, a.Sq, a.Skv, s[i], &unused);
            }
            if (need_mask && !elem_visible(mk, b, row, k0 + j + TPR * i, a.Sq, a.Skv)) s[i] = neg_inf<T>();
            mx = max_acc(mx, s[i]);
        }
        mx = max_acc(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = max_acc(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const T m_new = max_acc(m_r, mx);
        const T shift = m_new == neg_inf<T>() ? T(0) : m_new;
        const T alpha = exp_acc(m_r - shift);
        m_r = m_new;
        T rs = T(0);
#pragma unroll
        for (int i = 0; i < NC; ++i) {
            const T p = exp_acc(s[i] - shift);
            rs += p;
            Ps[r * PS + j + TPR * i] =
                dr.on ? p * dropout_factor(dr, drop_rescale, mk, b, h, row, k0 + j + TPR * i, a.Sq, a.Skv) : p;
        }
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        rs += __shfl_xor_sync(0xffffffffu, rs, 2);
        l_r = l_r * alpha + rs;
        __syncwarp();  // the row's P values come from the 4 lanes of its quad
#pragma unroll
        for (int i = 0; i < ND; ++i) o[i] *= alpha;
        if (!careful) {
            for (int cc = 0; cc < BN; ++cc) {
                const T p = Ps[r * PS + cc];
#pragma unroll
                for (int i = 0; i < ND; ++i) o[i] += p * Vs[cc * VRS + j + TPR * i];
            }
        } else {  // a hidden key (p = 0) must not add 0 * NaN; a visible one adds p * v whatever p is
            for (int cc = 0; cc < BN; ++cc) {
                const T p = Ps[r * PS + cc];
                const bool vis = pair_visible(mk, need_mask, b, row, k0 + cc, a.Sq, a.Skv);
#pragma unroll
                for (int i = 0; i < ND; ++i) o[i] = visible_add(o[i], vis, p, Vs[cc * VRS + j + TPR * i]);
            }
        }
        __syncwarp();  // Ps is rewritten by the next tile
    }
    if (!touched || row >= a.Sq) return;
    if (j == 0) {
        m_state[(long long)bh * a.Sq + row] = m_r;
        l_state[(long long)bh * a.Sq + row] = l_r;
    }
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const int d = j + TPR * i;
        if (d < a.Dv) o_acc[obase + (long long)row * a.Dv + d] = o[i];
    }
}
