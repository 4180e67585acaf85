/* Fused CPU ops for single-stream decode: the small per-layer work that costs more in torch op dispatch
 * (~3-30 us an op on a 2-core VM) than in arithmetic.
 *
 * Built at first use by cpu_ops.py (cc -O3 -march=native -ffp-contract=off -fopenmp) and called through
 * ctypes. All float32, single-threaded (the work per call is microseconds: a parallel region would cost more
 * than it saves, and on a shared machine it stalls; gguf_cpu.c NOTE 6) but a batch's decode attention (NOTE 6)
 * and a prefill chunk's norm and rotary (NOTE 12); cpu_decode_step's row products run on their own library's
 * threads.
 *
 *   cpu_add_rms_norm       out = norm(x + res) * w, res_out = x + res      (res NULL: out = norm(x) * w)
 *   cpu_rotary_neox        q, k rotated in place, neox halves, first `rot` dims of each head
 *   cpu_silu_and_mul       out = silu(x[:, :d]) * x[:, d:]
 *   cpu_decode_attention   write each decode's new K/V row into the paged cache, then one query per request
 *                          attends over its blocks (through the block table: no gather copy); a float32 or a
 *                          bf16 cache (NOTE 9)
 *   cpu_decode_step        a Llama model's whole one-token decode: the ops above and each layer's row products
 *                          (function pointers into the matmul library), layer after layer (NOTE 5)
 *   cpu_silu_and_mul_bf16  the same activation on the bf16 GEMM's [gate | up] output, bf16 out (NOTE 7)
 *   cpu_top_k              each row's k largest values' indices (the LM head's candidates: NOTE 8)
 *
 * NOTE 1: not bit-identical to torch (sums in another order, our own exp: NOTE 4), so the engine uses these only
 * where no bit-exact reference is promised (weights kept quantized; fused_ops.py set_cpu_ops). The rotary
 * is bit-identical: x1 * c - x2 * s computed without contraction is what torch computes.
 * NOTE 2: sums of 8 lanes (fused multiply-adds, written as intrinsics: -ffp-contract=off only stops the
 * compiler from fusing on its own) then a fixed tree, in float32; tests bound the difference.
 * NOTE 4: exp for softmax and SiLU is Cephes' single-precision polynomial on 8 lanes (~1-2 ulp, like torch's
 * own vectorized exp; libm's scalar expf for tails and without AVX2): libm's took ~6.5 ns a value here,
 * ~10 us of a layer's SiLU and as much of a 160-token attention.
 * NOTE 6: a batch's decode attention is milliseconds, not microseconds (32 SmolLM2 requests of ~200 tokens:
 * ~3.7M multiply-adds a layer, a sixth of the batch's decode step on one thread), so from MT_MIN_MACS on its
 * requests are shared out over `threads` OpenMP threads (torch's libgomp: gguf_cpu.c NOTE 3), one request at
 * a time from a shared counter. Each request is computed by one thread with the same code in the same order,
 * so every output keeps its bits whatever the thread count.
 * NOTE 7: a batch's MLP activation on bf16 (the gguf method's apply_act_and_mul): silu(g) * u in float32 from
 * the bf16 gate and up, rounded to bf16 once (round to nearest even, NaN kept), in one pass with rows shared
 * over `threads` from MT_MIN_ELEMS outputs on. torch's F.silu(gate).mul_(up) took two passes over strided
 * halves and rounded twice: SmolLM2's [2048, 3072] took 1.2 ms a layer on 2 threads (2026-12-02).
 * NOTE 12: the norm and the rotary share a prefill chunk's rows over `threads` (the `_mt` entry points) from
 * MT_MIN_ELEMS values on, each row computed as on one thread; the one-row decode plan binds the single-threaded
 * entry points. SmolLM2's 2048-row prefill norm took ~0.9 ms a layer on one thread.
 * NOTE 8: the k (<= TOPK_MAX) largest of each row in one pass: 16 values at a time compared with the k-th best so
 * far, the rare winners inserted one by one. The indices come in no set order (the caller recomputes those
 * logits and scatters them back); among equal values the first one seen wins; NaN is never picked. torch.topk
 * took 1.1 ms for SmolLM2's 32 x 49152 logits of a decode step, on one thread.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CPU_SIMD 1
#endif

#define MT_MIN_ELEMS (1L << 18) /* NOTE 7: below, one thread (a team's wake-up costs more than the pass) */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef CPU_SIMD
/* the 8 lanes' sum: halves, then pairs, then the last two (one fixed tree, so every caller rounds alike) */
static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* sum of a[i] * b[i] for i < n (NOTE 2) */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef CPU_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
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
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

