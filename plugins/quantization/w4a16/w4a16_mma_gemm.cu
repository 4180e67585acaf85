// W4A16 GEMM on tensor cores for tens to thousands of activation rows, reading GPTQ-ordered 4-bit words as they
// are (mma_gemm.py explains the design; compiled at first use by NVRTC, core/layers/cuda_rtc.py, after
// w4a16_fragments.cuh: the 16-bit types, magic numbers and fragment helpers it shares with w4a16_mma.cu).
//
//   y[m, n] = sum_k x[m, k] * s[k / G, n] * (q[k, n] - z[k / G, n])
//
// Defined by the host: ZFOLD (NOTE 5), WN, WM (warps along the output columns and along the activation rows), TM (8-row
// activation tiles per warp), STAGES (64-input k-tiles in flight), FP16 (1: float16 activations and scales,
// 0: bfloat16), GI (the group's 32-input iterations; even, so a k-tile lies in one group).
//
// A block owns BN = 64 WN output columns x BM = 8 TM WM activation rows and walks its share of K (gridDim.z
// splits it) in k-tiles of 64 inputs; a warp owns 64 columns x 8 TM rows. Operands of mma.m16n8k16 as in the
// decode GEMV (w4a16_mma.cu): A = dequantized weights (16 output columns as rows, 16 inputs), B = activations
// (16 inputs, 8 activation rows), fp32 accumulators; lane (g = lane / 4, t = lane % 4).
//
// NOTE 1 (the k order, no repacking): lane t of a 32-input iteration reads GPTQ word row 4i + t, whose 8 codes
// are inputs 8r .. 8r + 7 of one column. `(w >> 4s) & 0x000F000F | MAGIC` is the 16-bit pair (128 + q_s,
// 128 + q_s+4) (bf16; fp16 1024 + q), so a word gives the lane's four A registers of two mma k-steps, inputs
// (8r + s, 8r + s + 4) at its k positions; the activations take the same order: the lane loads x[row, 8r ..
// 8r + 7] (16 bytes) and pairs them with four PRMTs. k positions need only agree between A and B (w4a16_mma.cu
// NOTE 1), so the checkpoint's words are used as they are and the decode GEMV shares them.
// NOTE 2 (dequantization in the fragment): q - z (one FMA2: (128 + q) - (128 + z), exact), times the group's
// scale (one FMA2 with -0: the product rounded once) -- the value dequantize() writes, so the mma sees the
// same 16-bit weights as dequantize + cuBLAS. 15 instructions a word (three shifts, four LOP3, eight FMA2),
// shared by the warp's TM activation tiles: 8 TM mma per word pair.
// NOTE 3 (shared memory): each k-tile is one cp.async group of four parts -- 8 word rows x BN columns, BM
// activation rows x 64 inputs, the group's BN scales and BN / 8 zero words -- in a ring of STAGES k-tiles
// (rows past M zero-filled). 16-byte chunks are XOR-swizzled so the fragment loads are conflict-free: a word
// row's chunk c sits at c ^ 2 (row % 4) (a quarter warp reads 2 chunks of 4 word rows), an activation row's at
// c ^ 4 (row % 2) (2 rows of 4 chunks).
// NOTE 4 (split-K): gridDim.z splits K into runs of k-tiles; the blocks of one output tile meet through
// float32 partials [split, M, N] and a ticket: the block that draws the last ticket sums the partials in split
// order (the same bits every run), writes y and puts the ticket back to 0, so a CUDA graph can replay the
// launch (the GEMV's scheme, w4a16_mma.cu NOTE 3).
// NOTE 5 (ZFOLD 1: the zero point and scale after the mma): the fragment keeps 128 + q (one LOP3 a pair
// instead of a LOP3 and two FMA2s); the mma sums (128 + q) x per group in float32 beside the group's sum of x
// per activation row (one more mma per activation tile and k-step, A = ones), and the group's end adds
// s ((sum (128 + q) x) - (128 + z) sum x) = s sum (q - z) x to the totals: the decode GEMV's ZFOLD
// (w4a16_mma.cu NOTE 2), at the cost of a second set of accumulators (TM = 4 only). The weights are then never
// rounded to 16 bits, so the last bits differ from dequantize + cuBLAS (closer to the float32 product).

#ifndef ZFOLD
#define ZFOLD 0
#endif

#define NEG_ZERO2 0x80008000u  // -0.0 twice: fma2(a, s, -0) is the product a s, rounded once

