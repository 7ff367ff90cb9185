/* Portable vector helpers shared by hfgpt's C kernels (cpu/native.py's build hashes every header).
 *
 * `vf` is a vector of LANES floats in GCC/Clang's vector extensions, as wide as the host's widest float
 * vectors under -march=native: 16 lanes with AVX-512, 8 with AVX (AVX2 machines), 4 elsewhere (SSE2,
 * arm64 NEON). The compiler maps +, -, *, / and comparisons on it to the host's instructions, and fuses
 * a * b + c into an FMA where the CPU has one (GCC and Clang contract within an expression by default), so
 * one source runs on AVX2, AVX-512 and NEON, and is what CI tests.
 *
 * `exp_v` and `gelu_v` are the only transcendental pieces: exp as a degree-6 polynomial scaled by 2^n, the
 * tanh GELU as x sigmoid(2u). */
#ifndef HFGPT_VECTOR_MATH_H
#define HFGPT_VECTOR_MATH_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
#define LANES (VECTOR_BYTES / 4) /* float lanes */

typedef float vf __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(VECTOR_BYTES))); /* lane masks: -1 (true) or 0 */

/* Unaligned loads and stores (memcpy compiles to one vector move). */
static inline vf vload(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The first n lanes (0 <= n) from p, zeros after them: no read past p[n - 1]. */
static inline vf vload_first(const float *p, int64_t n)
{
    if (n >= LANES)
        return vload(p);
    vf v = {0};
    memcpy(&v, p, sizeof(float) * (size_t)n);
    return v;
}

/* Writes the first n lanes (0 <= n) of v to p: no write past p[n - 1]. */
static inline void vstore_first(float *p, vf v, int64_t n)
{
    if (n >= LANES)
        vstore(p, v);
    else
        memcpy(p, &v, sizeof(float) * (size_t)n);
}

static inline vf vsplat(float x) { return (vf){0} + x; }

/* Lane-wise select: where mask (a comparison's result), a, else b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* v where mask, else 0. */
static inline vf vkeep(vi mask, vf v) { return (vf)(mask & (vi)v); }

/* Lanes below n (of any n: all for n >= LANES, none for n <= 0). */
static inline vi lanes_below(int64_t n)
{
    vi index;
    for (int i = 0; i < LANES; i++) index[i] = i;
    const int32_t limit = n > LANES ? LANES : n < 0 ? 0 : (int32_t)n;
    return index < limit;
}

typedef float vf4 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));

/* The sum of the lanes as a tree: the two halves added, then their halves, then the last four lanes in
 * pairs; as short a chain as AVX-512's reduce_add (a loop in lane order, which the compiler may not
 * reassociate, is a chain of LANES - 1 adds). */
static inline float sum_lanes(vf v)
{
    vf4 q;
#if LANES == 4
    q = v;
#else
    vf8 e;
#if LANES == 16
    vf8 lo8, hi8;
    memcpy(&lo8, &v, 32);
    memcpy(&hi8, (const char *)&v + 32, 32);
    e = lo8 + hi8;
#else
    e = v;
#endif
    vf4 lo4, hi4;
    memcpy(&lo4, &e, 16);
    memcpy(&hi4, (const char *)&e + 16, 16);
    q = lo4 + hi4;
#endif
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* The largest lane: a NaN lane is skipped unless all are NaN (as AVX-512's reduce_max; callers that must
 * see a NaN look for it themselves). */
static inline float max_lanes(vf v)
{
    float t[LANES];
    memcpy(t, &v, sizeof v);
    float m = t[0];
    for (int i = 1; i < LANES; i++) m = t[i] > m ? t[i] : m;
    return m;
}

/* max(a, b) and min(a, b) lane-wise, giving b where either is a NaN (as x86's maxps / minps). */
static inline vf max_v(vf a, vf b) { return vselect(a > b, a, b); }
static inline vf min_v(vf a, vf b) { return vselect(a < b, a, b); }

/* exp(r) for |r| <= ln2 / 2: a degree-6 polynomial (relative error ~1e-7, as expf; the Cephes
 * coefficients). */
static inline vf exp_reduced(vf r)
{
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * (r * r) + (r + 1.0f);
}

/* n = round(x / ln2), as floats (by adding and subtracting 1.5 * 2^23: |x / ln2| < 2^22 here), and
 * r = x - n ln2 (ln2 in two parts, so that r is exact). */
static inline vf exp_split(vf x, vf *r)
{
    const vf magic = vsplat(12582912.0f);
    const vf n = (x * 1.44269504088896341f + magic) - magic;
    *r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    return n;
}

/* exp(x) for |x| <= 87, where 2^n is a normal float: exp(r) 2^n. No clamp: the callers bound x (the
 * GELU's -2u). A NaN stays NaN. */
static inline vf exp_bounded_v(vf x)
{
    vf r;
    const vf n = exp_split(x, &r);
    return exp_reduced(r) * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* exp(x) for x in [-103, 89] (a NaN stays NaN): exp(r) 2^n, with 2^n applied as two factors 2^(n/2) 2^(n - n/2),
 * each a normal float, so that results down to the subnormals are exact. `exp_v` clamps any x into that range;
 * attention.c's softmax, whose arguments are at most 0, clamps only below. */
static inline vf exp_clamped_v(vf x)
{
    vf r;
    const vi k = __builtin_convertvector(exp_split(x, &r), vi), half = k >> 1;
    return exp_reduced(r) * (vf)((half + 127) << 23) * (vf)((k - half + 127) << 23);
}

/* exp(x) for any x: arguments clamped to [-103, 89] (exp(-103) is float's smallest subnormal, 1.4e-45;
 * exp(89) overflows to infinity, as exp(+inf) does); a NaN stays NaN. */
static inline vf exp_v(vf x)
{
    const vf lo = vsplat(-103.0f), hi = vsplat(89.0f);
    x = vselect(x < lo, lo, x); /* (false for a NaN: it stays) */
    return exp_clamped_v(vselect(x > hi, hi, x));
}

static const float SQRT_2_OVER_PI = 0.7978845608028654f, CUBIC = 0.044715f, LIMIT = 10.0f;

/* The tanh GELU of each lane as x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), the sigmoid (0 below
 * -LIMIT) from x clamped to [-LIMIT, LIMIT], where exp(-2u) lies in [1e-38, 1e38] (beyond it the GELU is x, or
 * 0 to 1e-37). A NaN stays NaN. */
static inline vf gelu_v(vf x)
{
    const vf xc = max_v(vsplat(-LIMIT), min_v(vsplat(LIMIT), x)); /* (a NaN x gives x) */
    const vf x2 = xc * xc;
    const vf u = (xc * SQRT_2_OVER_PI) * (x2 * CUBIC + 1.0f);
    const vf e = exp_bounded_v(u * -2.0f); /* (|2u| <= 87.3 for |x| <= 10) */
    const vf sig = 1.0f / (e + 1.0f);
    return x * vkeep(~(x < -LIMIT), sig);
}

#endif
