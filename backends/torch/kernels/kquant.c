/* kquant: GGUF weights (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with the values the file
 * stores, times 8-bit activations; each row alone, in tiles of 16 output rows. Two builds of
 * one multiply: AVX-512 VNNI (dpbusd over a whole tile), and AVX2 for the CPUs without it
 * (maddubs + madd over each half of a tile: the same integers, the same float steps per lane,
 * so both builds give the same bits).
 *
 * Knows: ggml's block layouts of those types (read once at load by kq_pack),
 * the tiled layout below, the per-group activation quantization. Must not know: torch, models,
 * sessions. Called through ctypes from backends/torch/kquant.py.
 *
 * Why not ggml's own dot products (which kernels/ggml_linear.c calls): they are written for
 * one activation row, so every extra row of a verify block unpacks every weight again; here
 * a tile's codes are unpacked once and multiply up to 4 rows from registers.
 *
 * Packed tile (16 output rows), group after group of 32 inputs; a K-quant's groups come in
 * super-blocks of 8 after a header of 16 float32 `d` (Q4_K, Q5_K: then 16 float32 `dmin`). A group:
 * 256 bytes of the codes' low nibbles (as w4a8.c lays them: load p, lane o holds inputs
 * 4p..4p+3 of row o in its low nibbles and 16+4p.. in its high ones); the codes' higher bits
 * (Q5_x, Q5_K, Q6_K: 128 bytes of 2 bits, load h, byte (o, i), bits 2q..2q+1 for vector 4h+q;
 * Q8_0: 256 bytes of high nibbles laid out as the low ones); then the group's parameters:
 * Q4_K, Q5_K 16 6-bit scales and 16 6-bit mins; Q6_K 16 int8 scales of inputs 0..15 and 16 of
 * inputs 16..31; legacy types 16 float32 d (Q4_1, Q5_1: and 16 float32 m). Every value is the
 * file's: w = d*sc*q - dmin*m (Q4_K, Q5_K), d*sc*(q - 32) (Q6_K), d*(q - offset) or d*q + m
 * (legacy; Q8_0's signed codes stored plus 128), each product exact in float32.
 *
 * Activations: each row, each group of 32, to int8 with its own scale a (max |x| / 127),
 * with a times the codes' sums of each half. The integer dot products are exact and every row
 * runs the same instructions in the same order whatever the row count: a row gets its one-row
 * bits in any verify block.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TILE 16
#define GROUP 32
#define SUPER 256
#define MAX_ROWS 16
#define PREFETCH_GROUPS 16 /* as w4a8.c: 8 rows over the 1.5B Qwen's layers, cold, 49 -> 28 ms */
#define Q4_0 2
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define Q4K 12
#define Q5K 13
#define Q6K 14

static int is_k(int type) { return type == Q4K || type == Q5K || type == Q6K; }
/* K-quants whose groups take a 6-bit scale and min under the header's d and dmin */
static int has_min_k(int type) { return type == Q4K || type == Q5K; }
/* bits of code above the low nibble, stored in a plane after it */
static int high_bits(int type) {
    return type == Q8_0 ? 4 : (type == Q5_0 || type == Q5_1 || type == Q5K || type == Q6K) ? 2 : 0;
}
static int param_bytes(int type) {
    return (type == Q4_1 || type == Q5_1) ? 128 : is_k(type) ? 32 : 64;
}
/* a K-quant super-block's header: d (and dmin) per output row of the tile */
static int header_bytes(int type) { return has_min_k(type) ? 128 : type == Q6K ? 64 : 0; }
static int group_bytes(int type) { return 256 + 64 * high_bits(type) + param_bytes(type); }
static int block_elems(int type) { return is_k(type) ? SUPER : GROUP; }

static size_t tile_bytes(int type, int k) {
    int groups = k / GROUP;
    return (size_t)groups * group_bytes(type) + (size_t)(groups / 8) * header_bytes(type);
}

