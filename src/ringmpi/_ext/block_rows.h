/* One vector path of the compiled forward block op, included by fused.c right after exp_rows.h
 * (whose macros it uses and then undefines) once per path with FMA instructions, with
 *
 *   QK_MR   query rows of the Q K^T micro-kernel (its tile: QK_MR rows x 2 vectors of keys)
 *   PV_MR   query rows of the P V micro-kernel (its tile: PV_MR rows x up to PV_NV vectors of D_v)
 *   PV_NV   vectors of D_v columns the P V micro-kernel holds per row
 *   BQ      query rows of a strip (a multiple of QK_MR and PV_MR): 48 on every path, since a
 *           strip's clipped key range (below) depends on it, and with it a row sum's order
 *
 * fwd_chunk: one key chunk (at most a few hundred keys, packed once by the caller) folded into the
 * online softmax of a run of query rows, strip by strip of BQ rows, with no call out between:
 *
 *   S = Q_strip K^T        register-blocked, the keys packed in panels of PANEL columns, each
 *                          score one chain of fused multiply-adds over d = 0..D-1, from 0
 *   mask                   positions (causal, window) and segment ids (ChunkMask): scores a row does
 *                          not see (outside [lo_i, hi_i], another segment) -> -inf; a strip
 *                          the mask hides in part computes only the panels from the first key one of
 *                          its rows may see to the last, one it hides whole is skipped; with the
 *                          logit softcap each score first becomes c tanh(scale S / c) (softcap_row,
 *                          each step rounded) and the scale below is 1
 *   m' = max(m, scale * max_j S[i, j]), shift = m' (0 where m' = -inf)
 *   P = exp(scale * S - shift) with its row sums (exp_rows.h's exp_row: the tile pass's exp)
 *   alpha = exp(m - shift), l = l * alpha + sum, m = m'
 *   O = O * alpha + P V    register-blocked, each output one product O * alpha then one chain of
 *                          fused multiply-adds over the chunk's keys in order
 *
 * Every element's arithmetic is the same sequence of float32 operations on every path (the vector
 * width only decides how many elements go side by side), so every path gives the same bits. */

#define PANEL 32 /* keys per packed K panel: kp[panel][d][PANEL] */
#define VD CAT(vd, VW)
#define VQ CAT(vq, VW)
typedef double VD __attribute__((vector_size(VW * 8)));
typedef uint64_t VQ __attribute__((vector_size(VW * 8)));
#define QK_NR 2  /* vectors of keys per Q K^T micro-kernel tile */
#define JC 64    /* keys per run of the P V product */

/* acc[r][c] = sum_{d < dim} a[r * lda + d] * panel[d * PANEL + c * VW..] for QK_MR rows, QK_NR * VW
 * keys of the panel: each score one chain of fused multiply-adds over d from 0 (the accumulators
 * stay in registers once inlined) */
PINLINE void FN(qk_acc)(const float *a, Py_ssize_t lda, Py_ssize_t dim, const float *panel, VF acc[QK_MR][QK_NR])
{
    _Pragma("GCC unroll 16") for (int r = 0; r < QK_MR; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < QK_NR; c++) acc[r][c] = FN(bc)(0.0f);
    for (Py_ssize_t d = 0; d < dim; d++) {
        VF kv[QK_NR];
        _Pragma("GCC unroll 4") for (int c = 0; c < QK_NR; c++) kv[c] = LOAD(panel + d * PANEL + c * VW);
        _Pragma("GCC unroll 16") for (int r = 0; r < QK_MR; r++) {
            const VF qv = FN(splat)(a[r * lda + d]);
            _Pragma("GCC unroll 4") for (int c = 0; c < QK_NR; c++) acc[r][c] = FN(fma)(qv, kv[c], acc[r][c]);
        }
    }
}

/* s[r * lds + c] = the scores of qk_acc, stored */
PINLINE void FN(qk_tile)(const float *a, Py_ssize_t lda, Py_ssize_t dim, const float *panel, float *s, Py_ssize_t lds)
{
    VF acc[QK_MR][QK_NR];
    FN(qk_acc)(a, lda, dim, panel, acc);
    _Pragma("GCC unroll 16") for (int r = 0; r < QK_MR; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < QK_NR; c++) STORE(s + r * lds + c * VW, acc[r][c]);
}

/* os[r * dvp + c..] = os (times alpha[r] when `first`; 0 when `first` without alpha) + sum_{j < nk}
 * p[r * lds + j] * vp[j * dvp + c..] for mr <= PV_MR rows and nv vectors of columns */
PINLINE void FN(pv_tile)(float *os, Py_ssize_t dvp, const float *alpha, int first, const float *p, Py_ssize_t lds,
                         const float *vp, Py_ssize_t nk, const int nv, const int mr)
{
    VF acc[PV_MR][PV_NV];
    _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++) {
        if (first && !alpha) { /* from zero: os not read */
            _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) acc[r][c] = FN(bc)(0.0f);
            continue;
        }
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) acc[r][c] = LOAD(os + r * dvp + c * VW);
        if (first) {
            const VF a = FN(splat)(alpha[r]);
            _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) acc[r][c] = acc[r][c] * a;
        }
    }
    for (Py_ssize_t j = 0; j < nk; j++) {
        VF vv[PV_NV];
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) vv[c] = LOAD(vp + j * dvp + c * VW);
        _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++) {
            const VF pv = FN(splat)(p[r * lds + j]);
            _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) acc[r][c] = FN(fma)(pv, vv[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) STORE(os + r * dvp + c * VW, acc[r][c]);
}

