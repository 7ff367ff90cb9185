/* hfgpt's causal self-attention on the CPU: out = softmax(scale Q K^T, causal) V per batch entry and
 * head, for heads of D = 64 (every GPT-1 and GPT-2 size) in float32. For prefill (no dropout), for
 * training with dropout on the weights, forward and backward, and for one decoding step's query against
 * cached keys and values with an optional key mask (`head_decode`).
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called from cpu/ops.py
 * (`native_causal_attention` for prefill, `_BandedDropoutAttention` for training,
 * `native_decode_attention` for decoding), which run torch's ops wherever this does not apply. Torch's
 * CPU flash-attention kernel spends much of its time outside the arithmetic on GPT-2's short heads of 64;
 * this one holds a head's keys transposed in blocks of KB ([T / KB][D][KB], 128 KB at T = 512, in L2) and
 * works R query rows at a time (8 where the CPU has 32 vector registers: AVX-512, arm64; 4 with AVX2's 16):
 *   scores  S[r][j] = scale * q_r . k_j for the keys j up to the block's last row, R rows x KB keys (two
 *           vectors) in 2R accumulators, one broadcast of q[r][d] per 2 FMAs (`dots`);
 *   softmax per row over j <= i (the row's own position), exactly: max, exp(S - max), sum (the block's
 *           scores are all in cache, so no running rescaling is needed);
 *   values  O[r] = sum_j P[r][j] v_j / sum, two vectors of the head's 64 values at a time
 *           (`weighted_rows`).
 * Training saves P and drops weights with the keep masks it is given (P * keep / (1 - p)), in the band
 * layout of `_BandedDropoutAttention`. Its backward, per block of 8 rows, with P' the dropped weights:
 *   dP'[r][j] = dout_r . v_j (`dots` on V transposed); dP = dP' * keep / (1 - p);
 *   dS = scale * P * (dP - sum_j P dP) (the softmax's backward);
 *   dq_r = sum_j dS[r][j] k_j (`weighted_rows`); dk_j += sum_r dS[r][j] q_r and dv_j += sum_r P'[r][j]
 *   dout_r, into per-head sums (`rank_update`).
 * Each (batch, head) is one task for the OpenMP threads, and the sums for one output run in a fixed
 * order, so the result does not depend on the number of threads.
 *
 * One portable source: vector_math.h's vectors, as wide as the host's (AVX2, AVX-512, NEON), which the
 * compiler maps to the host's instructions under -march=native.
 *
 * exp is vector_math.h's `exp_v` (relative error ~1e-7, as expf; arguments clamped at -103, whose exp,
 * float's smallest subnormal, is a weight of nothing). Each output row
 * reads only its own query and the keys and values up to its position, as causal sdpa: a NaN or an
 * infinity there gives NaN outputs in that row (as in sdpa), and never reaches an earlier row. A decoding
 * step reads only the keys and values its mask keeps: a NaN or an infinity at a masked position, which
 * sdpa's scores and sums would still carry into NaN outputs, does not reach its output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "vector_math.h"

#define D HEAD_SIZE /* head size: 64 */
#if VECTOR_BYTES == 64 || defined(__aarch64__)
#define R 8 /* query rows per block: 2R accumulators and 3 more vectors fit 32 vector registers */
#else
#define R 4 /* ... and AVX2's (or SSE2's) 16 */
#endif
#define KB (2 * LANES) /* keys per block of scores: two vectors */
#define SPAN (2 * LANES) /* head values per pass of `weighted_rows` and `rank_update`: two vectors */

/* Dropout of the weights in training: per band of `band` query rows (starting at multiples of `band`,
 * a multiple of R), keep[b] (uint8, 1 = kept) and probs[b] (float32) are (B*H, rows of the band, keys up
 * to the band's last row) contiguous, as `_BandedDropoutAttention` draws and saves them. */
typedef struct {
    const uint8_t *const *keep;
    float *const *probs;
    int64_t band;
    float pscale; /* 1 / (1 - p) */
} dropout_t;