static int supported(int type, int n, int k) {
    int known = type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 ||
                is_k(type);
    return known && n % TILE == 0 && k % block_elems(type) == 0;
}

size_t kq_packed_bytes(int type, int n, int k) {
    return supported(type, n, k) ? (size_t)(n / TILE) * tile_bytes(type, k) : 0;
}

static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static float read_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* ---- unpacking the file's blocks: codes, and the parameters of each group of 32 ---- */

/* What one output row holds for one group of 32 inputs. */
struct group {
    uint8_t codes[GROUP];
    uint8_t p0, p1;   /* K-quants: Q4_K scale and min, Q6_K the two halves' scales */
    float d, m;       /* legacy: scale and offset (w = d*code + m) */
};

static void q4k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* one 144-byte Q4_K or 176-byte Q5_K block -> 8 groups; its d and dmin. Q5_K's fifth bits
 * sit in 32 bytes before the nibbles: bit 2c of byte l for group 2c, bit 2c+1 for 2c+1. */
static void unpack_q45k(int type, const uint8_t *b, struct group *g, float *d, float *dmin) {
    *d = read_half(b);
    *dmin = read_half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == Q5K ? 48 : 16);
    for (int c = 0; c < 4; c++) {
        q4k_scale_min(2 * c, scales, &g[2 * c].p0, &g[2 * c].p1);
        q4k_scale_min(2 * c + 1, scales, &g[2 * c + 1].p0, &g[2 * c + 1].p1);
        for (int l = 0; l < 32; l++) {
            int h0 = type == Q5K ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
            int h1 = type == Q5K ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
            g[2 * c].codes[l] = (uint8_t)((qs[32 * c + l] & 0xF) | h0);
            g[2 * c + 1].codes[l] = (uint8_t)((qs[32 * c + l] >> 4) | h1);
        }
    }
}

/* one 210-byte Q6_K block -> 8 groups (codes 0..63, two int8 scales each); its d */
static void unpack_q6k(const uint8_t *b, struct group *g, float *d) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    *d = read_half(b + 208);
    uint8_t y[SUPER];
    for (int half = 0; half < 2; half++) {
        const uint8_t *l0 = ql + 64 * half, *h0 = qh + 32 * half;
        uint8_t *yh = y + 128 * half;
        for (int l = 0; l < 32; l++) {
            yh[l] = (l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4);
            yh[l + 32] = (l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4);
            yh[l + 64] = (l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4);
            yh[l + 96] = (l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4);
        }
    }
    for (int j = 0; j < 8; j++) {
        memcpy(g[j].codes, y + GROUP * j, GROUP);
        g[j].p0 = (uint8_t)sc[2 * j];
        g[j].p1 = (uint8_t)sc[2 * j + 1];
    }
}

/* one legacy block of 32 -> its codes (unsigned) and w = d*code + m */
static void unpack_legacy(int type, const uint8_t *b, struct group *g) {
    float d = read_half(b);
    int has_min = type == Q4_1 || type == Q5_1;
    const uint8_t *qs = b + (has_min ? 4 : 2);
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) {
        memcpy(&qh, qs, 4);
        qs += 4;
    }
    g->d = d;
    for (int j = 0; j < 16 && type != Q8_0; j++) {
        g->codes[j] = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
        g->codes[j + 16] = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
    }
    if (type == Q8_0)
        for (int j = 0; j < GROUP; j++)
            g->codes[j] = (uint8_t)((int8_t)qs[j] + 128);
    float offset = type == Q4_0 ? 8.0f : type == Q5_0 ? 16.0f : type == Q8_0 ? 128.0f : 0.0f;
    g->m = has_min ? read_half(b + 2) : -offset * d;
}

static int stored_block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4K: return 144;
    case Q5K: return 176;
    default: return 210;
    }
}

