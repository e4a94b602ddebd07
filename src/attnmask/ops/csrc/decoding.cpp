// The decoding step's work between the matrix products, as C++ operators (attnmask.ops.decoding): what a
// step of a pre-norm RMSNorm / rotary / SwiGLU decoder does between its products, for rows of float32 on
// the CPU.
//
//   rms_norm(x, w, eps)               w * x / sqrt(mean(x^2) + eps), row by row
//   add_rms_norm(x, delta, w, eps)    (x + delta, rms_norm(x + delta, w, eps)): a residual and the next norm
//   silu_mul(gate_up)                 silu(gate) * up, gate and up the two halves of each row
//   pack_panels(weight)               a float32 W (N, K) in the panel layout of rows.h
//   linear_panels(x, panels, bias, n) x W^T (+ b) for rows x and W in panels
//   linear_rows(x, weight, bias)      the same for a row-major W, packed for the call
//   paged_attend(q, pools, tables, ...) packed rows of several sequences against a paged cache
//   packed_step(x, ...)               all of the above for every layer of a packed step, and its head:
//                                     one call a step instead of ~210 from Python (SmolLM2) or ~360
//                                     (Gemma 3: q/k norms, post-sublayer norms, a rotary table and a
//                                     window per layer, a GELU-gated MLP, its layers in several groups
//                                     of block tables)
//
// Eager PyTorch runs each of these as 3 to 20 operator calls of a few microseconds each, and a
// SmolLM2 token has 30 layers of them: ~3 ms a token of dispatching tiny tensors, as much as half
// the time of the products themselves. Here each is one call. The schemas, the shape rules for
// torch.compile and the PyTorch implementations (the reference the tests compare with) are
// registered from Python; this file adds the CPU implementations.
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "blocks.h"  // packed_step multiplies by block weights
#include "rows.h"    // and by float32 weights

namespace {

constexpr int LANES = 16;  // independent partial sums, so that the compiler can vectorize reductions

void check_rows(const at::Tensor &t, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
                      " must be a float32 CPU tensor; got ", t.scalar_type(), " on ", t.device().str());
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

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

// A dot product of two float32 rows, K long, in vectors: four accumulators (then their sum, then the
// tail past the last whole step). STREAM: the first row is a weight row streamed from memory once (the
// products of linear_rows), asked for AHEAD floats ahead into L2, where the hardware prefetchers alone
// leave the loop waiting (measured on Zen 5: 38 GB/s with one core against the BLAS's 21-26).
constexpr int64_t AHEAD = 2048;  // 8 KiB

template <bool STREAM>
float vdot(const float *w, const float *x, int64_t K) {
    int64_t k = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; k + 64 <= K; k += 64) {
        for (int j = 0; j < 4; j++) {
            if (STREAM) __builtin_prefetch(w + k + AHEAD + 16 * j, 0, 2);  // one 64-byte line
            a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16 * j), _mm512_loadu_ps(x + k + 16 * j), a[j]);
        }
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; k + 32 <= K; k += 32) {
        for (int j = 0; j < 4; j++) {
            if (STREAM && j % 2 == 0) __builtin_prefetch(w + k + AHEAD + 8 * j, 0, 2);  // a line per two
            a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), a[j]);
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    for (float lane : lanes) s += lane;
#endif
    // the tail past the vectors, if any: adding dot()'s zero when there is none only costs its 16 serial
    // adds (a third of a 256-long dot product's time) and can change nothing but the sign of a zero
    return k < K ? s + dot(w + k, x + k, K - k) : s;
}

// fn(r) for rows r in [0, rows), each `work` floats of a row's own work: shared among the threads where
// each thread gets at least ROW_WORK floats of it (a 16-row step's SiLU, norms and rotations: each alone
// too short to hand over, together ~4% of the step, serial while the other thread waited), else in order
// on the calling thread. A row is computed by the same operations whichever thread takes it.
constexpr int64_t ROW_WORK = 4096;

template <typename Fn>
void each_row(int64_t rows, int64_t work, const Fn &fn) {
    const int64_t grain = std::max<int64_t>(1, ROW_WORK / std::max<int64_t>(1, work));
    if (rows < 2 * grain || at::get_num_threads() < 2) {
        for (int64_t r = 0; r < rows; r++) fn(r);
        return;
    }
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) fn(r);
    });
}

void norm_row(const float *x, const float *w, float *out, int64_t C, double eps) {
    const float inv = 1.0f / std::sqrt(vdot<false>(x, x, C) / static_cast<float>(C) + static_cast<float>(eps));
    for (int64_t c = 0; c < C; c++) out[c] = w[c] * (x[c] * inv);
}

void check_norm(const at::Tensor &x, const at::Tensor &w, const char *op) {
    check_rows(x, op, "x");
    check_rows(w, op, "weight");
    TORCH_CHECK_VALUE(w.dim() == 1 && x.dim() >= 1 && x.size(-1) == w.size(0), op, ": weight has shape ", w.sizes(),
                      "; expected (", x.dim() ? x.size(-1) : 0, ",) for x of shape ", x.sizes());
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
    check_norm(x, w, "rms_norm");
    at::Tensor out = at::empty_like(x);
    const int64_t C = w.size(0), rows = x.numel() / C;
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float *op = out.mutable_data_ptr<float>();
    each_row(rows, C, [&](int64_t r) { norm_row(xp + r * C, wp, op + r * C, C, eps); });
    return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &delta, const at::Tensor &w,
                                                double eps) {
    check_norm(x, w, "add_rms_norm");
    check_rows(delta, "add_rms_norm", "delta");
    TORCH_CHECK_VALUE(delta.sizes() == x.sizes(), "add_rms_norm: delta has shape ", delta.sizes(),
                      "; expected x's ", x.sizes());
    at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
    const int64_t C = w.size(0), rows = x.numel() / C;
    const float *xp = x.const_data_ptr<float>(), *dp = delta.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float *sp = sum.mutable_data_ptr<float>(), *op = out.mutable_data_ptr<float>();
    each_row(rows, 2 * C, [&](int64_t r) {
        for (int64_t i = r * C; i < (r + 1) * C; i++) sp[i] = xp[i] + dp[i];
        norm_row(sp + r * C, wp, op + r * C, C, eps);
    });
    return {sum, out};
}

// silu(gate) up, rows of F (gated_rows' SiLU, below)
void silu_rows(const float *gate, int64_t gs, const float *up, int64_t us, int64_t rows, int64_t F, float *out);

at::Tensor silu_mul(const at::Tensor &gate_up) {
    check_rows(gate_up, "silu_mul", "gate_up");
    TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: gate_up has shape ",
                      gate_up.sizes(), "; expected (..., 2 * F): gate then up");
    std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
    const int64_t F = shape.back() / 2, rows = gate_up.numel() / (2 * F);
    shape.back() = F;
    at::Tensor out = at::empty(shape, gate_up.options());
    const float *g = gate_up.const_data_ptr<float>();
    float *o = out.mutable_data_ptr<float>();
    silu_rows(g, 2 * F, g + F, 2 * F, rows, F, o);
    return out;
}

// One head of one row rotated: y = x cos + roll(x, D/2) signed_sin (rotate-half layout), or copied
// where there is no rotary (c null).
inline void rotate_row(const float *x, const float *c, const float *s, float *y, int64_t D) {
    if (c == nullptr) {
        for (int64_t d = 0; d < D; d++) y[d] = x[d];
        return;
    }
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) y[d] = x[d] * c[d] + x[d < half ? d + half : d - half] * s[d];
}

// tanh-GELU times up, element by element: 0.5 a (1 + tanh(y)) u with y = sqrt(2 / pi) (a + 0.044715 a^3), as
// PyTorch's formula writes it, computed as a u / (1 + exp(-2 y)) (the same function: 1 + tanh(y) = 2 / (1 +
// exp(-2 y)), without tanh's cancellation near 0), exp(x) as Cephes' expf (exp_lanes): x = n ln 2 + r, e^r
// by a degree-6 polynomial, times 2^n. GELU_LANES elements at a time, a row's tail padded to a full vector, so
// that every element goes through the same instructions whatever the row's length and its place in it:
// its bits depend on its value alone.
constexpr float GELU_2BETA = -1.5957691216057308f;  // -2 sqrt(2 / pi)
constexpr float GELU_KAPPA = 0.044715f;
constexpr float EXP_MIN = -87.0f, EXP_MAX = 88.0f;  // 2^n stays a normal float: n in [-126, 127]
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
constexpr int GELU_LANES = 16;
// e^x for x clamped to [EXP_MIN, EXP_MAX], lane by lane (Cephes' expf, as above)
inline __m512 exp_lanes(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX)), _mm512_set1_ps(EXP_MIN));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
inline void gelu_mul_lanes(const float *g, const float *u, float *o) {
    const __m512 a = _mm512_loadu_ps(g);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), a), _mm512_mul_ps(a, a), a);
    const __m512 e = exp_lanes(_mm512_mul_ps(_mm512_set1_ps(GELU_2BETA), inner));
    const __m512 y = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(o, _mm512_mul_ps(y, _mm512_loadu_ps(u)));
}
inline void silu_mul_lanes(const float *g, const float *u, float *o) {
    const __m512 a = _mm512_loadu_ps(g);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), a));
    const __m512 y = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(o, _mm512_mul_ps(y, _mm512_loadu_ps(u)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int GELU_LANES = 8;
inline __m256 exp_lanes(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_MAX)), _mm256_set1_ps(EXP_MIN));
    const __m256 n =
        _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));  // p 2^n
}
inline void gelu_mul_lanes(const float *g, const float *u, float *o) {
    const __m256 a = _mm256_loadu_ps(g);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), a), _mm256_mul_ps(a, a), a);
    const __m256 e = exp_lanes(_mm256_mul_ps(_mm256_set1_ps(GELU_2BETA), inner));
    const __m256 y = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(o, _mm256_mul_ps(y, _mm256_loadu_ps(u)));
}
inline void silu_mul_lanes(const float *g, const float *u, float *o) {
    const __m256 a = _mm256_loadu_ps(g);
    const __m256 e = exp_lanes(_mm256_sub_ps(_mm256_setzero_ps(), a));
    const __m256 y = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(o, _mm256_mul_ps(y, _mm256_loadu_ps(u)));
}
#else
constexpr int GELU_LANES = 1;
inline float exp_lanes(float x) {
    x = std::max(std::min(x, EXP_MAX), EXP_MIN);
    const float n = std::nearbyint(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = EXP_P[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_P[i];
    p = p * (r * r) + (r + 1.0f);
    return std::ldexp(p, static_cast<int>(n));
}
inline void gelu_mul_lanes(const float *g, const float *u, float *o) {
    const float a = *g;
    *o = a / (1.0f + exp_lanes(GELU_2BETA * ((GELU_KAPPA * a) * (a * a) + a))) * *u;
}
inline void silu_mul_lanes(const float *g, const float *u, float *o) {
    const float a = *g;
    *o = a / (1.0f + exp_lanes(0.0f - a)) * *u;
}
#endif

// lanes(g + f, u + f, o + f) over a row of F, GELU_LANES elements at a time, the tail padded (see above):
// act(g) u for the gated MLP, e^(x - shift) for attention's weights
template <class Lanes>
void by_lanes(const float *g, const float *u, float *o, int64_t F, Lanes lanes) {
    int64_t f = 0;
    for (; f + GELU_LANES <= F; f += GELU_LANES) lanes(g + f, u + f, o + f);
    if (f < F) {  // the tail through the same instructions, padded
        float gt[GELU_LANES] = {0}, ut[GELU_LANES] = {0}, ot[GELU_LANES];
        for (int64_t i = f; i < F; i++) gt[i - f] = g[i], ut[i - f] = u[i];
        lanes(gt, ut, ot);
        for (int64_t i = f; i < F; i++) o[i] = ot[i - f];
    }
}


// e^(x - shift) of GELU_LANES elements (by_lanes: a row's tail padded, so each element's bits depend
// on its value alone)
#if defined(__AVX512F__)
inline void exp_shifted_lanes(const float *x, float shift, float *o) {
    _mm512_storeu_ps(o, exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(x), _mm512_set1_ps(shift))));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void exp_shifted_lanes(const float *x, float shift, float *o) {
    _mm256_storeu_ps(o, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(shift))));
}
#else
inline void exp_shifted_lanes(const float *x, float shift, float *o) { *o = exp_lanes(*x - shift); }
#endif

