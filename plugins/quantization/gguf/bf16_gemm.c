/* A bf16 GEMM for a GGUF matrix's batch products (decode batches, prompts) on AVX512-BF16 CPUs.
 *
 * Built at first use by bf16_gemm.py (cc -O3 -march=native -fopenmp) and called through ctypes.
 *
 *   b16_available   1 where this build has the AVX512-BF16 kernel, else 0 (then nothing else may be called)
 *   b16_pack        a float32 [N, K] matrix rounded to bf16 once at load, in panels (NOTE 1)
 *   b16_gemm        y [M, N] = x [M, K] @ W^T (NOTE 2): x float32 (rounded to bf16 inside) or bf16, y float32
 *                   or bf16 (rounded once from the float32 sums)
 *
 * NOTE 1: the layout. Panels of 16 output columns, [ceil(N/16)][K/2][16][2] bf16: one zmm holds 16 columns x
 * 2 consecutive inputs, the operand order of vdpbf16ps (each 32-bit lane multiplies a pair and adds both
 * products to its float32 sum). Padded columns are zero. K must be even.
 * NOTE 2: the arithmetic is oneDNN's bf16 GEMM's (what torch's bf16 linear runs): x and W rounded to bf16
 * (nearest even, as torch's `.to(torch.bfloat16)`), products summed in float32. The outputs stay float32 --
 * oneDNN's bf16 linear rounds them to bf16, which the float32 model then widens again -- so they are finer
 * than that path's, and the step skips the two conversions.
 * NOTE 3: the register tile: MR activation rows x NR panels of float32 sums; per 2 inputs NR weight loads and
 * MR broadcasts feed MR x NR vdpbf16ps (24 sums: four times the instruction's latency x throughput on Zen 4,
 * so the chains never wait). Work goes out in strips of NR panels from a shared counter (whichever threads
 * run do the work, gguf_cpu.c NOTE 6), in runs of a few strips to a thread; the next strip's weights are
 * prefetched while the current strip's first row tile streams its own from memory (int8_gemm.c NOTE 5: a
 * model's matrices arrive cold). All rows of a strip run before the next strip, so the weights are read
 * from memory once and the activations (bf16, M K 2 bytes) from cache. A row's outputs never depend on the
 * other rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define B16_KERNEL 1
#endif

#if defined(B16_MR) && B16_MR > 16
#error "B16_MR: at most 16 rows (TILE_ROWS covers tails of up to 15)"
#endif
#ifndef B16_MR
#define B16_MR 8
#endif
#ifndef B16_NR
#define B16_NR 3
#endif

int b16_available(void) {
#ifdef B16_KERNEL
    return 1;
#else
    return 0;
#endif
}

int b16_tile(void) { return B16_MR * 100 + B16_NR; }

#ifdef B16_KERNEL
/* float32 -> bf16, nearest even; NaN stays NaN (vcvtneps2bf16: torch's rounding, NOTE 2). */
static void to_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
        _mm256_mask_storeu_epi16(out + i, m, v);
    }
}
#endif

/* w: [N, K] float32 -> wp: [ceil(N/16)][K/2][16][2] bf16 (NOTE 1). Returns 0, or -1 for an odd K. */
int b16_pack(const float *w, int64_t N, int64_t K, uint16_t *wp, int threads) {
#ifdef B16_KERNEL
    if (K % 2) return -1;
    const int64_t np = (N + 15) / 16;
    memset(wp, 0, (size_t)(np * 16 * K) * sizeof(uint16_t));
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        uint16_t *row = (uint16_t *)malloc((size_t)K * sizeof(uint16_t));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!row) continue;
            to_bf16(w + n * K, K, row);
            uint16_t *panel = wp + (n / 16) * 16 * K;
            const int64_t j = n % 16;
            for (int64_t k = 0; k < K; k++) panel[(k / 2) * 32 + j * 2 + k % 2] = row[k];
        }
        free(row);
    }
    return 0;
#else
    (void)w; (void)N; (void)K; (void)wp; (void)threads;
    return -1;
#endif
}