/* Lay out one group of 16 rows: nibbles, high plane, parameters. */
static void put_group(int type, struct group *g[TILE], uint8_t *out) {
    for (int p = 0; p < 4; p++)
        for (int o = 0; o < TILE; o++)
            for (int i = 0; i < 4; i++) {
                const uint8_t *c = g[o]->codes;
                out[64 * p + 4 * o + i] =
                    (uint8_t)((c[4 * p + i] & 0xF) | ((c[16 + 4 * p + i] & 0xF) << 4));
            }
    uint8_t *hi = out + 256;
    if (high_bits(type) == 4)  /* the high nibbles, laid out as the low ones */
        for (int p = 0; p < 4; p++)
            for (int o = 0; o < TILE; o++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t *c = g[o]->codes;
                    hi[64 * p + 4 * o + i] = (uint8_t)((c[4 * p + i] >> 4) |
                                                       ((c[16 + 4 * p + i] >> 4) << 4));
                }
    if (high_bits(type) == 2) {  /* load h, byte (o, i), bits 2q..: vector 4h + q */
        memset(hi, 0, 128);
        for (int v = 0; v < 8; v++)
            for (int o = 0; o < TILE; o++)
                for (int i = 0; i < 4; i++) {
                    int input = v < 4 ? 4 * v + i : 16 + 4 * (v - 4) + i;
                    uint8_t bits = (uint8_t)((g[o]->codes[input] >> 4) & 3);
                    hi[64 * (v / 4) + 4 * o + i] |= (uint8_t)(bits << (2 * (v % 4)));
                }
    }
    uint8_t *params = hi + 64 * high_bits(type);
    for (int o = 0; o < TILE; o++) {
        if (is_k(type)) {
            params[o] = g[o]->p0;
            params[16 + o] = g[o]->p1;
        } else {
            memcpy(params + 4 * o, &g[o]->d, 4);
            if (param_bytes(type) == 128)
                memcpy(params + 64 + 4 * o, &g[o]->m, 4);
        }
    }
}

/* Pack n rows of k inputs stored as `type` blocks (src, row after row) into dst. */
int kq_pack(int type, const uint8_t *src, int n, int k, uint8_t *dst) {
    if (!supported(type, n, k))
        return -1;
    int blocks = k / block_elems(type), block = stored_block_bytes(type);
    size_t row_bytes = (size_t)blocks * block;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n / TILE; t++) {
        struct group groups[TILE][8], *column[TILE];
        float d[TILE], dmin[TILE];
        uint8_t *out = dst + (size_t)t * tile_bytes(type, k);
        for (int s = 0; s < blocks; s++) {
            for (int o = 0; o < TILE; o++) {
                const uint8_t *b = src + (size_t)(t * TILE + o) * row_bytes + (size_t)s * block;
                if (has_min_k(type))
                    unpack_q45k(type, b, groups[o], &d[o], &dmin[o]);
                else if (type == Q6K)
                    unpack_q6k(b, groups[o], &d[o]);
                else
                    unpack_legacy(type, b, &groups[o][0]);
            }
            if (is_k(type)) {
                memcpy(out, d, sizeof d);
                if (has_min_k(type))
                    memcpy(out + 64, dmin, sizeof dmin);
                out += header_bytes(type);
            }
            for (int j = 0; j < (is_k(type) ? 8 : 1); j++, out += group_bytes(type)) {
                for (int o = 0; o < TILE; o++)
                    column[o] = &groups[o][j];
                put_group(type, column, out);
            }
        }
    }
    return 0;
}

/* ---- the multiply ---- */

struct rows {
    const int8_t *q;
    const float *a, *b0, *b1;
    int k, groups;
};

#if defined(__AVX512VNNI__) /* built with kquant.py's AVX-512 flags where the CPU has them */
/* Row x [k] float32 to int8 codes; per group its scale a and a times each half's code sum. */
static void quantize_row(const float *x, int k, int8_t *q, float *a, float *b0, float *b1) {
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
        a[g] = d;
        b0[g] = d * (float)_mm512_reduce_add_epi32(qlo);
        b1[g] = d * (float)_mm512_reduce_add_epi32(qhi);
    }
}


