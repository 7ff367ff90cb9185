/* AVX-512 helpers shared by hfgpt's C kernels (attention.c, gelu.c, int8_linear.c, loss.c, row_product.c);
 * included where __AVX512F__, __AVX512BW__ and __AVX512VL__ are defined. cpu/native.py's build hashes this
 * header with each source. */
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

/* The tanh GELU as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): gelu.c (forward and backward) and
 * int8_linear.c's decoding block. */
static const float SQRT_2_OVER_PI = 0.7978845608028654f, CUBIC = 0.044715f, LIMIT = 10.0f;

/* For 16 values x: *s = sigmoid(2u) (0 below -LIMIT), *es = 1 - s, and *dv = 2u' x, each from x clamped to
 * [-LIMIT, LIMIT] (where exp(-2u) lies in [1e-38, 1e38], so e s never overflows; beyond it the GELU is x,
 * or 0 to 1e-37). */
static inline void sigmoid_parts(__m512 x, __m512 *s, __m512 *es, __m512 *dv)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    /* (min_ps and max_ps return their second operand for a NaN: the NaN) */
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-LIMIT), _mm512_min_ps(_mm512_set1_ps(LIMIT), x));
    const __m512 x2 = _mm512_mul_ps(xc, xc);
    const __m512 u = _mm512_mul_ps(_mm512_mul_ps(xc, _mm512_set1_ps(SQRT_2_OVER_PI)),
                                   _mm512_fmadd_ps(x2, _mm512_set1_ps(CUBIC), one));
    const __m512 e = exp_ps(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    *s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-LIMIT), _CMP_NLT_UQ), sig);
    *es = _mm512_mul_ps(e, sig); /* 1 - s without the cancellation of 1 - s */
    *dv = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f * SQRT_2_OVER_PI), xc),
                        _mm512_fmadd_ps(x2, _mm512_set1_ps(3.0f * CUBIC), one));
}

/* The tanh GELU of 16 values (gelu.c's forward, int8_linear.c's decoding block). */
static inline __m512 gelu_ps(__m512 x)
{
    __m512 s, es, dv;
    sigmoid_parts(x, &s, &es, &dv);
    return _mm512_mul_ps(x, s);
}

#endif
