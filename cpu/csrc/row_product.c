/* hfgpt's float32 products of a decoding step's rows with a weight, which stream every weight once for two
 * FLOPs a weight a row, so run at about the speed the weights are read from memory: a few rows with an
 * `[out, in]` weight (`few_rows_product` in cpu/products.py) and a whole decoding step of a float32 model (at
 * the end).
 *
 * `[out, in]`: each thread takes a contiguous run of the weight's rows, so that it reads one sequential
 * stream. `[in, out]` (a Conv1D weight, in the step): each thread takes whole vectors of output columns and
 * adds x[i] w[i, :] eight rows at a time (`add_rows`). The sums run in another order than MKL's: equal to
 * float rounding.
 *
 * The bfloat16 product (`hfgpt_row_product_bf16`, the bfloat16 decoding copy's) is portable too: it widens
 * pairs of bfloat16 to float32 with a shift and a mask and sums in float32. On a CPU with AVX-512 BF16 it
 * decodes GPT-2 as fast as a loop on that extension's VDPBF16PS, which it replaced (benchmarks/RESULTS.md).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"
#define PARALLEL_FROM 32768 /* weight elements: fewer run on the calling thread */

/* *s0 (and *s1) = the dot products of the weight row p with the rows x0 (and x1, unless NULL) of `in` floats:
 * the weight row read once, each sum with four accumulators in the same order, so that a row's sum is the same
 * alone or in a pair. (As loops over arrays of accumulators: 1.1x slower at 8 and 16 rows.) */
static inline __attribute__((always_inline)) void dot_pair(const float *p, const float *x0, const float *x1,
                                                           int64_t in, float *s0, float *s1)
{
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 4 * LANES <= in; i += 4 * LANES) {
        const vf w0 = vload(p + i), w1 = vload(p + i + LANES), w2 = vload(p + i + 2 * LANES);
        const vf w3 = vload(p + i + 3 * LANES);
        a0 += w0 * vload(x0 + i), a1 += w1 * vload(x0 + i + LANES);
        a2 += w2 * vload(x0 + i + 2 * LANES), a3 += w3 * vload(x0 + i + 3 * LANES);
        if (x1) b0 += w0 * vload(x1 + i), b1 += w1 * vload(x1 + i + LANES);
        if (x1) b2 += w2 * vload(x1 + i + 2 * LANES), b3 += w3 * vload(x1 + i + 3 * LANES);
    }
    for (; i < in; i += LANES) {
        const vf w = vload_first(p + i, in - i);
        a0 += w * vload_first(x0 + i, in - i);
        if (x1) b0 += w * vload_first(x1 + i, in - i);
    }
    *s0 = sum_lanes((a0 + a1) + (a2 + a3));
    if (x1) *s1 = sum_lanes((b0 + b1) + (b2 + b3));
}

/* y[r * out + o] = sum_i x[r * in + i] w[o, i] (+ bias[o]) for r < rows, o < out; x, w (out x in) and y
 * contiguous. Each thread takes a run of the weight's rows and reads each from memory once, summing it with
 * two rows of x at a time while it is in the level-1 cache (blocks of weight rows, or four or eight rows of x
 * at a time, ran no faster). A row of x gets the same sums beside any others. */
int hfgpt_row_product(const float *x, const float *w, int64_t rows, int64_t out, int64_t in, const float *bias,
                      float *y, int threads)
{
    if (rows < 0 || out < 0 || in < 0 || threads < 1) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * out * in >= PARALLEL_FROM)
    for (int64_t o = 0; o < out; o++) {
        const float *p = w + o * in;
        float b = bias ? bias[o] : 0.0f, s0 = 0.0f, s1 = 0.0f;
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            dot_pair(p, x + r * in, x + (r + 1) * in, in, &s0, &s1);
            y[r * out + o] = bias ? s0 + b : s0, y[(r + 1) * out + o] = bias ? s1 + b : s1;
        }
        if (r < rows) dot_pair(p, x + r * in, NULL, in, &s0, NULL), y[r * out + o] = bias ? s0 + b : s0;
    }
    return 0;
}