#ifdef CPU_SIMD
/* 8 bf16 widened to float32 in registers (exact: a bf16 is the top half of a float32; what AVX512-BF16's
 * vcvtpbh2ps does too) */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* dot() with b a bf16 cache row (NOTE 9): the same lanes, order and tree, each b widened exactly */
static inline float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef CPU_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8_bf16(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8_bf16(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8_bf16(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * bf16_to_f32(b[i]);
    return s;
}

/* axpy() with x a bf16 cache row (NOTE 9) */
static inline void axpy_bf16(float a, const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
#ifdef CPU_SIMD
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8_bf16(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * bf16_to_f32(x[i]);
}

#ifdef CPU_SIMD
/* e^x on 8 lanes (NOTE 4): Cephes' expf -- n = round(x log2 e), r = x - n ln 2 in two parts, a degree-7
 * polynomial, times 2^n built in the exponent bits. Inputs clamped to [-88, 88]: below, 0 or a value under
 * 1e-38 (no subnormals); above, no overflow to inf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* p[j] = exp(p[j] - m) for j < n; returns their sum */
static inline float exp_shifted(float *p, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.f;
#ifdef CPU_SIMD
    __m256 acc = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
        _mm256_storeu_ps(p + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    return sum;
}

/* x, res, out, res_out: [T, H] contiguous (res, res_out NULL for a plain norm; res_out may alias res).
 * gemma: scale by (1 + w) instead of w. */
/* NOTE 12 */
void cpu_add_rms_norm_mt(const float *x, const float *res, const float *w, float eps, int gemma, int64_t T,
                         int64_t H, float *out, float *res_out, int threads) {
    const int nt = threads > 1 && T > 1 && T * H >= MT_MIN_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
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

void cpu_add_rms_norm(const float *x, const float *res, const float *w, float eps, int gemma, int64_t T,
                      int64_t H, float *out, float *res_out) {
    cpu_add_rms_norm_mt(x, res, w, eps, gemma, T, H, out, res_out, 1);
}

static void rotate_rows(float *x, int64_t stride, int64_t heads, int64_t head, int64_t T, const int64_t *pos,
                        const float *cos, const float *sin, int64_t half, int threads) {
    const int nt = threads > 1 && T > 1 && T * heads * head >= MT_MIN_ELEMS ? threads : 1; /* NOTE 12 */
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
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
void cpu_rotary_neox_mt(float *q, int64_t qs, int64_t nq, float *k, int64_t ks, int64_t nk, int64_t head,
                        int64_t T, const int64_t *pos, const float *cos, const float *sin, int64_t half, int threads) {
    rotate_rows(q, qs, nq, head, T, pos, cos, sin, half, threads);
    rotate_rows(k, ks, nk, head, T, pos, cos, sin, half, threads);
}

void cpu_rotary_neox(float *q, int64_t qs, int64_t nq, float *k, int64_t ks, int64_t nk, int64_t head, int64_t T,
                     const int64_t *pos, const float *cos, const float *sin, int64_t half) {
    cpu_rotary_neox_mt(q, qs, nq, k, ks, nk, head, T, pos, cos, sin, half, 1);
}

/* x [T, 2d] contiguous -> out [T, d]: silu(gate) * up, silu(g) = g / (1 + exp(-g)) */
void cpu_silu_and_mul(const float *x, int64_t T, int64_t d, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
#ifdef CPU_SIMD
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                                  _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < d; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* D decodes, one query each. q [D, nh, head] (row stride qs), k_new / v_new [D, nkv, head] (row strides ks,
 * vs); cache [2, num_blocks, bs, nkv, head] contiguous, float32 or bf16 (kv_bf16, NOTE 9); slots [D] where the new rows go; block_table [*, bts]
 * int32; seq_lens [D] int32 (the new token included); window 0 = none, else the last `window` positions;
 * soft_cap 0 = none. out [D, nh, head] contiguous. Returns 0, or -1 when out of memory.
 * NOTE 3: one pass over the keys, then one over the values: each cache row (every KV head of one position,
 * contiguous) is read once, by all the query heads, and the row PREFETCH_AHEAD positions on is asked for
 * meanwhile. In single-stream decode a layer's cache rows are never in the CPU caches (the ~90 MB of weights
 * each token streams evict them); reading one KV head's slice of every row, then the next head's, took
 * 41 us a layer at ~100 positions (1.2 ms of an 11 ms token), three strided passes from memory per tensor.
 * Each score and each output row is the same sum, in the same order, as head by head. */
#define PREFETCH_AHEAD 4
#define MT_MIN_MACS (1L << 20) /* NOTE 6 */

/* NOTE 11: a power-of-two page size (every size the engine picks) takes a shift and a mask, not a 64-bit division */
static inline int64_t cache_slot(const int32_t *bt, int64_t bs, int64_t j) {
    if ((bs & (bs - 1)) == 0) {
        const int sh = __builtin_ctzll((unsigned long long)bs);
        return ((int64_t)bt[j >> sh] << sh) | (j & (bs - 1));
    }
    return (int64_t)bt[j / bs] * bs + j % bs;
}

static inline void prefetch_bytes(const char *r, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(r + i, 0, 3);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* NOTE 10: with AVX-512 (and a head a multiple of 16), one request's attention four positions at a time. Scores:
 * for each query head the four rows' dot products on 16 lanes, their four horizontal sums in one shuffle tree
 * (reduce4_16); values: each output row is loaded and stored once per four positions, not once per position,
 * with the same multiply-adds in the same order as axpy (lane for lane: the value pass keeps its bits). The row
 * loop made ~13 instructions of loads, stores and reductions per multiply-add vector on 8 lanes; SmolLM2's
 * 128-request batch (~190 positions each, 9 / 3 heads of 64) took 3.8 ms a layer on one thread, ~10 GB/s of a
 * float32 cache: bound by instructions and memory latency, not bandwidth. Rows are still read once each, in order
 * (NOTE 3); the rows PF_AHEAD positions on are asked for a share per query head, spread over the block's work:
 * the whole block's lines at once (48 for float32 rows of SmolLM2) overran the core's outstanding misses and
 * ran slower than NOTE 3's row per position. One thread, that batch, min of 6 (2026-12-02, a neighbour busy on
 * the other core): 3.3 -> 2.6 ms float32, 2.1 ms bf16 (ahead 4 rows a burst: 5.3 / 2.7; 12: 2.9 / 2.5; 16:
 * 4.2 / 2.2; no software prefetch 8.0 / 4.2).
 * NOTE 11: each key row's slice of a KV head is widened once for up to four of its query heads (dots4: 4 x 4
 * accumulators), each value row's once for all of them, and the rows ahead are asked for into L2 (prefetcht1)
 * 16 positions on rather than into L1 8 on (the likely reason it gains: L1 prefetches occupy the core's few
 * L1 miss buffers, which the loads then wait for). Every sum keeps its order, so the bits are NOTE 10's. SmolLM2's 128-request batch
 * (129..255 positions, bf16 cache, blocks scattered, 30 layers' caches in turn so rows come from memory), min
 * of 6, 2026-12-03, A B in one process: 1.45-1.53 -> 1.17-1.31 ms a layer on 2 threads, 2.6 -> 2.3 on one;
 * a float32 cache 2.6 -> 2.0 ms; Llama-3.1-8B's heads (32 on 8, head 128), 64 requests, 3.1 -> 2.8 ms. The
 * L1-resident case (32 requests, one layer) 0.60 -> 0.52 ms. */
#define DA_AVX512 1
#define PF_AHEAD 16
#define PF_HINT 2 /* prefetcht1: NOTE 11 */

static inline __m512 load16_row(const char *r, int64_t i, const int bf16) {
    if (bf16) /* widened exactly: what AVX512-BF16's vcvtpbh2ps does */
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)r + i))), 16));
    return _mm512_loadu_ps((const float *)r + i);
}

