/* Paged attention on the CPU for the `cpu` attention backend: one call per layer and step writes the step's K/V
 * rows into the paged cache and attends every request -- decodes and prefill chunks alike -- over its context,
 * read in place through its block table (no gather copy).
 *
 *   cpu_paged_attention   K/V write at slot_mapping, then causal attention (sliding window, soft-cap) per request
 *
 * Layouts (the torch backend's, so the two read each other's caches):
 *   cache      [2, num_blocks, bs, nkv, head]  K then V, bf16 or float32 (`kv_bf16` says which, NOTE 6)
 *   q, k, v, out  bf16 or float32 (`bf16` says which)
 *   q / out    T rows of nh * head elements, row strides qs / nh * head; k and v rows of nkv * head, strides ks, vs
 *   qsl [B+1]  int32 query_start_loc; seq_lens [B] int32; block_table [B, bts] int32; slots [T] int64
 *
 * Request i's rows qsl[i] .. qsl[i+1]-1 are the last of its seq_lens[i] positions; row r at position p_r sees keys
 * k with p_r - window < k <= p_r (window 0: all of them). Only the T rows of requests are stored and written
 * (rows past them are the caller's: padding).
 *
 * NOTE 1: the work item is (request, KV head, tile of up to TILE_ROWS query rows): every query head of the GQA
 * group and every row of the tile reads each key and value row of a chunk from L1 while it is hot, so the cache
 * is read from memory once per KV head. Decodes are one-row tiles. Items go to threads through an atomic
 * counter, largest (the prefill tiles, which are last) first.
 * NOTE 2: the softmax is online over chunks of CHUNK keys (running max m, sum l, accumulator rescaled by
 * exp(m_old - m_new)), in float32; dot products accumulate in float32 (bf16 pairs through _mm512_dpbf16_ps where
 * the CPU has AVX512-BF16, else each bf16 widened to float32 by a 16-bit shift). exp is Cephes' single-precision
 * polynomial on 16 lanes (~1-2 ulp, as torch's own vectorized exp; tails masked); libm's expf without AVX-512.
 * NOTE 3: threads: the caller passes torch's thread count, and the call's threads are an OpenMP team of torch's
 * own libgomp pool (the library is loaded after torch: gguf_cpu.c NOTE 3), the calling thread one of them, so the
 * call never runs more threads than that pool has. pthreads started per call ran beside the pool's threads,
 * which spin a while after each torch op (libgomp's spin-wait before sleeping) on the same cores: in the engine
 * (a bf16 GEMM right before every call) SmolLM2's 2048-token prefill attention took ~10 ms a layer against 4.5 ms
 * alone, on 2 cores (2026-12-02). Small steps stay on the calling thread (`min_work_per_thread`): waking a team
 * costs microseconds against work that is no longer.
 * NOTE 4: scores come four keys at a time, their four horizontal sums in one shuffle tree (reduce4): a 16-lane
 * sum costs ~8 shuffles and adds, as much as a 64-wide bf16 dot product's two dpbf16 and loads; four sums share
 * one tree of 12.
 * NOTE 5: with AVX-512, a tile of >= TILE_MIN_QUERIES queries (prefill rows x the GQA group) runs attend_tile
 * instead: the queries across the lanes, keys and values broadcast one element at a time, so a step is 12
 * fused multiply-adds on 7 loads and no horizontal sum (NOTE 4's four-key trees, the per-row scalar softmax
 * and one row's accumulators at a time are gone); decodes (one row: three queries for SmolLM2) keep
 * attend_item. Sums run in float32 whatever the cache dtype (bf16 keys and values widened exactly), in another
 * order than attend_item's. SmolLM2's heads, 14 fresh prompts of 32..256 tokens (2198 rows), one layer, min
 * of 20, 2026-12-02, load ~0.2: float32 4.3 -> 3.3 ms on 2 threads (6.35 ms on one: 36 G useful
 * multiply-adds/s, ~70 % of a Zen 4 core's float32 FMA peak); bf16 3.5 -> 2.9 ms.
 * NOTE 6: the cache's dtype is its own (kv_cache.cache_dtype): a float32 model may keep a bf16 cache (half the
 * bytes every step reads; the K/V rows rounded to nearest even as they are written, as torch's .to() rounds),
 * and a bf16 model a float32 one. Cache rows are widened to float32 in registers as they are read (exact);
 * AVX512-BF16's dpbf16 takes the scores only when the queries are bf16 too (a float32 query is not rounded).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define PA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PA_AVX2 1
#endif

#define TILE_ROWS 16
#define CHUNK 64
#define MAX_THREADS 64

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

#ifdef PA_AVX512
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x on 16 lanes (NOTE 2): n = round(x log2 e), r = x - n ln 2 in two parts, a degree-7 polynomial, times 2^n
 * built in the exponent bits; inputs clamped to [-88, 88] (no inf, no subnormals). */
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
#endif

