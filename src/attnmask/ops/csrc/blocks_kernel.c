/*
 * y = x W^T with W held in llama.cpp's block formats (attnmask.ops.blocks).
 *
 * The layouts attnmask.ops.blocks.repack moves a GGUF tensor into once, at load time (values
 * unchanged; blocks.LAYOUT says which format takes which), row by row:
 *
 *   4-bit (Q4_1; Q4_K with its sub-block products d * sc and -(dmin * m)): weight j of a block of 32 =
 *         d * q_j + m, q_j in 0..15. Blocks in pairs (a zero block pads an odd count); per pair 8
 *         uint32 lanes, lane i holding in bits 4k..4k+3 (k = 0..7) the code of weight 8k + i of the
 *         pair (weights 0..31 = first block, 32..63 = second); then d[nbp] and m[nbp] as float32
 *         arrays of their own.
 *   8-bit (Q8_0; Q5_0 as q - 16; Q6_K as q - 32, `sub16`): weight j of a block of 32 = d * q_j, q_j in
 *         -128..127, d per block (sub16: d per 16 weights). Per pair of blocks 4 planes of 16 bytes,
 *         plane k holding weights 8k..8k + 7 of the first block, then of the second (an odd last
 *         block: its 32 codes in order); then d[nb] (sub16: d[2 nb]) as float32.
 *
 * What reads them:
 *
 *   - dequantization (the float32 weight, as gguf.dequantize gives it);
 *   - packing into panels (attnmask_pack_block_panels), the layout of the float32-activation product
 *     (attnmask_panel_matmul; the section "Panels" says how): a layer packs its weight once and keeps
 *     the panels, blocks.block_matmul packs for each call. Each block's sum is regrouped, not
 *     approximated (d sum q x + m sum x), x never quantized;
 *   - the `_i8` products (at the end), the opt-in other arithmetic, llama.cpp's: each activation row
 *     quantized to 8 bits per block of 32, integer dot products with the codes as stored, one float
 *     scale product per block. Faster (no conversion of every code to float, a byte multiply-add per
 *     pair of weights), not exact: the activations are rounded.
 *
 * Every product computes each output by the same operations in the same order whatever the rows and
 * threads (OpenMP threads, the libgomp PyTorch has loaded, split W's rows, never a sum).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP: one thread */
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCKS_AVX2 1
#else
#define BLOCKS_AVX2 0
#endif
#if BLOCKS_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
#define BLOCKS_AVX512 1
#else
#define BLOCKS_AVX512 0
#endif
/* vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI): acc + the sums of four unsigned x signed byte products a
 * 32-bit lane, in one instruction. The int8 kernels' integer sums are exact either way (maddubs never
 * saturates on their operands), so the VNNI loops give the same bits as the AVX2 ones. */
#if BLOCKS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BLOCKS_VNNI 1
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif BLOCKS_AVX2 && defined(__AVXVNNI__)
#define BLOCKS_VNNI 1
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define BLOCKS_VNNI 0
#endif

#define QK 32
#define ROWS_PER_TASK 16
#define MAX_R 4 /* int8 activations: activation rows per pass over a weight row */
/* the loops over a pass's rows unrolled before GCC's scalar replacement of the accumulator arrays, so
 * that those stay in registers (AVX2: rolled, they were kept on the stack, a store and a load per
 * multiply-add) */
#define ROWS_UNROLLED _Pragma("GCC unroll 4")

/* the vector width the loops were built for: 512, 256, or 0 (portable C) */
int attnmask_blocks_simd(void) { return BLOCKS_AVX512 ? 512 : BLOCKS_AVX2 ? 256 : 0; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The activations' scratch copy: one buffer per thread, kept from call to call (no allocation per
 * product: a decoding step makes 121 of them) and on a cache line: the AVX-512 loops read it 64 bytes
 * at a time, and a load that straddles two lines costs two. With malloc's 16-byte alignment the speed
 * of a product depended on where the allocator put the copy: measured on Zen 5, one thread, Q4_1 with
 * 4-64 rows, 40 GMAC/s misaligned against 60-62 aligned (same bits). Returns NULL if it cannot grow. */
static void *grow(void **buffer, size_t *held, size_t bytes) {
    if (bytes > *held) {
        const size_t want = (bytes + 63) / 64 * 64; /* whole cache lines */
        void *grown = aligned_alloc(64, want);
        if (!grown) return NULL;
        free(*buffer);
        *buffer = grown, *held = want;
    }
    return *buffer;
}

static float *scratch(size_t floats) {
    static __thread void *buffer = NULL;
    static __thread size_t held = 0;
    return (float *)grow(&buffer, &held, floats * sizeof(float));
}

/* Software prefetch: the loops take ~10 cycles per 64 bytes of codes, too few for the hardware
 * prefetchers alone to bring a weight's streams (codes, d, m) from memory in time. Each step of a
 * loop asks for the codes CODES_AHEAD bytes further on and for the scales as many rows ahead (Q4_1
 * along each row, Q8_0 once a row), into L2 (a hint: it never faults, past an array's end included). Measured on Zen 5, one thread,
 * SmolLM2's 121 products of a token streamed from memory: 5.0-5.5 ms without, 4.3-4.5 ms with (same bits). */
#define CODES_AHEAD 8192
static inline void ahead(const void *p, int64_t bytes) { __builtin_prefetch((const void *)((uintptr_t)p + bytes), 0, 2); }

#if BLOCKS_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* out (N, K) float32 = the dequantized weight of the 4-bit row layout, d * q + m in float32 as gguf.dequantize computes it */
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
/* 8-bit codes: Q8_0 (and Q5_0, repacked as q - 16), scales per 32 weights; Q6_K (q - 32), per 16  */
/* ------------------------------------------------------------------------------------------ */
/* Where the codes of weights 8k..8k + 7 of block b sit in a row of nb blocks: plane8(...) + k * plane_step(...)
 * (blocks in pairs: 64 bytes a pair, plane k at 16 k, the second block 8 bytes on; an odd last block in order).
 * Decoding a plane (8 or 16 codes) is one sign extension, and the codes are converted to float exactly. */
static inline const uint8_t *plane8(const uint32_t *codes, int64_t b, int64_t nb) {
    const uint8_t *row = (const uint8_t *)codes;
    return b < nb / 2 * 2 ? row + (b / 2) * 64 + (b % 2) * 8 : row + b * QK;
}
static inline int64_t plane_step(int64_t b, int64_t nb) { return b < nb / 2 * 2 ? 16 : 8; }

/* out (N, K) float32 = the dequantized weight, d * q with d per `sub` weights (32 or 16) */
static void q8_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads, int sub) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < K; j++) {
            const int64_t b = j / QK, k = (j % QK) / 8, i = j % 8;
            const int8_t *q = (const int8_t *)plane8(codes + n * (K / 4), b, K / QK);
            out[n * K + j] = d[n * (K / sub) + j / sub] * (float)q[k * plane_step(b, K / QK) + i];
        }
}

void attnmask_q8_0_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads) {
    q8_dequantize(codes, d, out, N, K, threads, QK);
}

void attnmask_q6_k_dequantize(const uint32_t *codes, const float *d, float *out, int64_t N, int64_t K, int threads) {
    q8_dequantize(codes, d, out, N, K, threads, 16);
}

/* ------------------------------------------------------------------------------------------ */
/* Panels: the float32-activation products                                                    */
/* ------------------------------------------------------------------------------------------ */
/* A weight in panels (attnmask_pack_block_panels, once per weight; attnmask.ops.blocks.pack_block_panels):
 * its rows in groups of PANEL_COLS, and per group and block one unit of bytes, the group's blocks in order
 * (a row past N: codes and scales zero). In a unit, weight row l of the group is lane l:
 *
 *   4-bit (P4, Q4_K; 384 bytes, a block of 32): 4 vectors of 16 uint32, vector j lane l holding in bits
 *         4i..4i+3 the code of weight 8j + i (0..15); then d[16] and m[16] float32.
 *   4-bit/f16 (P4H, Q4_1; 320 bytes): the same codes; then d[16] and m[16] float16.
 *   8-bit (P8; 576 bytes, a block of 32): 32 rows of 16 int8, row k lane l the code of weight k; then d[16].
 *   8-bit/f16 (P8H, Q8_0 and Q5_0; 544 bytes): the same codes; then d[16] float16.
 *   8-bit/16 (P8_16, Q6_K; 336 bytes, a block of 16): 16 rows of 16 int8; then d[16] float32 and 16 bytes
 *         of padding (each layout's unit has its own size: the product tells the layout by it).
 *
 * Scales in float16 where the format stores them so (Q4_1, Q8_0, Q5_0: the GGUF's own halves, converted
 * exactly): the kernel widens them to float32 as it reads them (vcvtph2ps), the same values, so the
 * same bits as float32 scales, from fewer bytes (Q4_1 one sixth fewer, Q8_0 one eighteenth). A Q4_K or
 * Q6_K scale is a float16 times a 6- or 8-bit integer, not a float16 in general: those stay float32.
 *
 * Output (activation row r, weight row n), the one definition every loop below computes:
 *
 *     acc = 0
 *     for each block b in order:  s = q_0 x_0, then s = fma(q_k, x_k, s) for k = 1.. in order
 *                                 acc = fma(d_b, s, acc)
 *                                 4-bit: acc = fma(m_b, xsum_b, acc)     xsum_b = x_0 + x_1 + ... in order
 *     y = acc
 *
 * with each block's sum regrouped (sum_k (d q_k + m) x_k = d sum_k q_k x_k + m sum_k x_k), x never
 * quantized. A 4-bit code i < 7 of its lane is taken out in place, as the integer q 16^i (lane & 15 << 4i;
 * code 7 is lane >> 28), converted to float exactly and multiplied by x 16^-i, a copy of the activations
 * made once per call: a power-of-two scaling, so every product and sum is the one q x gives.
 *
 * The weight's rows sit in vector lanes, so a block's products are multiply-adds with one activation
 * broadcast, with no sums across lanes: R activation rows x U vectors of lanes a tile (R U <= 8 with
 * AVX-512, 4 with AVX2), each decoded code vector serving R rows, each broadcast U vectors. The tiles,
 * the split of the lanes between threads and the rows' grouping change nothing in any output's
 * operations, so a row's result is the same bits alone, in any batch and with any thread count, and the
 * AVX-512, AVX2 and portable builds (fmaf) give the same bits. Measured on an Intel Xeon (AVX-512), one
 * thread, Q4_1 1536 x 576 in L2, against the per-row loops this replaced (their lanes along K, summed at
 * the end, two scale products a row per 128 weights): 1 row 19 -> 37 GMAC/s, 16 rows 39 -> 76. */
