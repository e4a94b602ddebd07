// The block-weight operators' CPU implementations (attnmask.ops.blocks): attnmask::block_matmul (and
// block_matmul_i8, its int8-activation arithmetic), attnmask::block_dequantize, attnmask::pack_block_panels
// and attnmask::block_panels_matmul (the float32 product from a weight packed once into panels) over
// blocks_kernel.c, and attnmask::kernel_simd.
//
// The schemas, the shape rules for torch.compile and the PyTorch definitions (what runs on other
// devices, and everywhere when this library is not built) are registered from Python; this file adds
// the CPU implementations, so that a call from Python or from a compiled graph costs the dispatcher's
// ~2 us. The buffer checks are blocks.check_buffers's, word for word: the C kernel reads raw
// pointers, so nothing reaches it that could make it read past an end. Other native code multiplies
// by block weights through blocks.h (a declared dependency), not through the dispatcher.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include "blocks.h"

#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
int attnmask_blocks_simd(void);
void attnmask_q4_1_dequantize(const uint32_t *codes, const float *d, const float *m, float *out, int64_t N, int64_t K,
                              int threads);
void attnmask_q8_0_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads);
void attnmask_q6_k_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads);
void attnmask_pack_block_panels(int layout, const uint32_t *codes, const void *d, const void *m, uint8_t *out,
                                int64_t N, int64_t K, int threads);
int attnmask_q4_1_matmul_i8(const uint32_t *codes, const float *d, const float *m, const float *x, float *y, int64_t M,
                            int64_t N, int64_t K, int threads);
int attnmask_q8_0_matmul_i8(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N,
                            int64_t K, int threads);
int attnmask_q6_k_matmul_i8(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N,
                            int64_t K, int threads);
int attnmask_estimate_fast(void);
int attnmask_panel_estimate_i8(int layout, const uint8_t *panels, const float *x, float *y, double *xerr, int64_t M,
                               int64_t N, int64_t K, int threads);
}

namespace {

constexpr int64_t QK = 32;
constexpr int64_t PANEL_COLS = 16;  // weight rows a panel group (blocks_kernel.c)

std::string py_dtype(c10::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

std::string py_shape(c10::IntArrayRef shape) {
    std::ostringstream out;
    out << "(";
    for (size_t i = 0; i < shape.size(); i++) out << (i ? ", " : "") << shape[i];
    out << (shape.size() == 1 ? ",)" : ")");
    return out.str();
}

void check(const at::Tensor &t, const char *name, c10::ScalarType dtype, std::vector<int64_t> shape,
           const std::string &kind, bool n_known) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "block kernel: ", name, " is on ", t.device().str(),
                      "; the kernel reads CPU memory");
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, "block kernel: ", name, " is ", py_dtype(t.scalar_type()),
                      "; the kernel reads ", py_dtype(dtype));
    TORCH_CHECK_VALUE(n_known && t.sizes() == c10::IntArrayRef(shape), "block kernel: ", name, " has shape ",
                      py_shape(t.sizes()), "; expected ", py_shape(shape), " for ", kind);
    TORCH_CHECK_VALUE(t.is_contiguous(), "block kernel: ", name, " is not contiguous");
}

// The layout each format is repacked into (blocks.LAYOUT): Q4_1 and Q4_K 4-bit codes with d and m per
// 32 weights; Q8_0 and Q5_0 8-bit codes with d per 32; Q6_K 8-bit codes with d per 16.
enum class Layout { four_bit, eight_bit, eight_bit_16 };

struct Format {
    Layout layout;
    int64_t block;  // weights per GGUF block: in_features is a multiple of it
};

Format format_of(const std::string &kind) {
    if (kind == "Q4_1") return {Layout::four_bit, QK};
    if (kind == "Q4_K") return {Layout::four_bit, 256};
    if (kind == "Q8_0" || kind == "Q5_0") return {Layout::eight_bit, QK};
    TORCH_CHECK_VALUE(kind == "Q6_K", "block format '", kind,
                      "' is not supported; expected one of ['Q4_1', 'Q4_K', 'Q5_0', 'Q6_K', 'Q8_0']");
    return {Layout::eight_bit_16, 256};
}