#ifdef PA_AVX2
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* How the scores multiply (dot4, dot_bf16) (NOTE 6): float32 keys; bf16 keys and a bf16 query (AVX512-BF16's dot products); bf16
 * keys widened against a float32 query. */
enum { DOT_F32 = 0, DOT_BF16_PAIRS = 1, DOT_BF16_KEYS = 2 };

/* q . k over n elements: q is float32 (the query row, widened once per tile), k a cache row */
static inline float dot_f32(const float *q, const float *k, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#if defined(PA_AVX512)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(PA_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    s = hsum8(acc);
#endif
    for (; i < n; i++) s += q[i] * k[i];
    return s;
}

/* q . k for a bf16 cache row k; qf is the query in float32. With `qb` (the query itself is bf16, q) the pairs go
 * through AVX512-BF16's dot products where the CPU has them; otherwise (and for tails) k is widened (NOTE 6). */
static inline float dot_bf16(const uint16_t *q, const float *qf, const uint16_t *k, int64_t n, int qb) {
    int64_t i = 0;
    float s = 0.f;
#if defined(PA_AVX512) && defined(__AVX512BF16__)
    if (qb) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + 32 <= n; i += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(q + i)),
                                   (__m512bh)_mm512_loadu_si512((const void *)(k + i)));
        s = _mm512_reduce_add_ps(acc);
    } else
#endif
    {
#if defined(PA_AVX512)
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), load16_bf16(k + i), acc);
        s = _mm512_reduce_add_ps(acc);
#elif defined(PA_AVX2)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i), load8_bf16(k + i), acc);
        s = hsum8(acc);
#endif
    }
    (void)q;
    (void)qb;
    for (; i < n; i++) s += qf[i] * bf16_to_f32(k[i]);
    return s;
}

#ifdef PA_AVX512
/* the four horizontal sums of a, b, c, d in one __m128 (NOTE 4) */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* s[0..3] = q . k_t for four cache rows; the head's tail through masked loads (zeros add nothing) */
static inline void dot4(const void *q, const void *const *k, int64_t n, int mode, float *s) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (mode == DOT_BF16_PAIRS) {
#ifdef __AVX512BF16__
        const uint16_t *qb = (const uint16_t *)q;
        for (int64_t i = 0; i < n; i += 32) {
            const __mmask32 m = n - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (n - i)) - 1u);
            const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, qb + i);
            a0 = _mm512_dpbf16_ps(a0, x, (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)k[0] + i));
            a1 = _mm512_dpbf16_ps(a1, x, (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)k[1] + i));
            a2 = _mm512_dpbf16_ps(a2, x, (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)k[2] + i));
            a3 = _mm512_dpbf16_ps(a3, x, (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)k[3] + i));
        }
#endif
    } else if (mode == DOT_BF16_KEYS) {
        const float *qf = (const float *)q; /* the query in float32 */
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 x = _mm512_maskz_loadu_ps(m, qf + i);
#define PA_W(t) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)k[t] + i)), 16))
            a0 = _mm512_fmadd_ps(x, PA_W(0), a0);
            a1 = _mm512_fmadd_ps(x, PA_W(1), a1);
            a2 = _mm512_fmadd_ps(x, PA_W(2), a2);
            a3 = _mm512_fmadd_ps(x, PA_W(3), a3);
#undef PA_W
        }
    } else {
        const float *qf = (const float *)q;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 x = _mm512_maskz_loadu_ps(m, qf + i);
            a0 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, (const float *)k[0] + i), a0);
            a1 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, (const float *)k[1] + i), a1);
            a2 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, (const float *)k[2] + i), a2);
            a3 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, (const float *)k[3] + i), a3);
        }
    }
    _mm_storeu_ps(s, reduce4(a0, a1, a2, a3));
}
#endif

