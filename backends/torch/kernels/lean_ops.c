/* lean_ops: the small float32 steps between a GGUF decoder layer's matmuls (RMSNorm with the
 * residual add, rotary embedding, the KV cache write, attention of each row over the slots it
 * may see, SiLU gating), each one C call in place of several torch ops.
 *
 * Knows: Llama-style layer math (transformers' RMSNorm order, rotate_half rotary, grouped
 * query heads), the static cache layout [kv heads, slots, head_dim] of one layer. Must not
 * know: torch, models, GGUF, drafting. Called through ctypes from backends/torch/lean_ops.py.
 *
 * Why: at one row per forward, the 1.5B Qwen spent about 9 of its 42 ms in these steps, most
 * of it in per-op dispatch rather than arithmetic. Every row is computed alone, in the same
 * order whatever the rows beside it, so a row gets its one-row bits in any verify block and
 * a tree row the bits of its chain twin (its slots are the same keys in the same order).
 *
 * Two builds of one source: AVX-512F/DQ, and AVX2 with FMA for the CPUs without AVX-512 (AMD
 * Zen 2/3, Intel before Ice Lake), chosen by lean_ops.py's flags. Both work on vectors of 16
 * floats (vec, two 8-float halves on AVX2), so every loop and every sum runs in the same order
 * in both; a build's bits are its own, not the other's or torch's.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#define MAX_DIM 256 /* head_dim at most (lean_ops.py checks) */
#define LANES 16    /* floats per vec: every width handed over is a multiple (lean_ops.py) */

#if defined(__AVX512F__)

typedef __m512 vec;

static inline vec v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec v_set(float x) { return _mm512_set1_ps(x); }
static inline vec v_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec v_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec v_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec v_div(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec v_min(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec v_max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec v_fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float v_sum(vec v) { return _mm512_reduce_add_ps(v); }

static inline vec v_round(vec x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* y * 2^n, n integral */
static inline vec v_scale2(vec y, vec n) { return _mm512_scalef_ps(y, n); }

/* the first k of a vec's lanes (0 < k < LANES), zeros beyond them */
static inline vec v_load_first(const float *p, int k) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << k) - 1), p);
}
static inline void v_store_first(float *p, int k, vec v) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << k) - 1), v);
}
static inline vec v_keep_first(vec v, int k) {
    return _mm512_maskz_mov_ps((__mmask16)((1u << k) - 1), v);
}

#else

typedef struct {
    __m256 lo, hi;
} vec;

#define V_EACH(expr_lo, expr_hi) ((vec){expr_lo, expr_hi})
#define V_BINARY(name, op)                                                                    \
    static inline vec name(vec a, vec b) { return V_EACH(op(a.lo, b.lo), op(a.hi, b.hi)); }