/* A group's weights as ws * code + z per half, for 16 output rows: from the K-quant
 * header (d, dmin) and the group's small scales, or the legacy group's own d and m. */
static inline void group_params(int type, const uint8_t *params, __m512 d, __m512 dmin,
                                __m512 *ws0, __m512 *ws1, __m512 *z0, __m512 *z1) {
    if (type == Q6K) {
        *ws0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128((const __m128i *)params))));
        *ws1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128((const __m128i *)(params + 16)))));
        *z0 = _mm512_mul_ps(_mm512_set1_ps(-32.0f), *ws0);
        *z1 = _mm512_mul_ps(_mm512_set1_ps(-32.0f), *ws1);
    } else if (has_min_k(type)) {
        *ws0 = *ws1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                           _mm_loadu_si128((const __m128i *)params))));
        __m512 m = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                           _mm_loadu_si128((const __m128i *)(params + 16)))));
        *z0 = *z1 = _mm512_sub_ps(_mm512_setzero_ps(), m);
    } else {
        *ws0 = *ws1 = _mm512_loadu_ps((const float *)params);
        float offset = type == Q4_0 ? -8.0f : type == Q5_0 ? -16.0f : -128.0f;
        *z0 = *z1 = param_bytes(type) == 128 ? _mm512_loadu_ps((const float *)params + 16)
                                              : _mm512_mul_ps(_mm512_set1_ps(offset), *ws0);
    }
}

/* For NR rows from r0 and tile t: out[r][t*16 ..] = the tile's dot products. */
#define TILE_ROWS(NR)                                                                          \
    static void tile_rows_##NR(int type, const uint8_t *w, struct rows x, int r0, int t,       \
                               const float *bias, float *out, int n) {                          \
        __m512 acc[NR];                                                                        \
        for (int r = 0; r < NR; r++)                                                           \
            acc[r] = _mm512_setzero_ps();                                                      \
        const __m512i nib = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);                 \
        const uint8_t *block = w + (size_t)t * tile_bytes(type, x.k);                          \
        int hb = high_bits(type);                                                              \
        __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();                            \
        for (int g = 0; g < x.groups; g++) {                                                   \
            if (is_k(type) && g % 8 == 0) {                                                    \
                d = _mm512_loadu_ps((const float *)block);                                     \
                if (has_min_k(type))                                                           \
                    dmin = _mm512_loadu_ps((const float *)block + 16);                         \
                block += header_bytes(type);                                                   \
            }                                                                                  \
            /* ahead of the hardware prefetcher, which several rows' multiply-adds left behind */ \
            for (int l = 0; l < group_bytes(type); l += 64)                                    \
                _mm_prefetch((const char *)block + PREFETCH_GROUPS * group_bytes(type) + l,    \
                             _MM_HINT_T0);                                                     \
            __m512i c[8];                                                                      \
            for (int p = 0; p < 4; p++) {                                                      \
                __m512i v = _mm512_loadu_si512((const void *)(block + 64 * p));                \
                c[p] = _mm512_and_si512(v, nib);                                               \
                c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);                     \
            }                                                                                  \
            if (hb == 4)                                                                       \
                for (int p = 0; p < 4; p++) {                                                  \
                    __m512i v = _mm512_loadu_si512((const void *)(block + 256 + 64 * p));      \
                    c[p] = _mm512_or_si512(c[p], _mm512_slli_epi16(_mm512_and_si512(v, nib), 4)); \
                    c[p + 4] = _mm512_or_si512(c[p + 4], _mm512_andnot_si512(nib, v));         \
                }                                                                              \
            if (hb == 2)                                                                       \
                for (int h = 0; h < 2; h++) {                                                  \
                    __m512i v = _mm512_loadu_si512((const void *)(block + 256 + 64 * h));      \
                    for (int q = 0; q < 4; q++)                                                \
                        c[4 * h + q] = _mm512_or_si512(                                        \
                            c[4 * h + q],                                                      \
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 2 * q), two), \
                                              4));                                             \
                }                                                                              \
            __m512 ws0, ws1, z0, z1;                                                           \
            group_params(type, block + 256 + 64 * hb, d, dmin, &ws0, &ws1, &z0, &z1);          \
            block += group_bytes(type);                                                        \
            for (int r = 0; r < NR; r++) {                                                     \
                int row = r0 + r;                                                              \
                const int32_t *qa = (const int32_t *)(x.q + (size_t)row * x.k + g * GROUP);    \
                __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();              \
                for (int j = 0; j < 4; j++) {                                                  \
                    lo = _mm512_dpbusd_epi32(lo, c[j], _mm512_set1_epi32(qa[j]));              \
                    hi = _mm512_dpbusd_epi32(hi, c[j + 4], _mm512_set1_epi32(qa[j + 4]));      \
                }                                                                              \
                size_t at = (size_t)row * x.groups + g;                                        \
                __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), ws0);                      \
                part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), ws1, part);                     \
                acc[r] = _mm512_fmadd_ps(part, _mm512_set1_ps(x.a[at]), acc[r]);               \
                acc[r] = _mm512_fmadd_ps(z0, _mm512_set1_ps(x.b0[at]), acc[r]);                \
                acc[r] = _mm512_fmadd_ps(z1, _mm512_set1_ps(x.b1[at]), acc[r]);                \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < NR; r++) {                                                         \
            __m512 v = acc[r];                                                                 \
            if (bias)                                                                          \
                v = _mm512_add_ps(v, _mm512_loadu_ps(bias + t * TILE));                        \
            _mm512_storeu_ps(out + (size_t)(r0 + r) * n + t * TILE, v);                        \
        }                                                                                      \
    }
