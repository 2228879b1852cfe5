// invariant=True on the GPU: the three block kernels of ringmpi.backends.invariant_device,
// the CUDA twin of ringmpi.backends.invariant_tiles (same passes, same fixed-point rules;
// not the same bits as the CPU: the same bits for every P on this GPU and backend).
//
// The unit is a pair (query tile, key tile) of 64 global positions each
// (ringmpi.core.global_tiles): a tile's slot s holds global position 64 t + s, or a pad
// (slot map -1).  Every float a pair contributes is computed by one thread in a loop over
// the pair's slots in slot order (global position order), from the rows' own values, so it
// is the same bits whichever rank holds the pair and whatever else that rank holds; each such
// partial sum is then added to int64 fixed point (fixed_add: y = (x * row) * col, truncated
// toward zero; two words for float64), and integer addition is order-free.
//
//   ringmpi_inv_max      pass 1: each row's largest visible score (max is exact in any order)
//   ringmpi_inv_forward  pass 2: l = sum exp(s - M), o numerator sum exp(s - M) z v, in fixed point
//   ringmpi_inv_backward dq (int64 atomics: order-free), dK / dV partials of one key tile
//
// Scores are formed by inv_score in all three (this file is compiled with --fmad=false, so
// pass 1 and pass 2 give a score the same bits and p = exp(s - M) <= 1).  Non-finite inputs:
// the host zeroes flagged rows (q, do, lse, dvec) and keys (k, v) and passes the flags; a row
// that sees a flagged key, or is flagged and sees any key, is poisoned (NaN), and in the
// backward so is every key such a pair holds, as invariant_tiles states.  The kernels have
// one thread per tile slot (64 per CTA), no tensor cores: simple first, fast later.

// INV_TILE (64 global positions, one thread each) and INV_STRIDE (the shared-memory row stride of
// the backward's 64 x 64 tile) come as -D defines from ringmpi.kernels.INVARIANT_DEFINES.

// The fixed-point split is ringmpi.core.fixed_split's, as -D defines (exact doubles, from their
// IEEE bits): FIXED_LIMIT_1 and FIXED_LIMIT_2 (the one- and two-word ranges, 2^62 and 2^92),
// FIXED_LIMB and FIXED_LIMB_INV (2^30 and 2^-30: the two-word split); _ext/fixed.c takes the same.
#if !defined(FIXED_LIMIT_1) || !defined(FIXED_LIMIT_2) || !defined(FIXED_LIMB) || !defined(FIXED_LIMB_INV)
#error "compile with ringmpi.kernels.compile_options: it defines FIXED_* from ringmpi.core.fixed_split"
#endif
__device__ __forceinline__ double inv_range(int limbs) { return limbs == 1 ? FIXED_LIMIT_1 : FIXED_LIMIT_2; }

// Add y (already on the grid) to the words at w (w[0], and w[c_off] for the low word), or
// return false when |y| is beyond the range (or NaN): the caller flags the row and adds nothing.
template <bool ATOMIC>
__device__ __forceinline__ bool fixed_add(long long* w, long long c_off, int limbs, double y) {
    if (!(fabs(y) < inv_range(limbs))) return false;
    long long hi, lo = 0;
    if (limbs == 1) {
        hi = __double2ll_rz(y);
    } else {
        const double h = trunc(y * FIXED_LIMB_INV);      // y 2^-30
        hi = __double2ll_rz(h);
        lo = __double2ll_rz(y - h * FIXED_LIMB);          // y - hi 2^30
    }
    if (ATOMIC) {
        atomicAdd(reinterpret_cast<unsigned long long*>(w), (unsigned long long)hi);
        if (limbs == 2) atomicAdd(reinterpret_cast<unsigned long long*>(w + c_off), (unsigned long long)lo);
    } else {
        w[0] += hi;
        if (limbs == 2) w[c_off] += lo;
    }
    return true;
}

// x . y over d < n by common.cuh's Dot4 (four partial sums over d mod 4, added pairwise); the
// rows here are not padded, so the columns after the last multiple of 4 add to s0 (add_one)
template <typename T>
__device__ __forceinline__ T inv_dot(const T* __restrict__ x, const T* __restrict__ y, int n) {
    Dot4<T> acc;
    int d = 0;
    for (; d + 3 < n; d += 4) acc.add(x[d], x[d + 1], x[d + 2], x[d + 3], y + d);
    for (; d < n; ++d) acc.add_one(x[d], y[d]);
    return acc.sum();
}