static inline vec v_load(const float *p) {
    return V_EACH(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
static inline void v_store(float *p, vec v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline vec v_set(float x) { return V_EACH(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
V_BINARY(v_add, _mm256_add_ps)
V_BINARY(v_sub, _mm256_sub_ps)
V_BINARY(v_mul, _mm256_mul_ps)
V_BINARY(v_div, _mm256_div_ps)
V_BINARY(v_min, _mm256_min_ps)
V_BINARY(v_max, _mm256_max_ps)
static inline vec v_fmadd(vec a, vec b, vec c) {
    return V_EACH(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vec v_fnmadd(vec a, vec b, vec c) {
    return V_EACH(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}

static inline float v_sum(vec v) {
    __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline vec v_round(vec x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return V_EACH(_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode));
}

/* 2^k as a float's exponent bits, for -126 <= k <= 127 */
static inline __m256 pow2i(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

/* y * 2^n as scalef gives it, for y near 1 and -150 <= n <= 128 (what exp16's clamp leaves):
 * in two steps of at most 2^±75, each a normal float; the first product is exact, so the
 * result is rounded once, down to the subnormals */
static inline __m256 scale2_half(__m256 y, __m256 n) {
    __m256i k = _mm256_cvtps_epi32(n), first = _mm256_srai_epi32(k, 1);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2i(first)), pow2i(_mm256_sub_epi32(k, first)));
}
static inline vec v_scale2(vec y, vec n) {
    return V_EACH(scale2_half(y.lo, n.lo), scale2_half(y.hi, n.hi));
}

/* lanes below k of each half, as a mask maskload and maskstore read */
static inline __m256i first_of(int k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* the first k of a vec's lanes (0 < k < LANES), zeros beyond them */
static inline vec v_load_first(const float *p, int k) {
    return V_EACH(_mm256_maskload_ps(p, first_of(k)), _mm256_maskload_ps(p + 8, first_of(k - 8)));
}
static inline void v_store_first(float *p, int k, vec v) {
    _mm256_maskstore_ps(p, first_of(k), v.lo);
    _mm256_maskstore_ps(p + 8, first_of(k - 8), v.hi);
}
static inline vec v_keep_first(vec v, int k) {
    return V_EACH(_mm256_and_ps(v.lo, _mm256_castsi256_ps(first_of(k))),
                  _mm256_and_ps(v.hi, _mm256_castsi256_ps(first_of(k - 8))));
}

#endif

static inline vec v_zero(void) { return v_set(0.0f); }

/* e^x to about 1 ulp: 2^n e^r with r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
 * degree-6 polynomial; clamped so that scalef gives 0 below and a finite value above */
static inline vec exp16(vec x) {
    x = v_min(v_max(x, v_set(-104.0f)), v_set(88.7f));
    vec n = v_round(v_mul(x, v_set(1.44269504088896341f)));
    vec r = v_fnmadd(n, v_set(0.693359375f), x);
    r = v_fnmadd(n, v_set(-2.12194440e-4f), r);
    vec p = v_set(1.9875691500e-4f);
    p = v_fmadd(p, r, v_set(1.3981999507e-3f));
    p = v_fmadd(p, r, v_set(8.3334519073e-3f));
    p = v_fmadd(p, r, v_set(4.1665795894e-2f));
    p = v_fmadd(p, r, v_set(1.6666665459e-1f));
    p = v_fmadd(p, r, v_set(5.0000001201e-1f));
    vec y = v_fmadd(v_mul(p, r), r, v_add(r, v_set(1.0f)));
    return v_scale2(y, n);
}

/* x [n] -> out = w * (x * 1/sqrt(mean(x^2) + eps)), transformers' order of the products */
static void norm_row(const float *x, const float *w, float eps, int n, float *out) {
    vec acc = v_zero();
    for (int i = 0; i < n; i += LANES) {
        vec v = v_load(x + i);
        acc = v_fmadd(v, v, acc);
    }
    float inv = 1.0f / sqrtf(v_sum(acc) / (float)n + eps);
    for (int i = 0; i < n; i += LANES)
        v_store(out + i, v_mul(v_load(w + i), v_mul(v_load(x + i), v_set(inv))));
}

/* rows of x [rows, n]: out = norm(x) (n a multiple of LANES) */
void lo_rmsnorm(const float *x, const float *w, float eps, int rows, int n, float *out) {
    for (int r = 0; r < rows; r++)
        norm_row(x + (size_t)r * n, w, eps, n, out + (size_t)r * n);
}

/* the residual stream goes on: sum = x + delta, normed = norm(sum) */
void lo_add_rmsnorm(const float *x, const float *delta, const float *w, float eps, int rows,
                    int n, float *sum, float *normed) {
    for (int r = 0; r < rows; r++) {
        size_t at = (size_t)r * n;
        for (int i = 0; i < n; i += LANES)
            v_store(sum + at + i, v_add(v_load(x + at + i), v_load(delta + at + i)));
        norm_row(sum + at, w, eps, n, normed + at);
    }
}

/* In place on the first `heads` heads of each row of qkv (row stride `stride`): x * cos +
 * rotate_half(x) * sin, rotate_half(x) = (-x2, x1); cos, sin [rows, dim] */
void lo_rope(float *qkv, int rows, int stride, int heads, int dim, const float *cos,
             const float *sin) {
    int half = dim / 2;
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (size_t)r * dim, *s = sin + (size_t)r * dim;
        for (int h = 0; h < heads; h++) {
            float *x = qkv + (size_t)r * stride + (size_t)h * dim;
            for (int i = 0; i < half; i++) {
                float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* rows' keys and values (at k_at and v_at of each qkv row) into slots first.. of one layer's
 * cache [kv_heads, capacity, dim] */
void lo_store_kv(const float *qkv, int rows, int stride, int k_at, int v_at, int kv_heads,
                 int dim, float *keys, float *values, int capacity, int first) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < kv_heads; g++) {
            size_t slot = ((size_t)g * capacity + first + r) * dim;
            const float *row = qkv + (size_t)r * stride + (size_t)g * dim;
            for (int i = 0; i < dim; i++) {
                keys[slot + i] = row[k_at + i];
                values[slot + i] = row[v_at + i];
            }
        }
}

static inline float dot(const float *a, const float *b, int dim) {
    vec acc = v_zero();
    for (int i = 0; i < dim; i += LANES)
        acc = v_fmadd(v_load(a + i), v_load(b + i), acc);
    return v_sum(acc);
}

static inline int slot_of(int j, int start, int lead, const int *extra) {
    return j < lead ? start + j : extra[j - lead];
}

/* One query head of one row over its slots: slots start..start+lead-1, then
 * extra[0..n_extra-1]. */
static void attend(const float *q, const float *keys, const float *values, int start, int lead,
                   const int *extra, int n_extra, int dim, float scale, float *scores,
                   float *out) {
    int n = lead + n_extra;
    float top = -INFINITY;
    for (int j = 0; j < n; j++) {
        scores[j] = dot(q, keys + (size_t)slot_of(j, start, lead, extra) * dim, dim) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    int j = 0;
    vec total = v_zero();
    for (; j + LANES <= n; j += LANES) {
        vec e = exp16(v_sub(v_load(scores + j), v_set(top)));
        v_store(scores + j, e);
        total = v_add(total, e);
    }
    if (j < n) {
        vec e = exp16(v_sub(v_load_first(scores + j, n - j), v_set(top)));
        v_store_first(scores + j, n - j, e);
        total = v_add(total, v_keep_first(e, n - j));
    }
    float inv = 1.0f / v_sum(total);
    /* one pass over the values, up to MAX_DIM wide in registers; each output element still
     * sums its keys in slot order */
    vec acc[MAX_DIM / LANES];
    for (int i = 0; i < dim / LANES; i++)
        acc[i] = v_zero();
    for (int k = 0; k < n; k++) {
        const float *v = values + (size_t)slot_of(k, start, lead, extra) * dim;
        vec p = v_set(scores[k]);
        for (int i = 0; i < dim / LANES; i++)
            acc[i] = v_fmadd(p, v_load(v + LANES * i), acc[i]);
    }
    for (int i = 0; i < dim / LANES; i++)
        v_store(out + LANES * i, v_mul(acc[i], v_set(inv)));
}

/* out [rows, heads*dim] = softmax(q k^T * scale) v per row and query head, over the row's
 * slots (slots start[r]..prefix[r]-1, then extra[offsets[r]..offsets[r+1]-1]) of one layer's
 * cache; query head h reads kv head h / (heads / kv_heads). q: each qkv row's first heads*dim.
 * A sliding-window row starts past slot 0. */
int lo_attention(const float *qkv, int rows, int stride, int heads, int kv_heads, int dim,
                 const float *keys, const float *values, int capacity, const int *start,
                 const int *prefix, const int *offsets, const int *extra, float scale,
                 float *out) {
    int most = 0, group = heads / kv_heads;
    for (int r = 0; r < rows; r++) {
        int n = prefix[r] - start[r] + offsets[r + 1] - offsets[r];
        most = n > most ? n : most;
    }
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(most + LANES));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < rows * heads; task++) {
            if (!scores)
                continue;
            int r = task / heads, h = task % heads, g = h / group;
            size_t layer = (size_t)g * capacity * dim;
            attend(qkv + (size_t)r * stride + (size_t)h * dim, keys + layer, values + layer,
                   start[r], prefix[r] - start[r], extra + offsets[r],
                   offsets[r + 1] - offsets[r], dim, scale, scores,
                   out + ((size_t)r * heads + h) * dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2*inter]: silu(g) = g / (1 + e^-g) */
void lo_silu_mul(const float *gate_up, int rows, int inter, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i += LANES) {
            vec x = v_load(g + i);
            vec e = exp16(v_sub(v_zero(), x));
            vec silu = v_div(x, v_add(v_set(1.0f), e));
            v_store(o + i, v_mul(silu, v_load(u + i)));
        }
    }
}