#define PANEL_COLS 16
enum { P4 = 0, P8 = 1, P8_16 = 2, P4H = 3, P8H = 4 };
#define PANEL_LAYOUTS 5
static inline int four_bit(int layout) { return layout == P4 || layout == P4H; }
static inline int half_scales(int layout) { return layout == P4H || layout == P8H; }
static inline int64_t panel_block(int layout) { return layout == P8_16 ? 16 : QK; }
static inline int64_t panel_codes(int layout) { return layout == P8 || layout == P8H ? 512 : 256; }
static inline int64_t scale_bytes(int layout) { return half_scales(layout) ? 2 : 4; } /* a scale's */
static inline int64_t panel_unit(int layout) {
    return panel_codes(layout) + (four_bit(layout) ? 2 : 1) * PANEL_COLS * scale_bytes(layout) + (layout == P8_16 ? 16 : 0);
}
/* float16 bits -> the float32 they are, exactly (the portable loop's reading of a float16 scale) */
static inline float half_value(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const int e = (h >> 10) & 31, mant = h & 1023;
    const float v = e == 0 ? ldexpf((float)mant, -24) : e == 31 ? (mant ? NAN : INFINITY) : ldexpf((float)(mant | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}
static inline float scale_value(int layout, const uint8_t *p) {
    float v;
    if (half_scales(layout)) return half_value(p);
    memcpy(&v, p, sizeof v);
    return v;
}
int64_t attnmask_panel_unit(int layout) { return panel_unit(layout); }
/* the layout whose unit has `bytes` bytes (each has its own size), or -1 */
int attnmask_panel_layout(int64_t bytes) {
    for (int l = 0; l < PANEL_LAYOUTS; l++)
        if (panel_unit(l) == bytes) return l;
    return -1;
}
int64_t attnmask_panel_block(int layout) { return panel_block(layout); }

/* code k (0..block-1) of weight row n from the kernel's row layout (repack), as the integer it is */
static inline int code_of(int layout, const uint32_t *codes, int64_t n, int64_t K, int64_t j) {
    if (four_bit(layout)) {
        const int64_t nbp = ((K / QK) + 1) / 2 * 2, p = j / 64, k = (j % 64) / 8, i = j % 8;
        return (int)((codes[n * nbp * 4 + p * 8 + i] >> (4 * k)) & 15u);
    }
    const int64_t b = j / QK, k = (j % QK) / 8, i = j % 8;
    return ((const int8_t *)plane8(codes + n * (K / 4), b, K / QK))[k * plane_step(b, K / QK) + i];
}

/* the weight (N, K) of the row layout (codes, d, m) -> panels, (ceil(N / 16), K / block, unit) bytes; d and
 * m are float32, or for the float16 layouts their float16 bits (uint16) */
void attnmask_pack_block_panels(int layout, const uint32_t *codes, const void *d, const void *m, uint8_t *out,
                                int64_t N, int64_t K, int threads) {
    const int64_t blk = panel_block(layout), nblk = K / blk, unit = panel_unit(layout), cb = panel_codes(layout);
    const int64_t groups = (N + PANEL_COLS - 1) / PANEL_COLS, row_scales = four_bit(layout) ? ((K / QK) + 1) / 2 * 2 : nblk;
    const int64_t sb = scale_bytes(layout);
    memset(out, 0, (size_t)(groups * nblk * unit));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const int64_t l = n % PANEL_COLS;
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *u = out + ((n / PANEL_COLS) * nblk + b) * unit;
            for (int64_t k = 0; k < blk; k++) {
                const int q = code_of(layout, codes, n, K, b * blk + k);
                if (four_bit(layout))
                    u[64 * (k / 8) + 4 * l + (k % 8) / 2] |= (uint8_t)(q << (4 * (k % 2)));
                else
                    u[PANEL_COLS * k + l] = (uint8_t)(int8_t)q;
            }
            memcpy(u + cb + sb * l, (const uint8_t *)d + (n * row_scales + b) * sb, (size_t)sb);
            if (four_bit(layout))
                memcpy(u + cb + PANEL_COLS * sb + sb * l, (const uint8_t *)m + (n * row_scales + b) * sb, (size_t)sb);
        }
    }
}

/* 4-bit activations: x (one row of K) -> xq (x 16^-i at weights 8j + i, i < 7) and xsum (K / 32 block sums,
 * x_0 + x_1 + ... + x_31 added in that order; eight blocks' sums carried side by side: the same additions,
 * eight independent chains rather than one) */
static void p4_prepare_row(const float *__restrict x, float *__restrict xq, float *__restrict xsum, int64_t K) {
    static const float scale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
    const int64_t nb = K / QK;
    for (int64_t j = 0; j < K; j += 8) /* K is whole blocks */
        for (int i = 0; i < 8; i++) xq[j + i] = x[j + i] * scale[i];
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j = 0; j < QK; j++)
            for (int u = 0; u < 8; u++) s[u] += x[(b + u) * QK + j];
        for (int u = 0; u < 8; u++) xsum[b + u] = s[u];
    }
    for (; b < nb; b++) {
        float s = 0.0f;
        for (int64_t j = b * QK; j < (b + 1) * QK; j++) s += x[j];
        xsum[b] = s;
    }
}


#if BLOCKS_AVX2
#if BLOCKS_AVX512
#define VL 16 /* lanes a vector: one panel group */
#define TILE 8 /* R x U at most: 2 R U accumulators of the 32 registers */
typedef __m512 vf;
typedef __m512i vi;
#define V_ZERO() _mm512_setzero_ps()
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_SET1(p) _mm512_set1_ps(*(p))
#define V_LOADF(p) _mm512_loadu_ps((const float *)(p))
#define V_STOREF(p, v) _mm512_storeu_ps(p, v)
#define V_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define V_PLANE(raw, i) \
    ((i) == 7 ? _mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 28)) \
              : _mm512_cvtepi32_ps(_mm512_and_si512(raw, _mm512_set1_epi32(15 << (4 * (i))))))
#define V_BYTES(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#else
#define VL 8 /* half a panel group */
#define TILE 4 /* of the 16 registers */
typedef __m256 vf;
typedef __m256i vi;
#define V_ZERO() _mm256_setzero_ps()
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_SET1(p) _mm256_broadcast_ss(p)
#define V_LOADF(p) _mm256_loadu_ps((const float *)(p))
#define V_STOREF(p, v) _mm256_storeu_ps(p, v)
#define V_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_PLANE(raw, i) \
    ((i) == 7 ? _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 28)) \
              : _mm256_cvtepi32_ps(_mm256_and_si256(raw, _mm256_set1_epi32(15 << (4 * (i))))))
#define V_BYTES(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#if defined(__F16C__)
#define V_LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else /* without F16C (the build asks for it with AVX2): lane by lane, the same values */
static inline __m256 v_loadh(const uint8_t *p) {
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = half_value(p + 2 * l);
    return _mm256_loadu_ps(v);
}
#define V_LOADH(p) v_loadh((const uint8_t *)(p))
#endif
#endif
#define V_SCALES(layout, p) (half_scales(layout) ? V_LOADH(p) : V_LOADF(p))
#define HALVES (PANEL_COLS / VL) /* vectors a group */

/* R activation rows (x: rows xs floats apart; 4-bit: xq and the block sums `sums`, rows nblk apart)
 * against U vectors of lanes from vector v0 of the panels; out: R rows of TILE * VL floats. R and U are
 * constants at every call, so that the arrays below live in registers. */
static inline __attribute__((always_inline)) void panel_tile(const int layout, const int R, const int U,
                                                             const uint8_t *panels, int64_t v0, int64_t nblk,
                                                             const float *x, int64_t xs, const float *sums,
                                                             float *out) {
    const int64_t blk = panel_block(layout), unit = panel_unit(layout), cb = panel_codes(layout);
    const int64_t gbytes = nblk * unit, next = ((U + HALVES - 1) / HALVES) * gbytes; /* the next tile's groups */
    const uint8_t *base[TILE];
    const int in_out = R * U > TILE; /* the accumulators in `out` (L1) rather than in registers */
    vf acc[TILE], s[2 * TILE];
#pragma GCC unroll 16
    for (int u = 0; u < U; u++) base[u] = panels + ((v0 + u) / HALVES) * gbytes;
#pragma GCC unroll 16
    for (int t = 0; t < R * U; t++) {
        if (in_out)
            V_STOREF(out + (t / U) * TILE * VL + (t % U) * VL, V_ZERO());
        else
            acc[t] = V_ZERO();
    }
    for (int64_t b = 0; b < nblk; b++) {
        const float *xb = x + b * blk;
#pragma GCC unroll 16
        for (int u = 0; u < U; u++)
            if (HALVES == 1 || (v0 + u) % HALVES == 0 || u == 0)
                for (int64_t line = 0; line < unit; line += 64) ahead(base[u] + b * unit + line, next);
        if (four_bit(layout)) {
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                vi raw[TILE];
#pragma GCC unroll 16
                for (int u = 0; u < U; u++) raw[u] = V_LOADI(base[u] + b * unit + 64 * j + 4 * VL * ((v0 + u) % HALVES));
#pragma GCC unroll 16
                for (int i = 0; i < 8; i++)
#pragma GCC unroll 16
                    for (int u = 0; u < U; u++) {
                        const vf v = V_PLANE(raw[u], i);
#pragma GCC unroll 16
                        for (int r = 0; r < R; r++) {
                            const vf xv = V_SET1(xb + r * xs + 8 * j + i);
                            s[r * U + u] = (j | i) ? V_FMA(v, xv, s[r * U + u]) : V_MUL(v, xv);
                        }
                    }
            }
        } else {
#pragma GCC unroll 32
            for (int k = 0; k < blk; k++)
#pragma GCC unroll 16
                for (int u = 0; u < U; u++) {
                    const vf v = V_BYTES(base[u] + b * unit + PANEL_COLS * k + VL * ((v0 + u) % HALVES));
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) {
                        const vf xv = V_SET1(xb + r * xs + k);
                        s[r * U + u] = k ? V_FMA(v, xv, s[r * U + u]) : V_MUL(v, xv);
                    }
                }
        }