// outs[j] = inv[j] * sum_t w[j][t] v_t for `count` (row, query head) pairs j: w rows `wstride` apart over
// the n keys from `first` (a pair's weight is 0 at the keys outside its row's range: adding 0 w v leaves
// a sum's bits as they were), v_t at vbase + koff[first + t] (vbase: the pool at the key/value head;
// koff: each key's place in the pools, worked out once a unit).
// Each output lane is one accumulator, keys in order: the same operations whatever rows are computed
// beside it, and however the pairs are grouped below.
#if defined(__AVX512F__)
// NJ pairs and NV vectors of 16 (a chunk of D from `dc`) at a time, in registers: each value vector
// loaded once for the NJ pairs
template <int NJ, int NV>
void weighted_chunk(const float *w, int64_t wstride, int64_t n, const float *vbase, const int64_t *koff,
                    int64_t first, const float *inv, float *const *outs, int64_t dc) {
    __m512 acc[NJ][NV];
    for (int j = 0; j < NJ; j++)
        for (int c = 0; c < NV; c++) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = first + t;
        const float *vt = vbase + koff[at] + dc;
        __m512 v[NV];
        for (int c = 0; c < NV; c++) v[c] = _mm512_loadu_ps(vt + 16 * c);
        for (int j = 0; j < NJ; j++) {
            const __m512 wj = _mm512_set1_ps(w[j * wstride + t]);
            for (int c = 0; c < NV; c++) acc[j][c] = _mm512_fmadd_ps(wj, v[c], acc[j][c]);
        }
    }
    for (int j = 0; j < NJ; j++)
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(outs[j] + dc + 16 * c, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv[j])));
}

using WeightedChunk = void (*)(const float *, int64_t, int64_t, const float *, const int64_t *, int64_t,
                               const float *, float *const *, int64_t);
// up to 4 pairs: D 64 at a time; more (rows of one sequence side by side): up to 8 pairs, D 32 at a time
constexpr WeightedChunk WEIGHTED4[4][4] = {
    {weighted_chunk<1, 1>, weighted_chunk<1, 2>, weighted_chunk<1, 3>, weighted_chunk<1, 4>},
    {weighted_chunk<2, 1>, weighted_chunk<2, 2>, weighted_chunk<2, 3>, weighted_chunk<2, 4>},
    {weighted_chunk<3, 1>, weighted_chunk<3, 2>, weighted_chunk<3, 3>, weighted_chunk<3, 4>},
    {weighted_chunk<4, 1>, weighted_chunk<4, 2>, weighted_chunk<4, 3>, weighted_chunk<4, 4>},
};
constexpr WeightedChunk WEIGHTED8[8] = {
    weighted_chunk<1, 2>, weighted_chunk<2, 2>, weighted_chunk<3, 2>, weighted_chunk<4, 2>,
    weighted_chunk<5, 2>, weighted_chunk<6, 2>, weighted_chunk<7, 2>, weighted_chunk<8, 2>,
};
#elif defined(__AVX2__) && defined(__FMA__)
// The same with 8 lanes: NJ pairs (up to 4) and 2 vectors of 8 (16 floats of D from `dc`), 8 accumulators,
// the two value vectors and a weight in 11 of the 16 registers, over keys [ta, tb) of the n: the sums
// start at zero (ta = 0) or where the previous keys left them in `outs`, and are scaled by inv after the
// last key (tb = n). The caller takes every pair and D's chunks over a few keys at a time, so that
// those keys' values are read from memory once and stay in L1 across the chunks (Gemma's D = 256 at 8k
// keys is 8 MB of values). Each lane's operations are those of the AVX-512 chunks: one multiply-add a
// key, keys in order, times inv at the end (a sum stored and loaded back keeps its bits).
template <int NJ>
void weighted_chunk(const float *w, int64_t wstride, int64_t ta, int64_t tb, int64_t n, const float *vbase,
                    const int64_t *koff, int64_t first, const float *inv, float *const *outs, int64_t dc) {
    // the accumulators by name, not in an array: gcc kept an array's elements on the stack, stored back
    // after every multiply-add (seen in perf's annotation of a Gemma 3 prefill on Zen 3)
    __m256 a0, a1, b0, b1, c0, c1, e0, e1;
    auto start = [&](int j, __m256 &x0, __m256 &x1) {
        x0 = ta ? _mm256_loadu_ps(outs[j] + dc) : _mm256_setzero_ps();
        x1 = ta ? _mm256_loadu_ps(outs[j] + dc + 8) : _mm256_setzero_ps();
    };
    start(0, a0, a1);
    if constexpr (NJ > 1) start(1, b0, b1);
    if constexpr (NJ > 2) start(2, c0, c1);
    if constexpr (NJ > 3) start(3, e0, e1);
    for (int64_t t = ta; t < tb; t++) {
        const float *vt = vbase + koff[first + t] + dc;
        const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
        __m256 x = _mm256_broadcast_ss(w + t);
        a0 = _mm256_fmadd_ps(x, v0, a0), a1 = _mm256_fmadd_ps(x, v1, a1);
        if constexpr (NJ > 1) {
            x = _mm256_broadcast_ss(w + wstride + t);
            b0 = _mm256_fmadd_ps(x, v0, b0), b1 = _mm256_fmadd_ps(x, v1, b1);
        }
        if constexpr (NJ > 2) {
            x = _mm256_broadcast_ss(w + 2 * wstride + t);
            c0 = _mm256_fmadd_ps(x, v0, c0), c1 = _mm256_fmadd_ps(x, v1, c1);
        }
        if constexpr (NJ > 3) {
            x = _mm256_broadcast_ss(w + 3 * wstride + t);
            e0 = _mm256_fmadd_ps(x, v0, e0), e1 = _mm256_fmadd_ps(x, v1, e1);
        }
    }
    auto finish = [&](int j, __m256 x0, __m256 x1) {
        const __m256 s = _mm256_set1_ps(tb == n ? inv[j] : 1.0f);  // x * 1 is x: the partial sums unchanged
        _mm256_storeu_ps(outs[j] + dc, _mm256_mul_ps(x0, s));
        _mm256_storeu_ps(outs[j] + dc + 8, _mm256_mul_ps(x1, s));
    };
    finish(0, a0, a1);
    if constexpr (NJ > 1) finish(1, b0, b1);
    if constexpr (NJ > 2) finish(2, c0, c1);
    if constexpr (NJ > 3) finish(3, e0, e1);
}

using WeightedChunk = void (*)(const float *, int64_t, int64_t, int64_t, int64_t, const float *, const int64_t *,
                               int64_t, const float *, float *const *, int64_t);
constexpr WeightedChunk WEIGHTED4[4] = {weighted_chunk<1>, weighted_chunk<2>, weighted_chunk<3>, weighted_chunk<4>};
constexpr int64_t VALUE_KEYS = 32;  // keys a pass over D's chunks: 32 KB of values at D = 256
#endif

void weighted_values(const float *w, int64_t wstride, int64_t n, const float *vbase, const int64_t *koff,
                     int64_t first, const float *inv, float *const *outs, int64_t D,
                     int64_t count) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        const int64_t group = count <= 4 || D % 32 ? 4 : 8;
        for (int64_t j0 = 0; j0 < count; j0 += group) {
            const int64_t nj = std::min<int64_t>(group, count - j0);
            if (group == 4) {
                for (int64_t dc = 0; dc < D; dc += 64)
                    WEIGHTED4[nj - 1][std::min<int64_t>(4, (D - dc) / 16) - 1](
                        w + j0 * wstride, wstride, n, vbase, koff, first, inv + j0, outs + j0, dc);
            } else {
                for (int64_t dc = 0; dc < D; dc += 32)
                    WEIGHTED8[nj - 1](w + j0 * wstride, wstride, n, vbase, koff, first, inv + j0,
                                      outs + j0, dc);
            }
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 16 == 0 && n > 0) {
        // a few keys at a time for every pair: those keys' values are read from memory once, not once per
        // four pairs (a prefill unit's 32 pairs at 8k keys of D = 256: 8 MB a read)
        for (int64_t ta = 0; ta < n; ta += VALUE_KEYS)
            for (int64_t j0 = 0; j0 < count; j0 += 4) {
                const int64_t nj = std::min<int64_t>(4, count - j0);
                for (int64_t dc = 0; dc < D; dc += 16)
                    WEIGHTED4[nj - 1](w + j0 * wstride, wstride, ta, std::min(n, ta + VALUE_KEYS), n, vbase, koff,
                                      first, inv + j0, outs + j0, dc);
            }
        return;
    }
#endif
    for (int64_t j = 0; j < count; j++)
        for (int64_t d = 0; d < D; d++) outs[j][d] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = first + t;
        const float *__restrict vt = vbase + koff[at];
        for (int64_t j = 0; j < count; j++) {
            const float weight = w[j * wstride + t];
            float *__restrict oh = outs[j];
            for (int64_t d = 0; d < D; d++) oh[d] += weight * vt[d];
        }
    }
    for (int64_t j = 0; j < count; j++)
        for (int64_t d = 0; d < D; d++) outs[j][d] *= inv[j];
}

// Keys ta..tb of a sequence against one query: p[t] = (q . k_t) scale, k_t at kbase + koff[t], vdot's
// operations in vdot's order (with AVX-512 and D a multiple of 64 up to 256, the query is held in
// registers across the keys: the same products and sums, so the same bits); returns the running
// maximum from `top`.
constexpr int64_t KEY_BLOCK = 32;
#if defined(__AVX512F__)
// Eight keys' vectors (v[u]: key u's four accumulators added in pairs, vdot's), each one's lanes added as
// _mm512_reduce_add_ps adds them (lane l + lane l + 8, then l + 4, l + 2, l + 1, in that order), the
// eight at once: in the result, 128-bit lane i holds key i's total in float 0 and key 4 + i's in float 1.
inline __m512 eight_totals(const __m512 *v) {
    __m512 h[4], q[2];
    for (int u = 0; u < 4; u++)  // keys 2u, 2u + 1: lane l + lane l + 8 of each, l < 8
        h[u] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * u], v[2 * u + 1], 0xEE),
                             _mm512_shuffle_f32x4(v[2 * u], v[2 * u + 1], 0x44));
    for (int u = 0; u < 2; u++)  // 128-bit lane i: key 4u + i, its sums l + l + 4, l < 4
        q[u] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], 0xDD),
                             _mm512_shuffle_f32x4(h[2 * u], h[2 * u + 1], 0x88));
    // lane i: key i's sums l + l + 2 (l < 2), then key 4 + i's
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(z, z, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int NK>  // D = 64 NK
float scores_held(const float *q, const float *kbase, const int64_t *koff, int64_t ta, int64_t tb,
                  float scale, float *p, float top) {
    __m512 qr[NK * 4];
    for (int i = 0; i < NK * 4; i++) qr[i] = _mm512_loadu_ps(q + 16 * i);
    auto key = [&](int64_t t) {  // vdot's accumulators for key t, added in pairs
        const float *kt = kbase + koff[t];
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < NK; k++)
            for (int j = 0; j < 4; j++) a[j] = _mm512_fmadd_ps(qr[4 * k + j], _mm512_loadu_ps(kt + 64 * k + 16 * j), a[j]);
        return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
    };
    int64_t t = ta;
    // eight keys' lanes added at once, the same sums as one at a time; not with D = 256, whose query
    // takes 16 of the 32 registers (SmolLM2's D = 64 prefill: 15% less time; Gemma 3's: 5% more)
    for (; NK <= 2 && t + 7 <= tb; t += 8) {
        __m512 v[8];
        for (int u = 0; u < 8; u++) v[u] = key(t + u);
        alignas(64) float totals[16];
        _mm512_store_ps(totals, _mm512_mul_ps(eight_totals(v), _mm512_set1_ps(scale)));
        for (int i = 0; i < 4; i++) p[t + i] = totals[4 * i], p[t + 4 + i] = totals[4 * i + 1];
        for (int u = 0; u < 8; u++) top = std::max(top, p[t + u]);
    }
    for (; t <= tb; t++) {
        p[t] = _mm512_reduce_add_ps(key(t)) * scale;
        top = std::max(top, p[t]);
    }
    return top;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// vdot's steps for one query against two keys, D a multiple of 32 (AVX2 has too few registers to hold
// a query of 256, so the two keys share each load of it): each key's four accumulators, then those
// added in pairs, into s0 and s1
inline void two_dots(const float *q, const float *k0, const float *k1, int64_t D, __m256 &s0, __m256 &s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < D; k += 32) {
        __m256 qv = _mm256_loadu_ps(q + k);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + k), a0);
        b0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + k), b0);
        qv = _mm256_loadu_ps(q + k + 8);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + k + 8), a1);
        b1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + k + 8), b1);
        qv = _mm256_loadu_ps(q + k + 16);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + k + 16), a2);
        b2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + k + 16), b2);
        qv = _mm256_loadu_ps(q + k + 24);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + k + 24), a3);
        b3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + k + 24), b3);
    }
    s0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    s1 = _mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3));
}

// vdot's last step: a vector's lanes added one by one
inline float lane_total(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float s = 0.0f;
    for (float lane : lanes) s += lane;
    return s;
}

// The eight vectors' lane sums, each 0 + lane 0 + lane 1 + ... + lane 7 in that order (lane_total's),
// in one vector: the eight transposed, then added one after another.
inline __m256 lane_totals(const __m256 *v) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    // lane l of vector i below: lane i of v[l] (i < 4 from the low halves, 4..7 from the high ones)
    const __m256 lanes[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31),
    };
    __m256 s = _mm256_setzero_ps();
    for (const __m256 &lane : lanes) s = _mm256_add_ps(s, lane);
    return s;
}
#endif