/* the score modifiers over a row of raw scores (keys c0 .. c0 + n - 1 of row i): x = scale s, then
 * the cap (softcap_row; t, when given, receives its tanh), then ALiBi's x - slope |qd_i - kd_j| (the
 * distance exact in float64, rounded once to float32; the product and the difference each rounded) */
PINLINE void FN(modified_row)(float *row, Py_ssize_t n, float scale, const ScoreMods *md, Py_ssize_t i, Py_ssize_t c0,
                              float *t)
{
    if (md->cap != 0.0f) FN(softcap_row)(row, n, scale, md->cap, t);
    else {
        const VF vs = FN(bc)(scale);
        Py_ssize_t j = 0;
        for (; j + VW <= n; j += VW) STORE(row + j, LOAD(row + j) * vs);
        for (; j < n; j++) row[j] = row[j] * scale;
    }
    if (md->slope == 0.0f) return;
    const double qd = md->qd[i];
    const double *kd = md->kd + c0;
    const VD vq = (VD){0} + qd;
    const VQ mag = (VQ){0} + 0x7fffffffffffffffull;
    const VF vsl = FN(bc)(md->slope);
    Py_ssize_t j = 0;
    for (; j + VW <= n; j += VW) {
        VD d;
        memcpy(&d, kd + j, sizeof d);
        const VF dist = __builtin_convertvector((VD)((VQ)(vq - d) & mag), VF);
        STORE(row + j, LOAD(row + j) - vsl * dist);
    }
    for (; j < n; j++) row[j] = row[j] - md->slope * (float)fabs(qd - kd[j]);
}

/* z[j] = dropout's factor of row i's weight of key c0 + j (j < n): rescale where Philox 4x32-10's word
 * 0 of the (query, key) counter reaches the threshold, else 0 (rules.h's dropout_keep, lane by lane:
 * the 32 x 32 -> 64-bit products in 64-bit lanes) */
PINLINE void FN(dropout_factors)(float *z, Py_ssize_t n, const DropoutRow *dr, Py_ssize_t i, Py_ssize_t c0)
{
    const uint64_t ui = (uint64_t)dr->qpos[i];
    const int64_t *kp = dr->kvpos + c0;
    const VQ low = (VQ){0} + 0xffffffffull, thr = (VQ){0} + dr->threshold;
    const VI rescale = (VI)FN(bc)(dr->rescale);
    for (Py_ssize_t j = 0; j < n; j += VW) {
        VQ kj = (VQ){0};
        const Py_ssize_t take = n - j < VW ? n - j : VW;
        memcpy(&kj, kp + j, take * sizeof(int64_t));
        VU c0v = __builtin_convertvector(kj & low, VU);
        VU c1v = FN(bcu)((uint32_t)ui);
        VU c2v = __builtin_convertvector((((VQ){0} + (ui >> 32)) | ((kj >> 32) << 16)) & low, VU);
        VU c3v = FN(bcu)(dr->row);
        uint32_t k0 = dr->k0, k1 = dr->k1;
        for (int r = 0; r < PHILOX_ROUNDS; r++) {
            if (r) {
                k0 += PHILOX_W0;
                k1 += PHILOX_W1;
            }
            const VQ p0 = __builtin_convertvector(c0v, VQ) * ((VQ){0} + PHILOX_M0);
            const VQ p1 = __builtin_convertvector(c2v, VQ) * ((VQ){0} + PHILOX_M1);
            const VU hi0 = __builtin_convertvector(p0 >> 32, VU), lo0 = __builtin_convertvector(p0 & low, VU);
            const VU hi1 = __builtin_convertvector(p1 >> 32, VU), lo1 = __builtin_convertvector(p1 & low, VU);
            c0v = hi1 ^ c1v ^ FN(bcu)(k0);
            c1v = lo1;
            c2v = hi0 ^ c3v ^ FN(bcu)(k1);
            c3v = lo0;
        }
        const VI keep = __builtin_convertvector(__builtin_convertvector(c0v, VQ) >= thr, VI);
        float f[VW];
        STORE(f, (VF)(rescale & keep));
        memcpy(z + j, f, take * sizeof(float));
    }
}

/* row[j] = 0 where 0 < row[j] < 2^-126 (j < n): weights below the smallest normal float, at most
 * 2^-126 of the row's largest (1), which no float32 output can show, are left out of the products
 * (a subnormal operand costs an FMA a hundred times its time; ALiBi's far keys make many) */
PINLINE void FN(flush_row)(float *row, Py_ssize_t n)
{
    const VF tiny = FN(bc)(0x1p-126f);
    Py_ssize_t j = 0;
    for (; j + VW <= n; j += VW) {
        const VF x = LOAD(row + j);
        STORE(row + j, (VF)((VI)x & (VI)(x >= tiny)));
    }
    for (; j < n; j++) row[j] = row[j] >= 0x1p-126f ? row[j] : 0.0f;
}

