/* An int8 GEMM for a GGUF matrix's large products (>= 16 activation rows) on AVX512-VNNI CPUs.
 *
 * Built at first use by int8_gemm.py (cc -O3 -march=native -fopenmp) and called through ctypes.
 *
 *   i8_available   1 where this build has the AVX512-VNNI kernel, else 0 (then nothing else may be called)
 *   i8_pack        a Q4_0 / Q4_1 / Q8_0 matrix repacked once at load (NOTE 1)
 *   i8_gemm        y [M, N] = x [M, K] @ W^T, x float32 quantized per 32 to int8 inside (NOTE 2)
 *   i8_quantize    the activation quantization alone (for the tests' reference)
 *
 * NOTE 1: the layout. Each weight is an unsigned byte u with one (d, c) pair per 32 inputs, w = d * u + c:
 * Q4_1 u = q (0..15), c = m; Q4_0 u = q (0..15), c = -8 d; Q8_0 u = q + 128, c = -128 d. The bytes go in
 * panels of 16 output columns, [N/16][K/4][16][4] (16 columns x 4 consecutive inputs = one zmm), the pairs in
 * [N/16][K/32][2][16] floats (d then c). vpdpbusd multiplies unsigned by signed bytes, so u (unsigned)
 * against the int8 activations needs no sign trick.
 * NOTE 2: the activations as llama.cpp's Q8_1 (what it multiplies Q4_1 by): per 32 values s = max|x| / 127,
 * q = round(x / s) (to nearest even here; llama.cpp's roundf rounds ties away), and the block's s * sum(q).
 * Then per block sum_i w_i x_i ~ d s sum_i u_i q_i + c s sum_i q_i: the integer sum is exact in int32,
 * the block's two terms are added to a float32 accumulator (two fused multiply-adds), block after block in
 * order. For Q4_1 this is llama.cpp's ggml_vec_dot_q4_1_q8_1; Q4_0 and Q8_0 fold their centring into c.
 * NOTE 4: `precise` rounds the activations to 16 bits per 32 instead (s = max|x| / 32639, the precision of
 * gguf_cpu.c's decode kernel, finer than bfloat16's 8 bits), split q16 = 256 hi + lo into two int8 halves:
 * the block's sum over hi runs first, is shifted left by 8 and the sum over lo added, so the int32 sum is
 * still exact, for twice the vpdpbusd. What int8 activations cost in accuracy (SmolLM2's teacher-forced
 * top-1 against float32: 292 of 302 positions, bf16 300) is what this buys back.
 * NOTE 5: in the engine each matrix arrives cold (a model's layers do not stay in L3 between steps). So the
 * strips go out in runs of several to a thread, and while a strip's first row tile runs, the next strip's
 * weights of the same block are prefetched. Cycling through 30 copies of SmolLM2's gate_up (3072 x 576) at 32
 * rows this ran 0.192 ms against 0.218 without either (2 threads; 0.284 / 0.369 on one), elsewhere level
 * (tools/bench_cpu_gemm.py --cold 30, 2026-12-02).
 * NOTE 3: the register tile: MR activation rows x NR panels (16 columns each) of int32 sums for the current
 * block plus as many float32 accumulators; per 4 inputs NR weight loads and MR broadcasts feed MR x NR
 * vpdpbusd. Work goes out in strips of NR panels from a shared counter (gguf_cpu.c NOTE 6: whichever threads
 * run do the work); a row's outputs never depend on the other rows (no blocking decision uses M but the tail).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 }; /* ggml type ids */
#define QK 32
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define I8_KERNEL 1
#endif

#ifndef I8_MR
#define I8_MR 4
#endif
#ifndef I8_NR
#define I8_NR 3
#endif
#ifndef I8_PREFETCH
#define I8_PREFETCH 1 /* NOTE 5 */
#endif
#ifndef I8_CHUNKED
#define I8_CHUNKED 1 /* NOTE 5 */
#endif

int i8_available(void) {
#ifdef I8_KERNEL
    return 1;
#else
    return 0;
#endif
}

int i8_tile(void) { return I8_MR * 100 + I8_NR; }

static float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef I8_KERNEL
    return _cvtsh_ss(h);
#else
    (void)h;
    return 0.f;
#endif
}

/* wq: [ceil(N/16)][K/4][16][4] bytes, dc: [ceil(N/16)][K/32][2][16] floats (NOTE 1); padded columns zero. */
int i8_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *wq, float *dc, int threads) {
    if ((type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0) || K % QK) return -1;
    const int64_t nb = K / QK, np = (N + 15) / 16;
    const int bs = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34;
    memset(wq, 0, (size_t)(np * 16 * K));
    memset(dc, 0, (size_t)(np * nb * 32) * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / 16, j = n % 16;
        uint8_t *panel = wq + p * 16 * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (n * nb + b) * bs;
            const float d = half_to_float(blk);
            float c;
            uint8_t u[QK];
            if (type == T_Q8_0) {
                for (int i = 0; i < QK; i++) u[i] = (uint8_t)(blk[2 + i] ^ 0x80);
                c = -128.f * d;
            } else {
                const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
                for (int i = 0; i < 16; i++) {
                    u[i] = qs[i] & 0x0f;
                    u[i + 16] = qs[i] >> 4;
                }
                c = type == T_Q4_1 ? half_to_float(blk + 2) : -8.f * d;
            }
            for (int i = 0; i < QK; i++) {
                const int64_t k = b * QK + i;
                panel[(k / 4) * 64 + j * 4 + k % 4] = u[i];
            }
            dc[(p * nb + b) * 32 + j] = d;
            dc[(p * nb + b) * 32 + 16 + j] = c;
        }
    }
    return 0;
}