/* acc[i] = acc[i] * c + sum_j p[j] * v_j[i] for the n value rows vf (float32, already widened) */
static inline void rescale_accumulate(float *acc, float c, const float *p, const float *vf, int64_t nv,
                                      int64_t head) {
    int64_t i = 0;
#if defined(PA_AVX512)
    const __m512 vc = _mm512_set1_ps(c);
    for (; i + 64 <= head; i += 64) { /* four accumulators stay in registers over the keys */
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i), vc), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 16), vc);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 32), vc), a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + i + 48), vc);
        for (int64_t j = 0; j < nv; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]);
            const float *v = vf + j * head + i;
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 48), a3);
        }
        _mm512_storeu_ps(acc + i, a0);
        _mm512_storeu_ps(acc + i + 16, a1);
        _mm512_storeu_ps(acc + i + 32, a2);
        _mm512_storeu_ps(acc + i + 48, a3);
    }
    for (; i + 16 <= head; i += 16) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + i), vc);
        for (int64_t j = 0; j < nv; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vf + j * head + i), a0);
        _mm512_storeu_ps(acc + i, a0);
    }
#elif defined(PA_AVX2)
    const __m256 vc = _mm256_set1_ps(c);
    for (; i + 32 <= head; i += 32) {
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + i), vc), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 8), vc);
        __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 16), vc), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 24), vc);
        for (int64_t j = 0; j < nv; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *v = vf + j * head + i;
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + i, a0);
        _mm256_storeu_ps(acc + i + 8, a1);
        _mm256_storeu_ps(acc + i + 16, a2);
        _mm256_storeu_ps(acc + i + 24, a3);
    }
#endif
    for (; i < head; i++) {
        float a = acc[i] * c;
        for (int64_t j = 0; j < nv; j++) a += p[j] * vf[j * head + i];
        acc[i] = a;
    }
}

/* p[j] = exp(p[j] - m) for j < n; returns their sum */
static inline float exp_shifted(float *p, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.f;
#if defined(PA_AVX512)
    __m512 acc = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(m);
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm));
        _mm512_storeu_ps(p + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) { /* the tail as masked lanes: -inf - m would be a NaN, so the unused lanes load m itself */
        const __mmask16 mk = (__mmask16)((1u << (n - j)) - 1u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(vm, mk, p + j), vm));
        _mm512_mask_storeu_ps(p + j, mk, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mk, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    return sum;
}

typedef struct {
    const void *q, *k, *v;
    int64_t qs, ks, vs;
    void *cache;
    int64_t num_blocks, bs, nkv, head, nh;
    const int32_t *qsl, *seq_lens, *block_table;
    int64_t bts, B;
    float scale, soft_cap;
    int64_t window;
    int bf16;    /* q, k, v and out are bf16 (else float32) */
    int kv_bf16; /* the cache is bf16 (else float32): NOTE 6 */
    void *out;
    /* work items: item w < items is (request req[w], rows row0[w] .. row0[w] + nrows[w] - 1) x every KV head */
    const int32_t *req, *row0, *nrows;
    int64_t items;
    int64_t next; /* atomic: the next item x KV head to take */
    int failed;
} Job;

typedef struct {
    float *qf;   /* [TILE_ROWS * group, head] the tile's queries, float32 */
    float *acc;  /* [TILE_ROWS * group, head] */
    float *ml;   /* [TILE_ROWS * group, 2] running max and sum */
    float *p;    /* [CHUNK] scores, then probabilities */
    float *vf;   /* [CHUNK, head] the chunk's value rows, float32 */
    /* the query-major tile kernel's (NOTE 5): lanes are the tile's queries, nqp of them (a multiple of 16) */
    float *qt;   /* [head, nqp] the queries, transposed */
    float *ot;   /* [head, nqp] the output accumulators, transposed */
    float *st;   /* [CHUNK, nqp] scores, then probabilities */
    float *kf;   /* [CHUNK + 4, head] the chunk's key rows, float32 (rows past the chunk's keys zero) */
} Scratch;

/* NOTE 5: query lanes of the tile kernel, a multiple of 16 holding every query head of a tile */
static inline int64_t tile_lanes(int64_t group) { return (TILE_ROWS * group + 15) / 16 * 16; }

#ifdef PA_AVX512
/* NOTE 5: one tile of nq >= TILE_MIN_QUERIES queries (rows x the KV head's query heads), queries across the
 * vector lanes. Scores S^T[key][query] = sum_d K[key][d] * Q^T[d][query]: each key element is broadcast and
 * multiplied into QV vectors of 16 queries (4 keys at a time: 4 * QV accumulators), so no horizontal sums;
 * the softmax is lane-wise (max, exp, sum of 16 queries at once, the causal / window mask a compare per key);
 * the output O^T[d][query] += V[key][d] * P^T[key][query] the same way, 4 dims at a time. */
