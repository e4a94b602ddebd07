// The float32 product of rows by a weight in panels (rows.h), for decoding.cpp's linear_panels, linear_rows
// and packed_step: out (M, N) = x (M, K) W^T (+ bias).
//
// Batch invariance fixes the arithmetic: every output x_m . w_n is one chain of fused multiply-adds over
// k = 0, 1, ..., K - 1 in order, starting from 0, then the bias added. Nothing else touches it: not the
// number of rows, a row's place among them, the tile shape, how the threads split the work, or K's blocks
// (a chain stopped at a block's end is stored and taken up again, exactly). The portable loop computes
// the same chain with std::fma, so every build (AVX-512, AVX2, portable) gives the same bits too.
//
// The layout makes that chain fast. W's rows are taken NR at a time, a panel, and a panel stores for each
// k the NR weights w[n0 .. n0 + NR, k] side by side (panels[(p K + k) NR + j] = W[p NR + j, k], zeros past
// N). One vector load then holds V outputs' weights at one k, and each x[m, k], broadcast, feeds NR / V
// multiply-adds: a tile of MR rows of x against a panel keeps MR x NR / V accumulators in registers, with
// no sum across lanes at the end. This is the register blocking of a BLAS's sgemm with the weight packed
// once (pack_panels) instead of at every call. x is taken in chunks of rows, and K in blocks, so that a
// chunk's block of x and a panel's block stay in L2 while the tiles pass. With one row (batch-1
// decoding) the product streams the panels from memory, G at a time for enough independent chains,
// asked for a fixed distance ahead into L2. Not with a non-temporal hint: on an Intel Xeon `prefetchnta`
// fills L1 only, and a stream crawled at 5 GB/s a thread against 25 with `prefetcht1`.
//
// An earlier layout kept W row-major and summed each output across a vector's lanes at the end. On an Intel
// Xeon (1 thread, weights from memory) it ran 47-70 GMAC/s at 64-256 rows where this one runs 72-90, at or
// above MKL's sgemm on the same shapes (docs/benchmarks.md).
#include "rows.h"

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;  // lanes
constexpr int NV = 3, MR = 8;  // a panel is NV vectors; a tile MR rows of x: 24 accumulators of the 32 registers
constexpr int G = 2;  // panels a row streams at once: 6 chains
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float *p) { return _mm512_loadu_ps(p); }
inline Vec broadcast(const float *p) { return _mm512_set1_ps(*p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void store(float *p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec load_first(const float *p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline void store_first(float *p, Vec a, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
constexpr int NV = 2, MR = 6;  // 12 accumulators, 2 weight vectors and a broadcast: 15 of the 16 registers
constexpr int G = 4;  // 8 chains
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float *p) { return _mm256_loadu_ps(p); }
inline Vec broadcast(const float *p) { return _mm256_broadcast_ss(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void store(float *p, Vec a) { _mm256_storeu_ps(p, a); }
inline __m256i first_lanes(int n) {
    alignas(32) static const int ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_load_si256(reinterpret_cast<const __m256i *>(ramp)));
}
inline Vec load_first(const float *p, int n) { return _mm256_maskload_ps(p, first_lanes(n)); }
inline void store_first(float *p, Vec a, int n) { _mm256_maskstore_ps(p, first_lanes(n), a); }
#else
constexpr int V = 8;
constexpr int NV = 2, MR = 4, G = 1;
struct Vec {
    float v[V];
};
inline Vec zero() { return Vec{}; }
inline Vec load(const float *p) {
    Vec a;
    for (int l = 0; l < V; l++) a.v[l] = p[l];
    return a;
}
inline Vec broadcast(const float *p) {
    Vec a;
    for (int l = 0; l < V; l++) a.v[l] = *p;
    return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {
    for (int l = 0; l < V; l++) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return c;
}
inline Vec add(Vec a, Vec b) {
    for (int l = 0; l < V; l++) a.v[l] += b.v[l];
    return a;
}
inline void store(float *p, Vec a) {
    for (int l = 0; l < V; l++) p[l] = a.v[l];
}
inline Vec load_first(const float *p, int n) {
    Vec a{};
    for (int l = 0; l < n; l++) a.v[l] = p[l];
    return a;
}
inline void store_first(float *p, Vec a, int n) {
    for (int l = 0; l < n; l++) p[l] = a.v[l];
}
#endif

constexpr int NR = NV * V;  // a panel's width
constexpr int LINE = 16;  // floats in a 64-byte line
constexpr int64_t KC = 1024;  // K's block in the many-row product: a panel's block is <= 192 KiB (AVX-512)
constexpr int64_t AHEAD = 2048;  // the one-row stream's prefetch distance: 8 KiB

// The first n of a vector's V columns (all of them for n >= V, none for n <= 0): loaded, stored.
inline Vec load_cols(const float *p, int n) { return n >= V ? load(p) : n <= 0 ? zero() : load_first(p, n); }
inline void store_cols(float *p, Vec a, int n) {
    if (n >= V)
        store(p, a);
    else if (n > 0)
        store_first(p, a, n);
}

// R rows of x (ldx apart) against one panel's block of kc values of k (b: the panel at the block's first
// k), for the panel's first c columns of out (ldo apart): each chain taken up from out (or from 0 for the
// first block), kc multiply-adds, stored; the bias (null: none) added after the last block. Meanwhile the
// tile asks for `lines` 64-byte lines from `ahead` into L2, spread over its steps: its share of the panel
// block the thread takes next, so that it comes from memory while this one is multiplied.
template <int R>
void tile(const float *x, int64_t ldx, const float *b, int64_t kc, bool first, const float *bias, float *out,
          int64_t ldo, int c, const float *ahead, int64_t lines) {
    Vec acc[R][NV];
    const float *ask = ahead;
    int64_t owed = 0;  // lines * (k + 1) - kc * (lines asked): a line is due each time it reaches kc
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = first ? zero() : load_cols(out + i * ldo + j * V, c - j * V);
    for (int64_t k = 0; k < kc; k++) {
        for (owed += lines; owed >= kc; owed -= kc, ask += LINE) __builtin_prefetch(ask, 0, 2);
        Vec w[NV];
        for (int j = 0; j < NV; j++) w[j] = load(b + k * NR + j * V);
        for (int i = 0; i < R; i++) {
            const Vec a = broadcast(x + i * ldx + k);
            for (int j = 0; j < NV; j++) acc[i][j] = fma(a, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NV; j++) {
            const Vec s = bias != nullptr ? add(acc[i][j], load_cols(bias + j * V, c - j * V)) : acc[i][j];
            store_cols(out + i * ldo + j * V, s, c - j * V);
        }
}

using Tile = void (*)(const float *, int64_t, const float *, int64_t, bool, const float *, float *, int64_t, int,
                     const float *, int64_t);

template <int... R>
constexpr std::array<Tile, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
    return {&tile<R + 1>...};
}

const auto TILES = tiles(std::make_integer_sequence<int, MR>());  // TILES[r - 1]: the tile of r rows

// One row of x against g <= G whole panels (b: the first), all of K at once, as one stream from memory:
// out's g * NR columns, the first c of the last panel's.
template <int g>
void stream(const float *x, const float *b, int64_t K, const float *bias, float *out, int c) {
    Vec acc[g][NV];
    for (int p = 0; p < g; p++)
        for (int j = 0; j < NV; j++) acc[p][j] = zero();
    for (int64_t k = 0; k < K; k++) {
        const Vec a = broadcast(x + k);
        for (int p = 0; p < g; p++) {
            const float *w = b + (p * K + k) * NR;
            for (int j = 0; j < NV; j++) {
                if ((j * V) % LINE == 0) __builtin_prefetch(w + j * V + AHEAD, 0, 2);
                acc[p][j] = fma(a, load(w + j * V), acc[p][j]);
            }
        }
    }
    for (int p = 0; p < g; p++) {
        const int cp = p + 1 < g ? NR : c;
        for (int j = 0; j < NV; j++) {
            const int n = cp - j * V;
            const Vec s = bias != nullptr ? add(acc[p][j], load_cols(bias + p * NR + j * V, n)) : acc[p][j];
            store_cols(out + p * NR + j * V, s, n);
        }
    }
}

template <int... g>
constexpr auto streams(std::integer_sequence<int, g...>) {
    using Stream = void (*)(const float *, const float *, int64_t, const float *, float *, int);
    return std::array<Stream, sizeof...(g)>{&stream<g + 1>...};
}

const auto STREAMS = streams(std::make_integer_sequence<int, G>());  // STREAMS[g - 1]: g panels at once

}  // namespace

namespace attnmask {

int64_t panel_width() { return NR; }

int64_t panels_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * K * NR; }

void pack_panels(const float *w, int64_t N, int64_t K, float *panels) {
    constexpr int64_t KB = 64;  // k a step: the panel's part being written stays in L1
    at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; p++) {
            float *panel = panels + p * K * NR;
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t k1 = std::min(K, k0 + KB);
                for (int64_t j = 0; j < NR; j++) {
                    const int64_t n = p * NR + j;
                    for (int64_t k = k0; k < k1; k++) panel[k * NR + j] = n < N ? w[n * K + k] : 0.0f;
                }
            }
        }
    });
}

void panels_matmul(const float *x, int64_t M, const float *panels, int64_t N, int64_t K, const float *bias,
                   float *out) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {  // empty sums: the bias, or zeros
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) out[m * N + n] = bias != nullptr ? bias[n] : 0.0f;
        return;
    }
    const int64_t P = (N + NR - 1) / NR;
    auto cols = [&](int64_t p) { return static_cast<int>(std::min<int64_t>(NR, N - p * NR)); };
    if (M == 1) {  // each thread one contiguous run of panels, G at a time
        const int64_t grain = std::max<int64_t>(G, ((int64_t{1} << 15) / std::max<int64_t>(1, K) + NR - 1) / NR);
        at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
            for (int64_t p = begin; p < end; p += G) {
                const int g = static_cast<int>(std::min<int64_t>(G, end - p));
                STREAMS[g - 1](x, panels + p * K * NR, K, bias ? bias + p * NR : nullptr, out + p * NR,
                               cols(p + g - 1));
            }
        });
        return;
    }
    // rows of x in chunks whose block of K stays in L2 (384 KiB) while the thread's panels pass
    const int64_t chunk = std::max<int64_t>(MR, (int64_t{3} << 15) / std::min(K, KC) / MR * MR);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K * M * NR));
    at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t m1 = std::min(M, m0 + chunk), tiles = (m1 - m0 + MR - 1) / MR;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = std::min(KC, K - k0);
                const bool first = k0 == 0, last = k0 + kc == K;
                const int64_t lines = kc * NR / LINE, share = (lines + tiles - 1) / tiles;  // of the next block
                for (int64_t p = begin; p < end; p++) {
                    const float *b = panels + (p * K + k0) * NR;
                    const float *next = p + 1 < end ? b + K * NR : nullptr;  // the next panel's block
                    const float *bp = last && bias ? bias + p * NR : nullptr;
                    for (int64_t t = 0; t < tiles; t++) {
                        const int64_t m = m0 + t * MR, r = std::min<int64_t>(MR, m1 - m);
                        const int64_t asked = next ? std::clamp<int64_t>(lines - t * share, 0, share) : 0;
                        TILES[r - 1](x + m * K + k0, K, b, kc, first, bp, out + m * N + p * NR, N, cols(p),
                                     next ? next + t * share * LINE : nullptr, asked);
                    }
                }
            }
        }
    });
}

void rows_matmul(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *out) {
    if (M <= 0 || N <= 0) return;
    std::vector<float> panels(static_cast<size_t>(panels_size(N, K)));
    pack_panels(w, N, K, panels.data());
    panels_matmul(x, M, panels.data(), N, K, bias, out);
}

}  // namespace attnmask