#ifdef I8_KERNEL
#define Q16_MAX 32639.f /* (32639 + 128) >> 8 = 127: hi stays in int8 */
static void quantize_rows16(const float *x, int64_t m0, int64_t m1, int64_t K, int8_t *q, float *s, int8_t *lo) {
    const int64_t nb = K / QK;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i half = _mm512_set1_epi32(128);
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * QK;
            __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask)));
            const float d = amax / Q16_MAX, id = d != 0.f ? 1.f / d : 0.f;
            __m512i sum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i q16 = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
                const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q16, half), 8);
                const __m512i l = _mm512_sub_epi32(q16, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(q + m * K + b * QK + 16 * h), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(lo + m * K + b * QK + 16 * h), _mm512_cvtepi32_epi8(l));
                sum = _mm512_add_epi32(sum, q16);
            }
            s[(m * nb + b) * 2] = d;
            s[(m * nb + b) * 2 + 1] = d * (float)_mm512_reduce_add_epi32(sum);
        }
    }
}

/* Rows m0 .. m1 of x [M, K] -> q [M, K] int8, s [M][K/32][2] (scale, scale * sum q): NOTE 2. With `lo`
 * (NOTE 4): x rounded to 16 bits, q16 = 256 hi + lo, hi in q and lo (-128 .. 127) in lo; s the scale of q16. */
static void quantize_rows(const float *x, int64_t m0, int64_t m1, int64_t K, int8_t *q, float *s, int8_t *lo) {
    if (lo) {
        quantize_rows16(x, m0, m1, K, q, s, lo);
        return;
    }
    const int64_t nb = K / QK;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * QK;
            __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            __m512 a = _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask));
            const float amax = _mm512_reduce_max_ps(a);
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            const __m512 vid = _mm512_set1_ps(id);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)); /* nearest even (MXCSR default) */
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            _mm_storeu_si128((__m128i *)(q + m * K + b * QK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + m * K + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            s[(m * nb + b) * 2] = d;
            s[(m * nb + b) * 2 + 1] = d * (float)sum;
        }
    }
}

/* One tile: rows m0 .. m0 + mr, panels p0 .. p0 + nr (NOTE 3); `cols` the valid columns of the last panel. */
INLINE void tile(const int mr, const int nr, const uint8_t *wq, const float *dc, int64_t K, const int8_t *q,
                 const float *s, const int8_t *lo, int64_t m0, int64_t p0, float *y, int64_t N, const int prefetch) {
    const int64_t nb = K / QK;
    const uint8_t *wp = wq + p0 * 16 * K;
    const float *dp = dc + p0 * nb * 32;
    __m512 fa[I8_MR][I8_NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) fa[m][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i ia[I8_MR][I8_NR];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < nr; j++) ia[m][j] = _mm512_setzero_si512();
#define I8_PASS(SRC)                                                                                         \
        for (int kk = 0; kk < QK / 4; kk++) {                                                                \
            const int64_t k4 = b * (QK / 4) + kk;                                                            \
            __m512i wv[I8_NR];                                                                               \
            for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_si512((const void *)(wp + j * 16 * K + k4 * 64)); \
            for (int m = 0; m < mr; m++) {                                                                   \
                int32_t xi;                                                                                  \
                memcpy(&xi, (SRC) + (m0 + m) * K + k4 * 4, 4);                                               \
                const __m512i xb = _mm512_set1_epi32(xi);                                                    \
                for (int j = 0; j < nr; j++) ia[m][j] = _mm512_dpbusd_epi32(ia[m][j], wv[j], xb);            \
            }                                                                                                \
        }
        if (m0 == 0 && prefetch) /* NOTE 5: the next strip's block, while this strip's first tile runs */
            for (int j = 0; j < nr; j++)
                for (int l = 0; l < QK * 16 / 64; l++)
                    _mm_prefetch((const char *)(wp + (nr + j) * 16 * K + b * QK * 16 + l * 64), _MM_HINT_T0);
        I8_PASS(q)
        if (lo) { /* NOTE 4: sum u hi, times 256, plus sum u lo: exact (|sum| < 2^27) */
            for (int m = 0; m < mr; m++)
                for (int j = 0; j < nr; j++) ia[m][j] = _mm512_slli_epi32(ia[m][j], 8);
            I8_PASS(lo)
        }
#undef I8_PASS
        __m512 dv[I8_NR], cv[I8_NR];
        for (int j = 0; j < nr; j++) {
            dv[j] = _mm512_loadu_ps(dp + (j * nb + b) * 32);
            cv[j] = _mm512_loadu_ps(dp + (j * nb + b) * 32 + 16);
        }
        for (int m = 0; m < mr; m++) {
            const __m512 sx = _mm512_set1_ps(s[((m0 + m) * nb + b) * 2]);
            const __m512 ss = _mm512_set1_ps(s[((m0 + m) * nb + b) * 2 + 1]);
            for (int j = 0; j < nr; j++) {
                fa[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][j]), _mm512_mul_ps(dv[j], sx), fa[m][j]);
                fa[m][j] = _mm512_fmadd_ps(cv[j], ss, fa[m][j]);
            }
        }
    }
    for (int j = 0; j < nr; j++) {
        const int64_t n0 = (p0 + j) * 16, left = N - n0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int m = 0; m < mr; m++) _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, fa[m][j]);
    }
}