#pragma GCC unroll 16
        for (int u = 0; u < U; u++) {
            const int64_t sb = scale_bytes(layout);
            const uint8_t *scales = base[u] + b * unit + cb + sb * VL * ((v0 + u) % HALVES);
            const vf dv = V_SCALES(layout, scales);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                float *o = out + r * TILE * VL + u * VL;
                vf a = in_out ? V_LOADF(o) : acc[r * U + u];
                a = V_FMA(dv, s[r * U + u], a);
                if (four_bit(layout)) a = V_FMA(V_SCALES(layout, scales + PANEL_COLS * sb), V_SET1(sums + r * nblk + b), a);
                if (in_out)
                    V_STOREF(o, a);
                else
                    acc[r * U + u] = a;
            }
        }
    }
    if (!in_out)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 16
            for (int u = 0; u < U; u++) V_STOREF(out + r * TILE * VL + u * VL, acc[r * U + u]);
}

/* Each (layout, R, U) tile its own function: inlined into one, the thirty of them left GCC's register
 * allocation spilling the accumulators (measured on an Intel Xeon, one thread, Q4_1 1536 x 576, 16 rows:
 * 44 GMAC/s inlined, 76 apart). */
typedef void (*panel_tile_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, const float *, float *);
#define PANEL_TILE_FN(layout, r, u)                                                                         \
    static __attribute__((noinline)) void panel_tile_##layout##_##r##_##u(                                  \
        const uint8_t *panels, int64_t v0, int64_t nblk, const float *x, int64_t xs, const float *sums,      \
        float *out) {                                                                                        \
        panel_tile(layout, r, u, panels, v0, nblk, x, xs, sums, out);                                        \
    }
#if BLOCKS_AVX512
#define PANEL_TILES(layout)                                                                                   \
    PANEL_TILE_FN(layout, 16, 1) PANEL_TILE_FN(layout, 8, 1) PANEL_TILE_FN(layout, 4, 2) PANEL_TILE_FN(layout, 4, 1)                      \
    PANEL_TILE_FN(layout, 2, 4) PANEL_TILE_FN(layout, 2, 2) PANEL_TILE_FN(layout, 2, 1)                      \
    PANEL_TILE_FN(layout, 1, 8) PANEL_TILE_FN(layout, 1, 4) PANEL_TILE_FN(layout, 1, 2) PANEL_TILE_FN(layout, 1, 1)