/* acc[:n] += x0 p[0, :n] + ... + x7 p[7, :n] (rows `ld` floats apart), for n <= LANES: two sums of four
 * products, then their sum. Inlined with n = LANES, its loads and stores are whole vectors. */
static inline __attribute__((always_inline)) void add_eight(const float *p, int64_t ld, float x0, float x1, float x2,
                                                            float x3, float x4, float x5, float x6, float x7,
                                                            float *acc, int64_t n)
{
    vf s0 = vload_first(p, n) * x0;
    vf s1 = vload_first(p + ld, n) * x1;
    s0 += vload_first(p + 2 * ld, n) * x2;
    s1 += vload_first(p + 3 * ld, n) * x3;
    s0 += vload_first(p + 4 * ld, n) * x4;
    s1 += vload_first(p + 5 * ld, n) * x5;
    s0 += vload_first(p + 6 * ld, n) * x6;
    s1 += vload_first(p + 7 * ld, n) * x7;
    vstore_first(acc, vload_first(acc, n) + (s0 + s1), n);
}

/* acc[:out] += sum over rows i of [from, to) of x[i] w[i, :out], the rows `ld` floats apart; eight rows at a
 * time (`add_eight`). */
static void add_rows(const float *x, const float *w, int64_t ld, int64_t out, int64_t from, int64_t to, float *acc)
{
    int64_t i = from;
    for (; i + 8 <= to; i += 8) {
        const float *p = w + i * ld;
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
        const float x4 = x[i + 4], x5 = x[i + 5], x6 = x[i + 6], x7 = x[i + 7];
        int64_t c = 0;
        for (; c + LANES <= out; c += LANES) add_eight(p + c, ld, x0, x1, x2, x3, x4, x5, x6, x7, acc + c, LANES);
        if (c < out) add_eight(p + c, ld, x0, x1, x2, x3, x4, x5, x6, x7, acc + c, out - c);
    }
    for (; i < to; i++) {
        const float *p = w + i * ld;
        for (int64_t c = 0; c < out; c += LANES)
            vstore_first(acc + c, vload_first(p + c, out - c) * x[i] + vload_first(acc + c, out - c), out - c);
    }
}

/* A bfloat16 is the upper half of a float32's bits. A vector of 2 * LANES bfloat16 read as LANES 32-bit
 * words (little-endian) holds the even-indexed values in the words' low halves and the odd-indexed ones in
 * their high halves: a shift and a mask widen them to floats exactly, with no shuffle. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "row_product.c's bfloat16 product reads pairs of bfloat16 as little-endian 32-bit words"
#endif
typedef uint32_t vu __attribute__((vector_size(VECTOR_BYTES)));

static inline vf even_values(vu pairs) { return (vf)(pairs << 16); }
static inline vf odd_values(vu pairs) { return (vf)(pairs & 0xFFFF0000u); }

/* 2 * LANES bfloat16 from p as LANES pairs; only the first n (0 <= n) read, zeros after them. */
static inline vu load_pairs(const uint16_t *p, int64_t n)
{
    vu v = {0};
    memcpy(&v, p, sizeof(uint16_t) * (size_t)(n < 2 * LANES ? n : 2 * LANES));
    return v;
}

