// A probe of wgmma for the slab engine (benchmarks/NOTES.md v40), standalone: nvcc -arch=sm_90a -O3
// -o probe 2026-12-04-wgmma-probe.cu && ./probe
//
// 1. Correctness: a K-major B operand of rows of 32 bytes (one k-step of 8 TF32 values per row, a
//    conv's staged position), 32-byte swizzled by absolute shared-memory address, read by a
//    descriptor that starts at row o (a tap's offset, any o, not only multiples of 8), with the
//    descriptor's base-offset field 0 or (start >> 7) & 7. Inputs are small integers: exact in TF32.
// 2. Rates: TF32 products per second of wgmma m64nNk8 with A from registers (N = 64, 128, 256) and of
//    mma.sync m16n8k8, every SM busy, operands fixed (no loads): the tensor pipe's ceiling each way.
//    (ptxas serializes these wgmma loops for want of registers, C7511: the wgmma rates are floors.)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

constexpr int ROWS = 64 + 8 + 256;  // B rows staged: enough for N = 256 at row offsets 0..7

// The descriptor of a K-major tile of 32-byte rows, 32-byte swizzle: start address, leading byte
// offset 1 (unused), stride byte offset 8 rows x 32 bytes, base offset, layout code 3.
__device__ __forceinline__ uint64_t desc32(unsigned addr, unsigned base_offset) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(256 >> 4) << 32) |
         (static_cast<uint64_t>(base_offset & 7) << 49) | (3ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d (+)= A x B: 64 rows x 64 columns x 8 of K; A from registers (a warp's 16 rows, as mma.sync
// m16n8k8 lays out its A fragment), B (K-major rows of 32 bytes) by descriptor; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const unsigned (&a)[4], uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// d (+)= A x B: 64 rows x 128 columns x 8 of K; A from registers (a warp's 16 rows, as mma.sync
// m16n8k8 lays out its A fragment), B (K-major rows of 32 bytes) by descriptor; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const unsigned (&a)[4], uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// d (+)= A x B: 64 rows x 256 columns x 8 of K; A from registers (a warp's 16 rows, as mma.sync
// m16n8k8 lays out its A fragment), B (K-major rows of 32 bytes) by descriptor; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const unsigned (&a)[4], uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// Stage B [ROWS][8] into shared memory, row r at byte r * 32 of a 1024-aligned region, its two
// 16-byte halves swapped where bit 7 of the address (bit 2 of r) is set: the 32-byte swizzle.
__device__ void stage_b(const float* __restrict__ b, float* b_s) {
  for (int e = threadIdx.x; e < ROWS * 8; e += blockDim.x) {
    const int r = e / 8, k = e % 8, chunk = (k / 4) ^ ((r >> 2) & 1);
    b_s[r * 8 + chunk * 4 + k % 4] = b[e];
  }
  __syncthreads();
}

// One warpgroup: D[64][64] = A[64][8] x B[o .. o + 63][8]^T.
__global__ void check_offsets(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ d_out, int o, int base_mode) {
  extern __shared__ __align__(1024) float smem[];
  float* b_s = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
  stage_b(b, b_s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = 16 * warp + g;
  const unsigned av[4] = {__float_as_uint(a[m0 * 8 + t]), __float_as_uint(a[(m0 + 8) * 8 + t]),
                          __float_as_uint(a[m0 * 8 + t + 4]), __float_as_uint(a[(m0 + 8) * 8 + t + 4])};
  const unsigned start = static_cast<unsigned>(__cvta_generic_to_shared(b_s)) + 32 * o;
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  wgmma_fence();
  wgmma_rs_n64(d, av, desc32(start, base_mode ? (start >> 7) & 7 : 0), 0);
  wgmma_commit();
  wgmma_wait<0>();
  for (int j = 0; j < 8; ++j) {
    d_out[m0 * 64 + 8 * j + 2 * t] = d[4 * j];
    d_out[m0 * 64 + 8 * j + 2 * t + 1] = d[4 * j + 1];
    d_out[(m0 + 8) * 64 + 8 * j + 2 * t] = d[4 * j + 2];
    d_out[(m0 + 8) * 64 + 8 * j + 2 * t + 1] = d[4 * j + 3];
  }
}

constexpr int ITERS = 4096;

// Every warpgroup issues ITERS x 8 wgmma m64nNk8 on one accumulator, committing every 8.
template <int N>
__global__ void rate_wgmma(float* sink, int offset) {
  extern __shared__ __align__(1024) float smem[];
  float* b_s = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
  for (int e = threadIdx.x; e < ROWS * 8; e += blockDim.x) b_s[e] = 1.0f / (1 + e % 7);
  __syncthreads();
  const unsigned av[4] = {__float_as_uint(1.0f), __float_as_uint(0.5f), __float_as_uint(0.25f), __float_as_uint(2.0f)};
  const uint64_t b = desc32(static_cast<unsigned>(__cvta_generic_to_shared(b_s)) + 32 * offset, 0);
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  wgmma_fence();
  for (int it = 0; it < ITERS; ++it) {
    #pragma unroll
    for (int u = 0; u < 8; ++u) if constexpr (N == 64) wgmma_rs_n64(d, av, b, 1); else if constexpr (N == 128) wgmma_rs_n128(d, av, b, 1); else wgmma_rs_n256(d, av, b, 1);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  float s = 0.0f;
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (s == 12345.0f) sink[threadIdx.x] = s;  // keeps the products alive
}

// Every warp issues ITERS x 8 x 3 mma.sync m16n8k8 on 8 accumulators (3xTF32's shape: 3 per tile).
__global__ void rate_mma_sync(float* sink) {
  const unsigned a[4] = {__float_as_uint(1.0f), __float_as_uint(0.5f), __float_as_uint(0.25f), __float_as_uint(2.0f)};
  unsigned b[8][2];  // a B fragment per tile, all different: identical products could be merged
  #pragma unroll
  for (int j = 0; j < 8; ++j) b[j][0] = __float_as_uint(1.5f + j), b[j][1] = __float_as_uint(0.75f - j);
  float acc[8][4] = {};
  #pragma unroll 1
  for (int it = 0; it < ITERS; ++it) {
    #pragma unroll
    for (int p = 0; p < 3; ++p) {
      #pragma unroll
      for (int j = 0; j < 8; ++j) mma_tf32(acc[j], a, b[j]);
    }
  }
  float s = 0.0f;
  for (int j = 0; j < 8; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  if (s == 12345.0f) sink[threadIdx.x] = s;
}

template <typename F>
static float time_ms(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  CHECK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = ms < best ? ms : best;
  }
  return best;
}

int main() {
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int smem = ROWS * 32 + 1024;
  float *a, *b, *d, *sink;
  CHECK(cudaMallocManaged(&a, 64 * 8 * sizeof(float)));
  CHECK(cudaMallocManaged(&b, ROWS * 8 * sizeof(float)));
  CHECK(cudaMallocManaged(&d, 64 * 64 * sizeof(float)));
  CHECK(cudaMalloc(&sink, 1024 * sizeof(float)));
  srand(1);
  for (int i = 0; i < 64 * 8; ++i) a[i] = static_cast<float>(rand() % 9 - 4);
  for (int i = 0; i < ROWS * 8; ++i) b[i] = static_cast<float>(rand() % 9 - 4);
  printf("1. B read by descriptor from row o of a 32-byte-swizzled K-major tile (max |error| over 64 x 64):\n");
  for (int base_mode = 0; base_mode < 2; ++base_mode) {
    printf("   base offset %s:", base_mode ? "(start >> 7) & 7" : "0             ");
    for (int o = 0; o < 8; ++o) {
      for (int i = 0; i < 64 * 64; ++i) d[i] = -1e30f;
      check_offsets<<<1, 128, smem>>>(a, b, d, o, base_mode);
      CHECK(cudaDeviceSynchronize());
      double worst = 0;
      for (int m = 0; m < 64; ++m)
        for (int n = 0; n < 64; ++n) {
          double want = 0;
          for (int k = 0; k < 8; ++k) want += static_cast<double>(a[m * 8 + k]) * b[(o + n) * 8 + k];
          const double err = want - d[m * 64 + n] < 0 ? d[m * 64 + n] - want : want - d[m * 64 + n];
          worst = err > worst ? err : worst;
        }
      printf("  o=%d %g", o, worst);
    }
    printf("\n");
  }
  printf("2. TF32 rates, %d SMs, operands in registers / shared memory, no loads in the loop:\n", sms);
  for (int blocks_per_sm = 1; blocks_per_sm <= 2; ++blocks_per_sm) {
    {
      CHECK(cudaFuncSetAttribute(rate_wgmma<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const float ms = time_ms([&] { rate_wgmma<64><<<sms * blocks_per_sm, 128, smem>>>(sink, 3); });
      const double flops = 2.0 * sms * blocks_per_sm * ITERS * 8.0 * (64 * 64 * 8);
      printf("   wgmma m64n64k8 (A in registers), %d warpgroup(s) per SM: %.1f TFLOP/s\n", blocks_per_sm, flops / ms / 1e9);
    }
    {
      CHECK(cudaFuncSetAttribute(rate_wgmma<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const float ms = time_ms([&] { rate_wgmma<128><<<sms * blocks_per_sm, 128, smem>>>(sink, 3); });
      const double flops = 2.0 * sms * blocks_per_sm * ITERS * 8.0 * (64 * 128 * 8);
      printf("   wgmma m64n128k8 (A in registers), %d warpgroup(s) per SM: %.1f TFLOP/s\n", blocks_per_sm, flops / ms / 1e9);
    }
    {
      CHECK(cudaFuncSetAttribute(rate_wgmma<256>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const float ms = time_ms([&] { rate_wgmma<256><<<sms * blocks_per_sm, 128, smem>>>(sink, 3); });
      const double flops = 2.0 * sms * blocks_per_sm * ITERS * 8.0 * (64 * 256 * 8);
      printf("   wgmma m64n256k8 (A in registers), %d warpgroup(s) per SM: %.1f TFLOP/s\n", blocks_per_sm, flops / ms / 1e9);
    }

  }
  for (int warps = 4; warps <= 16; warps *= 2) {
    const float ms = time_ms([&] { rate_mma_sync<<<sms * 2, 32 * warps>>>(sink); });
    const double flops = 2.0 * sms * 2 * warps * ITERS * 24.0 * (16 * 8 * 8);
    printf("   mma.sync m16n8k8, 2 blocks x %2d warps per SM: %.1f TFLOP/s\n", warps, flops / ms / 1e9);
  }
  return 0;
}
