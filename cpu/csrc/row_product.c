/* hfgpt's float32 products of one row with a weight on the CPU: a decoding step at batch size 1, which
 * streams every weight of the model once and does two FLOPs a weight, so runs at the speed the weights
 * are read from memory.
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by `one_row_product`
 * (an `[out, in]` weight: nn.Linear, the LM head, the float32 decoding copy) and `one_row_conv1d` (a
 * Conv1D `[in, out]` weight: the model's own layers, through `hfgpt.cpu.layers.conv1d_forward`) in
 * cpu/ops.py, which split torch's products between the threads wherever this does not apply.
 *
 * `[out, in]`: each thread takes a contiguous run of the weight's rows, one dot product a row with four
 * accumulators, so that it reads one sequential stream. `[in, out]`: each thread takes a contiguous run
 * of the weight's rows too, adding x[i] w[i, :] into a partial sum of its own (in cache) eight rows at a
 * time; the partial sums and the bias are then added. The sums run in another order than MKL's: equal to
 * float rounding.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <omp.h>

#include "vector_math.h"
#define VECTORIZED 1
#define PARALLEL_FROM 32768 /* weight elements: fewer run on the calling thread */

/* y[o] = sum_i x[i] w[o, i] (+ bias[o]) for o < out; w contiguous, out x in. */
int hfgpt_row_product(const float *x, const float *w, int64_t out, int64_t in, const float *bias, float *y,
                      int threads)
{
    if (out < 0 || in < 0 || threads < 1)
        return 2;
    const int64_t full = in / 64 * 64;
#pragma omp parallel for num_threads(threads) schedule(static) if (out * in >= PARALLEL_FROM)
    for (int64_t o = 0; o < out; o++) {
        const float *p = w + o * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < full; i += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 16), _mm512_loadu_ps(x + i + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 32), _mm512_loadu_ps(x + i + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 48), _mm512_loadu_ps(x + i + 48), a3);
        }
        for (; i < in; i += 16) {
            const __mmask16 m = first(in - i);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + i), _mm512_maskz_loadu_ps(m, x + i), a0);
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        y[o] = bias ? sum + bias[o] : sum;
    }
    return 0;
}

/* acc[:out] += sum over rows i of [from, to) of x[i] w[i, :]; eight rows at a time. */
static void add_rows(const float *x, const float *w, int64_t out, int64_t from, int64_t to, float *acc)
{
    int64_t i = from;
    for (; i + 8 <= to; i += 8) {
        __m512 xv[8];
        for (int k = 0; k < 8; k++)
            xv[k] = _mm512_set1_ps(x[i + k]);
        const float *p = w + i * out;
        for (int64_t c = 0; c < out; c += 16) {
            const __mmask16 m = first(out - c);
            __m512 s0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + c), xv[0]);
            __m512 s1 = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + out + c), xv[1]);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 2 * out + c), xv[2], s0);
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 3 * out + c), xv[3], s1);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 4 * out + c), xv[4], s0);
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 5 * out + c), xv[5], s1);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 6 * out + c), xv[6], s0);
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + 7 * out + c), xv[7], s1);
            _mm512_mask_storeu_ps(acc + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + c), _mm512_add_ps(s0, s1)));
        }
    }
    for (; i < to; i++) {
        const __m512 x0 = _mm512_set1_ps(x[i]);
        const float *p = w + i * out;
        for (int64_t c = 0; c < out; c += 16) {
            const __mmask16 m = first(out - c);
            _mm512_mask_storeu_ps(acc + c, m,
                                  _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + c), x0, _mm512_maskz_loadu_ps(m, acc + c)));
        }
    }
}

