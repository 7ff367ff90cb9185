/* hfgpt's causal self-attention for CPU inference (prefill): out = softmax(scale Q K^T, causal) V, per
 * batch entry and head, for heads of D = 64 (every GPT-1 and GPT-2 size) in float32.
 *
 * Built on first use by hfgpt/modeling/native.py (cc -O3 -march=native -fopenmp) and called by
 * `native_causal_attention` in ops_hfgpt.py, which falls back to torch's sdpa (in bands) wherever this
 * does not apply. Torch's CPU flash-attention kernel spends half its time outside the arithmetic on
 * GPT-2's short heads of 64; this one holds a head's keys transposed ([D][T], 128 KB at T = 512, in L2) and
 * works R = 8 query rows at a time:
 *   scores  S[r][j] = scale * q_r . k_j for the keys j up to the block's last row, 8 rows x 32 keys in
 *           16 AVX-512 accumulators, one broadcast of q[r][d] per 2 FMAs;
 *   softmax per row over j <= i (the row's own position), exactly: max, exp(S - max), sum (the block's
 *           scores are all in cache, so no running rescaling is needed);
 *   values  O[r] = sum_j P[r][j] v_j / sum, half a head (32 values) at a time.
 * Each (batch, head) is one task for the OpenMP threads, and the sums for one output run in a fixed
 * order, so the result does not depend on the number of threads.
 *
 * exp is a degree-6 polynomial on [-ln2/2, ln2/2] scaled by 2^n (relative error ~1e-7, as expf);
 * arguments below -103 give 0 (their true value is under float's smallest subnormal). Each output row
 * reads only its own query and the keys and values up to its position, as causal sdpa: a NaN or an
 * infinity there gives NaN outputs in that row (as in sdpa), and never reaches an earlier row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define D 64 /* head size */
#define R 8  /* query rows per block */
#define KB 32 /* keys per block of scores */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTORIZED 1

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

/* One head: q, k, v rows at strides qst, kst, vst (D contiguous floats each), out rows at ost. Scratch:
 * kt [D][tp] and s [R][tp], tp = T rounded up to KB. */
static void head(const float *q, int64_t qst, const float *k, int64_t kst, const float *v, int64_t vst, float *o,
                 int64_t ost, int64_t T, float scale, float *kt, float *s)
{
    const int64_t tp = (T + KB - 1) / KB * KB;
    for (int64_t j = 0; j < T; j++)
        for (int d = 0; d < D; d++) kt[d * tp + j] = k[j * kst + d];
    for (int d = 0; d < D; d++)
        for (int64_t j = T; j < tp; j++) kt[d * tp + j] = 0.0f;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i0 = 0; i0 < T; i0 += R) {
        const int rows = T - i0 < R ? (int)(T - i0) : R;
        const int64_t n = i0 + rows, nk = (n + KB - 1) / KB * KB; /* keys seen by the block's last row */
        const float *qr[R];
        for (int r = 0; r < R; r++) qr[r] = q + (i0 + (r < rows ? r : rows - 1)) * qst; /* spare rows repeat */
        for (int64_t j0 = 0; j0 < nk; j0 += KB) {
            __m512 a[R][2];
            for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m512 k0 = _mm512_loadu_ps(kt + d * tp + j0), k1 = _mm512_loadu_ps(kt + d * tp + j0 + 16);
                for (int r = 0; r < R; r++) {
                    const __m512 b = _mm512_set1_ps(qr[r][d]);
                    a[r][0] = _mm512_fmadd_ps(b, k0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(b, k1, a[r][1]);
                }
            }
            for (int r = 0; r < R; r++) {
                _mm512_storeu_ps(s + r * tp + j0, _mm512_mul_ps(a[r][0], sc));
                _mm512_storeu_ps(s + r * tp + j0 + 16, _mm512_mul_ps(a[r][1], sc));
            }
        }
        float inv[R];
        for (int r = 0; r < R; r++) {
            float *sr = s + r * tp;
            const int64_t seen = r < rows ? i0 + r + 1 : 0; /* keys 0..i: causal */
            __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < seen; j += 16)
                m = _mm512_mask_max_ps(m, first(seen - j), m, _mm512_loadu_ps(sr + j));
            const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            for (int64_t j = 0; j < nk; j += 16) {
                const __mmask16 keep = j < seen ? first(seen - j) : 0;
                const __m512 e = _mm512_maskz_mov_ps(keep, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
                _mm512_storeu_ps(sr + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            inv[r] = seen ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
        }
        for (int half = 0; half < 2; half++) {
            __m512 a[R][2];
            for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const float *vj = v + j * vst + 32 * half;
                const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
                /* A row never reads a later position's values (a NaN there must not reach it). */
                for (int r = j < i0 ? 0 : (int)(j - i0); r < R; r++) {
                    const __m512 b = _mm512_set1_ps(s[r * tp + j]);
                    a[r][0] = _mm512_fmadd_ps(b, v0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(b, v1, a[r][1]);
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m512 iv = _mm512_set1_ps(inv[r]);
                float *orow = o + (i0 + r) * ost + 32 * half;
                _mm512_storeu_ps(orow, _mm512_mul_ps(a[r][0], iv));
                _mm512_storeu_ps(orow + 16, _mm512_mul_ps(a[r][1], iv));
            }
        }
    }
}
#else
#define VECTORIZED 0
#endif

/* 1 where this build has the AVX-512 kernel; 0 elsewhere (the caller then runs torch's sdpa). */
int hfgpt_attention_vectorized(void) { return VECTORIZED; }

/* q, k, v, out: (B, H, T, D) with strides [batch, head, position] given in floats (the last dimension
 * contiguous). Returns 0; 1 where scratch memory could not be allocated; 2 in a build without the kernel. */
int hfgpt_causal_attention(const float *q, const float *k, const float *v, float *out, int64_t B, int64_t H,
                           int64_t T, const int64_t *qs, const int64_t *ks, const int64_t *vs, const int64_t *os,
                           float scale, int threads)
{
#if VECTORIZED
    if (B <= 0 || H <= 0 || T <= 0) return 0;
    const int64_t tp = (T + KB - 1) / KB * KB;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)((D + R) * tp));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * H; t++) {
            if (!scratch) continue;
            const int64_t b = t / H, h = t % H;
            head(q + b * qs[0] + h * qs[1], qs[2], k + b * ks[0] + h * ks[1], ks[2], v + b * vs[0] + h * vs[1],
                 vs[2], out + b * os[0] + h * os[1], os[2], T, scale, scratch, scratch + D * tp);
        }
        free(scratch);
    }
    return failed;
#else
    (void)q, (void)k, (void)v, (void)out, (void)B, (void)H, (void)T, (void)qs, (void)ks, (void)vs, (void)os;
    (void)scale, (void)threads;
    return 2;
#endif
}