#define PANEL_TABLE(layout)                                                                                   \
    {{panel_tile_##layout##_1_1, panel_tile_##layout##_1_2, panel_tile_##layout##_1_4, panel_tile_##layout##_1_8}, \
     {panel_tile_##layout##_2_1, panel_tile_##layout##_2_2, panel_tile_##layout##_2_4, NULL},                \
     {panel_tile_##layout##_4_1, panel_tile_##layout##_4_2, NULL, NULL},                                     \
     {panel_tile_##layout##_8_1, NULL, NULL, NULL},                                                          \
     {panel_tile_##layout##_16_1, NULL, NULL, NULL}}
#else
#define PANEL_TILES(layout)                                                                                   \
    PANEL_TILE_FN(layout, 8, 1) PANEL_TILE_FN(layout, 4, 1) PANEL_TILE_FN(layout, 2, 2) PANEL_TILE_FN(layout, 2, 1)                      \
    PANEL_TILE_FN(layout, 1, 4) PANEL_TILE_FN(layout, 1, 2) PANEL_TILE_FN(layout, 1, 1)
#define PANEL_TABLE(layout)                                                                                   \
    {{panel_tile_##layout##_1_1, panel_tile_##layout##_1_2, panel_tile_##layout##_1_4, NULL},                \
     {panel_tile_##layout##_2_1, panel_tile_##layout##_2_2, NULL, NULL},                                     \
     {panel_tile_##layout##_4_1, NULL, NULL, NULL},                                                          \
     {panel_tile_##layout##_8_1, NULL, NULL, NULL},                                                          \
     {NULL, NULL, NULL, NULL}}
#endif
PANEL_TILES(0)
PANEL_TILES(1)
PANEL_TILES(2)
PANEL_TILES(3)
PANEL_TILES(4)
/* [layout][log2 R][log2 U] */
static const panel_tile_fn PANEL_TILE_TABLE[PANEL_LAYOUTS][5][4] = {PANEL_TABLE(0), PANEL_TABLE(1), PANEL_TABLE(2),
                                                                    PANEL_TABLE(3), PANEL_TABLE(4)};
static inline int log2_small(int v) { return v >= 16 ? 4 : v >= 8 ? 3 : v >= 4 ? 2 : v >= 2 ? 1 : 0; }
/* y's rows m0..m1 at the lanes of vectors v_first..v_end (panel_matmul's tiles: as many rows and vectors a
 * tile as its registers hold). */
static inline __attribute__((always_inline)) void panel_lanes(const int layout, const uint8_t *panels, int64_t nblk,
                                                              const float *xs, const float *sums, float *y, int64_t N,
                                                              int64_t K, int64_t m0, int64_t m1, int64_t v_first,
                                                              int64_t v_end, float *out) {
    for (int64_t c0 = v_first; c0 < v_end; c0 += TILE) {
        const int64_t width = min64(TILE, v_end - c0);
        for (int64_t r0 = m0; r0 < m1;) {
            int R = 2 * TILE;
            while (R > m1 - r0) R /= 2;
            for (int64_t u0 = 0; u0 < width;) {
                int U = R > TILE ? 1 : TILE / R;
                while (U > width - u0) U /= 2;
                PANEL_TILE_TABLE[layout][log2_small(R)][log2_small(U)](panels, c0 + u0, nblk, xs + r0 * K, K,
                                                                        sums ? sums + r0 * nblk : NULL, out);
                for (int r = 0; r < R; r++)
                    for (int64_t c = (c0 + u0) * VL; c < min64((c0 + u0 + U) * VL, N); c++)
                        y[(r0 + r) * N + c] = out[r * TILE * VL + c - (c0 + u0) * VL];
                u0 += U;
            }
            r0 += R;
        }
    }
}
#endif

/* Activation rows a product takes through its lanes before the next: as many as 512 KiB of float32
 * activations hold, so that with a long prompt's chunk they stay in L2 while the weight's lanes pass. */
static inline int64_t panel_row_block(int64_t K) {
    const int64_t fit = (int64_t)(512 * 1024 / sizeof(float)) / K / 16 * 16;
    return fit > 16 ? fit : 16;
}

/* y (M, N) = x (M, K) W^T, W in panels. Returns 0, or -1 if the 4-bit activations' copy cannot be allocated. */
static inline __attribute__((always_inline)) int panel_matmul(const int layout, const uint8_t *panels, const float *x,
                                                              float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blk = panel_block(layout), nblk = K / blk;
    const float *xs = x, *sums = NULL;
    float *copy = NULL;
    if (four_bit(layout)) {
        copy = scratch((size_t)(M * (K + nblk)));
        if (!copy) return -1;
        xs = copy, sums = copy + M * K;
    }
    const int64_t groups = (N + PANEL_COLS - 1) / PANEL_COLS;
    int64_t handed = 0; /* the tail's vectors handed out so far (below) */
#pragma omp parallel num_threads(threads) if (threads > 1 && (groups > 1 || M > 64))
    {
        if (four_bit(layout)) { /* the rows' copies shared out, then all of them before any product */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) p4_prepare_row(x + r * K, copy + r * K, copy + M * K + r * nblk, K);
        }
#if BLOCKS_AVX2
        /* Each thread its own contiguous share of the lanes. Where the rows are as many as a tile's and one
         * block of them (a step of many streams: a product bound by the arithmetic), that share is three
         * quarters of the lanes split evenly, and the last quarter is handed out a few vectors at a time as
         * the threads come for it: a virtual machine's cores run at speeds that differ from moment to
         * moment (one measured up to 28% slower than the other, for seconds at a time), and with an even split
         * every such product waited for the slower one; the faster thread now takes the tail, up to a
         * speed ratio of 5 : 3. Which thread computes a vector never changes its outputs. */
        const int64_t vectors = groups * HALVES, T = omp_get_num_threads(), t = omp_get_thread_num();
        float out[2 * TILE * TILE * VL] __attribute__((aligned(64)));
        if (T > 1 && M >= TILE && M <= panel_row_block(K)) {
            const int64_t own = vectors * 3 / 4, grab = max64(1, (vectors - own) / 8);
            panel_lanes(layout, panels, nblk, xs, sums, y, N, K, 0, M, own * t / T, own * (t + 1) / T, out);
            for (int64_t v; (v = own + __atomic_fetch_add(&handed, grab, __ATOMIC_RELAXED)) < vectors;)
                panel_lanes(layout, panels, nblk, xs, sums, y, N, K, 0, M, v, min64(v + grab, vectors), out);
        } else {
            for (int64_t m0 = 0; m0 < M; m0 += panel_row_block(K))
                panel_lanes(layout, panels, nblk, xs, sums, y, N, K, m0, min64(m0 + panel_row_block(K), M),
                            vectors * t / T, vectors * (t + 1) / T, out);
        }
#else
        (void)handed;
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t n_first = groups * t / T * PANEL_COLS, n_end = min64(groups * (t + 1) / T * PANEL_COLS, N);
        const int64_t unit = panel_unit(layout), cb = panel_codes(layout);
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = n_first; n < n_end; n++) {
                const uint8_t *g = panels + (n / PANEL_COLS) * nblk * unit;
                const int64_t l = n % PANEL_COLS;
                float acc = 0.0f;
                for (int64_t b = 0; b < nblk; b++) {
                    const uint8_t *u = g + b * unit;
                    const float *xb = xs + r * K + b * blk;
                    float s = 0.0f;
                    for (int64_t k = 0; k < blk; k++) {
                        float q;
                        if (four_bit(layout)) {
                            uint32_t lane;
                            memcpy(&lane, u + 64 * (k / 8) + 4 * l, sizeof lane);
                            q = (float)(k % 8 < 7 ? lane & (15u << (4 * (k % 8))) : lane >> 28);
                        } else {
                            q = (float)(int8_t)u[PANEL_COLS * k + l];
                        }
                        s = k ? fmaf(q, xb[k], s) : q * xb[k];
                    }
                    const int64_t sb = scale_bytes(layout);
                    acc = fmaf(scale_value(layout, u + cb + sb * l), s, acc);
                    if (four_bit(layout)) acc = fmaf(scale_value(layout, u + cb + PANEL_COLS * sb + sb * l), sums[r * nblk + b], acc);
                }
                y[r * N + n] = acc;
            }
#endif
    }
    return 0;
}

int attnmask_panel_matmul(int layout, const uint8_t *panels, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                          int threads) {
    switch (layout) {
        case P4: return panel_matmul(P4, panels, x, y, M, N, K, threads);
        case P8: return panel_matmul(P8, panels, x, y, M, N, K, threads);
        case P4H: return panel_matmul(P4H, panels, x, y, M, N, K, threads);
        case P8H: return panel_matmul(P8H, panels, x, y, M, N, K, threads);
        default: return panel_matmul(P8_16, panels, x, y, M, N, K, threads);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* int8 activations (opt-in, llama.cpp's arithmetic): each activation row quantized per block of 32  */
/* ------------------------------------------------------------------------------------------ */
/* A block of 32 activations x_j becomes dx * q_j: dx = max|x_j| / 127, q_j = x_j * (127 / max|x_j|)
 * rounded to the nearest integer (ties to even), |q_j| <= 127 (a block with max|x_j| < 2^-120: q = 0). A
 * weight block's sum is then d * dx * sum_j w_j q_j (+ m * (dx * sum_j q_j) for the 4-bit layout): the
 * product of the dequantized weight with the rounded activations, the integer sums exact. (The m term
 * takes the rounded activations too: with the exact sum of x it would add m * sum_j (x_j - dx q_j),
 * and a Q4_1 block's codes 0..15 are not centred: measured on SmolLM2, twice the logits' error.)
 * Each output is computed by the same operations in the same order whatever the rows, the threads and
 * the loop that computes it, so a row's result does not depend on its batch, bit for bit.
 *
 * 4-bit layout (Q4_1, Q4_K), output (activation row r, weight row n):
 *
 *     acc = 0, macc = 0
 *     for each block b in order:  acc = fma(float(S_b), d_b * dx_b, acc)   S_b: the block's exact integer sum
 *                                 macc = fma(m_b, xs_b, macc)               xs_b = dx_b * sum_j q_j
 *     y = acc + macc
 *
 * The AVX2 loops take eight weight rows at once, one per 32-bit lane, so that the scale products (the
 * float work, one per block) are shared by eight outputs. A lane of the layout holds four bytes of one
 * weight row, so with several activation rows, eight weight rows' vectors are transposed 8 x 8 once
 * (kept per thread for every pass of activation rows) and the four matching activation codes are
 * broadcast to every lane: a block's integer sums for the eight rows come out in eight lanes, with no
 * horizontal sums. With one activation row (decoding one sequence, bound by memory) each weight row
 * is read in order as stored and multiplied lane by lane, and the eight rows' partial sums are added
 * across lanes per block: the same S_b, the same float operations. Weight rows past the last whole
 * eight, and the portable build, compute the definition one output at a time (fmaf): the same bits.
 * Measured on Zen 3 against the per-row loops this replaced (SmolLM2's shapes, C harness, the two
 * alternating): 16 activation rows 1.4-1.8x (one thread, in cache) and 1.5x (two threads, from
 * memory); one row from memory 0.86x (one thread) and 0.92-0.95x (two).
 *
 * 8-bit layout (Q8_0, Q5_0; Q6_K with a scale per 16): per weight row and up to four activation rows,
 * each lane of a block's integer products scaled and accumulated, summed across lanes at the end (an
 * 8 x 8 transposition measured no faster here: the sign trick's three operations per 32 products
 * dominate either way).
 *
 * The activation codes are laid out in the order the weight codes are (one byte each): 4-bit layout,
 * per pair p of blocks, 32 bytes "low" (byte 4i + c: weight 16c + i of the pair) then 32 "high"
 * (16c + 8 + i), with dx and xs one float a block; 8-bit layout, per pair of blocks, planes k = 0..3
 * of 16 bytes (weights 8k..8k + 7 of the first block, then of the second), an odd last block's 32 in
 * order, with the scales kept as 8 lanes per pair (dx of the first block in lanes 0, 1, 4, 5 and of the
 * second in 2, 3, 6, 7: the lanes where the integer sums of those blocks end up). */
static inline float i8_block(const float *x, int8_t *q) {
#if BLOCKS_AVX2 /* the same values: max|x| is exact in any order (NaN skipped: max_ps keeps its second operand),
                   vcvtps2dq rounds to nearest, ties to even, as rintf does */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_setzero_ps();
    for (int j = 0; j < QK; j += 8) a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), a);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = x[j] > amax ? x[j] : -x[j] > amax ? -x[j] : amax;
#endif
    const float inv = amax >= 0x1p-120f ? 127.0f / amax : 0.0f; /* below, 127 / amax could overflow: q = 0 */
#if BLOCKS_AVX2
    const __m256 scale = _mm256_set1_ps(inv);
    for (int j = 0; j < QK; j += 8) { /* |x * inv| <= 127: the packs do not saturate */
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), scale));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + j), _mm_packs_epi16(w, w));
    }
#else
    for (int j = 0; j < QK; j++) q[j] = (int8_t)__builtin_rintf(x[j] * inv);
#endif
    return amax / 127.0f;
}

/* x (M rows of K) -> xq (M rows of `nbp` * 32 codes in the 4-bit layout's order), xd (M rows of nbp
 * block scales dx), xsum (M rows of nbp block sums dx * sum q); nbp = blocks rounded up to pairs (a
 * zero block pads) */
static void i8_prepare4(const float *x, int8_t *xq, float *xd, float *xsum, int64_t M, int64_t K, int64_t nbp) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t p = 0; p < nbp / 2; p++) {
            int8_t q[64] = {0};
            for (int h = 0; h < 2; h++) {
                const int64_t b = 2 * p + h;
                int32_t s = 0;
                float dx = 0.0f;
                if (b < nb) {
                    dx = i8_block(x + r * K + b * QK, q + 32 * h);
                    for (int j = 0; j < QK; j++) s += q[32 * h + j];
                }
                xd[r * nbp + b] = dx;
                xsum[r * nbp + b] = dx * (float)s; /* the sum of the rounded activations, dx * sum q */
            }
            int8_t *to = xq + (r * nbp + 2 * p) * QK;
#if BLOCKS_AVX2 /* bytes 4i..4i + 3 <- q[i], q[16 + i], q[32 + i], q[48 + i] (then the same from q[8 + i]) */
            for (int h = 0; h < 2; h++) {
                const __m128i a = _mm_loadl_epi64((const __m128i *)(q + 8 * h)), b = _mm_loadl_epi64((const __m128i *)(q + 16 + 8 * h));
                const __m128i c = _mm_loadl_epi64((const __m128i *)(q + 32 + 8 * h)), e = _mm_loadl_epi64((const __m128i *)(q + 48 + 8 * h));
                const __m128i ab = _mm_unpacklo_epi8(a, b), ce = _mm_unpacklo_epi8(c, e);
                _mm_storeu_si128((__m128i *)(to + 32 * h), _mm_unpacklo_epi16(ab, ce));
                _mm_storeu_si128((__m128i *)(to + 32 * h + 16), _mm_unpackhi_epi16(ab, ce));
            }
#else
            for (int i = 0; i < 8; i++)
                for (int c = 0; c < 4; c++) {
                    to[4 * i + c] = q[16 * c + i];
                    to[32 + 4 * i + c] = q[16 * c + 8 + i];
                }
#endif
        }
    }
}

/* One output of the 4-bit layout, the definition above taken one block at a time (the vector loops'
 * lanes compute exactly this): `row` a weight row's codes, xq/xd/xsum one activation row's. */
static float i8_one4(const uint8_t *row, const float *d, const float *m, const int8_t *xq, const float *xd,
                     const float *xsum, int64_t nbp) {
    float acc = 0.0f, macc = 0.0f;
    for (int64_t p = 0; p < nbp / 2; p++) {
        const uint8_t *bytes = row + p * 32;
        const int8_t *lo = xq + p * 64, *hi = lo + 32;
        for (int h = 0; h < 2; h++) { /* bytes c = 2h, 2h + 1 of each lane: block 2p + h */
            int32_t s = 0;
            for (int i = 0; i < 8; i++)
                for (int c = 2 * h; c < 2 * h + 2; c++)
                    s += (bytes[4 * i + c] & 15) * lo[4 * i + c] + (bytes[4 * i + c] >> 4) * hi[4 * i + c];
            const int64_t b = 2 * p + h;
            acc = __builtin_fmaf((float)s, d[b] * xd[b], acc);
        }
        macc = __builtin_fmaf(m[2 * p], xsum[2 * p], macc);
        macc = __builtin_fmaf(m[2 * p + 1], xsum[2 * p + 1], macc);
    }
    return acc + macc;
}

#if BLOCKS_AVX2
/* Eight weight rows' transposed codes and scales: a second buffer per thread, as scratch() */
static void *group_scratch(size_t bytes) {
    static __thread void *buffer = NULL;
    static __thread size_t held = 0;
    return grow(&buffer, &held, bytes);
}

/* v[j] lane c <- v[c] lane j (32-bit lanes) */
static inline __attribute__((always_inline)) void transpose8(__m256i v[8]) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    v[0] = _mm256_permute2x128_si256(u0, u4, 0x20), v[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    v[1] = _mm256_permute2x128_si256(u1, u5, 0x20), v[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    v[2] = _mm256_permute2x128_si256(u2, u6, 0x20), v[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    v[3] = _mm256_permute2x128_si256(u3, u7, 0x20), v[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* out[8 j + c] = src[c * stride + j] for j < count: a scale of eight weight rows per vector */
static void gather8(const float *src, int64_t stride, int64_t count, float *out) {
    int64_t j0 = 0;
    for (; j0 + 8 <= count; j0 += 8) {
        __m256i v[8];
        for (int c = 0; c < 8; c++) v[c] = _mm256_castps_si256(_mm256_loadu_ps(src + c * stride + j0));
        transpose8(v);
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(out + 8 * (j0 + j)), v[j]);
    }
    for (; j0 < count; j0++) /* the last few, one vector each */
        _mm256_store_ps(out + 8 * j0, _mm256_setr_ps(src[j0], src[stride + j0], src[2 * stride + j0], src[3 * stride + j0],
                                                     src[4 * stride + j0], src[5 * stride + j0], src[6 * stride + j0],
                                                     src[7 * stride + j0]));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* 4-bit: weight rows n .. n + 7 (codes at `codes`, nbp * 16 bytes a row) -> w: per pair 8 low-nibble
 * vectors then 8 high-nibble ones (vector i, lane c: the four codes of lane i of row n + c) */
static void i8_group4(const uint8_t *codes, int64_t nbp, __m256i *w) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t p = 0; p < nbp / 2; p++) {
        __m256i v[8];
        /* the eight rows' codes are one run of 2 nbp lines: four a pair, in order */
        for (int t = 0; t < 4; t++) ahead(codes + 256 * p + 64 * t, CODES_AHEAD);
        for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(codes + c * nbp * 16 + p * 32));
        transpose8(v);
        for (int i = 0; i < 8; i++) {
            const __m256i lo = _mm256_and_si256(v[i], low), hi = _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low);
#if BLOCKS_VNNI /* one block a lane: bytes c = 0, 1 (block 2p) of lo then of hi; then c = 2, 3 (block 2p + 1) */
            w[16 * p + i] = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
            w[16 * p + 8 + i] = _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xAA);
#else
            w[16 * p + i] = lo;
            w[16 * p + 8 + i] = hi;
#endif
        }
    }
}