/* s = q K^T for K packed in panels (kp[panel][d][PANEL], zero past nk): the scores fwd_chunk
 * computes, bit for bit (each one chain of fused multiply-adds over d from 0), for the backward's
 * tiles and invariant=True's tile pairs.  Whole groups of QK_MR rows read q in place; the last
 * rows are copied with zero rows up to a whole group into `scratch` (QK_MR * dim floats, then BQ *
 * kbp for the scratch strip).  With tile == 0, s[i * lds + j]; with tile > 0 (nk a multiple of it
 * and of QK_NR * VW), the pairs' layout: key j of row i at s[(j / tile) * nq * tile + i * tile + j %
 * tile] (one (nq, tile) block per run of tile keys).  Micro-kernel tiles wholly inside s store
 * there directly; the others (the last rows, the keys past the last whole tile) go through the
 * scratch strip. */
PATH_ISA static void FN(scores_packed)(const float *q, Py_ssize_t ldq, Py_ssize_t nq, Py_ssize_t dim,
                                       const float *kp, Py_ssize_t nk, float *s, Py_ssize_t lds, Py_ssize_t tile,
                                       float *scratch)
{
    const Py_ssize_t kbp = (nk + PANEL - 1) / PANEL * PANEL, nw = QK_NR * VW;
    const Py_ssize_t kw = nk / nw * nw; /* keys [0, kw) in whole micro-kernel tiles */
    float *qs = scratch, *st = qs + QK_MR * dim;
    for (Py_ssize_t i0 = 0; i0 < nq; i0 += BQ) {
        const Py_ssize_t rows = nq - i0 < BQ ? nq - i0 : BQ;
        const int used = (int)((rows + QK_MR - 1) / QK_MR * QK_MR), whole = (int)(rows / QK_MR * QK_MR);
        for (Py_ssize_t r = whole; r < used; r++) {
            if (r < rows) memcpy(qs + (r - whole) * dim, q + (i0 + r) * ldq, dim * sizeof(float));
            else memset(qs + (r - whole) * dim, 0, dim * sizeof(float));
        }
        for (Py_ssize_t jb = 0; jb < kbp; jb += nw) {
            const float *panel = kp + (jb / PANEL) * PANEL * dim + jb % PANEL;
            for (int r = 0; r < used; r += QK_MR) {
                const float *a = r < whole ? q + (i0 + r) * ldq : qs;
                const Py_ssize_t lda = r < whole ? ldq : dim;
                if (jb < kw && r < whole) { /* straight into s */
                    float *dst = tile ? s + (jb / tile) * nq * tile + (i0 + r) * tile + jb % tile
                                      : s + (i0 + r) * lds + jb;
                    FN(qk_tile)(a, lda, dim, panel, dst, tile ? tile : lds);
                } else
                    FN(qk_tile)(a, lda, dim, panel, st + r * kbp + jb, kbp);
            }
        }
        for (Py_ssize_t r = 0; r < rows; r++) { /* what went through the scratch strip */
            const Py_ssize_t from = r < whole ? kw : 0;
            if (tile == 0) {
                memcpy(s + (i0 + r) * lds + from, st + r * kbp + from, (nk - from) * sizeof(float));
                continue;
            }
            for (Py_ssize_t j0 = from; j0 < nk; j0 += tile)
                memcpy(s + (j0 / tile) * nq * tile + (i0 + r) * tile, st + r * kbp + j0, tile * sizeof(float));
        }
    }
}

/* mx[r] = max(mx[r], the scores of QK_MR rows against QK_NR * VW keys of a panel), qk_tile's
 * arithmetic; nan[r] flags lanes that met a NaN (x86's max drops it) */
PINLINE void FN(qk_tile_max)(const float *a, Py_ssize_t lda, Py_ssize_t dim, const float *panel, VF *mx, VI *nan)
{
    VF acc[QK_MR][QK_NR];
    FN(qk_acc)(a, lda, dim, panel, acc);
    _Pragma("GCC unroll 16") for (int r = 0; r < QK_MR; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < QK_NR; c++) {
            mx[r] = FN(max)(mx[r], acc[r][c]);
            nan[r] |= acc[r][c] != acc[r][c];
        }
}

/* rowmax[i] = max_j sum_d q[i * ldq + d] K[j, d] over nk keys packed in whole panels (nk % PANEL
 * == 0): the maxima of scores_packed's scores, NaN where a row met one, without storing them
 * (invariant=True's first pass).  Whole groups of QK_MR rows read q in place, the last rows a
 * zero-padded copy in scratch (QK_MR * dim floats). */