float scores(const float *q, const float *kbase, const int64_t *koff, int64_t ta, int64_t tb, int64_t D, float scale,
             float *p, float top) {
#if defined(__AVX512F__)
    switch (D) {
        case 64: return scores_held<1>(q, kbase, koff, ta, tb, scale, p, top);
        case 128: return scores_held<2>(q, kbase, koff, ta, tb, scale, p, top);
        case 192: return scores_held<3>(q, kbase, koff, ta, tb, scale, p, top);
        case 256: return scores_held<4>(q, kbase, koff, ta, tb, scale, p, top);
        default: break;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // AVX2 has too few registers to hold the query (D = 256 is 32 of them): two keys at a time share
    // each load of it instead. Each key's accumulators, products and sums are vdot's, in its order.
    if (D % 32 == 0) {
        int64_t t = ta;
        // eight keys at a time: their last steps (the lanes added one by one) for the eight at once
        __m256 tops = _mm256_set1_ps(top);
        for (; t + 7 <= tb; t += 8) {
            __m256 sums[8];
            for (int u = 0; u < 8; u += 2)
                two_dots(q, kbase + koff[t + u], kbase + koff[t + u + 1], D, sums[u], sums[u + 1]);
            const __m256 r = _mm256_mul_ps(lane_totals(sums), _mm256_set1_ps(scale));
            _mm256_storeu_ps(p + t, r);
            tops = _mm256_max_ps(r, tops);  // a NaN score leaves the maximum as it was, as std::max does
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, tops);
        for (float lane : lanes) top = std::max(top, lane);
        for (; t + 1 <= tb; t += 2) {
            __m256 s0, s1;
            two_dots(q, kbase + koff[t], kbase + koff[t + 1], D, s0, s1);
            p[t] = lane_total(s0) * scale;
            top = std::max(top, p[t]);
            p[t + 1] = lane_total(s1) * scale;
            top = std::max(top, p[t + 1]);
        }
        if (t == tb) {
            p[t] = vdot<false>(q, kbase + koff[t], D) * scale;
            top = std::max(top, p[t]);
        }
        return top;
    }
#endif
    for (int64_t t = ta; t <= tb; t++) {
        p[t] = vdot<false>(q, kbase + koff[t], D) * scale;
        top = std::max(top, p[t]);
    }
    return top;
}

// Attention of packed rows against a paged cache: q (N, H D) the rows' rotated queries, heads in order;
// k_pool, v_pool (P, S, Hkv, D): P blocks of S positions; tables (Q, W) int64: the blocks holding each
// sequence's positions in order; row_seq, row_pos (N,) int64: each row's sequence and its position there.
// Row r attends to its own sequence's keys at positions [max(0, pos - window + 1), pos] (window 0: all),
// i.e. document(row_seq) & causal with each sequence's own offset (& sliding_window): the ranges the
// mask algebra's lowering gives (attnmask.engine.step). Every (row, head) is computed alone, in the
// same order whatever the other rows, so a row's output does not depend on what it is packed with.
at::Tensor paged_attend(const at::Tensor &q, const at::Tensor &k_pool, const at::Tensor &v_pool,
                        const at::Tensor &tables, const at::Tensor &row_seq, const at::Tensor &row_pos,
                        int64_t window, int64_t heads, double scale) {
    const char *op = "paged_attend";
    check_rows(q, op, "q");
    TORCH_CHECK_VALUE(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), op,
                      ": the key and value pools must be (P, S, Hkv, D) alike; got ", k_pool.sizes(), " and ",
                      v_pool.sizes());
    check_rows(k_pool, op, "k_pool");
    check_rows(v_pool, op, "v_pool");
    const int64_t P = k_pool.size(0), S = k_pool.size(1), Hkv = k_pool.size(2), D = k_pool.size(3);
    const int64_t N = q.dim() == 2 ? q.size(0) : -1, H = heads;
    TORCH_CHECK_VALUE(H > 0 && H % Hkv == 0 && q.dim() == 2 && q.size(1) == H * D, op, ": q has shape ", q.sizes(),
                      "; expected (N, ", H * D, ") for ", H, " heads of ", D, " over ", Hkv, " key/value heads");
    for (const at::Tensor *t : {&tables, &row_seq, &row_pos}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(), op,
                          ": tables, row_seq and row_pos must be contiguous int64 CPU tensors");
    }
    TORCH_CHECK_VALUE(tables.dim() == 2 && row_seq.dim() == 1 && row_pos.dim() == 1 && row_seq.size(0) == N &&
                          row_pos.size(0) == N,
                      op, ": tables (Q, W), row_seq (N,) and row_pos (N,) expected; got ", tables.sizes(), ", ",
                      row_seq.sizes(), " and ", row_pos.sizes(), " for N = ", N);
    const int64_t Q = tables.size(0), W = tables.size(1), G = H / Hkv;
    TORCH_CHECK_VALUE(G <= 64, op, ": ", G, " query heads share a key/value head; at most 64 are supported");
    const int64_t *tab = tables.const_data_ptr<int64_t>(), *seq = row_seq.const_data_ptr<int64_t>();
    const int64_t *pos = row_pos.const_data_ptr<int64_t>();
    int64_t longest = 0;
    for (int64_t r = 0; r < N; r++) {  // every index checked before any is read
        TORCH_CHECK_VALUE(0 <= seq[r] && seq[r] < Q && 0 <= pos[r] && pos[r] < W * S, op, ": row ", r,
                          " is position ", pos[r], " of sequence ", seq[r], "; the tables hold ", Q,
                          " sequences of at most ", W * S, " positions");
        for (int64_t b = 0; b <= pos[r] / S; b++) {
            const int64_t block = tab[seq[r] * W + b];
            TORCH_CHECK_VALUE(0 <= block && block < P, op, ": sequence ", seq[r], " names block ", block,
                              " of a pool of ", P);
        }
        longest = std::max(longest, pos[r] + 1);
    }
    at::Tensor out = at::empty({N, H * D}, q.options());
    const float *qp = q.const_data_ptr<float>(), *kp = k_pool.const_data_ptr<float>();
    const float *vp = v_pool.const_data_ptr<float>();
    float *o = out.mutable_data_ptr<float>();
    // The work comes in units of up to ROW_BLOCK consecutive rows of one sequence and a key/value head
    // (below). Nothing changes how a (row, head) is computed: its scores, weights and sums run over its
    // own keys in the same order, so the bits do not depend on which rows share its unit, nor on how
    // the threads share the work.
    constexpr int64_t ROW_BLOCK = 8;
    std::vector<int64_t> starts;  // the units' first rows; a block ends where the sequence changes
    for (int64_t r = 0; r < N; r++)
        if (starts.empty() || r - starts.back() == ROW_BLOCK || seq[r] != seq[r - 1]) starts.push_back(r);
    const int64_t nblocks = static_cast<int64_t>(starts.size());
    starts.push_back(N);
    const int64_t threads = at::get_num_threads();
    // One unit's state and its three phases, each over a part of the unit's work: the scores of some of
    // its key blocks, the weights of some of its (row, head) pairs, the weighted values over a part of D.
    // However a unit's work is split, each score, weight and output lane is computed by the same
    // operations in the same order.
    struct Unit {
        int64_t block = -1;  // the row block whose keys' places koff holds (the units of one block share them)
        int64_t r0, rows, h0, g, count, first, last, n, lo[ROW_BLOCK], hi[ROW_BLOCK];
        std::vector<float> p;     // pair c's scores, then weights: p[c * n ...], keys first..last
        std::vector<int64_t> koff;  // where key t of the unit's sequence is in the pools, in floats
        float top[ROW_BLOCK * 64], inv[ROW_BLOCK * 64];  // G <= 64 (checked above)
        float *outs[ROW_BLOCK * 64];
    };
    auto prepare = [&](Unit &a, int64_t block, int64_t g) {  // rows starts[block].., key/value head g
        a.r0 = starts[block], a.rows = starts[block + 1] - a.r0, a.g = g, a.h0 = g * G, a.count = a.rows * G;
        for (int64_t i = 0; i < a.rows; i++) {
            a.hi[i] = pos[a.r0 + i];
            a.lo[i] = window > 0 ? std::max<int64_t>(0, a.hi[i] - window + 1) : 0;
        }
        a.first = *std::min_element(a.lo, a.lo + a.rows), a.last = *std::max_element(a.hi, a.hi + a.rows);
        a.n = a.last - a.first + 1;  // the union of the rows' keys
        a.p.resize(a.count * a.n);
        if (a.block == block) return;  // the keys' places: those of the block's previous unit (another head)
        // the keys' places, once a row block (not once a key and pass over the values), block by block
        a.block = block;
        a.koff.resize(a.last + 1);
        const int64_t *blocks = tab + seq[a.r0] * W;
        for (int64_t b = a.first / S; b <= a.last / S; b++) {
            const int64_t t0 = std::max(a.first, b * S), t1 = std::min(a.last, b * S + S - 1);
            for (int64_t t = t0; t <= t1; t++) a.koff[t] = (blocks[b] * S + t - b * S) * Hkv * D;
        }
    };
    // the scores of key blocks [b0, b1), KEY_BLOCK keys at a time for every (row, head) of the unit, so
    // that the keys stay in L1 while each pair's query goes over them; their maxima into tops
    auto score_blocks = [&](Unit &a, int64_t b0, int64_t b1, float *tops) {
        for (int64_t c = 0; c < a.count; c++) tops[c] = -std::numeric_limits<float>::infinity();
        for (int64_t t0 = a.first + b0 * KEY_BLOCK; t0 <= a.last && t0 < a.first + b1 * KEY_BLOCK; t0 += KEY_BLOCK)
            for (int64_t i = 0; i < a.rows; i++) {
                const int64_t ta = std::max(t0, a.lo[i]), tb = std::min({t0 + KEY_BLOCK - 1, a.hi[i], a.last});
                for (int64_t j = 0; ta <= tb && j < G; j++) {
                    const int64_t c = i * G + j;
                    tops[c] = scores(qp + ((a.r0 + i) * H + a.h0 + j) * D, kp + a.g * D, a.koff.data(), ta, tb, D,
                                     static_cast<float>(scale), a.p.data() + c * a.n - a.first, tops[c]);
                }
            }
    };
    // the weights e^(score - top) over each row's own keys, and 1 / their sum, in key order: pairs [c0, c1)
    auto weigh = [&](Unit &a, int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; c++) {
            const int64_t i = c / G, j = c % G, n = a.n;
            float *w = a.p.data() + c * n + a.lo[i] - a.first;  // scores here; zero outside the row's keys
            std::fill(a.p.data() + c * n, w, 0.0f);
            std::fill(w + a.hi[i] - a.lo[i] + 1, a.p.data() + (c + 1) * n, 0.0f);
            by_lanes(w, w, w, a.hi[i] - a.lo[i] + 1, [&](const float *x, const float *, float *e) {
                exp_shifted_lanes(x, a.top[c], e);
            });
            float sum = 0.0f;
            for (int64_t t = 0; t <= a.hi[i] - a.lo[i]; t++) sum += w[t];
            a.inv[c] = 1.0f / sum;
            a.outs[c] = o + ((a.r0 + i) * H + a.h0 + j) * D;
        }
    };
    // the outputs' lanes [d0, d1) (multiples of 16, or all of D)
    auto values = [&](Unit &a, int64_t d0, int64_t d1) {
        float *outs[ROW_BLOCK * 64];
        for (int64_t c = 0; c < a.count; c++) outs[c] = a.outs[c] + d0;
        weighted_values(a.p.data(), a.n, a.n, vp + a.g * D + d0, a.koff.data(), a.first, a.inv, outs, d1 - d0,
                        a.count);
    };
    if (nblocks * Hkv < threads && threads > 1) {
        // Fewer units than threads (batch 1 of a model with one key/value head): the threads share each
        // unit by its key blocks, then its pairs, then D's lanes, so that each key and value is still read
        // from memory once (Gemma 3 at 8k keys: 16 MB a global layer), not once per thread.
        Unit a;
        std::vector<float> tops(threads * ROW_BLOCK * 64);
        for (int64_t u = 0; u < nblocks * Hkv; u++) {
            prepare(a, u / Hkv, u % Hkv);
            const int64_t kblocks = (a.n + KEY_BLOCK - 1) / KEY_BLOCK, parts = std::min(threads, kblocks);
            at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
                for (int64_t t = begin; t < end; t++)
                    score_blocks(a, t * kblocks / parts, (t + 1) * kblocks / parts, tops.data() + t * ROW_BLOCK * 64);
            });
            for (int64_t c = 0; c < a.count; c++) {  // a maximum (NaNs passed over, as std::max does), in any order
                a.top[c] = -std::numeric_limits<float>::infinity();
                for (int64_t t = 0; t < parts; t++) a.top[c] = std::max(a.top[c], tops[t * ROW_BLOCK * 64 + c]);
            }
            at::parallel_for(0, a.count, 1, [&](int64_t begin, int64_t end) { weigh(a, begin, end); });
            const int64_t lanes = D % 16 ? 1 : D / 16;
            at::parallel_for(0, lanes, 1, [&](int64_t begin, int64_t end) {
                values(a, lanes == 1 ? 0 : begin * 16, lanes == 1 ? D : end * 16);
            });
        }
        return out;
    }
    // Otherwise a unit of work is up to ROW_BLOCK consecutive rows of one sequence (a prefill chunk's
    // rows; a decoding step's rows are one a sequence) and the G query heads that share one key/value
    // head, so that each key and value is read once for all of them (a grouped-query model's cache is
    // read once, not G times; a chunk's keys once per block of rows, not once per row).
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, longest * D * G * ROW_BLOCK));
    at::parallel_for(0, nblocks * Hkv, grain, [&](int64_t begin, int64_t end) {
        Unit a;
        for (int64_t u = begin; u < end; u++) {
            prepare(a, u / Hkv, u % Hkv);
            score_blocks(a, 0, (a.n + KEY_BLOCK - 1) / KEY_BLOCK, a.top);
            weigh(a, 0, a.count);
            values(a, 0, D);
        }
    });
    return out;
}