static inline __m128 reduce4_16(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* the scores of query heads h0 .. h0 + SG - 1 (one KV head's, at byte offset `at` of a row) against four rows
 * (NOTE 10, 11): chunk by chunk, each row's chunk widened once for all SG heads */
static inline __attribute__((always_inline)) void dots4(const float *qd, const char *const kr[4], int64_t at,
                                                        int64_t h0, int64_t head, float s4[][4], const int SG,
                                                        const int bf16) {
    __m512 acc[4][4];
    for (int hh = 0; hh < SG; hh++)
        for (int t = 0; t < 4; t++) acc[hh][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < head; c += 16) {
        const __m512 k0 = load16_row(kr[0] + at, c, bf16), k1 = load16_row(kr[1] + at, c, bf16);
        const __m512 k2 = load16_row(kr[2] + at, c, bf16), k3 = load16_row(kr[3] + at, c, bf16);
        for (int hh = 0; hh < SG; hh++) {
            const __m512 x = _mm512_loadu_ps(qd + (h0 + hh) * head + c);
            acc[hh][0] = _mm512_fmadd_ps(x, k0, acc[hh][0]);
            acc[hh][1] = _mm512_fmadd_ps(x, k1, acc[hh][1]);
            acc[hh][2] = _mm512_fmadd_ps(x, k2, acc[hh][2]);
            acc[hh][3] = _mm512_fmadd_ps(x, k3, acc[hh][3]);
        }
    }
    for (int hh = 0; hh < SG; hh++) _mm_storeu_ps(s4[hh], reduce4_16(acc[hh][0], acc[hh][1], acc[hh][2], acc[hh][3]));
}

/* scores p[h * n + j - first] of one request's positions first .. len-1 (NOTE 10, 11) */
static inline __attribute__((always_inline)) void scores4(const float *qd, const char *keys, const int32_t *bt,
                                                          int64_t bs, int64_t row_bytes, int64_t nh, int64_t group,
                                                          int64_t head, int64_t first, int64_t len, float scale,
                                                          float soft_cap, float *p, const int bf16) {
    const int64_t n = len - first, esz = bf16 ? 2 : 4, nkv = nh / group;
    const int64_t subs = (group + 3) / 4, parts = nkv * subs; /* (KV head, <= 4 of its query heads) pieces */
    for (int64_t j = first; j < len; j += 4) {
        const int64_t m = len - j < 4 ? len - j : 4; /* past the end: row j again, its scores dropped */
        const char *kr[4];
        for (int64_t t = 0; t < 4; t++) kr[t] = keys + cache_slot(bt, bs, t < m ? j + t : j) * row_bytes;
        const char *pf[4]; /* the rows PF_AHEAD on, asked for a share per piece (NOTE 10) */
        int64_t npf = 0;
        for (int64_t t = PF_AHEAD; t < PF_AHEAD + 4; t++)
            if (j + t < len) pf[npf++] = keys + cache_slot(bt, bs, j + t) * row_bytes;
        const int64_t lines = row_bytes / 64, per_part = (npf * lines + parts - 1) / parts;
        for (int64_t part = 0; part < parts; part++) {
            for (int64_t x = part * per_part; x < (part + 1) * per_part && x < npf * lines; x++)
                __builtin_prefetch(pf[x / lines] + x % lines * 64, 0, PF_HINT);
            const int64_t g = part / subs, h0 = g * group + part % subs * 4;
            const int64_t sg = g * group + group - h0 < 4 ? g * group + group - h0 : 4;
            const int64_t at = g * head * esz;
            float s4[4][4];
            switch (sg) {
            case 1: dots4(qd, kr, at, h0, head, s4, 1, bf16); break;
            case 2: dots4(qd, kr, at, h0, head, s4, 2, bf16); break;
            case 3: dots4(qd, kr, at, h0, head, s4, 3, bf16); break;
            default: dots4(qd, kr, at, h0, head, s4, 4, bf16); break;
            }
            for (int64_t hh = 0; hh < sg; hh++)
                for (int64_t t = 0; t < m; t++) {
                    float sc = s4[hh][t] * scale;
                    if (soft_cap > 0.f) sc = soft_cap * tanhf(sc / soft_cap);
                    p[(h0 + hh) * n + j - first + t] = sc;
                }
        }
    }
}

/* od[h] = sum_j p[h][j] V_j for one request (NOTE 10, 11): od zeroed first, the positions in order */
static inline __attribute__((always_inline)) void values4(const char *values, const int32_t *bt, int64_t bs,
                                                          int64_t row_bytes, int64_t nh, int64_t group, int64_t head,
                                                          int64_t first, int64_t len, const float *p, float *od,
                                                          const int bf16) {
    const int64_t n = len - first, esz = bf16 ? 2 : 4, nkv = nh / group;
    memset(od, 0, nh * head * sizeof(float));
    for (int64_t j = first; j < len; j += 4) {
        const int64_t m = len - j < 4 ? len - j : 4;
        const char *vr[4];
        for (int64_t t = 0; t < 4; t++) vr[t] = values + cache_slot(bt, bs, t < m ? j + t : j) * row_bytes;
        const char *pf[4]; /* the rows PF_AHEAD on, asked for a share per KV head (NOTE 10) */
        int64_t npf = 0;
        for (int64_t t = PF_AHEAD; t < PF_AHEAD + 4; t++)
            if (j + t < len) pf[npf++] = values + cache_slot(bt, bs, j + t) * row_bytes;
        const int64_t lines = row_bytes / 64, per_g = (npf * lines + nkv - 1) / nkv;
        for (int64_t g = 0; g < nkv; g++) {
            for (int64_t x = g * per_g; x < (g + 1) * per_g && x < npf * lines; x++)
                __builtin_prefetch(pf[x / lines] + x % lines * 64, 0, PF_HINT);
            const int64_t at = g * head * esz;
            for (int64_t c = 0; c < head; c += 16) {
                const __m512 v0 = load16_row(vr[0] + at, c, bf16), v1 = load16_row(vr[1] + at, c, bf16);
                const __m512 v2 = load16_row(vr[2] + at, c, bf16), v3 = load16_row(vr[3] + at, c, bf16);
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *ph = p + h * n + j - first;
                    float *o = od + h * head + c;
                    __m512 acc = _mm512_loadu_ps(o);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(ph[0]), v0, acc);
                    if (m > 1) acc = _mm512_fmadd_ps(_mm512_set1_ps(ph[1]), v1, acc);
                    if (m > 2) acc = _mm512_fmadd_ps(_mm512_set1_ps(ph[2]), v2, acc);
                    if (m > 3) acc = _mm512_fmadd_ps(_mm512_set1_ps(ph[3]), v3, acc);
                    _mm512_storeu_ps(o, acc);
                }
            }
        }
    }
}

