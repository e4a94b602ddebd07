// The decoding step's work between the matrix products, as C++ operators (attnmask.ops.decoding): what a
// step of a pre-norm RMSNorm / rotary / SwiGLU decoder does between its products, for rows of float32 on
// the CPU.
//
//   rms_norm(x, w, eps)               w * x / sqrt(mean(x^2) + eps), row by row
//   add_rms_norm(x, delta, w, eps)    (x + delta, rms_norm(x + delta, w, eps)): a residual and the next norm
//   silu_mul(gate_up)                 silu(gate) * up, gate and up the two halves of each row
//   linear_rows(x, weight, bias)      x W^T (+ b) for a few rows x and a row-major float32 W
//   paged_attend(q, pools, tables, ...) packed rows of several sequences against a paged cache
//   packed_step(x, ...)               all of the above for every layer of a packed step, and its head:
//                                     one call a step instead of ~210 from Python
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
#include <ATen/ops/index_select.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
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
    return s + dot(w + k, x + k, K - k);
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
    for (int64_t r = 0; r < rows; r++) norm_row(xp + r * C, wp, op + r * C, C, eps);
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
    for (int64_t i = 0; i < rows * C; i++) sp[i] = xp[i] + dp[i];
    for (int64_t r = 0; r < rows; r++) norm_row(sp + r * C, wp, op + r * C, C, eps);
    return {sum, out};
}

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
    for (int64_t r = 0; r < rows; r++)
        for (int64_t f = 0; f < F; f++) {
            const float a = g[r * 2 * F + f];
            o[r * F + f] = a / (1.0f + std::exp(-a)) * g[r * 2 * F + F + f];
        }
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
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, longest * D));
    at::parallel_for(0, N * H, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> p(longest);
        for (int64_t i = begin; i < end; i++) {
            const int64_t r = i / H, h = i % H, g = h / G, last = pos[r];
            const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
            const int64_t *blocks = tab + seq[r] * W;
            const float *qh = qp + i * D;
            float top = -std::numeric_limits<float>::infinity();
            for (int64_t t = first; t <= last; t++) {
                const float *kt = kp + ((blocks[t / S] * S + t % S) * Hkv + g) * D;
                p[t - first] = vdot<false>(qh, kt, D) * static_cast<float>(scale);
                top = std::max(top, p[t - first]);
            }
            float *__restrict oh = o + i * D;
            for (int64_t d = 0; d < D; d++) oh[d] = 0.0f;
            float total = 0.0f;
            for (int64_t t = first; t <= last; t++) {
                const float weight = std::exp(p[t - first] - top);
                total += weight;
                const float *__restrict vt = vp + ((blocks[t / S] * S + t % S) * Hkv + g) * D;
                for (int64_t d = 0; d < D; d++) oh[d] += weight * vt[d];
            }
            const float inv = 1.0f / total;
            for (int64_t d = 0; d < D; d++) oh[d] *= inv;
        }
    });
    return out;
}

// x (M, K) W^T + bias for W (N, K) row-major (rows.cpp: each output computed by the same operations
// whatever M and the thread count, so a row's result does not depend on its batch).
at::Tensor linear_rows(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const char *op = "linear_rows";
    check_rows(x, op, "x");
    check_rows(weight, op, "weight");
    TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op, ": x has shape ",
                      x.sizes(), " and weight ", weight.sizes(), "; expected (M, K) and (N, K)");
    const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
    const float *b = nullptr;
    if (bias.has_value()) {
        check_rows(*bias, op, "bias");
        TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, op, ": bias has shape ", bias->sizes(),
                          "; expected (", N, ",)");
        b = bias->const_data_ptr<float>();
    }
    at::Tensor out = at::empty({M, N}, x.options());
    attnmask::rows_matmul(x.const_data_ptr<float>(), M, weight.const_data_ptr<float>(), N, K, b,
                          out.mutable_data_ptr<float>());
    return out;
}

// One product of packed_step: kind 0 is a float32 weight and its bias (an empty tensor for none),
// through linear_rows; kinds 1 and 2 are a block layer's codes, d and m (Q4_1) or codes and d (Q8_0),
// through attnmask::block_matmul (blocks.h: the function the operator runs, declared, not looked up).
constexpr int64_t DENSE = 0, Q4_1 = 1, Q8_0 = 2;