int panel_layout(const std::string &kind) {
    if (kind == "Q4_1") return P4H;
    if (kind == "Q8_0" || kind == "Q5_0") return P8H;
    return format_of(kind).layout == Layout::four_bit ? P4 : P8_16;
}

// The checks shared by both operators; returns n (the weight's rows).
int64_t check_blocks(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                     const std::string &kind, int64_t in_features, Layout layout, int64_t block) {
    const bool four = layout == Layout::four_bit;
    TORCH_CHECK_VALUE(in_features > 0 && in_features % block == 0, "in_features=", in_features,
                      " is not a positive multiple of the block size ", block);
    TORCH_CHECK_VALUE(!four || m.has_value(), kind, " needs the block minimums m; got None");
    TORCH_CHECK_VALUE(four || !m.has_value(), kind, " has no block minimums; got an m tensor");
    const bool n_known = codes.dim() == 2;
    const int64_t n = n_known ? codes.size(0) : -1, blocks = in_features / QK;
    const int64_t nb = four ? blocks + blocks % 2 : blocks;  // the 4-bit layout pads an odd block count
    const int64_t scales = layout == Layout::eight_bit_16 ? 2 * nb : nb;
    check(codes, "codes", at::kByte, {n, four ? nb * 16 : in_features}, kind, n_known);
    check(d, "d", at::kFloat, {n, scales}, kind, n_known);
    if (four) check(*m, "m", at::kFloat, {n, scales}, kind, n_known);
    return n;
}

// half: float16 scales for Q4_1, Q8_0, Q5_0 (the other formats' panels are float32 either way). strict: a
// scale that is not a float16 value is then an error (pack_block_panels: the caller chose the layout,
// and so the shape); otherwise such a weight takes the float32 layout (block_matmul's own packing).
at::Tensor pack_panels(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                       const std::string &kind, int64_t in_features, bool half, bool strict) {
    const Format f = format_of(kind);
    const int64_t n = check_blocks(codes, d, m, kind, in_features, f.layout, f.block);
    int layout = panel_layout(kind);
    if (!half) layout = layout == P4H ? P4 : layout == P8H ? P8 : layout;
    at::Tensor dh = d, mh = m ? *m : at::Tensor();
    if (layout == P4H || layout == P8H) {
        dh = d.to(at::kHalf);
        if (m) mh = m->to(at::kHalf);
        const bool exact = at::equal(dh.to(at::kFloat), d) && (!m || at::equal(mh.to(at::kFloat), *m));
        TORCH_CHECK_VALUE(exact || !strict, "pack_block_panels: a ", kind, " scale is not a float16 value (a GGUF ", kind,
                          " block stores its scales as float16); expected d", m ? " and m" : "",
                          " from attnmask.ops.blocks.repack, or half_scales=False");
        if (!exact) layout = layout == P4H ? P4 : P8, dh = d, mh = m ? *m : at::Tensor();
    }
    const int64_t groups = (n + PANEL_COLS - 1) / PANEL_COLS, blocks = in_features / attnmask_panel_block(layout);
    at::Tensor out = at::empty({groups, blocks, attnmask_panel_unit(layout)}, codes.options());
    attnmask_pack_block_panels(layout, static_cast<const uint32_t *>(codes.const_data_ptr()), dh.const_data_ptr(),
                               m ? mh.const_data_ptr() : nullptr, out.mutable_data_ptr<uint8_t>(), n, in_features,
                               at::get_num_threads());
    return out;
}

}  // namespace

