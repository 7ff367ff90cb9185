/* hfgpt's int8 linear layer for CPU decoding: y = x W^T + b with W in int8 (one scale per output channel)
 * and x quantised to int8 at run time with one scale per BLOCK consecutive inputs of a row. `Int8Linear`
 * (cpu/quantization.py) packs the weights and holds the torch reference the tests compare this file against.
 *
 * The packed weight (uint8, W + 128, padded with 128: a zero weight) is [ceil(out / TILE)][inp / 4][TILE][4],
 * inp = in rounded up to BLOCK: a tile of 32 outputs is one contiguous stream, read 128 bytes (4 inputs of 32
 * outputs) at a time, each 32-bit lane the 4 weights of one output that meet the same 4 activation bytes.
 *
 * Per row r and block b, with sx[r, b] = max |x[r, b*BLOCK ...]| / 127, q = round-half-even(x / sx) in
 * [-127, 127]:  y[r, o] = scale[o] * sum_b sx[r, b] * (sum_{i in b} W[o, i] q[r, i]) + bias[o].
 * The bracket is exact in int32; the float sum runs over blocks in order, each output on one thread, so the
 * result does not depend on the number of threads. A block holding a NaN or an infinity gets sx = NaN (and
 * q = 0): NaN outputs, as the float product's.
 *
 * The integer products, by what the compiler targets (`hfgpt_int8_vectorized()` says which was built):
 *   3  AVX-512 VNNI: VPDPBUSD on 16 lanes, unsigned weight bytes (W + 128) times signed activations,
 *      four products summed into each int32 lane; the bracket is sum (W + 128) q - 128 qsum, with
 *      qsum[r, b] = sum_{i in b} q[r, i] (at most 64 * 255 * 127 before the subtraction).
 *   2  AVX-VNNI (AVX2 CPUs with VPDPBUSD on 8 lanes): the same, 256 bits at a time.
 *   1  AVX2: VPMADDUBSW sums pairs of products in int16 with saturation, which (W + 128) q would overflow
 *      (2 * 255 * 127 > 32767); so the weights are made signed again (xor 0x80) and multiplied as |q| times
 *      W with q's sign (VPSIGNB): a pair is at most 2 * 127 * 127 = 32258; VPMADDWD by ones sums pairs of
 *      pairs in int32. The bracket, sum W q, is the same integer.
 *   0  portable C (any CPU; the compiler vectorises what it can).
 * All compute the same int32 brackets and then the same float operations in the same order (one fused
 * multiply-add per block, one for the scale and bias), so paths 1 to 3 give identical outputs; the portable
 * one leaves the contraction of `a * b + c` to the compiler, and so can differ in the last bits.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#define BLOCK 64
#define TILE 32
#define LAYOUT_VERSION 2

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ISA 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 1
#else
#define ISA 0
#endif

#if ISA > 0
#include <immintrin.h>
#endif

int hfgpt_int8_layout_version(void) { return LAYOUT_VERSION; }

/* The 128 weight bytes of a group of 4 inputs, asked for one block of the tile (2 KiB) ahead of their use:
 * at one row, 15-20% faster than the hardware prefetchers alone on each path (measured on an Intel Xeon).
 * (Past the end of a tile, the next tile, which the same thread reads next under `schedule(static)`.) The
 * portable loop leaves its reads to the compiler and the hardware. */
#if ISA > 0
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *group)
{
    __builtin_prefetch(group + (BLOCK / 4) * TILE * 4);
    __builtin_prefetch(group + (BLOCK / 4) * TILE * 4 + 64);
}
#endif