#else /* AVX2: the same integers per lane as vpdpbusd, in two 8-row halves of a tile */

/* dpbusd's sums of 4 u8 x s8 products per lane: maddubs' s16 pairs summed before madd widens
 * them. Exact while no s16 sum passes 32767: eight pairs of codes below 16 (8 * 2 * 15 * 127),
 * four below 32, two below 64 (Q6_K's); Q8_0's 8-bit codes go through as two nibbles. */
static inline __m256i widen(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }

static inline __m256i pairs(const __m256i *c, const int32_t *qa, int j) {
    return _mm256_maddubs_epi16(c[j], _mm256_set1_epi32(qa[j]));
}

/* 8 vectors of codes below 16: every s16 pair summed, then widened once */
static inline __m256i dots_below16(const __m256i *c, const int32_t *qa) {
    __m256i s0 = _mm256_add_epi16(pairs(c, qa, 0), pairs(c, qa, 1));
    __m256i s1 = _mm256_add_epi16(pairs(c, qa, 2), pairs(c, qa, 3));
    __m256i s2 = _mm256_add_epi16(pairs(c, qa, 4), pairs(c, qa, 5));
    __m256i s3 = _mm256_add_epi16(pairs(c, qa, 6), pairs(c, qa, 7));
    return widen(_mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)));
}

/* 4 vectors of codes below 32 (widened once) or below 64 (widened in two pairs) */
static inline __m256i dots4(const __m256i *c, const int32_t *qa, int below64) {
    __m256i s01 = _mm256_add_epi16(pairs(c, qa, 0), pairs(c, qa, 1));
    __m256i s23 = _mm256_add_epi16(pairs(c, qa, 2), pairs(c, qa, 3));
    if (below64)
        return _mm256_add_epi32(widen(s01), widen(s23));
    return widen(_mm256_add_epi16(s01, s23));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* Row x [k] float32 to int8 codes; per group its scale a and a times each half's code sum. */
static void quantize_row(const float *x, int k, int8_t *q, float *a, float *b0, float *b1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xg + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        float amax = max8(m);
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t codes[GROUP], sums[2] = {0, 0};
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(codes + 8 * i),
                                _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))));
        for (int j = 0; j < GROUP; j++) {
            int32_t c = codes[j];
            q[g * GROUP + j] = (int8_t)(c > 127 ? 127 : c < -128 ? -128 : c);
            sums[j / 16] += c;
        }
        a[g] = d;
        b0[g] = d * (float)sums[0];
        b1[g] = d * (float)sums[1];
    }
}