namespace attnmask {

at::Tensor block_matmul(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                        const at::Tensor &x, c10::string_view kind_view, int64_t in_features, bool int8_activations) {
    const std::string kind(kind_view);
    const Format f = format_of(kind);
    const int64_t n = check_blocks(codes, d, m, kind, in_features, f.layout, f.block);
    const bool n_known = n >= 0;
    const int64_t rows = x.dim() == 2 ? x.size(0) : -1;
    check(x, "x", at::kFloat, {rows, in_features}, kind, n_known);
    if (!int8_activations)  // packed for the call: the bits of block_panels_matmul with the weight's panels
        return block_panels_matmul(pack_panels(codes, d, m, kind, in_features, true, false), x, n);
    at::Tensor out = at::empty({rows, n}, x.options());
    const int threads = at::get_num_threads();
    const auto *c = static_cast<const uint32_t *>(codes.const_data_ptr());
    const float *dp = d.const_data_ptr<float>(), *xp = x.const_data_ptr<float>();
    float *yp = out.mutable_data_ptr<float>();
    int status = 0;
    switch (f.layout) {
        case Layout::four_bit:
            status = attnmask_q4_1_matmul_i8(c, dp, m->const_data_ptr<float>(), xp, yp, rows, n, in_features, threads);
            break;
        case Layout::eight_bit: status = attnmask_q8_0_matmul_i8(c, dp, xp, yp, rows, n, in_features, threads); break;
        case Layout::eight_bit_16: status = attnmask_q6_k_matmul_i8(c, dp, xp, yp, rows, n, in_features, threads); break;
    }
    if (status) throw std::bad_alloc();  // -> MemoryError: the kernel's scratch buffer
    return out;
}

at::Tensor pack_block_panels(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                             c10::string_view kind_view, int64_t in_features, bool half_scales) {
    return pack_panels(codes, d, m, std::string(kind_view), in_features, half_scales, true);
}

at::Tensor block_panels_matmul(const at::Tensor &panels, const at::Tensor &x, int64_t out_features) {
    TORCH_CHECK_VALUE(panels.device().is_cpu() && panels.scalar_type() == at::kByte && panels.dim() == 3 &&
                          panels.is_contiguous(),
                      "block_panels_matmul: panels must be contiguous uint8 (groups, blocks, unit) on the CPU, from "
                      "pack_block_panels; got ", py_dtype(panels.scalar_type()), " ", py_shape(panels.sizes()), " on ",
                      panels.device().str());
    const int layout = attnmask_panel_layout(panels.size(2));  // each layout's unit has its own size
    TORCH_CHECK_VALUE(layout >= 0 && out_features > 0 && panels.size(0) == (out_features + PANEL_COLS - 1) / PANEL_COLS,
                      "block_panels_matmul: panels of shape ", py_shape(panels.sizes()), " do not hold ", out_features,
                      " outputs; expected (ceil(out_features / ", PANEL_COLS, "), blocks, 384 | 320 | 576 | 544 | 336)");
    const int64_t K = panels.size(1) * attnmask_panel_block(layout);
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K &&
                          x.is_contiguous(),
                      "block_panels_matmul: x must be contiguous float32 (rows, ", K, ") on the CPU; got ",
                      py_dtype(x.scalar_type()), " ", py_shape(x.sizes()), " on ", x.device().str());
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    if (attnmask_panel_matmul(layout, panels.const_data_ptr<uint8_t>(), x.const_data_ptr<float>(),
                              out.mutable_data_ptr<float>(), x.size(0), out_features, K, at::get_num_threads()))
        throw std::bad_alloc();  // -> MemoryError: the activations' copy
    return out;
}

