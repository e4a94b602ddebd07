/*
 * y = x W^T with W held in llama.cpp's block formats, float32 activations (attnmask.quantized).
 *
 * A GGUF block holds 32 weights: Q4_1 weight j = d * q_j + m (q_j in 0..15), Q8_0 weight j = d * q_j
 * (q_j in -128..127), d and m float16. attnmask.quantized repacks each row once, at load time, into a
 * layout these loops read without byte shuffles (values unchanged):
 *
 *   Q4_1: blocks in pairs (a zero block pads an odd count); per pair 8 uint32 lanes, lane i holding
 *         in bits 4k..4k+3 (k = 0..7) the code of weight 8k + i of the pair (weights 0..31 = first
 *         block, 32..63 = second); then d[nbp] and m[nbp] as float32 arrays of their own.
 *   Q8_0: per block 8 uint32 lanes, lane i holding in byte k (k = 0..3) weight 8k + i; then d[nb].
 *
 * Each block's sum is regrouped, not approximated: sum_j (d q_j + m) x_j = d * sum_j q_j x_j +
 * m * sum_j x_j, with x never quantized. A Q4_1 code k < 7 is taken out of its lane in place, as
 * the integer q * 16^k (lane & 15 << 4k; code 7 is lane >> 28), converted to float exactly, and
 * multiplied by x * 16^-k: a power-of-two scaling, so every product and sum is the one q * x
 * would give. The result equals the float32 product with the dequantized matrix up to summation
 * order.
 *
 * Rows of W are split over `threads` OpenMP threads (the libgomp PyTorch has loaded).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCKS_AVX2 1
#else
#define BLOCKS_AVX2 0
#endif

#define QK 32
#define ROWS_PER_TASK 16
#define MAX_R 4 /* activation rows per pass over a weight row */

int attnmask_blocks_avx2(void) { return BLOCKS_AVX2; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#if BLOCKS_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if BLOCKS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum8(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* ------------------------------------------------------------------------------------------ */
/* Q4_1                                                                                        */
/* ------------------------------------------------------------------------------------------ */
/* x (R rows of K) -> xq (R rows of nbp * 32: x * 16^-k at weight 8k + i of each pair, k < 7;
 * zero padded) and xsum (R rows of nbp block sums) */
static void q4_1_prepare(const float *x, float *xq, float *xsum, int64_t M, int64_t K, int64_t nbp) {
    static const float scale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
    for (int64_t r = 0; r < M; r++) {
        for (int64_t j = 0; j < nbp * QK; j++)
            xq[r * nbp * QK + j] = j < K ? x[r * K + j] * scale[(j % 64) / 8] : 0.0f;
        for (int64_t b = 0; b < nbp; b++) {
            float s = 0.0f;
            for (int64_t j = b * QK; j < min64((b + 1) * QK, K); j++) s += x[r * K + j];
            xsum[r * nbp + b] = s;
        }
    }
}

/* up to MAX_R activation rows against weight row n. R is a constant at each call site of the
 * AVX2 version (see q4_1_row), so the accumulators stay in registers. */
#if BLOCKS_AVX2
static inline __attribute__((always_inline)) void q4_1_row_r(const uint32_t *codes, const float *d, const float *m,
                                                             const float *xq, const float *xsum, float *y, const int R,
                                                             int64_t N, int64_t nbp) {
    __m256 acc0[MAX_R], acc1[MAX_R];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi32(15);
    for (int64_t p = 0; p < nbp / 2; p++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + p * 8));
        __m256 v[8];
        for (int k = 0; k < 7; k++) v[k] = _mm256_cvtepi32_ps(_mm256_and_si256(raw, _mm256_slli_epi32(nib, 4 * k)));
        v[7] = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 28));
        const __m256 d0 = _mm256_broadcast_ss(d + 2 * p), d1 = _mm256_broadcast_ss(d + 2 * p + 1);
        for (int r = 0; r < R; r++) {
            const float *xp = xq + r * nbp * QK + p * 64;
            const __m256 t0 = _mm256_add_ps(_mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp + 8), _mm256_mul_ps(v[0], _mm256_loadu_ps(xp))),
                                            _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(v[2], _mm256_loadu_ps(xp + 16))));
            const __m256 t1 = _mm256_add_ps(_mm256_fmadd_ps(v[5], _mm256_loadu_ps(xp + 40), _mm256_mul_ps(v[4], _mm256_loadu_ps(xp + 32))),
                                            _mm256_fmadd_ps(v[7], _mm256_loadu_ps(xp + 56), _mm256_mul_ps(v[6], _mm256_loadu_ps(xp + 48))));
            acc0[r] = _mm256_fmadd_ps(d0, t0, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(d1, t1, acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum8(_mm256_add_ps(acc0[r], acc1[r])) + dot(m, xsum + r * nbp, nbp);
}

static void q4_1_row(const uint32_t *codes, const float *d, const float *m, const float *xq, const float *xsum,
                     float *y, int64_t R, int64_t N, int64_t nbp) {
    switch (R) {
        case 1: q4_1_row_r(codes, d, m, xq, xsum, y, 1, N, nbp); break;
        case 2: q4_1_row_r(codes, d, m, xq, xsum, y, 2, N, nbp); break;
        case 3: q4_1_row_r(codes, d, m, xq, xsum, y, 3, N, nbp); break;
        default: q4_1_row_r(codes, d, m, xq, xsum, y, 4, N, nbp); break;
    }
}
#else
static void q4_1_row(const uint32_t *codes, const float *d, const float *m, const float *xq, const float *xsum,
                     float *y, int64_t R, int64_t N, int64_t nbp) {
    for (int64_t r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t p = 0; p < nbp / 2; p++) {
            const float *xp = xq + r * nbp * QK + p * 64;
            float t[2] = {0.0f, 0.0f};
            for (int k = 0; k < 8; k++)
                for (int i = 0; i < 8; i++) {
                    const uint32_t lane = codes[p * 8 + i];
                    const float q = (float)(k < 7 ? lane & (15u << (4 * k)) : lane >> 28);
                    t[k / 4] += q * xp[k * 8 + i];
                }
            total += d[2 * p] * t[0] + d[2 * p + 1] * t[1];
        }
        y[r * N] = total + dot(m, xsum + r * nbp, nbp);
    }
}
#endif

