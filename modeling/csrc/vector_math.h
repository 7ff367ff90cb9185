/* AVX-512 helpers shared by hfgpt's C kernels (attention.c, gelu.c); included where __AVX512F__,
 * __AVX512BW__ and __AVX512VL__ are defined. native.py's build hashes this header with each source. */
#ifndef HFGPT_VECTOR_MATH_H
#define HFGPT_VECTOR_MATH_H
#include <immintrin.h>
#include <stdint.h>

/* exp(x) for 16 floats: a degree-6 polynomial on [-ln2/2, ln2/2] scaled by 2^n (relative error ~1e-7,
 * as expf); arguments are clamped at -103, whose exp is float's smallest subnormal (1.4e-45). A NaN
 * stays NaN; arguments above 88.7 give infinity. */
static inline __m512 exp_ps(__m512 x)
{
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    x = _mm512_max_ps(_mm512_set1_ps(-103.0f), x); /* (max_ps returns its second operand, x, for a NaN) */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first(int64_t n) /* lanes below n (0 <= n) */
{
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

#endif