#if BLOCKS_VNNI
/* The activation codes in i8_group4's VNNI order: per pair, lane i of the first 32 bytes holds bytes
 * 4i, 4i + 1 of the low 32 then of the high 32 (block 2p's), the next 32 bytes bytes 4i + 2, 4i + 3
 * (block 2p + 1's) */
static void i8_vnni4(const int8_t *xq, int8_t *xe, int64_t pairs) {
    for (int64_t p = 0; p < pairs; p++) {
        const int8_t *lo = xq + 64 * p, *hi = lo + 32;
        int8_t *to = xe + 64 * p;
        for (int i = 0; i < 8; i++) {
            memcpy(to + 4 * i, lo + 4 * i, 2);
            memcpy(to + 4 * i + 2, hi + 4 * i, 2);
            memcpy(to + 32 + 4 * i, lo + 4 * i + 2, 2);
            memcpy(to + 32 + 4 * i + 2, hi + 4 * i + 2, 2);
        }
    }
}
#endif

/* R activation rows against the eight weight rows of w (scales d8, m8: 8 lanes a block) */
static inline __attribute__((always_inline)) void i8_rows4(const __m256i *w, const float *d8, const float *m8,
                                                           const int8_t *xq, const float *xd, const float *xsum,
                                                           float *y, const int R, int64_t N, int64_t nbp) {
    __m256 acc[MAX_R], macc[MAX_R];
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < nbp / 2; p++) {
        const __m256i *wp = w + 16 * p;
        ROWS_UNROLLED
        for (int r = 0; r < R; r++) {
            const int8_t *xp = xq + (r * nbp + 2 * p) * QK;
#if BLOCKS_VNNI /* xq in i8_vnni4's order, w in i8_group4's: a lane's four products are one block's */
            __m256i e0 = dot4(_mm256_setzero_si256(), wp[0], bcast4(xp)), e1 = dot4(_mm256_setzero_si256(), wp[4], bcast4(xp + 16));
            __m256i o0 = dot4(_mm256_setzero_si256(), wp[8], bcast4(xp + 32)), o1 = dot4(_mm256_setzero_si256(), wp[12], bcast4(xp + 48));
            for (int i = 1; i < 4; i++) {
                e0 = dot4(e0, wp[i], bcast4(xp + 4 * i));
                e1 = dot4(e1, wp[4 + i], bcast4(xp + 16 + 4 * i));
                o0 = dot4(o0, wp[8 + i], bcast4(xp + 32 + 4 * i));
                o1 = dot4(o1, wp[12 + i], bcast4(xp + 48 + 4 * i));
            }
            const __m256i s0 = _mm256_add_epi32(e0, e1), s1 = _mm256_add_epi32(o0, o1);
#else
            __m256i lo = _mm256_maddubs_epi16(wp[0], bcast4(xp)), hi = _mm256_maddubs_epi16(wp[8], bcast4(xp + 32));
            for (int i = 1; i < 8; i++) { /* |sum| <= 8 * 2 * 15 * 127 < 2^15 in each 16-bit lane */
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(wp[i], bcast4(xp + 4 * i)));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(wp[8 + i], bcast4(xp + 32 + 4 * i)));
            }
            /* even 16-bit lanes: block 2p, odd: block 2p + 1 */
            const __m256i s0 = _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16),
                                                _mm256_srai_epi32(_mm256_slli_epi32(hi, 16), 16));
            const __m256i s1 = _mm256_add_epi32(_mm256_srai_epi32(lo, 16), _mm256_srai_epi32(hi, 16));
#endif
            const float *dx = xd + r * nbp + 2 * p, *xs = xsum + r * nbp + 2 * p;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(_mm256_loadu_ps(d8 + 16 * p), _mm256_set1_ps(dx[0])), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(_mm256_loadu_ps(d8 + 16 * p + 8), _mm256_set1_ps(dx[1])), acc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + 16 * p), _mm256_set1_ps(xs[0]), macc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + 16 * p + 8), _mm256_set1_ps(xs[1]), macc[r]);
        }
    }
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N, _mm256_add_ps(acc[r], macc[r]));
}

/* One activation row against eight weight rows, the same sums as i8_rows4 with R = 1 (integer sums are
 * exact, so their order is free; the float operations are the same): each weight row's codes read in
 * order as stored (one stream through memory, as the rows lie), the integer partial sums of each block
 * kept per row, then summed across lanes for the eight rows at once. Faster than transposing the codes
 * when there is one activation row to share them with. */
static void i8_single4(const uint8_t *codes, const float *d8, const float *m8, const int8_t *xq, const float *xd,
                       const float *xsum, float *y, int64_t nbp, __m256i *part) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 8; c++) {
        const uint8_t *row = codes + c * nbp * 16;
        for (int64_t p = 0; p < nbp / 2; p++) {
            if (!(p & 1)) ahead(row + p * 32, CODES_AHEAD);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + p * 32));
            /* 16-bit lanes: even, block 2p; odd, block 2p + 1; |sum| <= 4 * 15 * 127 */
            part[8 * p + c] = _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(raw, low), _mm256_loadu_si256((const __m256i *)(xq + 64 * p))),
                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                     _mm256_loadu_si256((const __m256i *)(xq + 64 * p + 32))));
        }
    }
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    for (int64_t p = 0; p < nbp / 2; p++) {
        /* the eight rows' 32-bit lanes summed in 16 bits while they fit (4 lanes: <= 4 * 7620), then
         * even and odd halves widened to 32 bits for the last step: lane c = row c's block sums */
        const __m256i *v = part + 8 * p;
        __m256i t[4];
        for (int i = 0; i < 4; i++)
            t[i] = _mm256_add_epi16(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
        const __m256i a = _mm256_add_epi16(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
        const __m256i b = _mm256_add_epi16(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
        const __m256i ae = _mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16), ao = _mm256_srai_epi32(a, 16);
        const __m256i be = _mm256_srai_epi32(_mm256_slli_epi32(b, 16), 16), bo = _mm256_srai_epi32(b, 16);
        const __m256i s0 = _mm256_add_epi32(_mm256_permute2x128_si256(ae, be, 0x20), _mm256_permute2x128_si256(ae, be, 0x31));
        const __m256i s1 = _mm256_add_epi32(_mm256_permute2x128_si256(ao, bo, 0x20), _mm256_permute2x128_si256(ao, bo, 0x31));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(_mm256_loadu_ps(d8 + 16 * p), _mm256_set1_ps(xd[2 * p])), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(_mm256_loadu_ps(d8 + 16 * p + 8), _mm256_set1_ps(xd[2 * p + 1])), acc);
        macc = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + 16 * p), _mm256_set1_ps(xsum[2 * p]), macc);
        macc = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + 16 * p + 8), _mm256_set1_ps(xsum[2 * p + 1]), macc);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(acc, macc));
}

static void i8_pass4(const __m256i *w, const float *d8, const float *m8, const int8_t *xq, const float *xd,
                     const float *xsum, float *y, int64_t R, int64_t N, int64_t nbp) {
    switch (R) {
        case 1: i8_rows4(w, d8, m8, xq, xd, xsum, y, 1, N, nbp); break;
        case 2: i8_rows4(w, d8, m8, xq, xd, xsum, y, 2, N, nbp); break;
        case 3: i8_rows4(w, d8, m8, xq, xd, xsum, y, 3, N, nbp); break;
        default: i8_rows4(w, d8, m8, xq, xd, xsum, y, 4, N, nbp); break;
    }
}
#endif

/* x (M rows of K) -> xq (M rows of K codes in the 8-bit layout's order), xd (M rows of nb * 8 lanes:
 * per pair 8 lanes, then an odd last block's dx in 8) */
static void i8_prepare8(const float *x, int8_t *xq, float *xd, int64_t M, int64_t K) {
    const int64_t nb = K / QK, pairs = nb / 2, xlanes = (nb + 1) / 2 * 8;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t g = 0; g < pairs; g++) {
            int8_t q[64];
            const float d0 = i8_block(x + r * K + 2 * g * QK, q), d1 = i8_block(x + r * K + (2 * g + 1) * QK, q + 32);
            int8_t *to = xq + r * K + g * 64;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 8; i++) {
                    to[16 * k + i] = q[8 * k + i];
                    to[16 * k + 8 + i] = q[32 + 8 * k + i];
                }
            float *lanes = xd + r * xlanes + g * 8;
            for (int l = 0; l < 8; l++) lanes[l] = (l & 2) ? d1 : d0;
        }
        if (nb % 2) {
            const float dl = i8_block(x + r * K + (nb - 1) * QK, xq + r * K + (nb - 1) * QK);
            for (int l = 0; l < 8; l++) xd[r * xlanes + pairs * 8 + l] = dl;
        }
    }
}

