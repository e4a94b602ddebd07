// What other native code of attnmask may call of blocks.cpp: the declared dependency of
// decoding.cpp's packed_step on the block-weight products (the same function the operator
// attnmask::block_matmul runs on the CPU, called directly rather than looked up by name).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

// blocks_kernel.c's panels: a layout's unit bytes (and the layout of a unit size) and weights a block, and the float32 product y (M, N) =
// x (M, K) W^T from W's panels (0, or -1 where the activations' copy cannot be allocated).
extern "C" {
int64_t attnmask_panel_unit(int layout);
int attnmask_panel_layout(int64_t unit_bytes);  // the layout of a unit of that size, or -1
int64_t attnmask_panel_block(int layout);
int attnmask_panel_matmul(int layout, const uint8_t *panels, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                          int threads);
// The screen of a head in 8-bit panels in one pass: each thread's top and candidates of every row (blocks_kernel.c).
int attnmask_panel_screen_i8(int layout, const uint8_t *panels, const float *x, const double *norms,
                             const double *bound, const float *bias, int exact_panels, int64_t M, int64_t N, int64_t K,
                             int threads, int64_t cap, double *reach, double *top, int64_t *count, int64_t *cand,
                             double *hi);
}

// The panels' layouts (blocks_kernel.c's enum): 4-bit codes with float32 scales (Q4_K; Q4_1 with scales that are
// not float16 values), 8-bit (Q8_0 and Q5_0 with such scales), 8-bit per 16 (Q6_K), and the 4-bit and 8-bit ones
// with float16 scales (Q4_1; Q8_0 and Q5_0), the GGUF's own halves.
constexpr int P4 = 0, P8 = 1, P8_16 = 2, P4H = 3, P8H = 4;

namespace attnmask {

// x (rows, in_features) float32 @ W^T, W held as GGUF blocks repacked by attnmask.ops.blocks.repack;
// every buffer is checked first (ValueError naming it). kind: "Q4_1", "Q8_0", "Q5_0", "Q4_K" or "Q6_K"
// (attnmask.ops.blocks.BLOCK_BYTES); m is given for the 4-bit layout (Q4_1, Q4_K) only. int8_activations:
// the operator block_matmul_i8's arithmetic (each row of x quantized to 8 bits per block of 32, integer
// dot products) instead of block_matmul's exact float32 one.
at::Tensor block_matmul(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                        const at::Tensor &x, c10::string_view kind, int64_t in_features, bool int8_activations);

// The weight in panels, uint8 (ceil(out / 16), blocks, unit): what block_panels_matmul reads (blocks_kernel.c);
// half_scales: Q4_1's, Q8_0's and Q5_0's scales as float16 (each must be a float16 value).
at::Tensor pack_block_panels(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                             c10::string_view kind, int64_t in_features, bool half_scales);

// x (rows, K) float32 @ W^T for W (out_features, K) in panels: block_matmul's float32 product, the same bits,
// without packing the weight for the call.
at::Tensor block_panels_matmul(const at::Tensor &panels, const at::Tensor &x, int64_t out_features);

// The float32 (out, in_features) weight the blocks hold, d * q (+ m).
at::Tensor block_dequantize(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                            c10::string_view kind, int64_t in_features);

}  // namespace attnmask
