// Which A element each of a thread's four registers holds in wgmma m64n8k8 tf32 with A in registers
// (the fragment `a_fragments` in templates/tma.cu.j2 fills). Build and run on an sm_90 GPU:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o wgmma_rs_fragment benchmarks/wgmma_rs_fragment.cu && ./wgmma_rs_fragment
// B is the 8x8 identity, so D = A: a register that holds another element than the one supposed shows as
// a mismatch. Measured on an H100 (benchmarks/NOTES.md v71): 0 mismatches of 512.
#include <cstdio>
__global__ void probe(float* d_out) {
  __shared__ __align__(1024) float b[64];  // two 8x4 core matrices (16-byte rows): identity
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, gq = lane / 4, tq = lane % 4;
  if (t < 64) { int core = t / 32, n = t % 32 / 4, k = 4 * core + t % 4; b[t] = n == k ? 1.0f : 0.0f; }
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(b));
  unsigned long long desc = (addr >> 4) | (128ull >> 4) << 16 | (128ull >> 4) << 32;
  // hypothesis: a0 (gq, tq), a1 (gq + 8, tq), a2 (gq, tq + 4), a3 (gq + 8, tq + 4) of the warp's 16 rows
  float a[4];
  int r0 = 16 * warp + gq;
  a[0] = r0 * 8 + tq; a[1] = (r0 + 8) * 8 + tq; a[2] = r0 * 8 + tq + 4; a[3] = (r0 + 8) * 8 + tq + 4;
  float d[4] = {0, 0, 0, 0};
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
                 "l"(desc), "r"(0));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  // d0, d1: row 16 w + gq, cols 2 tq, 2 tq + 1; d2, d3: row + 8
  d_out[r0 * 8 + 2 * tq] = d[0]; d_out[r0 * 8 + 2 * tq + 1] = d[1];
  d_out[(r0 + 8) * 8 + 2 * tq] = d[2]; d_out[(r0 + 8) * 8 + 2 * tq + 1] = d[3];
}
int main() {
  float* d; cudaMalloc(&d, 512 * 4); cudaMemset(d, 0xff, 512 * 4);
  probe<<<1, 128>>>(d);
  float h[512]; cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
  int bad = 0;
  for (int i = 0; i < 512; ++i) if (h[i] != i) { if (bad < 20) printf("D[%d][%d] = %g (want %d)\n", i / 8, i % 8, h[i], i); ++bad; }
  printf("mismatches %d of 512\n", bad);
}