/* Offset of row i of head t (of B*H) in its band's (B*H, rows, stop) tensors; *stop = the band's keys. */
static inline int64_t band_row(const dropout_t *dp, int64_t T, int64_t t, int64_t i, int64_t *band_index,
                               int64_t *stop)
{
    const int64_t b = i / dp->band, start = b * dp->band;
    *stop = start + dp->band < T ? start + dp->band : T;
    *band_index = b;
    return (t * (*stop - start) + (i - start)) * *stop;
}

typedef uint8_t vbytes __attribute__((vector_size(LANES)));

/* keep[j..j+LANES) * pscale as floats, lanes below `lanes` only (no read past them; 0 beyond). */
static inline vf kept(const uint8_t *keep, int64_t lanes, float pscale)
{
    vbytes bytes = {0};
    if (lanes >= LANES) /* (a copy of a constant size: one load, where a variable one may be a call) */
        memcpy(&bytes, keep, LANES);
    else
        memcpy(&bytes, keep, (size_t)(lanes > 0 ? lanes : 0));
    return __builtin_convertvector(__builtin_convertvector(bytes, vi), vf) * pscale;
}

/* A head's rows 0..T-1 (stride st) transposed a block of KB rows at a time, into mt [tp / KB][D][KB], zero
 * past T: `dots` then reads each block of keys as one contiguous run of D * KB floats. (Transposed whole, as
 * [D][tp], a block's D rows lay tp floats apart, which at T = 256 or 512 maps them all onto two sets of the L1
 * cache: 1.2x slower as a whole on an Intel Xeon.) */
static void transpose_head(const float *m, int64_t st, int64_t T, int64_t tp, float *mt)
{
    for (int64_t j = 0; j < tp; j++) {
        float *column = mt + (j / KB) * (D * KB) + j % KB;
        for (int d = 0; d < D; d++) column[d * KB] = j < T ? m[j * st + d] : 0.0f;
    }
}