PATH_ISA static void FN(scores_max)(const float *q, Py_ssize_t ldq, Py_ssize_t nq, Py_ssize_t dim, const float *kp,
                                    Py_ssize_t nk, float *rowmax, float *qs)
{
    VF mx[BQ];
    VI nan[BQ];
    for (Py_ssize_t i0 = 0; i0 < nq; i0 += BQ) {
        const Py_ssize_t rows = nq - i0 < BQ ? nq - i0 : BQ;
        const int used = (int)((rows + QK_MR - 1) / QK_MR * QK_MR);
        const int whole = (int)(rows / QK_MR * QK_MR);
        for (Py_ssize_t r = 0; r < used; r++) {
            if (r >= whole && r < rows) memcpy(qs + (r - whole) * dim, q + (i0 + r) * ldq, dim * sizeof(float));
            else if (r >= rows) memset(qs + (r - whole) * dim, 0, dim * sizeof(float));
            mx[r] = FN(bc)(-INFINITY);
            nan[r] = (VI){0};
        }
        for (Py_ssize_t jb = 0; jb < nk; jb += QK_NR * VW) {
            const float *panel = kp + (jb / PANEL) * PANEL * dim + jb % PANEL;
            for (int r = 0; r < used; r += QK_MR)
                if (r < whole) FN(qk_tile_max)(q + (i0 + r) * ldq, ldq, dim, panel, mx + r, nan + r);
                else FN(qk_tile_max)(qs, dim, dim, panel, mx + r, nan + r);
        }
        for (Py_ssize_t r = 0; r < rows; r++) {
            float m = -INFINITY;
            int any_nan = 0;
            for (int lane = 0; lane < VW; lane++) {
                m = mx[r][lane] > m ? mx[r][lane] : m;
                any_nan |= nan[r][lane] != 0;
            }
            rowmax[i0 + r] = any_nan ? NAN : m;
        }
    }
}

/* s[i * lds + j] = sum_d q[i * ldq + d] * k[j * ldk + d] for i < nq, j < nk: scores_packed with k
 * packed here into panels in `scratch` */
PATH_ISA static void FN(scores)(const float *q, Py_ssize_t ldq, Py_ssize_t nq, Py_ssize_t dim, const float *k,
                                Py_ssize_t ldk, Py_ssize_t nk, float *s, Py_ssize_t lds, float *scratch)
{
    const Py_ssize_t kbp = (nk + PANEL - 1) / PANEL * PANEL;
    float *kp = scratch;
    for (Py_ssize_t j = 0; j < kbp; j++)
        for (Py_ssize_t d = 0; d < dim; d++)
            kp[(j / PANEL) * PANEL * dim + d * PANEL + j % PANEL] = j < nk ? k[j * ldk + d] : 0.0f;
    FN(scores_packed)(q, ldq, nq, dim, kp, nk, s, lds, 0, kp + kbp * dim);
}

/* the scratch of one call: a strip's scores, its rows of Q and O, per-row alpha */
PATH_ISA static void FN(fwd_chunk)(const float *q, Py_ssize_t ldq, Py_ssize_t nq, Py_ssize_t dim, const float *kp,
                                   Py_ssize_t nk, const float *vp, Py_ssize_t dvp, float *o, Py_ssize_t ldo,
                                   Py_ssize_t dv, float *m, float *l, float scale, const ScoreMods *md,
                                   const ChunkMask *mk, const DropoutRow *dr, float *scratch)
{
    const Py_ssize_t kbp = (nk + PANEL - 1) / PANEL * PANEL; /* score columns, whole panels */
    float *s = scratch, *qs = s + BQ * kbp, *os = qs + BQ * dim, *alpha = os + BQ * dvp, *z = alpha + BQ;
    for (Py_ssize_t i0 = 0; i0 < nq; i0 += BQ) {
        const Py_ssize_t rows = nq - i0 < BQ ? nq - i0 : BQ;
        int partial;
        Py_ssize_t c0, c1; /* the keys the strip computes: [c0, c1) */
        if (!strip_keys(mk, i0, rows, PANEL, &c0, &c1, &partial)) continue; /* hidden: no change */
        const Py_ssize_t n = c1 - c0;
        /* the strip's Q rows, padded with zero rows to BQ */
        for (Py_ssize_t r = 0; r < BQ; r++) {
            if (r < rows) memcpy(qs + r * dim, q + (i0 + r) * ldq, dim * sizeof(float));
            else memset(qs + r * dim, 0, dim * sizeof(float));
        }
        for (Py_ssize_t jb = c0; jb < c1; jb += QK_NR * VW) {
            const float *panel = kp + (jb / PANEL) * PANEL * dim + jb % PANEL;
            for (int r = 0; r < BQ; r += QK_MR) FN(qk_tile)(qs + r * dim, dim, dim, panel, s + r * kbp + jb, kbp);
        }
        for (Py_ssize_t r = 0; r < BQ; r++) {
            float *row = s + r * kbp + c0;
            if (r >= rows) { /* a padding row: weights 0 */
                memset(row, 0, n * sizeof(float));
                alpha[r] = 0.0f;
                continue;
            }
            const Py_ssize_t i = i0 + r;
            const int modified = md->cap != 0.0f || md->slope != 0.0f;
            if (modified) FN(modified_row)(row, n, scale, md, i, c0, NULL); /* the scores as they enter the max */
            if (partial) mask_row(mk, i, row, c0, n);
            VF vmx = FN(bc)(-INFINITY);
            Py_ssize_t j = 0;
            for (; j + VW <= n; j += VW) vmx = FN(max)(vmx, LOAD(row + j));
            float mx = -INFINITY;
            for (int lane = 0; lane < VW; lane++) mx = vmx[lane] > mx ? vmx[lane] : mx;
            for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
            if (mx == 0.0f) mx = 0.0f; /* +0 whichever zero won: the same bits on every path */
            const float sc = modified ? 1.0f : scale; /* modified scores carry their scale */
            const float m_old = m[i], scaled = mx * sc, m_new = scaled > m_old ? scaled : m_old;
            const float shift = m_new == -INFINITY ? 0.0f : m_new;
            const float sum = FN(exp_row)(row, n, sc, NULL, shift);
            FN(flush_row)(row, n); /* after the sum, which keeps them */
            if (dr->on) { /* dropout after the row sums: it changes what reaches P V, not l */
                FN(dropout_factors)(z, n, dr, i, c0);
                for (Py_ssize_t j = 0; j < n; j++) row[j] = row[j] * z[j];
            }
            const float a = expf(m_old - shift);
            alpha[r] = a;
            l[i] = l[i] * a + sum;
            m[i] = m_new;
        }
        for (Py_ssize_t r = 0; r < BQ; r++) {
            if (r < rows) {
                memcpy(os + r * dvp, o + (i0 + r) * ldo, dv * sizeof(float));
                memset(os + r * dvp + dv, 0, (dvp - dv) * sizeof(float));
            } else memset(os + r * dvp, 0, dvp * sizeof(float));
        }
        /* P V a run of JC keys at a time (their V rows stay in L1 across the strip's row groups) */
        for (Py_ssize_t jc = c0; jc < c1; jc += JC) {
            const Py_ssize_t nj = c1 - jc < JC ? c1 - jc : JC;
            Py_ssize_t c = 0;
            for (; c + PV_NV * VW <= dvp; c += PV_NV * VW)
                for (int r = 0; r < BQ; r += PV_MR)
                    FN(pv_tile)(os + r * dvp + c, dvp, alpha + r, jc == c0, s + r * kbp + jc, kbp, vp + jc * dvp + c,
                                nj, PV_NV, PV_MR);
            for (; c < dvp; c += VW)
                for (int r = 0; r < BQ; r += PV_MR)
                    FN(pv_tile)(os + r * dvp + c, dvp, alpha + r, jc == c0, s + r * kbp + jc, kbp, vp + jc * dvp + c,
                                nj, 1, PV_MR);
        }
        for (Py_ssize_t r = 0; r < rows; r++) memcpy(o + (i0 + r) * ldo, os + r * dvp, dv * sizeof(float));
    }
}

