// W4A16 decode GEMV on tensor cores, reading GPTQ-ordered 4-bit words as they are (w4a16_mma.py explains the
// design; compiled at first use by NVRTC, core/layers/cuda_rtc.py, after w4a16_fragments.cuh: the 16-bit
// types, magic numbers and fragment helpers it shares with w4a16_mma_gemm.cu).
//
//   y[m, n] = sum_k x[m, k] * s[k / G, n] * (q[k, n] - z[k / G, n])        m < M <= 8
//
// Defined by the host: WARPS (warps per block), ITERS (iterations of 32 inputs per warp), UNROLL (iterations
// whose loads are issued together; divides G / 32), COLS (4 or 2 columns per lane and A row pair: a block
// owns CB = 16 COLS output columns), ZFOLD (NOTE 2), FP16 (1: float16 activations and scales, 0: bfloat16),
// PDL (NOTE 4), GI (the group's iterations, G / 32: a constant, so the group arithmetic is shifts), DQ (NOTE
// 2: 0 PRMT pairs, 1 shifted-word pairs), GATED (NOTE 5), PROBE (0; 1 / 2: measurement only, wrong results:
// the loads without the math / the math without the loads).
//
// One mma.m16n8k16 (A 16 x 16 row-major, B 16 x 8 col-major, fp32 accumulators) takes A = dequantized weights
// (16 output columns n as rows, 16 inputs k) and B = activations (16 inputs, 8 activation rows m). Lane
// (g = lane / 4, t = lane % 4) holds A rows g and g + 8 at k positions 2t, 2t+1, 2t+8, 2t+9, B column g at
// the same k positions, and gets D rows g, g + 8, columns 2t, 2t + 1 (PTX ISA, "mma.m16n8k16 fragments").
//
// NOTE 1 (no repacking): k positions need only agree between A and B, so position (2t, 2t+1, 2t+8, 2t+9) of
// a tile stands for input 8r + (0, 1, 2, 3) and of the next tile for 8r + (4..7), where r = 4i + t is the
// GPTQ word row lane t reads in iteration i. One 32-bit word (8 codes of one column) then feeds two tiles,
// and lane (g, t) loads its words as two COLS-word loads per iteration -- columns nb + COLS g .. (A row g)
// and nb + CB / 2 + COLS g .. (A row g + 8) of word row 4i + t -- and its activations as one 16-byte load of
// x[g, 32i + 8t .. +7]: four rows of 4 CB contiguous bytes per warp. Column j of the COLS loaded gives A rows
// (g, g + 8) <-> outputs (nb + COLS g + j, nb + CB / 2 + COLS g + j): COLS mma pairs per iteration.
// NOTE 2 (a code pair in two instructions): bf16 128 + q has the bits 0x4300 | q (fp16: 1024 + q, 0x6400 |
// q), exact for q < 128. PRMT puts byte b of the word (codes 2b, 2b + 1) in the low half and byte b of the
// word >> 4 in the high half, so `& 0x000F000F | 0x43004300` (one LOP3) is the pair (128 + q_2b,
// 128 + q_2b+1), lower k in the lower half as the fragment wants. The zero point: ZFOLD 0 subtracts
// 128 + z with one HADD2-class FMA2 per pair (q - z, exact); ZFOLD 1 keeps 128 + q in the fragment and
// subtracts (128 + z) X afterwards, where X = the group's sum of x per row comes from one more mma per tile
// with A = ones (sum (128 + q) x - (128 + z) sum x = sum (q - z) x; the fp32 sums lose ~8 of 24 bits to the
// cancellation, far under bf16's 8). The group scale multiplies the fp32 accumulators once per group.
// DQ 1 (seven instructions a word instead of nine): `(w >> 4s) & 0x000F000F | MAGIC` is the pair (q_s, q_s+4)
// for s = 0..3 (three shifts and four LOP3s, as Marlin does), so each fragment pairs inputs 8r + s and
// 8r + s + 4; the activations are paired the same way with four PRMTs per iteration, shared by the 2 COLS
// words of the iteration (the k order inside a tile is free, NOTE 1).
// NOTE 3 (split-K): warps of a block take consecutive ITERS-iteration runs of K and are summed through shared
// memory; blocks along gridDim.y take consecutive runs of WARPS * ITERS iterations and meet through float32
// partials [split, m, n] and a ticket per column block: the block that draws the last ticket sums the
// partials in split order (the same bits every run), writes y and puts the ticket back to 0, so the buffer is
// zero between launches and a CUDA graph can replay the launch (the Triton GEMVs' split_k.py scheme).
// NOTE 4 (PDL, sm_90+): launched with programmatic stream serialization, a block lets the next kernel start,
// issues its first weight loads (the weights are not written by the kernel before it), and only then waits
// for that kernel before reading x.