#if ISA == 3
#define ROWS 4 /* rows of activations per pass over a tile's weights */
/* A whole block of BLOCK (64) inputs: the same divisions and round-half-even as the portable loop. */
static inline int32_t quantize_block(const float *x, int8_t *xq, float *s_out)
{
    __m512 v[4], a[4];
    __mmask16 bad = 0; /* NaN or infinity: unordered or above FLT_MAX (max_ps may drop a NaN) */
    for (int j = 0; j < 4; j++) {
        v[j] = _mm512_loadu_ps(x + 16 * j);
        a[j] = _mm512_abs_ps(v[j]);
        bad |= _mm512_cmp_ps_mask(a[j], _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
    }
    __m512 m = _mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3]));
    float s = bad ? NAN : _mm512_reduce_max_ps(m) / 127.0f;
    *s_out = s;
    if (!(s > 0.0f)) {
        memset(xq, 0, BLOCK);
        return 0;
    }
    __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v[j], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128((__m128i *)(xq + 16 * j), _mm512_cvtsepi32_epi8(q));
    }
    return _mm512_reduce_add_epi32(sum);
}
#define QUANTIZE_BLOCK 1
#elif ISA > 0
#define ROWS 2 /* (4 rows over half a tile at a time, which fit AVX2's 16 registers, measured no faster) */
/* As the AVX-512 version: the same divisions and round-half-even as the portable loop, 8 lanes at a time. */
static inline int32_t quantize_block(const float *x, int8_t *xq, float *s_out)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), huge = _mm256_set1_ps(FLT_MAX);
    __m256 v[8], m = _mm256_setzero_ps();
    int bad = 0; /* NaN or infinity: unordered or above FLT_MAX (max_ps may drop a NaN) */
    for (int j = 0; j < 8; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        const __m256 a = _mm256_andnot_ps(sign, v[j]);
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, huge, _CMP_NLE_UQ));
        m = _mm256_max_ps(m, a);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float s = bad ? NAN : _mm_cvtss_f32(m4) / 127.0f;
    *s_out = s;
    if (!(s > 0.0f)) {
        memset(xq, 0, BLOCK);
        return 0;
    }
    const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 4) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 r = _mm256_round_ps(_mm256_div_ps(v[j + k], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            sum = _mm256_add_epi32(sum, q[k]);
        }
        /* 32 int32 in [-127, 127] to bytes: the packs work within 128-bit lanes, the permutation restores
         * the order */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + 8 * j),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
}
#define QUANTIZE_BLOCK 1
#else
#define QUANTIZE_BLOCK 0
#endif

/* One row: xq[0 .. inp) (zero past `in`), sx and qsum[0 .. inp / BLOCK). */
static void quantize_row(const float *x, int64_t in, int64_t inp, int8_t *xq, float *sx, int32_t *qsum)
{
    for (int64_t b = 0; b < inp / BLOCK; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK < in ? lo + BLOCK : in;
#if QUANTIZE_BLOCK
        if (hi - lo == BLOCK) {
            qsum[b] = quantize_block(x + lo, xq + lo, sx + b);
            continue;
        }
#endif
        float m = 0.0f;
        int bad = 0;
        for (int64_t i = lo; i < hi; i++) {
            float a = fabsf(x[i]);
            bad |= !(a <= FLT_MAX); /* NaN or infinity */
            m = a > m ? a : m;
        }
        float s = bad ? NAN : m / 127.0f;
        int32_t sum = 0;
        for (int64_t i = lo; i < lo + BLOCK; i++) {
            float r = (i < hi && s > 0.0f) ? nearbyintf(x[i] / s) : 0.0f;
            int32_t q = r > 127.0f ? 127 : (r < -127.0f ? -127 : (int32_t)r);
            xq[i] = (int8_t)q;
            sum += q;
        }
        sx[b] = s;
        qsum[b] = sum;
    }
}

#if ISA == 3

