// W4A16 decode GEMV on tensor cores, reading GPTQ-ordered 4-bit words as they are (w4a16_mma.py explains the
// design; compiled at first use by NVRTC, core/layers/cuda_rtc.py).
//
//   y[m, n] = sum_k x[m, k] * s[k / G, n] * (q[k, n] - z[k / G, n])        m < M <= 8
//
// Defined by the host: WARPS (warps per block), ITERS (iterations of 32 inputs per warp), UNROLL (iterations
// whose loads are issued together; divides G / 32), FP16 (1: float16 activations and scales, 0: bfloat16),
// TILED (NOTE 4), PIPE (1: the next UNROLL run's loads are issued before this one's math), PDL (NOTE 5).
//
// One mma.m16n8k16 (A 16 x 16 row-major, B 16 x 8 col-major, fp32 accumulators) takes A = dequantized weights
// (16 output columns n as rows, 16 inputs k) and B = activations (16 inputs, 8 activation rows m). Lane
// (g = lane / 4, t = lane % 4) holds A rows g and g + 8 at k positions 2t, 2t+1, 2t+8, 2t+9, B column g at
// the same k positions, and gets D rows g, g + 8, columns 2t, 2t + 1 (PTX ISA, "mma.m16n8k16 fragments").
//
// NOTE 1 (no repacking): k positions need only agree between A and B, so position (2t, 2t+1, 2t+8, 2t+9) of
// a tile stands for input 8r + (0, 1, 2, 3) and of the next tile for 8r + (4..7), where r = 4i + t is the
// GPTQ word row lane t reads in iteration i. One 32-bit word (8 codes of one column) then feeds two tiles,
// and lane (g, t) loads its words as two 16-byte loads per iteration -- columns nb + 4g .. +3 (A row g) and
// nb + 32 + 4g .. +3 (A row g + 8) of word row 4i + t -- and its activations as one 16-byte load of
// x[g, 32i + 8t .. +7]: four 128-byte rows of words per warp, coalesced. Column j of the four loaded gives
// A rows (g, g + 8) <-> outputs (nb + 4g + j, nb + 32 + 4g + j): four mma pairs per iteration, 64 outputs.
// NOTE 2 (a code pair in three instructions): bf16 128 + q has the bits 0x4300 | q (fp16: 1024 + q, 0x6400 |
// q), exact for q < 128. PRMT puts byte b of the word (codes 2b, 2b + 1) in the low half and byte b of the
// word >> 4 in the high half, so `& 0x000F000F | 0x43004300` (one LOP3) is the pair (128 + q_2b,
// 128 + q_2b+1), lower k in the lower half as the fragment wants; one FMA2 with -(128 + z) gives q - z exactly
// (|q - z| <= 16). The group scale multiplies the fp32 accumulators once per group, not every weight.
// NOTE 3 (split-K): warps of a block take consecutive ITERS-iteration runs of K and are summed through shared
// memory; blocks along gridDim.y take consecutive runs of WARPS * ITERS iterations and meet through float32
// partials [split, m, n] and a ticket per 64-column block: the block that draws the last ticket sums the
// partials in split order (the same bits every run), writes y and puts the ticket back to 0, so the buffer is
// zero between launches and a CUDA graph can replay the launch (the Triton GEMVs' split_k.py scheme).

// NOTE 4 (TILED): the words of a 64-column block's iteration (4 word rows x 64 columns, 1 KB) stored
// together, [N / 64][K / 32][4][64], so a warp's UNROLL run is one contiguous stretch of DRAM (the GPTQ order
// has it as 256-byte pieces of rows 4N bytes apart). Same words, permuted once at load (w4a16_mma.py).
// NOTE 5 (PDL, sm_90+): launched with programmatic stream serialization, a block lets the next kernel start,
// issues its first weight loads (the weights are not written by the kernel before it), and only then waits
// for that kernel before reading x.

typedef unsigned int u32;
typedef unsigned short u16;