#endif

/* NOTE 9: kv_bf16 = the cache holds bf16 (kv_cache.cache_dtype bfloat16): each new K/V row is rounded to bf16
 * (to nearest even, as torch's .to(torch.bfloat16)) as it is written, and cache rows are widened to float32 in
 * registers as they are read (dot_bf16, axpy_bf16: the same lanes and order as the float32 path); q, the
 * scores, the softmax and out stay float32. The query is not rounded (AVX512-BF16's dpbf16 would need it in
 * bf16 too): the stored K/V are the only values bf16 touches. A decode batch's attention reads the cache from
 * memory (~31 of ~40 GB/s in float32 on SmolLM2's 128-request batch, 2026-12-02), so half the bytes is the
 * gain; the widening is two integer ops per 8 values. */
int cpu_decode_attention(const float *q, int64_t qs, const float *k_new, int64_t ks, const float *v_new,
                         int64_t vs, void *cache, int64_t num_blocks, int64_t bs, int64_t nkv, int64_t head,
                         int64_t nh, const int64_t *slots, const int32_t *block_table, int64_t bts,
                         const int32_t *seq_lens, int64_t D, float scale, int64_t window, float soft_cap,
                         float *out, int threads, int kv_bf16) {
    const int64_t row = nkv * head, v_off = num_blocks * bs * row, group = nh / nkv;
    const int64_t esz = kv_bf16 ? 2 : 4, row_bytes = row * esz;
    char *const keys = (char *)cache, *const values = keys + v_off * esz;
    for (int64_t d = 0; d < D; d++) {
        if (kv_bf16) {
            uint16_t *kd = (uint16_t *)keys + slots[d] * row, *vd = (uint16_t *)values + slots[d] * row;
            for (int64_t i = 0; i < row; i++) {
                kd[i] = f32_to_bf16(k_new[d * ks + i]);
                vd[i] = f32_to_bf16(v_new[d * vs + i]);
            }
        } else {
            memcpy(keys + slots[d] * row_bytes, k_new + d * ks, row_bytes);
            memcpy(values + slots[d] * row_bytes, v_new + d * vs, row_bytes);
        }
    }
    int64_t max_len = 0, total = 0;
    for (int64_t d = 0; d < D; d++) {
        max_len = seq_lens[d] > max_len ? seq_lens[d] : max_len;
        total += seq_lens[d];
    }
    const int nt = threads > 1 && D > 1 && total * nh * head >= MT_MIN_MACS ? (D < threads ? (int)D : threads) : 1;
    const int64_t per_thread = (max_len + 1) * nh;
    float *scratch = malloc(per_thread * nt * sizeof(float)); /* p[h * n + j]: query head h, position j */
    if (!scratch) return -1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t d = 0; d < D; d++) {
        float *p = scratch + per_thread * omp_get_thread_num();
        const int64_t len = seq_lens[d], first = window > 0 && len > window ? len - window : 0, n = len - first;
        const int32_t *bt = block_table + d * bts;
        const float *qd = q + d * qs; /* query head h = g * group + hh reads KV head g (GQA) */
        float *od = out + d * nh * head;
#ifdef DA_AVX512
        if (head % 16 == 0) { /* NOTE 10 */
            if (kv_bf16) scores4(qd, keys, bt, bs, row_bytes, nh, group, head, first, len, scale, soft_cap, p, 1);
            else scores4(qd, keys, bt, bs, row_bytes, nh, group, head, first, len, scale, soft_cap, p, 0);
        } else
#endif
        for (int64_t j = first; j < len; j++) {
            if (j + PREFETCH_AHEAD < len) prefetch_bytes(keys + cache_slot(bt, bs, j + PREFETCH_AHEAD) * row_bytes, row_bytes);
            const char *kr = keys + cache_slot(bt, bs, j) * row_bytes;
            for (int64_t h = 0; h < nh; h++) {
                const int64_t at = h / group * head;
                float s = (kv_bf16 ? dot_bf16(qd + h * head, (const uint16_t *)kr + at, head)
                                   : dot(qd + h * head, (const float *)kr + at, head)) * scale;
                if (soft_cap > 0.f) s = soft_cap * tanhf(s / soft_cap);
                p[h * n + j - first] = s;
            }
        }
        for (int64_t h = 0; h < nh; h++) {
            float *ph = p + h * n, m = -INFINITY;
            int64_t j = 0;
#ifdef DA_AVX512
            if (n >= 16) { /* max_ps(x, acc) is (x > acc ? x : acc), the loop below's rule */
                __m512 mv = _mm512_set1_ps(-INFINITY);
                for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(ph + j), mv);
                m = _mm512_reduce_max_ps(mv);
            }
#endif
            for (; j < n; j++) m = ph[j] > m ? ph[j] : m;
            const float inv = 1.f / exp_shifted(ph, n, m);
            for (int64_t j = 0; j < n; j++) ph[j] *= inv;
        }