/* out[r][j] = f * x_r . m_j for the R rows x and j < nk (a multiple of KB), m as `transpose_head` holds it. */
static void dots(const float *const *x, const float *mt, int64_t tp, int64_t nk, float f, float *out)
{
    for (int64_t j0 = 0; j0 < nk; j0 += KB) {
        const float *block = mt + j0 * D;
        vf a[R][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (vf){0};
        for (int d = 0; d < D; d++) {
            const vf m0 = vload(block + d * KB), m1 = vload(block + d * KB + LANES);
            for (int r = 0; r < R; r++) {
                const float b = x[r][d];
                a[r][0] += m0 * b;
                a[r][1] += m1 * b;
            }
        }
        for (int r = 0; r < R; r++) {
            vstore(out + r * tp + j0, a[r][0] * f);
            vstore(out + r * tp + j0 + LANES, a[r][1] * f);
        }
    }
}

/* dst_r = f[r] * sum_{j < n} w[r][j] m_j for r < rows (block of rows i0..), where row r reads m_j only for
 * j <= i0 + r: a row never reads a later position (a NaN there must not reach it). */
static void weighted_rows(const float *w, int64_t tp, const float *m, int64_t mst, int64_t n, int64_t i0, int rows,
                          const float *f, float *dst, int64_t dst_st)
{
    for (int c0 = 0; c0 < D; c0 += SPAN) {
        vf a[R][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (vf){0};
        for (int64_t j = 0; j < n; j++) {
            const float *mj = m + j * mst + c0;
            const vf m0 = vload(mj), m1 = vload(mj + LANES);
            for (int r = j < i0 ? 0 : (int)(j - i0); r < R; r++) {
                const float b = w[r * tp + j];
                a[r][0] += m0 * b;
                a[r][1] += m1 * b;
            }
        }
        for (int r = 0; r < rows; r++) {
            float *row = dst + (i0 + r) * dst_st + c0;
            vstore(row, a[r][0] * f[r]);
            vstore(row + LANES, a[r][1] * f[r]);
        }
    }
}

/* acc[j] += sum_r w[r][j] x_r for j < n (acc rows of D floats), over the rows r >= j - i0 that see key j. */
static void rank_update(const float *w, int64_t tp, const float *const *x, int64_t n, int64_t i0, float *acc)
{
    for (int c0 = 0; c0 < D; c0 += SPAN) {
        vf xr[R][2];
        for (int r = 0; r < R; r++) {
            xr[r][0] = vload(x[r] + c0);
            xr[r][1] = vload(x[r] + c0 + LANES);
        }
        for (int64_t j = 0; j < n; j++) {
            float *aj = acc + j * D + c0;
            vf a0 = vload(aj), a1 = vload(aj + LANES);
            for (int r = j < i0 ? 0 : (int)(j - i0); r < R; r++) {
                const float b = w[r * tp + j];
                a0 += xr[r][0] * b;
                a1 += xr[r][1] * b;
            }
            vstore(aj, a0);
            vstore(aj + LANES, a1);
        }
    }
}

/* The largest of x[0 .. n), NaNs skipped (-inf where there is none), in four chains of max: one chain's
 * compare and select per vector would bound the loop by their latency. */
static inline float row_max(const float *x, int64_t n)
{
    vf m0 = vsplat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t j = 0;
    for (; j + 4 * LANES <= n; j += 4 * LANES) {
        m0 = max_v(vload(x + j), m0);
        m1 = max_v(vload(x + j + LANES), m1);
        m2 = max_v(vload(x + j + 2 * LANES), m2);
        m3 = max_v(vload(x + j + 3 * LANES), m3);
    }
    for (; j < n; j += LANES) m0 = vselect(lanes_below(n - j), max_v(vload(x + j), m0), m0);
    return max_lanes(max_v(max_v(m0, m1), max_v(m2, m3)));
}

/* exp(s - the row's largest score): at most 0, or a NaN (a NaN or infinite score), so exp_v's upper clamp
 * would never apply. */
static inline vf exp_below_max(vf x) { return exp_clamped_v(vselect(x < -103.0f, vsplat(-103.0f), x)); }

/* Pointers to rows i0.. of a head (stride st); the spare rows of a short last block repeat its last row. */
static inline void block_rows(const float *m, int64_t st, int64_t i0, int rows, const float **out)
{
    for (int r = 0; r < R; r++) out[r] = m + (i0 + (r < rows ? r : rows - 1)) * st;
}

/* Forward of one head (t of B*H): q, k, v rows at strides qst, kst, vst (D contiguous floats each), out rows
 * at ost. Without dropout (dp NULL), inference; with it, the probabilities are saved and the weights
 * dropped. Scratch: kt [tp / KB][D][KB] and s [R][tp], tp = T rounded up to KB. */
static void head_forward(const float *q, int64_t qst, const float *k, int64_t kst, const float *v, int64_t vst,
                         float *o, int64_t ost, int64_t T, float scale, const dropout_t *dp, int64_t t, float *scratch)
{
    const int64_t tp = (T + KB - 1) / KB * KB;
    float *kt = scratch, *s = scratch + D * tp;
    transpose_head(k, kst, T, tp, kt);
    const float pscale = dp ? dp->pscale : 1.0f;
    for (int64_t i0 = 0; i0 < T; i0 += R) {
        const int rows = T - i0 < R ? (int)(T - i0) : R;
        const int64_t n = i0 + rows, nk = (n + KB - 1) / KB * KB; /* keys seen by the block's last row */
        const float *qr[R];
        block_rows(q, qst, i0, rows, qr);
        dots(qr, kt, tp, nk, scale, s);
        float f[R];
        for (int r = 0; r < R; r++) {
            float *sr = s + r * tp;
            const int64_t seen = r < rows ? i0 + r + 1 : 0; /* keys 0..i: causal */
            const float mv = row_max(sr, seen); /* (a NaN score reaches the sum through exp) */
            vf sum = {0};
            int64_t j = 0;
            for (; j + LANES <= seen; j += LANES) {
                const vf e = exp_below_max(vload(sr + j) - mv);
                vstore(sr + j, e);
                sum += e;
            }
            if (j < seen) { /* the last keys seen, and zeros after them */
                const vf e = vkeep(lanes_below(seen - j), exp_below_max(vload(sr + j) - mv));
                vstore(sr + j, e);
                sum += e;
                j += LANES;
            }
            for (; j < nk; j += LANES) vstore(sr + j, (vf){0});
            f[r] = seen ? 1.0f / sum_lanes(sum) : 0.0f;
            if (dp && seen) { /* save P = e / sum; weights P * keep / (1 - p) */
                int64_t b, stop;
                const int64_t off = band_row(dp, T, t, i0 + r, &b, &stop);
                float *pr = dp->probs[b] + off;
                const uint8_t *kr = dp->keep[b] + off;
                for (int64_t j = 0; j < stop; j += LANES) {
                    const vf pj = j < nk ? vload(sr + j) * f[r] : (vf){0};
                    vstore_first(pr + j, pj, stop - j);
                    if (j < nk)
                        vstore(sr + j, j < seen ? pj * kept(kr + j, seen - j, pscale) : pj);
                }
                f[r] = 1.0f;
            }
        }
        weighted_rows(s, tp, v, vst, n, i0, rows, f, o, ost);
    }
}

/* Backward of one head with dropout: gradients dq, dk, dv (rows at their strides) from dout. Scratch: vt
 * [tp / KB][D][KB], ds and pd [R][tp], dk and dv sums [tp][D]. */
static void head_backward(const float *q, int64_t qst, const float *k, int64_t kst, const float *v, int64_t vst,
                          const float *dout, int64_t dost, float *dq, int64_t dqst, float *dk, int64_t dkst, float *dv,
                          int64_t dvst, int64_t T, float scale, const dropout_t *dp, int64_t t, float *scratch)
{
    const int64_t tp = (T + KB - 1) / KB * KB;
    float *vt = scratch, *ds = vt + D * tp, *pd = ds + R * tp, *dk_sum = pd + R * tp, *dv_sum = dk_sum + tp * D;
    transpose_head(v, vst, T, tp, vt);
    memset(dk_sum, 0, sizeof(float) * (size_t)(2 * tp * D));
    float ones[R];
    for (int r = 0; r < R; r++) ones[r] = 1.0f;
    for (int64_t i0 = 0; i0 < T; i0 += R) {
        const int rows = T - i0 < R ? (int)(T - i0) : R;
        const int64_t n = i0 + rows, nk = (n + KB - 1) / KB * KB;
        const float *gr[R], *qr[R];
        block_rows(dout, dost, i0, rows, gr);
        block_rows(q, qst, i0, rows, qr);
        dots(gr, vt, tp, nk, 1.0f, ds); /* gradient of the dropped weights: dout_i . v_j */
        for (int r = 0; r < R; r++) {
            float *dsr = ds + r * tp, *pdr = pd + r * tp;
            const int64_t seen = r < rows ? i0 + r + 1 : 0;
            if (!seen) {
                memset(dsr, 0, sizeof(float) * (size_t)nk);
                memset(pdr, 0, sizeof(float) * (size_t)nk);
                continue;
            }
            int64_t b, stop;
            const int64_t off = band_row(dp, T, t, i0 + r, &b, &stop);
            const float *pr = dp->probs[b] + off;
            const uint8_t *kr = dp->keep[b] + off;
            vf delta = {0}; /* sum_j P dP: the softmax's backward */
            for (int64_t j = 0; j < seen; j += LANES) {
                const vf kj = kept(kr + j, seen - j, dp->pscale), pj = vload_first(pr + j, seen - j);
                const vf dp_j = vload(dsr + j) * kj;
                vstore(dsr + j, dp_j);
                vstore(pdr + j, pj * kj);
                delta += pj * dp_j;
            }
            const float dv_ = sum_lanes(delta);
            for (int64_t j = 0; j < nk; j += LANES) {
                const vi lanes = lanes_below(seen - j);
                const vf pj = j < seen ? vload_first(pr + j, seen - j) : (vf){0};
                const vf g = (pj * (vload(dsr + j) - dv_)) * scale;
                vstore(dsr + j, vkeep(lanes, g));
                vstore(pdr + j, vkeep(lanes, vload(pdr + j)));
            }
        }
        weighted_rows(ds, tp, k, kst, n, i0, rows, ones, dq, dqst); /* dq_i = sum_j dS_ij k_j */
        rank_update(ds, tp, qr, n, i0, dk_sum);                    /* dk_j += sum_i dS_ij q_i */
        rank_update(pd, tp, gr, n, i0, dv_sum);                    /* dv_j += sum_i P'_ij dout_i */
    }
    for (int64_t j = 0; j < T; j++) {
        memcpy(dk + j * dkst, dk_sum + j * D, sizeof(float) * D);
        memcpy(dv + j * dvst, dv_sum + j * D, sizeof(float) * D);
    }
}

/* Scratch floats per thread: head_forward's or head_backward's. */
static int64_t scratch_floats(int64_t T, int backward)
{
    const int64_t tp = (T + KB - 1) / KB * KB;
    return backward ? (D + 2 * R) * tp + 2 * tp * D : (D + R) * tp;
}

/* The tensors of one call, each (B, H, T, D) with strides [batch, head, position] given in floats (the last
 * dimension contiguous): q, k, v and out for a forward; q, k, v, dout, dq, dk and dv for a backward. */
typedef struct {
    const float *q, *k, *v, *dout;
    float *out, *dq, *dk, *dv;
    const int64_t *qs, *ks, *vs, *os, *dos, *dqs, *dks, *dvs;
    int64_t H, T;
    float scale;
    const dropout_t *dp; /* NULL for inference */
} call_t;

/* Head h of batch entry b of a tensor. */
#define HEAD(m, s, b, h) ((m) + (b) * (s)[0] + (h) * (s)[1])

/* head_forward or head_backward for every (batch, head), one per task of the OpenMP threads, each thread
 * with its own scratch. Returns 0, or 1 where scratch memory could not be allocated. */
static int run_heads(const call_t *c, int64_t B, int backward, int threads)
{
    if (B <= 0 || c->H <= 0 || c->T <= 0) return 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scratch = (float *)malloc(sizeof(float) * (size_t)scratch_floats(c->T, backward));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * c->H; t++) {
            if (!scratch) continue;
            const int64_t b = t / c->H, h = t % c->H;
            const float *q = HEAD(c->q, c->qs, b, h), *k = HEAD(c->k, c->ks, b, h), *v = HEAD(c->v, c->vs, b, h);
            if (backward)
                head_backward(q, c->qs[2], k, c->ks[2], v, c->vs[2], HEAD(c->dout, c->dos, b, h), c->dos[2],
                              HEAD(c->dq, c->dqs, b, h), c->dqs[2], HEAD(c->dk, c->dks, b, h), c->dks[2],
                              HEAD(c->dv, c->dvs, b, h), c->dvs[2], c->T, c->scale, c->dp, t, scratch);
            else
                head_forward(q, c->qs[2], k, c->ks[2], v, c->vs[2], HEAD(c->out, c->os, b, h), c->os[2], c->T,
                             c->scale, c->dp, t, scratch);
        }
        free(scratch);
    }
    return failed;
}