at::Tensor product(int64_t kind, const at::Tensor *t, const at::Tensor &x) {
    if (kind == DENSE) return linear_rows(x, t[0], t[1].numel() ? std::optional<at::Tensor>(t[1]) : std::nullopt);
    const bool q4_1 = kind == Q4_1;
    return attnmask::block_matmul(t[0], t[1], q4_1 ? std::optional<at::Tensor>(t[2]) : std::nullopt, x,
                                  q4_1 ? "Q4_1" : "Q8_0", x.size(1));
}

int64_t product_tensors(int64_t kind) { return kind == Q4_1 ? 3 : 2; }

// packed_step's checks of its operands: 2 L + 1 norms (and eps), 4 L + 1 products of known
// kinds whose tensors add up; returns where each product's tensors start.
std::vector<int64_t> product_offsets(const char *op, int64_t L, at::TensorList norms, at::ArrayRef<double> eps,
                                     at::TensorList products, at::IntArrayRef kinds) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * L + 1 && eps.size() == norms.size(), op, ": ",
                      norms.size(), " norm weights and ", eps.size(), " eps for ", L, " layers; expected ", 2 * L + 1,
                      " of each");
    TORCH_CHECK_VALUE(static_cast<int64_t>(kinds.size()) == 4 * L + 1, op, ": ", kinds.size(), " products for ", L,
                      " layers; expected ", 4 * L + 1);
    std::vector<int64_t> first(kinds.size() + 1, 0);
    for (size_t i = 0; i < kinds.size(); i++) {
        TORCH_CHECK_VALUE(kinds[i] == DENSE || kinds[i] == Q4_1 || kinds[i] == Q8_0, op, ": product kind ", kinds[i],
                          " is not one of 0 (float32), 1 (Q4_1), 2 (Q8_0)");
        first[i + 1] = first[i] + product_tensors(kinds[i]);
    }
    TORCH_CHECK_VALUE(first.back() == static_cast<int64_t>(products.size()), op, ": ", products.size(),
                      " product tensors; the kinds name ", first.back());
    return first;
}

// Packed rows' new queries rotated (returned, (N, H D)) and keys rotated and values copied into the pools
// at `slots` (flat block * S + offset of each row's position), before they attend.
at::Tensor rope_write(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &signed_sin,
                      const at::Tensor &k_pool, const at::Tensor &v_pool, const int64_t *slots, int64_t heads) {
    const int64_t N = qkv.size(0), Hkv = k_pool.size(2), D = k_pool.size(3), H = heads;
    const int64_t row = (H + 2 * Hkv) * D, cells = k_pool.size(0) * k_pool.size(1);
    const bool rotary = cos.numel() > 0;
    at::Tensor q = at::empty({N, H * D}, qkv.options());
    const float *src = qkv.const_data_ptr<float>();
    const float *cp = rotary ? cos.const_data_ptr<float>() : nullptr;
    const float *sp = rotary ? signed_sin.const_data_ptr<float>() : nullptr;
    float *qp = q.mutable_data_ptr<float>(), *kc = k_pool.mutable_data_ptr<float>();
    float *vc = v_pool.mutable_data_ptr<float>();
    for (int64_t r = 0; r < N; r++) {
        TORCH_CHECK_VALUE(0 <= slots[r] && slots[r] < cells, "packed_step: row ", r, " writes slot ", slots[r],
                          " of a pool of ", cells);
        for (int64_t h = 0; h < H + Hkv; h++) {
            const float *x = src + r * row + h * D;
            float *y = h < H ? qp + (r * H + h) * D : kc + (slots[r] * Hkv + (h - H)) * D;
            rotate_row(x, rotary ? cp + r * D : nullptr, rotary ? sp + r * D : nullptr, y, D);
        }
        for (int64_t g = 0; g < Hkv; g++) {
            const float *x = src + r * row + (H + Hkv + g) * D;
            float *y = vc + (slots[r] * Hkv + g) * D;
            for (int64_t d = 0; d < D; d++) y[d] = x[d];
        }
    }
    return q;
}

