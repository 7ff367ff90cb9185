/* hfgpt's tanh GELU on the CPU in float32, forward and backward, for training's MLP activations.
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by `gelu_tanh` in
 * cpu/ops.py, which runs torch's `F.gelu(x, approximate="tanh")` wherever this does not apply. With
 * u = sqrt(2/pi) (x + 0.044715 x^3), the GELU 0.5 x (1 + tanh u) is x sigmoid(2u) exactly:
 *   y = x s,  s = 1 / (1 + e),  e = exp(-2u);
 *   dy/dx = s + 2 x u' (1 - s) s,  u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
 * (1 - s as e s, without the cancellation of 1 - s). One exp and one division an element where torch's
 * kernel evaluates a tanh, which makes this several times faster on the MLP's activations, forward and
 * backward (benchmarks/RESULTS.md). Both are computed from x clamped to [-10, 10], and are 0 below -10
 * (the GELU's magnitude there is below 1e-37; torch's float32 gives 0 below about -4): no
 * overflow for any finite x. A NaN stays NaN, -inf gives NaN and +inf gives +inf (as in torch); the
 * gradient at a NaN or an infinite x is NaN (as in torch), and at any finite x the slope of the GELU,
 * 1 or 0 beyond the clamp, where torch's float32 formula overflows to NaN for |x| above about 1.8e19.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "vector_math.h"
#define VECTORIZED 1
#define PARALLEL_FROM 32768 /* elements: fewer run on the calling thread */

int hfgpt_gelu_forward(const float *x, float *y, int64_t n, int threads)
{
    if (n < 0 || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        _mm512_mask_storeu_ps(y + i, m, gelu_ps(_mm512_maskz_loadu_ps(m, x + i)));
    }
    return 0;
}

/* grad_x = grad_y * dy/dx at x */
int hfgpt_gelu_backward(const float *x, const float *grad_y, float *grad_x, int64_t n, int threads)
{
    if (n < 0 || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        __m512 s, es, dv;
        sigmoid_parts(v, &s, &es, &dv);
        /* s + 2u' x (1 - s) s, plus x - x: 0 for a finite x, NaN for an infinite one (the clamp lost it) */
        const __m512 slope = _mm512_add_ps(_mm512_fmadd_ps(dv, _mm512_mul_ps(es, s), s), _mm512_sub_ps(v, v));
        _mm512_mask_storeu_ps(grad_x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, grad_y + i), slope));
    }
    return 0;
}
#else
#define VECTORIZED 0

int hfgpt_gelu_forward(const float *x, float *y, int64_t n, int threads)
{
    (void)x, (void)y, (void)n, (void)threads;
    return 3;
}

int hfgpt_gelu_backward(const float *x, const float *grad_y, float *grad_x, int64_t n, int threads)
{
    (void)x, (void)grad_y, (void)grad_x, (void)n, (void)threads;
    return 3;
}
#endif

/* Whether this build has the vector path (else the entry points return 3 and callers run torch's GELU). */
int hfgpt_gelu_vectorized(void) { return VECTORIZED; }