#ifdef DA_AVX512
        if (head % 16 == 0) {
            if (kv_bf16) values4(values, bt, bs, row_bytes, nh, group, head, first, len, p, od, 1);
            else values4(values, bt, bs, row_bytes, nh, group, head, first, len, p, od, 0);
            continue;
        }
#endif
        memset(od, 0, nh * head * sizeof(float));
        for (int64_t j = first; j < len; j++) {
            if (j + PREFETCH_AHEAD < len) prefetch_bytes(values + cache_slot(bt, bs, j + PREFETCH_AHEAD) * row_bytes, row_bytes);
            const char *vr = values + cache_slot(bt, bs, j) * row_bytes;
            for (int64_t h = 0; h < nh; h++) {
                const int64_t at = h / group * head;
                if (kv_bf16) axpy_bf16(p[h * n + j - first], (const uint16_t *)vr + at, od + h * head, head);
                else axpy(p[h * n + j - first], (const float *)vr + at, od + h * head, head);
            }
        }
    }
    free(scratch);
    return 0;
}

/* ---- A whole one-token decode step of a Llama model in one call (NOTE 5) ---------------------------------- */

/* A one-row product y [1, n] = x [1, k] @ W^T as the matmul library's C function takes it (gguf_matmul's
 * signature: type, weights, n, k, x, rows, y, threads; non-zero = not supported). */
