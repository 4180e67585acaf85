/* CPU matmul and row lookup straight from GGUF blocks (Q4_0, Q4_1, Q8_0).
 *
 * Built at first use by gguf_native.py (cc -O3 -march=native -fopenmp -ffp-contract=off) and called through
 * ctypes. Weights stay in the file's own block layout (gguf_blocks.py has the byte layouts), so nothing but
 * the blocks is ever resident.
 *
 *   gguf_matmul           y = x @ W^T for a few activation rows (decode): x rounded to int16 per 32 (NOTE 2)
 *   gguf_dequantize_rows  W[ids] (or all of W) as float32: row lookups, and W for a float GEMM on many rows
 *
 * NOTE 1: a block decodes to exactly the floats gguf_blocks.dequantize_blocks makes (float(q) * d, then + m
 * for Q4_1; Q4_0 centres q first; no fused multiply-add, hence -ffp-contract=off).
 * NOTE 2: the matmul rounds each 32-value block of an activation row to int16 with its own scale
 * (s = max|x| / 32767, error <= s / 2 per value, ~2^-16 of the block's largest: bfloat16 rounds every value
 * to 2^-9 of itself), multiplies the integer weights exactly in int32 (vpmaddwd) and scales the block's sum
 * by d * s in float32; Q4_1's m term uses the exact float sum of the block's x. llama.cpp rounds to int8.
 * Float activations with weights decoded to float (NOTE 1) measured 1.7x slower per token here.
 * NOTE 3: the OpenMP runtime is the one torch already loaded (the same libgomp.so.1 soname), so our
 * parallel regions run on torch's thread pool, with the thread count the caller passes (torch's).
 * NOTE 4: the parallel region is opened once and the block type switched on inside it: GCC outlines an
 * `omp parallel for` body into its own function, where a type passed in is no longer a constant and every
 * block paid for the branches (~1.5x slower). Inside, `rows` is inlined with a literal type per case.
 * NOTE 5: two accumulators per activation row, so consecutive FMAs into one register do not wait on each
 * other's latency; a block's integer expansion is reused by up to TILE_M activation rows.
 * NOTE 6: a busy machine. Rows go out in chunks from a shared counter, so whichever threads run do the work,
 * but a parallel region still ends only when every team thread has arrived, and a thread whose core another
 * process holds arrives a scheduler slice later (milliseconds, against ~50-200 us of work): two threads then
 * ran SmolLM2 ~10x slower than one. So the master times its wait at the end of the region; a wait longer
 * than STALL_NS and than its own work sends the next BACKOFF_CALLS calls to one thread, then it tries again.
 * NOTE 7: where the CPU has AVX512-VL (32 vector registers) a block's expansion feeds up to 8 activation rows,
 * and with AVX512-VNNI the second half of its integer dot product is a vpdpwssd into the first (the add
 * fused); the int32 sums are exact either way, so every output keeps its bits. SmolLM2-shaped Q4_1 layers,
 * weights from memory, one thread, thread CPU time (2026-12-02, Zen 4, interleaved with the previous build):
 * 1 row 0.170 -> 0.161 ms a layer, 4 rows 0.425 -> 0.391, 8 rows 0.823 -> 0.722, 15 rows 1.618 -> 1.456.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_SIMD 1
#endif
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 }; /* ggml type ids */
#define QK 32
#if defined(__AVX512VL__)
#define TILE_M 8 /* NOTE 7 */
#else
#define TILE_M 4
#endif
#define STALL_NS 500000L   /* NOTE 6 */
#define BACKOFF_CALLS 1000 /* ~8 tokens of SmolLM2 (121 calls each) */
#define CHUNKS_PER_THREAD 8
#define INLINE static inline __attribute__((always_inline))

INLINE int block_bytes(int type) { return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34; }

