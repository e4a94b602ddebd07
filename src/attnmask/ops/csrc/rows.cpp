// The float32 product of a few rows by a row-major weight (rows.h), for decoding.cpp.
#include "rows.h"

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>

namespace {

constexpr int LANES = 16;
constexpr int64_t AHEAD = 2048;  // 8 KiB

float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[i + l] * b[i + l];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < LANES; l++) s += part[l];
    return s;
}

float vdot(const float *w, const float *x, int64_t K) {
    int64_t k = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; k + 64 <= K; k += 64) {
        for (int j = 0; j < 4; j++) {
            __builtin_prefetch(w + k + AHEAD + 16 * j, 0, 2);
            a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16 * j), _mm512_loadu_ps(x + k + 16 * j), a[j]);
        }
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; k + 32 <= K; k += 32) {
        for (int j = 0; j < 4; j++) {
            if (j % 2 == 0) __builtin_prefetch(w + k + AHEAD + 8 * j, 0, 2);
            a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), a[j]);
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    for (float lane : lanes) s += lane;
#endif
    return s + dot(w + k, x + k, K - k);
}

}  // namespace

namespace attnmask {

void rows_matmul(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *out) {
    const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(1, K * M));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; n++)
            for (int64_t r = 0; r < M; r++) out[r * N + n] = vdot(w + n * K, x + r * K, K) + (bias ? bias[n] : 0.0f);
    });
}

}  // namespace attnmask