int attnmask_q4_1_matmul_i8(const uint32_t *codes, const float *d, const float *m, const float *x, float *y, int64_t M,
                            int64_t N, int64_t K, int threads) {
    const int64_t nbp = ((K / QK) + 1) / 2 * 2;
    /* xd and xsum (nbp floats a row each), then the codes (nbp * 32 bytes a row) on a cache line */
    const int64_t scales = (2 * M * nbp + 15) / 16 * 16;
    const int vnni = BLOCKS_VNNI && M > 1; /* the rows' passes read a second copy of the codes, in VNNI order */
    float *xd = scratch((size_t)(scales + M * nbp * 8 * (vnni ? 2 : 1)));
    if (!xd) return -1;
    float *xsum = xd + M * nbp;
    int8_t *xq = (int8_t *)(xd + scales);
    i8_prepare4(x, xq, xd, xsum, M, K, nbp);
    const int8_t *xr = xq; /* the codes i8_pass4 reads */
    (void)xr;
#if BLOCKS_VNNI
    if (vnni) {
        int8_t *xe = xq + M * nbp * QK;
        i8_vnni4(xq, xe, M * nbp / 2);
        xr = xe;
    }
#endif
    const uint8_t *bytes = (const uint8_t *)codes;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t n = task * ROWS_PER_TASK;
        const int64_t end = min64((task + 1) * ROWS_PER_TASK, N);
#if BLOCKS_AVX2
        if (n + 8 <= end) {
            __m256i *w = (__m256i *)group_scratch((size_t)(nbp / 2 * 512 + 2 * nbp * 32));
            if (!w) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *d8 = (float *)(w + nbp / 2 * 16), *m8 = d8 + nbp * 8;
            for (; n + 8 <= end; n += 8) {
                for (int64_t t = 0; t < 8 * nbp * 4; t += 64) { /* the eight rows' d and m, as far ahead as the codes */
                    ahead((const char *)(d + n * nbp) + t, CODES_AHEAD / 4);
                    ahead((const char *)(m + n * nbp) + t, CODES_AHEAD / 4);
                }
                gather8(d + n * nbp, nbp, nbp, d8);
                gather8(m + n * nbp, nbp, nbp, m8);
                if (M == 1) {
                    i8_single4(bytes + n * nbp * 16, d8, m8, xq, xd, xsum, y + n, nbp, w);
                    continue;
                }
                i8_group4(bytes + n * nbp * 16, nbp, w);
                for (int64_t r0 = 0; r0 < M; r0 += MAX_R)
                    i8_pass4(w, d8, m8, xr + r0 * nbp * QK, xd + r0 * nbp, xsum + r0 * nbp, y + r0 * N + n,
                             min64(MAX_R, M - r0), N, nbp);
            }
        }
#endif
        for (; n < end; n++)
            for (int64_t r = 0; r < M; r++)
                y[r * N + n] = i8_one4(bytes + n * nbp * 16, d + n * nbp, m + n * nbp, xq + r * nbp * QK, xd + r * nbp,
                                       xsum + r * nbp, nbp);
    }
    return failed ? -1 : 0;
}

#if BLOCKS_AVX2
/* 8-bit, pair g (blocks 2g and 2g + 1: planes 0 and 1, then 2 and 3, 32 bytes each) against R activation
 * rows. Each plane's 16 codes are block 2g's 8 then block 2g + 1's, so after the byte products and
 * the pairwise sums, int32 lanes 0, 1, 4, 5 hold block 2g's sums and 2, 3, 6, 7 block 2g + 1's; the
 * scales are laid out to match. Q8_0 adds both halves' sums before scaling (to acc0 for an even g,
 * acc1 for an odd one); sub16 scales planes 0-1 (weights 0..15) and 2-3 (16..31) on their own. */
static inline __attribute__((always_inline)) void i8_pair8(const uint32_t *codes, const float *d, const int8_t *xq,
                                                           const float *xd, __m256 *acc0, __m256 *acc1, const int R,
                                                           int64_t K, int64_t xlanes, int64_t g, const int sub16) {
    const __m256i *w = (const __m256i *)((const uint8_t *)codes + g * 64);
    ahead(w, CODES_AHEAD);
    const __m256i w01 = _mm256_loadu_si256(w), w23 = _mm256_loadu_si256(w + 1);
    const __m256i a01 = _mm256_abs_epi8(w01), a23 = _mm256_abs_epi8(w23), ones = _mm256_set1_epi16(1);
    __m256 s0, s1;
    if (sub16) { /* d[4g .. 4g + 3]: block 2g's halves, then block 2g + 1's */
        if (!(g & 3)) ahead(d + 4 * g, CODES_AHEAD / 4);
        const __m128 d4 = _mm_loadu_ps(d + 4 * g);
        const __m128 h0 = _mm_shuffle_ps(d4, d4, _MM_SHUFFLE(2, 2, 0, 0)), h1 = _mm_shuffle_ps(d4, d4, _MM_SHUFFLE(3, 3, 1, 1));
        s0 = _mm256_set_m128(h0, h0), s1 = _mm256_set_m128(h1, h1);
    } else {
        const __m128 d2 = _mm_castpd_ps(_mm_load_sd((const double *)(d + 2 * g)));
        const __m128 dd = _mm_shuffle_ps(d2, d2, _MM_SHUFFLE(1, 1, 0, 0));
        s0 = s1 = _mm256_set_m128(dd, dd);
    }
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) {
        const int8_t *xp = xq + r * K + g * 64;
        const __m256i x01 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xp), w01);
        const __m256i x23 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xp + 32)), w23);
        const __m256 dx = _mm256_loadu_ps(xd + r * xlanes + g * 8);
#if BLOCKS_VNNI
        (void)ones;
        if (sub16) {
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(_mm256_setzero_si256(), a01, x01)), _mm256_mul_ps(s0, dx), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(_mm256_setzero_si256(), a23, x23)), _mm256_mul_ps(s1, dx), acc1[r]);
        } else {
            const __m256i p = dot4(dot4(_mm256_setzero_si256(), a01, x01), a23, x23);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s0, dx), acc0[r]);
        }
#else
        const __m256i p01 = _mm256_madd_epi16(_mm256_maddubs_epi16(a01, x01), ones);
        const __m256i p23 = _mm256_madd_epi16(_mm256_maddubs_epi16(a23, x23), ones);
        if (sub16) {
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p01), _mm256_mul_ps(s0, dx), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p23), _mm256_mul_ps(s1, dx), acc1[r]);
        } else {
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p01, p23)), _mm256_mul_ps(s0, dx), acc0[r]);
        }
#endif
    }
}

/* an odd last block (its 32 codes in order: int32 lanes 0..3 weights 0..15, 4..7 16..31), added to acc0 */
static inline __attribute__((always_inline)) void i8_last8(const uint32_t *codes, const float *d, const int8_t *xq,
                                                           const float *xd, __m256 *acc0, const int R, int64_t K,
                                                           int64_t xlanes, const int sub16) {
    const int64_t b = K / QK - 1;
    const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint8_t *)codes + b * QK));
    const __m256i a = _mm256_abs_epi8(w), ones = _mm256_set1_epi16(1);
    const __m256 s = sub16 ? _mm256_set_m128(_mm_set1_ps(d[2 * b + 1]), _mm_set1_ps(d[2 * b])) : _mm256_set1_ps(d[b]);
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
#if BLOCKS_VNNI
        (void)ones;
        const __m256i p = dot4(_mm256_setzero_si256(), a, _mm256_sign_epi8(x, w));
#else
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(x, w)), ones);
#endif
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, _mm256_loadu_ps(xd + r * xlanes + (b / 2) * 8)), acc0[r]);
    }
}

static inline __attribute__((always_inline)) void i8_row8_r(const uint32_t *codes, const float *d, const int8_t *xq,
                                                            const float *xd, float *y, const int R, int64_t N, int64_t K,
                                                            const int sub16) {
    const int64_t nb = K / QK, xlanes = (nb + 1) / 2 * 8;
    ahead(d, CODES_AHEAD / 8);
    __m256 acc0[MAX_R], acc1[MAX_R];
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= nb / 2; g += 2) { /* by two pairs: Q8_0's even one adds to acc0, the odd one to acc1 */
        i8_pair8(codes, d, xq, xd, acc0, sub16 ? acc1 : acc0, R, K, xlanes, g, sub16);
        i8_pair8(codes, d, xq, xd, sub16 ? acc0 : acc1, acc1, R, K, xlanes, g + 1, sub16);
    }
    if (g < nb / 2) i8_pair8(codes, d, xq, xd, acc0, acc1, R, K, xlanes, g, sub16);
    if (nb % 2) i8_last8(codes, d, xq, xd, acc0, R, K, xlanes, sub16);
    ROWS_UNROLLED
    for (int r = 0; r < R; r++) y[r * N] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}

/* one activation row against weight rows n and n + 1: i8_row8_r's operations for each row, interleaved */
static inline __attribute__((always_inline)) void i8_row8_pair(const uint32_t *codes, const float *d, const int8_t *xq,
                                                               const float *xd, float *y, int64_t K, const int sub16) {
    const int64_t nb = K / QK, xlanes = (nb + 1) / 2 * 8, row_d = sub16 ? 2 * nb : nb;
    const uint32_t *codes1 = codes + K / 4;
    const float *d1 = d + row_d;
    ahead(d, CODES_AHEAD / 8);
    ahead(d1, CODES_AHEAD / 8);
    __m256 a0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, a1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = 0;
    for (; g + 2 <= nb / 2; g += 2) {
        i8_pair8(codes, d, xq, xd, &a0[0], sub16 ? &a1[0] : &a0[0], 1, K, xlanes, g, sub16);
        i8_pair8(codes1, d1, xq, xd, &a0[1], sub16 ? &a1[1] : &a0[1], 1, K, xlanes, g, sub16);
        i8_pair8(codes, d, xq, xd, sub16 ? &a0[0] : &a1[0], &a1[0], 1, K, xlanes, g + 1, sub16);
        i8_pair8(codes1, d1, xq, xd, sub16 ? &a0[1] : &a1[1], &a1[1], 1, K, xlanes, g + 1, sub16);
    }
    if (g < nb / 2) {
        i8_pair8(codes, d, xq, xd, &a0[0], &a1[0], 1, K, xlanes, g, sub16);
        i8_pair8(codes1, d1, xq, xd, &a0[1], &a1[1], 1, K, xlanes, g, sub16);
    }
    if (nb % 2) {
        i8_last8(codes, d, xq, xd, &a0[0], 1, K, xlanes, sub16);
        i8_last8(codes1, d1, xq, xd, &a0[1], 1, K, xlanes, sub16);
    }
    y[0] = hsum8(_mm256_add_ps(a0[0], a1[0]));
    y[1] = hsum8(_mm256_add_ps(a0[1], a1[1]));
}

