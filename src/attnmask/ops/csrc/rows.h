// What other native code of attnmask may call of rows.cpp: the float32 product of rows by a weight packed in
// panels, which decoding.cpp's linear_panels, linear_rows and packed_step run.
#pragma once

#include <cstdint>

namespace attnmask {

// The panel layout of a weight W (N, K): its rows taken panel_width() at a time, each panel storing for
// each k that many weights side by side (zeros past N), panels_size(N, K) floats in all. The width is the
// build's (48 with AVX-512, 16 with AVX2 or none): panels are packed and read by the same library.
int64_t panel_width();
int64_t panels_size(int64_t N, int64_t K);
void pack_panels(const float *w, int64_t N, int64_t K, float *panels);

// out (M, N) = x (M, K) W^T (+ bias) for W in panels, all float32 and contiguous; bias may be null. Each
// output is one chain of fused multiply-adds over k in order, then the bias: the same operations whatever
// M, the thread count or the build, so a row's result does not depend on the rows it is multiplied with.
void panels_matmul(const float *x, int64_t M, const float *panels, int64_t N, int64_t K, const float *bias,
                   float *out);

// The same product for W (N, K) row-major, packed into panels for the call: the same bits.
void rows_matmul(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *out);

}  // namespace attnmask
