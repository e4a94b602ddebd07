// What other native code of attnmask may call of rows.cpp: the float32 product of a few rows by a
// row-major weight that decoding.cpp's linear_rows and packed_step run.
#pragma once

#include <cstdint>

namespace attnmask {

// out (M, N) = x (M, K) W^T (+ bias) for W (N, K) row-major, all float32 and contiguous; bias may be
// null. Each output is computed by the same operations in the same order whatever M and the thread
// count: a row's result does not depend on the rows it is multiplied with.
void rows_matmul(const float *x, int64_t M, const float *w, int64_t N, int64_t K, const float *bias, float *out);

}  // namespace attnmask