#define BN (64 * WN)
#define BM (8 * TM * WM)
#define THREADS (32 * WN * WM)
#define A_BYTES (32 * BN)   // 8 word rows x BN columns
#define B_BYTES (128 * BM)  // BM rows x 64 inputs
#define S_BYTES (2 * BN)
#define Z_BYTES (BN / 2)
#define STAGE_BYTES ((A_BYTES + B_BYTES + S_BYTES + Z_BYTES + 127) / 128 * 128)

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {  // ok false: 16 zero bytes
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Nibbles 0 and 4 of `w` as the pair (128 + q, 128 + q') (bf16; fp16 1024 + q): ZFOLD's fragment (NOTE 5).
__device__ __forceinline__ u32 raw(u32 w) { return and_or(w, 0x000F000Fu, MAGIC2); }

// Nibbles 0 and 4 of `w` dequantized: the pair (s (q - z), s (q' - z)) (NOTE 2).
__device__ __forceinline__ u32 deq(u32 w, u32 neg_zero, u32 scale) {
    return fma2(fma2(raw(w), ONE2, neg_zero), scale, NEG_ZERO2);
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)float_to_half(lo) | ((u32)float_to_half(hi) << 16);
}

__device__ __forceinline__ u32 word_of(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

extern "C" __global__ void __launch_bounds__(THREADS)
w4a16_mma_gemm(const u16* __restrict__ x, const u32* __restrict__ qw, const u32* __restrict__ qz,
               const u16* __restrict__ sc, u16* __restrict__ y, float* __restrict__ part,
               u32* __restrict__ tickets, int M, int N, int K, int stride_x, int stride_qz, int stride_s,
               int tiles_per_split, int zero_offset) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wc = (warp % WN) * 64, wr = (warp / WN) * 8 * TM;  // the warp's columns and rows in the tile
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int split = blockIdx.z, splits = gridDim.z;
    const int kt0 = split * tiles_per_split, kt1 = min(kt0 + tiles_per_split, K / 64);
    const int ntiles = kt1 - kt0;

    // NOTE 3: the thread's chunks of a k-tile are fixed; only k moves. A: word rows r0a + 2 WM u, chunk
    // tid % (BN / 4); B: activation rows r0b + (THREADS / 8) u, chunk tid % 8; one scale or zero chunk.
    constexpr int A_PER = 4 / WM, B_PER = 2 * TM / WN, B_STEP = THREADS / 8;
    static_assert(A_PER * WM == 4 && B_PER * WN == 2 * TM && B_PER <= 32 && GI % 2 == 0, "WM, WN, TM, GI");
    const int tid = threadIdx.x;
    const int cca = tid % (BN / 4), r0a = tid / (BN / 4);
    const int ccb = tid & 7, r0b = tid >> 3;
    const u32* a_src = qw + (size_t)r0a * N + n0 + 4 * cca;
    const size_t a_step = (size_t)2 * WM * N;
    const u16* b_src = x + (size_t)min(m0 + r0b, M - 1) * stride_x + 8 * ccb;
    const size_t b_step = (size_t)B_STEP * stride_x;
    u32 b_ok = 0;  // bit u: row r0b + B_STEP u of the tile exists (else that chunk is zero-filled)
#pragma unroll
    for (int u = 0; u < B_PER; ++u) b_ok |= (u32)(m0 + r0b + B_STEP * u < M) << u;
    const u32 s_base = shared_addr(smem);
    const u32 a_dst = s_base + r0a * (4 * BN), b_dst = s_base + A_BYTES + r0b * 128 + ((ccb ^ ((r0b & 1) << 2)) << 4);
    const bool sz_scale = tid < BN / 8, sz_zero = !sz_scale && tid < BN / 8 + BN / 32;
    const u32 sz_dst = s_base + A_BYTES + B_BYTES + (sz_scale ? tid << 4 : S_BYTES + ((tid - BN / 8) << 4));

    auto load_tile = [&](int stage, int kt) {
        const u32 so = stage * STAGE_BYTES;
        const u32* a = a_src + (size_t)kt * 8 * N;
#pragma unroll
        for (int u = 0; u < A_PER; ++u) {
            const int r = r0a + 2 * WM * u;
            cp16(a_dst + so + 2 * WM * u * (4 * BN) + ((cca ^ ((r & 3) << 1)) << 4), a + u * a_step, true);
        }
        const u16* b = b_src + kt * 64;
#pragma unroll
        for (int u = 0; u < B_PER; ++u) {
            const bool ok = (b_ok >> u) & 1u;
            cp16(b_dst + so + B_STEP * u * 128, ok ? b + u * b_step : x, ok);
        }
        const int grp = kt / (GI / 2);
        if (sz_scale) cp16(sz_dst + so, sc + (size_t)grp * stride_s + n0 + 8 * tid, true);
        if (sz_zero) cp16(sz_dst + so, qz + (size_t)grp * stride_qz + n0 / 8 + 4 * (tid - BN / 8), true);
    };

    float acc[TM][4][4];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
#if ZFOLD
    static_assert(TM <= 4, "ZFOLD keeps two sets of accumulators: TM <= 4");
    float gacc[TM][4][4], xs[TM][4];  // the group's sums of (128 + q) x, and of x (NOTE 5)
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) xs[i][r] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) gacc[i][j][r] = 0.f;
    }