typedef int (*row_matmul_fn)(int, const void *, int64_t, int64_t, const float *, int64_t, float *, int);

typedef struct {
    row_matmul_fn fn;
    int64_t type;
    const void *w;
    int64_t n, k;
    const float *x;
    float *y;
} cpu_row_product;

typedef struct {
    const float *norm1, *norm2; /* input_layernorm / post_attention_layernorm weights */
    float eps1, eps2;
    int64_t gemma1, gemma2;
    int64_t qkv, o, gate_up, down, end; /* products[qkv .. o) are qkv's pieces, and so on; `end` closes down's */
    float scale, soft_cap;
    int64_t window;
    void *cache; /* this layer's [2, num_blocks, bs, nkv, head], float32 or bf16 (kv_bf16) */
} cpu_decode_layer;

typedef struct {
    const cpu_decode_layer *layers;
    int64_t num_layers;
    const cpu_row_product *products;
    int threads;
    int64_t hidden, inter;
    /* the step's inputs: the embedding row, positions [1], the attention metadata's slot, table row, length */
    const float *x;
    const int64_t *positions, *slots;
    const int32_t *block_table;
    int64_t block_table_stride;
    const int32_t *seq_lens;
    /* shapes: heads, KV cache */
    int64_t nh, nkv, head, num_blocks, block_size;
    /* rotary tables [max_position, half] */
    const float *cos, *sin;
    int64_t half;
    /* scratch, all [1, *]: qkv (q | k | v), attention output, normed input, MLP input, gate_up, activation,
     * the o and down products, and the two residual buffers */
    float *qkv, *attn_out, *normed, *mlp_in, *gate_up, *act, *o_out, *down, *residual[2];
    /* the final norm: weights, eps, gemma; its output */
    const float *final_norm;
    float final_eps;
    int64_t final_gemma;
    float *out;
    int64_t kv_bf16; /* the caches hold bf16 (NOTE 9) */
} cpu_decode_step_args;

