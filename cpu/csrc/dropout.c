/* hfgpt's dropout keep masks on the CPU: keep[i] = 1 with probability 1 - p, as bytes.
 *
 * Built on first use by cpu/native.py (cc -O3 -march=native -fopenmp) and called by `keep_mask` in
 * cpu/ops.py, whose torch implementation computes the same bits wherever this library is not loaded.
 * The generator is counter-based, SplitMix64's output function applied to
 * seed + (w + 1) * 0x9E3779B97F4A7C15 for the w-th 64-bit word (so word w does not depend on any other,
 * and the threads split the words in any way with the same result); element 2w takes the word's low 32
 * bits and element 2w + 1 its high 32 bits, and an element is kept when its 32 bits, read as an unsigned
 * number, are at least `threshold` (round(p * 2^32), at most 2^32 - 1). The seed is one 64-bit draw from
 * torch's generator, so torch.manual_seed and the RNG state that gradient checkpointing restores decide
 * the masks.
 *
 * torch's `randint` draws from a Mersenne Twister on one thread, one word after another; here every word
 * is computed from its index alone, so the loop runs on all threads and gcc vectorises it with AVX-512's
 * 64-bit multiplies where the CPU has them (benchmarks/RESULTS.md has the figures).
 */
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define PARALLEL_FROM 65536 /* elements: fewer run on the calling thread */

static inline uint64_t splitmix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* keep: n bytes. Returns 0, or 2 for a negative n or a thread count below 1. */
int hfgpt_keep_mask(uint8_t *keep, int64_t n, uint64_t seed, uint32_t threshold, int threads)
{
    if (n < 0 || threads < 1)
        return 2;
    const int64_t words = n / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_FROM)
    for (int64_t w = 0; w < words; w++) {
        const uint64_t z = splitmix64(seed + (uint64_t)(w + 1) * GOLDEN);
        keep[2 * w] = (uint32_t)z >= threshold;
        keep[2 * w + 1] = (uint32_t)(z >> 32) >= threshold;
    }
    if (n & 1)
        keep[n - 1] = (uint32_t)splitmix64(seed + (uint64_t)(words + 1) * GOLDEN) >= threshold;
    return 0;
}