#define TILE_ROWS(NR_)                                                                                       \
    do {                                                                                                     \
        int64_t m0 = 0;                                                                                      \
        for (; m0 + I8_MR <= M; m0 += I8_MR) tile(I8_MR, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch);                \
        switch (M - m0) {                                                                                    \
        case 1: tile(1, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;                                          \
        case 2: tile(2, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;                                          \
        case 3: tile(3, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;                                          \
        case 4: if (I8_MR > 4) tile(4 < I8_MR ? 4 : 1, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;           \
        case 5: if (I8_MR > 5) tile(5 < I8_MR ? 5 : 1, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;           \
        case 6: if (I8_MR > 6) tile(6 < I8_MR ? 6 : 1, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;           \
        case 7: if (I8_MR > 7) tile(7 < I8_MR ? 7 : 1, NR_, wq, dc, K, q, s, lo, m0, p0, y, N, prefetch); break;           \
        default: break;                                                                                      \
        }                                                                                                    \
    } while (0)

static void strip(const uint8_t *wq, const float *dc, int64_t N, int64_t K, const int8_t *q, const float *s,
                  const int8_t *lo, int64_t M, float *y, int64_t p0, int64_t nr, int prefetch) {
    switch (nr) {
    case I8_NR: TILE_ROWS(I8_NR); break;
#if I8_NR > 1
    case 1: TILE_ROWS(1); break;
#endif
#if I8_NR > 2
    case 2: TILE_ROWS(2); break;
#endif
#if I8_NR > 3
    case 3: TILE_ROWS(3); break;
#endif
    default: break;
    }
}
#endif

/* q [M, K] int8 and s [M][K/32][2] as i8_gemm quantizes x (NOTE 2; lo non-NULL: NOTE 4). */
int i8_quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *s, int8_t *lo) {
#ifdef I8_KERNEL
    if (K % QK) return -1;
    quantize_rows(x, 0, M, K, q, s, lo);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)q; (void)s; (void)lo;
    return -1;
#endif
}

/* y [M, N] = x [M, K] @ W^T with W packed by i8_pack. Returns 0, -1 (no kernel / K), -3 (out of memory). */
int i8_gemm(const uint8_t *wq, const float *dc, int64_t N, int64_t K, const float *x, int64_t M, float *y,
            int threads, int precise) {
#ifdef I8_KERNEL
    if (K % QK) return -1;
    const int64_t nb = K / QK, np = (N + 15) / 16, strips = (np + I8_NR - 1) / I8_NR;
    int8_t *q = (int8_t *)malloc((size_t)(2 * M * K) + (size_t)(M * nb * 2) * sizeof(float) + 64);
    if (!q) return -3;
    int8_t *lo = precise ? q + M * K : NULL;
    float *s = (float *)(((uintptr_t)(q + 2 * M * K) + 63) & ~(uintptr_t)63);
    if (threads < 1) threads = 1;
    if (strips < threads) threads = (int)strips;
    int64_t next = 0;
    const int64_t chunk = I8_CHUNKED ? (strips + 4 * threads - 1) / (4 * threads) : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        quantize_rows(x, M * t / nt, M * (t + 1) / nt, K, q, s, lo);
#pragma omp barrier
        for (;;) { /* NOTE 3, 5: runs of `chunk` strips to whichever thread asks */
            const int64_t c0 = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) * chunk;
            if (c0 >= strips) break;
            const int64_t c1 = c0 + chunk < strips ? c0 + chunk : strips;
            for (int64_t i = c0; i < c1; i++) {
                const int64_t p0 = i * I8_NR, nr = np - p0 < I8_NR ? np - p0 : I8_NR;
                strip(wq, dc, N, K, q, s, lo, M, y, p0, nr, I8_PREFETCH && i + 1 < c1);
            }
        }
    }
    free(q);
    return 0;
#else
    (void)wq; (void)dc; (void)N; (void)K; (void)x; (void)M; (void)y; (void)threads; (void)precise;
    return -1;
#endif
}
