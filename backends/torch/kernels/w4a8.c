/* w4a8: 4-bit weights times 8-bit activations on AVX-512 VNNI, each row alone.
 *
 * Knows: the packed layout below, the per-group activation quantization. Must not know:
 * torch, models, sessions. Called through ctypes from backends/torch/w4a8.py.
 *
 * Weights come in tiles of 16 output rows. For each tile and each group of 32 inputs, one
 * block of 320 bytes: 256 bytes of codes, then 16 bf16 scales, then 16 bf16 zeros, with
 * w = (code - 8) * scale + zero. In the codes, 4 loads of 64 bytes; in load p, the dword of
 * lane o holds, in its low nibbles, inputs 4p..4p+3 of output row o and, in its high nibbles,
 * inputs 16+4p..16+4p+3. So one vpdpbusd multiplies 16 output rows by 4 broadcast inputs.
 *
 * Activations: each row, each group of 32 inputs, quantized to int8 with its own scale
 * (max |x| / 127). The integer products are exact; every row runs the same instructions in
 * the same order whatever the number of rows, so a row gets the same bits alone or in a
 * verify block of many rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define TILE 16
#define BLOCK_BYTES 320
#define MAX_ROWS 16
/* Blocks are prefetched this far ahead: with more than one row the multiply-adds kept the
 * hardware prefetcher behind (8 rows over the 1.5B Qwen's layers, cold: 49 -> 28 ms). */
#define PREFETCH_BYTES (16 * BLOCK_BYTES)

static inline __m512 bf16_to_ps(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Round to bf16 as torch does (to nearest, ties to even), kept as float. */
static inline __m512 round_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Row r of x [rows, k] to int8 codes, per-group scale a and scaled code sum b = a * sum(q). */
static void quantize_row(const uint16_t *x, int k, int8_t *q, float *a, float *b) {
    for (int g = 0; g < k / GROUP; g++) {
        const uint16_t *xg = x + g * GROUP;
        __m512 lo = bf16_to_ps(xg), hi = bf16_to_ps(xg + 16);
        __m512 m = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        a[g] = d;
        b[g] = d * (float)sum;
    }
}

/* One row's share of one block: the 32-input dot products of 16 output rows, scaled. */
static inline void row_block(const __m512i *c, __m512 scale, __m512 zmin, const int8_t *q,
                             float a, float b, __m512 *acc, __m512 *accz) {
    const int32_t *qa = (const int32_t *)q;
    /* two chains of 4 multiply-adds instead of one of 8: the adds wait less on each other */
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        lo = _mm512_dpbusd_epi32(lo, c[j], _mm512_set1_epi32(qa[j]));
        hi = _mm512_dpbusd_epi32(hi, c[j + 4], _mm512_set1_epi32(qa[j + 4]));
    }
    __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
    *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(a)), *acc);
    *accz = _mm512_fmadd_ps(zmin, _mm512_set1_ps(b), *accz);
}

/* 16 outputs as bf16, then plus the bias, each sum rounded as torch's bf16 add rounds it. */
static inline void store_bf16(uint16_t *out, __m512 v, const uint16_t *bias) {
    v = round_bf16(v);
    if (bias)
        v = round_bf16(_mm512_add_ps(v, bf16_to_ps(bias)));
    __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(bits));
}

/* out[r, t*16 .. t*16+15] for one tile t and NR rows from row r0, accumulators in
 * registers. The tile's blocks are read from memory for the first rows and from cache after. */