// W (N, K) float32 in the panel layout of rows.h: (P, K, width), P = ceil(N / width).
at::Tensor pack_panels(const at::Tensor &weight) {
    const char *op = "pack_panels";
    check_rows(weight, op, "weight");
    TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight has shape ", weight.sizes(), "; expected (N, K)");
    const int64_t N = weight.size(0), K = weight.size(1), width = attnmask::panel_width();
    at::Tensor panels = at::empty({(N + width - 1) / width, K, width}, weight.options());
    attnmask::pack_panels(weight.const_data_ptr<float>(), N, K, panels.mutable_data_ptr<float>());
    return panels;
}

const float *checked_bias(const std::optional<at::Tensor> &bias, int64_t N, const char *op) {
    if (!bias.has_value()) return nullptr;
    check_rows(*bias, op, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, op, ": bias has shape ", bias->sizes(),
                      "; expected (", N, ",)");
    return bias->const_data_ptr<float>();
}

// x (M, K) W^T + bias for W (N, K) in panels (rows.cpp: each output computed by the same operations
// whatever M and the thread count, so a row's result does not depend on its batch).
at::Tensor linear_panels(const at::Tensor &x, const at::Tensor &panels, const std::optional<at::Tensor> &bias,
                         int64_t N) {
    const char *op = "linear_panels";
    check_rows(x, op, "x");
    check_rows(panels, op, "panels");
    const int64_t width = attnmask::panel_width();
    TORCH_CHECK_VALUE(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == width &&
                          panels.size(1) == x.size(1) && panels.size(0) == (N + width - 1) / width,
                      op, ": x has shape ", x.sizes(), " and panels ", panels.sizes(), " for ", N,
                      " outputs; expected (M, K) and (ceil(N / ", width, "), K, ", width,
                      ") from pack_panels of this build");
    const float *b = checked_bias(bias, N, op);
    at::Tensor out = at::empty({x.size(0), N}, x.options());
    attnmask::panels_matmul(x.const_data_ptr<float>(), x.size(0), panels.const_data_ptr<float>(), N, x.size(1), b,
                            out.mutable_data_ptr<float>());
    return out;
}

// x (M, K) and weight (N, K), float32 CPU contiguous, of one K (x is called `name` in the message).
void check_product(const at::Tensor &x, const at::Tensor &weight, const char *op, const char *name) {
    check_rows(x, op, name);
    check_rows(weight, op, "weight");
    TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op, ": ", name, " has shape ",
                      x.sizes(), " and weight ", weight.sizes(), "; expected (M, K) and (N, K)");
}

// The same product for W (N, K) row-major, packed for the call: the bits of linear_panels.
at::Tensor linear_rows(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const char *op = "linear_rows";
    check_product(x, weight, op, "x");
    const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
    const float *b = checked_bias(bias, N, op);
    at::Tensor out = at::empty({M, N}, x.options());
    attnmask::rows_matmul(x.const_data_ptr<float>(), M, weight.const_data_ptr<float>(), N, K, b,
                          out.mutable_data_ptr<float>());
    return out;
}

// The index of row x's (N > 0) first largest value as PyTorch's max(dim=-1) gives it on the CPU: the first NaN
// where there is one, else the first value equal to the largest (-0.0 == 0.0).
int64_t first_largest_row(const float *x, int64_t N) {
    float top = -std::numeric_limits<float>::infinity();
    bool nan = false;
    int64_t n = 0;
#if defined(__AVX512F__)
    // four maxima side by side (a maximum of values that are not NaN is the same in any order; which zero a
    // tie of zeros keeps does not matter: -0.0 == 0.0 below), NaNs noted apart
    __m512 tops[4];
    for (__m512 &t : tops) t = _mm512_set1_ps(top);
    __mmask16 unordered = 0;
    for (; n + 64 <= N; n += 64)
        for (int j = 0; j < 4; j++) {
            const __m512 v = _mm512_loadu_ps(x + n + 16 * j);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            tops[j] = _mm512_max_ps(tops[j], v);
        }
    for (; n + 16 <= N; n += 16) {
        const __m512 v = _mm512_loadu_ps(x + n);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        tops[0] = _mm512_max_ps(tops[0], v);
    }
    nan = unordered != 0;  // then the top is not used: the first NaN is the answer
    top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3])));
#endif
    for (; n < N; n++) {
        nan |= std::isnan(x[n]);
        top = x[n] > top ? x[n] : top;
    }
    n = 0;
#if defined(__AVX512F__)
    const __m512 want = _mm512_set1_ps(top);  // then the first lane that is the top (or a NaN), 16 at a time
    for (; n + 16 <= N; n += 16) {
        const __m512 v = _mm512_loadu_ps(x + n);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
        if (hit) return n + __builtin_ctz(hit);
    }
#endif
    for (; n < N; n++)
        if (nan ? std::isnan(x[n]) : x[n] == top) return n;
    return 0;  // not reached: some value is the largest
}

// x (M, N) float32 -> (M,) int64: each row's first_largest_row, rows split over the threads.
at::Tensor first_largest(const at::Tensor &x) {
    const char *op = "first_largest";
    check_rows(x, op, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) > 0, op, ": x has shape ", x.sizes(), "; expected (M, N), N > 0");
    const int64_t M = x.size(0), N = x.size(1);
    at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
    const float *p = x.const_data_ptr<float>();
    int64_t *o = out.mutable_data_ptr<int64_t>();
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / N), [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; m++) o[m] = first_largest_row(p + m * N, N);
    });
    return out;
}

// The arg-max over n of each row's x_m . w_n (+ bias_n) as linear_panels computes it (the first of equal
// largest), for W (N, K) float32, from estimates of every output and the exact outputs of a few rows:
//   1. `estimates` (M, N): x_m . s_n for a screen s_n of each row, computed by the caller in float32 in any
//      order (attnmask.ops.decoding.argmax_rows: W in 8-bit blocks, about a quarter of W's bytes);
//   2. how far an estimate can be from the exact output: |x.w - e| <= |x.(w - s)| + (the rounding of both
//      sums) <= (||w_n - s_n|| + 3 gamma (||s_n|| + ||w_n||)) ||x_m|| = bound[n] ||x_m|| (Cauchy-Schwarz;
//      gamma = n u / (1 - n u), u = 2^-24, for n at least the roundings any one product meets); `bound`
//      (N,) float64 is computed once with the screen, rounded up;
//      with a bias, the estimate is e_n + bias_n and the bound grows by the exact output's last rounding,
//      2^-23 (|e_n + bias_n| + B_n) (twice float32's unit roundoff: the margin covers the float64 sums);
//   3. the winner's exact output is at least every output, so its estimate plus its bound reaches the
//      largest estimate minus its bound: only the rows n with e_n + B_n >= max_j (e_j - B_j) can win;
//   4. those rows' exact outputs (exact_outputs: the bits of linear_panels) and their first largest.
// The comparisons run in float64, with a margin over their own rounding. A row of x whose estimates or
// candidates are not all finite, or that leaves more than N / 8 candidates (and more than 64), is
// answered -1: the caller computes that row's logits whole.
// head_argmax's two passes over a row's N estimates e (float32), bound b (float64) and bias (or null), with
// nx = ||x|| (rounded up): the estimate en = e_n (+ bias_n) and reach R_n = b_n nx (+ 2^-23 (|en| + b_n nx)
// with a bias), in float64. `top_of` returns max_n (en - R_n) (the largest of the finite ones; all_finite is
// cleared by a non-finite e_n), `candidates` appends the n with en + R_n >= top. The vector loops compute
// the same float64 values (each operation IEEE's, one at a time) and a maximum is exact in any order.
struct Reach {
    const float *e;
    const double *b;
    const float *bias;
    double nx;
    int64_t N;
    double estimate(int64_t n) const { return bias ? static_cast<double>(e[n]) + bias[n] : e[n]; }
    double reach(int64_t n) const {
        const double B = b[n] * nx;
        return bias ? B + 0x1p-23 * (std::fabs(estimate(n)) + B) : B;
    }
#if defined(__AVX512F__)
    // 8 at a time: the estimates and reaches of n .. n + 7
    void lanes(int64_t n, __m512d &en, __m512d &rn) const {
        en = _mm512_cvtps_pd(_mm256_loadu_ps(e + n));
        const __m512d B = _mm512_mul_pd(_mm512_loadu_pd(b + n), _mm512_set1_pd(nx));
        if (bias) {
            en = _mm512_add_pd(en, _mm512_cvtps_pd(_mm256_loadu_ps(bias + n)));
            rn = _mm512_add_pd(B, _mm512_mul_pd(_mm512_set1_pd(0x1p-23), _mm512_add_pd(_mm512_abs_pd(en), B)));
        } else {
            rn = B;
        }
    }
#endif
    double top_of(bool &all_finite) const {
        double top = -std::numeric_limits<double>::infinity();
        int64_t n = 0;
#if defined(__AVX512F__)
        __m512d tops = _mm512_set1_pd(top);
        const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
        __mmask16 finite = 0xFFFF;
        for (; n + 8 <= N; n += 8) {
            __m512d en, rn;
            lanes(n, en, rn);
            // |e| < inf is false for an infinity and a NaN
            finite &= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_castps256_ps512(_mm256_loadu_ps(e + n))), inf, _CMP_LT_OQ) | 0xFF00;
            tops = _mm512_max_pd(tops, _mm512_sub_pd(en, rn));  // only compared when every e_n is finite
        }
        all_finite &= finite == 0xFFFF;
        top = _mm512_reduce_max_pd(tops);
#endif
        for (; n < N; n++) {
            all_finite &= std::isfinite(e[n]);
            top = std::max(top, estimate(n) - reach(n));
        }
        return top;
    }
    void candidates(double top, std::vector<int64_t> &cand) const {
        int64_t n = 0;
#if defined(__AVX512F__)
        const __m512d t = _mm512_set1_pd(top);
        for (; n + 8 <= N; n += 8) {
            __m512d en, rn;
            lanes(n, en, rn);
            for (__mmask8 m = _mm512_cmp_pd_mask(_mm512_add_pd(en, rn), t, _CMP_GE_OQ); m; m &= m - 1)
                cand.push_back(n + __builtin_ctz(m));
        }
#endif
        for (; n < N; n++)
            if (estimate(n) + reach(n) >= top) cand.push_back(n);
    }
};

// The exact outputs of the candidates n = cand[0 .. c) for one row x (K), as linear_panels computes them: each
// one chain of multiply-adds over k in order from 0, then the bias added (rows.cpp). With AVX-512, 16
// candidates a vector, their weights laid side by side in `lanes` first (the chains are the same, lane by lane).
void exact_outputs(const float *x, const float *w, const int64_t *cand, int64_t c, int64_t K, const float *bias,
                   std::vector<float> &lanes, float *vals) {
    int64_t i = 0;
#if defined(__AVX512F__)
    lanes.resize(static_cast<size_t>(16 * K));
    for (; i < c; i += 16) {
        const int64_t width = std::min<int64_t>(16, c - i);
        for (int64_t j = 0; j < 16; j++)
            for (int64_t k = 0; k < K; k++) lanes[16 * k + j] = j < width ? w[cand[i + j] * K + k] : 0.0f;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(lanes.data() + 16 * k), acc);
        alignas(64) float out[16];
        _mm512_store_ps(out, acc);
        for (int64_t j = 0; j < width; j++) vals[i + j] = bias ? out[j] + bias[cand[i + j]] : out[j];
    }
#endif
    for (; i < c; i++) {
        const float *wn = w + cand[i] * K;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = std::fma(x[k], wn[k], acc);
        vals[i] = bias ? acc + bias[cand[i]] : acc;
    }
}

// A screen's estimates (M, N) float32 (checked with check_rows by the caller) and bound (N,) float64.
void check_screen(const at::Tensor &estimates, const at::Tensor &bound, int64_t M, int64_t N, const char *op) {
    TORCH_CHECK_VALUE(estimates.dim() == 2 && estimates.size(0) == M && estimates.size(1) == N, op,
                      ": estimates has shape ", estimates.sizes(), "; expected (", M, ", ", N, ")");
    TORCH_CHECK_VALUE(bound.scalar_type() == at::kDouble && bound.is_contiguous() && bound.dim() == 1 &&
                          bound.size(0) == N,
                      op, ": bound has shape ", bound.sizes(), " and dtype ", bound.scalar_type(),
                      "; expected float64 (", N, ",)");
}