#endif

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ntiles) load_tile(s, kt0 + s);
        cp_commit();  // empty groups too: the wait below counts groups
    }
    for (int it = 0; it < ntiles; ++it) {
        cp_wait<STAGES - 2>();
        __syncthreads();  // tile `it` is in; every warp is done with the stage about to be refilled
        if (it + STAGES - 1 < ntiles) load_tile((it + STAGES - 1) % STAGES, kt0 + it + STAGES - 1);
        cp_commit();
        const unsigned char* base = smem + (it % STAGES) * STAGE_BYTES;
        const u32* As = reinterpret_cast<const u32*>(base);
        const unsigned char* Bs = base + A_BYTES;
        const u16* Ss = reinterpret_cast<const u16*>(base + A_BYTES + B_BYTES);
        const u32* Zs = reinterpret_cast<const u32*>(base + A_BYTES + B_BYTES + S_BYTES);
        // The group's scales and zero points of the lane's 8 columns: wc + 4g + j (A rows g) and
        // wc + 32 + 4g + j (A rows g + 8), j < 4.
        const uint2 sa4 = *reinterpret_cast<const uint2*>(Ss + wc + 4 * g);
        const uint2 sb4 = *reinterpret_cast<const uint2*>(Ss + wc + 32 + 4 * g);
        const u32 za8 = Zs[(wc + 4 * g) >> 3], zb8 = Zs[(wc + 32 + 4 * g) >> 3];
        const int zshift = 16 * (g & 1);
#if !ZFOLD
        u32 s2a[4], s2b[4], nza[4], nzb[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 sa = ((j < 2 ? sa4.x : sa4.y) >> (16 * (j & 1))) & 0xFFFFu;
            const u32 sb = ((j < 2 ? sb4.x : sb4.y) >> (16 * (j & 1))) & 0xFFFFu;
            s2a[j] = sa | (sa << 16);
            s2b[j] = sb | (sb << 16);
            const u32 za = NEG_BASE | (((za8 >> (zshift + 4 * j)) & 0xFu) + zero_offset);
            const u32 zb = NEG_BASE | (((zb8 >> (zshift + 4 * j)) & 0xFu) + zero_offset);
            nza[j] = za | (za << 16);
            nzb[j] = zb | (zb << 16);
        }
#endif
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // two 32-input iterations: word rows 4h + t
            const int rl = 4 * h + t;
            const uint4 wa = *reinterpret_cast<const uint4*>(As + rl * BN + 4 * (((wc >> 2) + g) ^ (t << 1)));
            const uint4 wb = *reinterpret_cast<const uint4*>(As + rl * BN + 4 * (((wc >> 2) + 8 + g) ^ (t << 1)));
            u32 af[4][8];  // per A tile j: the two k-steps' four registers (NOTE 1)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a = word_of(wa, j), b = word_of(wb, j);
#if ZFOLD
                af[j][0] = raw(a);
                af[j][1] = raw(b);
                af[j][2] = raw(a >> 4);
                af[j][3] = raw(b >> 4);
                af[j][4] = raw(a >> 8);
                af[j][5] = raw(b >> 8);
                af[j][6] = raw(a >> 12);
                af[j][7] = raw(b >> 12);
#else
                af[j][0] = deq(a, nza[j], s2a[j]);
                af[j][1] = deq(b, nzb[j], s2b[j]);
                af[j][2] = deq(a >> 4, nza[j], s2a[j]);
                af[j][3] = deq(b >> 4, nzb[j], s2b[j]);
                af[j][4] = deq(a >> 8, nza[j], s2a[j]);
                af[j][5] = deq(b >> 8, nzb[j], s2b[j]);
                af[j][6] = deq(a >> 12, nza[j], s2a[j]);
                af[j][7] = deq(b >> 12, nzb[j], s2b[j]);
#endif
            }
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int rr = wr + 8 * i + g;
                const uint4 xv = *reinterpret_cast<const uint4*>(Bs + rr * 128 + ((rl ^ ((rr & 1) << 2)) << 4));
                const u32 x04 = prmt(xv.x, xv.z, 0x5410u), x15 = prmt(xv.x, xv.z, 0x7632u);
                const u32 x26 = prmt(xv.y, xv.w, 0x5410u), x37 = prmt(xv.y, xv.w, 0x7632u);
#if ZFOLD
                mma(xs[i], ONE2, ONE2, ONE2, ONE2, x04, x15);
                mma(xs[i], ONE2, ONE2, ONE2, ONE2, x26, x37);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mma(gacc[i][j], af[j][0], af[j][1], af[j][2], af[j][3], x04, x15);
                    mma(gacc[i][j], af[j][4], af[j][5], af[j][6], af[j][7], x26, x37);
                }