/* The entry points: tensors as in call_t; they return run_heads' status, or 3 (training) for a band that
 * is not a positive multiple of R. */
int hfgpt_causal_attention(const float *q, const float *k, const float *v, float *out, int64_t B, int64_t H,
                           int64_t T, const int64_t *qs, const int64_t *ks, const int64_t *vs, const int64_t *os,
                           float scale, int threads)
{
    const call_t c = {.q = q, .k = k, .v = v, .out = out, .qs = qs, .ks = ks, .vs = vs, .os = os, .H = H, .T = T,
                      .scale = scale, .dp = NULL};
    return run_heads(&c, B, 0, threads);
}

/* Training forward with dropout p (pscale = 1 / (1 - p)): also writes the probabilities into probs. */
int hfgpt_attention_train_forward(const float *q, const float *k, const float *v, float *out, int64_t B, int64_t H,
                                  int64_t T, const int64_t *qs, const int64_t *ks, const int64_t *vs,
                                  const int64_t *os, float scale, const uint8_t *const *keep, float *const *probs,
                                  int64_t band, float pscale, int threads)
{
    if (band <= 0 || band % R) return 3;
    const dropout_t dp = {keep, probs, band, pscale};
    const call_t c = {.q = q, .k = k, .v = v, .out = out, .qs = qs, .ks = ks, .vs = vs, .os = os, .H = H, .T = T,
                      .scale = scale, .dp = &dp};
    return run_heads(&c, B, 0, threads);
}