#define TILE_ROWS(NR)                                                                          \
    static void tile_rows_##NR(const uint8_t *w, int groups, const int8_t *q, const float *a,  \
                               const float *b, int k, int n, int t, const uint16_t *bias,      \
                               uint16_t *out) {                                                 \
        __m512 acc[NR], accz[NR];                                                              \
        for (int r = 0; r < NR; r++) {                                                         \
            acc[r] = _mm512_setzero_ps();                                                      \
            accz[r] = _mm512_setzero_ps();                                                     \
        }                                                                                      \
        const __m512i nib = _mm512_set1_epi8(0x0F);                                            \
        const uint8_t *block = w + (size_t)t * groups * BLOCK_BYTES;                           \
        for (int g = 0; g < groups; g++, block += BLOCK_BYTES) {                               \
            for (int l = 0; l < BLOCK_BYTES; l += 64)                                          \
                _mm_prefetch((const char *)block + PREFETCH_BYTES + l, _MM_HINT_T0);           \
            __m512i c[8];                                                                      \
            for (int p = 0; p < 4; p++) {                                                      \
                __m512i v = _mm512_loadu_si512((const void *)(block + 64 * p));                \
                c[p] = _mm512_and_si512(v, nib);                                               \
                c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);                     \
            }                                                                                  \
            __m512 scale = bf16_to_ps((const uint16_t *)(block + 256));                        \
            __m512 zero = bf16_to_ps((const uint16_t *)(block + 288));                         \
            /* (code - 8) * scale + zero = code * scale + zmin: no per-row correction */       \
            __m512 zmin = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);                 \
            for (int r = 0; r < NR; r++)                                                       \
                row_block(c, scale, zmin, q + (size_t)r * k + g * GROUP, a[r * groups + g],    \
                          b[r * groups + g], &acc[r], &accz[r]);                               \
        }                                                                                      \
        for (int r = 0; r < NR; r++)                                                           \
            store_bf16(out + (size_t)r * n + t * TILE, _mm512_add_ps(acc[r], accz[r]),         \
                       bias ? bias + t * TILE : NULL);                                          \
    }
TILE_ROWS(1)
TILE_ROWS(2)
TILE_ROWS(3)
TILE_ROWS(4)

/* All rows of one tile, 4 at a time: a row's instructions never depend on its neighbours. */
static void tile_rows(const uint8_t *w, int groups, int rows, const int8_t *q, const float *a,
                      const float *b, int k, int n, int t, const uint16_t *bias,
                      uint16_t *out) {
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int8_t *qr = q + (size_t)r0 * k;
        const float *ar = a + (size_t)r0 * groups, *br = b + (size_t)r0 * groups;
        uint16_t *o = out + (size_t)r0 * n;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: tile_rows_1(w, groups, qr, ar, br, k, n, t, bias, o); break;
        case 2: tile_rows_2(w, groups, qr, ar, br, k, n, t, bias, o); break;
        case 3: tile_rows_3(w, groups, qr, ar, br, k, n, t, bias, o); break;
        default: tile_rows_4(w, groups, qr, ar, br, k, n, t, bias, o); break;
        }
    }
}

/* out [rows, n] = x [rows, k] times the packed weight of n outputs, plus bias (or NULL), all
 * bf16; rows <= MAX_ROWS. scratch holds rows*k int8 codes and 2*rows*k/GROUP floats. */
int w4a8_matmul(const uint16_t *x, int rows, int k, const uint8_t *w, int n,
                const uint16_t *bias, uint16_t *out, void *scratch) {
    if (rows < 1 || rows > MAX_ROWS || k % GROUP || n % TILE)
        return -1;
    int groups = k / GROUP;
    int8_t *q = (int8_t *)scratch;
    float *a = (float *)(q + (size_t)rows * k);
    float *b = a + (size_t)rows * groups;
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * k, k, q + (size_t)r * k, a + (size_t)r * groups,
                     b + (size_t)r * groups);
    int tiles = n / TILE;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++)
        tile_rows(w, groups, rows, q, a, b, k, n, t, bias, out);
    return 0;
}

/* Pack codes (uint8 0..15, [n, k]) and bf16 scales/zeros ([k/GROUP, n] each) into w. */
int w4a8_pack(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int n, int k,
              uint8_t *w) {
    if (k % GROUP || n % TILE)
        return -1;
    int groups = k / GROUP;
    for (int t = 0; t < n / TILE; t++)
        for (int g = 0; g < groups; g++) {
            uint8_t *block = w + ((size_t)t * groups + g) * BLOCK_BYTES;
            for (int p = 0; p < 4; p++)
                for (int o = 0; o < TILE; o++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t *row = codes + (size_t)(t * TILE + o) * k + g * GROUP;
                        block[64 * p + 4 * o + i] =
                            (uint8_t)(row[4 * p + i] | (row[16 + 4 * p + i] << 4));
                    }
            uint16_t *sc = (uint16_t *)(block + 256), *zr = (uint16_t *)(block + 288);
            for (int o = 0; o < TILE; o++) {
                sc[o] = scales[(size_t)g * n + t * TILE + o];
                zr[o] = zeros[(size_t)g * n + t * TILE + o];
            }
        }
    return 0;
}