static inline __attribute__((always_inline)) void tile(
    const int8_t *xq, const float *sx, const int32_t *qsum, int64_t inp, const uint8_t *w,
    const float *scale, const float *bias, float *y, int64_t ldy, int64_t o0, int64_t out, const int nr)
{
    const int64_t nb = inp / BLOCK;
    __m512 acc[ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[ROWS][2];
        for (int r = 0; r < nr; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        const uint8_t *wb = w + b * (BLOCK / 4) * TILE * 4;
        const int8_t *xb = xq + b * BLOCK;
        for (int g = 0; g < BLOCK / 4; g++) {
            __m512i w0 = _mm512_loadu_si512((const void *)(wb + g * TILE * 4));
            __m512i w1 = _mm512_loadu_si512((const void *)(wb + g * TILE * 4 + 64));
            prefetch_ahead(wb + g * TILE * 4);
            for (int r = 0; r < nr; r++) {
                int32_t four;
                memcpy(&four, xb + r * inp + g * 4, 4);
                __m512i xv = _mm512_set1_epi32(four);
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, xv);
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, xv);
            }
        }
        for (int r = 0; r < nr; r++) {
            __m512 s = _mm512_set1_ps(sx[r * nb + b]);
            __m512i offset = _mm512_set1_epi32(128 * qsum[r * nb + b]); /* the weights' +128, exactly */
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][0], offset)), s, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][1], offset)), s, acc[r][1]);
        }
    }
    for (int h = 0; h < 2; h++) {
        int64_t o = o0 + 16 * h;
        if (o >= out) break;
        __mmask16 m = out - o >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (out - o)) - 1u);
        __m512 sc = _mm512_maskz_loadu_ps(m, scale + o);
        __m512 bi = bias ? _mm512_maskz_loadu_ps(m, bias + o) : _mm512_setzero_ps();
        for (int r = 0; r < nr; r++) {
            __m512 v = _mm512_fmadd_ps(acc[r][h], sc, bi);
            _mm512_mask_storeu_ps(y + r * ldy + o, m, v);
        }
    }
}

#elif ISA > 0

/* The four int8 products of each 32-bit lane added into `acc`: (W + 128) q (AVX-VNNI), or W q (AVX2;
 * `ax` = |x|, see the top of the file). */
static inline __attribute__((always_inline)) __m256i dot_add(__m256i acc, __m256i w, __m256i x, __m256i ax)
{
#if ISA == 2
    (void)ax;
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    const __m256i signed_w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(signed_w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* The AVX-512 tile's arithmetic in 256-bit vectors: 32 outputs as four vectors of 8. */
static inline __attribute__((always_inline)) void tile(
    const int8_t *xq, const float *sx, const int32_t *qsum, int64_t inp, const uint8_t *w,
    const float *scale, const float *bias, float *y, int64_t ldy, int64_t o0, int64_t out, const int nr)
{
    const int64_t nb = inp / BLOCK;
    __m256 acc[ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < 4; k++) acc[r][k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[ROWS][4];
        for (int r = 0; r < nr; r++)
            for (int k = 0; k < 4; k++) dot[r][k] = _mm256_setzero_si256();
        const uint8_t *wb = w + b * (BLOCK / 4) * TILE * 4;
        const int8_t *xb = xq + b * BLOCK;
        for (int g = 0; g < BLOCK / 4; g++) {
            __m256i wv[4];
            for (int k = 0; k < 4; k++) wv[k] = _mm256_loadu_si256((const __m256i *)(wb + g * TILE * 4 + 32 * k));
            prefetch_ahead(wb + g * TILE * 4);
            for (int r = 0; r < nr; r++) {
                int32_t four;
                memcpy(&four, xb + r * inp + g * 4, 4);
                const __m256i xv = _mm256_set1_epi32(four), ax = _mm256_abs_epi8(xv);
                for (int k = 0; k < 4; k++) dot[r][k] = dot_add(dot[r][k], wv[k], xv, ax);
            }
        }
        for (int r = 0; r < nr; r++) {
            const __m256 s = _mm256_set1_ps(sx[r * nb + b]);
#if ISA == 2
            const __m256i offset = _mm256_set1_epi32(128 * qsum[r * nb + b]); /* the weights' +128, exactly */
#else
            (void)qsum;
            const __m256i offset = _mm256_setzero_si256(); /* (the products were W q already) */
#endif
            for (int k = 0; k < 4; k++)
                acc[r][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[r][k], offset)), s, acc[r][k]);
        }
    }
    for (int k = 0; k < 4; k++) {
        const int64_t o = o0 + 8 * k;
        if (o >= out) break;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(out - o < 8 ? (int)(out - o) : 8),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 sc = _mm256_maskload_ps(scale + o, m);
        const __m256 bi = bias ? _mm256_maskload_ps(bias + o, m) : _mm256_setzero_ps();
        for (int r = 0; r < nr; r++) _mm256_maskstore_ps(y + r * ldy + o, m, _mm256_fmadd_ps(acc[r][k], sc, bi));
    }
}