#else
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mma(acc[i][j], af[j][0], af[j][1], af[j][2], af[j][3], x04, x15);
                    mma(acc[i][j], af[j][4], af[j][5], af[j][6], af[j][7], x26, x37);
                }
#endif
            }
        }
#if ZFOLD
        if ((kt0 + it + 1) % (GI / 2) == 0 || it == ntiles - 1) {  // the group (or the split's share) ends
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float sa = half_to_float((u16)((j < 2 ? sa4.x : sa4.y) >> (16 * (j & 1))));
                const float sb = half_to_float((u16)((j < 2 ? sb4.x : sb4.y) >> (16 * (j & 1))));
                const float za = BASE + (float)(((za8 >> (zshift + 4 * j)) & 0xFu) + zero_offset);
                const float zb = BASE + (float)(((zb8 >> (zshift + 4 * j)) & 0xFu) + zero_offset);
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    acc[i][j][0] += sa * (gacc[i][j][0] - za * xs[i][0]);
                    acc[i][j][1] += sa * (gacc[i][j][1] - za * xs[i][1]);
                    acc[i][j][2] += sb * (gacc[i][j][2] - zb * xs[i][0]);
                    acc[i][j][3] += sb * (gacc[i][j][3] - zb * xs[i][1]);
                    gacc[i][j][0] = gacc[i][j][1] = gacc[i][j][2] = gacc[i][j][3] = 0.f;
                }
            }
#pragma unroll
            for (int i = 0; i < TM; ++i) xs[i][0] = xs[i][1] = xs[i][2] = xs[i][3] = 0.f;
        }
#endif
    }
    cp_wait<0>();

    // D of tile (i, j): rows g / g + 8 -> columns wc + 4g + j / wc + 32 + 4g + j; columns 2t, 2t + 1 -> rows
    // wr + 8i + 2t, + 1. The lane's four j of one row are four consecutive outputs: one 8-byte store.
    if (splits == 1) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int row = m0 + wr + 8 * i + 2 * t + hr;
                if (row >= M) continue;
                u16* yr = y + (size_t)row * N + n0 + wc + 4 * g;
                *reinterpret_cast<uint2*>(yr) = make_uint2(pack2(acc[i][0][hr], acc[i][1][hr]),
                                                           pack2(acc[i][2][hr], acc[i][3][hr]));
                *reinterpret_cast<uint2*>(yr + 32) = make_uint2(pack2(acc[i][0][2 + hr], acc[i][1][2 + hr]),
                                                                pack2(acc[i][2][2 + hr], acc[i][3][2 + hr]));
            }
        return;
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {  // NOTE 4
            const int row = m0 + wr + 8 * i + 2 * t + hr;
            if (row >= M) continue;
            float* pr = part + ((size_t)split * M + row) * N + n0 + wc + 4 * g;
            *reinterpret_cast<float4*>(pr) = make_float4(acc[i][0][hr], acc[i][1][hr], acc[i][2][hr], acc[i][3][hr]);
            *reinterpret_cast<float4*>(pr + 32) =
                make_float4(acc[i][0][2 + hr], acc[i][1][2 + hr], acc[i][2][2 + hr], acc[i][3][2 + hr]);
        }
    __threadfence();  // every partial of this block visible before its ticket
    __syncthreads();
    __shared__ bool last;
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) last = atomicAdd(tickets + tile, 1u) == (u32)(splits - 1);
    __syncthreads();
    if (!last) return;
    // The thread's 4 TM float4 of the tile summed split by split: 4 TM independent loads in flight per split
    // (a loop over outputs with the splits inside would wait on each load in turn).
    constexpr int PER = BM * (BN / 4) / THREADS;
    float4 v[PER];
#pragma unroll
    for (int p = 0; p < PER; ++p) v[p] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int idx = threadIdx.x + p * THREADS, row = m0 + idx / (BN / 4);
            if (row >= M) continue;
            const float4 q = __ldcg(reinterpret_cast<const float4*>(part + ((size_t)s * M + row) * N + n0 +
                                                                     4 * (idx % (BN / 4))));
            v[p].x += q.x;
            v[p].y += q.y;
            v[p].z += q.z;
            v[p].w += q.w;
        }
    }
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const int idx = threadIdx.x + p * THREADS, row = m0 + idx / (BN / 4);
        if (row < M)
            *reinterpret_cast<uint2*>(y + (size_t)row * N + n0 + 4 * (idx % (BN / 4))) =
                make_uint2(pack2(v[p].x, v[p].y), pack2(v[p].z, v[p].w));
    }
    if (threadIdx.x == 0) tickets[tile] = 0;
}