/* group_params for the 8 output rows of half h of the tile */
static inline void group_params(int type, const uint8_t *params, int h, __m256 d, __m256 dmin,
                                __m256 *ws0, __m256 *ws1, __m256 *z0, __m256 *z1) {
    if (type == Q6K) {
        *ws0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64((const __m128i *)(params + 8 * h)))));
        *ws1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64((const __m128i *)(params + 16 + 8 * h)))));
        *z0 = _mm256_mul_ps(_mm256_set1_ps(-32.0f), *ws0);
        *z1 = _mm256_mul_ps(_mm256_set1_ps(-32.0f), *ws1);
    } else if (has_min_k(type)) {
        *ws0 = *ws1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                           _mm_loadl_epi64((const __m128i *)(params + 8 * h)))));
        __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                           _mm_loadl_epi64((const __m128i *)(params + 16 + 8 * h)))));
        *z0 = *z1 = _mm256_sub_ps(_mm256_setzero_ps(), m);
    } else {
        *ws0 = *ws1 = _mm256_loadu_ps((const float *)params + 8 * h);
        float offset = type == Q4_0 ? -8.0f : type == Q5_0 ? -16.0f : -128.0f;
        *z0 = *z1 = param_bytes(type) == 128 ? _mm256_loadu_ps((const float *)params + 16 + 8 * h)
                                              : _mm256_mul_ps(_mm256_set1_ps(offset), *ws0);
    }
}

/* Half h of a group's codes for 8 output rows: c the codes (below 64), or Q8_0's low nibbles
 * with its high ones in ch. */
static inline void half_codes(int hb, const uint8_t *block, int h, __m256i c[8], __m256i ch[8]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + 64 * p + 32 * h));
        c[p] = _mm256_and_si256(v, nib);
        c[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
    if (hb == 4)
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(block + 256 + 64 * p + 32 * h));
            ch[p] = _mm256_and_si256(v, nib);
            ch[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
    if (hb == 2)
        for (int s = 0; s < 2; s++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(block + 256 + 64 * s + 32 * h));
            for (int q = 0; q < 4; q++)
                c[4 * s + q] = _mm256_or_si256(
                    c[4 * s + q],
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 2 * q), two), 4));
        }
}

/* the integer dot products of one row's group with 8 rows' codes: inputs 0..15 in lo and
 * 16..31 in hi for Q6_K, whose two halves take two scales; all 32 in lo for the rest */
static inline void row_dots(int type, const __m256i c[8], const __m256i ch[8], const int32_t *qa,
                            __m256i *lo, __m256i *hi) {
    if (type == Q6K) {
        *lo = dots4(c, qa, 1);
        *hi = dots4(c + 4, qa + 4, 1);
    } else if (high_bits(type) == 2) {
        *lo = _mm256_add_epi32(dots4(c, qa, 0), dots4(c + 4, qa + 4, 0));
    } else {
        *lo = dots_below16(c, qa);
        if (type == Q8_0)
            *lo = _mm256_add_epi32(*lo, _mm256_slli_epi32(dots_below16(ch, qa), 4));
    }
}

/* acc += one row's group times 8 output rows' codes, scaled: a, b0, b1 the row's group
 * parameters (quantize_row's), ws and z the weights' */