/* y = x @ w (+ bias) for w contiguous, in x out; scratch: threads x out floats. */
int hfgpt_row_conv1d(const float *x, const float *w, int64_t in, int64_t out, const float *bias, float *y,
                     float *scratch, int threads)
{
    if (out < 0 || in < 0 || threads < 1)
        return 2;
#pragma omp parallel num_threads(threads) if (out * in >= PARALLEL_FROM)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t per = ((in + team - 1) / team + 7) / 8 * 8; /* whole groups of eight rows a thread */
        const int64_t from = t * per < in ? t * per : in, to = from + per < in ? from + per : in;
        float *acc = scratch + t * out;
        for (int64_t c = 0; c < out; c += 16)
            _mm512_mask_storeu_ps(acc + c, first(out - c), _mm512_setzero_ps());
        add_rows(x, w, out, from, to, acc);
#pragma omp barrier
        const int64_t vectors = (out + 15) / 16, share = (vectors + team - 1) / team;
        for (int64_t c = t * share * 16; c < out && c < (t + 1) * share * 16; c += 16) {
            const __mmask16 m = first(out - c);
            __m512 s = bias ? _mm512_maskz_loadu_ps(m, bias + c) : _mm512_setzero_ps();
            for (int u = 0; u < team; u++)
                s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, scratch + u * out + c));
            _mm512_mask_storeu_ps(y + c, m, s);
        }
    }
    return 0;
}
#else
#define VECTORIZED 0
#endif

#if VECTORIZED && defined(__AVX512BF16__)
#define BFLOAT16 1

/* float -> bfloat16, rounding to nearest even (a NaN stays a quiet NaN) */
static inline uint16_t to_bfloat16(float value)
{
    union { float f; uint32_t u; } bits = {value};
    if ((bits.u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((bits.u >> 16) | 0x40u);
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

static inline float from_bfloat16(uint16_t value)
{
    union { uint32_t u; float f; } bits = {(uint32_t)value << 16};
    return bits.f;
}

/* y[o] = bfloat16(sum_i x[i] w[o, i] (+ bias[o])) for bfloat16 x, w (contiguous, out x in), bias and y: the
 * products of pairs summed in float32 by VDPBF16PS (as oneDNN's bfloat16 products; subnormal inputs count
 * as 0), the bias added in float32, then one rounding to bfloat16. */
int hfgpt_row_product_bf16(const uint16_t *x, const uint16_t *w, int64_t out, int64_t in, const uint16_t *bias,
                           uint16_t *y, int threads)
{
    if (out < 0 || in < 0 || threads < 1)
        return 2;
    const int64_t full = in / 64 * 64;
#pragma omp parallel for num_threads(threads) schedule(static) if (out * in >= PARALLEL_FROM)
    for (int64_t o = 0; o < out; o++) {
        const uint16_t *p = w + o * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < full; i += 64) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(p + i), (__m512bh)_mm512_loadu_si512(x + i));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(p + i + 32),
                                  (__m512bh)_mm512_loadu_si512(x + i + 32));
        }
        for (; i < in; i += 32) {
            const int64_t left = in - i;
            const __mmask32 m = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, p + i),
                                  (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        y[o] = to_bfloat16(bias ? sum + from_bfloat16(bias[o]) : sum);
    }
    return 0;
}
#else
#define BFLOAT16 0

int hfgpt_row_product_bf16(const uint16_t *x, const uint16_t *w, int64_t out, int64_t in, const uint16_t *bias,
                           uint16_t *y, int threads)
{
    (void)x, (void)w, (void)out, (void)in, (void)bias, (void)y, (void)threads;
    return 3;
}
#endif

#if !VECTORIZED

int hfgpt_row_product(const float *x, const float *w, int64_t out, int64_t in, const float *bias, float *y,
                      int threads)
{
    (void)x, (void)w, (void)out, (void)in, (void)bias, (void)y, (void)threads;
    return 3;
}

int hfgpt_row_conv1d(const float *x, const float *w, int64_t in, int64_t out, const float *bias, float *y,
                     float *scratch, int threads)
{
    (void)x, (void)w, (void)in, (void)out, (void)bias, (void)y, (void)scratch, (void)threads;
    return 3;
}
#endif

/* Whether this build has the vector path (else the entry points return 3 and callers run torch's ops), and
 * the bfloat16 one (AVX-512 BF16). */
int hfgpt_row_product_vectorized(void) { return VECTORIZED; }
int hfgpt_row_product_bf16_available(void) { return BFLOAT16; }