// The most candidates a screened row may leave before it is computed whole (their exact outputs would cost
// about as much as the row's whole product).
inline int64_t most_candidates(int64_t N) { return std::max<int64_t>(64, N / 8); }

// The candidates' exact outputs' first largest (vals[0 .. c)), or -1 if one is not finite.
inline int64_t finite_first_largest(const float *vals, int64_t c) {
    int64_t best = 0;
    for (int64_t i = 0; i < c; i++) {
        if (!std::isfinite(vals[i])) return -1;
        if (vals[i] > vals[best]) best = i;
    }
    return best;
}

// Each row's screened arg-max (head_argmax's steps 2-4 below), rows split over the threads; exact(x_m,
// candidates, scratch, values) gives the candidates' exact outputs. o[m] = -1 for a row left open.
template <typename Exact>
void screened_rows(const float *x, const float *estimates, const double *b, const float *bias_n, int64_t M, int64_t N,
                   int64_t K, int64_t *o, const Exact &exact) {
    if (M == 0) return;
    TORCH_CHECK_VALUE(N > 0, "head_argmax: the head has no rows");
    const double MARGIN = 1.0 + 1e-6;  // over float64's rounding of the norms and the comparisons
    // each row alone (its candidates' exact outputs run inline inside this loop's threads)
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> cand;
        std::vector<float> scratch, vals;
        for (int64_t m = begin; m < end; m++) {
            const float *xm = x + m * K, *e = estimates + m * N;
            double sq = 0;
            for (int64_t k = 0; k < K; k++) sq += static_cast<double>(xm[k]) * xm[k];
            const double nx = std::sqrt(sq) * MARGIN;
            o[m] = -1;
            if (!std::isfinite(nx)) continue;
            // with a bias: e_n + bias_n, and the exact output's last rounding (the bias added) in the bound
            const Reach r{e, b, bias_n, nx, N};
            bool finite = true;
            const double top = r.top_of(finite);  // max_j (e_j - B_j)
            if (!finite) continue;
            cand.clear();
            r.candidates(top, cand);
            const int64_t c = static_cast<int64_t>(cand.size());
            if (c > most_candidates(N)) continue;
            vals.resize(static_cast<size_t>(c));
            exact(xm, cand, scratch, vals.data());
            const int64_t best = finite_first_largest(vals.data(), c);
            if (best >= 0) o[m] = cand[best];
        }
    });
}

at::Tensor head_argmax(const at::Tensor &h, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                       const at::Tensor &estimates, const at::Tensor &bound) {
    const char *op = "head_argmax";
    check_product(h, weight, op, "h");
    check_rows(estimates, op, "estimates");
    const int64_t M = h.size(0), N = weight.size(0), K = weight.size(1);
    check_screen(estimates, bound, M, N, op);
    at::Tensor out = at::empty({M}, h.options().dtype(at::kLong));
    int64_t *o = out.mutable_data_ptr<int64_t>();
    TORCH_CHECK_VALUE(N > 0 || M == 0, op, ": weight has no rows");
    const float *x = h.const_data_ptr<float>(), *w = weight.const_data_ptr<float>();
    const double *b = bound.const_data_ptr<double>();
    const float *bias_n = checked_bias(bias, N, op);  // added to each estimate, and after each exact chain
    screened_rows(x, estimates.const_data_ptr<float>(), b, bias_n, M, N, K, o,
                  [&](const float *xm, const std::vector<int64_t> &cand, std::vector<float> &lanes, float *vals) {
                      exact_outputs(xm, w, cand.data(), static_cast<int64_t>(cand.size()), K, bias_n, lanes, vals);
                  });
    return out;
}

// The exact outputs of candidates cand (increasing) of one row x (K) for a head in block panels, as
// block_panels_matmul computes them: each candidate's 16-row group of units copied out and multiplied by the
// row alone (a row's bits depend neither on its batch nor on the other groups).
void block_exact_outputs(const uint8_t *p, int layout, int64_t group_bytes, int64_t K, const float *x,
                         const std::vector<int64_t> &cand, std::vector<uint8_t> &copy, std::vector<float> &out,
                         float *vals) {
    std::vector<int64_t> seen;  // the candidates' groups, increasing
    for (int64_t n : cand)
        if (seen.empty() || seen.back() != n / 16) seen.push_back(n / 16);
    const int64_t G = static_cast<int64_t>(seen.size());
    copy.resize(static_cast<size_t>(G * group_bytes));
    for (int64_t i = 0; i < G; i++)
        std::copy(p + seen[i] * group_bytes, p + (seen[i] + 1) * group_bytes, copy.data() + i * group_bytes);
    out.resize(static_cast<size_t>(16 * G));
    if (attnmask_panel_matmul(layout, copy.data(), x, out.data(), 1, 16 * G, K, 1)) throw std::bad_alloc();
    for (size_t j = 0, i = 0; j < cand.size(); j++) {
        while (seen[i] != cand[j] / 16) i++;
        vals[j] = out[16 * i + cand[j] % 16];
    }
}

// Each row's screened arg-max from 8-bit panels in one pass (attnmask_panel_screen_i8, blocks_kernel.c: the panels'
// int8 estimates, each compared with its reach as it is made, never stored; norms, bound, bias and exact_panels
// as it takes them): the winner's exact output is at least every output, so its estimate plus reach reaches the
// largest estimate minus reach, and only the n recorded there can win. exact(x_m, candidates, values) gives their
// exact outputs; o[m] is the first largest, or -1 for a row left open (a NaN or an infinity in the row or an
// estimate, or more than max(64, N / 8) candidates). Rows split over the threads.
template <typename Exact>
void screen_rows(int layout, const uint8_t *p, const float *x, const double *norms, const double *bound,
                 const float *bias, bool exact_panels, int64_t M, int64_t N, int64_t K, int64_t *o, const Exact &exact) {
    const int T = at::get_num_threads();
    // entries a thread and row before the row is left open: a thread's own top can be far below the row's,
    // and until it rises every output is an entry
    const int64_t cap = std::max<int64_t>(1024, N / 64);
    std::vector<double> reach(2 * M), top(T * M);
    std::vector<int64_t> count(T * M);
    const std::unique_ptr<double[]> hi(new double[T * M * cap]);  // not initialized: written before read
    const std::unique_ptr<int64_t[]> cand(new int64_t[T * M * cap]);
    if (attnmask_panel_screen_i8(layout, p, x, norms, bound, bias, exact_panels ? 1 : 0, M, N, K, T, cap, reach.data(),
                                 top.data(), count.data(), cand.get(), hi.get()))
        throw std::bad_alloc();  // -> MemoryError: the rows' copy
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> c;
        std::vector<float> vals;
        for (int64_t m = begin; m < end; m++) {
            o[m] = -1;
            bool open = std::isnan(reach[m]);
            double best = -std::numeric_limits<double>::infinity();
            for (int t = 0; t < T && !open; t++) {
                open = count[t * M + m] < 0;
                best = std::max(best, top[t * M + m]);
            }
            if (open) continue;
            c.clear();
            for (int t = 0; t < T; t++)  // thread t's groups follow thread t - 1's: n increasing
                for (int64_t i = 0; i < count[t * M + m]; i++)
                    if (hi[(t * M + m) * cap + i] >= best) c.push_back(cand[(t * M + m) * cap + i]);
            const int64_t n_cand = static_cast<int64_t>(c.size());
            if (n_cand == 0 || n_cand > most_candidates(N)) continue;
            vals.resize(static_cast<size_t>(n_cand));
            exact(x + m * K, c, vals.data());
            const int64_t win = finite_first_largest(vals.data(), n_cand);
            if (win >= 0) o[m] = c[win];
        }
    });
}

// The 8-bit panels' layout of a unit size, checked: panels (groups, blocks, unit) of N outputs.
int eight_bit_layout(const at::Tensor &panels, int64_t N, const char *op, const char *name) {
    TORCH_CHECK_VALUE(panels.device().is_cpu() && panels.scalar_type() == at::kByte && panels.dim() == 3 &&
                          panels.is_contiguous(),
                      op, ": ", name, " must be contiguous uint8 (groups, blocks, unit) on the CPU, from pack_block_panels");
    const int layout = attnmask_panel_layout(panels.size(2));
    TORCH_CHECK_VALUE((layout == P8 || layout == P8H) && N > 0 && panels.size(0) == (N + 15) / 16, op, ": ", name,
                      " of shape ", panels.sizes(), " are not 8-bit panels (Q8_0, Q5_0) of ", N, " outputs");
    return layout;
}

void check_row_values(const at::Tensor &t, int64_t N, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.is_contiguous() && t.dim() == 1 &&
                          t.size(0) == N,
                      op, ": ", name, " has shape ", t.sizes(), " and dtype ", t.scalar_type(), "; expected float64 (",
                      N, ",) on the CPU");
}

// Each row's first largest output of block_panels_matmul(panels, h, out_features) for a head in 8-bit block panels
// (Q8_0's layouts: Q8_0, Q5_0), without computing every output (attnmask.ops.decoding.block_argmax_rows):
// screen_rows on the panels themselves (norms: the rows' ||w_n||), the candidates' exact outputs as
// block_panels_matmul computes them (block_exact_outputs); the rows left open computed whole, their arg-max
// taken as PyTorch's max takes it.
at::Tensor block_head_argmax(const at::Tensor &h, const at::Tensor &panels, const at::Tensor &norms,
                             int64_t out_features) {
    const char *op = "block_head_argmax";
    check_rows(h, op, "h");
    const int64_t N = out_features;
    const int layout = eight_bit_layout(panels, N, op, "panels");
    const int64_t nblk = panels.size(1), unit = panels.size(2), K = nblk * attnmask_panel_block(layout);
    TORCH_CHECK_VALUE(h.dim() == 2 && h.size(1) == K, op, ": h has shape ", h.sizes(), "; expected (M, ", K, ")");
    check_row_values(norms, N, op, "norms");
    const int64_t M = h.size(0);
    at::Tensor out = at::empty({M}, h.options().dtype(at::kLong));
    if (M == 0) return out;
    const uint8_t *p = panels.const_data_ptr<uint8_t>();
    int64_t *o = out.mutable_data_ptr<int64_t>();
    screen_rows(layout, p, h.const_data_ptr<float>(), norms.const_data_ptr<double>(), nullptr, nullptr, true, M, N, K, o,
                [&](const float *xm, const std::vector<int64_t> &c, float *vals) {
                    thread_local std::vector<uint8_t> copy;
                    thread_local std::vector<float> scratch;
                    block_exact_outputs(p, layout, nblk * unit, K, xm, c, copy, scratch, vals);
                });
    std::vector<int64_t> open_rows;
    for (int64_t m = 0; m < M; m++)
        if (o[m] < 0) open_rows.push_back(m);
    if (!open_rows.empty()) {  // the whole product of those rows, and PyTorch's arg-max of it
        at::Tensor rows = at::empty({static_cast<int64_t>(open_rows.size())}, h.options().dtype(at::kLong));
        std::copy(open_rows.begin(), open_rows.end(), rows.mutable_data_ptr<int64_t>());
        const at::Tensor whole = attnmask::block_panels_matmul(panels, h.index_select(0, rows).contiguous(), N);
        for (size_t i = 0; i < open_rows.size(); i++) o[open_rows[i]] = first_largest_row(whole[i].const_data_ptr<float>(), N);
    }
    return out;
}

// Each row's first largest output of h W^T (+ bias) as linear_panels computes it, for a float32 weight W (N, K)
// with a screen in 8-bit panels (attnmask.ops.decoding.screen: screen, bound, and norms the screen rows' ||s_n||):
// screen_rows on the screen, the candidates' exact outputs from W (exact_outputs); a row left open gets every
// output exactly so, its arg-max taken as PyTorch's max takes it.
at::Tensor screen_argmax(const at::Tensor &h, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                         const at::Tensor &screen, const at::Tensor &bound, const at::Tensor &norms) {
    const char *op = "screen_argmax";
    check_product(h, weight, op, "h");
    const int64_t M = h.size(0), N = weight.size(0), K = weight.size(1);
    const int layout = eight_bit_layout(screen, N, op, "screen");
    TORCH_CHECK_VALUE(screen.size(1) * attnmask_panel_block(layout) == K, op, ": screen of shape ", screen.sizes(),
                      " is not of rows of ", K);
    check_row_values(bound, N, op, "bound");
    check_row_values(norms, N, op, "norms");
    const float *b = checked_bias(bias, N, op), *w = weight.const_data_ptr<float>();
    at::Tensor out = at::empty({M}, h.options().dtype(at::kLong));
    if (M == 0) return out;
    int64_t *o = out.mutable_data_ptr<int64_t>();
    const float *x = h.const_data_ptr<float>();
    auto exact = [&](const float *xm, const std::vector<int64_t> &c, float *vals) {
        thread_local std::vector<float> lanes;
        exact_outputs(xm, w, c.data(), static_cast<int64_t>(c.size()), K, b, lanes, vals);
    };
    screen_rows(layout, screen.const_data_ptr<uint8_t>(), x, norms.const_data_ptr<double>(),
                bound.const_data_ptr<double>(), b, false, M, N, K, o, exact);
    std::vector<int64_t> every;
    std::vector<float> vals;
    for (int64_t m = 0; m < M; m++) {
        if (o[m] >= 0) continue;
        if (every.empty()) {
            every.resize(static_cast<size_t>(N));
            std::iota(every.begin(), every.end(), int64_t{0});
            vals.resize(static_cast<size_t>(N));
        }
        exact(x + m * K, every, vals.data());
        o[m] = first_largest_row(vals.data(), N);
    }
    return out;
}

