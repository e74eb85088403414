/* Batch-invariant attention on a CPU: one fixed order of every reduction, whatever else runs.
 *
 * Each query's output is computed by one thread, from its own inputs only: the scores of the
 * keys its mask lets through (q . k in LANES fixed partial sums, then a fixed tree), their max
 * (exact in any order), then exp(s - max) and the weighted values summed key by key in key
 * order. A masked key adds an exact zero or is skipped, so neither the keys read past a query's
 * last one (a batch's longest row, a prefill chunk's end) nor the rows beside it change a bit
 * of its result: a token decoded alone, in any batch, or inside a prefill gets the same output.
 * Built with -ffp-contract=off, so every lane rounds a product and a sum apiece whatever the
 * vector width the compiler picks, and exp is ours (pure arithmetic, so the same bits whether a
 * key lands in a vector or in a loop's scalar tail: libm's vector and scalar expf can differ).
 * celerytp/layers/invariant_attention.py builds and loads it.
 */
#define _GNU_SOURCE /* memrchr */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* The LANES partial sums added pairwise, halves first: spelt out so that they stay in registers. */
static inline float tree(float *acc) {
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    return tree(acc);
}

/* e^x for x <= 0 (a score minus the row's max), within 2 ulp: Cody-Waite reduction by ln 2 and
 * Cephes' expf polynomial; 0 below -87 (and for -inf, a masked key). */
static inline float exp_nonpositive(float x) {
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)(x < -87.0f ? -127.0f : n) + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* o = inv * sum over keys j (in order) of p[j] v[j]: each output dim its own running sum, so
 * the sizes compiled with constant dims (held in registers) give the bits the general one does. */
static void weighted(float *o, const float *p, const float *v, int64_t stride, int64_t n, int64_t D, float inv) {
    float a[D];
    for (int64_t d = 0; d < D; d++) a[d] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        if (p[j] != 0.0f)
            for (int64_t d = 0; d < D; d++) a[d] += p[j] * v[j * stride + d];
    for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv;
}

#define WEIGHTED(DIM)                                                                                  \
    static void weighted_##DIM(float *o, const float *p, const float *v, int64_t stride, int64_t n,  \
                               float inv) {                                                          \
        float a[DIM] = {0};                                                                          \
        for (int64_t j = 0; j < n; j++)                                                              \
            if (p[j] != 0.0f)                                                                        \
                for (int d = 0; d < DIM; d++) a[d] += p[j] * v[j * stride + d];                      \
        for (int d = 0; d < DIM; d++) o[d] = a[d] * inv;                                             \
    }
WEIGHTED(64)
WEIGHTED(128)

/* q (B, H, T, D), k and v (B, KVH, L, D), out (B, H, T, D), last dims contiguous, other strides
 * in elements, 3 each in `st` for q (b, h, t), k and v (b, h, key), mask and out: mask (B, T, L)
 * bytes (strides b, t, key; 0 for a broadcast dim), NULL: every key.
 * Query head h reads key head h / (H / KVH). Returns 0, or -1 when scratch memory ran out.
 *
 * Work items are (row, key head, up to QB query positions); an item's queries (every query head
 * of the key head, at each position) share each key and value they read. Blocking changes only
 * which loads are shared: every score is `dot`, every sum runs over keys in key order. */
#define QB 4

int invariant_attention(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                        int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t L,
                        const int64_t *st, float scale, int threads) {
    const int64_t *q_st = st, *k_st = st + 3, *v_st = st + 6, *m_st = st + 9, *o_st = st + 12;
    const int64_t group = H / KVH, positions = T > 1 ? QB : 1, blocks = (T + positions - 1) / positions;
    const int64_t items = B * KVH * blocks, width = group * positions;
    const int64_t Lp = (L + LANES - 1) / LANES * LANES;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * (size_t)(width * Lp));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (s == NULL) continue;
            const int64_t b = item / (KVH * blocks), kh = (item / blocks) % KVH, t0 = item % blocks * positions;
            const int64_t nt = T - t0 < positions ? T - t0 : positions, n = group * nt;
            const float *kb = k + b * k_st[0] + kh * k_st[1], *vb = v + b * v_st[0] + kh * v_st[1];
            const float *qs[group * QB];
            const uint8_t *ms[group * QB];
            float *os[group * QB];
            int64_t last = 0;  /* keys past the last one any query sees add nothing: not read */
            for (int64_t i = 0; i < n; i++) {
                const int64_t g = i / nt, t = t0 + i % nt, h = kh * group + g;
                qs[i] = q + b * q_st[0] + h * q_st[1] + t * q_st[2];
                os[i] = out + b * o_st[0] + h * o_st[1] + t * o_st[2];
                ms[i] = mask ? mask + b * m_st[0] + t * m_st[1] : NULL;
                int64_t seen = L;
                if (ms[i] && m_st[2] == 1) {  /* a bool mask row: the last 1 (memrchr scans it by vectors) */
                    const uint8_t *hit = memrchr(ms[i], 1, (size_t)L);
                    seen = hit ? hit - ms[i] + 1 : 0;
                } else if (ms[i]) {
                    while (seen > 0 && !ms[i][(seen - 1) * m_st[2]]) seen--;
                }
                if (seen > last) last = seen;
            }
            const int64_t Lq = (last + LANES - 1) / LANES * LANES;
            for (int64_t j = 0; j < Lq; j++) {  /* scores, -inf where masked */
                const float *kj = kb + j * k_st[2];
                for (int64_t i = 0; i < n; i++)
                    s[i * Lp + j] = j < L && (!ms[i] || ms[i][j * m_st[2]]) ? dot(qs[i], kj, D) * scale : -INFINITY;
            }
            float totals[group * QB];
            for (int64_t i = 0; i < n; i++) {  /* softmax weights, summed in LANES partial sums by key */
                float *si = s + i * Lp, m = -INFINITY, lanes[LANES] = {0}, top[LANES];
                for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
                for (int64_t j = 0; j < Lq; j += LANES)  /* a max is exact in any order */
                    for (int l = 0; l < LANES; l++) top[l] = si[j + l] > top[l] ? si[j + l] : top[l];
                for (int l = 0; l < LANES; l++) m = top[l] > m ? top[l] : m;
                for (int64_t j = 0; j < Lq; j++) si[j] = exp_nonpositive(si[j] - m);
                for (int64_t j = 0; j < Lq; j += LANES)
                    for (int l = 0; l < LANES; l++) lanes[l] += si[j + l];
                totals[i] = tree(lanes);
            }
            for (int64_t i = 0; i < n; i++) {  /* weighted values, key by key */
                const float inv = totals[i] > 0.0f ? 1.0f / totals[i] : 0.0f;
                if (D == 64) weighted_64(os[i], s + i * Lp, vb, v_st[2], Lq, inv);
                else if (D == 128) weighted_128(os[i], s + i * Lp, vb, v_st[2], Lq, inv);
                else weighted(os[i], s + i * Lp, vb, v_st[2], Lq, D, inv);
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