// The score of local query row qi and local key row kj: scale q.k, then the modifiers
// (modify_score: softcap, ALiBi); *slope its derivative.
template <typename T>
__device__ __forceinline__ T inv_score(const MaskArgs& mk, T cap, const HeadValues<T>& hv, const T* qrow,
                                       const T* krow, int D, T scale, int qi, int kj, int Sq, int Skv, T* slope) {
    return modify_score<T>(mk, cap, hv, qi, kj, Sq, Skv, inv_dot<T>(qrow, krow, D) * scale, slope);
}

// Whether the pair class cls lets local rows (qi, kj) see each other (pads excluded by the caller).
__device__ __forceinline__ bool inv_visible(const MaskArgs& mk, int cls, int b, int qi, int kj, int Sq, int Skv) {
    return cls == TILE_FULL || elem_visible(mk, b, qi, kj, Sq, Skv);
}

// One partial sum per column of a tile pair: for each column d < n, sum_i w[i] x[rows[i], d] over
// the tile's slots i in order (pads, rows[i] < 0, skipped), then y = (sum * rs) * g[d] added to out[d]
// (low words at out[n + d]), by atomics when several CTAs add to out.  A key's dv and dk terms over
// a query tile (rs = 1, exact) and a row's dq terms over a key tile.  False when a value was beyond
// its grid (that value adds nothing).
template <typename T, bool ATOMIC>
__device__ __forceinline__ bool inv_add_rows(long long* out, const T* w, const T* __restrict__ x,
                                             const int* __restrict__ rows, int n, int limbs, double rs,
                                             const double* __restrict__ g) {
    bool ok = true;
    for (int d = 0; d < n; ++d) {
        T a = T(0);
        for (int i = 0; i < INV_TILE; ++i)
            if (rows[i] >= 0) a += w[i] * x[(long long)rows[i] * n + d];
        ok = fixed_add<ATOMIC>(out + d, n, limbs, ((double)a * rs) * g[d]) && ok;
    }
    return ok;
}

#define INV_SHAPE int B, int H, int Hkv, int Sq, int Skv, int D, int Dv, int nqt, int nkt
#define INV_TILES                                                                                      \
    const int* __restrict__ q_slot, const int* __restrict__ k_slot, const signed char* __restrict__ classes, \
    int class_batch, const unsigned char* __restrict__ bad_q, const unsigned char* __restrict__ bad_k

// One query row of a max / forward CTA (row = cta_row(), thread = slot of query tile
// blockIdx.x): its batch entry, head and K/V head, local row qi (-1: a pad slot), the offsets
// of its q row (qr) and of its K/V head's rows (kvrow), its slot in the (B, H, nqt, 64) state
// (at), its flag, its q row and its classes against the key tiles.
template <typename T>
struct InvRow {
    int b, h, hkv, qi;
    long long qr, kvrow, at;
    bool bad;
    const T* qrow;
    const signed char* cls;
};

template <typename T>
__device__ __forceinline__ InvRow<T> inv_row(const T* q, const int* q_slot, const signed char* classes,
                                             int class_batch, const unsigned char* bad_q, int row, int H, int Hkv,
                                             int Sq, int Skv, int D, int nqt, int nkt) {
    InvRow<T> w;
    const int qt = blockIdx.x, r = threadIdx.x;
    w.b = row / H;
    w.h = row % H;
    w.hkv = w.h / (H / Hkv);
    w.qi = q_slot[qt * INV_TILE + r];
    w.qr = (long long)row * Sq + (w.qi < 0 ? 0 : w.qi);
    w.kvrow = (long long)(w.b * Hkv + w.hkv) * Skv;
    w.at = ((long long)row * nqt + qt) * INV_TILE + r;
    w.bad = w.qi >= 0 && bad_q[w.qr] != 0;
    w.qrow = q + w.qr * D;
    w.cls = classes + ((long long)(class_batch ? w.b : 0) * nqt + qt) * nkt;
    return w;
}