// One product of packed_step, by kind: DENSE is a float32 weight in panels and its bias (N,) or, for none,
// an empty (N, 0) tensor that gives N, through linear_panels. Q4_1, Q8_0 and Q6_K are a block layer's
// weight in one of the kernel's layouts (Q4_1 the 4-bit one: Q4_1, and Q4_K repacked into it; Q8_0 the
// 8-bit one: Q8_0, Q5_0; Q6_K the 8-bit one with a scale per 16 weights): its panels and an empty (N, 0)
// tensor, through attnmask::block_panels_matmul; INT8 + each of those: the layer's buffers (codes, d, and
// m for the 4-bit layout) with int8 activations, through attnmask::block_matmul (blocks.h: the functions
// the operators run, declared, not looked up). NONE: no product in this slot.
constexpr int64_t NONE = -1, DENSE = 0, Q4_1 = 1, Q8_0 = 2, Q6_K = 3, INT8 = 3;

at::Tensor product(int64_t kind, const at::Tensor *t, const at::Tensor &x) {
    if (kind == DENSE)
        return linear_panels(x, t[0], t[1].dim() == 1 ? std::optional<at::Tensor>(t[1]) : std::nullopt, t[1].size(0));
    if (kind <= Q6_K) return attnmask::block_panels_matmul(t[0], x, t[1].size(0));
    const int64_t layout = kind - INT8;
    const char *name = layout == Q4_1 ? "Q4_1" : layout == Q8_0 ? "Q8_0" : "Q6_K";
    return attnmask::block_matmul(t[0], t[1], layout == Q4_1 ? std::optional<at::Tensor>(t[2]) : std::nullopt, x,
                                  name, x.size(1), true);
}

int64_t product_tensors(int64_t kind) { return kind == NONE ? 0 : kind == Q4_1 + INT8 ? 3 : 2; }

// The slots of a layer's lists: norms (NORMS a layer, then the final norm's), products (PRODUCTS a layer,
// then the head). A missing optional norm is an empty tensor; a missing product has kind NONE: k and v
// when q's slot holds the fused q/k/v product, up when gate's slot holds the fused gate/up product.
enum Norm { SELF_NORM, Q_NORM, K_NORM, POST_SELF_NORM, MLP_NORM, POST_MLP_NORM, NORMS };
enum Product { QKV, K, V, O, GATE_UP, UP, DOWN, PRODUCTS };

// The activation of the gated MLP: act(gate) * up, element by element (so a row's result never depends
// on the other rows), gate and up rows of F floats `gs` and `us` apart: SiLU, a u / (1 + exp(-a)), and
// tanh-GELU (Gemma), both through exp_lanes, GELU_LANES elements at a time (by_lanes). The exponential
// in vectors rather than libm's, one element at a time: measured on Zen 5, SmolLM2's 30 SiLUs of a
// 16-row step took ~1 ms of one thread, all of it serial between the products.
enum class Act { SILU, GELU_TANH };

Act activation_of(c10::string_view name) {
    if (name == "silu") return Act::SILU;
    TORCH_CHECK_VALUE(name == "gelu_tanh", "packed_step: activation '", std::string(name),
                      "' is not one of 'silu', 'gelu_tanh'");
    return Act::GELU_TANH;
}

void gated_rows(Act act, const float *gate, int64_t gs, const float *up, int64_t us, int64_t rows, int64_t F,
                float *out) {
    each_row(rows, 4 * F, [&](int64_t r) {  // an exponential an element: about four of a norm's floats
        const float *g = gate + r * gs, *u = up + r * us;
        float *o = out + r * F;
        if (act == Act::SILU) {
            by_lanes(g, u, o, F, silu_mul_lanes);
        } else {
            by_lanes(g, u, o, F, gelu_mul_lanes);
        }
    });
}

void silu_rows(const float *gate, int64_t gs, const float *up, int64_t us, int64_t rows, int64_t F, float *out) {
    gated_rows(Act::SILU, gate, gs, up, us, rows, F, out);
}

// The checks of packed_step's per-layer lists; returns where each product's tensors start.
std::vector<int64_t> check_layers(const char *op, int64_t L, int64_t C, int64_t D, int64_t R, at::TensorList norms,
                                  at::ArrayRef<double> eps, at::TensorList products, at::IntArrayRef kinds,
                                  at::IntArrayRef layer_rope, at::IntArrayRef layer_group, int64_t G,
                                  at::IntArrayRef windows) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == NORMS * L + 1 && eps.size() == norms.size(), op, ": ",
                      norms.size(), " norm weights and ", eps.size(), " eps for ", L, " layers; expected ",
                      NORMS * L + 1, " of each (", static_cast<int>(NORMS), " a layer, empty where a layer has none, "
                      "then the final norm)");
    for (int64_t i = 0; i < NORMS * L + 1; i++) {
        const int64_t slot = i < NORMS * L ? i % NORMS : SELF_NORM;  // the final norm is required, as self_norm
        const bool optional = slot == Q_NORM || slot == K_NORM || slot == POST_SELF_NORM || slot == POST_MLP_NORM;
        const int64_t want = slot == Q_NORM || slot == K_NORM ? D : C;
        if (optional && norms[i].numel() == 0) continue;
        check_rows(norms[i], op, "a norm weight");
        TORCH_CHECK_VALUE(norms[i].dim() == 1 && norms[i].size(0) == want, op, ": norm ", i, " has shape ",
                          norms[i].sizes(), "; expected (", want, ",)");
    }
    TORCH_CHECK_VALUE(static_cast<int64_t>(kinds.size()) == PRODUCTS * L + 1, op, ": ", kinds.size(),
                      " products for ", L, " layers; expected ", PRODUCTS * L + 1, " (", static_cast<int>(PRODUCTS),
                      " a layer, then the head)");
    std::vector<int64_t> first(kinds.size() + 1, 0);
    for (size_t i = 0; i < kinds.size(); i++) {
        const int64_t slot = i < static_cast<size_t>(PRODUCTS * L) ? static_cast<int64_t>(i) % PRODUCTS : QKV;
        const bool head = i == static_cast<size_t>(PRODUCTS * L);  // none: the step returns the final norm's rows
        const bool optional = slot == K || slot == V || slot == UP || head;
        TORCH_CHECK_VALUE((optional && kinds[i] == NONE) || (DENSE <= kinds[i] && kinds[i] <= Q6_K + INT8), op,
                          ": product kind ", kinds[i], " in slot ", i, " is not one of 0 (float32), 1 (4-bit "
                          "blocks), 2 (8-bit), 3 (8-bit, a scale per 16), 4-6 (those with int8 activations)",
                          optional ? " or -1 (none)" : "");
        first[i + 1] = first[i] + product_tensors(kinds[i]);
    }
    for (int64_t l = 0; l < L; l++) {
        const int64_t *k = kinds.data() + PRODUCTS * l;
        TORCH_CHECK_VALUE((k[K] == NONE) == (k[V] == NONE), op, ": layer ", l,
                          " has one of its k and v products; expected both, or neither (q/k/v fused)");
        TORCH_CHECK_VALUE(0 <= layer_group[l] && layer_group[l] < G, op, ": layer ", l, " is in group ",
                          layer_group[l], " of ", G, " block tables");
        TORCH_CHECK_VALUE(0 <= layer_rope[l] && layer_rope[l] < std::max<int64_t>(R, 1), op, ": layer ", l,
                          " takes rotary table ", layer_rope[l], " of ", R);
        TORCH_CHECK_VALUE(windows[l] >= 0, op, ": layer ", l, " has window ", windows[l], "; expected >= 0");
    }
    TORCH_CHECK_VALUE(first.back() == static_cast<int64_t>(products.size()), op, ": ", products.size(),
                      " product tensors; the kinds name ", first.back());
    return first;
}

// One layer's attention inputs: each row's query heads (q_norm'ed, rotated) returned, (N, H D); its key
// heads (k_norm'ed, rotated) and value heads written into the pools at `slots` (flat block * S + offset of
// each row's position), before the rows attend. q, k, v rows are `qs`, `ks`, `vs` floats apart; qw, kw the
// norms' weights (null: none); c, s the rows' rotary factors (N, D) (null: no rotary).
at::Tensor attention_inputs(const at::Tensor &like, const float *q, int64_t qs, const float *k, int64_t ks,
                            const float *v, int64_t vs, int64_t N, int64_t H, const float *qw, double q_eps,
                            const float *kw, double k_eps, const float *c, const float *s, const at::Tensor &k_pool,
                            const at::Tensor &v_pool, const int64_t *slots) {
    const int64_t Hkv = k_pool.size(2), D = k_pool.size(3), cells = k_pool.size(0) * k_pool.size(1);
    at::Tensor out = at::empty({N, H * D}, like.options());
    float *qp = out.mutable_data_ptr<float>(), *kc = k_pool.mutable_data_ptr<float>();
    float *vc = v_pool.mutable_data_ptr<float>();
    TORCH_CHECK_VALUE(D <= 512, "packed_step: heads of ", D, " features; at most 512 are supported");
    for (int64_t r = 0; r < N; r++)  // every slot checked before any row is written
        TORCH_CHECK_VALUE(0 <= slots[r] && slots[r] < cells, "packed_step: row ", r, " writes slot ", slots[r],
                          " of a pool of ", cells);
    auto head = [&](const float *x, const float *w, double eps, int64_t r, float *y) {
        float normed[512];  // D <= 512 (checked above)
        if (w != nullptr) {  // RMSNorm over the head, as rms_norm computes each row of (N * heads, D)
            norm_row(x, w, normed, D, eps);
            x = normed;
        }
        rotate_row(x, c ? c + r * D : nullptr, s ? s + r * D : nullptr, y, D);
    };
    each_row(N, (H + 2 * Hkv) * D, [&](int64_t r) {  // a row writes its own slots: rows apart, pools apart
        for (int64_t h = 0; h < H; h++) head(q + r * qs + h * D, qw, q_eps, r, qp + (r * H + h) * D);
        for (int64_t g = 0; g < Hkv; g++) {
            head(k + r * ks + g * D, kw, k_eps, r, kc + (slots[r] * Hkv + g) * D);
            const float *x = v + r * vs + g * D;
            float *y = vc + (slots[r] * Hkv + g) * D;
            for (int64_t d = 0; d < D; d++) y[d] = x[d];
        }
    });
    return out;
}

// Each row's flat pool index in a group's block tables (Q, W): tables[seq, pos / S] * S + pos % S.
std::vector<int64_t> slots_of(const at::Tensor &tables, const int64_t *seq, const int64_t *pos, int64_t N,
                              int64_t S) {
    TORCH_CHECK_VALUE(tables.device().is_cpu() && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
                          tables.dim() == 2,
                      "packed_step: block tables must be (Q, W) contiguous int64 CPU tensors; got ", tables.sizes());
    const int64_t Q = tables.size(0), W = tables.size(1);
    const int64_t *tab = tables.const_data_ptr<int64_t>();
    std::vector<int64_t> slots(N);
    for (int64_t r = 0; r < N; r++) {
        TORCH_CHECK_VALUE(0 <= seq[r] && seq[r] < Q && 0 <= pos[r] && pos[r] < W * S, "packed_step: row ", r,
                          " is position ", pos[r], " of sequence ", seq[r], "; the tables hold ", Q,
                          " sequences of at most ", W * S, " positions");
        slots[r] = tab[seq[r] * W + pos[r] / S] * S + pos[r] % S;
    }
    // no two rows write one cache slot: each row's key and value are its own (and the rows are written by
    // several threads at once)
    std::vector<int64_t> order(slots);
    std::sort(order.begin(), order.end());
    const auto twice = std::adjacent_find(order.begin(), order.end());
    TORCH_CHECK_VALUE(twice == order.end(), "packed_step: two rows write cache slot ", twice == order.end() ? 0 : *twice,
                      " (block ", twice == order.end() ? 0 : *twice / S, "); each row needs a slot of its own: a "
                      "sequence's positions once each, and blocks no other sequence writes");
    return slots;
}

