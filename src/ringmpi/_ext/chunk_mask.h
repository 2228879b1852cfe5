/* The mask of one key chunk of the compiled block op (block_rows.h's fwd_chunk, bwd_chunk) against its
 * query rows, the same on every vector path: which keys a strip of rows computes, and which scores of
 * a row it hides.  Included once by fused.c, before the paths. */

/* A key chunk's mask against the query rows (the same on every path): global positions (lo, hi:
 * each row's visible key positions [lo_i, hi_i]; kvpos: the keys' positions; NULL without a
 * positional mask) and segment ids (segq: each row's, segk: each key's; NULL without).  Key j is
 * visible from row i when lo_i <= kvpos_j <= hi_i and segq_i == segk_j (rules.h's elem_visible). */
typedef struct {
    const int64_t *lo, *hi, *kvpos, *segq, *segk;
    Py_ssize_t nk;
    int64_t kmin, kmax, smin, smax; /* the keys' positions' and segment ids' ranges */
} ChunkMask;

static ChunkMask chunk_mask(const int64_t *lo, const int64_t *hi, const int64_t *kvpos, const int64_t *segq,
                            const int64_t *segk, Py_ssize_t nk)
{
    ChunkMask mk = {lo, hi, kvpos, segq, segk, nk, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
    for (Py_ssize_t j = 0; kvpos && j < nk; j++) {
        mk.kmin = kvpos[j] < mk.kmin ? kvpos[j] : mk.kmin;
        mk.kmax = kvpos[j] > mk.kmax ? kvpos[j] : mk.kmax;
    }
    for (Py_ssize_t j = 0; segq && j < nk; j++) {
        mk.smin = segk[j] < mk.smin ? segk[j] : mk.smin;
        mk.smax = segk[j] > mk.smax ? segk[j] : mk.smax;
    }
    return mk;
}

/* The keys the strip of rows [i0, i0 + rows) computes: 0 where the mask hides them all (the strip
 * is skipped), else [*c0, *c1) -- for a strip the mask hides in part (*partial: masked per score)
 * the panels (of `panel` keys) from the first key one of its rows may see to the last, else every key. */
static int strip_keys(const ChunkMask *mk, Py_ssize_t i0, Py_ssize_t rows, Py_ssize_t panel, Py_ssize_t *c0,
                      Py_ssize_t *c1, int *partial)
{
    int64_t slo = INT64_MAX, shi = INT64_MIN, glo = INT64_MAX, ghi = INT64_MIN;
    *c0 = 0;
    *c1 = mk->nk;
    *partial = 0;
    if (mk->kvpos) {
        int any = 0;
        for (Py_ssize_t i = i0; i < i0 + rows; i++) {
            if (mk->hi[i] >= mk->kmin && mk->lo[i] <= mk->kmax) any = 1;
            if (mk->lo[i] > mk->kmin || mk->hi[i] < mk->kmax) *partial = 1;
            slo = mk->lo[i] < slo ? mk->lo[i] : slo;
            shi = mk->hi[i] > shi ? mk->hi[i] : shi;
        }
        if (!any) return 0;
    }
    if (mk->segq) {
        for (Py_ssize_t i = i0; i < i0 + rows; i++) {
            glo = mk->segq[i] < glo ? mk->segq[i] : glo;
            ghi = mk->segq[i] > ghi ? mk->segq[i] : ghi;
        }
        if (ghi < mk->smin || glo > mk->smax) return 0;
        if (!(glo == ghi && mk->smin == mk->smax && glo == mk->smin)) *partial = 1;
    }
    if (*partial) {
        Py_ssize_t first = mk->nk, last = -1;
        for (Py_ssize_t j = 0; j < mk->nk; j++)
            if ((!mk->kvpos || (mk->kvpos[j] >= slo && mk->kvpos[j] <= shi)) &&
                (!mk->segq || (mk->segk[j] >= glo && mk->segk[j] <= ghi))) {
                first = j < first ? j : first;
                last = j;
            }
        if (last < 0) return 0;
        *c0 = first / panel * panel;
        *c1 = last + 1;
    }
    return 1;
}

/* A chunk's score modifiers, the same on every path: the logit softcap (cap; 0: none) and ALiBi
 * (slope, this head's; 0: none; qd: each row's position plus N_kv - N_q, kd: each key's position,
 * both float64, exact below 2^53).  A score becomes cap tanh(scale s / cap) (or scale s without the
 * cap) - slope |qd_i - kd_j|, each step rounded: rules.h's softcap_score, then alibi_score with the
 * distance exact and rounded once to float32. */
typedef struct {
    float cap, slope;
    const double *qd, *kd;
} ScoreMods;

/* A chunk's dropout (on 0: none), the same on every path: rules.h's dropout_keep with key (k0, k1),
 * threshold and the counter word of this (batch entry, head), `row`; qpos, kvpos: the rows' and the
 * keys' positions.  A kept weight is multiplied by rescale (rounded on the host), a dropped one by 0,
 * after the row sums. */
typedef struct {
    int on;
    unsigned int k0, k1, row;
    unsigned long long threshold;
    float rescale;
    const int64_t *qpos, *kvpos;
} DropoutRow;

/* row[j] = -inf for the keys c0 + j (j < n) that row i does not see */
static void mask_row(const ChunkMask *mk, Py_ssize_t i, float *row, Py_ssize_t c0, Py_ssize_t n)
{
    if (mk->kvpos) {
        const int64_t a = mk->lo[i], b = mk->hi[i];
        for (Py_ssize_t j = 0; j < n; j++)
            if (mk->kvpos[c0 + j] < a || mk->kvpos[c0 + j] > b) row[j] = -INFINITY;
    }
    if (mk->segq) {
        const int64_t g = mk->segq[i];
        for (Py_ssize_t j = 0; j < n; j++)
            if (mk->segk[c0 + j] != g) row[j] = -INFINITY;
    }
}