// A whole step of a pre-norm RMSNorm / rotary / SwiGLU decoder with fused projections over packed rows of
// several sequences (attnmask.decode.step), the same calls in the same order as packed_step_reference
// makes them from Python: per layer the q/k/v product, the rows rotated and written to their slots,
// paged_attend, the output product and a residual + norm, the MLP and a residual + norm; the head applied
// to `logit_rows` only. x (N, C) embedded tokens; cos, signed_sin (N, D) or empty; norms: each layer's two
// norm weights, then the final norm's (2 L + 1), eps theirs; products: per layer q/k/v, o, gate/up, down,
// then the head (4 L + 1), their tensors one after another as `kinds` says; k_pools, v_pools one (P, S, Hkv, D) pair per layer; tables, row_seq,
// row_pos, window as paged_attend takes them; slots (N,) each row's flat pool index. Returns (M, V).
at::Tensor packed_step(const at::Tensor &x0, const at::Tensor &cos, const at::Tensor &signed_sin,
                       at::TensorList norms, at::ArrayRef<double> eps, at::TensorList products, at::IntArrayRef kinds,
                       at::TensorList k_pools, at::TensorList v_pools, const at::Tensor &tables,
                       const at::Tensor &row_seq, const at::Tensor &row_pos, const at::Tensor &slots,
                       const at::Tensor &logit_rows, int64_t window, int64_t heads, int64_t kv_heads, double scale) {
    const char *op = "packed_step";
    const int64_t L = static_cast<int64_t>(k_pools.size());
    check_rows(x0, op, "x");
    TORCH_CHECK_VALUE(L > 0 && static_cast<int64_t>(v_pools.size()) == L, op, ": ", L, " key pools and ",
                      v_pools.size(), " value pools; expected one of each per layer");
    const int64_t N = x0.size(0), D = k_pools[0].size(3);
    for (const at::Tensor *t : {&slots, &logit_rows}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                          op, ": slots and logit_rows must be 1-D contiguous int64 CPU tensors");
    }
    TORCH_CHECK_VALUE(slots.size(0) == N, op, ": ", slots.size(0), " slots for ", N, " rows");
    const int64_t *lr = logit_rows.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.size(0); i++)
        TORCH_CHECK_VALUE(0 <= lr[i] && lr[i] < N, op, ": logit row ", lr[i], " of ", N, " rows");
    if (cos.numel()) {
        check_rows(cos, op, "cos");
        check_rows(signed_sin, op, "signed_sin");
        TORCH_CHECK_VALUE(cos.numel() == N * D && signed_sin.numel() == N * D, op, ": cos and signed_sin must hold (",
                          N, ", ", D, ")");
    }
    for (int64_t l = 0; l < L; l++) {
        for (const at::Tensor *t : {&k_pools[l], &v_pools[l]}) {
            check_rows(*t, op, "a pool");
            TORCH_CHECK_VALUE(t->dim() == 4 && t->sizes() == k_pools[0].sizes() && t->size(2) == kv_heads, op,
                              ": pools must all be (P, S, Hkv, D) = ", k_pools[0].sizes(), " with Hkv = ", kv_heads);
        }
    }
    const std::vector<int64_t> first = product_offsets(op, L, norms, eps, products, kinds);
    auto project = [&](int64_t i, const at::Tensor &h) { return product(kinds[i], products.data() + first[i], h); };
    const int64_t *sl = slots.const_data_ptr<int64_t>();
    at::Tensor x = x0, h = rms_norm(x0, norms[0], eps[0]);
    for (int64_t l = 0; l < L; l++) {
        const at::Tensor qkv = project(4 * l, h);
        TORCH_CHECK_VALUE(qkv.size(1) == (heads + 2 * kv_heads) * D, op, ": layer ", l, "'s q/k/v product gives ",
                          qkv.size(1), " features; expected ", (heads + 2 * kv_heads) * D);
        const at::Tensor q = rope_write(qkv, cos, signed_sin, k_pools[l], v_pools[l], sl, heads);
        const at::Tensor out =
            paged_attend(q, k_pools[l], v_pools[l], tables, row_seq, row_pos, window, heads, scale);
        std::tie(x, h) = add_rms_norm(x, project(4 * l + 1, out), norms[2 * l + 1], eps[2 * l + 1]);
        const at::Tensor delta = project(4 * l + 3, silu_mul(project(4 * l + 2, h)));
        std::tie(x, h) = add_rms_norm(x, delta, norms[2 * l + 2], eps[2 * l + 2]);
    }
    return project(4 * L, h.index_select(0, logit_rows).contiguous());
}

}  // namespace

TORCH_LIBRARY_IMPL(attnmask, CPU, lib) {
    lib.impl("rms_norm", &rms_norm);
    lib.impl("add_rms_norm", &add_rms_norm);
    lib.impl("silu_mul", &silu_mul);
    lib.impl("linear_rows", &linear_rows);
    lib.impl("paged_attend", &paged_attend);
    lib.impl("packed_step", &packed_step);
}