// Estimates of x (rows, K) W^T for W in 8-bit panels (Q8_0's layout), x rounded to 8 bits per block of 32
// (blocks_kernel.c), and each row's ||x - its rounding|| (float64): the screen of attnmask.ops.decoding.argmax_rows.
std::tuple<at::Tensor, at::Tensor> block_panels_estimate(const at::Tensor &panels, const at::Tensor &x,
                                                         int64_t out_features) {
    const char *op = "block_panels_estimate";
    TORCH_CHECK_VALUE(panels.device().is_cpu() && panels.scalar_type() == at::kByte && panels.dim() == 3 &&
                          panels.is_contiguous(),
                      op, ": panels must be contiguous uint8 (groups, blocks, unit) on the CPU, from "
                      "pack_block_panels; got ", py_dtype(panels.scalar_type()), " ", py_shape(panels.sizes()), " on ",
                      panels.device().str());
    const int layout = attnmask_panel_layout(panels.size(2));
    TORCH_CHECK_VALUE((layout == P8 || layout == P8H) && out_features > 0 &&
                          panels.size(0) == (out_features + PANEL_COLS - 1) / PANEL_COLS,
                      op, ": panels of shape ", py_shape(panels.sizes()), " are not 8-bit panels (Q8_0, Q5_0) of ",
                      out_features, " outputs; expected (ceil(out_features / ", PANEL_COLS, "), blocks, 576 | 544)");
    const int64_t K = panels.size(1) * attnmask_panel_block(layout);
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K &&
                          x.is_contiguous(),
                      op, ": x must be contiguous float32 (rows, ", K, ") on the CPU; got ", py_dtype(x.scalar_type()),
                      " ", py_shape(x.sizes()), " on ", x.device().str());
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    at::Tensor xerr = at::empty({x.size(0)}, x.options().dtype(at::kDouble));
    if (attnmask_panel_estimate_i8(layout, panels.const_data_ptr<uint8_t>(), x.const_data_ptr<float>(),
                                   out.mutable_data_ptr<float>(), xerr.mutable_data_ptr<double>(), x.size(0),
                                   out_features, K, at::get_num_threads()))
        throw std::bad_alloc();  // -> MemoryError: the rows' copy
    return {out, xerr};
}

at::Tensor block_dequantize(const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                            c10::string_view kind_view, int64_t in_features) {
    const std::string kind(kind_view);
    const Format f = format_of(kind);
    const int64_t n = check_blocks(codes, d, m, kind, in_features, f.layout, f.block);
    at::Tensor out = at::empty({n, in_features}, d.options());
    const int threads = at::get_num_threads();
    const auto *c = static_cast<const uint32_t *>(codes.const_data_ptr());
    const float *dp = d.const_data_ptr<float>();
    float *o = out.mutable_data_ptr<float>();
    switch (f.layout) {
        case Layout::four_bit:
            attnmask_q4_1_dequantize(c, dp, m->const_data_ptr<float>(), o, n, in_features, threads);
            break;
        case Layout::eight_bit: attnmask_q8_0_dequantize(c, dp, o, n, in_features, threads); break;
        case Layout::eight_bit_16: attnmask_q6_k_dequantize(c, dp, o, n, in_features, threads); break;
    }
    return out;
}

}  // namespace attnmask

// The vector width blocks_kernel.c was compiled for: 512, 256 (AVX2/FMA) or 0 (portable C).
TORCH_LIBRARY_FRAGMENT(attnmask, lib) {
    lib.def("kernel_simd() -> int", [] { return static_cast<int64_t>(attnmask_blocks_simd()); });
    // whether block_panels_estimate runs its vector loop here (AVX512-VNNI and VBMI), not the portable one
    lib.def("estimate_fast() -> bool", [] { return attnmask_estimate_fast() != 0; });
}

TORCH_LIBRARY_IMPL(attnmask, CPU, lib) {
    lib.impl("block_matmul", [](const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                                const at::Tensor &x, c10::string_view kind, int64_t in_features) {
        return attnmask::block_matmul(codes, d, m, x, kind, in_features, false);
    });
    lib.impl("block_matmul_i8", [](const at::Tensor &codes, const at::Tensor &d, const std::optional<at::Tensor> &m,
                                   const at::Tensor &x, c10::string_view kind, int64_t in_features) {
        return attnmask::block_matmul(codes, d, m, x, kind, in_features, true);
    });
    lib.impl("block_dequantize", &attnmask::block_dequantize);
    lib.impl("pack_block_panels", &attnmask::pack_block_panels);
    lib.impl("block_panels_matmul", &attnmask::block_panels_matmul);
    lib.impl("block_panels_estimate", &attnmask::block_panels_estimate);
}