/* ------------------------------------------------------------ the backward block op
 * bwd_chunk: one key chunk (K, V packed here) against every query row, FlashAttention-2's order:
 * the chunk's dK, dV accumulators (padded copies in scratch) stay resident while the query strips
 * of BQ rows stream past; per strip
 *
 *   S = Q_strip K^T, dP = dO_strip V^T   qk_tile: each one chain of fused multiply-adds from 0
 *                                        (S bit for bit the forward's scores, so P matches its lse)
 *   mask                                 as fwd_chunk (positions and segment ids, ChunkMask): hidden
 *                                        scores -> -inf, a strip computes only its clipped key range,
 *                                        skips a hidden one; with the softcap S first capped as there
 *   P = exp(scale * S - lse_i)           exp_rows.h's exp_row (the tile pass's exp; scale 1 when capped)
 *   dS = (dP - dvec_i) * P               each step rounded (ds_rows's arithmetic); with the softcap then
 *                                        times its slope 1 - t^2 (t = the score's tanh; 0 where hidden)
 *   dV += P^T dO, dK += dS^T Q           tn_tile: each element one chain over the strip's rows in order
 *   dQ += dS K                           pv_tile: each element one chain over the keys in order
 *
 * so every element of dQ, dK, dV is one chain of fused multiply-adds in a fixed order (strips in
 * order, rows or keys in order within one) on every path: the same bits on each. */

/* acc[r * ldacc + c..] += sum_{i < rows} a[i * lda + r] * b[i * ldb + c..] for mr keys r, nv vectors c
 * (acc from zero, not read, with `zero`) */
PINLINE void FN(tn_tile)(float *accp, Py_ssize_t ldacc, const float *a, Py_ssize_t lda, const float *b,
                         Py_ssize_t ldb, Py_ssize_t rows, const int mr, const int nv, int zero)
{
    VF acc[PV_MR][PV_NV];
    _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++)
            acc[r][c] = zero ? FN(bc)(0.0f) : (VF)LOAD(accp + r * ldacc + c * VW);
    for (Py_ssize_t i = 0; i < rows; i++) {
        VF bv[PV_NV];
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) bv[c] = LOAD(b + i * ldb + c * VW);
        _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++) {
            const VF av = FN(splat)(a[i * lda + r]);
            _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) acc[r][c] = FN(fma)(av, bv[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < nv; c++) STORE(accp + r * ldacc + c * VW, acc[r][c]);
}