#define TILE_MIN_QUERIES 8

static inline void load_chunk_rows(const Job *J, const int32_t *bt, int64_t g, int64_t c, int64_t n, float *kf,
                                   float *vf) {
    const int64_t head = J->head, row = J->nkv * head, bs = J->bs, v_off = J->num_blocks * bs * row;
    const char *cache = (const char *)J->cache;
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = c + j, slot = (int64_t)bt[t / bs] * bs + t % bs;
        const char *kr = cache + (slot * row + g * head) * (J->kv_bf16 ? 2 : 4);
        const char *vr = cache + (v_off + slot * row + g * head) * (J->kv_bf16 ? 2 : 4);
        if (J->kv_bf16) {
            int64_t d = 0;
            for (; d + 16 <= head; d += 16) {
                _mm512_storeu_ps(kf + j * head + d, load16_bf16((const uint16_t *)kr + d));
                _mm512_storeu_ps(vf + j * head + d, load16_bf16((const uint16_t *)vr + d));
            }
            for (; d < head; d++) {
                kf[j * head + d] = bf16_to_f32(((const uint16_t *)kr)[d]);
                vf[j * head + d] = bf16_to_f32(((const uint16_t *)vr)[d]);
            }
        } else {
            memcpy(kf + j * head, kr, head * sizeof(float));
            memcpy(vf + j * head, vr, head * sizeof(float));
        }
    }
    memset(kf + n * head, 0, ((n + 3) / 4 * 4 - n) * head * sizeof(float)); /* tile_scores reads keys 4 at a time */
}

/* S^T[j][lanes of vectors v0 .. v0 + QV) for the chunk's keys j < n (rounded up to 4; those rows are zero) */
static inline __attribute__((always_inline)) void tile_scores(const float *qt, const float *kf, float *st,
                                                              int64_t nqp, int64_t head, int64_t n, int64_t v0,
                                                              int QV, float scale) {
    for (int64_t j = 0; j < n; j += 4) {
        __m512 acc[4][3];
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < QV; v++) acc[jj][v] = _mm512_setzero_ps();
        const float *k0 = kf + j * head;
        for (int64_t d = 0; d < head; d++) {
            __m512 q[3];
            for (int v = 0; v < QV; v++) q[v] = _mm512_loadu_ps(qt + d * nqp + (v0 + v) * 16);
            for (int jj = 0; jj < 4; jj++) {
                const __m512 kb = _mm512_set1_ps(k0[jj * head + d]);
                for (int v = 0; v < QV; v++) acc[jj][v] = _mm512_fmadd_ps(kb, q[v], acc[jj][v]);
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < QV; v++)
                _mm512_storeu_ps(st + (j + jj) * nqp + (v0 + v) * 16, _mm512_mul_ps(acc[jj][v], _mm512_set1_ps(scale)));
    }
}

/* O^T[d][lanes] = O^T[d][lanes] * corr + sum_{j < n} V[j][d] * P^T[j][lanes], vectors v0 .. v0 + QV */
static inline __attribute__((always_inline)) void tile_values(float *ot, const float *st, const float *vf,
                                                              const __m512 *corr, int64_t nqp, int64_t head,
                                                              int64_t n, int64_t v0, int QV) {
    int64_t d = 0;
    for (; d + 4 <= head; d += 4) {
        __m512 acc[4][3];
        for (int dd = 0; dd < 4; dd++)
            for (int v = 0; v < QV; v++)
                acc[dd][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + dd) * nqp + (v0 + v) * 16), corr[v0 + v]);
        for (int64_t j = 0; j < n; j++) {
            __m512 p[3];
            for (int v = 0; v < QV; v++) p[v] = _mm512_loadu_ps(st + j * nqp + (v0 + v) * 16);
            for (int dd = 0; dd < 4; dd++) {
                const __m512 vb = _mm512_set1_ps(vf[j * head + d + dd]);
                for (int v = 0; v < QV; v++) acc[dd][v] = _mm512_fmadd_ps(vb, p[v], acc[dd][v]);
            }
        }
        for (int dd = 0; dd < 4; dd++)
            for (int v = 0; v < QV; v++) _mm512_storeu_ps(ot + (d + dd) * nqp + (v0 + v) * 16, acc[dd][v]);
    }
    for (; d < head; d++)
        for (int v = 0; v < QV; v++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(ot + d * nqp + (v0 + v) * 16), corr[v0 + v]);
            for (int64_t j = 0; j < n; j++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(vf[j * head + d]), _mm512_loadu_ps(st + j * nqp + (v0 + v) * 16), a);
            _mm512_storeu_ps(ot + d * nqp + (v0 + v) * 16, a);
        }
}