static int run_products(const cpu_row_product *p, int64_t from, int64_t to, int threads) {
    for (int64_t i = from; i < to; i++)
        if (p[i].fn((int)p[i].type, p[i].w, p[i].n, p[i].k, p[i].x, 1, p[i].y, threads)) return -2;
    return 0;
}

/* NOTE 5: the Python loop this replaces (the llama plugin's CpuDecodePlan.run) made ~12 calls a layer through
 * ctypes, ~360 a token, each converting its arguments (1-3 us, more with the caches cold from the weights);
 * here the same calls run in the same order on the same buffers, so every output is bit for bit the loop's.
 * Returns 0, -1 when the attention is out of memory, -2 when a product's type is not supported. */
int cpu_decode_step(const cpu_decode_step_args *a) {
    const int64_t h = a->hidden, q = a->nh * a->head, kv = a->nkv * a->head, row = q + 2 * kv;
    float *qp = a->qkv, *kp = a->qkv + q, *vp = a->qkv + q + kv;
    const float *x = a->x, *residual = NULL;
    int which = 0;
    for (int64_t l = 0; l < a->num_layers; l++) {
        const cpu_decode_layer *L = &a->layers[l];
        if (residual) {
            cpu_add_rms_norm(x, residual, L->norm1, L->eps1, (int)L->gemma1, 1, h, a->normed, a->residual[which]);
            residual = a->residual[which];
            which = 1 - which;
        } else { /* layer 0: its residual is the embedding itself (LlamaDecoderLayer.forward) */
            cpu_add_rms_norm(x, NULL, L->norm1, L->eps1, (int)L->gemma1, 1, h, a->normed, NULL);
            residual = x;
        }
        if (run_products(a->products, L->qkv, L->o, a->threads)) return -2;
        cpu_rotary_neox(qp, row, a->nh, kp, row, a->nkv, a->head, 1, a->positions, a->cos, a->sin, a->half);
        if (cpu_decode_attention(qp, row, kp, row, vp, row, L->cache, a->num_blocks, a->block_size, a->nkv, a->head,
                                 a->nh, a->slots, a->block_table, a->block_table_stride, a->seq_lens, 1, L->scale,
                                 L->window, L->soft_cap, a->attn_out, 1, (int)a->kv_bf16))
            return -1;
        if (run_products(a->products, L->o, L->gate_up, a->threads)) return -2;
        cpu_add_rms_norm(a->o_out, residual, L->norm2, L->eps2, (int)L->gemma2, 1, h, a->mlp_in, a->residual[which]);
        residual = a->residual[which];
        which = 1 - which;
        if (run_products(a->products, L->gate_up, L->down, a->threads)) return -2;
        cpu_silu_and_mul(a->gate_up, 1, a->inter, a->act);
        if (run_products(a->products, L->down, L->end, a->threads)) return -2;
        x = a->down;
    }
    /* x + residual is not needed after the last layer: written to the free residual buffer, as the loop did */
    cpu_add_rms_norm(x, residual, a->final_norm, a->final_eps, (int)a->final_gemma, 1, h, a->out, a->residual[which]);
    return 0;
}