static int known_type(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

INLINE float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef GGUF_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Scalar decode of one block into w[32] (row lookup, and the matmul without AVX2). */
INLINE void decode_block(const int type, const uint8_t *blk, float *w) {
    float d = f16_to_f32(blk);
    if (type == T_Q8_0) {
        for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)blk[2 + j] * d;
    } else if (type == T_Q4_0) {
        for (int j = 0; j < 16; j++) {
            w[j] = (float)((blk[2 + j] & 0x0f) - 8) * d;
            w[j + 16] = (float)((blk[2 + j] >> 4) - 8) * d;
        }
    } else { /* Q4_1 */
        float m = f16_to_f32(blk + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = (float)(blk[4 + j] & 0x0f) * d + m;
            w[j + 16] = (float)(blk[4 + j] >> 4) * d + m;
        }
    }
}

/* One activation row rounded per block (NOTE 2): q[K] int16, scale[K/32], sum[K/32] (exact float sums). */
typedef struct {
    int16_t *q;
    float *scale, *sum;
} qrow;

static void quantize_row(const float *x, int64_t K, qrow r) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f, s = 0.f;
        for (int j = 0; j < QK; j++) {
            float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
            s += xb[j];
        }
        const float d = amax / 32767.f, id = amax > 0 ? 32767.f / amax : 0.f;
        for (int j = 0; j < QK; j++) {
            float v = xb[j] * id;
            r.q[b * QK + j] = (int16_t)(v < 0 ? v - 0.5f : v + 0.5f);
        }
        r.scale[b] = d;
        r.sum[b] = s;
    }
}

#ifdef GGUF_SIMD
/* A block's weights q (centred for Q4_0, raw 0..15 for Q4_1, signed for Q8_0) as 2 x 16 int16, in order. */
INLINE void expand_block(const int type, const uint8_t *blk, __m256i *w0, __m256i *w1) {
    if (type == T_Q8_0) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        return;
    }
    const __m128i nib = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2)));
    __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
    if (type == T_Q4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    *w0 = _mm256_cvtepi8_epi16(lo);
    *w1 = _mm256_cvtepi8_epi16(hi);
}

/* The block's integer dot product, 8 lanes of 4 products each (NOTE 7): exact in int32 either way. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT32(W0, X0, W1, X1) _mm256_dpwssd_epi32(_mm256_madd_epi16(W0, X0), W1, X1)
#else
#define DOT32(W0, X0, W1, X1) _mm256_add_epi32(_mm256_madd_epi16(W0, X0), _mm256_madd_epi16(W1, X1))
#endif

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* y[m * N] = W row . x[m] for activation rows m < mt (mt <= TILE_M), x given as quantized rows (NOTE 2). */
INLINE void row_tile(const int type, const uint8_t *row, int64_t nb, const qrow *x, int64_t mt, float *y,
                     int64_t N) {
    const int bs = block_bytes(type);
#ifdef GGUF_SIMD
    __m256 acc[TILE_M][2];
    float mterm[TILE_M][2];
    for (int64_t m = 0; m < mt; m++) {
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        mterm[m][0] = mterm[m][1] = 0.f;
    }
    /* Blocks in pairs: block b feeds accumulator 0, block b + 1 accumulator 1 (NOTE 5). */
#define GGUF_BLOCK(B, SLOT)                                                                                    \
    do {                                                                                                       \
        const uint8_t *blk = row + (B) * bs;                                                                   \
        const float d = f16_to_f32(blk), mw = type == T_Q4_1 ? f16_to_f32(blk + 2) : 0.f;                      \
        __m256i w0, w1;                                                                                        \
        expand_block(type, blk, &w0, &w1);                                                                     \
        for (int64_t m = 0; m < mt; m++) {                                                                     \
            const int16_t *qx = x[m].q + (B) * QK;                                                             \
            __m256i p = DOT32(w0, _mm256_loadu_si256((const __m256i *)qx),                                     \
                              w1, _mm256_loadu_si256((const __m256i *)(qx + 16)));                             \
            acc[m][SLOT] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x[m].scale[B]), acc[m][SLOT]); \
            if (type == T_Q4_1) mterm[m][SLOT] += mw * x[m].sum[B];                                            \
        }                                                                                                      \
    } while (0)
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        GGUF_BLOCK(b, 0);
        GGUF_BLOCK(b + 1, 1);
    }
    if (b < nb) GGUF_BLOCK(b, 0);