// A whole step of a pre-norm RMSNorm decoder over packed rows of several sequences (attnmask.decode.step):
// Llama's layers (SmolLM2), and Gemma 3's, whose optional parts are per layer. The same calls in the same
// order as packed_step_reference makes them from Python; per layer:
//
//   h = rms_norm(x, self_norm)
//   q, k, v = the q/k/v product(s) of h; q, k each head rms_norm'ed (q_norm, k_norm: where given),
//             rotated by the layer's rotary table; k, v written to the rows' slots in the layer's group
//   out = o(paged_attend(q, the layer's pools, its group's tables, its window))
//   x = x + post_self_norm(out) (where given);  h = rms_norm(x, mlp_norm)
//   delta = down(act(gate(h)) * up(h))  (gate and up one product or two; act SiLU or tanh-GELU)
//   x = x + post_mlp_norm(delta) (where given); h = rms_norm(x, the next self_norm or the final norm)
//
// then the head on `logit_rows` only. x (N, C) embedded tokens; cos, signed_sin (R, N, D): R rotary tables
// (empty: no rotary), layer_rope (L,) each layer's; norms: NORMS a layer and the final norm's, eps theirs;
// products: PRODUCTS a layer and the head, their tensors one after another as `kinds` says; k_pools,
// v_pools: one (P, S, Hkv, D) pair per layer (layers of different groups may share a tensor); tables: G
// block tables (Q, W), one per layer group, layer_group (L,) each layer's; windows (L,) each layer's (0:
// none); row_seq, row_pos as paged_attend takes them. Every operation is a row's own (norms, rotary,
// the activation) or computes each row alone in a fixed order (products, paged_attend): a row's result
// does not depend on the rows packed with it. Returns (M, V).
at::Tensor packed_step(const at::Tensor &x0, const at::Tensor &cos, const at::Tensor &signed_sin,
                       at::IntArrayRef layer_rope, at::TensorList norms, at::ArrayRef<double> eps,
                       at::TensorList products, at::IntArrayRef kinds, c10::string_view activation,
                       at::TensorList k_pools, at::TensorList v_pools, at::TensorList tables,
                       at::IntArrayRef layer_group, at::IntArrayRef windows, const at::Tensor &row_seq,
                       const at::Tensor &row_pos, const at::Tensor &logit_rows, int64_t heads, int64_t kv_heads,
                       double scale) {
    const char *op = "packed_step";
    const int64_t L = static_cast<int64_t>(k_pools.size()), G = static_cast<int64_t>(tables.size());
    check_rows(x0, op, "x");
    TORCH_CHECK_VALUE(L > 0 && static_cast<int64_t>(v_pools.size()) == L, op, ": ", L, " key pools and ",
                      v_pools.size(), " value pools; expected one of each per layer");
    TORCH_CHECK_VALUE(static_cast<int64_t>(layer_rope.size()) == L && static_cast<int64_t>(layer_group.size()) == L &&
                          static_cast<int64_t>(windows.size()) == L,
                      op, ": layer_rope, layer_group and windows must name each of the ", L, " layers; got ",
                      layer_rope.size(), ", ", layer_group.size(), " and ", windows.size());
    TORCH_CHECK_VALUE(x0.dim() == 2, op, ": x must be (N, C); got ", x0.sizes());
    const Act act = activation_of(activation);
    const int64_t N = x0.size(0), C = x0.size(1), S = k_pools[0].size(1), D = k_pools[0].size(3);
    const int64_t H = heads, Hkv = kv_heads;
    for (const at::Tensor *t : {&row_seq, &row_pos, &logit_rows}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                          op, ": row_seq, row_pos and logit_rows must be 1-D contiguous int64 CPU tensors");
    }
    TORCH_CHECK_VALUE(row_seq.size(0) == N && row_pos.size(0) == N, op, ": row_seq and row_pos must have the ", N,
                      " rows of x; got ", row_seq.size(0), " and ", row_pos.size(0));
    const int64_t *lr = logit_rows.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.size(0); i++)
        TORCH_CHECK_VALUE(0 <= lr[i] && lr[i] < N, op, ": logit row ", lr[i], " of ", N, " rows");
    const int64_t R = cos.numel() ? cos.size(0) : 0;
    if (R) {
        check_rows(cos, op, "cos");
        check_rows(signed_sin, op, "signed_sin");
        TORCH_CHECK_VALUE(cos.dim() == 3 && cos.size(1) == N && cos.size(2) == D && signed_sin.sizes() == cos.sizes(),
                          op, ": cos and signed_sin must be (R, N, D) = (R, ", N, ", ", D, ") alike; got ", cos.sizes(),
                          " and ", signed_sin.sizes());
    }
    for (int64_t l = 0; l < L; l++) {
        for (const at::Tensor *t : {&k_pools[l], &v_pools[l]}) {
            check_rows(*t, op, "a pool");
            TORCH_CHECK_VALUE(t->dim() == 4 && t->sizes() == k_pools[0].sizes() && t->size(2) == Hkv, op,
                              ": pools must all be (P, S, Hkv, D) = ", k_pools[0].sizes(), " with Hkv = ", Hkv);
        }
    }
    TORCH_CHECK_VALUE(H > 0 && Hkv > 0 && H % Hkv == 0, op, ": ", H, " heads over ", Hkv, " key/value heads");
    const std::vector<int64_t> first =
        check_layers(op, L, C, D, R, norms, eps, products, kinds, layer_rope, layer_group, G, windows);
    auto project = [&](int64_t i, const at::Tensor &h) { return product(kinds[i], products.data() + first[i], h); };
    auto has = [&](int64_t i) { return norms[i].numel() > 0; };
    auto features = [&](const at::Tensor &t, int64_t want, int64_t l, const char *what) {
        TORCH_CHECK_VALUE(t.size(1) == want, op, ": layer ", l, "'s ", what, " product gives ", t.size(1),
                          " features; expected ", want);
    };
    const int64_t *seq = row_seq.const_data_ptr<int64_t>(), *pos = row_pos.const_data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> slots;
    for (int64_t g = 0; g < G; g++) slots.push_back(slots_of(tables[g], seq, pos, N, S));
    const float *cp = R ? cos.const_data_ptr<float>() : nullptr, *sp = R ? signed_sin.const_data_ptr<float>() : nullptr;

    at::Tensor x = x0, h = rms_norm(x0, norms[SELF_NORM], eps[SELF_NORM]);
    for (int64_t l = 0; l < L; l++) {
        const int64_t n = NORMS * l, p = PRODUCTS * l, g = layer_group[l];
        // attention
        const at::Tensor first_product = project(p + QKV, h);
        at::Tensor k_out, v_out;
        const float *qp = first_product.const_data_ptr<float>(), *kp, *vp;
        int64_t qs = first_product.size(1), ks, vs;
        if (kinds[p + K] == NONE) {  // one q/k/v product: each row's q, k and v side by side
            features(first_product, (H + 2 * Hkv) * D, l, "q/k/v");
            kp = qp + H * D, vp = kp + Hkv * D, ks = vs = qs;
        } else {
            features(first_product, H * D, l, "q");
            k_out = project(p + K, h), v_out = project(p + V, h);
            features(k_out, Hkv * D, l, "k");
            features(v_out, Hkv * D, l, "v");
            kp = k_out.const_data_ptr<float>(), vp = v_out.const_data_ptr<float>(), ks = vs = Hkv * D;
        }
        const float *c = R ? cp + layer_rope[l] * N * D : nullptr, *s = R ? sp + layer_rope[l] * N * D : nullptr;
        const at::Tensor q = attention_inputs(
            x0, qp, qs, kp, ks, vp, vs, N, H, has(n + Q_NORM) ? norms[n + Q_NORM].const_data_ptr<float>() : nullptr,
            eps[n + Q_NORM], has(n + K_NORM) ? norms[n + K_NORM].const_data_ptr<float>() : nullptr, eps[n + K_NORM],
            c, s, k_pools[l], v_pools[l], slots[g].data());
        at::Tensor out = project(p + O, paged_attend(q, k_pools[l], v_pools[l], tables[g], row_seq, row_pos,
                                                     windows[l], H, scale));
        features(out, C, l, "output");
        if (has(n + POST_SELF_NORM)) out = rms_norm(out, norms[n + POST_SELF_NORM], eps[n + POST_SELF_NORM]);
        std::tie(x, h) = add_rms_norm(x, out, norms[n + MLP_NORM], eps[n + MLP_NORM]);
        // MLP
        const at::Tensor gate = project(p + GATE_UP, h);
        at::Tensor a;
        if (kinds[p + UP] == NONE) {  // one gate/up product: each row's gate, then its up
            TORCH_CHECK_VALUE(gate.size(1) % 2 == 0, op, ": layer ", l, "'s gate/up product gives ", gate.size(1),
                              " features; expected gate and up alike");
            const int64_t F = gate.size(1) / 2;
            if (act == Act::SILU) {
                a = silu_mul(gate);  // the operator's own call, as the definition makes it
            } else {
                a = at::empty({N, F}, gate.options());
                const float *gp = gate.const_data_ptr<float>();
                gated_rows(act, gp, 2 * F, gp + F, 2 * F, N, F, a.mutable_data_ptr<float>());
            }
        } else {
            const at::Tensor up = project(p + UP, h);
            features(up, gate.size(1), l, "up");
            const int64_t F = gate.size(1);
            a = at::empty({N, F}, gate.options());
            gated_rows(act, gate.const_data_ptr<float>(), F, up.const_data_ptr<float>(), F, N, F,
                       a.mutable_data_ptr<float>());
        }
        at::Tensor delta = project(p + DOWN, a);
        features(delta, C, l, "down");
        if (has(n + POST_MLP_NORM)) delta = rms_norm(delta, norms[n + POST_MLP_NORM], eps[n + POST_MLP_NORM]);
        const int64_t next = n + NORMS;  // the next layer's self_norm, or the final norm
        std::tie(x, h) = add_rms_norm(x, delta, norms[next], eps[next]);
    }
    h = h.index_select(0, logit_rows).contiguous();
    return kinds[PRODUCTS * L] == NONE ? h : project(PRODUCTS * L, h);
}

// The slots of seq2seq_step's lists, per decoder layer: its norms (self-attention, cross-attention, MLP),
// each a (weight, bias) pair of tensors (an empty bias: none), then the final norm's pair (an empty
// weight: none, a post-norm model's); its products (NONE for k and v when QKV holds the fused q/k/v
// product; for GATE in an MLP that is not gated; for UP when GATE holds gate and up in one product), then
// the head.
enum S2sNorm { S2S_SELF, S2S_CROSS, S2S_MLP, S2S_NORMS };
enum S2sProduct { S_QKV, S_K, S_V, S_O, S_CROSS_Q, S_CROSS_O, S_GATE, S_UP, S_DOWN, S2S_PRODUCTS };

// The activation of seq2seq_step's MLP, as ATen's operator computes it (the bits of the step made
// operation by operation from Python).
at::Tensor s2s_act(c10::string_view name, const at::Tensor &t) {
    if (name == "silu") return at::silu(t);
    if (name == "relu") return at::relu(t);
    if (name == "gelu") return at::gelu(t);
    TORCH_CHECK_VALUE(name == "gelu_tanh", "seq2seq_step: activation '", std::string(name),
                      "' is not one of 'silu', 'relu', 'gelu', 'gelu_tanh'");
    return at::gelu(t, "tanh");
}

