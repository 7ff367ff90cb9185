/* hfgpt's LM-head loss on the CPU in float32: the log-sum-exp of the logits a block of the vocabulary at a
 * time (forward), and softmax - onehot times each row's scale a slice at a time (backward).
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by
 * `onednn_logits_and_lse` and `_LinearCrossEntropy.backward` in cpu/ops.py, whose torch expressions of
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
 * the factor (which overflows when the first finite block lies below -88). Each block's sum is taken in 16
 * float lanes and added to the double total.
 *
 * exp of an argument below -103 is 0 here (as for torch's float32 exp, whose results are subnormal or 0
 * there), so that exp(-inf) is 0; a NaN stays NaN.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "vector_math.h"
#define VECTORIZED 1
#define PARALLEL_FROM 65536 /* elements: fewer run on the calling thread */

static inline __m512 exp_or_zero(__m512 x)
{
    /* lanes not below -103 (NaN included: exp_ps keeps it) take exp_ps, the others 0 */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.0f), _CMP_NLT_UQ), exp_ps(x));
}

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
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 m = first(cols - c);
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + c);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, v);
        }
        const float old_peak = peak[r];
        float new_peak = fmaxf(old_peak, _mm512_reduce_max_ps(top));
        if (nan || isnan(old_peak))
            new_peak = NAN;
        const float old_shift = finite_or_zero(old_peak), new_shift = finite_or_zero(new_peak);
        const __m512 shift = _mm512_set1_ps(new_shift);
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 32 <= cols; c += 32) {
            const __m512 v0 = _mm512_loadu_ps(x + c), v1 = _mm512_loadu_ps(x + c + 16);
            _mm512_storeu_ps(y + c, v0);
            _mm512_storeu_ps(y + c + 16, v1);
            sum0 = _mm512_add_ps(sum0, exp_or_zero(_mm512_sub_ps(v0, shift)));
            sum1 = _mm512_add_ps(sum1, exp_or_zero(_mm512_sub_ps(v1, shift)));
        }
        for (; c < cols; c += 16) {
            const __mmask16 m = first(cols - c);
            const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
            _mm512_mask_storeu_ps(y + c, m, v);
            sum0 = _mm512_add_ps(sum0, _mm512_maskz_mov_ps(m, exp_or_zero(_mm512_sub_ps(v, shift))));
        }
        const double block = (double)_mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
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
        const __m512 l = _mm512_set1_ps(lse[r]), s = _mm512_set1_ps(scale[r]);
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 m = first(cols - c);
            const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
            _mm512_mask_storeu_ps(g + c, m, _mm512_mul_ps(exp_or_zero(_mm512_sub_ps(v, l)), s));
        }
        const int64_t t = targets[r] - start;
        if (t >= 0 && t < cols)
            g[t] += -scale[r];
    }
    return 0;
}
#else
#define VECTORIZED 0

int hfgpt_lse_block(const float *part, int64_t ldp, float *out, int64_t ldo, int64_t rows, int64_t cols,
                    float *peak, double *total, int threads)
{
    (void)part, (void)ldp, (void)out, (void)ldo, (void)rows, (void)cols, (void)peak, (void)total, (void)threads;
    return 3;
}

int hfgpt_softmax_grad(const float *logits, int64_t ldl, const float *lse, const float *scale,
                       const int64_t *targets, int64_t start, int64_t rows, int64_t cols, float *grad,
                       int64_t ldg, int threads)
{
    (void)logits, (void)ldl, (void)lse, (void)scale, (void)targets, (void)start, (void)rows, (void)cols;
    (void)grad, (void)ldg, (void)threads;
    return 3;
}
#endif

/* Whether this build has the vector path (else the entry points return 3 and callers run torch's ops). */
int hfgpt_loss_vectorized(void) { return VECTORIZED; }
