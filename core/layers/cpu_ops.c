/* Fused CPU ops for single-stream decode: the small per-layer work that costs more in torch op dispatch
 * (~3-30 us an op on a 2-core VM) than in arithmetic.
 *
 * Built at first use by cpu_ops.py (cc -O3 -march=native -ffp-contract=off) and called through ctypes. All
 * float32, single-threaded (the work per call is microseconds: a parallel region would cost more than it
 * saves, and on a shared machine it stalls; gguf_cpu.c NOTE 6).
 *
 *   cpu_add_rms_norm       out = norm(x + res) * w, res_out = x + res      (res NULL: out = norm(x) * w)
 *   cpu_rotary_neox        q, k rotated in place, neox halves, first `rot` dims of each head
 *   cpu_silu_and_mul       out = silu(x[:, :d]) * x[:, d:]
 *   cpu_decode_attention   write each decode's new K/V row into the paged cache, then one query per request
 *                          attends over its blocks (through the block table: no gather copy)
 *
 * NOTE 1: not bit-identical to torch (sums in another order, libm's expf), so the engine uses these only
 * where no bit-exact reference is promised (weights kept quantized; fused_ops.py set_cpu_ops). The rotary
 * is bit-identical: x1 * c - x2 * s computed without contraction is what torch computes.
 * NOTE 2: sums of 8 lanes then a fixed tree, in float32 (torch's own reductions are blocked the same way);
 * tests bound the difference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CPU_SIMD 1
#endif

/* sum of a[i] * b[i] for i < n (NOTE 2) */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef CPU_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    s = _mm_cvtss_f32(h);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[i] += a * x[i] */
static inline void axpy(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
#ifdef CPU_SIMD
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(va, _mm256_loadu_ps(x + i))));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

/* x, res, out, res_out: [T, H] contiguous (res, res_out NULL for a plain norm; res_out may alias res).
 * gemma: scale by (1 + w) instead of w. */
void cpu_add_rms_norm(const float *x, const float *res, const float *w, float eps, int gemma, int64_t T,
                      int64_t H, float *out, float *res_out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        if (res) {
            float *r = res_out + t * H;
            const float *rr = res + t * H;
            for (int64_t i = 0; i < H; i++) r[i] = xr[i] + rr[i];
            xr = r;
        }
        const float scale = 1.f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        if (gemma)
            for (int64_t i = 0; i < H; i++) o[i] = xr[i] * scale * (1.f + w[i]);
        else
            for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

static void rotate_rows(float *x, int64_t stride, int64_t heads, int64_t head, int64_t T, const int64_t *pos,
                        const float *cos, const float *sin, int64_t half) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * half, *s = sin + pos[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * stride + h * head, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* q: T rows of nq heads (row stride qs floats), k likewise; heads `head` floats apart; cos/sin [*, half]
 * rows indexed by pos[t]; the first 2 * half dims of each head rotate (neox), the rest stay. */
void cpu_rotary_neox(float *q, int64_t qs, int64_t nq, float *k, int64_t ks, int64_t nk, int64_t head, int64_t T,
                     const int64_t *pos, const float *cos, const float *sin, int64_t half) {
    rotate_rows(q, qs, nq, head, T, pos, cos, sin, half);
    rotate_rows(k, ks, nk, head, T, pos, cos, sin, half);
}

/* x [T, 2d] contiguous -> out [T, d]: silu(gate) * up, silu(g) = g / (1 + exp(-g)) */
void cpu_silu_and_mul(const float *x, int64_t T, int64_t d, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* D decodes, one query each. q [D, nh, head] (row stride qs), k_new / v_new [D, nkv, head] (row strides ks,
 * vs); cache [2, num_blocks, bs, nkv, head] contiguous; slots [D] where the new rows go; block_table [*, bts]
 * int32; seq_lens [D] int32 (the new token included); window 0 = none, else the last `window` positions;
 * soft_cap 0 = none. out [D, nh, head] contiguous. Returns 0, or -1 when out of memory. */
int cpu_decode_attention(const float *q, int64_t qs, const float *k_new, int64_t ks, const float *v_new,
                         int64_t vs, float *cache, int64_t num_blocks, int64_t bs, int64_t nkv, int64_t head,
                         int64_t nh, const int64_t *slots, const int32_t *block_table, int64_t bts,
                         const int32_t *seq_lens, int64_t D, float scale, int64_t window, float soft_cap,
                         float *out) {
    const int64_t row = nkv * head, v_off = num_blocks * bs * row, group = nh / nkv;
    for (int64_t d = 0; d < D; d++) {
        memcpy(cache + slots[d] * row, k_new + d * ks, row * sizeof(float));
        memcpy(cache + v_off + slots[d] * row, v_new + d * vs, row * sizeof(float));
    }
    int64_t max_len = 0;
    for (int64_t d = 0; d < D; d++) max_len = seq_lens[d] > max_len ? seq_lens[d] : max_len;
    float *p = malloc((max_len + 1) * sizeof(float));
    if (!p) return -1;
    for (int64_t d = 0; d < D; d++) {
        const int64_t len = seq_lens[d], first = window > 0 && len > window ? len - window : 0;
        const int32_t *bt = block_table + d * bts;
        for (int64_t h = 0; h < nh; h++) {
            const int64_t g = h / group;
            const float *qh = q + d * qs + h * head;
            float m = -INFINITY;
            for (int64_t j = first; j < len; j++) {
                const float *kr = cache + ((int64_t)bt[j / bs] * bs + j % bs) * row + g * head;
                float s = dot(qh, kr, head) * scale;
                if (soft_cap > 0.f) s = soft_cap * tanhf(s / soft_cap);
                p[j - first] = s;
                m = s > m ? s : m;
            }
            float sum = 0.f;
            for (int64_t j = 0; j < len - first; j++) {
                p[j] = expf(p[j] - m);
                sum += p[j];
            }
            float *o = out + (d * nh + h) * head;
            memset(o, 0, head * sizeof(float));
            for (int64_t j = first; j < len; j++) {
                const float *vr = cache + v_off + ((int64_t)bt[j / bs] * bs + j % bs) * row + g * head;
                axpy(p[j - first], vr, o, head);
            }
            const float inv = 1.f / sum;
            for (int64_t i = 0; i < head; i++) o[i] *= inv;
        }
    }
    free(p);
    return 0;
}
