/* hfgpt's tanh GELU on the CPU in float32, forward and backward, for training's MLP activations.
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by `gelu_tanh` in
 * cpu/ops.py, which runs torch's `F.gelu(x, approximate="tanh")` wherever this does not apply. With
 * u = sqrt(2/pi) (x + 0.044715 x^3), the GELU 0.5 x (1 + tanh u) is x sigmoid(2u) exactly:
 *   y = x s,  s = 1 / (1 + e),  e = exp(-2u);
 *   dy/dx = s + 2 x u' (1 - s) s,  u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
 * (1 - s as e s, without the cancellation of 1 - s). One exp and one division an element where torch's
 * kernel evaluates a tanh, which makes this several times faster on the MLP's activations, forward and
 * backward (benchmarks/RESULTS.md). One portable source (vector_math.h's vectors, as wide as the host's:
AVX2, AVX-512, NEON). Both are computed from x clamped to [-10, 10], and are 0 below -10
 * (the GELU's magnitude there is below 1e-37; torch's float32 gives 0 below about -4): no
 * overflow for any finite x. A NaN stays NaN, -inf gives NaN and +inf gives +inf (as in torch); the
 * gradient at a NaN or an infinite x is NaN (as in torch), and at any finite x the slope of the GELU,
 * 1 or 0 beyond the clamp, where torch's float32 formula overflows to NaN for |x| above about 1.8e19.
 */
#include <stdint.h>

#include "vector_math.h"
#define PARALLEL_FROM 32768 /* elements: fewer run on the calling thread */

int hfgpt_gelu_forward(const float *x, float *y, int64_t n, int threads)
{
    if (n < 0 || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < n; i += LANES)
        vstore_first(y + i, gelu_v(vload_first(x + i, n - i)), n - i);
    return 0;
}

/* grad_x = grad_y * dy/dx at x */
int hfgpt_gelu_backward(const float *x, const float *grad_y, float *grad_x, int64_t n, int threads)
{
    if (n < 0 || threads < 1)
        return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < n; i += LANES) {
        const vf v = vload_first(x + i, n - i);
        vf s, es, dv;
        sigmoid_parts_v(v, &s, &es, &dv);
        /* s + 2u' x (1 - s) s, plus x - x: 0 for a finite x, NaN for an infinite one (the clamp lost it) */
        const vf slope = (dv * (es * s) + s) + (v - v);
        vstore_first(grad_x + i, vload_first(grad_y + i, n - i) * slope, n - i);
    }
    return 0;
}