// A whole step of an encoder-decoder's decoder over packed rows of several sequences: LayerNorm (or
// RMSNorm) before each sublayer (pre) or after its residual (post: the original Transformer, Marian),
// self-attention over the paged cache, attention to each row's source, a plain or gated MLP, then the
// head on `logit_rows` only. The same operators in the same order as the step made operation by
// operation from Python (attnmask.decode.step.packed_forward without a plan) and as seq2seq_step_reference,
// so the same bits; per layer, with sub(x, f) = x + f(norm(x)) (pre) or norm(x + f(x)) (post):
//
//   x = sub(x, self):  q, k, v = the q/k/v product(s); q, k rotated (rotary models); k, v written to the
//                      rows' slots in the layer's group of block tables; o(paged_attend(q, the layer's pools, within its window))
//   x = sub(x, cross): o(paged_attend(q(x), the layer's source keys and values, each row its source
//                      whole) * src_real)
//   x = sub(x, mlp):   down(act(up)), down(act(gate) * up) or down(silu_mul(gate_up))
//
// memory_k, memory_v: (Q, S, Hkv, D) a layer, one block per source, read through memory_tables (Q, 1);
// row_src (N,) each row's source, src_last (N,) its last position; src_real (N, 1) 0 for a row whose
// source is padding alone (none: every source real); cos, signed_sin (N, D): the rows' rotary factors,
// applied to every query and key head (empty: no rotary). The rest as packed_step takes it.
at::Tensor seq2seq_step(const at::Tensor &x0, const at::Tensor &cos, const at::Tensor &signed_sin, at::TensorList norms, at::ArrayRef<double> eps, bool pre, bool rms,
                        at::TensorList products, at::IntArrayRef kinds, c10::string_view activation,
                        at::TensorList k_pools, at::TensorList v_pools, at::TensorList tables,
                        at::IntArrayRef layer_group, at::IntArrayRef windows, at::TensorList memory_k,
                        at::TensorList memory_v, const at::Tensor &memory_tables, const at::Tensor &row_seq,
                        const at::Tensor &row_pos, const at::Tensor &row_src, const at::Tensor &src_last,
                        const std::optional<at::Tensor> &src_real, const at::Tensor &logit_rows, int64_t heads,
                        int64_t kv_heads, double scale) {
    const char *op = "seq2seq_step";
    const int64_t L = static_cast<int64_t>(k_pools.size()), G = static_cast<int64_t>(tables.size());
    check_rows(x0, op, "x");
    TORCH_CHECK_VALUE(x0.dim() == 2, op, ": x must be (N, C); got ", x0.sizes());
    const int64_t N = x0.size(0), C = x0.size(1), H = heads, Hkv = kv_heads;
    TORCH_CHECK_VALUE(L > 0 && static_cast<int64_t>(v_pools.size()) == L &&
                          static_cast<int64_t>(memory_k.size()) == L && static_cast<int64_t>(memory_v.size()) == L,
                      op, ": ", L, " key pools, ", v_pools.size(), " value pools, ", memory_k.size(), " and ",
                      memory_v.size(), " source key and value tensors; expected one of each per layer");
    TORCH_CHECK_VALUE(static_cast<int64_t>(layer_group.size()) == L && static_cast<int64_t>(windows.size()) == L,
                      op, ": layer_group and windows must name each of the ", L, " layers");
    TORCH_CHECK_VALUE(H > 0 && Hkv > 0 && H % Hkv == 0, op, ": ", H, " heads over ", Hkv, " key/value heads");
    TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * (S2S_NORMS * L + 1) &&
                          static_cast<int64_t>(eps.size()) == S2S_NORMS * L + 1,
                      op, ": ", norms.size(), " norm tensors and ", eps.size(), " eps for ", L, " layers; expected ",
                      2 * (S2S_NORMS * L + 1), " and ", S2S_NORMS * L + 1, " (", static_cast<int>(S2S_NORMS),
                      " (weight, bias) pairs a layer, then the final norm's)");
    for (int64_t i = 0; i < S2S_NORMS * L + 1; i++) {
        const at::Tensor &w = norms[2 * i], &b = norms[2 * i + 1];
        if (i == S2S_NORMS * L && w.numel() == 0) continue;  // no final norm
        for (const at::Tensor *t : {&w, &b}) {
            if (t == &b && b.numel() == 0) continue;
            check_rows(*t, op, "a norm weight or bias");
            TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == C, op, ": norm ", i, " has a tensor of shape ", t->sizes(),
                              "; expected (", C, ",)");
        }
    }
    TORCH_CHECK_VALUE(static_cast<int64_t>(kinds.size()) == S2S_PRODUCTS * L + 1, op, ": ", kinds.size(),
                      " products for ", L, " layers; expected ", S2S_PRODUCTS * L + 1, " (",
                      static_cast<int>(S2S_PRODUCTS), " a layer, then the head)");
    std::vector<int64_t> first(kinds.size() + 1, 0);
    for (size_t i = 0; i < kinds.size(); i++) {
        const bool head = i == static_cast<size_t>(S2S_PRODUCTS * L);  // NONE: the final norm's rows are returned
        const int64_t slot = head ? S_QKV : static_cast<int64_t>(i) % S2S_PRODUCTS;
        const bool optional = head || slot == S_K || slot == S_V || slot == S_GATE || slot == S_UP;
        TORCH_CHECK_VALUE((optional && kinds[i] == NONE) || (DENSE <= kinds[i] && kinds[i] <= Q6_K + INT8), op,
                          ": product kind ", kinds[i], " in slot ", i, " is not a product kind of packed_step",
                          optional ? " or -1 (none)" : "");
        first[i + 1] = first[i] + product_tensors(kinds[i]);
    }
    TORCH_CHECK_VALUE(first.back() == static_cast<int64_t>(products.size()), op, ": ", products.size(),
                      " product tensors; the kinds name ", first.back());
    for (int64_t l = 0; l < L; l++) {
        const int64_t *k = kinds.data() + S2S_PRODUCTS * l;
        TORCH_CHECK_VALUE((k[S_K] == NONE) == (k[S_V] == NONE), op, ": layer ", l,
                          " has one of its k and v products; expected both, or neither (q/k/v fused)");
        TORCH_CHECK_VALUE(k[S_GATE] != NONE || k[S_UP] != NONE, op, ": layer ", l, " has no MLP product");
        TORCH_CHECK_VALUE(0 <= layer_group[l] && layer_group[l] < G, op, ": layer ", l, " is in group ",
                          layer_group[l], " of ", G, " block tables");
        TORCH_CHECK_VALUE(windows[l] >= 0, op, ": layer ", l, " has window ", windows[l], "; expected >= 0");
        for (const at::Tensor *t : {&k_pools[l], &v_pools[l]}) {
            check_rows(*t, op, "a pool");
            TORCH_CHECK_VALUE(t->dim() == 4 && t->sizes() == k_pools[0].sizes() && t->size(2) == Hkv, op,
                              ": pools must all be (P, S, Hkv, D) = ", k_pools[0].sizes(), " with Hkv = ", Hkv);
        }
    }
    for (const at::Tensor *t : {&row_seq, &row_pos, &row_src, &src_last, &logit_rows}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                          op, ": row_seq, row_pos, row_src, src_last and logit_rows must be 1-D contiguous int64 CPU "
                          "tensors");
    }
    TORCH_CHECK_VALUE(row_seq.size(0) == N && row_pos.size(0) == N && row_src.size(0) == N && src_last.size(0) == N,
                      op, ": row_seq, row_pos, row_src and src_last must have the ", N, " rows of x");
    const int64_t *lr = logit_rows.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.size(0); i++)
        TORCH_CHECK_VALUE(0 <= lr[i] && lr[i] < N, op, ": logit row ", lr[i], " of ", N, " rows");
    const int64_t S = k_pools[0].size(1), D = k_pools[0].size(3), cells = k_pools[0].size(0) * S;
    const bool rotary = cos.numel() > 0;
    if (rotary) {
        check_rows(cos, op, "cos");
        check_rows(signed_sin, op, "signed_sin");
        TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(0) == N && cos.size(1) == D && signed_sin.sizes() == cos.sizes(),
                          op, ": cos and signed_sin must be (N, D) = (", N, ", ", D, ") alike; got ", cos.sizes(),
                          " and ", signed_sin.sizes());
    }
    const float *cp = rotary ? cos.const_data_ptr<float>() : nullptr;
    const float *sp = rotary ? signed_sin.const_data_ptr<float>() : nullptr;

    auto project = [&](int64_t i, const at::Tensor &h) { return product(kinds[i], products.data() + first[i], h); };
    auto features = [&](const at::Tensor &t, int64_t want, int64_t l, const char *what) {
        TORCH_CHECK_VALUE(t.size(1) == want, op, ": layer ", l, "'s ", what, " product gives ", t.size(1),
                          " features; expected ", want);
    };
    auto norm = [&](int64_t i, const at::Tensor &t) {
        const at::Tensor &w = norms[2 * i], &b = norms[2 * i + 1];
        if (rms) return rms_norm(t.contiguous(), w, eps[i]);
        return at::layer_norm(t, {C}, w, b.numel() ? std::optional<at::Tensor>(b) : std::nullopt, eps[i]);
    };
    // one sublayer with its residual, norm before (pre) or after (post)
    auto sublayer = [&](const at::Tensor &x, int64_t i, auto fn) {
        return pre ? at::add(x, fn(norm(i, x))) : norm(i, at::add(x, fn(x)));
    };
    const int64_t *seq = row_seq.const_data_ptr<int64_t>(), *pos = row_pos.const_data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> slots;
    for (int64_t g = 0; g < G; g++) slots.push_back(slots_of(tables[g], seq, pos, N, S));

    at::Tensor x = x0;
    for (int64_t l = 0; l < L; l++) {
        const int64_t n = S2S_NORMS * l, p = S2S_PRODUCTS * l, g = layer_group[l];
        x = sublayer(x, n + S2S_SELF, [&](const at::Tensor &h) {
            const at::Tensor qkv = project(p + S_QKV, h);
            at::Tensor q, k, v;
            if (kinds[p + S_K] == NONE) {  // one q/k/v product: each row's q, k and v side by side
                features(qkv, (H + 2 * Hkv) * D, l, "q/k/v");
                q = qkv.narrow(1, 0, H * D);
                k = qkv.narrow(1, H * D, Hkv * D), v = qkv.narrow(1, (H + Hkv) * D, Hkv * D);
            } else {
                features(qkv, H * D, l, "q");
                q = qkv, k = project(p + S_K, h), v = project(p + S_V, h);
                features(k, Hkv * D, l, "k");
                features(v, Hkv * D, l, "v");
            }
            // each row's query heads rotated (or copied), its key heads rotated and its value heads copied
            // into its slot, before the rows attend
            at::Tensor qr = at::empty({N, H * D}, x0.options());
            float *qo = qr.mutable_data_ptr<float>();
            float *kc = k_pools[l].mutable_data_ptr<float>(), *vc = v_pools[l].mutable_data_ptr<float>();
            const float *qp = q.const_data_ptr<float>(), *kp = k.const_data_ptr<float>(), *vp = v.const_data_ptr<float>();
            const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), *sl = slots[g].data();
            for (int64_t r = 0; r < N; r++) {
                TORCH_CHECK_VALUE(0 <= sl[r] && sl[r] < cells, op, ": row ", r, " writes slot ", sl[r],
                                  " of a pool of ", cells);
                const float *c = rotary ? cp + r * D : nullptr, *s = rotary ? sp + r * D : nullptr;
                for (int64_t hd = 0; hd < H; hd++) rotate_row(qp + r * qs + hd * D, c, s, qo + (r * H + hd) * D, D);
                for (int64_t hd = 0; hd < Hkv; hd++)
                    rotate_row(kp + r * ks + hd * D, c, s, kc + (sl[r] * Hkv + hd) * D, D);
                std::copy(vp + r * vs, vp + r * vs + Hkv * D, vc + sl[r] * Hkv * D);
            }
            q = qr;
            const at::Tensor out = project(p + S_O, paged_attend(q, k_pools[l], v_pools[l], tables[g], row_seq,
                                                                 row_pos, windows[l], H, scale));
            features(out, C, l, "output");
            return out;
        });
        x = sublayer(x, n + S2S_CROSS, [&](const at::Tensor &h) {
            const at::Tensor q = project(p + S_CROSS_Q, h);
            features(q, H * D, l, "source query");
            at::Tensor out = paged_attend(q, memory_k[l], memory_v[l], memory_tables, row_src, src_last, 0, H, scale);
            if (src_real.has_value()) out = at::mul(out, *src_real);  // a source of padding alone: zeros
            out = project(p + S_CROSS_O, out);
            features(out, C, l, "source output");
            return out;
        });
        x = sublayer(x, n + S2S_MLP, [&](const at::Tensor &h) {
            at::Tensor a;
            if (kinds[p + S_GATE] == NONE) {  // down(act(up))
                a = s2s_act(activation, project(p + S_UP, h));
            } else if (kinds[p + S_UP] == NONE) {  // one gate/up product: each row's gate, then its up
                const at::Tensor both = project(p + S_GATE, h);
                TORCH_CHECK_VALUE(both.size(1) % 2 == 0, op, ": layer ", l, "'s gate/up product gives ",
                                  both.size(1), " features; expected gate and up alike");
                if (activation == "silu") {
                    a = silu_mul(both);
                } else {
                    const int64_t F = both.size(1) / 2;
                    a = at::mul(s2s_act(activation, both.narrow(1, 0, F)), both.narrow(1, F, F));
                }
            } else {
                a = at::mul(s2s_act(activation, project(p + S_GATE, h)), project(p + S_UP, h));
            }
            const at::Tensor out = project(p + S_DOWN, a.contiguous());
            features(out, C, l, "down");
            return out;
        });
    }
    at::Tensor h = x.index_select(0, logit_rows);
    if (norms[2 * S2S_NORMS * L].numel()) h = norm(S2S_NORMS * L, h);
    return kinds[S2S_PRODUCTS * L] == NONE ? h : project(S2S_PRODUCTS * L, h.contiguous());
}

}  // namespace

TORCH_LIBRARY_IMPL(attnmask, CPU, lib) {
    lib.impl("rms_norm", &rms_norm);
    lib.impl("add_rms_norm", &add_rms_norm);
    lib.impl("silu_mul", &silu_mul);
    lib.impl("pack_panels", &pack_panels);
    lib.impl("linear_panels", &linear_panels);
    lib.impl("linear_rows", &linear_rows);
    lib.impl("head_argmax", &head_argmax);
    lib.impl("block_head_argmax", &block_head_argmax);
    lib.impl("first_largest", &first_largest);
    lib.impl("screen_argmax", &screen_argmax);
    lib.impl("paged_attend", &paged_attend);
    lib.impl("packed_step", &packed_step);
    lib.impl("seq2seq_step", &seq2seq_step);
}