// NOTE 5 (GATED, SwiGLU in the epilogue): the weights are [gate | up] (N = 2 I) and y = silu(gate) * up, [M, I].
// Block b's A rows g take gate columns 32 b + COLS g .. and rows g + 8 the up columns I + 32 b + COLS g .., so
// one block holds both halves of its 32 outputs and forms them where it writes y: the SiLU-and-mul kernel and
// its [M, 2 I] round trip go away. Rounded as the unfused path: gate and up to 16 bits, then SiluAndMul's
// float32 silu, rounded, times up (core/layers/triton_ops.py NOTE 1).

#ifndef GATED
#define GATED 0
#endif
#ifndef PROBE
#define PROBE 0
#endif

#define CB (16 * COLS)

#if COLS == 4
typedef uint4 wvec;
#define WGET(v, j) ((j) == 0 ? (v).x : (j) == 1 ? (v).y : (j) == 2 ? (v).z : (v).w)
__device__ __forceinline__ wvec load_words(const u32* p) {
    wvec v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
typedef uint2 svec;  // COLS 16-bit scales
#define SGET(v, j) ((u16)(((j) < 2 ? (v).x : (v).y) >> (16 * ((j) & 1))))
#elif COLS == 2
typedef uint2 wvec;
#define WGET(v, j) ((j) == 0 ? (v).x : (v).y)
__device__ __forceinline__ wvec load_words(const u32* p) {
    wvec v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
typedef u32 svec;
#define SGET(v, j) ((u16)((v) >> (16 * (j))))
#else
#error "COLS must be 2 or 4"
#endif

// Nibbles 0 and 4 of `w` as the 16-bit pair (128 + q, 128 + q') (ZFOLD) or (q - z, q' - z) (DQ 1, NOTE 2).
__device__ __forceinline__ u32 low_pair(u32 w, u32 neg_zero) {
    const u32 v = and_or(w, 0x000F000Fu, MAGIC2);
#if ZFOLD
    return v;
#else
    return fma2(v, ONE2, neg_zero);
#endif
}

// Codes 2b, 2b + 1 of `w` as the 16-bit pair (128 + q) (ZFOLD) or (q - z) (DQ 0, NOTE 2); hi = w >> 4.
__device__ __forceinline__ u32 pair(u32 w, u32 hi, u32 sel, u32 neg_zero) {
    const u32 v = and_or(prmt(w, hi, sel), 0x000F000Fu, MAGIC2);
#if ZFOLD
    return v;
#else
    return fma2(v, ONE2, neg_zero);
#endif
}

#define SEL0 0x4400u
#define SEL1 0x5511u
#define SEL2 0x6622u
#define SEL3 0x7733u

#if GATED
__device__ __forceinline__ u16 silu_mul(float gate, float up) {  // NOTE 5
    const float g = half_to_float(float_to_half(gate)), u = half_to_float(float_to_half(up));
    return float_to_half(half_to_float(float_to_half(g / (1.f + __expf(-g)))) * u);
}
#endif

struct Batch {  // one UNROLL run of iterations: its words, activations, and its group's zero words and scales
    wvec wa[UNROLL], wb[UNROLL];
    uint4 xv[UNROLL];
    u32 za, zb;
    svec sa, sb;
};

extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_gemv(const u16* __restrict__ x, const u32* __restrict__ qw, const u32* __restrict__ qz,
               const u16* __restrict__ sc, u16* __restrict__ y, float* __restrict__ part,
               u32* __restrict__ tickets, int M, int N, int stride_x, int stride_qz, int stride_s,
               int total_iters, int zero_offset) {
    constexpr int group_iters = GI;  // a constant: the group's index and end are shifts for powers of two
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nb = blockIdx.x * CB;  // the block's slice of [N] for the split-K partials
#if GATED  // NOTE 5: A rows g gate columns ca + COLS g .., rows g + 8 the up columns ca + boff + COLS g ..
    const int ca = blockIdx.x * (CB / 2), boff = N / 2;
#else
    const int ca = nb, boff = CB / 2;
#endif
    const int split = blockIdx.y, splits = gridDim.y;
    const int it0 = (split * WARPS + warp) * ITERS;
    const int it1 = min(it0 + ITERS, total_iters);

    const u32* wp = qw + (size_t)t * N + ca + COLS * g;  // word row 4i + t, columns ca + COLS g ..
    const bool has_row = g < M;
    const u16* xp = x + (size_t)(has_row ? g : 0) * stride_x + 8 * t;
    const u32* zp = qz + ((ca + COLS * g) >> 3);
    const u16* sp = sc + ca + COLS * g;
    const int zshift = 4 * ((COLS * g) & 7);

    float out[COLS][4];
    float acc[COLS][4];
#pragma unroll
    for (int j = 0; j < COLS; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) out[j][r] = acc[j][r] = 0.f;
#if ZFOLD
    float xs[4] = {0.f, 0.f, 0.f, 0.f};  // the group's sums of x: D of A = ones (NOTE 2)
#else
    u32 nz_a[COLS], nz_b[COLS];
#endif

    Batch cur;
    // Running pointers: the next run's first word row and activations (no 64-bit products in the loop).
    const size_t wstep = (size_t)4 * N;
    const u32* wnext = wp + (size_t)it0 * wstep;
    const u16* xnext = xp + it0 * 32;
    auto load_w = [&](Batch& b, int it) {
        const u32* p = wnext;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u, p += wstep) {
            b.wa[u] = load_words(p);
            b.wb[u] = load_words(p + boff);
        }
        wnext = p;
        const int grp = it / group_iters;
        b.za = __ldg(zp + (size_t)grp * stride_qz);
        b.zb = __ldg(zp + (size_t)grp * stride_qz + (boff >> 3));
        b.sa = __ldg(reinterpret_cast<const svec*>(sp + (size_t)grp * stride_s));
        b.sb = __ldg(reinterpret_cast<const svec*>(sp + (size_t)grp * stride_s + boff));
    };
    auto load_x = [&](Batch& b) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            b.xv[u] = has_row ? __ldg(reinterpret_cast<const uint4*>(xnext + u * 32)) : make_uint4(0, 0, 0, 0);
        xnext += UNROLL * 32;
    };
    if (it0 < it1) load_w(cur, it0);
#if PDL  // NOTE 4: the first weights are in flight before the kernel that writes x has finished
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (it0 < it1) load_x(cur);

    for (int it = it0; it < it1; it += UNROLL) {
#if !ZFOLD
        if (it == it0 || it % group_iters == 0) {  // a new group: its zero points
#pragma unroll
            for (int j = 0; j < COLS; ++j) {
                const u32 za = NEG_BASE | (((cur.za >> (zshift + 4 * j)) & 0xFu) + zero_offset);
                const u32 zb = NEG_BASE | (((cur.zb >> (zshift + 4 * j)) & 0xFu) + zero_offset);
                nz_a[j] = za | (za << 16);
                nz_b[j] = zb | (zb << 16);
            }
        }
#endif
#if PROBE == 1  // measurement only: the loads without the math
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < COLS; ++j) acc[j][0] += __uint_as_float((WGET(cur.wa[u], j) ^ WGET(cur.wb[u], j)) & 0x3FFFFFFFu);
        if (false)
#endif
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#if ZFOLD
            mma(xs, ONE2, ONE2, ONE2, ONE2, cur.xv[u].x, cur.xv[u].y);
            mma(xs, ONE2, ONE2, ONE2, ONE2, cur.xv[u].z, cur.xv[u].w);
#endif
#if DQ  // NOTE 2: inputs (8r + s, 8r + s + 4) in one register, as the code pairs
            const u32 x04 = prmt(cur.xv[u].x, cur.xv[u].z, 0x5410u), x15 = prmt(cur.xv[u].x, cur.xv[u].z, 0x7632u);
            const u32 x26 = prmt(cur.xv[u].y, cur.xv[u].w, 0x5410u), x37 = prmt(cur.xv[u].y, cur.xv[u].w, 0x7632u);
#endif
#pragma unroll
            for (int j = 0; j < COLS; ++j) {
                const u32 a = WGET(cur.wa[u], j), b = WGET(cur.wb[u], j);
#if ZFOLD
                const u32 zna = 0, znb = 0;
#else
                const u32 zna = nz_a[j], znb = nz_b[j];
#endif
#if DQ
                mma(acc[j], low_pair(a, zna), low_pair(b, znb), low_pair(a >> 4, zna), low_pair(b >> 4, znb),
                    x04, x15);
                mma(acc[j], low_pair(a >> 8, zna), low_pair(b >> 8, znb), low_pair(a >> 12, zna),
                    low_pair(b >> 12, znb), x26, x37);
#else
                const u32 ah = a >> 4, bh = b >> 4;
                mma(acc[j], pair(a, ah, SEL0, zna), pair(b, bh, SEL0, znb), pair(a, ah, SEL1, zna),
                    pair(b, bh, SEL1, znb), cur.xv[u].x, cur.xv[u].y);
                mma(acc[j], pair(a, ah, SEL2, zna), pair(b, bh, SEL2, znb), pair(a, ah, SEL3, zna),
                    pair(b, bh, SEL3, znb), cur.xv[u].z, cur.xv[u].w);
#endif
            }
        }
        if ((it + UNROLL) % group_iters == 0 || it + UNROLL >= it1) {  // the group ends: scale and keep
#pragma unroll
            for (int j = 0; j < COLS; ++j) {
                const float sa = half_to_float(SGET(cur.sa, j)), sb = half_to_float(SGET(cur.sb, j));
#if ZFOLD
                const float za = BASE + (float)(((cur.za >> (zshift + 4 * j)) & 0xFu) + zero_offset);
                const float zb = BASE + (float)(((cur.zb >> (zshift + 4 * j)) & 0xFu) + zero_offset);
                out[j][0] += sa * (acc[j][0] - za * xs[0]);
                out[j][1] += sa * (acc[j][1] - za * xs[1]);
                out[j][2] += sb * (acc[j][2] - zb * xs[2]);
                out[j][3] += sb * (acc[j][3] - zb * xs[3]);
#else
                out[j][0] += sa * acc[j][0];
                out[j][1] += sa * acc[j][1];
                out[j][2] += sb * acc[j][2];
                out[j][3] += sb * acc[j][3];
#endif
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            }
#if ZFOLD
            xs[0] = xs[1] = xs[2] = xs[3] = 0.f;
#endif
        }
        if (it + UNROLL < it1) {
#if PROBE == 2  // measurement only: the math without the loads (the first run's words again)
            if (false)
#endif
            load_w(cur, it + UNROLL);
            load_x(cur);
        }
    }

    // NOTE 3: the block's warps meet in shared memory ([warp][m][column]).
    __shared__ float red[WARPS][8][CB];
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
        const int m0 = 2 * t, m1 = 2 * t + 1, c0 = COLS * g + j, c1 = CB / 2 + COLS * g + j;
        if (m0 < M) {
            red[warp][m0][c0] = out[j][0];
            red[warp][m0][c1] = out[j][2];
        }
        if (m1 < M) {
            red[warp][m1][c0] = out[j][1];
            red[warp][m1][c1] = out[j][3];
        }
    }
    __syncthreads();
