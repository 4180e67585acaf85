// Shared by the W4A16 tensor-core kernels (w4a16_mma.cu, w4a16_mma_gemm.cu), prepended to each source by
// mma.py's cuda_source: 16-bit types, the dtype's magic numbers and instructions (FP16 1: float16, 0:
// bfloat16), and the register-level helpers their fragments are built with.

typedef unsigned int u32;
typedef unsigned short u16;

#if FP16
#define MAGIC2 0x64006400u
#define BASE 1024.f
#define NEG_BASE 0xE400u
#define ONE2 0x3C003C00u
#define FMA2 "fma.rn.f16x2"
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define CVT16 "cvt.rn.f16.f32"
#else
#define MAGIC2 0x43004300u
#define BASE 128.f
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

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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