static inline __m256 row_step(int type, const __m256i c[8], const __m256i ch[8],
                              const int32_t *qa, float a, float b0, float b1, __m256 ws0,
                              __m256 ws1, __m256 z0, __m256 z1, __m256 acc) {
    __m256i lo, hi = _mm256_setzero_si256();
    row_dots(type, c, ch, qa, &lo, &hi);
    __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), ws0);
    if (type == Q6K)
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), ws1, part);
    acc = _mm256_fmadd_ps(part, _mm256_set1_ps(a), acc);
    if (type != Q6K) /* one scale and offset for the group: z0 == z1 */
        return _mm256_fmadd_ps(z0, _mm256_set1_ps(b0 + b1), acc);
    acc = _mm256_fmadd_ps(z0, _mm256_set1_ps(b0), acc);
    return _mm256_fmadd_ps(z1, _mm256_set1_ps(b1), acc);
}

/* Halves h0..h0+span-1 of one tile for rows r0..r0+NR-1; inlined with every int argument
 * constant, so each case below is its own loop with its own registers (a runtime type in the
 * row loop cost about 20%). */
static inline __attribute__((always_inline)) void tile_pass(int NR, int type, const uint8_t *w,
                                                             struct rows x, int r0, int t,
                                                             const float *bias, float *out,
                                                             int n, int h0, int span) {
    __m256 acc[4][2]; /* NR <= 4, span <= 2 */
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *block = w + (size_t)t * tile_bytes(type, x.k);
    int hb = high_bits(type);
    __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmin[2] = {d[0], d[1]};
    for (int g = 0; g < x.groups; g++) {
        if (is_k(type) && g % 8 == 0) {
            for (int s = 0; s < span; s++) {
                d[s] = _mm256_loadu_ps((const float *)block + 8 * (h0 + s));
                if (has_min_k(type))
                    dmin[s] = _mm256_loadu_ps((const float *)block + 16 + 8 * (h0 + s));
            }
            block += header_bytes(type);
        }
        if (h0 == 0)
            for (int l = 0; l < group_bytes(type); l += 64)
                _mm_prefetch((const char *)block + PREFETCH_GROUPS * group_bytes(type) + l,
                             _MM_HINT_T0);
        for (int s = 0; s < span; s++) {
            __m256i c[8], ch[8];
            half_codes(hb, block, h0 + s, c, ch);
            __m256 ws0, ws1, z0, z1;
            group_params(type, block + 256 + 64 * hb, h0 + s, d[s], dmin[s], &ws0, &ws1, &z0,
                         &z1);
            for (int r = 0; r < NR; r++) {
                int row = r0 + r;
                size_t at = (size_t)row * x.groups + g;
                acc[r][s] = row_step(type, c, ch,
                                     (const int32_t *)(x.q + (size_t)row * x.k + g * GROUP),
                                     x.a[at], x.b0[at], x.b1[at], ws0, ws1, z0, z1, acc[r][s]);
            }
        }
        block += group_bytes(type);
    }
    for (int r = 0; r < NR; r++)
        for (int s = 0; s < span; s++) {
            int column = t * TILE + 8 * (h0 + s);
            __m256 v = acc[r][s];
            if (bias)
                v = _mm256_add_ps(v, _mm256_loadu_ps(bias + column));
            _mm256_storeu_ps(out + (size_t)(r0 + r) * n + column, v);
        }
}

/* Several rows go half by half over the whole tile: their accumulators beside 8 vectors of
 * codes fit AVX2's 16 registers only for one half at a time (both spill: 12% slower); one row
 * reads each group once for both halves (8% faster than two passes). */
static inline __attribute__((always_inline)) void tile_rows(int NR, int type, const uint8_t *w,
                                                             struct rows x, int r0, int t,
                                                             const float *bias, float *out,
                                                             int n) {
    if (NR == 1) {
        tile_pass(NR, type, w, x, r0, t, bias, out, n, 0, 2);
    } else {
        tile_pass(NR, type, w, x, r0, t, bias, out, n, 0, 1);
        tile_pass(NR, type, w, x, r0, t, bias, out, n, 1, 1);
    }
}

#define TILE_CASE(NR, T)                                                                       \
    case T: tile_rows(NR, T, w, x, r0, t, bias, out, n); break;
