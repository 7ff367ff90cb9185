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
 * float rounding. One portable source (vector_math.h's vectors, as wide as the host's: AVX2, AVX-512,
 * NEON).
 *
 * The bfloat16 product (`hfgpt_row_product_bf16`) is the one part in intrinsics: AVX-512 BF16's VDPBF16PS
 * multiplies pairs of bfloat16 and sums them in float32 in one instruction, which a CPU without it has no
 * counterpart of (its callers then run oneDNN or torch).
 */
#include <omp.h>
#include <stdint.h>

#include "vector_math.h"
#define PARALLEL_FROM 32768 /* weight elements: fewer run on the calling thread */

/* y[o] = sum_i x[i] w[o, i] (+ bias[o]) for o < out; w contiguous, out x in. */
int hfgpt_row_product(const float *x, const float *w, int64_t out, int64_t in, const float *bias, float *y,
                      int threads)
{
    if (out < 0 || in < 0 || threads < 1)
        return 2;
    const int64_t full = in / (4 * LANES) * (4 * LANES);
#pragma omp parallel for num_threads(threads) schedule(static) if (out * in >= PARALLEL_FROM)
    for (int64_t o = 0; o < out; o++) {
        const float *p = w + o * in;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i < full; i += 4 * LANES) {
            a0 += vload(p + i) * vload(x + i);
            a1 += vload(p + i + LANES) * vload(x + i + LANES);
            a2 += vload(p + i + 2 * LANES) * vload(x + i + 2 * LANES);
            a3 += vload(p + i + 3 * LANES) * vload(x + i + 3 * LANES);
        }
        for (; i < in; i += LANES)
            a0 += vload_first(p + i, in - i) * vload_first(x + i, in - i);
        const float sum = sum_lanes((a0 + a1) + (a2 + a3));
        y[o] = bias ? sum + bias[o] : sum;
    }
    return 0;
}

/* acc[:out] += sum over rows i of [from, to) of x[i] w[i, :]; eight rows at a time. */
static void add_rows(const float *x, const float *w, int64_t out, int64_t from, int64_t to, float *acc)
{
    int64_t i = from;
    for (; i + 8 <= to; i += 8) {
        const float *p = w + i * out;
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
        const float x4 = x[i + 4], x5 = x[i + 5], x6 = x[i + 6], x7 = x[i + 7];
        for (int64_t c = 0; c < out; c += LANES) {
            const int64_t n = out - c;
            vf s0 = vload_first(p + c, n) * x0;
            vf s1 = vload_first(p + out + c, n) * x1;
            s0 += vload_first(p + 2 * out + c, n) * x2;
            s1 += vload_first(p + 3 * out + c, n) * x3;
            s0 += vload_first(p + 4 * out + c, n) * x4;
            s1 += vload_first(p + 5 * out + c, n) * x5;
            s0 += vload_first(p + 6 * out + c, n) * x6;
            s1 += vload_first(p + 7 * out + c, n) * x7;
            vstore_first(acc + c, vload_first(acc + c, n) + (s0 + s1), n);
        }
    }
    for (; i < to; i++) {
        const float *p = w + i * out;
        for (int64_t c = 0; c < out; c += LANES)
            vstore_first(acc + c, vload_first(p + c, out - c) * x[i] + vload_first(acc + c, out - c), out - c);
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
        memset(acc, 0, sizeof(float) * (size_t)out);
        add_rows(x, w, out, from, to, acc);
#pragma omp barrier
        const int64_t vectors = (out + LANES - 1) / LANES, share = (vectors + team - 1) / team;
        for (int64_t c = t * share * LANES; c < out && c < (t + 1) * share * LANES; c += LANES) {
            vf s = bias ? vload_first(bias + c, out - c) : (vf){0};
            for (int u = 0; u < team; u++)
                s += vload_first(scratch + u * out + c, out - c);
            vstore_first(y + c, s, out - c);
        }
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BFLOAT16 1
#include <immintrin.h>

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

/* Whether this build has the bfloat16 product (AVX-512 BF16; else it returns 3 and callers run oneDNN or
 * torch). */
int hfgpt_row_product_bf16_available(void) { return BFLOAT16; }