/* acc (keys [c0, c1) of a (nkeys, w) padded accumulator) += a^T b over `rows` strip rows */
PINLINE void FN(tn_block)(float *acc, Py_ssize_t w, const float *a, Py_ssize_t lda, const float *b,
                          Py_ssize_t rows, Py_ssize_t c0, Py_ssize_t c1)
{
    Py_ssize_t c = 0;
    for (; c + PV_NV * VW <= w; c += PV_NV * VW) {
        Py_ssize_t j = c0;
        for (; j + PV_MR <= c1; j += PV_MR)
            FN(tn_tile)(acc + j * w + c, w, a + j, lda, b + c, w, rows, PV_MR, PV_NV, 0);
        for (; j < c1; j++) FN(tn_tile)(acc + j * w + c, w, a + j, lda, b + c, w, rows, 1, PV_NV, 0);
    }
    for (; c < w; c += VW) {
        Py_ssize_t j = c0;
        for (; j + PV_MR <= c1; j += PV_MR) FN(tn_tile)(acc + j * w + c, w, a + j, lda, b + c, w, rows, PV_MR, 1, 0);
        for (; j < c1; j++) FN(tn_tile)(acc + j * w + c, w, a + j, lda, b + c, w, rows, 1, 1, 0);
    }
}

/* ------------------------------------------------------------ invariant=True's pair products
 * pair_products: for n pairs of (t, t) blocks a[j] and (t, w) blocks b[j] (or one b for all),
 * out[j] = a[j] b[j] (trans 0: pv_tile) or a[j]^T b[j] (trans 1: tn_tile), each element one chain
 * of fused multiply-adds over the pair's t terms in order, from 0: the same bits whatever the
 * stack holds, on every path.  scratch: 2 * t * wp floats (wp: w rounded up to VW), used where w
 * is not a multiple of VW. */

/* the rows (trans 0) or keys (trans 1) [0, t) of one pair's out columns [c, c + nv * VW): whole
 * groups of PV_MR, then the last t % PV_MR as one group */
PINLINE void FN(pair_cols)(float *oj, Py_ssize_t wp, const float *aj, Py_ssize_t t, const float *bb, Py_ssize_t c,
                           int trans, const int nv)
{
#define PAIR_GROUP(MR)                                                                                   \
    do {                                                                                                 \
        if (trans) FN(tn_tile)(oj + r * wp + c, wp, aj + r, t, bb + c, wp, t, MR, nv, 1);                \
        else FN(pv_tile)(oj + r * wp + c, wp, NULL, 1, aj + r * t, t, bb + c, t, nv, MR);                 \
    } while (0)
    Py_ssize_t r = 0;
    for (; r + PV_MR <= t; r += PV_MR) PAIR_GROUP(PV_MR);
    switch (t - r) { /* the remainder, below PV_MR (at most 7: PV_MR <= 8) */
    case 1: PAIR_GROUP(1); break;
    case 2: PAIR_GROUP(2); break;
    case 3: PAIR_GROUP(3); break;
#if PV_MR > 4
    case 4: PAIR_GROUP(4); break;
#endif
#if PV_MR > 5
    case 5: PAIR_GROUP(5); break;
#endif
#if PV_MR > 6
    case 6: PAIR_GROUP(6); break;
#endif
#if PV_MR > 7
    case 7: PAIR_GROUP(7); break;
#endif
    default: break;
    }
#undef PAIR_GROUP
}

PATH_ISA static void FN(pair_products)(const float *a, Py_ssize_t n, Py_ssize_t t, const float *b, Py_ssize_t b_step,
                                       Py_ssize_t w, float *out, int trans, float *scratch)
{
    _Static_assert(PV_MR >= 4 && PV_MR <= 8, "pair_cols covers remainders of 1 to 7 rows");
    const Py_ssize_t wp = (w + VW - 1) / VW * VW;
    const int padded = wp != w;
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *aj = a + j * t * t, *bj = b + j * b_step;
        float *oj = padded ? scratch + t * wp : out + j * t * w;
        if (padded && (j == 0 || b_step)) /* b[j] with zero columns up to wp */
            for (Py_ssize_t i = 0; i < t; i++) {
                memcpy(scratch + i * wp, bj + i * w, w * sizeof(float));
                memset(scratch + i * wp + w, 0, (wp - w) * sizeof(float));
            }
        const float *bb = padded ? scratch : bj;
        Py_ssize_t c = 0;
        for (; c + PV_NV * VW <= wp; c += PV_NV * VW) FN(pair_cols)(oj, wp, aj, t, bb, c, trans, PV_NV);
        for (; c < wp; c += VW) FN(pair_cols)(oj, wp, aj, t, bb, c, trans, 1);
        if (padded)
            for (Py_ssize_t i = 0; i < t; i++) memcpy(out + j * t * w + i * w, oj + i * wp, w * sizeof(float));
    }
}

/* invariant=True's second pass over a stack of n pairs of one query tile (t rows of q) and key tiles
 * (kp: t keys each, packed in panels; v: their (t, w) values): per pair, its scores (scores_packed),
 * exp(scale s - shift) with each row's sum (exp_row, the tile pass's exp) into sums[j * t + r], and
 * P V into out[j] (pair_products): bit for bit what those three calls give one after the other, the
 * scores never leaving the cache.  scratch: t * t + QK_MR * dim + BQ * t + 2 * t * wp floats. */
PATH_ISA static void FN(pair_forward)(const float *q, Py_ssize_t dim, const float *kp, Py_ssize_t n, Py_ssize_t t,
                                      const float *v, Py_ssize_t w, const float *shift, float scale, float *out,
                                      float *sums, float *scratch)
{
    float *st = scratch, *sp = st + t * t, *pad = sp + QK_MR * dim + BQ * t;
    for (Py_ssize_t j = 0; j < n; j++) {
        FN(scores_packed)(q, dim, t, dim, kp + j * t * dim, t, st, t, 0, sp);
        for (Py_ssize_t r = 0; r < t; r++) sums[j * t + r] = FN(exp_row)(st + r * t, t, scale, NULL, shift[r]);
        FN(pair_products)(st, 1, t, v + j * t * w, 0, w, out + j * t * w, 0, pad);
    }
}