#if GATED
    if (splits == 1) {
        for (int idx = threadIdx.x; idx < M * (CB / 2); idx += WARPS * 32) {
            const int m = idx / (CB / 2), c = idx % (CB / 2);
            float vg = 0.f, vu = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                vg += red[w][m][c];
                vu += red[w][m][c + CB / 2];
            }
            y[(size_t)m * (N / 2) + ca + c] = silu_mul(vg, vu);
        }
        return;
    }
#endif
    for (int idx = threadIdx.x; idx < M * CB; idx += WARPS * 32) {
        const int m = idx / CB, c = idx % CB;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w][m][c];
        if (!GATED && splits == 1)
            y[(size_t)m * N + nb + c] = float_to_half(v);
        else
            part[((size_t)split * M + m) * N + nb + c] = v;
    }
    if (splits == 1) return;
    __threadfence();  // every partial of this block visible before its ticket
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1u) == (u32)(splits - 1);
    __syncthreads();
    if (!last) return;
#if GATED
    for (int idx = threadIdx.x; idx < M * (CB / 2); idx += WARPS * 32) {
        const int m = idx / (CB / 2), c = idx % (CB / 2);
        float vg = 0.f, vu = 0.f;
        for (int s = 0; s < splits; ++s) {
            vg += __ldcg(part + ((size_t)s * M + m) * N + nb + c);
            vu += __ldcg(part + ((size_t)s * M + m) * N + nb + c + CB / 2);
        }
        y[(size_t)m * (N / 2) + ca + c] = silu_mul(vg, vu);
    }
#else
    for (int idx = threadIdx.x; idx < M * CB; idx += WARPS * 32) {
        const int m = idx / CB, c = idx % CB;
        float v = 0.f;
        for (int s = 0; s < splits; ++s) v += __ldcg(part + ((size_t)s * M + m) * N + nb + c);
        y[(size_t)m * N + nb + c] = float_to_half(v);
    }
#endif
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}