#ifdef B16_KERNEL
/* One tile: rows m0 .. m0 + mr of xb, panels p0 .. p0 + nr (NOTE 3); the last panel may be partial. */
INLINE void tile(const int mr, const int nr, const uint16_t *wp, int64_t K, const uint16_t *xb, int64_t m0,
                 int64_t p0, void *y, int ybf16, int64_t N, const int prefetch) {
    const uint16_t *w = wp + p0 * 16 * K;
    __m512 acc[B16_MR][B16_NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) acc[m][j] = _mm512_setzero_ps();
    const int64_t k2n = K / 2;
    for (int64_t k2 = 0; k2 < k2n; k2++) {
        if (prefetch) /* a line a panel a pair: the next strip's same inputs, at the rate this one streams */
            for (int j = 0; j < nr; j++) _mm_prefetch((const char *)(w + (nr + j) * 16 * K + k2 * 32), _MM_HINT_T0);
        __m512 wv[B16_NR];
        for (int j = 0; j < nr; j++) wv[j] = (__m512)_mm512_loadu_si512((const void *)(w + j * 16 * K + k2 * 32));
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, xb + (m0 + m) * K + 2 * k2, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nr; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], xv);
        }
    }
    for (int j = 0; j < nr; j++) {
        const int64_t n0 = (p0 + j) * 16, left = N - n0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        if (ybf16)
            for (int m = 0; m < mr; m++)
                _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + m) * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
        else
            for (int m = 0; m < mr; m++) _mm512_mask_storeu_ps((float *)y + (m0 + m) * N + n0, mask, acc[m][j]);
    }
}

/* The rows past the last full tile, in one tile of that many rows (a compile-time count, so it stays in
 * registers). */
#define TAIL(R_, NR_) case R_: if (R_ < B16_MR) tile(R_ < B16_MR ? R_ : 1, NR_, wp, K, xb, m0, p0, y, ybf16, N, pf); break;
#define TILE_ROWS(NR_)                                                                                       \
    do {                                                                                                     \
        int64_t m0 = 0;                                                                                      \
        int pf = prefetch;                                                                                   \
        for (; m0 + B16_MR <= M; m0 += B16_MR, pf = 0) tile(B16_MR, NR_, wp, K, xb, m0, p0, y, ybf16, N, pf);       \
        switch (M - m0) {                                                                                    \
            TAIL(1, NR_) TAIL(2, NR_) TAIL(3, NR_) TAIL(4, NR_) TAIL(5, NR_) TAIL(6, NR_) TAIL(7, NR_)       \
            TAIL(8, NR_) TAIL(9, NR_) TAIL(10, NR_) TAIL(11, NR_) TAIL(12, NR_) TAIL(13, NR_) TAIL(14, NR_)  \
            TAIL(15, NR_)                                                                                    \
        default: break;                                                                                      \
        }                                                                                                    \
    } while (0)

static void strip(const uint16_t *wp, int64_t N, int64_t K, const uint16_t *xb, int64_t M, void *y, int ybf16,
                  int64_t p0, int64_t nr, int prefetch) {
    switch (nr) {
    case B16_NR: TILE_ROWS(B16_NR); break;
#if B16_NR > 1
    case 1: TILE_ROWS(1); break;
#endif
#if B16_NR > 2
    case 2: TILE_ROWS(2); break;
#endif
#if B16_NR > 3
    case 3: TILE_ROWS(3); break;
#endif
    default: break;
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T with W packed by b16_pack; x float32 (xbf16 0) or bf16 (1), y float32 (ybf16 0) or
 * bf16 (1). Returns 0, -1 (no kernel / odd K), -3 (out of memory). */
int b16_gemm(const uint16_t *wp, int64_t N, int64_t K, const void *x, int xbf16, int64_t M, void *y, int ybf16,
             int threads) {
#ifdef B16_KERNEL
    if (K % 2) return -1;
    const int64_t np = (N + 15) / 16, strips = (np + B16_NR - 1) / B16_NR;
    uint16_t *xb = xbf16 ? (uint16_t *)x : (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
    if (!xb) return -3;
    if (threads < 1) threads = 1;
    if (strips < threads) threads = (int)strips;
    int64_t next = 0;
    const int64_t chunk = (strips + 4 * threads - 1) / (4 * threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t r0 = M * t / nt, r1 = M * (t + 1) / nt;
        if (!xbf16) to_bf16((const float *)x + r0 * K, (r1 - r0) * K, xb + r0 * K);
#pragma omp barrier
        for (;;) { /* NOTE 3: runs of `chunk` strips to whichever thread asks */
            const int64_t c0 = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) * chunk;
            if (c0 >= strips) break;
            const int64_t c1 = c0 + chunk < strips ? c0 + chunk : strips;
            for (int64_t i = c0; i < c1; i++) {
                const int64_t p0 = i * B16_NR, nr = np - p0 < B16_NR ? np - p0 : B16_NR;
                strip(wp, N, K, xb, M, y, ybf16, p0, nr, i + 1 < c1);
            }
        }
    }
    if (!xbf16) free(xb);
    return 0;
#else
    (void)wp; (void)N; (void)K; (void)x; (void)xbf16; (void)M; (void)y; (void)ybf16; (void)threads;
    return -1;
#endif
}