#endif

#if ISA > 0
static void tile_rows(const int8_t *xq, const float *sx, const int32_t *qsum, int64_t rows, int64_t inp,
                      const uint8_t *w, const float *scale, const float *bias, float *y, int64_t ldy,
                      int64_t o0, int64_t out)
{
    const int64_t nb = inp / BLOCK;
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        const int8_t *x = xq + r0 * inp;
        const float *s = sx + r0 * nb;
        const int32_t *qs = qsum + r0 * nb;
        float *yr = y + r0 * ldy;
        switch (rows - r0 < ROWS ? rows - r0 : ROWS) {
        case 1: tile(x, s, qs, inp, w, scale, bias, yr, ldy, o0, out, 1); break;
#if ROWS == 4
        case 2: tile(x, s, qs, inp, w, scale, bias, yr, ldy, o0, out, 2); break;
        case 3: tile(x, s, qs, inp, w, scale, bias, yr, ldy, o0, out, 3); break;
#endif
        default: tile(x, s, qs, inp, w, scale, bias, yr, ldy, o0, out, ROWS); break;
        }
    }
}
#elif ISA == 0
/* Portable version of the same arithmetic (the compiler vectorises what it can). */
static void tile_rows(const int8_t *xq, const float *sx, const int32_t *qsum, int64_t rows, int64_t inp,
                      const uint8_t *w, const float *scale, const float *bias, float *y, int64_t ldy,
                      int64_t o0, int64_t out)
{
    const int64_t nb = inp / BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t dot[TILE] = {0};
            for (int64_t g = b * BLOCK / 4; g < (b + 1) * BLOCK / 4; g++)
                for (int j = 0; j < TILE; j++)
                    for (int q = 0; q < 4; q++)
                        dot[j] += (int32_t)w[(g * TILE + j) * 4 + q] * (int32_t)xq[r * inp + g * 4 + q];
            for (int j = 0; j < TILE; j++) acc[j] += (float)(dot[j] - 128 * qsum[r * nb + b]) * sx[r * nb + b];
        }
        for (int j = 0; j < TILE && o0 + j < out; j++)
            y[r * ldy + o0 + j] = acc[j] * scale[o0 + j] + (bias ? bias[o0 + j] : 0.0f);
    }
}
#endif

/* Which integer products were built: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable (see the top). */
int hfgpt_int8_vectorized(void) { return ISA; }

/* The activation quantisation alone (for tests): xq [rows, inp], sx and qsum [rows, inp / BLOCK]. */
void hfgpt_int8_quantize_rows(const float *x, int64_t rows, int64_t ldx, int64_t in, int64_t inp, int8_t *xq,
                              float *sx, int32_t *qsum)
{
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, in, inp, xq + r * inp, sx + r * (inp / BLOCK), qsum + r * (inp / BLOCK));
}

/* Scratch for the int8 copies of `rows` rows of up to `inp` inputs. */
typedef struct {
    int8_t *xq;
    float *sx;
    int32_t *qsum;
} scratch_t;

static int scratch_alloc(scratch_t *sc, int64_t rows, int64_t inp)
{
    sc->xq = (int8_t *)malloc((size_t)(rows * inp));
    sc->sx = (float *)malloc(sizeof(float) * (size_t)(rows * (inp / BLOCK)));
    sc->qsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(rows * (inp / BLOCK)));
    return sc->xq && sc->sx && sc->qsum;
}

