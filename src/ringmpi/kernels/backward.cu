// Backward block kernels (FlashAttention-2 order: one CTA per key tile and
// kv head, looping over the query heads of its GQA group and over query
// tiles).  Same arithmetic as NumpyBackend.backward_block:
//   P = exp((q k^T) * scale - lse)      (lse = -inf rows use +inf: P = 0)
//   dv += P^T do;  dS = P * (do v^T - dvec);  dq += dS k;  dk += dS^T q
// (dq and dk unscaled: the caller multiplies the finished sums by the scale)
// dk / dv of the CTA's key tile are accumulated in registers and added to
// global memory once (the CTA owns them); dq rows are shared by all key
// tiles and are updated with atomicAdd, the key tiles taking turns in a fixed
// order (dq_wait_turn below), so that dq is bitwise the same every run.
// Layouts: q, dq (B, H, Sq, D); do (B, H, Sq, Dv); lse, dvec (B, H, Sq);
// k, dk (B, Hkv, Skv, D); v, dv (B, Hkv, Skv, Dv); dq_turns (B, H, query tiles) int32,
// zeroed before each launch.  Grid: (kv tiles, B * Hkv).
// The value head dim Dv may differ from D (the SIMT kernel's DVP, default DP,
// is its padded bucket; the MMA kernel takes Dv <= DP at run time).

struct BwdArgs {
    int B, H, Hkv, Sq, Skv, D, nqt, nkt, Dv;
};
#define BWD_SHAPE_PARAMS int B, int H, int Hkv, int Sq, int Skv, int D, int nqt, int nkt, int Dv
#define BWD_SHAPE_INIT(a) const BwdArgs a = {B, H, Hkv, Sq, Skv, D, nqt, nkt, Dv}

// Ordered dq.  atomicAdd alone adds the key tiles' dq terms in whatever order their CTAs
// arrive, so the float sums (and dq's last bits) would change from run to run.  Instead the
// key tiles that add to the dq rows of one (b, h, query tile) take turns, the last key tile
// first: the turn of key tile kt is the number of key tiles after it that add to query tile qt
// (classify_tile, which every CTA evaluates alike), and turns[(b * H + h) * nqt + qt] (zeroed
// before the launch) counts the tiles that have added.  The grid's x runs over the key tiles
// from the last (x = 0), so a CTA only waits on CTAs of its own grid row with a smaller x,
// dispatched before it, and every wait ends; and each CTA walks its query tiles from the last.
// Under a causal mask the last key tiles see the fewest query tiles: in this order they add
// first and leave early, instead of holding their places until the first key tile, which
// has the most work, has added to every query tile.  Call all three at points every thread
// of the CTA reaches.
template <int NTH>
__device__ __forceinline__ int dq_turn_of(const MaskArgs& mk, int b, const BwdArgs& a, int qt, int kt, int tid) {
    int turn = 0;
    for (int base = kt + 1; base < a.nkt; base += NTH) {
        const int other = base + tid;
        turn += __syncthreads_count(other < a.nkt &&
                                    classify_tile(mk, b, a.B, qt, a.nqt, other, a.nkt) != TILE_SKIP);
    }
    return turn;
}

