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
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#define MAX_DIM 256 /* head_dim at most (lean_ops.py checks) */

/* e^x to about 1 ulp: 2^n e^r with r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
 * degree-6 polynomial; clamped so that scalef gives 0 below and a finite value above */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* x [n] -> out = w * (x * 1/sqrt(mean(x^2) + eps)), transformers' order of the products */
static void norm_row(const float *x, const float *w, float eps, int n, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps);
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                                _mm512_mul_ps(_mm512_loadu_ps(x + i),
                                                              _mm512_set1_ps(inv))));
}

/* rows of x [rows, n]: out = norm(x) (n a multiple of 16) */
void lo_rmsnorm(const float *x, const float *w, float eps, int rows, int n, float *out) {
    for (int r = 0; r < rows; r++)
        norm_row(x + (size_t)r * n, w, eps, n, out + (size_t)r * n);
}

/* the residual stream goes on: sum = x + delta, normed = norm(sum) */
void lo_add_rmsnorm(const float *x, const float *delta, const float *w, float eps, int rows,
                    int n, float *sum, float *normed) {
    for (int r = 0; r < rows; r++) {
        size_t at = (size_t)r * n;
        for (int i = 0; i < n; i += 16)
            _mm512_storeu_ps(sum + at + i, _mm512_add_ps(_mm512_loadu_ps(x + at + i),
                                                         _mm512_loadu_ps(delta + at + i)));
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
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

static inline int slot_of(int j, int prefix, const int *extra) {
    return j < prefix ? j : extra[j - prefix];
}

/* One query head of one row over its slots: slots 0..prefix-1, then extra[0..n_extra-1]. */
static void attend(const float *q, const float *keys, const float *values, int prefix,
                   const int *extra, int n_extra, int dim, float scale, float *scores,
                   float *out) {
    int n = prefix + n_extra;
    float top = -INFINITY;
    for (int j = 0; j < n; j++) {
        scores[j] = dot(q, keys + (size_t)slot_of(j, prefix, extra) * dim, dim) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    int j = 0;
    __m512 total = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), _mm512_set1_ps(top)));
        _mm512_storeu_ps(scores + j, e);
        total = _mm512_add_ps(total, e);
    }
    if (j < n) {
        __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + j),
                                       _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(scores + j, tail, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    float inv = 1.0f / _mm512_reduce_add_ps(total);
    /* one pass over the values, up to MAX_DIM wide in registers; each output element still
     * sums its keys in slot order */
    __m512 acc[MAX_DIM / 16];
    for (int i = 0; i < dim / 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < n; k++) {
        const float *v = values + (size_t)slot_of(k, prefix, extra) * dim;
        __m512 p = _mm512_set1_ps(scores[k]);
        for (int i = 0; i < dim / 16; i++)
            acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * i), acc[i]);
    }
    for (int i = 0; i < dim / 16; i++)
        _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
}

/* out [rows, heads*dim] = softmax(q k^T * scale) v per row and query head, over the row's
 * slots (prefix[r] first slots, then extra[offsets[r]..offsets[r+1]-1]) of one layer's cache;
 * query head h reads kv head h / (heads / kv_heads). q: each qkv row's first heads*dim. */
int lo_attention(const float *qkv, int rows, int stride, int heads, int kv_heads, int dim,
                 const float *keys, const float *values, int capacity, const int *prefix,
                 const int *offsets, const int *extra, float scale, float *out) {
    int most = 0, group = heads / kv_heads;
    for (int r = 0; r < rows; r++) {
        int n = prefix[r] + offsets[r + 1] - offsets[r];
        most = n > most ? n : most;
    }
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(most + 16));
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
                   prefix[r], extra + offsets[r], offsets[r + 1] - offsets[r], dim, scale,
                   scores, out + ((size_t)r * heads + h) * dim);
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
        for (int i = 0; i < inter; i += 16) {
            __m512 x = _mm512_loadu_ps(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        }
    }
}
