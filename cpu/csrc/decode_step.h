/* A transformer block, and a whole decoding step, in one parallel region, whatever the weights' format:
 * shared by int8_linear.c (the int8 decoding copy) and row_product.c (the float32 model).
 *
 * The including file defines, before including it:
 *   layer_t     one linear layer's weights in its format, with a field `out` (its outputs);
 *   scratch_t   what its products need besides their arguments;
 *   layer_product(l, x, rows, in, y, ldy, sc)
 *               y[r * ldy + o] = (x[r] W^T)[o] + b[o] for r < rows, o < l->out; x: rows x in floats;
 *               called by every thread of a parallel region, and ends on a barrier;
 *   LAYER_POINTERS  how many pointers describe a block in `decode_step`'s `layers`;
 * and after it `block_at`, which reads them.
 *
 * Per block, for `rows` rows of n features (GPT-2's pre-norm order, or GPT-1's post-norm one):
 *   norm_linear   qkv = W_qkv LN1(h) + b  (pre-norm; post-norm: W_qkv h + b)
 *   (the attention, on the cached keys and values)
 *   block_tail    pre-norm:  h1 = h + P(a);       out = h1 + M(LN2(h1))
 *                 post-norm: h1 = LN1(h + P(a));  out = LN2(h1 + M(h1))
 *                 M(x) = W_proj gelu(W_fc x + b_fc) + b_proj, P(a) = W_o a + b_o
 * The residual sums are plain float sums, as in the unfused block; the layer norms and the tanh GELU are
 * computed here (vector_math.h's), and so differ from torch's by float rounding. */
#ifndef HFGPT_DECODE_STEP_H
#define HFGPT_DECODE_STEP_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "vector_math.h"

/* Layer norm of one row, with torch's biased variance: two passes (the mean, then the squared deviations),
 * each summed in a vector of partial sums, then across its lanes. */
static void layer_norm_row(const float *x, int64_t n, const float *w, const float *b, float eps, float *y)
{
    vf sum = {0};
    for (int64_t i = 0; i < n; i += LANES) sum += vload_first(x + i, n - i);
    const float mean = sum_lanes(sum) / (float)n;
    vf squares = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        const vf d = vkeep(lanes_below(n - i), vload_first(x + i, n - i) - mean);
        squares += d * d;
    }
    const float rstd = 1.0f / sqrtf(sum_lanes(squares) / (float)n + eps);
    for (int64_t i = 0; i < n; i += LANES) {
        const vf normed = (vload_first(x + i, n - i) - mean) * rstd;
        vstore_first(y + i, normed * vload_first(w + i, n - i) + vload_first(b + i, n - i), n - i);
    }
}

/* Inside a parallel region, row by row: y = LN(a + c), the sum kept in `sum`; c NULL: y = LN(a); w NULL:
 * y = a + c. */
static void add_norm(const float *a, const float *c, int64_t rows, int64_t n, const float *w, const float *b,
                     float eps, float *y, float *sum)
{
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = a + r * n;
        if (c) {
            float *target = w ? sum + r * n : y + r * n;
            for (int64_t i = 0; i < n; i++) target[i] = row[i] + c[r * n + i];
            row = target;
        }
        if (w) layer_norm_row(row, n, w, b, eps, y + r * n);
    }
}

/* The tanh GELU in place, split between the threads of the region. */
static void gelu_rows(float *x, int64_t count)
{
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; i += LANES) vstore_first(x + i, gelu_v(vload_first(x + i, count - i)), count - i);
}

/* Inside a parallel region: y = W LN(x) + b, or W x + b where ln_w is NULL (`normed`: rows x in floats). */
static void norm_linear(const float *x, int64_t rows, int64_t in, const float *ln_w, const float *ln_b, float eps,
                        const layer_t *l, float *normed, float *y, const scratch_t *sc)
{
    if (ln_w) add_norm(x, NULL, rows, in, ln_w, ln_b, eps, normed, NULL);
    layer_product(l, ln_w ? normed : x, rows, in, y, l->out, sc);
}

/* Inside a parallel region: the block after its attention output `attn` ([rows, n]), from the block's
 * input `h`, into `y` (see above); `work`: rows x (4 n + inner) floats. */
static void block_tail(const float *attn, const float *h, float *y, int64_t rows, int64_t n, int pre_norm,
                       const float *ln1_w, const float *ln1_b, const float *ln2_w, const float *ln2_b, float eps,
                       const layer_t *proj, const layer_t *fc, const layer_t *mproj, float *work,
                       const scratch_t *sc)
{
    const int64_t inner = fc->out;
    float *t = work, *h1 = t + rows * n, *x2 = h1 + rows * n, *sum = x2 + rows * n, *act = sum + rows * n;
    layer_product(proj, attn, rows, n, t, n, sc);
    if (pre_norm) {
        add_norm(h, t, rows, n, NULL, NULL, eps, h1, NULL);        /* h1 = h + P(a) (barrier: omp for) */
        add_norm(h1, NULL, rows, n, ln2_w, ln2_b, eps, x2, NULL); /* x2 = LN2(h1) */
    } else {
        add_norm(h, t, rows, n, ln1_w, ln1_b, eps, h1, sum); /* h1 = LN1(h + P(a)) */
    }
    layer_product(fc, pre_norm ? x2 : h1, rows, n, act, inner, sc);
    gelu_rows(act, rows * inner);
    layer_product(mproj, act, rows, inner, t, n, sc);
    if (pre_norm)
        add_norm(h1, t, rows, n, NULL, NULL, eps, y, NULL); /* y = h1 + M(x2) */
    else
        add_norm(h1, t, rows, n, ln2_w, ln2_b, eps, y, sum); /* y = LN2(h1 + M(h1)) */
}