__device__ __forceinline__ void dq_wait_turn(int* turns, int turn, int tid) {
    if (tid == 0) {
        while (atomicAdd(turns, 0) != turn) __nanosleep(100);
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ void dq_end_turn(int* turns, int tid) {
    __threadfence();  // this thread's dq adds are done before the next tile's turn begins
    __syncthreads();
    if (tid == 0) atomicAdd(turns, 1);
}

// lse_s, dvec_s of query rows q0 .. q0 + BM of row base ``row0`` (threads tid,
// tid + NTH, ...): lse = -inf (a row that saw nothing) and rows past Sq read as
// +inf, so that P = 0 there.  Returns nonzero when one of this thread's rows has
// a NaN lse or a non-finite dvec (the step is then careful).
template <int BM, int NTH, typename T>
__device__ __forceinline__ int bwd_load_row_stats(T* lse_s, T* dvec_s, const T* __restrict__ lse,
                                                  const T* __restrict__ dvec, long long row0, int q0, int Sq,
                                                  int tid) {
    int bad = 0;
    for (int r = tid; r < BM; r += NTH) {
        T lv = pos_inf<T>(), dvv = T(0);
        if (q0 + r < Sq) {
            lv = lse[row0 + q0 + r];
            if (lv == neg_inf<T>()) lv = pos_inf<T>();
            dvv = dvec[row0 + q0 + r];
            bad |= (lv != lv) || !finite_acc(dvv);
        }
        lse_s[r] = lv;
        dvec_s[r] = dvv;
    }
    return bad;
}

// ---------------------------------------------------------------------------
// Tensor-core kernel for f16 / bf16 K/V (DP <= 128): 4 warps, 64 keys
// (16 per warp), BM query rows per inner step; q, do, P and dS are rounded
// to the K/V dtype for the MMAs, accumulation is float.
// BWD_MMA_BN (and BWD_SIMT_MAX_THREADS below) are ringmpi.kernels.TILE_DEFINES, -D defines of
// compile_options; the query rows BM are the template argument (kernels.bwd_mma_rows).
#if !defined(BWD_MMA_BN) || !defined(BWD_SIMT_MAX_THREADS)
#error "compile with ringmpi.kernels.compile_options: it defines the tile sizes (kernels.TILE_DEFINES)"
#endif

// The careful step of the tensor-core backward, for a (query tile, key tile)
// step whose operands hold a NaN/Inf: every sum runs over visible pairs only
// (pair_visible), in float on the same 16-bit P, dS, q, do, k values the MMAs
// would use, so the clean pairs round as in a clean run.  Registers hold P and
// dS in the score layout (thread: keys kl0 = warp * 16 + g and kl0 + 8,
// queries nt * 8 + 2c + (e & 1)); they reach each key's thread through the
// query-major tile ts (dSq).  These helpers contain no barrier: the
// __syncthreads() around them are at their call sites, inside `if (careful)`
// branches, which is correct only because `careful` is uniform per CTA (it
// comes from __syncthreads_or); never call one, or move its barriers, into a
// branch that can differ between threads of a CTA.
template <int NQ, int SS, bool BF16>
__device__ __forceinline__ void bwd_mma_store_scores(unsigned short* ts, const float (*x)[4], int warp, int g, int c) {
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int ql = nt * 8 + 2 * c + (e & 1);
            const int kl = warp * 16 + g + (e < 2 ? 0 : 8);
            ts[ql * SS + kl] = to_bits16<BF16>(x[nt][e]);
        }
    }
}

// acc[dt][e] (keys kl0, kl0 + 8; columns dt * 8 + 2c + (e & 1)) += sum over visible
// queries ql of w[ql][key] * x[ql][column], w from the query-major tile ts.
template <int DT, int BM, int SS, int RS, bool BF16>
__device__ __forceinline__ void bwd_mma_careful_key_sum(float (*acc)[4], const unsigned short* ts,
                                                        const unsigned short* x, int kl0, int c, int q0,
                                                        int k0, bool need_mask, const MaskArgs& mk, int b,
                                                        const BwdArgs& a) {
    for (int ql = 0; ql < BM; ++ql) {
        const bool vis0 = pair_visible(mk, need_mask, b, q0 + ql, k0 + kl0, a.Sq, a.Skv);
        const bool vis1 = pair_visible(mk, need_mask, b, q0 + ql, k0 + kl0 + 8, a.Sq, a.Skv);
        const float w0 = from_bits16<BF16>(ts[ql * SS + kl0]), w1 = from_bits16<BF16>(ts[ql * SS + kl0 + 8]);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float xv = from_bits16<BF16>(x[ql * RS + dt * 8 + 2 * c + (e & 1)]);
                acc[dt][e] = e < 2 ? visible_add(acc[dt][e], vis0, w0, xv) : visible_add(acc[dt][e], vis1, w1, xv);
            }
        }
    }
}