#undef GGUF_BLOCK
    for (int64_t m = 0; m < mt; m++)
        y[m * N] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + (mterm[m][0] + mterm[m][1]);
#else
    float acc[TILE_M] = {0}, mterm[TILE_M] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bs;
        const float d = f16_to_f32(blk), mw = type == T_Q4_1 ? f16_to_f32(blk + 2) : 0.f;
        int32_t q[QK];
        for (int j = 0; j < 16; j++) {
            if (type == T_Q8_0) {
                q[j] = (int8_t)blk[2 + j];
                q[j + 16] = (int8_t)blk[18 + j];
            } else {
                const uint8_t byte = blk[(type == T_Q4_1 ? 4 : 2) + j], c = type == T_Q4_0 ? 8 : 0;
                q[j] = (byte & 0x0f) - c;
                q[j + 16] = (byte >> 4) - c;
            }
        }
        for (int64_t m = 0; m < mt; m++) {
            int32_t dot = 0;
            for (int j = 0; j < QK; j++) dot += q[j] * x[m].q[b * QK + j];
            acc[m] += (float)dot * (d * x[m].scale[b]);
            mterm[m] += mw * x[m].sum[b];
        }
    }
    for (int64_t m = 0; m < mt; m++) y[m * N] = acc[m] + mterm[m];
#endif
}

/* Weight rows n0 .. n1 against every activation row, a tile of TILE_M at a time. */
INLINE void matmul_rows(const int type, int64_t n0, int64_t n1, const uint8_t *w, int64_t K, const qrow *x,
                        int64_t M, float *y, int64_t N) {
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        int64_t m0 = 0;
        for (; m0 + TILE_M <= M; m0 += TILE_M) row_tile(type, row, nb, x + m0, TILE_M, y + m0 * N + n, N);
        switch (M - m0) { /* constant tile sizes, so the per-row loops unroll */
        case 1: row_tile(type, row, nb, x + m0, 1, y + m0 * N + n, N); break;
        case 2: row_tile(type, row, nb, x + m0, 2, y + m0 * N + n, N); break;
        case 3: row_tile(type, row, nb, x + m0, 3, y + m0 * N + n, N); break;
#if TILE_M > 4
        case 4: row_tile(type, row, nb, x + m0, 4, y + m0 * N + n, N); break;
        case 5: row_tile(type, row, nb, x + m0, 5, y + m0 * N + n, N); break;
        case 6: row_tile(type, row, nb, x + m0, 6, y + m0 * N + n, N); break;
        case 7: row_tile(type, row, nb, x + m0, 7, y + m0 * N + n, N); break;
#endif
        default: break;
        }
    }
}