static void attend_tile(Job *J, Scratch *S, int64_t w, int64_t g) {
    const int64_t i = J->req[w], r0 = J->row0[w], nr = J->nrows[w];
    const int64_t head = J->head, nh = J->nh, group = nh / J->nkv;
    const int64_t len = J->seq_lens[i], first_row = J->qsl[i], qlen = J->qsl[i + 1] - first_row;
    const int32_t *bt = J->block_table + i * J->bts;
    const int64_t nq = nr * group, nqp = (nq + 15) / 16 * 16, nv = nqp / 16;
    const int64_t pos_first = len - qlen + r0, pos_last = pos_first + nr - 1;
    /* Q^T, zero in the padding lanes; each lane's position (-1: a padding lane sees nothing) */
    for (int64_t x = 0; x < nqp; x++) {
        const int64_t r = x / group, hh = x % group;
        for (int64_t d = 0; d < head; d++) {
            float q = 0.f;
            if (x < nq) {
                const int64_t at = (first_row + r0 + r) * J->qs + (g * group + hh) * head + d;
                q = J->bf16 ? bf16_to_f32(((const uint16_t *)J->q)[at]) : ((const float *)J->q)[at];
            }
            S->qt[d * nqp + x] = q;
        }
    }
    memset(S->ot, 0, head * nqp * sizeof(float));
    __m512i qpos[TILE_ROWS * 8 / 16 + 1];
    __m512 m[TILE_ROWS * 8 / 16 + 1], l[TILE_ROWS * 8 / 16 + 1], corr[TILE_ROWS * 8 / 16 + 1];
    for (int64_t v = 0; v < nv; v++) {
        int32_t pos[16];
        for (int64_t lane = 0; lane < 16; lane++) {
            const int64_t x = v * 16 + lane;
            pos[lane] = x < nq ? (int32_t)(pos_first + x / group) : -1;
        }
        qpos[v] = _mm512_loadu_si512(pos);
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    int64_t lo = 0;
    if (J->window > 0 && pos_first - J->window + 1 > 0) lo = pos_first - J->window + 1;
    for (int64_t c = lo; c <= pos_last; c += CHUNK) {
        const int64_t n = (c + CHUNK - 1 < pos_last ? c + CHUNK - 1 : pos_last) - c + 1;
        load_chunk_rows(J, bt, g, c, n, S->kf, S->vf);
        for (int64_t v = 0; v < nv;) { /* three vectors at a time: 12 accumulators */
            const int64_t left = nv - v;
            if (left >= 3) tile_scores(S->qt, S->kf, S->st, nqp, head, n, v, 3, J->scale), v += 3;
            else if (left == 2) tile_scores(S->qt, S->kf, S->st, nqp, head, n, v, 2, J->scale), v += 2;
            else tile_scores(S->qt, S->kf, S->st, nqp, head, n, v, 1, J->scale), v += 1;
        }
        for (int64_t v = 0; v < nv; v++) {
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < n; j++) {
                const __m512i t = _mm512_set1_epi32((int32_t)(c + j));
                __mmask16 vis = _mm512_cmp_epi32_mask(t, qpos[v], _MM_CMPINT_LE);
                if (J->window > 0)
                    vis &= _mm512_cmp_epi32_mask(t, _mm512_sub_epi32(qpos[v], _mm512_set1_epi32((int32_t)J->window)),
                                                 _MM_CMPINT_NLE);
                float *sj = S->st + j * nqp + v * 16;
                __m512 sv = _mm512_loadu_ps(sj);
                if (J->soft_cap > 0.f) {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, sv);
                    for (int lane = 0; lane < 16; lane++) tmp[lane] = J->soft_cap * tanhf(tmp[lane] / J->soft_cap);
                    sv = _mm512_loadu_ps(tmp);
                }
                sv = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-INFINITY), sv);
                _mm512_storeu_ps(sj, sv);
                mx = _mm512_max_ps(mx, sv);
            }
            const __m512 m_new = _mm512_max_ps(m[v], mx);
            const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __mmask16 had = _mm512_cmp_ps_mask(m[v], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            corr[v] = _mm512_maskz_mov_ps(had, exp16(_mm512_sub_ps(m[v], _mm512_mask_blend_ps(seen, m[v], m_new))));
            __m512 sum = _mm512_setzero_ps();
            const __m512 shift = _mm512_maskz_mov_ps(seen, m_new);
            for (int64_t j = 0; j < n; j++) {
                float *sj = S->st + j * nqp + v * 16;
                const __m512 sv = _mm512_loadu_ps(sj);
                const __mmask16 live = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_mov_ps(live, sv), shift)));
                _mm512_storeu_ps(sj, p);
                sum = _mm512_add_ps(sum, p);
            }
            l[v] = _mm512_add_ps(_mm512_mul_ps(l[v], corr[v]), sum);
            m[v] = m_new;
        }
        for (int64_t v = 0; v < nv;) {
            const int64_t left = nv - v;
            if (left >= 3) tile_values(S->ot, S->st, S->vf, corr, nqp, head, n, v, 3), v += 3;
            else if (left == 2) tile_values(S->ot, S->st, S->vf, corr, nqp, head, n, v, 2), v += 2;
            else tile_values(S->ot, S->st, S->vf, corr, nqp, head, n, v, 1), v += 1;
        }
    }
    float inv[TILE_ROWS * 8 + 16];
    for (int64_t v = 0; v < nv; v++) {
        const __mmask16 pos = _mm512_cmp_ps_mask(l[v], _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_storeu_ps(inv + v * 16, _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.f), l[v]));
    }
    for (int64_t x = 0; x < nq; x++) {
        const int64_t r = x / group, hh = x % group;
        const int64_t o = ((first_row + r0 + r) * nh + g * group + hh) * head;
        for (int64_t d = 0; d < head; d++) {
            const float val = S->ot[d * nqp + x] * inv[x];
            if (J->bf16) ((uint16_t *)J->out)[o + d] = f32_to_bf16(val);
            else ((float *)J->out)[o + d] = val;
        }
    }
}
#endif