// dq rows (rg * 16 + g, + 8), columns d0 .. d0 + DW (the MMA's partition) +=
// sum over visible keys of dS[row][key] * k[key][column], dS from dSq.
template <int DW, int SS, int RS, int BN, bool BF16>
__device__ __forceinline__ void bwd_mma_careful_dq(float* __restrict__ dq, long long qbase, const unsigned short* dSq,
                                                   const unsigned short* Ks, int rg, int d0, int g, int c, int q0,
                                                   int k0, bool need_mask, const MaskArgs& mk, int b,
                                                   const BwdArgs& a) {
    for (int i = 0; i < 2; ++i) {
        const int ql = rg * 16 + g + 8 * i, row = q0 + ql;
        if (row >= a.Sq) continue;
        unsigned long long seen = 0;  // BN == 64 keys
        for (int kc = 0; kc < BN; ++kc)
            if (pair_visible(mk, need_mask, b, row, k0 + kc, a.Sq, a.Skv)) seen |= 1ull << kc;
        for (int dt = 0; dt < DW / 8; ++dt) {
            for (int e = 0; e < 2; ++e) {
                const int d = d0 + dt * 8 + 2 * c + e;
                if (d >= a.D) continue;
                float acc = 0.f;
                for (int kc = 0; kc < BN; ++kc)
                    acc = visible_add(acc, ((seen >> kc) & 1ull) != 0, from_bits16<BF16>(dSq[ql * SS + kc]),
                                      from_bits16<BF16>(Ks[kc * RS + d]));
                atomicAdd(dq + qbase + (long long)row * a.D + d, acc);
            }
        }
    }
}