// Pass 1.  Grid (query tiles, split_rows(B * H)), 64 threads: thread r is slot r of query tile
// blockIdx.x.  m (B, H, nqt, 64) becomes max(m, every visible score of this block); poison
// (same shape, uint8) is set for rows that see a flagged key or are flagged and see one.
template <typename T>
__global__ void __launch_bounds__(INV_TILE) ringmpi_inv_max(
    const T* __restrict__ q, const T* __restrict__ k, INV_TILES, T* __restrict__ m,
    unsigned char* __restrict__ poison, const T scale, MASK_PARAMS, MOD_PARAMS, INV_SHAPE) {
    const int row = cta_row();
    if (row >= B * H) return;
    const InvRow<T> w = inv_row<T>(q, q_slot, classes, class_batch, bad_q, row, H, Hkv, Sq, Skv, D, nqt, nkt);
    if (w.qi < 0) return;  // a pad slot (no barrier in this kernel)
    MASK_INIT(mk);
    MOD_INIT(mk);
    const T cap = (T)mk.softcap;
    const HeadValues<T> hv = head_values<T>(mk, w.h);
    T mx = neg_inf<T>();
    bool bad = false;
    for (int kt = 0; kt < nkt; ++kt) {
        const int cls = w.cls[kt];
        if (cls == TILE_SKIP) continue;
        for (int s = 0; s < INV_TILE; ++s) {
            const int kj = k_slot[kt * INV_TILE + s];
            if (kj < 0 || !inv_visible(mk, cls, w.b, w.qi, kj, Sq, Skv)) continue;
            T slope;
            mx = max_acc(mx, inv_score<T>(mk, cap, hv, w.qrow, k + (w.kvrow + kj) * D, D, scale, w.qi, kj, Sq, Skv,
                                          &slope));
            bad = bad || w.bad || bad_k[w.kvrow + kj] != 0;
        }
    }
    m[w.at] = max_acc(m[w.at], mx);
    if (bad) poison[w.at] = 1;
}

// Pass 2.  Grid and threads as pass 1.  Per visible pair: p = exp(score - shift) (shift: pass 1's
// maxima, 0 where not finite), l_pair = sum p (slot order), o_pair,d = sum p z v_d (four partial
// sums over slots mod 4), each added on its grid: acc_l (B, H, nqt, 64, limbs) on grid_l[0],
// acc_o (B, H, nqt, 64, limbs * Dv) on grid_o (B, Hkv, Dv).  A value beyond its grid poisons the row.
template <typename T>
__global__ void __launch_bounds__(INV_TILE) ringmpi_inv_forward(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, INV_TILES,
    const T* __restrict__ shift, long long* __restrict__ acc_l, long long* __restrict__ acc_o,
    unsigned char* __restrict__ poison, const double* __restrict__ grid_l, const double* __restrict__ grid_o,
    int limbs, const T scale, MASK_PARAMS, MOD_PARAMS, DROPOUT_PARAMS(T), INV_SHAPE) {
    const int row = cta_row();
    if (row >= B * H) return;
    const InvRow<T> w = inv_row<T>(q, q_slot, classes, class_batch, bad_q, row, H, Hkv, Sq, Skv, D, nqt, nkt);
    if (w.qi < 0) return;
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    const T cap = (T)mk.softcap;
    const HeadValues<T> hv = head_values<T>(mk, w.h);
    const long long at = w.at;
    const T sh = shift[at];
    long long* al = acc_l + at * limbs;
    long long* ao = acc_o + at * (long long)limbs * Dv;
    const double* go = grid_o + (long long)(w.b * Hkv + w.hkv) * Dv;
    T p[INV_TILE];   // this row's weights in one key tile, dropout's factor applied (0: hidden or pad)
    int kr[INV_TILE];
    bool bad = false;
    for (int kt = 0; kt < nkt; ++kt) {
        const int cls = w.cls[kt];
        if (cls == TILE_SKIP) continue;
        T l = T(0);
        bool any = false;
        for (int s = 0; s < INV_TILE; ++s) {
            const int kj = k_slot[kt * INV_TILE + s];
            kr[s] = kj;
            p[s] = T(0);
            if (kj < 0 || !inv_visible(mk, cls, w.b, w.qi, kj, Sq, Skv)) continue;
            T slope;
            const T e = exp_acc(inv_score<T>(mk, cap, hv, w.qrow, k + (w.kvrow + kj) * D, D, scale, w.qi, kj, Sq, Skv,
                                             &slope) - sh);
            l += e;  // the row sum is taken before dropout's factor
            p[s] = dr.on ? e * dropout_factor<T>(dr, drop_rescale, mk, w.b, w.h, w.qi, kj, Sq, Skv) : e;
            any = true;
            bad = bad || w.bad || bad_k[w.kvrow + kj] != 0;
        }
        if (!any) continue;  // nothing visible: the pair adds zeros
        if (!fixed_add<false>(al, 1, limbs, (double)l * grid_l[0])) bad = true;
        for (int d = 0; d < Dv; ++d) {
            T a0 = T(0), a1 = T(0), a2 = T(0), a3 = T(0);
            for (int s = 0; s < INV_TILE; s += 4) {
                if (kr[s] >= 0) a0 += p[s] * v[(w.kvrow + kr[s]) * Dv + d];
                if (kr[s + 1] >= 0) a1 += p[s + 1] * v[(w.kvrow + kr[s + 1]) * Dv + d];
                if (kr[s + 2] >= 0) a2 += p[s + 2] * v[(w.kvrow + kr[s + 2]) * Dv + d];
                if (kr[s + 3] >= 0) a3 += p[s + 3] * v[(w.kvrow + kr[s + 3]) * Dv + d];
            }
            if (!fixed_add<false>(ao + d, Dv, limbs, (double)((a0 + a1) + (a2 + a3)) * go[d])) bad = true;
        }
    }
    if (bad) poison[at] = 1;
}