/* ---- Batch helpers of the bf16 GEMM path (NOTE 7, 8) --------------------------------------------------------- */

#define TOPK_MAX 64

#ifdef CPU_SIMD
/* f32_to_bf16 on 8 lanes */
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* 8 x 32-bit lanes holding 16-bit values -> 8 x 16 bits (packus saturates nothing: every value < 2^16) */
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CPU_AVX512 1
/* exp on 16 lanes: exp8's polynomial */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16 on 16 lanes */
static inline void store16_bf16(uint16_t *p, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#endif

/* x [T, 2d] bf16 (gate | up, contiguous) -> out [T, d] bf16 contiguous: silu(gate) * up (NOTE 7) */
void cpu_silu_and_mul_bf16(const uint16_t *x, int64_t T, int64_t d, uint16_t *out, int threads) {
    const int nt = threads > 1 && T > 1 && T * d >= MT_MIN_ELEMS ? threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * 2 * d, *u = g + d;
        uint16_t *o = out + t * d;
        int64_t i = 0;
#ifdef CPU_AVX512
        for (; i + 16 <= d; i += 16) {
            const __m512 gv = load16_bf16(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            store16_bf16(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), load16_bf16(u + i)));
        }
#endif
#ifdef CPU_SIMD
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = load8_bf16(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            store8_bf16(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), load8_bf16(u + i)));
        }
#endif
        for (; i < d; i++) {
            const float gf = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(gf / (1.f + expf(-gf)) * bf16_to_f32(u[i]));
        }
    }
}

/* the k largest of row x[0..n) into idx[0..k) (NOTE 8); k <= n */
static void top_k_row(const float *x, int64_t n, int64_t k, int64_t *idx) {
    float best[TOPK_MAX];
    int64_t worst = 0; /* the slot holding the smallest of best[] */
    for (int64_t j = 0; j < k; j++) {
        best[j] = x[j] == x[j] ? x[j] : -INFINITY; /* a NaN among the first k holds its slot as -inf */
        idx[j] = j;
        if (best[j] < best[worst]) worst = j;
    }
    float floor_ = best[worst];
    int64_t i = k;
#ifdef CPU_SIMD
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor_), _CMP_GT_OQ));
        while (mask) {
            const int b = __builtin_ctz(mask);
            mask &= mask - 1;
            if (x[i + b] > floor_) { /* floor_ may have risen within these 8 */
                best[worst] = x[i + b];
                idx[worst] = i + b;
                for (int64_t j = 0; j < k; j++)
                    if (best[j] < best[worst]) worst = j;
                floor_ = best[worst];
            }
        }
    }
#endif
    for (; i < n; i++)
        if (x[i] > floor_) {
            best[worst] = x[i];
            idx[worst] = i;
            for (int64_t j = 0; j < k; j++)
                if (best[j] < best[worst]) worst = j;
            floor_ = best[worst];
        }
}

/* idx [T, k] int64 = the k largest of each row of x [T, n] float32 contiguous (NOTE 8); rows shared over
 * `threads` from MT_MIN_ELEMS values on. Returns 0, or -1 when k is outside 1..min(n, TOPK_MAX). */
int cpu_top_k(const float *x, int64_t T, int64_t n, int64_t k, int64_t *idx, int threads) {
    if (k < 1 || k > n || k > TOPK_MAX) return -1;
    const int nt = threads > 1 && T > 1 && T * n >= MT_MIN_ELEMS ? (T < threads ? (int)T : threads) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < T; t++) top_k_row(x + t * n, n, k, idx + t * k);
    return 0;
}