/* invariant=True's backward over a stack of n pairs of query tiles (qs, dos: t rows each) and one key
 * tile (kp, vp: its K and V packed in panels; k: its K rows, (t, dim)): per pair, S (scores_packed),
 * P = exp(scale S - lse) with each row's sum into sums (exp_row), dV = P^T dO, dP = dO V^T, dS =
 * (dP - dvec) P (ds_rows), dQ = dS K, dK = dS^T Q (pair_products) into outv, outq, outk: bit for bit
 * those calls one after the other, S and dP never leaving the cache.  scratch: 2 * t * t + QK_MR *
 * wmax + BQ * t + 2 * t * wp floats (wmax = max(dim, dv), wp: it rounded up to VW). */
PATH_ISA static void FN(pair_backward)(const float *qs, const float *dos, Py_ssize_t n, Py_ssize_t t, Py_ssize_t dim,
                                       Py_ssize_t dv, const float *kp, const float *vp, const float *k,
                                       const float *lse, const float *dvec, float scale, float *outv, float *outq,
                                       float *outk, float *sums, float *scratch)
{
    const Py_ssize_t wmax = dim > dv ? dim : dv;
    float *st = scratch, *dpt = st + t * t, *sp = dpt + t * t, *pad = sp + QK_MR * wmax + BQ * t;
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *qj = qs + j * t * dim, *doj = dos + j * t * dv;
        FN(scores_packed)(qj, dim, t, dim, kp, t, st, t, 0, sp);
        for (Py_ssize_t r = 0; r < t; r++)
            sums[j * t + r] = FN(exp_row)(st + r * t, t, scale, NULL, lse[j * t + r]);
        FN(pair_products)(st, 1, t, doj, 0, dv, outv + j * t * dv, 1, pad);
        FN(scores_packed)(doj, dv, t, dv, vp, t, dpt, t, 0, sp);
        FN(ds_rows)(dpt, t, t, t, st, t, dvec + j * t, 1);
        FN(pair_products)(dpt, 1, t, k, 0, dim, outq + j * t * dim, 0, pad);
        FN(pair_products)(dpt, 1, t, qj, 0, dim, outk + j * t * dim, 1, pad);
    }
}

/* pack (n, w) rows into panels of PANEL: out[panel][d][PANEL], zero past n */
static inline void FN(pack_panels)(const float *x, Py_ssize_t ldx, Py_ssize_t n, Py_ssize_t w, float *out)
{
    const Py_ssize_t np_ = (n + PANEL - 1) / PANEL * PANEL;
    for (Py_ssize_t j = 0; j < np_; j++)
        for (Py_ssize_t d = 0; d < w; d++)
            out[(j / PANEL) * PANEL * w + d * PANEL + j % PANEL] = j < n ? x[j * ldx + d] : 0.0f;
}

/* copy `rows` rows of width w (stride ldx) into (BQ or n, wp) zero-padded rows */
static inline void FN(pad_rows)(const float *x, Py_ssize_t ldx, Py_ssize_t rows, Py_ssize_t w, float *out,
                                Py_ssize_t wp, Py_ssize_t total)
{
    for (Py_ssize_t r = 0; r < total; r++) {
        if (r < rows) {
            memcpy(out + r * wp, x + r * ldx, w * sizeof(float));
            memset(out + r * wp + w, 0, (wp - w) * sizeof(float));
        } else memset(out + r * wp, 0, wp * sizeof(float));
    }
}