template <int DP, bool BF16, int BM>
__global__ void __launch_bounds__(128) ringmpi_backward_mma(
    const float* __restrict__ q, const float* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dvec, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, float* __restrict__ dq, float* __restrict__ dk,
    float* __restrict__ dv, int* __restrict__ dq_turns, const float scale, MASK_PARAMS, MOD_PARAMS,
    DROPOUT_PARAMS(float), BWD_SHAPE_PARAMS) {
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    BWD_SHAPE_INIT(a);
    const float cap = (float)mk.softcap;
    constexpr int BN = BWD_MMA_BN;
    constexpr int RS = DP + 8;   // row stride of Ks, Vs, Qs, dOs   ([row][d])
    constexpr int KTS = BN + 8;  // row stride of Kt                 ([d][key])
    constexpr int QTS = BM + 8;  // row stride of Qt, dOt            ([d][query])
    constexpr int SS = BN + 8;   // row stride of dSq                ([query][key])
    constexpr int DT = DP / 8;
    constexpr int NQ = BM / 8;   // n-tiles of the (16 keys x BM queries) scores
    constexpr int RG = BM / 16;  // 16-row query groups for the dq product
    constexpr int DW = DP / (4 / RG);  // dq columns per warp
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* lse_s = reinterpret_cast<float*>(smem_raw);
    float* dvec_s = lse_s + BM;
    unsigned short* Ks = reinterpret_cast<unsigned short*>(dvec_s + BM);
    unsigned short* Kt = Ks + BN * RS;
    unsigned short* Vs = Kt + DP * KTS;
    unsigned short* Qs = Vs + BN * RS;
    unsigned short* Qt = Qs + BM * RS;
    unsigned short* dOs = Qt + DP * QTS;
    unsigned short* dOt = dOs + BM * RS;
    unsigned short* dSq = dOt + DP * QTS;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int kt = a.nkt - 1 - (int)blockIdx.x, bhk = cta_row();  // the last key tile at x = 0
    if (bhk >= a.B * a.Hkv) return;  // padding CTA of the last z slice
    const int b = bhk / a.Hkv, hk = bhk % a.Hkv;
    const int group = a.H / a.Hkv;
    const int k0 = kt * BN;
    const long long kvbase = (long long)bhk * a.Skv * a.D;
    const long long vbase = (long long)bhk * a.Skv * a.Dv;

    int bad_kv = 0;
    for (int idx = tid; idx < BN * DP; idx += 128) {
        const int r = idx / DP, d = idx % DP;
        unsigned short kx = 0, vx = 0;
        if (k0 + r < a.Skv) {
            if (d < a.D) kx = k[kvbase + (long long)(k0 + r) * a.D + d];
            if (d < a.Dv) vx = v[vbase + (long long)(k0 + r) * a.Dv + d];
            bad_kv |= nonfinite_bits16<BF16>(kx) || nonfinite_bits16<BF16>(vx);
        }
        Ks[r * RS + d] = kx;
        Kt[d * KTS + r] = kx;
        Vs[r * RS + d] = vx;
    }
    bad_kv = __syncthreads_or(bad_kv);  // a NaN/Inf in this key tile's K or V

    float dk_acc[DT][4], dv_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

    const bool ragged_kv = k0 + BN > a.Skv;
    const unsigned short* Kw = Ks + (warp * 16) * RS;
    const unsigned short* Vw = Vs + (warp * 16) * RS;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;  // this thread's keys
    bool touched = false;
    for (int hh = 0; hh < group; ++hh) {
        const int h = hk * group + hh;
        const HeadValues<float> hv = head_values<float>(mk, h);
        const long long bh = (long long)b * a.H + h;
        const long long qbase = bh * a.Sq * a.D;
        const long long obase = bh * a.Sq * a.Dv;
        for (int qt = a.nqt - 1; qt >= 0; --qt) {  // from the last query tile (dq turns)
            const int state = classify_tile(mk, b, a.B, qt, a.nqt, kt, a.nkt);
            if (state == TILE_SKIP) continue;
            touched = true;
            const bool need_mask = state == TILE_PARTIAL || ragged_kv;
            const int q0 = qt * BM;
            __syncthreads();  // previous step done with Qs / Qt / dOs / dOt / dSq
            int bad = 0;
            for (int idx = tid; idx < BM * DP; idx += 128) {
                const int r = idx / DP, d = idx % DP;
                float qx = 0.f, dx = 0.f;
                if (q0 + r < a.Sq) {
                    if (d < a.D) qx = q[qbase + (long long)(q0 + r) * a.D + d];
                    if (d < a.Dv) dx = dout[obase + (long long)(q0 + r) * a.Dv + d];
                }
                const unsigned short qb = to_bits16<BF16>(qx), db = to_bits16<BF16>(dx);
                bad |= nonfinite_bits16<BF16>(qb) || nonfinite_bits16<BF16>(db);
                Qs[r * RS + d] = qb;
                Qt[d * QTS + r] = qb;
                dOs[r * RS + d] = db;
                dOt[d * QTS + r] = db;
            }
            bad |= bwd_load_row_stats<BM, 128>(lse_s, dvec_s, lse, dvec, bh * a.Sq, q0, a.Sq, tid);
            const bool careful = __syncthreads_or(bad) || bad_kv;  // this step's operands hold a NaN/Inf

            // S^T (16 keys x BM queries) and dP^T = V dO^T
            float p[NQ][4], ds[NQ][4];
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) p[nt][e] = ds[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                unsigned int ak[4], av[4];
                ak[0] = lds32(Kw, g * RS + kk * 16 + 2 * c);
                ak[1] = lds32(Kw, (g + 8) * RS + kk * 16 + 2 * c);
                ak[2] = lds32(Kw, g * RS + kk * 16 + 2 * c + 8);
                ak[3] = lds32(Kw, (g + 8) * RS + kk * 16 + 2 * c + 8);
                av[0] = lds32(Vw, g * RS + kk * 16 + 2 * c);
                av[1] = lds32(Vw, (g + 8) * RS + kk * 16 + 2 * c);
                av[2] = lds32(Vw, g * RS + kk * 16 + 2 * c + 8);
                av[3] = lds32(Vw, (g + 8) * RS + kk * 16 + 2 * c + 8);
#pragma unroll
                for (int nt = 0; nt < NQ; ++nt) {
                    unsigned int bq[2], bd[2];
                    bq[0] = lds32(Qs, (nt * 8 + g) * RS + kk * 16 + 2 * c);
                    bq[1] = lds32(Qs, (nt * 8 + g) * RS + kk * 16 + 2 * c + 8);
                    bd[0] = lds32(dOs, (nt * 8 + g) * RS + kk * 16 + 2 * c);
                    bd[1] = lds32(dOs, (nt * 8 + g) * RS + kk * 16 + 2 * c + 8);
                    mma16816<BF16>(p[nt], ak, bq);
                    mma16816<BF16>(ds[nt], av, bd);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = nt * 8 + 2 * c + (e & 1);
                    const int key = e < 2 ? key0 : key1;
                    float s = p[nt][e] * scale, slope = 1.f;
                    if (score_modified(cap, hv)) s = modify_score(mk, cap, hv, q0 + ql, key, a.Sq, a.Skv, s, &slope);
                    const bool hidden = need_mask && !elem_visible(mk, b, q0 + ql, key, a.Sq, a.Skv);
                    if (hidden) s = neg_inf<float>();
                    // careful: a hidden pair is 0 even for a NaN lse, a NaN do v^T or a NaN slope
                    const float pe = (careful && hidden) ? 0.f : expf(s - lse_s[ql]);
                    // dropout: dV += (P Z)^T dO;  dS = P * (dP Z - dvec), then the softcap's slope
                    const float z = dr.on ? dropout_factor(dr, drop_rescale, mk, b, h, q0 + ql, key, a.Sq, a.Skv) : 1.f;
                    p[nt][e] = dr.on ? pe * z : pe;
                    const float dpz = dr.on ? ds[nt][e] * z : ds[nt][e];
                    ds[nt][e] = (careful && hidden) ? 0.f : pe * (dpz - dvec_s[ql]) * slope;
                }
            }
            // dV += P^T dO and dK += dS^T Q (k = queries); the score
            // accumulators are already in A-fragment layout
            if (!careful) {
#pragma unroll
                for (int kk = 0; kk < BM / 16; ++kk) {
                    unsigned int ap[4], as[4];
                    ap[0] = pack2<BF16>(p[2 * kk][0], p[2 * kk][1]);
                    ap[1] = pack2<BF16>(p[2 * kk][2], p[2 * kk][3]);
                    ap[2] = pack2<BF16>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
                    ap[3] = pack2<BF16>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
                    as[0] = pack2<BF16>(ds[2 * kk][0], ds[2 * kk][1]);
                    as[1] = pack2<BF16>(ds[2 * kk][2], ds[2 * kk][3]);
                    as[2] = pack2<BF16>(ds[2 * kk + 1][0], ds[2 * kk + 1][1]);
                    as[3] = pack2<BF16>(ds[2 * kk + 1][2], ds[2 * kk + 1][3]);
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt) {
                        unsigned int bo[2], bq[2];
                        bo[0] = lds32(dOt, (dt * 8 + g) * QTS + kk * 16 + 2 * c);
                        bo[1] = lds32(dOt, (dt * 8 + g) * QTS + kk * 16 + 2 * c + 8);
                        bq[0] = lds32(Qt, (dt * 8 + g) * QTS + kk * 16 + 2 * c);
                        bq[1] = lds32(Qt, (dt * 8 + g) * QTS + kk * 16 + 2 * c + 8);
                        mma16816<BF16>(dv_acc[dt], ap, bo);
                        mma16816<BF16>(dk_acc[dt], as, bq);
                    }
                }
            } else {  // dV += P^T dO over visible pairs, P through dSq (dK follows with dS below)
                bwd_mma_store_scores<NQ, SS, BF16>(dSq, p, warp, g, c);
                __syncthreads();
                bwd_mma_careful_key_sum<DT, BM, SS, RS, BF16>(dv_acc, dSq, dOs, warp * 16 + g, c, q0, k0,
                                                              need_mask, mk, b, a);
                __syncthreads();  // P read by every warp before dS overwrites dSq
            }
            // dS to shared memory, query-major, for dq = dS K
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = nt * 8 + 2 * c + (e & 1);
                    const int kl = warp * 16 + g + (e < 2 ? 0 : 8);
                    dSq[ql * SS + kl] = to_bits16<BF16>(ds[nt][e]);
                }
            }
            __syncthreads();
            int* const turns = dq_turns + bh * a.nqt + qt;
            dq_wait_turn(turns, dq_turn_of<128>(mk, b, a, qt, kt, tid), tid);
            if (careful) {  // dK += dS^T Q and dq += dS K over visible pairs
                bwd_mma_careful_key_sum<DT, BM, SS, RS, BF16>(dk_acc, dSq, Qs, warp * 16 + g, c, q0, k0,
                                                              need_mask, mk, b, a);
                bwd_mma_careful_dq<DW, SS, RS, BN, BF16>(dq, qbase, dSq, Ks, warp % RG, (warp / RG) * DW, g, c, q0,
                                                         k0, need_mask, mk, b, a);
            } else {
                const int rg = warp % RG, d0 = (warp / RG) * DW;
                unsigned int af[BN / 16][4];
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    af[kk][0] = lds32(dSq, (rg * 16 + g) * SS + kk * 16 + 2 * c);
                    af[kk][1] = lds32(dSq, (rg * 16 + g + 8) * SS + kk * 16 + 2 * c);
                    af[kk][2] = lds32(dSq, (rg * 16 + g) * SS + kk * 16 + 2 * c + 8);
                    af[kk][3] = lds32(dSq, (rg * 16 + g + 8) * SS + kk * 16 + 2 * c + 8);
                }
                const int qr0 = q0 + rg * 16 + g, qr1 = qr0 + 8;