#define TILE_ROWS(NR)                                                                          \
    static void tile_rows_##NR(int type, const uint8_t *w, struct rows x, int r0, int t,       \
                               const float *bias, float *out, int n) {                          \
        switch (type) {                                                                        \
            TILE_CASE(NR, Q4_0) TILE_CASE(NR, Q4_1) TILE_CASE(NR, Q5_0) TILE_CASE(NR, Q5_1)     \
            TILE_CASE(NR, Q8_0) TILE_CASE(NR, Q4K) TILE_CASE(NR, Q5K) TILE_CASE(NR, Q6K)        \
        }                                                                                      \
    }
#endif
TILE_ROWS(1)
TILE_ROWS(2)
TILE_ROWS(3)
TILE_ROWS(4)

/* x's rows quantized into scratch (rows*k bytes, then 3*rows*k/GROUP floats) */
static struct rows quantize_rows(const float *x, int rows, int k, void *scratch) {
    int groups = k / GROUP;
    int8_t *q = (int8_t *)scratch;
    float *a = (float *)(q + (size_t)rows * k), *b0 = a + rows * groups, *b1 = b0 + rows * groups;
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * k, k, q + (size_t)r * k, a + r * groups, b0 + r * groups,
                     b1 + r * groups);
    struct rows xs = {q, a, b0, b1, k, groups};
    return xs;
}

/* One tile of one packed weight for every row, 4 rows at a time. */
static void tile_all_rows(int type, const uint8_t *w, struct rows xs, int rows, int t,
                          const float *bias, float *out, int out_stride) {
    for (int r0 = 0; r0 < rows; r0 += 4) {
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: tile_rows_1(type, w, xs, r0, t, bias, out, out_stride); break;
        case 2: tile_rows_2(type, w, xs, r0, t, bias, out, out_stride); break;
        case 3: tile_rows_3(type, w, xs, r0, t, bias, out, out_stride); break;
        default: tile_rows_4(type, w, xs, r0, t, bias, out, out_stride); break;
        }
    }
}

/* out [rows, n] (row stride out_stride) = x [rows, k] float32 times the packed weight, plus
 * bias (or NULL); rows <= MAX_ROWS. scratch: rows*k bytes plus 3*rows*k/GROUP floats. */
int kq_matmul(int type, const uint8_t *w, int n, int k, const float *x, int rows,
              const float *bias, float *out, int out_stride, void *scratch) {
    if (rows < 1 || rows > MAX_ROWS || !supported(type, n, k))
        return -1;
    struct rows xs = quantize_rows(x, rows, k, scratch);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n / TILE; t++)
        tile_all_rows(type, w, xs, rows, t, bias, out, out_stride);
    return 0;
}

/* Several packed weights that read the same x (a fused projection's parts), their outputs side
 * by side from columns[p]: x quantized once, one parallel region over every part's tiles.
 * Each tile runs as kq_matmul runs it, so the outputs are kq_matmul's bits. */
int kq_matmul_parts(int parts, const int *types, const uint8_t *const *w, const int *ns,
                    const float *const *biases, const int *columns, int k, const float *x,
                    int rows, float *out, int out_stride, void *scratch) {
    int first[9] = {0};
    if (rows < 1 || rows > MAX_ROWS || parts < 1 || parts > 8)
        return -1;
    for (int p = 0; p < parts; p++) {
        if (!supported(types[p], ns[p], k))
            return -1;
        first[p + 1] = first[p] + ns[p] / TILE;
    }
    struct rows xs = quantize_rows(x, rows, k, scratch);
    /* each thread takes its share of every part, as kq_matmul's static split would: parts of
     * unlike types (Q4_K gate, Q6_K up) then cost every thread alike */
#pragma omp parallel
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num();
        for (int p = 0; p < parts; p++) {
            int tiles = first[p + 1] - first[p];
            for (int t = tiles * me / threads; t < tiles * (me + 1) / threads; t++)
                tile_all_rows(types[p], w[p], xs, rows, t, biases[p], out + columns[p],
                              out_stride);
        }
    }
    return 0;
}