static void i8_row8(const uint32_t *codes, const float *d, const int8_t *xq, const float *xd, float *y, int64_t R,
                    int64_t N, int64_t K, const int sub16) {
    if (sub16) {
        switch (R) {
            case 1: i8_row8_r(codes, d, xq, xd, y, 1, N, K, 1); break;
            case 2: i8_row8_r(codes, d, xq, xd, y, 2, N, K, 1); break;
            case 3: i8_row8_r(codes, d, xq, xd, y, 3, N, K, 1); break;
            default: i8_row8_r(codes, d, xq, xd, y, 4, N, K, 1); break;
        }
        return;
    }
    switch (R) {
        case 1: i8_row8_r(codes, d, xq, xd, y, 1, N, K, 0); break;
        case 2: i8_row8_r(codes, d, xq, xd, y, 2, N, K, 0); break;
        case 3: i8_row8_r(codes, d, xq, xd, y, 3, N, K, 0); break;
        default: i8_row8_r(codes, d, xq, xd, y, 4, N, K, 0); break;
    }
}
#else
static void i8_row8(const uint32_t *codes, const float *d, const int8_t *xq, const float *xd, float *y, int64_t R,
                    int64_t N, int64_t K, const int sub16) {
    const int64_t nb = K / QK, xlanes = (nb + 1) / 2 * 8;
    const int8_t *w = (const int8_t *)codes;
    for (int64_t r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *q = (const int8_t *)plane8(codes, b, nb);
            const int8_t *xb = xq + r * K + (q - w); /* the activations sit where the codes do */
            const int64_t step = plane_step(b, nb);
            int32_t s[2] = {0, 0};
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 8; i++) s[sub16 ? k / 2 : 0] += (int32_t)q[k * step + i] * xb[k * step + i];
            const float dx = xd[r * xlanes + (b / 2) * 8 + (b % 2) * 2];
            total += sub16 ? (float)s[0] * (d[2 * b] * dx) + (float)s[1] * (d[2 * b + 1] * dx) : (float)s[0] * (d[b] * dx);
        }
        y[r * N] = total;
    }
}
#endif

static int i8_matmul8(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                      int threads, const int sub16) {
    const int64_t nb = K / QK, row_d = nb * (sub16 ? 2 : 1), xlanes = (nb + 1) / 2 * 8;
    /* xd (xlanes floats a row), then the codes (K bytes a row) on a cache line */
    const int64_t lanes = (M * xlanes + 15) / 16 * 16;
    float *xd = scratch((size_t)(lanes + (M * K + 3) / 4));
    if (!xd) return -1;
    int8_t *xq = (int8_t *)(xd + lanes);
    i8_prepare8(x, xq, xd, M, K);
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++)
        for (int64_t r0 = 0; r0 < M; r0 += MAX_R) {
            int64_t n = task * ROWS_PER_TASK;
            const int64_t end = min64((task + 1) * ROWS_PER_TASK, N);
#if BLOCKS_AVX2
            if (M - r0 == 1)
                for (; n + 2 <= end; n += 2) {
                    if (sub16)
                        i8_row8_pair(codes + n * (K / 4), d + n * row_d, xq + r0 * K, xd + r0 * xlanes, y + r0 * N + n, K, 1);
                    else
                        i8_row8_pair(codes + n * (K / 4), d + n * row_d, xq + r0 * K, xd + r0 * xlanes, y + r0 * N + n, K, 0);
                }
#endif
            for (; n < end; n++)
                i8_row8(codes + n * (K / 4), d + n * row_d, xq + r0 * K, xd + r0 * xlanes, y + r0 * N + n,
                        min64(MAX_R, M - r0), N, K, sub16);
        }
    return 0;
}

int attnmask_q8_0_matmul_i8(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N,
                            int64_t K, int threads) {
    return i8_matmul8(codes, d, x, y, M, N, K, threads, 0);
}

int attnmask_q6_k_matmul_i8(const uint32_t *codes, const float *d, const float *x, float *y, int64_t M, int64_t N,
                            int64_t K, int threads) {
    return i8_matmul8(codes, d, x, y, M, N, K, threads, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* Estimates with int8 activations from 8-bit panels: greedy decoding's head screen           */
/* ------------------------------------------------------------------------------------------ */
/* y[r, n] ~ x_r . w_n for w in the 8-bit panels (P8, P8H: Q8_0's and Q5_0's codes and scales), each row
 * of x rounded to 8 bits per block of 32 as the int8 products round it (i8_block: x_j ~ dx q_j), the
 * integer sums exact:
 *
 *     acc = 0;  for each block b in order:  acc = fma(float(S_b), d_b * dx_b, acc),  S_b = sum_j w_j q_j
 *
 * and xerr[r] = ||x_r - dx q|| (float64), from the same q. Not the bits of any other product: an estimate,
 * whose distance from the exact output attnmask.ops.decoding.argmax_rows bounds with xerr (the exact
 * outputs of the few rows that can win come from the float32 kernels). The portable loop computes the
 * same operations as the vector one, so their bits agree too, but only the vector one is fast.
 *
 * The vector loop (AVX512-VNNI and VBMI): a unit's 32 rows of 16 codes are read 4 rows (64 bytes) at a
 * time and their bytes transposed (vpermb) so that 32-bit lane l holds lane l's codes of 4 consecutive
 * weights; the row's codes go as unsigned bytes q + 128 (1..255), broadcast 4 at a time, and vpdpbusd
 * adds 4 products to each lane: the sum is S_b + 128 sum_j w_j, so each lane starts from -128 sum_j w_j
 * (vpdpbusd of the codes with bytes 1, once a unit for all the rows). 16 outputs per vector, one
 * multiply-add of floats per block and row: about 40 multiply-adds of bytes an instruction, against
 * the float32 kernels' 16. */
#if BLOCKS_AVX512 && BLOCKS_VNNI && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define BLOCKS_ESTIMATE 1
#else
#define BLOCKS_ESTIMATE 0
#endif
#define EST_ROWS 16 /* activation rows a pass over a group's units */

int attnmask_estimate_fast(void) { return BLOCKS_ESTIMATE; }

/* row x (K) -> xu (K unsigned codes q + 128), dx (K / 32 scales); returns ||x - dx q||^2 in float64 */
static double est_prepare_row(const float *x, uint8_t *xu, float *dx, int64_t K) {
    double err = 0.0;
    for (int64_t b = 0; b < K / QK; b++) {
        int8_t q[QK];
        const float d = i8_block(x + b * QK, q);
        dx[b] = d;
        for (int j = 0; j < QK; j++) {
            xu[b * QK + j] = (uint8_t)(q[j] + 128);
            const double e = (double)x[b * QK + j] - (double)d * (double)q[j];
            err += e * e;
        }
    }
    return err;
}

#if BLOCKS_ESTIMATE
/* byte 4l + j <- byte 16j + l: four rows of 16 codes -> 16 lanes of four consecutive weights' codes */
static const uint8_t EST_TRANSPOSE[64] __attribute__((aligned(64))) = {
    0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
    6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
    12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};

/* R rows (xu, dx: K and nblk apart) against one group's units (g): out[r * 16 + l] */
static inline __attribute__((always_inline)) void est_tile(const int half, const uint8_t *g, int64_t nblk, int64_t unit,
                                                           const uint8_t *xu, const float *dx, int64_t K, const int R,
                                                           float *out) {
    const __m512i perm = _mm512_load_si512((const void *)EST_TRANSPOSE), ones = _mm512_set1_epi8(1);
    __m512 acc[EST_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        const uint8_t *u = g + b * unit;
        __m512i w[8], sw = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            ahead(u + 64 * j, 2 * nblk * unit);
            w[j] = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512((const void *)(u + 64 * j)));
            sw = _mm512_dpbusd_epi32(sw, ones, w[j]);
        }
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sw, 7)); /* -128 sum w */
        const __m512 d = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + 512)))
                              : _mm512_loadu_ps((const float *)(u + 512));
        for (int r = 0; r < R; r++) {
            const uint8_t *xr = xu + r * K + b * QK;
            __m512i s[2] = {start, _mm512_setzero_si512()}; /* two chains: half the wait on each sum */
            for (int j = 0; j < 8; j++) {
                int32_t four;
                memcpy(&four, xr + 4 * j, sizeof four);
                s[j & 1] = _mm512_dpbusd_epi32(s[j & 1], _mm512_set1_epi32(four), w[j]);
            }
            const __m512i sum = _mm512_add_epi32(s[0], s[1]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nblk + b])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

static void est_pass(const int half, const uint8_t *g, int64_t nblk, int64_t unit, const uint8_t *xu, const float *dx,
                     int64_t K, int64_t R, float *out) {
    switch (R) {
#define EST_CASE(n) \
    case n: est_tile(half, g, nblk, unit, xu, dx, K, n, out); break;
        EST_CASE(1) EST_CASE(2) EST_CASE(3) EST_CASE(4) EST_CASE(5) EST_CASE(6) EST_CASE(7) EST_CASE(8)
        EST_CASE(9) EST_CASE(10) EST_CASE(11) EST_CASE(12) EST_CASE(13) EST_CASE(14) EST_CASE(15)
        default: est_tile(half, g, nblk, unit, xu, dx, K, EST_ROWS, out); break;
#undef EST_CASE
    }
}
#endif

/* The estimates of group g's outputs (cols of them) for R rows of codes xu and scales dx (K and K / 32 apart):
 * out[r * PANEL_COLS + l]. The portable loop computes the same operations as the vector one. */
static void est_group(const int half, const int layout, const uint8_t *g, int64_t nblk, int64_t unit,
                      const uint8_t *xu, const float *dx, int64_t K, int64_t R, int64_t cols, float *out) {
#if BLOCKS_ESTIMATE
    (void)layout, (void)cols;
    est_pass(half, g, nblk, unit, xu, dx, K, R, out);
#else
    (void)half;
    for (int64_t r = 0; r < R; r++)
        for (int64_t l = 0; l < cols; l++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nblk; b++) {
                const uint8_t *u = g + b * unit;
                int32_t s = 0;
                for (int64_t k = 0; k < QK; k++) s += (int32_t)(int8_t)u[PANEL_COLS * k + l] * ((int32_t)xu[r * K + b * QK + k] - 128);
                const float d = scale_value(layout, u + 512 + scale_bytes(layout) * l);
                acc = fmaf((float)s, d * dx[r * (K / QK) + b], acc);
            }
            out[r * PANEL_COLS + l] = acc;
        }
