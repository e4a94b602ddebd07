// The float32 product of a few rows by a row-major weight (rows.h), for decoding.cpp's linear_rows and
// packed_step: out (M, N) = x (M, K) W^T (+ bias).
//
// Batch invariance fixes the arithmetic: every output x_m . w_n is one vector accumulator, lane l
// summing x[k] w[k] for k = l, l + V, l + 2V, ... in order by fused multiply-adds (the last step masked
// to K), then the lanes summed by one fixed sequence of shuffles and adds, then the bias added. That
// sequence is the same in every tile shape below, so a row's result does not depend on how many rows
// it is multiplied with, where it sits among them, or how the threads split the work.
//
// Speed comes from tiles: MR rows of x against NR rows of W at once, MR * NR accumulators in registers,
// so that each loaded vector feeds several multiply-adds (a dot product at a time loads two vectors for
// one); x is taken in chunks of rows that stay in L2 while W's tiles pass (batched translation, long
// prefill chunks). With one row (batch-1 decoding) the product only streams W from memory, once: there
// W is read front to back, one row after another (each thread one contiguous part of it), the chains of
// neighbouring rows overlapping in the out-of-order core, and asked for a fixed distance ahead into L2.
// Not with a non-temporal hint: on an Intel Xeon `prefetchnta` fills L1 only, and the stream crawled at
// 5 GB/s a thread against 25 with `prefetcht1`. One stream per thread moves more bytes a second than
// several rows read side by side (SmolLM2-135M's batch-1 decoding on Zen 5 at 2 threads: 1.1-1.2x the
// tokens/s of 1 x 8 tiles).
#include "rows.h"

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;  // lanes
constexpr int MR = 4, NR = 6;  // a tile's rows of x and W
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float *p) { return _mm512_loadu_ps(p); }
inline Vec load_first(const float *p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(Vec a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
constexpr int MR = 3, NR = 4;  // 3 x 4 accumulators + 3 rows of x + 1 of W: the 16 registers
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float *p) { return _mm256_loadu_ps(p); }
inline Vec load_first(const float *p, int n) {
    alignas(32) static const int ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_load_si256(reinterpret_cast<const __m256i *>(ramp)));
    return _mm256_maskload_ps(p, mask);
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lanes_sum(Vec a) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}
#else
constexpr int V = 8;
constexpr int MR = 2, NR = 4;
struct Vec {
    float v[V];
};
inline Vec zero() { return Vec{}; }
inline Vec load(const float *p) {
    Vec a;
    for (int l = 0; l < V; l++) a.v[l] = p[l];
    return a;
}
inline Vec load_first(const float *p, int n) {
    Vec a{};
    for (int l = 0; l < n; l++) a.v[l] = p[l];
    return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {
    for (int l = 0; l < V; l++) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return c;
}
inline float lanes_sum(Vec a) {
    float h[V / 2];
    for (int l = 0; l < V / 2; l++) h[l] = a.v[l] + a.v[l + V / 2];
    const float q0 = h[0] + h[2], q1 = h[1] + h[3];
    return q0 + q1;
}
#endif

constexpr int LINE = 16;  // floats in a 64-byte line

// out[i * ldo + j] = x_i . w_j (+ bias[j]) for the tile's R rows of x and C rows of W (K long, rows
// contiguous). next: the next tile's W rows, asked for into L2 a line per load (null: not asked).
template <int R, int C>
void tile(const float *x, const float *w, int64_t K, const float *bias, float *out, int64_t ldo, const float *next) {
    Vec acc[R][C];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) acc[i][j] = zero();
    int64_t k = 0, line = 0;
    for (; k + V <= K; k += V) {
        Vec xv[R];
        for (int i = 0; i < R; i++) xv[i] = load(x + i * K + k);
        for (int j = 0; j < C; j++) {
            if (next != nullptr && (k % LINE) == 0) __builtin_prefetch(next + (line++) * LINE, 0, 2);
            const Vec wv = load(w + j * K + k);
            for (int i = 0; i < R; i++) acc[i][j] = fma(wv, xv[i], acc[i][j]);
        }
    }
    if (k < K) {  // the last, partial step: lanes past K add 0 * 0
        const int n = static_cast<int>(K - k);
        Vec xv[R];
        for (int i = 0; i < R; i++) xv[i] = load_first(x + i * K + k, n);
        for (int j = 0; j < C; j++) {
            const Vec wv = load_first(w + j * K + k, n);
            for (int i = 0; i < R; i++) acc[i][j] = fma(wv, xv[i], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            float s = lanes_sum(acc[i][j]);
            if (bias != nullptr) s += bias[j];
            out[i * ldo + j] = s;
        }
}

// out[j] = x . w_j (+ bias[j]) for one row of x and C rows of W (K long, rows contiguous), one W row after
// another: each output the same one accumulator in the same order as tile()'s, W read as one stream and
// asked for AHEAD floats ahead into L2, a line per load.
constexpr int64_t AHEAD = 2048;  // 8 KiB

void row_stream(const float *x, const float *w, int64_t K, int64_t C, const float *bias, float *out) {
    for (int64_t j = 0; j < C; j++) {
        const float *wj = w + j * K;
        Vec acc = zero();
        int64_t k = 0;
        for (; k + V <= K; k += V) {
            if ((k % LINE) < V) __builtin_prefetch(wj + k + AHEAD, 0, 2);
            acc = fma(load(wj + k), load(x + k), acc);
        }
        if (k < K) {  // the last, partial step, as in tile()
            const int n = static_cast<int>(K - k);
            acc = fma(load_first(wj + k, n), load_first(x + k, n), acc);
        }
        float s = lanes_sum(acc);
        if (bias != nullptr) s += bias[j];
        out[j] = s;
    }
}

using Tile = void (*)(const float *, const float *, int64_t, const float *, float *, int64_t, const float *);

template <int R, int... C>
constexpr auto row_of_tiles(std::integer_sequence<int, C...>) {
    return std::array<Tile, sizeof...(C)>{&tile<R, C + 1>...};
}

template <int... R>
constexpr auto table_of_tiles(std::integer_sequence<int, R...>) {
    return std::array<std::array<Tile, NR>, sizeof...(R)>{row_of_tiles<R + 1>(std::make_integer_sequence<int, NR>())...};
}

// TILES[r - 1][c - 1]: the tile of r rows of x and c rows of W.
const auto TILES = table_of_tiles(std::make_integer_sequence<int, MR>());

}  // namespace

namespace attnmask {

void rows_matmul(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *out) {
    if (M <= 0 || N <= 0) return;
    if (M == 1) {  // each thread one contiguous run of W's rows
        const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(1, K));
        at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            row_stream(x, w + begin * K, K, end - begin, bias ? bias + begin : nullptr, out + begin);
        });
        return;
    }
    const int64_t nr = NR, tiles = (N + nr - 1) / nr;
    // x in chunks of rows that stay in L2 (256 KiB) while every W tile of a thread passes them
    const int64_t chunk = std::max<int64_t>(MR, (int64_t{1} << 16) / std::max<int64_t>(1, K) / MR * MR);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K * M * nr));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = std::min(M, m0 + chunk);
            for (int64_t t = begin; t < end; t++) {
                const int64_t n0 = t * nr, c = std::min(nr, N - n0);
                const float *next = t + 1 < end ? w + (n0 + nr) * K : nullptr;
                for (int64_t m = m0; m < m1; m += MR) {
                    const int64_t r = std::min<int64_t>(MR, m1 - m);
                    TILES[r - 1][c - 1](x + m * K, w + n0 * K, K, bias ? bias + n0 : nullptr, out + m * N + n0, N,
                                        m == m0 ? next : nullptr);
                }
            }
        }
    });
}

}  // namespace attnmask