#if FP16
#define MAGIC2 0x64006400u
#define NEG_BASE 0xE400u
#define ONE2 0x3C003C00u
#define FMA2 "fma.rn.f16x2"
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define CVT16 "cvt.rn.f16.f32"
#else
#define MAGIC2 0x43004300u
#define NEG_BASE 0xC300u
#define ONE2 0x3F803F80u
#define FMA2 "fma.rn.bf16x2"
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define CVT16 "cvt.rn.bf16.f32"
#endif

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// (a & b) | c
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm(FMA2 " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Codes 2b, 2b + 1 of `w` minus the zero point, as a 16-bit pair (NOTE 2); hi = w >> 4.
__device__ __forceinline__ u32 pair(u32 w, u32 hi, u32 sel, u32 neg_zero) {
    return fma2(and_or(prmt(w, hi, sel), 0x000F000Fu, MAGIC2), ONE2, neg_zero);
}

#define SEL0 0x4400u
#define SEL1 0x5511u
#define SEL2 0x6622u
#define SEL3 0x7733u

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_stream(const u32* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 component(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

__device__ __forceinline__ float half_to_float(u16 h) {
#if FP16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm(CVT16 " %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

struct Batch {  // one UNROLL run of iterations: its words, activations, and its group's zero words and scales
    uint4 wa[UNROLL], wb[UNROLL], xv[UNROLL];
    u32 za, zb;
    uint2 sa, sb;
};

extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_gemv(const u16* __restrict__ x, const u32* __restrict__ qw, const u32* __restrict__ qz,
               const u16* __restrict__ sc, u16* __restrict__ y, float* __restrict__ part,
               u32* __restrict__ tickets, int M, int N, int stride_x, int stride_qz, int stride_s,
               int total_iters, int group_iters, int zero_offset) {
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nb = blockIdx.x * 64;
    const int split = blockIdx.y, splits = gridDim.y;
    const int it0 = (split * WARPS + warp) * ITERS;
    const int it1 = min(it0 + ITERS, total_iters);

#if TILED  // NOTE 4: [N / 64][K / 32][4 word rows][64 columns]
    const u32* wp = qw + (size_t)blockIdx.x * total_iters * 256 + t * 64 + 4 * g;
    const int it_words = 256, b_off = 32;
#else  // GPTQ order: word row 4i + t, columns nb + 4g ..
    const u32* wp = qw + (size_t)t * N + nb + 4 * g;
    const int it_words = 4 * N, b_off = 32;
#endif
    const bool has_row = g < M;
    const u16* xp = x + (size_t)(has_row ? g : 0) * stride_x + 8 * t;
    const u32* zp = qz + (nb >> 3) + (g >> 1);
    const u16* sp = sc + nb + 4 * g;

    float out[4][4];
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) out[j][r] = acc[j][r] = 0.f;
    u32 nz_a[4], nz_b[4];
    float s_a[4], s_b[4];

    Batch cur;
#if PIPE
    Batch nxt;
#endif
    auto load_w = [&](Batch& b, int it) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32* p = wp + (size_t)(it + u) * it_words;
            b.wa[u] = load_stream(p);
            b.wb[u] = load_stream(p + b_off);
        }
        const int grp = it / group_iters;
        b.za = __ldg(zp + (size_t)grp * stride_qz);
        b.zb = __ldg(zp + (size_t)grp * stride_qz + 4);
        b.sa = __ldg(reinterpret_cast<const uint2*>(sp + (size_t)grp * stride_s));
        b.sb = __ldg(reinterpret_cast<const uint2*>(sp + (size_t)grp * stride_s + 32));
    };
    auto load_x = [&](Batch& b, int it) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            b.xv[u] = has_row ? __ldg(reinterpret_cast<const uint4*>(xp + (it + u) * 32)) : make_uint4(0, 0, 0, 0);
    };
    if (it0 < it1) load_w(cur, it0);
#if PDL  // NOTE 5: the first weights are in flight before the kernel that writes x has finished
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (it0 < it1) load_x(cur, it0);

    for (int it = it0; it < it1; it += UNROLL) {
#if PIPE
        if (it + UNROLL < it1) {
            load_w(nxt, it + UNROLL);
            load_x(nxt, it + UNROLL);
        }
#endif
        if (it == it0 || it % group_iters == 0) {  // a new group: its zero points and scales
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int shift = 4 * (4 * (g & 1) + j);
                const u32 za = NEG_BASE | (((cur.za >> shift) & 0xFu) + zero_offset);
                const u32 zb = NEG_BASE | (((cur.zb >> shift) & 0xFu) + zero_offset);
                nz_a[j] = za | (za << 16);
                nz_b[j] = zb | (zb << 16);
                const u32 wsa = j < 2 ? cur.sa.x : cur.sa.y, wsb = j < 2 ? cur.sb.x : cur.sb.y;
                s_a[j] = half_to_float((u16)(wsa >> (16 * (j & 1))));
                s_b[j] = half_to_float((u16)(wsb >> (16 * (j & 1))));
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a = component(cur.wa[u], j), b = component(cur.wb[u], j);
                const u32 ah = a >> 4, bh = b >> 4;
                mma(acc[j], pair(a, ah, SEL0, nz_a[j]), pair(b, bh, SEL0, nz_b[j]), pair(a, ah, SEL1, nz_a[j]),
                    pair(b, bh, SEL1, nz_b[j]), cur.xv[u].x, cur.xv[u].y);
                mma(acc[j], pair(a, ah, SEL2, nz_a[j]), pair(b, bh, SEL2, nz_b[j]), pair(a, ah, SEL3, nz_a[j]),
                    pair(b, bh, SEL3, nz_b[j]), cur.xv[u].z, cur.xv[u].w);
            }
        }
        if ((it + UNROLL) % group_iters == 0 || it + UNROLL >= it1) {  // the group ends: scale and keep
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                out[j][0] += s_a[j] * acc[j][0];
                out[j][1] += s_a[j] * acc[j][1];
                out[j][2] += s_b[j] * acc[j][2];
                out[j][3] += s_b[j] * acc[j][3];
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            }
        }
#if PIPE
        cur = nxt;
#else
        if (it + UNROLL < it1) {
            load_w(cur, it + UNROLL);
            load_x(cur, it + UNROLL);
        }
#endif
    }

    // NOTE 3: the block's warps meet in shared memory ([warp][m][column]).
    __shared__ float red[WARPS][8][64];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int m0 = 2 * t, m1 = 2 * t + 1, c0 = 4 * g + j, c1 = 32 + 4 * g + j;
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
    for (int idx = threadIdx.x; idx < M * 64; idx += WARPS * 32) {
        const int m = idx >> 6, c = idx & 63;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += red[w][m][c];
        if (splits == 1)
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
    for (int idx = threadIdx.x; idx < M * 64; idx += WARPS * 32) {
        const int m = idx >> 6, c = idx & 63;
        float v = 0.f;
        for (int s = 0; s < splits; ++s) v += __ldcg(part + ((size_t)s * M + m) * N + nb + c);
        y[(size_t)m * N + nb + c] = float_to_half(v);
    }
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}
