/* ggml_linear: a linear layer over a GGUF tensor's own blocks, on ggml's CPU dot products.
 *
 * Knows: ggml's public CPU type traits (ggml-cpu.h: from_float, vec_dot, vec_dot_type) and
 * row sizes (ggml.h), which this file declares itself so it builds without ggml's headers.
 * Must not know: torch, models, sessions. Called through ctypes from backends/torch/ggml.py.
 *
 * Every output element is one vec_dot call over one weight row and one activation row,
 * each activation row quantized alone by the weight type's vec_dot_type (Q8_K for the
 * K-quants, Q8_0 / Q8_1 for the legacy types): llama.cpp's arithmetic, and a row gets the
 * same bits whatever the number of rows or threads beside it. Threads split the outputs.
 */
#include <stddef.h>
#include <stdint.h>

typedef void (*from_float_t)(const float *x, void *y, int64_t k);
typedef void (*vec_dot_t)(int n, float *s, size_t bs, const void *x, size_t bx,
                          const void *y, size_t by, int nrc);

struct type_traits_cpu { /* ggml-cpu.h: struct ggml_type_traits_cpu */
    from_float_t from_float;
    vec_dot_t vec_dot;
    int vec_dot_type;
    int64_t nrows;
};

extern const struct type_traits_cpu *ggml_get_type_traits_cpu(int type);
extern size_t ggml_row_size(int type, int64_t ne);
extern void ggml_cpu_init(void);

#define CHUNK 16 /* weight rows a thread takes at a time: each stays in L1 across the rows */

void gl_init(void) { ggml_cpu_init(); }

/* The type activations are quantized to for weights of `type`; -1 when ggml cannot dot it. */
int gl_vec_dot_type(int type) {
    const struct type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    return t && t->vec_dot ? t->vec_dot_type : -1;
}

size_t gl_row_size(int type, int64_t k) { return ggml_row_size(type, k); }

/* rows of x [rows, k] float32 into `type` rows (the vec_dot_type of some weight), each alone */
int gl_quantize(int type, const float *x, int rows, int k, uint8_t *out) {
    const struct type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    if (!t || !t->from_float)
        return -1;
    size_t row = ggml_row_size(type, k);
    for (int r = 0; r < rows; r++)
        t->from_float(x + (size_t)r * k, out + (size_t)r * row, k);
    return 0;
}

/* out[r * out_stride + j] = dot(weight row order[j] (or j), activation row r) + bias[j], for
 * j < n; qx holds the rows quantized to this type's vec_dot_type. */
int gl_matmul(int type, const uint8_t *w, const int32_t *order, int n, int k, const uint8_t *qx,
              int rows, const float *bias, float *out, int out_stride) {
    const struct type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    if (!t || !t->vec_dot)
        return -1;
    size_t w_row = ggml_row_size(type, k), x_row = ggml_row_size(t->vec_dot_type, k);
    vec_dot_t dot = t->vec_dot;
    int chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
    for (int c = 0; c < chunks; c++) {
        int end = (c + 1) * CHUNK < n ? (c + 1) * CHUNK : n;
        for (int j = c * CHUNK; j < end; j++) {
            const uint8_t *wj = w + (size_t)(order ? order[j] : j) * w_row;
            for (int r = 0; r < rows; r++) {
                float s;
                dot(k, &s, 0, wj, 0, qx + (size_t)r * x_row, 0, 1);
                out[(size_t)r * out_stride + j] = bias ? s + bias[j] : s;
            }
        }
    }
    return 0;
}