// The backward.  Grid (key tiles, split_rows(B * Hkv)), 64 threads, dynamic shared memory
// (kernels.InvariantLaunch.shared_mem_bytes): thread t is slot t of key tile blockIdx.x in phases A and C
// and slot t of the query tile in phases B and D.  Per query head of the K/V head's group
// and per visible pair (query tile qt, this key tile), FlashAttention-2's terms with
// P = exp(score - lse) (lse +inf on flagged rows: P = 0):
//   A  each key's P and dS = ((dP z) - dvec) P slope over the tile's 64 rows (P into shared memory)
//   B  each row's sum of P over the tile: past 2 (or NaN) the row's P and dS count as 0 and the
//      row and the keys it sees are poisoned (lse does not bound these scores)
//   C  each key's dv_d = sum_i P z do_i,d and dk_d = sum_i dS q_i,d (slot order) added to its row
//      of dk (B, Hkv, Skv, limbs D) and dv (B, Hkv, Skv, limbs Dv + 1: the last column counts
//      poisoned pairs), which only this thread writes; dS into shared memory
//   D  each row's dq_d = sum_j dS k_j,d (slot order) added to dq_acc (B, H, nqt, 64, limbs D) with
//      int64 atomics (several key tiles add to a row: integer addition is order-free)
// Grids: dq (dq_rows (B, H, nqt, 64) then dq_cols (B, Hkv, D)), dk_cols (B, Hkv, D), dv_cols (B, Hkv, Dv).
template <typename T>
__global__ void __launch_bounds__(INV_TILE) ringmpi_inv_backward(
    const T* __restrict__ q, const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ dvec,
    const T* __restrict__ k, const T* __restrict__ v, INV_TILES,
    long long* __restrict__ dq_acc, unsigned char* __restrict__ q_poison, long long* __restrict__ dk,
    long long* __restrict__ dv, const double* __restrict__ dq_rows, const double* __restrict__ dq_cols,
    const double* __restrict__ dk_cols, const double* __restrict__ dv_cols, int limbs, const T scale,
    MASK_PARAMS, MOD_PARAMS, DROPOUT_PARAMS(T), INV_SHAPE) {
    extern __shared__ __align__(16) unsigned char inv_smem_raw[];
    T* tile = reinterpret_cast<T*>(inv_smem_raw);                 // [64][INV_STRIDE]
    int* over = reinterpret_cast<int*>(tile + INV_TILE * INV_STRIDE);  // [64]
    const int row = cta_row();
    if (row >= B * Hkv) return;  // the whole CTA: before any barrier
    const int b = row / Hkv, hkv = row % Hkv, group = H / Hkv, kt = blockIdx.x, t = threadIdx.x;
    MASK_INIT(mk);
    MOD_INIT(mk);
    DROPOUT_INIT(dr);
    const T cap = (T)mk.softcap;
    const long long kvrow = (long long)row * Skv;
    const int kj = k_slot[kt * INV_TILE + t];  // this thread's key in phases A and C (-1: a pad)
    const bool key_flag = kj >= 0 && bad_k[kvrow + kj] != 0;
    bool key_bad = false;
    T pz[INV_TILE], ds[INV_TILE];  // this key's P z and dS over the query tile's rows
    unsigned long long seen = 0;   // bit i: row slot i sees this key
    for (int g = 0; g < group; ++g) {
        const int h = hkv * group + g;
        const HeadValues<T> hv = head_values<T>(mk, h);
        const long long hrow = (long long)(b * H + h) * Sq;
        for (int qt = 0; qt < nqt; ++qt) {
            const int cls = classes[((long long)(class_batch ? b : 0) * nqt + qt) * nkt + kt];
            if (cls == TILE_SKIP) continue;  // the same for the whole CTA
            // A: this key against the tile's rows
            seen = 0;
            for (int i = 0; i < INV_TILE; ++i) {
                const int qi = q_slot[qt * INV_TILE + i];
                T p = T(0), dsi = T(0), z = T(0);
                if (kj >= 0 && qi >= 0 && inv_visible(mk, cls, b, qi, kj, Sq, Skv)) {
                    const long long qr = hrow + qi;
                    T slope;
                    const T sc = inv_score<T>(mk, cap, hv, q + qr * D, k + (kvrow + kj) * D, D, scale, qi, kj, Sq,
                                              Skv, &slope);
                    p = exp_acc(sc - lse[qr]);
                    z = dr.on ? dropout_factor<T>(dr, drop_rescale, mk, b, h, qi, kj, Sq, Skv) : T(1);
                    const T dp = inv_dot<T>(dout + qr * Dv, v + (kvrow + kj) * Dv, Dv);
                    dsi = ((dp * z) - dvec[qr]) * p;
                    if (cap != T(0)) dsi = dsi * slope;
                    seen |= 1ULL << i;
                    if (key_flag || bad_q[qr] != 0) {  // a flagged row or key: both are poisoned
                        key_bad = true;
                        q_poison[((long long)(b * H + h) * nqt + qt) * INV_TILE + i] = 1;
                    }
                }
                pz[i] = p * z;
                ds[i] = dsi;
                tile[i * INV_STRIDE + t] = p;
            }
            __syncthreads();
            // B: row t's sum of P over the tile's keys
            {
                T sum = T(0);
                for (int j = 0; j < INV_TILE; ++j) sum += tile[t * INV_STRIDE + j];
                over[t] = !(sum <= T(2));
                if (over[t]) q_poison[((long long)(b * H + h) * nqt + qt) * INV_TILE + t] = 1;
            }
            __syncthreads();
            // C: this key's dv and dk terms, then its dS into the tile
            for (int i = 0; i < INV_TILE; ++i) {
                if (over[i]) {
                    if ((seen >> i) & 1ULL) key_bad = true;
                    pz[i] = T(0);
                    ds[i] = T(0);
                }
                tile[i * INV_STRIDE + t] = ds[i];
            }
            if (kj >= 0 && seen != 0) {
                long long* dvk = dv + (kvrow + kj) * ((long long)limbs * Dv + 1);
                long long* dkk = dk + (kvrow + kj) * ((long long)limbs * D);
                const double* gv = dv_cols + (long long)row * Dv;
                const double* gk = dk_cols + (long long)row * D;
                const int* rows = q_slot + qt * INV_TILE;
                if (!inv_add_rows<T, false>(dvk, pz, dout + hrow * Dv, rows, Dv, limbs, 1.0, gv)) key_bad = true;
                if (!inv_add_rows<T, false>(dkk, ds, q + hrow * D, rows, D, limbs, 1.0, gk)) key_bad = true;
            }
            __syncthreads();
            // D: row t's dq terms over the tile's keys
            const int qi = q_slot[qt * INV_TILE + t];
            if (qi >= 0) {
                const long long at = ((long long)(b * H + h) * nqt + qt) * INV_TILE + t;
                const T* dsr = tile + t * INV_STRIDE;
                bool any = false;
                for (int j = 0; j < INV_TILE; ++j) any = any || dsr[j] != T(0);
                if (any && !inv_add_rows<T, true>(dq_acc + at * ((long long)limbs * D), dsr, k + kvrow * D,
                                                  k_slot + kt * INV_TILE, D, limbs, dq_rows[at],
                                                  dq_cols + (long long)row * D))
                    q_poison[at] = 1;
            }
            __syncthreads();  // the tile is rewritten by the next pair's phase A
        }
    }
    if (kj >= 0 && key_bad) dv[(kvrow + kj) * ((long long)limbs * Dv + 1) + (long long)limbs * Dv] += 1;
}