/* float -> bfloat16, rounding to nearest even (a NaN stays a quiet NaN) */
static inline uint16_t to_bfloat16(float value)
{
    union { float f; uint32_t u; } bits = {value};
    if ((bits.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits.u >> 16) | 0x40u);
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

static inline float from_bfloat16(uint16_t value)
{
    union { uint32_t u; float f; } bits = {(uint32_t)value << 16};
    return bits.f;
}

/* y[o] = bfloat16(sum_i x[i] w[o, i] (+ bias[o])) for bfloat16 x, w (contiguous, out x in), bias and y: x
 * widened to float32 once, even- and odd-indexed values apart in each block of 2 * LANES, each row of w read
 * as pairs (above). The products (exact in float32) and the bias are summed in float32 and rounded once, as
 * AVX-512 BF16's VDPBF16PS and oneDNN do, in another order. Returns 1 where no scratch can be allocated. */
int hfgpt_row_product_bf16(const uint16_t *x, const uint16_t *w, int64_t out, int64_t in, const uint16_t *bias,
                           uint16_t *y, int threads)
{
    if (out < 0 || in < 0 || threads < 1) return 2;
    const int64_t block = 2 * LANES, blocks = (in + block - 1) / block, full = in / block;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(blocks > 0 ? blocks * block : 1));
    if (!xs) return 1;
    for (int64_t b = 0; b < blocks; b++) {
        const vu u = load_pairs(x + b * block, in - b * block);
        vstore(xs + b * block, even_values(u));
        vstore(xs + b * block + LANES, odd_values(u));
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (out * in >= PARALLEL_FROM)
    for (int64_t o = 0; o < out; o++) {
        const uint16_t *p = w + o * in;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t b = 0;
        for (; b + 2 <= full; b += 2) {
            const vu u0 = load_pairs(p + b * block, block), u1 = load_pairs(p + (b + 1) * block, block);
            const float *s = xs + b * block;
            a0 += even_values(u0) * vload(s);
            a1 += odd_values(u0) * vload(s + LANES);
            a2 += even_values(u1) * vload(s + block);
            a3 += odd_values(u1) * vload(s + block + LANES);
        }
        for (; b < blocks; b++) {
            const vu u = load_pairs(p + b * block, in - b * block);
            a0 += even_values(u) * vload(xs + b * block);
            a1 += odd_values(u) * vload(xs + b * block + LANES);
        }
        const float sum = sum_lanes((a0 + a1) + (a2 + a3));
        y[o] = to_bfloat16(bias ? sum + from_bfloat16(bias[o]) : sum);
    }
    free(xs);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * A decoding step of a float32 model (decode_step.h) on its own Conv1D weights, `[in, out]` as GPT-1's and
 * GPT-2's releases hold them.
 */
typedef struct {
    const float *w; /* [in][out] */
    int64_t out;
    const float *bias; /* or NULL */
} layer_t;

typedef struct {
    float *sums;        /* several rows: `layer_product`'s sums, `per_thread` floats for each thread; or NULL */
    int64_t per_thread; /* rows x (the widest layer's outputs + 2 LANES) */
} scratch_t;

#define CACHED_FLOATS 8192 /* 32 KiB: a level-1 data cache */

/* sums[r * lds + c] for r < rows, c < width: the bias's columns c0.., or zeros. */
static void start_sums(const float *bias, int64_t c0, int64_t rows, int64_t width, float *sums, int64_t lds)
{
    for (int64_t r = 0; r < rows; r++)
        if (bias) memcpy(sums + r * lds, bias + c0, sizeof(float) * (size_t)width);
        else memset(sums + r * lds, 0, sizeof(float) * (size_t)width);
}

/* Inside a parallel region: y[r * ldy + o] = sum_i x[r, i] w[i, o] + bias[o]. Each thread takes a run of
 * whole vectors of output columns and reads its piece of each weight row in turn (`add_rows`), eight
 * weight rows at a time for every row of x while they are in cache: one pass over the weight whatever the
 * rows. Several rows sum into the thread's part of the step's scratch (`sc->sums`), its rows a few vectors
 * longer than the run of columns, then copied into y: summed in y, whose rows lie `out` floats apart (a
 * multiple of 4 KiB for GPT-2's 3072-wide MLP), GPT-2's blocks took 1.17x as long at 8 rows (the same sums,
 * in the same order). Ends on a barrier. */
static void layer_product(const layer_t *l, const float *x, int64_t rows, int64_t in, float *y, int64_t ldy,
                          const scratch_t *sc)
{
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num(), out = l->out;
    const int64_t vectors = (out + LANES - 1) / LANES;
    const int64_t from = vectors * t / team * LANES, to_vector = vectors * (t + 1) / team * LANES;
    const int64_t to = to_vector < out ? to_vector : out;
    if (from < to) {
        /* several rows: runs of columns narrow enough that eight weight rows' pieces and the rows' sums
         * stay in the level-1 cache while every row reads them */
        const int64_t fits = CACHED_FLOATS / (8 + rows) / LANES * LANES;
        const int64_t run = rows == 1 || fits >= to - from ? to - from : (fits > LANES ? fits : LANES);
        const int64_t lds = run + 2 * LANES;
        float *own = sc->sums ? sc->sums + t * sc->per_thread : NULL;
        for (int64_t c = from; c < to; c += run) {
            const int64_t width = c + run < to ? run : to - c;
            /* (one row: the sums in y itself) */
            float *sums = own ? own : y + c;
            const int64_t ld = own ? lds : ldy;
            start_sums(l->bias, c, rows, width, sums, ld);
            for (int64_t i = 0; i < in; i += 8) {
                const int64_t stop = i + 8 < in ? i + 8 : in;
                for (int64_t r = 0; r < rows; r++)
                    add_rows(x + r * in, l->w + c, out, width, i, stop, sums + r * ld);
            }
            if (own)
                for (int64_t r = 0; r < rows; r++)
                    memcpy(y + r * ldy + c, own + r * lds, sizeof(float) * (size_t)width);
        }
    }
#pragma omp barrier
}

#define LAYER_POINTERS 12 /* a block's pointers in `hfgpt_float_decode_step`'s layers (`block_at`) */
#include "decode_step.h"

/* The step (decode_step.h): layers holds LAYER_POINTERS pointers a block: ln_1's weight and bias, ln_2's,
 * then c_attn, the attention's c_proj, c_fc and the MLP's c_proj, each as weight [in][out] and bias. The
 * other arguments are `decode_step`'s. Returns 0, or 1 where scratch memory could not be allocated. */
static block_t block_at(const void *const *pointers, int64_t n, int64_t inner)
{
    const float *const *p = (const float *const *)pointers;
    const block_t b = {
        p[0], p[1], p[2], p[3], {p[4], 3 * n, p[5]}, {p[6], n, p[7]}, {p[8], inner, p[9]}, {p[10], n, p[11]},
    };
    return b;
}

int hfgpt_float_decode_step(const int64_t *ids, const int64_t *positions, const float *wte, const float *wpe,
                            int64_t rows, int64_t n, int64_t heads, int64_t inner, int64_t n_layer, int pre_norm,
                            float eps, const float *scaling, const void *const *layers, float *const *keys,
                            float *const *values, const int64_t *capacity, int64_t past, const uint8_t *mask,
                            int64_t mask_stride, const float *lnf_w, const float *lnf_b, float lnf_eps, float *y,
                            int threads)
{
    if (rows <= 0) return 0;
    const int64_t widest = inner > 3 * n ? inner : 3 * n;
    scratch_t sc = {NULL, rows > 1 ? rows * (widest + 2 * LANES) : 0};
    if (rows > 1) {
        sc.sums = (float *)malloc(sizeof(float) * (size_t)(sc.per_thread * (threads > 1 ? threads : 1)));
        if (!sc.sums) return 1;
    }
    const int status = decode_step(ids, positions, wte, wpe, rows, n, heads, inner, n_layer, pre_norm, eps, scaling,
                                   layers, keys, values, capacity, past, mask, mask_stride, lnf_w, lnf_b, lnf_eps, y,
                                   &sc, threads);
    free(sc.sums);
    return status;
}