static void scratch_free(scratch_t *sc) { free(sc->xq), free(sc->sx), free(sc->qsum); }

/* One product, called by every thread of a parallel region (or outside one, by one thread): the rows'
 * int8 copies, then the tiles of outputs; each `omp for` ends on a barrier, so the phases stay in order. */
static void product(const float *x, int64_t rows, int64_t ldx, int64_t in, const uint8_t *w, int64_t out,
                    int64_t inp, const float *scale, const float *bias, float *y, int64_t ldy, const scratch_t *sc)
{
    const int64_t nb = inp / BLOCK, tiles = (out + TILE - 1) / TILE, tile_bytes = (inp / 4) * TILE * 4;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, in, inp, sc->xq + r * inp, sc->sx + r * nb, sc->qsum + r * nb);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        tile_rows(sc->xq, sc->sx, sc->qsum, rows, inp, w + t * tile_bytes, scale, bias, y, ldy, t * TILE, out);
}

/* y[r * ldy + o] for r < rows, o < out. Returns 0, or 1 where scratch memory could not be allocated. */
int hfgpt_int8_linear(const float *x, int64_t rows, int64_t ldx, int64_t in, const uint8_t *w, int64_t out,
                      int64_t inp, const float *scale, const float *bias, float *y, int64_t ldy, int threads)
{
    if (rows <= 0 || out <= 0) return 0;
    scratch_t sc;
    if (!scratch_alloc(&sc, rows, inp)) {
        scratch_free(&sc);
        return 1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    product(x, rows, ldx, in, w, out, inp, scale, bias, y, ldy, &sc);
    scratch_free(&sc);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * A block of an int8 decoding copy in two calls around its attention (`Int8Block`), for any number of rows,
 * and a whole decoding step in one: decode_step.h on `product`'s int8 products. Its layer norms and GELU
 * differ from torch's by float rounding, which the int8 copy of the next product can turn into one step of
 * 127 in a block of 64 inputs now and then.
 */
/* (built on every CPU; kept for the callers that ask) */
int hfgpt_int8_fused_available(void) { return 1; }

/* An int8 layer: packed weight, outputs, padded inputs, per-channel scales, bias (or NULL). */
typedef struct {
    const uint8_t *w;
    int64_t out, inp;
    const float *scale, *bias;
} layer_t;

static void layer_product(const layer_t *l, const float *x, int64_t rows, int64_t in, float *y, int64_t ldy,
                          const scratch_t *sc)
{
    product(x, rows, in, in, l->w, l->out, l->inp, l->scale, l->bias, y, ldy, sc);
}

#define LAYER_POINTERS 16 /* a block's pointers in `hfgpt_int8_decode_step`'s layers (`block_at`) */
#include "decode_step.h"

/* y = W LN(x) + b, or W x + b where ln_w is NULL. Returns 0, or 1 (no memory). */
int hfgpt_int8_norm_linear(const float *x, int64_t rows, int64_t in, const float *ln_w, const float *ln_b,
                           float eps, const uint8_t *w, int64_t out, int64_t inp, const float *scale,
                           const float *bias, float *y, int threads)
{
    if (rows <= 0 || out <= 0) return 0;
    scratch_t sc;
    float *normed = ln_w ? (float *)malloc(sizeof(float) * (size_t)(rows * in)) : NULL;
    if (!scratch_alloc(&sc, rows, inp) || (ln_w && !normed)) {
        scratch_free(&sc), free(normed);
        return 1;
    }
    const layer_t layer = {w, out, inp, scale, bias};
#pragma omp parallel num_threads(threads) if (threads > 1)
    norm_linear(x, rows, in, ln_w, ln_b, eps, &layer, normed, y, &sc);
    scratch_free(&sc), free(normed);
    return 0;
}

/* The block after its attention output `attn` ([rows, n]), from the block's input `h`, into `y` (see
 * above): the attention's output projection (n x n), the MLP's input (inner x n) and output (n x inner)
 * products, each as packed weight, padded inputs, scales and bias. Returns 0, or 1 (no memory). */
int hfgpt_int8_block_tail(const float *attn, const float *h, float *y, int64_t rows, int64_t n, int pre_norm,
                          const float *ln1_w, const float *ln1_b, const float *ln2_w, const float *ln2_b, float eps,
                          const uint8_t *proj_w, int64_t proj_inp, const float *proj_scale, const float *proj_bias,
                          const uint8_t *fc_w, int64_t inner, int64_t fc_inp, const float *fc_scale,
                          const float *fc_bias, const uint8_t *mproj_w, int64_t mproj_inp, const float *mproj_scale,
                          const float *mproj_bias, int threads)
{
    if (rows <= 0) return 0;
    const layer_t proj = {proj_w, n, proj_inp, proj_scale, proj_bias};
    const layer_t fc = {fc_w, inner, fc_inp, fc_scale, fc_bias};
    const layer_t mproj = {mproj_w, n, mproj_inp, mproj_scale, mproj_bias};
    const int64_t widest = fc.inp > mproj.inp ? fc.inp : mproj.inp;
    scratch_t sc;
    float *work = (float *)malloc(sizeof(float) * (size_t)(rows * (4 * n + inner)));
    if (!scratch_alloc(&sc, rows, widest) || !work) {
        scratch_free(&sc), free(work);
        return 1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    block_tail(attn, h, y, rows, n, pre_norm, ln1_w, ln1_b, ln2_w, ln2_b, eps, &proj, &fc, &mproj, work, &sc);
    scratch_free(&sc), free(work);
    return 0;
}

/* A decoding step of an int8 decoding copy (decode_step.h). layers: LAYER_POINTERS pointers a block: ln_1's
 * weight and bias, ln_2's, then c_attn, the attention's c_proj, c_fc and the MLP's c_proj, each as packed
 * weight, scales and bias. Returns 0, or 1 where scratch memory could not be allocated. */
static block_t block_at(const void *const *p, int64_t n, int64_t inner)
{
    const int64_t n_inp = (n + BLOCK - 1) / BLOCK * BLOCK, inner_inp = (inner + BLOCK - 1) / BLOCK * BLOCK;
    const block_t b = {
        (const float *)p[0], (const float *)p[1], (const float *)p[2], (const float *)p[3],
        {(const uint8_t *)p[4], 3 * n, n_inp, (const float *)p[5], (const float *)p[6]},
        {(const uint8_t *)p[7], n, n_inp, (const float *)p[8], (const float *)p[9]},
        {(const uint8_t *)p[10], inner, n_inp, (const float *)p[11], (const float *)p[12]},
        {(const uint8_t *)p[13], n, inner_inp, (const float *)p[14], (const float *)p[15]},
    };
    return b;
}

int hfgpt_int8_decode_step(const int64_t *ids, const int64_t *positions, const float *wte, const float *wpe,
                           int64_t rows, int64_t n, int64_t heads, int64_t inner, int64_t n_layer, int pre_norm,
                           float eps, const float *scaling, const void *const *layers, float *const *keys,
                           float *const *values, const int64_t *capacity, int64_t past, const uint8_t *mask,
                           int64_t mask_stride, const float *lnf_w, const float *lnf_b, float lnf_eps, float *y,
                           int threads)
{
    if (rows <= 0) return 0;
    const int64_t widest = inner > n ? inner : n;
    scratch_t sc;
    int status = 1;
    if (scratch_alloc(&sc, rows, (widest + BLOCK - 1) / BLOCK * BLOCK))
        status = decode_step(ids, positions, wte, wpe, rows, n, heads, inner, n_layer, pre_norm, eps, scaling, layers,
                             keys, values, capacity, past, mask, mask_stride, lnf_w, lnf_b, lnf_eps, y, &sc, threads);
    scratch_free(&sc);
    return status;
}
