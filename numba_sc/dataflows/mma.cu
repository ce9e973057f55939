// Tensor-core multiply-accumulate of one warp's piece of an output tile: the only
// C++ in numba-sc, linked into the @cuda.jit kernel of implicit_gemm_v4
// (numba_sc/dataflows/implicit_gemm.py; the fragment layouts are drawn in
// numba_sc/dataflows/tensor_cores.py). Numba cannot emit mma or ldmatrix
// instructions, so this file does the multiply-accumulate and nothing else: the
// Python kernel gathers the rows, fills shared memory, synchronizes, and writes
// the results out.
//
// numba-cuda compiles this file with NVRTC when it links a kernel that calls one of
// the functions below (cuda.declare_device(..., link=<this file>)); with link-time
// optimization (numba-cuda's default when nvJitLink is present) they are inlined
// into the kernel, so the accumulators stay in registers.
//
// Inputs, both fp16 in shared memory, row-major, rows 16-byte aligned:
//   A: the row tile, [row slot][input channel of the chunk], pitch a_pitch halves
//   B: the weight tile, [input channel of the chunk][output channel], pitch b_pitch halves
// The warp multiplies A's rows row0 .. row0 + 16*MI - 1 by B's columns
// col0 .. col0 + 8*NI - 1 over k_steps * 16 input channels, and adds the products
// onto its fp32 accumulators acc[(i * NI + j) * 4 + r], in the mma's C layout.
//
// ABI: numba-cuda's for foreign device functions: extern "C", an int status as the
// return value (0: no Python exception), a pointer to the declared return value
// first (an int32 the kernel ignores), then the arguments.

typedef unsigned int u32;

// ldmatrix takes an address in the shared-memory window; Numba hands over generic
// pointers, so convert.
__device__ __forceinline__ u32 shared_address(const void *p)
{
    u32 a;
    asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 fp16 matrices from shared memory, one per register: lane l gives the
// address of row l % 8 of matrix l / 8; afterwards lane l holds, of each matrix,
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1, exactly the A layout of the mma.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The same, each matrix transposed on the way: lane l holds rows 2 (l % 4) and
// 2 (l % 4) + 1 of column l / 4, the B layout of the mma read from a row-major B.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D = A B + D for one 16x8 tile over 16 channels: A 16x16 (four registers of two
// halves each), B 16x8 (two registers), D 16x8 in fp32 (four floats).
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int MI, int NI>
__device__ __forceinline__ void warp_tile(float *acc, const void *a_tile, const void *b_tile, int a_pitch,
                                          int b_pitch, int row0, int col0, int k_steps)
{
    static_assert(NI % 2 == 0, "B fragments are loaded two 8-column tiles at a time");
    const int lane = threadIdx.x & 31;
    float d[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                d[i][j][r] = acc[(i * NI + j) * 4 + r];
    const u32 a_base = shared_address(a_tile);
    const u32 b_base = shared_address(b_tile);
    for (int ks = 0; ks < k_steps; ++ks) {
        u32 a[MI][4], b[NI][2];
        // A, 16 rows x 16 channels per i: lanes 0-15 point at rows 0-15, channels
        // 0-7; lanes 16-31 at the same rows, channels 8-15. The four matrices come
        // back as (rows 0-7, ch 0-7), (rows 8-15, ch 0-7), (rows 0-7, ch 8-15),
        // (rows 8-15, ch 8-15): registers a0..a3 of the mma.
#pragma unroll
        for (int i = 0; i < MI; ++i) {
            const int row = row0 + i * 16 + (lane & 15);
            const int ch = ks * 16 + (lane >> 4) * 8;
            ldmatrix_x4(a[i], a_base + 2u * (u32)(row * a_pitch + ch));
        }
        // B, 16 channels x 16 columns per pair of j: lanes 0-7 point at channels 0-7,
        // lanes 8-15 at channels 8-15 (both at columns 0-7), lanes 16-31 likewise at
        // columns 8-15; transposed, they are b0, b1 of column tile j, then of j + 1.
#pragma unroll
        for (int j = 0; j < NI; j += 2) {
            const int ch = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int col = col0 + j * 8 + (lane >> 4) * 8;
            u32 r[4];
            ldmatrix_x4_trans(r, b_base + 2u * (u32)(ch * b_pitch + col));
            b[j][0] = r[0];
            b[j][1] = r[1];
            b[j + 1][0] = r[2];
            b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j)
                mma_m16n8k16(d[i][j], a[i], b[j][0], b[j][1]);
    }
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                acc[(i * NI + j) * 4 + r] = d[i][j][r];
}

// One entry point per warp-tile shape, implicit_mma_m<MI>n<NI>: a warp tile of
// 16 MI rows by 8 NI columns. (extern "C" functions cannot be templates.)
#define IMPLICIT_MMA(MI, NI)                                                                          \
    extern "C" __device__ int implicit_mma_m##MI##n##NI(int *ret, float *acc, const void *a_tile,     \
                                                        const void *b_tile, int a_pitch, int b_pitch, \
                                                        int row0, int col0, int k_steps)              \
    {                                                                                                 \
        warp_tile<MI, NI>(acc, a_tile, b_tile, a_pitch, b_pitch, row0, col0, k_steps);                \
        *ret = 0;                                                                                     \
        return 0;                                                                                     \
    }

IMPLICIT_MMA(1, 2)
IMPLICIT_MMA(1, 4)
IMPLICIT_MMA(2, 2)
IMPLICIT_MMA(2, 4)
IMPLICIT_MMA(4, 2)
IMPLICIT_MMA(4, 4)