/* ---------------------------------------------------------------------------------------------------
 * One decoding step of a whole model in one parallel region (a call for each part of each block, with Python
 * between them, cost a sizeable share of a step at one row): the embeddings, every block as above with
 * `head_decode` on each layer's cache, and the final layer norm, for `rows` sequences of one new token each.
 *
 * ids, positions: [rows] (checked by the caller) into wte [vocab][n] and wpe [positions][n]. layers:
 * LAYER_POINTERS pointers a block, read by `block_at`. keys[l], values[l]: block l's cache,
 * [rows][heads][capacity[l]][HEAD_SIZE] floats holding `past` positions; the step writes position `past`
 * (< capacity[l]) and attends those with mask[b * mask_stride + j] != 0 (mask NULL: all). lnf_w, lnf_b:
 * the final layer norm (NULL: none). y: [rows][n]. Returns 0, or 1 where no scratch could be allocated.
 */
typedef struct {
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    layer_t qkv, proj, fc, mproj;
} block_t;

/* Defined by the including file (after this header): a block's norms and layers from its LAYER_POINTERS
 * pointers, for n features and an MLP of `inner`. */
static block_t block_at(const void *const *p, int64_t n, int64_t inner);

static int decode_step(const int64_t *ids, const int64_t *positions, const float *wte, const float *wpe,
                       int64_t rows, int64_t n, int64_t heads, int64_t inner, int64_t n_layer, int pre_norm,
                       float eps, const float *scaling, const void *const *layers, float *const *keys,
                       float *const *values, const int64_t *capacity, int64_t past, const uint8_t *mask,
                       int64_t mask_stride, const float *lnf_w, const float *lnf_b, float lnf_eps, float *y,
                       const scratch_t *sc, int threads)
{
    const int64_t keys_seen = past + 1;
    /* the hidden states in and out of a block, c_attn's output, the attention's, LN1's, block_tail's work */
    float *work = (float *)malloc(sizeof(float) * (size_t)(rows * (2 * n + 3 * n + n + n + 4 * n + inner)));
    float *scores = (float *)malloc(sizeof(float) * (size_t)(rows * heads * keys_seen));
    block_t *blocks = (block_t *)malloc(sizeof(block_t) * (size_t)(n_layer > 0 ? n_layer : 1));
    if (!work || !scores || !blocks) {
        free(work), free(scores), free(blocks);
        return 1;
    }
    for (int64_t l = 0; l < n_layer; l++) blocks[l] = block_at(layers + l * LAYER_POINTERS, n, inner);
    float *const first = work, *const second = first + rows * n, *qkv = second + rows * n;
    float *attn = qkv + rows * 3 * n, *normed = attn + rows * n, *tail = normed + rows * n;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *h = first, *next = second; /* (each thread's own, swapped alike after each block) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) h[r * n + i] = wte[ids[r] * n + i] + wpe[positions[r] * n + i];
        for (int64_t l = 0; l < n_layer; l++) {
            const block_t *b = blocks + l;
            norm_linear(h, rows, n, pre_norm ? b->ln1_w : NULL, b->ln1_b, eps, &b->qkv, normed, qkv, sc);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows * heads; t++) {
                const int64_t r = t / heads, head = t % heads, cap = capacity[l];
                const float *row = qkv + r * 3 * n + head * HEAD_SIZE;
                float *k = keys[l] + t * cap * HEAD_SIZE, *v = values[l] + t * cap * HEAD_SIZE;
                memcpy(k + past * HEAD_SIZE, row + n, sizeof(float) * HEAD_SIZE);
                memcpy(v + past * HEAD_SIZE, row + 2 * n, sizeof(float) * HEAD_SIZE);
                head_decode(row, k, HEAD_SIZE, v, HEAD_SIZE, mask ? mask + r * mask_stride : NULL, keys_seen,
                            scaling[l], scores + t * keys_seen, attn + r * n + head * HEAD_SIZE);
            }
            block_tail(attn, h, next, rows, n, pre_norm, b->ln1_w, b->ln1_b, b->ln2_w, b->ln2_b, eps, &b->proj,
                       &b->fc, &b->mproj, tail, sc);
            float *swap = h;
            h = next, next = swap;
        }
        if (lnf_w) {
            add_norm(h, NULL, rows, n, lnf_w, lnf_b, lnf_eps, y, NULL);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) memcpy(y + r * n, h + r * n, sizeof(float) * (size_t)n);
        }
    }
    free(work), free(scores), free(blocks);
    return 0;
}

#endif