#pragma unroll
                for (int dt = 0; dt < DW / 8; ++dt) {
                    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int kk = 0; kk < BN / 16; ++kk) {
                        unsigned int bk[2];
                        bk[0] = lds32(Kt, (d0 + dt * 8 + g) * KTS + kk * 16 + 2 * c);
                        bk[1] = lds32(Kt, (d0 + dt * 8 + g) * KTS + kk * 16 + 2 * c + 8);
                        mma16816<BF16>(acc, af[kk], bk);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = e < 2 ? qr0 : qr1;
                        const int d = d0 + dt * 8 + 2 * c + (e & 1);
                        if (row < a.Sq && d < a.D) atomicAdd(dq + qbase + (long long)row * a.D + d, acc[e]);
                    }
                }
            }
            dq_end_turn(turns, tid);
        }
    }
    if (!touched) return;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = e < 2 ? key0 : key1;
            const int d = dt * 8 + 2 * c + (e & 1);
            if (key < a.Skv && d < a.D) dk[kvbase + (long long)key * a.D + d] += dk_acc[dt][e];
            if (key < a.Skv && d < a.Dv) dv[vbase + (long long)key * a.Dv + d] += dv_acc[dt][e];
        }
    }
}

// ---------------------------------------------------------------------------
// SIMT kernel for every dtype (the exact path for float32 / float64, and the
// f16 / bf16 path for DP > 128): NTH = min(BWD_SIMT_MAX_THREADS, BN * BN) threads, BN keys and
// BN queries per step, TPR = NTH / BN threads per key row (BN = 8 keeps float64
// at DP > 128 within 99 KB of shared memory).  Shared tiles hold the compute type.
#define BWD_SIMT_THREADS(BN) ((BN) * (BN) < BWD_SIMT_MAX_THREADS ? (BN) * (BN) : BWD_SIMT_MAX_THREADS)
template <int DP, int KIND, int BN, int DVP = DP>
__global__ void __launch_bounds__(BWD_SIMT_THREADS(BN)) ringmpi_backward_simt(
    const typename Kind<KIND>::acc* __restrict__ q, const typename Kind<KIND>::acc* __restrict__ dout,
    const typename Kind<KIND>::acc* __restrict__ lse, const typename Kind<KIND>::acc* __restrict__ dvec,
    const typename Kind<KIND>::storage* __restrict__ k, const typename Kind<KIND>::storage* __restrict__ v,
    typename Kind<KIND>::acc* __restrict__ dq, typename Kind<KIND>::acc* __restrict__ dk,
    typename Kind<KIND>::acc* __restrict__ dv, int* __restrict__ dq_turns, const typename Kind<KIND>::acc scale,
    MASK_PARAMS, MOD_PARAMS, DROPOUT_PARAMS(typename Kind<KIND>::acc), BWD_SHAPE_PARAMS) {
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    BWD_SHAPE_INIT(a);
    typedef typename Kind<KIND>::acc T;
    const T cap = (T)mk.softcap;
    constexpr int BM = BN;
    constexpr int NTH = BWD_SIMT_THREADS(BN);
    constexpr int TPR = NTH / BN;
    constexpr int RS = DP + 1;    // row stride of Ks, Qs
    constexpr int VRS = DVP + 1;  // row stride of Vs, dOs
    constexpr int PS = BN + 1;
    constexpr int ND = DP / TPR;  // d columns per thread (dk, dq)
    constexpr int NDV = DVP / TPR;  // dv columns per thread
    constexpr int NDL = ND > NDV ? ND : NDV;
    constexpr int DL = DP > DVP ? DP : DVP;  // columns loaded per row
    constexpr int NR = BM / TPR;  // query rows per thread in the score step
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + BN * RS;
    T* Qs = Vs + BN * VRS;
    T* dOs = Qs + BM * RS;
    T* Ps = dOs + BM * VRS;     // [query][key]
    T* dSs = Ps + BM * PS;      // [query][key]
    T* lse_s = dSs + BM * PS;
    T* dvec_s = lse_s + BM;

    const int tid = threadIdx.x, cr = tid / TPR, j = tid % TPR;
    const int kt = a.nkt - 1 - (int)blockIdx.x, bhk = cta_row();  // the last key tile at x = 0
    if (bhk >= a.B * a.Hkv) return;  // padding CTA of the last z slice
    const int b = bhk / a.Hkv, hk = bhk % a.Hkv;
    const int group = a.H / a.Hkv;
    const int k0 = kt * BN, key = k0 + cr;
    const long long kvbase = (long long)bhk * a.Skv * a.D;
    const long long vbase = (long long)bhk * a.Skv * a.Dv;

    int bad_kv = 0;
    for (int idx = tid; idx < BN * DL; idx += NTH) {
        const int r = idx / DL, d = idx % DL;
        T kx = T(0), vx = T(0);
        if (k0 + r < a.Skv) {
            if (d < a.D) kx = load_acc<KIND>(k + kvbase + (long long)(k0 + r) * a.D + d);
            if (d < a.Dv) vx = load_acc<KIND>(v + vbase + (long long)(k0 + r) * a.Dv + d);
            bad_kv |= !(finite_acc(kx) && finite_acc(vx));
        }
        if (d < DP) Ks[r * RS + d] = kx;
        if (d < DVP) Vs[r * VRS + d] = vx;
    }
    bad_kv = __syncthreads_or(bad_kv);  // a NaN/Inf in this key tile's K or V
    T dk_acc[ND], dv_acc[NDV];
#pragma unroll
    for (int i = 0; i < ND; ++i) dk_acc[i] = T(0);
#pragma unroll
    for (int i = 0; i < NDV; ++i) dv_acc[i] = T(0);

    const bool ragged_kv = k0 + BN > a.Skv;
    bool touched = false;
    for (int hh = 0; hh < group; ++hh) {
        const int h = hk * group + hh;
        const HeadValues<T> hv = head_values<T>(mk, h);
        const long long bh = (long long)b * a.H + h;
        const long long qbase = bh * a.Sq * a.D;
        const long long obase = bh * a.Sq * a.Dv;
        for (int qt = a.nqt - 1; qt >= 0; --qt) {  // from the last query tile (dq turns)
            const int state = classify_tile(mk, b, a.B, qt, a.nqt, kt, a.nkt);
            if (state == TILE_SKIP) continue;
            touched = true;
            const bool need_mask = state == TILE_PARTIAL || ragged_kv;
            const int q0 = qt * BM;
            __syncthreads();
            int bad = 0;
            for (int idx = tid; idx < BM * DL; idx += NTH) {
                const int r = idx / DL, d = idx % DL;
                T qx = T(0), dx = T(0);
                if (q0 + r < a.Sq) {
                    if (d < a.D) qx = q[qbase + (long long)(q0 + r) * a.D + d];
                    if (d < a.Dv) dx = dout[obase + (long long)(q0 + r) * a.Dv + d];
                    bad |= !(finite_acc(qx) && finite_acc(dx));
                }
                if (d < DP) Qs[r * RS + d] = qx;
                if (d < DVP) dOs[r * VRS + d] = dx;
            }
            bad |= bwd_load_row_stats<BM, NTH>(lse_s, dvec_s, lse, dvec, bh * a.Sq, q0, a.Sq, tid);
            const bool careful = __syncthreads_or(bad) || bad_kv;
            // thread (key cr, lane-in-row j): queries j, j + TPR, ...
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const int ql = j + TPR * i;
                T s = dot4(Qs + ql * RS, Ks + cr * RS, a.D);  // the forward's arithmetic
                T dp = dot4(dOs + ql * VRS, Vs + cr * VRS, a.Dv);
                s *= scale;
                T slope = T(1);
                if (score_modified(cap, hv)) s = modify_score(mk, cap, hv, q0 + ql, key, a.Sq, a.Skv, s, &slope);
                const bool hidden = need_mask && !elem_visible(mk, b, q0 + ql, key, a.Sq, a.Skv);
                if (hidden) s = neg_inf<T>();
                const T pe = (careful && hidden) ? T(0) : exp_acc(s - lse_s[ql]);  // even for a NaN lse
                const T z = dr.on ? dropout_factor(dr, drop_rescale, mk, b, h, q0 + ql, key, a.Sq, a.Skv) : T(1);
                Ps[ql * PS + cr] = dr.on ? pe * z : pe;
                // a hidden pair: dS = 0 even when do v^T is NaN
                T dse = (careful && hidden) ? T(0) : pe * ((dr.on ? dp * z : dp) - dvec_s[ql]);
                if (cap != T(0) && !(careful && hidden)) dse *= slope;  // (a NaN score's slope is NaN)
                dSs[ql * PS + cr] = dse;
            }
            __syncthreads();
            // dv, dk of key cr, columns j, j + TPR, ...
            if (!careful) {
                for (int ql = 0; ql < BM; ++ql) {
                    const T pe = Ps[ql * PS + cr], dse = dSs[ql * PS + cr];
#pragma unroll
                    for (int i = 0; i < NDL; ++i) {
                        const int d = j + TPR * i;
                        if (i < NDV) dv_acc[i] += pe * dOs[ql * VRS + d];
                        if (i < ND) dk_acc[i] += dse * Qs[ql * RS + d];
                    }
                }
            } else {  // visible pairs only, whatever their weight
                for (int ql = 0; ql < BM; ++ql) {
                    const T pe = Ps[ql * PS + cr], dse = dSs[ql * PS + cr];
                    const bool vis = pair_visible(mk, need_mask, b, q0 + ql, key, a.Sq, a.Skv);
#pragma unroll
                    for (int i = 0; i < NDL; ++i) {
                        const int d = j + TPR * i;
                        if (i < NDV) dv_acc[i] = visible_add(dv_acc[i], vis, pe, dOs[ql * VRS + d]);
                        if (i < ND) dk_acc[i] = visible_add(dk_acc[i], vis, dse, Qs[ql * RS + d]);
                    }
                }
            }
            // dq of query row cr (BM == BN), columns j, j + TPR, ...: summed here, added in turn
            const int row = q0 + cr;
            T dq_part[ND];
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                const int d = j + TPR * i;
                T acc = T(0);
                if (row < a.Sq && d < a.D) {
                    if (!careful) {
                        for (int kc = 0; kc < BN; ++kc) acc += dSs[cr * PS + kc] * Ks[kc * RS + d];
                    } else {
                        for (int kc = 0; kc < BN; ++kc)
                            acc = visible_add(acc, pair_visible(mk, need_mask, b, row, k0 + kc, a.Sq, a.Skv),
                                              dSs[cr * PS + kc], Ks[kc * RS + d]);
                    }
                }
                dq_part[i] = acc;
            }
            int* const turns = dq_turns + bh * a.nqt + qt;
            dq_wait_turn(turns, dq_turn_of<NTH>(mk, b, a, qt, kt, tid), tid);
            if (row < a.Sq) {
#pragma unroll
                for (int i = 0; i < ND; ++i) {
                    const int d = j + TPR * i;
                    if (d < a.D) atomicAdd(dq + qbase + (long long)row * a.D + d, dq_part[i]);
                }
            }
            dq_end_turn(turns, tid);
        }
    }
    if (!touched || key >= a.Skv) return;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        const int d = j + TPR * i;
        if (d < a.D) dk[kvbase + (long long)key * a.D + d] += dk_acc[i];
    }
#pragma unroll
    for (int i = 0; i < NDV; ++i) {
        const int d = j + TPR * i;
        if (d < a.Dv) dv[vbase + (long long)key * a.Dv + d] += dv_acc[i];
    }
}