/* y (M, N) = x (M, K) @ W^T. codes: N rows of nbp * 4 uint32; d, m: N rows of nbp float32.
 * Returns 0, or -1 if the scratch buffer cannot be allocated. */
int attnmask_q4_1_matmul(const uint32_t *codes, const float *d, const float *m, const float *x, float *y, int64_t M,
                         int64_t N, int64_t K, int threads) {
    const int64_t nbp = ((K / QK) + 1) / 2 * 2;
    float *xq = (float *)malloc(sizeof(float) * (size_t)(M * nbp * (QK + 1)));
    if (!xq) return -1;
    float *xsum = xq + M * nbp * QK;
    q4_1_prepare(x, xq, xsum, M, K, nbp);
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++)
        for (int64_t r0 = 0; r0 < M; r0 += MAX_R)
            for (int64_t n = task * ROWS_PER_TASK; n < min64((task + 1) * ROWS_PER_TASK, N); n++)
                q4_1_row(codes + n * nbp * 4, d + n * nbp, m + n * nbp, xq + r0 * nbp * QK, xsum + r0 * nbp,
                         y + r0 * N + n, min64(MAX_R, M - r0), N, nbp);
    free(xq);
    return 0;
}

/* out (N, K) float32 = the dequantized weight, d * q + m in float32 as gguf.dequantize computes it */
void attnmask_q4_1_dequantize(const uint32_t *codes, const float *d, const float *m, float *out, int64_t N, int64_t K,
                              int threads) {
    const int64_t nbp = ((K / QK) + 1) / 2 * 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < K; j++) {
            const int64_t p = j / 64, k = (j % 64) / 8, i = j % 8;
            const uint32_t q = (codes[n * nbp * 4 + p * 8 + i] >> (4 * k)) & 15u;
            out[n * K + j] = d[n * nbp + j / QK] * (float)q + m[n * nbp + j / QK];
        }
}

/* ------------------------------------------------------------------------------------------ */
/* Q8_0                                                                                        */
/* ------------------------------------------------------------------------------------------ */
#if BLOCKS_AVX2
static inline __attribute__((always_inline)) void q8_0_row_r(const uint32_t *codes, const float *d, const float *x,
                                                             float *y, const int R, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    __m256 acc0[MAX_R], acc1[MAX_R];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + b * 8));
        const __m256 v0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 24), 24));
        const __m256 v1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 16), 24));
        const __m256 v2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 8), 24));
        const __m256 v3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(raw, 24));
        const __m256 db = _mm256_broadcast_ss(d + b);
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * K + b * QK;
            const __m256 t = _mm256_add_ps(_mm256_fmadd_ps(v1, _mm256_loadu_ps(xb + 8), _mm256_mul_ps(v0, _mm256_loadu_ps(xb))),
                                           _mm256_fmadd_ps(v3, _mm256_loadu_ps(xb + 24), _mm256_mul_ps(v2, _mm256_loadu_ps(xb + 16))));
            if (b & 1)
                acc1[r] = _mm256_fmadd_ps(db, t, acc1[r]);
            else
                acc0[r] = _mm256_fmadd_ps(db, t, acc0[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r * N] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

static void q8_0_row(const uint32_t *codes, const float *d, const float *x, float *y, int64_t R, int64_t N, int64_t K) {
    switch (R) {
        case 1: q8_0_row_r(codes, d, x, y, 1, N, K); break;
        case 2: q8_0_row_r(codes, d, x, y, 2, N, K); break;
        case 3: q8_0_row_r(codes, d, x, y, 3, N, K); break;
        default: q8_0_row_r(codes, d, x, y, 4, N, K); break;
    }
}
#else
static void q8_0_row(const uint32_t *codes, const float *d, const float *x, float *y, int64_t R, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    const int8_t *q = (const int8_t *)codes;
    for (int64_t r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            float t = 0.0f;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 8; i++) t += (float)q[b * QK + i * 4 + k] * x[r * K + b * QK + k * 8 + i];
            total += d[b] * t;
        }
        y[r * N] = total;
    }
}
#endif

/* y (M, N) = x (M, K) @ W^T. codes: N rows of K uint8 (as K / 4 uint32); d: N rows of K / 32 float32. */
int attnmask_q8_0_matmul(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N,
                         int64_t K, int threads) {
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++)
        for (int64_t r0 = 0; r0 < M; r0 += MAX_R)
            for (int64_t n = task * ROWS_PER_TASK; n < min64((task + 1) * ROWS_PER_TASK, N); n++)
                q8_0_row(codes + n * (K / 4), d + n * (K / QK), x + r0 * K, y + r0 * N + n, min64(MAX_R, M - r0), N, K);
    return 0;
}

void attnmask_q8_0_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *q = (const int8_t *)(codes + n * (K / 4));
        for (int64_t j = 0; j < K; j++) {
            const int64_t b = j / QK, k = (j % QK) / 8, i = j % 8;
            out[n * K + j] = d[n * (K / QK) + b] * (float)q[b * QK + i * 4 + k];
        }
    }
}