PATH_ISA static void FN(bwd_chunk)(const float *q, Py_ssize_t ldq, const float *dout, Py_ssize_t lddo, Py_ssize_t nq,
                                   Py_ssize_t dim, Py_ssize_t dvd, const float *k, Py_ssize_t ldk, const float *v,
                                   Py_ssize_t ldv, Py_ssize_t nk, const float *lse, const float *dvec, float *dq,
                                   Py_ssize_t lddq, float *dk, Py_ssize_t lddk, float *dv, Py_ssize_t lddv,
                                   float scale, const ScoreMods *md, const ChunkMask *mk, const DropoutRow *dr,
                                   float *scratch)
{
    const Py_ssize_t kbp = (nk + PANEL - 1) / PANEL * PANEL;
    const Py_ssize_t dpd = (dim + 15) / 16 * 16, dpv = (dvd + 15) / 16 * 16;
    float *kp = scratch, *vpn = kp + kbp * dim, *kr = vpn + kbp * dvd, *dka = kr + kbp * dpd, *dva = dka + kbp * dpd;
    float *s = dva + kbp * dpv, *dps = s + BQ * kbp, *qs = dps + BQ * kbp, *dos = qs + BQ * dpd, *dqs = dos + BQ * dpv;
    float *th = dqs + BQ * dpd; /* with the softcap: a row's tanh, for the slope */
    float *z = th + kbp;        /* with dropout: a row's factors */
    FN(pack_panels)(k, ldk, nk, dim, kp);
    FN(pack_panels)(v, ldv, nk, dvd, vpn);
    FN(pad_rows)(k, ldk, nk, dim, kr, dpd, kbp);
    FN(pad_rows)(dk, lddk, nk, dim, dka, dpd, kbp);
    FN(pad_rows)(dv, lddv, nk, dvd, dva, dpv, kbp);
    for (Py_ssize_t i0 = 0; i0 < nq; i0 += BQ) {
        const Py_ssize_t rows = nq - i0 < BQ ? nq - i0 : BQ;
        int partial;
        Py_ssize_t c0, c1;
        if (!strip_keys(mk, i0, rows, PANEL, &c0, &c1, &partial)) continue; /* as fwd_chunk's */
        const Py_ssize_t n = c1 - c0;
        FN(pad_rows)(q + i0 * ldq, ldq, rows, dim, qs, dpd, BQ);
        FN(pad_rows)(dout + i0 * lddo, lddo, rows, dvd, dos, dpv, BQ);
        for (Py_ssize_t jb = c0; jb < c1; jb += QK_NR * VW) {
            const float *kpanel = kp + (jb / PANEL) * PANEL * dim + jb % PANEL;
            const float *vpanel = vpn + (jb / PANEL) * PANEL * dvd + jb % PANEL;
            for (int r = 0; r < BQ; r += QK_MR) {
                FN(qk_tile)(qs + r * dpd, dpd, dim, kpanel, s + r * kbp + jb, kbp);
                FN(qk_tile)(dos + r * dpv, dpv, dvd, vpanel, dps + r * kbp + jb, kbp);
            }
        }
        for (Py_ssize_t r = 0; r < BQ; r++) {
            float *row = s + r * kbp + c0, *drow = dps + r * kbp + c0;
            if (r >= rows) { /* a padding row: P = dS = 0 */
                memset(row, 0, n * sizeof(float));
                memset(drow, 0, n * sizeof(float));
                continue;
            }
            const Py_ssize_t i = i0 + r;
            const float cap = md->cap;
            const int modified = cap != 0.0f || md->slope != 0.0f;
            if (modified) FN(modified_row)(row, n, scale, md, i, c0, th);
            if (partial) mask_row(mk, i, row, c0, n);
            if (cap != 0.0f && partial) /* a hidden score's slope is 0: nothing of it reaches dS */
                for (Py_ssize_t j = 0; j < n; j++)
                    if (row[j] == -INFINITY) th[j] = 1.0f;
            FN(exp_row)(row, n, modified ? 1.0f : scale, NULL, lse[i]);
            FN(flush_row)(row, n);
            const float d = dvec[i];
            if (dr->on) { /* dS = (dP Z - dvec) P, then P Z for dV (each product rounded) */
                FN(dropout_factors)(z, n, dr, i, c0);
                for (Py_ssize_t j = 0; j < n; j++) {
                    drow[j] = (drow[j] * z[j] - d) * row[j];
                    row[j] = row[j] * z[j];
                }
            } else
                for (Py_ssize_t j = 0; j < n; j++) drow[j] = (drow[j] - d) * row[j];
            if (cap != 0.0f) /* dS through the cap's slope 1 - t^2 (t^2 rounded, then 1 - it) */
                for (Py_ssize_t j = 0; j < n; j++) {
                    const float t2 = th[j] * th[j];
                    drow[j] = drow[j] * (1.0f - t2);
                }
        }
        FN(tn_block)(dva, dpv, s, kbp, dos, rows, c0, c1);  /* dV += P^T dO */
        FN(tn_block)(dka, dpd, dps, kbp, qs, rows, c0, c1); /* dK += dS^T Q */
        FN(pad_rows)(dq + i0 * lddq, lddq, rows, dim, dqs, dpd, BQ);
        for (Py_ssize_t jc = c0; jc < c1; jc += JC) { /* dQ += dS K */
            const Py_ssize_t nj = c1 - jc < JC ? c1 - jc : JC;
            Py_ssize_t c = 0;
            for (; c + PV_NV * VW <= dpd; c += PV_NV * VW)
                for (int r = 0; r < BQ; r += PV_MR)
                    FN(pv_tile)(dqs + r * dpd + c, dpd, NULL, 0, dps + r * kbp + jc, kbp, kr + jc * dpd + c, nj,
                                PV_NV, PV_MR);
            for (; c < dpd; c += VW)
                for (int r = 0; r < BQ; r += PV_MR)
                    FN(pv_tile)(dqs + r * dpd + c, dpd, NULL, 0, dps + r * kbp + jc, kbp, kr + jc * dpd + c, nj, 1,
                                PV_MR);
        }
        for (Py_ssize_t r = 0; r < rows; r++) memcpy(dq + (i0 + r) * lddq, dqs + r * dpd, dim * sizeof(float));
    }
    for (Py_ssize_t j = 0; j < nk; j++) {
        memcpy(dk + j * lddk, dka + j * dpd, dim * sizeof(float));
        memcpy(dv + j * lddv, dva + j * dpv, dvd * sizeof(float));
    }
}

#undef PANEL
#undef VD
#undef VQ
#undef QK_NR
#undef JC
#undef QK_MR
#undef PV_MR
#undef PV_NV
#undef BQ
#include "path_end.h"