INLINE void thread_range(int64_t total, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    int64_t t = 0, nt = 1;
#endif
    *lo = total * t / nt;
    *hi = total * (t + 1) / nt;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static int backoff_left; /* calls still to run on one thread (NOTE 6); relaxed atomics */

INLINE void matmul_range(int type, int64_t n0, int64_t n1, const uint8_t *w, int64_t K, const qrow *x,
                         int64_t M, float *y, int64_t N) {
    switch (type) { /* NOTE 4 */
    case T_Q4_0: matmul_rows(T_Q4_0, n0, n1, w, K, x, M, y, N); break;
    case T_Q4_1: matmul_rows(T_Q4_1, n0, n1, w, K, x, M, y, N); break;
    default: matmul_rows(T_Q8_0, n0, n1, w, K, x, M, y, N); break;
    }
}

/* y [M, N] = x [M, K] @ W^T, W = N rows of K/32 blocks of `type` (rows stored one after another).
 * Returns 0, -1 for a type this file does not decode or K not a multiple of 32, -3 when out of memory. */
int gguf_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                int threads) {
    if (!known_type(type) || K % QK) return -1;
    void *scratch = malloc(M * (K * sizeof(int16_t) + 2 * (K / QK) * sizeof(float) + sizeof(qrow)));
    if (!scratch) return -3;
    int16_t *q = (int16_t *)scratch;
    float *f = (float *)(q + M * K);
    qrow *rows = (qrow *)(f + M * 2 * (K / QK));
    for (int64_t m = 0; m < M; m++) {
        rows[m] = (qrow){q + m * K, f + m * 2 * (K / QK), f + m * 2 * (K / QK) + K / QK};
        quantize_row(x + m * K, K, rows[m]);
    }
    if (threads > 1 && __atomic_load_n(&backoff_left, __ATOMIC_RELAXED) > 0) {
        __atomic_fetch_sub(&backoff_left, 1, __ATOMIC_RELAXED);
        threads = 1;
    }
    if (threads <= 1 || N * K * M < 65536) {
        matmul_range(type, 0, N, w, K, rows, M, y, N);
        free(scratch);
        return 0;
    }
    const int64_t chunk = (N + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    int64_t next = 0, start = now_ns(), master_done = start;
#pragma omp parallel num_threads(threads)
    {
        for (;;) { /* NOTE 6: chunks to whoever runs */
            int64_t c = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) * chunk;
            if (c >= N) break;
            matmul_range(type, c, c + chunk < N ? c + chunk : N, w, K, rows, M, y, N);
        }
#ifdef _OPENMP
        if (omp_get_thread_num() == 0) master_done = now_ns();
#endif
    }
    const int64_t waited = now_ns() - master_done;
    if (waited > STALL_NS && waited > master_done - start)
        __atomic_store_n(&backoff_left, BACKOFF_CALLS, __ATOMIC_RELAXED);
    free(scratch);
    return 0;
}

#ifdef GGUF_SIMD
/* decode_block with vectors: the same products and sums (NOTE 1), 8 lanes at a time. */
INLINE void decode_block_simd(const int type, const uint8_t *blk, float *w) {
    const __m256 d = _mm256_set1_ps(f16_to_f32(blk));
    __m256i q[4];
    if (type == T_Q8_0) {
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i)));
    } else {
        const __m128i nib = _mm_set1_epi8(0x0f);
        __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        if (type == T_Q4_0) {
            lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
            hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
        }
        q[0] = _mm256_cvtepi8_epi32(lo);
        q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
        q[2] = _mm256_cvtepi8_epi32(hi);
        q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
    }
    if (type == T_Q4_1) {
        const __m256 m = _mm256_set1_ps(f16_to_f32(blk + 2));
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d), m));
    } else {
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d));
    }
}
#endif

INLINE void dequantize_rows(const int type, int64_t t0, int64_t t1, const uint8_t *w, int64_t K,
                            const int64_t *ids, float *out) {
    const int64_t nb = K / QK, bs = block_bytes(type), row_bytes = nb * bs;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *row = w + (ids ? ids[t] : t) * row_bytes;
#ifdef GGUF_SIMD
        for (int64_t b = 0; b < nb; b++) decode_block_simd(type, row + b * bs, out + t * K + b * QK);
#else
        for (int64_t b = 0; b < nb; b++) decode_block(type, row + b * bs, out + t * K + b * QK);
#endif
    }
}

/* out [T, K] = W[ids] as float32 (ids == NULL: the first T rows, e.g. the whole matrix).
 * Returns 0, -1 as gguf_matmul, or -2 for an id outside 0 .. N-1. */
int gguf_dequantize_rows(int type, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t T,
                         float *out, int threads) {
    if (!known_type(type) || K % QK) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids ? ids[t] < 0 || ids[t] >= N : t >= N) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1 && T * K >= 65536)
    {
        int64_t t0, t1;
        thread_range(T, &t0, &t1);
        switch (type) {
        case T_Q4_0: dequantize_rows(T_Q4_0, t0, t1, w, K, ids, out); break;
        case T_Q4_1: dequantize_rows(T_Q4_1, t0, t1, w, K, ids, out); break;
        default: dequantize_rows(T_Q8_0, t0, t1, w, K, ids, out); break;
        }
    }
    return 0;
}