/* Its backward: dq, dk, dv from dout. */
int hfgpt_attention_train_backward(const float *q, const float *k, const float *v, const float *dout, float *dq,
                                   float *dk, float *dv, int64_t B, int64_t H, int64_t T, const int64_t *qs,
                                   const int64_t *ks, const int64_t *vs, const int64_t *dos, const int64_t *dqs,
                                   const int64_t *dks, const int64_t *dvs, float scale, const uint8_t *const *keep,
                                   float *const *probs, int64_t band, float pscale, int threads)
{
    if (band <= 0 || band % R) return 3;
    const dropout_t dp = {keep, probs, band, pscale};
    const call_t c = {.q = q, .k = k, .v = v, .dout = dout, .dq = dq, .dk = dk, .dv = dv, .qs = qs, .ks = ks,
                      .vs = vs, .dos = dos, .dqs = dqs, .dks = dks, .dvs = dvs, .H = H, .T = T, .scale = scale,
                      .dp = &dp};
    return run_heads(&c, B, 1, threads);
}

/* head_decode for every (batch, head), one per task of the OpenMP threads, each thread with its own
 * scratch. Returns 0, or 1 where scratch memory could not be allocated. */
static int decode_heads(const float *q, const float *k, const float *v, float *out, const uint8_t *mask,
                        int64_t mask_stride, int64_t B, int64_t H, int64_t T, const int64_t *qs, const int64_t *ks,
                        const int64_t *vs, const int64_t *os, float scale, int threads)
{
    if (B <= 0 || H <= 0) return 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * H > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(T > 0 ? T : 1));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * H; t++) {
            if (!s) continue;
            const int64_t b = t / H, h = t % H;
            const float *qh = HEAD(q, qs, b, h);
            const float *kh = HEAD(k, ks, b, h), *vh = HEAD(v, vs, b, h);
            head_decode(qh, kh, ks[2], vh, vs[2], mask ? mask + b * mask_stride : NULL, T, scale, s,
                        HEAD(out, os, b, h));
        }
        free(s);
    }
    return failed;
}

/* One decoding step: q (B, H, 1, D) against k and v (B, H, T, D), strides [batch, head, position] in floats
 * (q's and out's position strides unused), out (B, H, 1, D) at its strides. mask: NULL, or bytes (1 =
 * attend) for batch entry b's T keys at mask + b * mask_stride (0: one row for all). Returns 0, or 1 where
 * scratch memory could not be allocated. */
int hfgpt_attention_decode(const float *q, const float *k, const float *v, float *out, const uint8_t *mask,
                           int64_t mask_stride, int64_t B, int64_t H, int64_t T, const int64_t *qs, const int64_t *ks,
                           const int64_t *vs, const int64_t *os, float scale, int threads)
{
    return decode_heads(q, k, v, out, mask, mask_stride, B, H, T, qs, ks, vs, os, scale, threads);
}