#endif
}

/* The rows' codes (K bytes a row, on cache lines) and scales (K / 32 floats a row) in the thread's scratch, and
 * each row's ||x - dx q||^2 (float64) in err2; NULL if the copy cannot be allocated. */
static uint8_t *est_prepare(const float *x, int64_t M, int64_t K, float **dx, double *err2) {
    const int64_t nblk = K / QK, code_floats = (M * K + 63) / 64 * 16;
    float *copy = scratch((size_t)(code_floats + M * nblk));
    if (!copy) return NULL;
    uint8_t *xu = (uint8_t *)copy;
    *dx = copy + code_floats;
    for (int64_t r = 0; r < M; r++) err2[r] = est_prepare_row(x + r * K, xu + r * K, *dx + r * nblk, K);
    return xu;
}

/* layout P8 or P8H; y (M, N), xerr (M). Returns 0, or -1 if the rows' copy cannot be allocated. */
int attnmask_panel_estimate_i8(int layout, const uint8_t *panels, const float *x, float *y, double *xerr, int64_t M,
                               int64_t N, int64_t K, int threads) {
    const int64_t nblk = K / QK, unit = panel_unit(layout), groups = (N + PANEL_COLS - 1) / PANEL_COLS;
    const int half = half_scales(layout);
    float *dx;
    const uint8_t *xu = est_prepare(x, M, K, &dx, xerr);
    if (!xu) return -1;
    for (int64_t r = 0; r < M; r++) xerr[r] = sqrt(xerr[r]);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && groups > 1)
    for (int64_t c = 0; c < groups; c++) {
        const uint8_t *g = panels + c * nblk * unit;
        const int64_t cols = min64(PANEL_COLS, N - c * PANEL_COLS);
        float out[EST_ROWS * PANEL_COLS] __attribute__((aligned(64)));
        for (int64_t r0 = 0; r0 < M; r0 += EST_ROWS) {
            const int64_t R = min64(EST_ROWS, M - r0);
            est_group(half, layout, g, nblk, unit, xu + r0 * K, dx + r0 * nblk, K, R, cols, out);
            for (int64_t r = 0; r < R; r++)
                memcpy(y + (r0 + r) * N + c * PANEL_COLS, out + PANEL_COLS * r, (size_t)cols * sizeof(float));
        }
    }
    return 0;
}

/* A head's screen in one pass (attnmask::block_head_argmax, attnmask::screen_argmax): every estimate of the
 * 8-bit panels as attnmask_panel_estimate_i8 computes it, compared as soon as it is made and never stored.
 *
 * How far an estimate e of row m and output n can be from the exact output, its reach B: with nx = ||x_m||,
 * xerr = ||x_m - dx q|| (the row's rounding to 8 bits), gamma = 2K u / (1 - 2K u), u = 2^-24 (the estimate's
 * sum meets at most K / 32 + 1 roundings, an exact float32 chain at most 32 + K / 32),
 *   - the panels are the weight itself (a block head; bound null, exact_panels 1): B = norms_n reach_m with
 *     reach_m = (1 + gamma) xerr + 2 gamma nx, norms the rows' ||w_n||;
 *   - the panels are a screen s of a float32 weight w (exact_panels 0): B = bound_n nx + norms_n reach_m with
 *     reach_m = (1 + gamma) xerr, norms the screen rows' ||s_n||, bound_n >= ||w_n - s_n|| + 3 gamma
 *     (||s_n|| + ||w_n||) (attnmask.ops.decoding.screen);
 *   - with a bias, e is e + bias_n and B grows by the exact output's last rounding, 2^-23 (|e| + B).
 * reach and nx carry a margin of 1e-6 for float64's own roundings (reach[m], reach[M + m] = nx: computed here,
 * NaN for a row with a NaN or an infinity). The comparisons run in float64, each operation IEEE's, the same
 * values in the vector loop and the portable one.
 *
 * Each thread takes a contiguous share of the groups, in order, and for each row keeps the largest e - B it
 * has seen (top[t * M + m], from -inf) and records (cand, hi: cap entries per thread and row, at
 * (t * M + m) cap) every n whose e + B reaches that top when n is seen. A thread's top only grows, so every n
 * with e + B >= the largest of the threads' tops is recorded, in increasing n. count[t * M + m]: the entries,
 * or -1 where an estimate was not finite or the row needed more than cap entries (recorded entries below the
 * top are dropped first). Returns 0, or -1 if the rows' copy cannot be allocated. */
int attnmask_panel_screen_i8(int layout, const uint8_t *panels, const float *x, const double *norms,
                             const double *bound, const float *bias, int exact_panels, int64_t M, int64_t N, int64_t K,
                             int threads, int64_t cap, double *reach, double *top, int64_t *count, int64_t *cand,
                             double *hi) {
    const int64_t nblk = K / QK, unit = panel_unit(layout), groups = (N + PANEL_COLS - 1) / PANEL_COLS;
    const int half = half_scales(layout);
    const double u = 0x1p-24, gamma = 2 * K * u / (1 - 2 * K * u), margin = 1.0 + 1e-6;
    double *nx = reach + M;
    float *dx;
    const uint8_t *xu = est_prepare(x, M, K, &dx, reach);
    if (!xu) return -1;
    for (int64_t r = 0; r < M; r++) {
        double sq = 0.0;
        for (int64_t k = 0; k < K; k++) sq += (double)x[r * K + k] * x[r * K + k];
        const double size = sqrt(sq) * margin, R = ((1 + gamma) * sqrt(reach[r]) + (exact_panels ? 2 * gamma * size : 0.0)) * margin;
        reach[r] = isfinite(R) && isfinite(size) ? R : NAN, nx[r] = size;
    }
    for (int64_t i = 0; i < (int64_t)threads * M; i++) top[i] = -INFINITY, count[i] = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        double *tops = top + t * M;
        int64_t *counts = count + t * M;
        float out[EST_ROWS * PANEL_COLS] __attribute__((aligned(64)));
        for (int64_t c = groups * t / T; c < groups * (t + 1) / T; c++) {
            const uint8_t *g = panels + c * nblk * unit;
            const int64_t n0 = c * PANEL_COLS, cols = min64(PANEL_COLS, N - n0);
            for (int64_t r0 = 0; r0 < M; r0 += EST_ROWS) {
                const int64_t R = min64(EST_ROWS, M - r0);
                est_group(half, layout, g, nblk, unit, xu + r0 * K, dx + r0 * nblk, K, R, cols, out);
                for (int64_t r = 0; r < R; r++) {
                    const int64_t m = r0 + r;
                    if (counts[m] < 0 || isnan(reach[m])) continue;
                    double h[PANEL_COLS], best = tops[m];
                    uint32_t reaches = 0; /* bit l: h[l] >= best */
                    int finite = 1;
#if BLOCKS_ESTIMATE
                    const __mmask16 valid = (__mmask16)(cols == PANEL_COLS ? 0xFFFF : (1u << cols) - 1);
                    const __m512 v = _mm512_load_ps(out + r * PANEL_COLS);
                    finite = (_mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_LT_OQ) & valid) == valid;
                    __m512d lo = _mm512_set1_pd(-INFINITY);
                    for (int j = 0; j < 2; j++) {
                        const __mmask8 lanes = (__mmask8)(valid >> (8 * j));
                        __m512d e = _mm512_cvtps_pd(j ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))
                                                      : _mm512_castps512_ps256(v));
                        __m512d B = _mm512_mul_pd(_mm512_maskz_loadu_pd(lanes, norms + n0 + 8 * j), _mm512_set1_pd(reach[m]));
                        if (bound)
                            B = _mm512_add_pd(B, _mm512_mul_pd(_mm512_maskz_loadu_pd(lanes, bound + n0 + 8 * j),
                                                               _mm512_set1_pd(nx[m])));
                        if (bias) {
                            e = _mm512_add_pd(e, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(lanes, bias + n0 + 8 * j)));
                            B = _mm512_add_pd(B, _mm512_mul_pd(_mm512_set1_pd(0x1p-23), _mm512_add_pd(_mm512_abs_pd(e), B)));
                        }
                        lo = _mm512_mask_max_pd(lo, lanes, lo, _mm512_sub_pd(e, B));
                        _mm512_storeu_pd(h + 8 * j, _mm512_add_pd(e, B));
                    }
                    best = fmax(best, _mm512_reduce_max_pd(lo));
                    for (int j = 0; j < 2; j++)
                        reaches |= (uint32_t)(_mm512_cmp_pd_mask(_mm512_loadu_pd(h + 8 * j), _mm512_set1_pd(best), _CMP_GE_OQ) &
                                              (__mmask8)(valid >> (8 * j))) << (8 * j);
#else
                    for (int64_t l = 0; l < cols; l++) { /* each operation IEEE's: the vector loop's values */
                        const float v = out[r * PANEL_COLS + l];
                        finite &= isfinite(v) != 0;
                        double e = (double)v, B = norms[n0 + l] * reach[m];
                        if (bound) B = B + bound[n0 + l] * nx[m];
                        if (bias) {
                            e = e + (double)bias[n0 + l];
                            B = B + 0x1p-23 * (fabs(e) + B);
                        }
                        h[l] = e + B;
                        best = e - B > best ? e - B : best;
                    }
                    for (int64_t l = 0; l < cols; l++) reaches |= (uint32_t)(h[l] >= best) << l;
#endif
                    if (!finite) {
                        counts[m] = -1;
                        continue;
                    }
                    tops[m] = best;
                    int64_t *cm = cand + (t * M + m) * cap;
                    double *hm = hi + (t * M + m) * cap;
                    for (; reaches; reaches &= reaches - 1) {
                        const int l = __builtin_ctz(reaches);
                        if (counts[m] == cap) { /* full: drop what the top has passed */
                            int64_t kept = 0;
                            for (int64_t i = 0; i < cap; i++)
                                if (hm[i] >= best) cm[kept] = cm[i], hm[kept] = hm[i], kept++;
                            counts[m] = kept;
                            if (kept == cap) {
                                counts[m] = -1;
                                break;
                            }
                        }
                        cm[counts[m]] = n0 + l, hm[counts[m]] = h[l], counts[m]++;
                    }
                }
            }
        }
    }
    return 0;
}
