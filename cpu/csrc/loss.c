/* hfgpt's LM-head loss on the CPU in float32: the log-sum-exp of the logits a block of the vocabulary at a
 * time (forward), and softmax - onehot times each row's scale a slice at a time (backward).
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by
 * `blockwise_logits_and_lse` and `_LinearCrossEntropy.backward` in cpu/ops.py, whose torch expressions of
 * the same arithmetic run wherever this does not apply. Each row's pass over a block is one read of data
 * that oneDNN has just written (still in cache) where torch's ops make five or six passes: copy into the
 * logits, amax, subtract, exp, sum; and, backward, subtract, exp, multiply, then index_put for the targets.
 *
 * Forward, per row r, for a block of columns x (the block's logits, copied into `out` on the way):
 *   peak'  = max(peak, max x)                  the running maximum (NaN where a NaN was seen)
 *   shift  = peak  where finite, else 0        what the running sum is taken against
 *   total' = total exp(shift - shift') + sum exp(x - shift')
 * so that log(total) + shift is the row's log-sum-exp, as torch.logsumexp gives it: +inf for a row with
 * +inf, -inf for a row of -inf, NaN for a row with a NaN. A total of 0 (only -inf so far) stays 0 whatever
 * the factor (which overflows when the first finite block lies below -88). Each block's sum is taken in the
 * vector's float lanes (vector_math.h: as wide as the host's) and added to the double total.
 *
 * exp of an argument below -103 is 0 here (as for torch's float32 exp, whose results are subnormal or 0
 * there), so that exp(-inf) is 0; a NaN stays NaN.
 */
#include <math.h>
#include <stdint.h>

#include "vector_math.h"
#define PARALLEL_FROM 65536 /* elements: fewer run on the calling thread */

static inline float finite_or_zero(float x) { return isfinite(x) ? x : 0.0f; }

/* part: rows x cols, row stride ldp; out: the same values written with row stride ldo (may be part
 * itself); peak: rows floats, -inf before the first block; total: rows doubles, 0 before the first block. */
int hfgpt_lse_block(const float *part, int64_t ldp, float *out, int64_t ldo, int64_t rows, int64_t cols,
                    float *peak, double *total, int threads)
{
    if (rows < 0 || cols < 0 || ldp < cols || ldo < cols || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = part + r * ldp;
        float *y = out + r * ldo;
        vf top = vsplat(-INFINITY);
        vi nan = {0};
        for (int64_t c = 0; c < cols; c += LANES) {
            const vf v = vselect(lanes_below(cols - c), vload_first(x + c, cols - c), vsplat(-INFINITY));
            nan |= v != v;
            top = max_v(v, top); /* (a NaN lane keeps top: `nan` records it) */
        }
        int seen_nan = isnan(peak[r]);
        for (int i = 0; i < LANES; i++) seen_nan |= nan[i] != 0;
        const float old_peak = peak[r];
        const float new_peak = seen_nan ? NAN : fmaxf(old_peak, max_lanes(top));
        const float old_shift = finite_or_zero(old_peak), new_shift = finite_or_zero(new_peak);
        vf sum0 = {0}, sum1 = {0};
        int64_t c = 0;
        for (; c + 2 * LANES <= cols; c += 2 * LANES) {
            const vf v0 = vload(x + c), v1 = vload(x + c + LANES);
            vstore(y + c, v0);
            vstore(y + c + LANES, v1);
            sum0 += exp_or_zero(v0 - new_shift);
            sum1 += exp_or_zero(v1 - new_shift);
        }
        for (; c < cols; c += LANES) {
            const vf v = vload_first(x + c, cols - c);
            vstore_first(y + c, v, cols - c);
            sum0 += vkeep(lanes_below(cols - c), exp_or_zero(v - new_shift));
        }
        const double block = (double)sum_lanes(sum0 + sum1);
        const double kept = total[r] == 0.0 ? 0.0 : total[r] * exp((double)old_shift - (double)new_shift);
        total[r] = kept + block;
        peak[r] = new_peak;
    }
    return 0;
}

/* grad[r, c] = exp(logits[r, c] - lse[r]) * scale[r] for a slice of cols columns (logits row stride ldl,
 * grad row stride ldg), then grad[r, targets[r] - start] += -scale[r] where that column lies in the slice
 * (as index_put with accumulate=True after torch's sub, exp_ and mul_). */
int hfgpt_softmax_grad(const float *logits, int64_t ldl, const float *lse, const float *scale,
                       const int64_t *targets, int64_t start, int64_t rows, int64_t cols, float *grad,
                       int64_t ldg, int threads)
{
    if (rows < 0 || cols < 0 || ldl < cols || ldg < cols || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * ldl;
        float *g = grad + r * ldg;
        const float l = lse[r], s = scale[r];
        for (int64_t c = 0; c < cols; c += LANES)
            vstore_first(g + c, exp_or_zero(vload_first(x + c, cols - c) - l) * s, cols - c);
        const int64_t t = targets[r] - start;
        if (t >= 0 && t < cols)
            g[t] += -scale[r];
    }
    return 0;
}
