/* One decoding step of one attention head, shared by decode_step.h's float32 and int8 steps so that both
 * compute the same numbers. Heads of HEAD_SIZE (64) floats: every GPT-1 and GPT-2 size. */
#ifndef HFGPT_DECODE_ATTENTION_H
#define HFGPT_DECODE_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#define HEAD_SIZE 64

/* The single query q against T cached keys and values (rows at strides kst, vst), into o. Keys j with
 * mask[j] == 0 (mask NULL: none) and their value rows are never read: their weights are exactly 0. Scratch:
 * s [T]. Dot products of 64 floats, an exact softmax over the keys attended, then the weighted sum of their
 * value rows, two keys at a time. No key attended: zeros, as sdpa. */
static inline void head_decode(const float *q, const float *k, int64_t kst, const float *v, int64_t vst,
                               const uint8_t *mask, int64_t T, float scale, float *s, float *o)
{
    vf qv[HEAD_SIZE / LANES];
    for (int c = 0; c < HEAD_SIZE / LANES; c++) qv[c] = vload(q + LANES * c) * scale;
    int64_t seen = 0;
    for (int64_t j = 0; j < T; j++) {
        if (mask && !mask[j]) {
            s[j] = -INFINITY;
            continue;
        }
        const float *kj = k + j * kst;
        vf d = qv[0] * vload(kj);
        for (int c = 1; c < HEAD_SIZE / LANES; c++) d += qv[c] * vload(kj + LANES * c);
        s[j] = sum_lanes(d);
        seen++;
    }
    if (!seen) {
        memset(o, 0, sizeof(float) * HEAD_SIZE);
        return;
    }
    vf m = vsplat(-INFINITY), sum = {0};
    for (int64_t j = 0; j < T; j += LANES)
        m = vselect(lanes_below(T - j), max_v(vload_first(s + j, T - j), m), m);
    const float mv = max_lanes(m);
    for (int64_t j = 0; j < T; j += LANES) {
        const vf sj = vload_first(s + j, T - j);
        /* a masked score (-inf) weighs exactly 0 (exp_v's clamp would give 1.4e-45); a NaN stays NaN */
        const vf e = vkeep(lanes_below(T - j) & (sj != -INFINITY), exp_v(sj - mv));
        vstore_first(s + j, e, T - j);
        sum += e;
    }
    const float f = 1.0f / sum_lanes(sum);
    /* the value rows of the attended keys, two at a time into two sets of accumulators (two chains of
     * FMAs a vector of the head) */
    vf acc0[HEAD_SIZE / LANES], acc1[HEAD_SIZE / LANES];
    for (int c = 0; c < HEAD_SIZE / LANES; c++) acc0[c] = acc1[c] = (vf){0};
    int64_t j = 0;
    while (1) {
        while (j < T && mask && !mask[j]) j++;
        int64_t j1 = j + 1;
        while (j1 < T && mask && !mask[j1]) j1++;
        if (j >= T) break;
        const float *v0 = v + j * vst;
        if (j1 < T) {
            const float *v1 = v + j1 * vst;
            for (int c = 0; c < HEAD_SIZE / LANES; c++) {
                acc0[c] += vload(v0 + LANES * c) * s[j];
                acc1[c] += vload(v1 + LANES * c) * s[j1];
            }
        } else {
            for (int c = 0; c < HEAD_SIZE / LANES; c++) acc0[c] += vload(v0 + LANES * c) * s[j];
        }
        j = j1 + 1;
    }
    for (int c = 0; c < HEAD_SIZE / LANES; c++) vstore(o + LANES * c, (acc0[c] + acc1[c]) * f);
}

#endif