static void attend_item(Job *J, Scratch *S, int64_t task) {
    const int64_t w = task / J->nkv, g = task % J->nkv;
#ifdef PA_AVX512
    if (J->nrows[w] * (J->nh / J->nkv) >= TILE_MIN_QUERIES && J->nh / J->nkv <= 8) {
        attend_tile(J, S, w, g);
        return;
    }
#endif
    const int64_t i = J->req[w], r0 = J->row0[w], nr = J->nrows[w];
    const int64_t head = J->head, nh = J->nh, group = nh / J->nkv, row = J->nkv * head, bs = J->bs;
    const int64_t esz = J->bf16 ? 2 : 4, kesz = J->kv_bf16 ? 2 : 4, v_off = J->num_blocks * bs * row;
#ifdef __AVX512BF16__
    const int mode = !J->kv_bf16 ? DOT_F32 : J->bf16 ? DOT_BF16_PAIRS : DOT_BF16_KEYS;
#else
    const int mode = J->kv_bf16 ? DOT_BF16_KEYS : DOT_F32;
#endif
    const int64_t len = J->seq_lens[i], first_row = J->qsl[i], qlen = J->qsl[i + 1] - first_row;
    const int32_t *bt = J->block_table + i * J->bts;
    const int64_t nq = nr * group;
    /* widen the tile's queries once (NOTE 1): rows r0.., heads g * group .. g * group + group - 1 */
    for (int64_t r = 0; r < nr; r++)
        for (int64_t hh = 0; hh < group; hh++) {
            float *dst = S->qf + (r * group + hh) * head;
            const char *src = (const char *)J->q + ((first_row + r0 + r) * J->qs + (g * group + hh) * head) * esz;
            if (J->bf16)
                for (int64_t d = 0; d < head; d++) dst[d] = bf16_to_f32(((const uint16_t *)src)[d]);
            else
                memcpy(dst, src, head * sizeof(float));
        }
    for (int64_t x = 0; x < nq; x++) {
        S->ml[2 * x] = -INFINITY;
        S->ml[2 * x + 1] = 0.f;
    }
    memset(S->acc, 0, nq * head * sizeof(float));
    /* positions: row r (0-based in the request) sits at len - qlen + r */
    const int64_t pos_first = len - qlen + r0, pos_last = pos_first + nr - 1;
    int64_t lo = 0;
    if (J->window > 0 && pos_first - J->window + 1 > 0) lo = pos_first - J->window + 1;
    const char *cache = (const char *)J->cache;
    for (int64_t c = lo; c <= pos_last; c += CHUNK) {
        const int64_t ce = c + CHUNK - 1 < pos_last ? c + CHUNK - 1 : pos_last; /* inclusive */
        const int64_t n = ce - c + 1;
        const char *krow[CHUNK];
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = c + j;
            const int64_t slot = (int64_t)bt[t / bs] * bs + t % bs;
            krow[j] = cache + (slot * row + g * head) * kesz;
            float *vf = S->vf + j * head;
            const char *vr = cache + (v_off + slot * row + g * head) * kesz;
            if (J->kv_bf16) {
                int64_t d = 0;
#if defined(PA_AVX512)
                for (; d + 16 <= head; d += 16) _mm512_storeu_ps(vf + d, load16_bf16((const uint16_t *)vr + d));
#elif defined(PA_AVX2)
                for (; d + 8 <= head; d += 8) _mm256_storeu_ps(vf + d, load8_bf16((const uint16_t *)vr + d));
#endif
                for (; d < head; d++) vf[d] = bf16_to_f32(((const uint16_t *)vr)[d]);
            } else {
                memcpy(vf, vr, head * sizeof(float));
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t pos = pos_first + r;
            int64_t a = c, b = ce < pos ? ce : pos; /* the keys this row sees in the chunk */
            if (J->window > 0 && pos - J->window + 1 > a) a = pos - J->window + 1;
            if (a > b) continue;
            const int64_t na = b - a + 1, off = a - c;
            for (int64_t hh = 0; hh < group; hh++) {
                const int64_t x = r * group + hh;
                const float *qf = S->qf + x * head;
                const uint16_t *qb =
                    (const uint16_t *)J->q + (first_row + r0 + r) * J->qs + (g * group + hh) * head;
                float mx = -INFINITY;
                int64_t j = 0;
#ifdef PA_AVX512
                const void *qd = mode == DOT_BF16_PAIRS ? (const void *)qb : (const void *)qf;
                for (; j + 4 <= na; j += 4) dot4(qd, (const void *const *)(krow + off + j), head, mode, S->p + j);
#endif
                for (; j < na; j++)
                    S->p[j] = J->kv_bf16 ? dot_bf16(qb, qf, (const uint16_t *)krow[off + j], head, mode == DOT_BF16_PAIRS)
                                         : dot_f32(qf, (const float *)krow[off + j], head);
                for (j = 0; j < na; j++) {
                    float s = S->p[j] * J->scale;
                    if (J->soft_cap > 0.f) s = J->soft_cap * tanhf(s / J->soft_cap);
                    S->p[j] = s;
                    mx = s > mx ? s : mx;
                }
                float *m = S->ml + 2 * x, *l = m + 1;
                const float m_new = mx > *m ? mx : *m;
                const float corr = *m == -INFINITY ? 0.f : expf(*m - m_new);
                *l = *l * corr + exp_shifted(S->p, na, m_new);
                *m = m_new;
                rescale_accumulate(S->acc + x * head, corr, S->p, S->vf + off * head, na, head);
            }
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t hh = 0; hh < group; hh++) {
            const int64_t x = r * group + hh;
            const float l = S->ml[2 * x + 1], inv = l > 0.f ? 1.f / l : 0.f;
            const float *acc = S->acc + x * head;
            const int64_t o = ((first_row + r0 + r) * nh + g * group + hh) * head;
            if (J->bf16) {
                uint16_t *dst = (uint16_t *)J->out + o;
                for (int64_t d = 0; d < head; d++) dst[d] = f32_to_bf16(acc[d] * inv);
            } else {
                float *dst = (float *)J->out + o;
                for (int64_t d = 0; d < head; d++) dst[d] = acc[d] * inv;
            }
        }
}

static void *worker(void *arg) {
    Job *J = (Job *)arg;
    const int64_t group = J->nh / J->nkv, head = J->head;
    Scratch S;
    const size_t lanes = (size_t)tile_lanes(group);
    float *mem = malloc(((size_t)TILE_ROWS * group * (2 * head + 2) + CHUNK + (size_t)CHUNK * head +
                         lanes * (2 * head + CHUNK) + (size_t)(CHUNK + 4) * head) * sizeof(float));
    if (!mem) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    S.qf = mem;
    S.acc = S.qf + TILE_ROWS * group * head;
    S.ml = S.acc + TILE_ROWS * group * head;
    S.p = S.ml + 2 * TILE_ROWS * group;
    S.vf = S.p + CHUNK;
    S.qt = S.vf + CHUNK * head;
    S.ot = S.qt + lanes * head;
    S.st = S.ot + lanes * head;
    S.kf = S.st + lanes * CHUNK;
    const int64_t total = J->items * J->nkv;
    for (;;) {
        const int64_t t = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (t >= total) break;
        attend_item(J, &S, total - 1 - t); /* the last items are the prefill tiles: the largest go first */
    }
    free(mem);
    return NULL;
}

/* Returns 0, -1 when out of memory, -2 when a slot or block id is outside the cache (nothing attended then). */
int cpu_paged_attention(const void *q, int64_t qs, const void *k, int64_t ks, const void *v, int64_t vs, void *cache,
                        int64_t num_blocks, int64_t bs, int64_t nkv, int64_t head, int64_t nh, const int64_t *slots,
                        int64_t T, const int32_t *qsl, const int32_t *seq_lens, const int32_t *block_table,
                        int64_t bts, int64_t B, float scale, int64_t window, float soft_cap, int bf16, int kv_bf16,
                        void *out, int64_t num_threads, int64_t min_work_per_thread) {
    const int64_t row = nkv * head, esz = bf16 ? 2 : 4, v_off = num_blocks * bs * row;
    const int64_t num_slots = num_blocks * bs;
    char *c = (char *)cache;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    for (int64_t t = 0; t < T; t++) {
        if (bf16 == kv_bf16) {
            memcpy(c + slots[t] * row * esz, (const char *)k + t * ks * esz, row * esz);
            memcpy(c + (v_off + slots[t] * row) * esz, (const char *)v + t * vs * esz, row * esz);
        } else if (kv_bf16) { /* a float32 row into the bf16 cache: rounded to nearest even (NOTE 6) */
            const float *kt = (const float *)k + t * ks, *vt = (const float *)v + t * vs;
            uint16_t *kd = (uint16_t *)c + slots[t] * row, *vd = (uint16_t *)c + v_off + slots[t] * row;
            for (int64_t i = 0; i < row; i++) {
                kd[i] = f32_to_bf16(kt[i]);
                vd[i] = f32_to_bf16(vt[i]);
            }
        } else { /* a bf16 row into the float32 cache: widened */
            const uint16_t *kt = (const uint16_t *)k + t * ks, *vt = (const uint16_t *)v + t * vs;
            float *kd = (float *)c + slots[t] * row, *vd = (float *)c + v_off + slots[t] * row;
            for (int64_t i = 0; i < row; i++) {
                kd[i] = bf16_to_f32(kt[i]);
                vd[i] = bf16_to_f32(vt[i]);
            }
        }
    }
    /* the work items (NOTE 1) and the work they hold, in query-key pairs */
    int64_t items = 0, work = 0;
    for (int64_t i = 0; i < B; i++) {
        const int64_t qlen = qsl[i + 1] - qsl[i];
        items += (qlen + TILE_ROWS - 1) / TILE_ROWS;
        if (qlen > 0) { /* the blocks it reads: from the first row's window on (earlier ones may be freed) */
            const int64_t nblk = (seq_lens[i] + bs - 1) / bs, first_pos = seq_lens[i] - qlen - window + 1;
            for (int64_t b = window > 0 && first_pos > 0 ? first_pos / bs : 0; b < nblk; b++)
                if (block_table[i * bts + b] < 0 || block_table[i * bts + b] >= num_blocks) return -2;
        }
        work += qlen * (window > 0 && seq_lens[i] > window ? window : seq_lens[i]);
    }
    int32_t *plan = malloc((size_t)(3 * items + 1) * sizeof(int32_t));
    if (!plan) return -1;
    Job J = {q, k, v, qs, ks, vs, cache, num_blocks, bs, nkv, head, nh, qsl, seq_lens, block_table, bts, B,
             scale, soft_cap, window, bf16, kv_bf16, out, plan, plan + items, plan + 2 * items, items, 0, 0};
    int64_t w = 0;
    for (int64_t i = 0; i < B; i++)
        for (int64_t r = 0; r < qsl[i + 1] - qsl[i]; r += TILE_ROWS, w++) {
            plan[w] = (int32_t)i;
            plan[items + w] = (int32_t)r;
            const int64_t left = qsl[i + 1] - qsl[i] - r;
            plan[2 * items + w] = (int32_t)(left < TILE_ROWS ? left : TILE_ROWS);
        }
    int64_t n = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
    if (min_work_per_thread > 0 && work * nh * head / min_work_per_thread < n) n = work * nh * head / min_work_per_thread;
    if (n > items * nkv) n = items * nkv;
    if (n < 1) n = 1;
#pragma omp parallel num_threads((int)n) if (n > 1)
    worker(&J);
    free(plan);
    return J.failed ? -1 : 0;
}
