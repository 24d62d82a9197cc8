// Which coordinates a tiled TMA load (cp.async.bulk.tensor, .tile mode) accepts along the tensor's
// innermost dimension: the question behind the TMA engine's taps-in-place attempt (NOTES v65).
//
// A bf16 tensor [N = 2][C = 64][H = 8][W = 64] is read through a 4-D tiled map (W, H, C, N) with a
// box of 64 positions x 1 row x 64 channels x 1 sample -- one m64 tile of an NCHW conv's A operand,
// as a tap of a conv of several taps would load it, at column w and row h. With no swizzle the
// landed tile is checked element by element (zeros outside the tensor: the conv's padding).
//
//   nvcc -arch=sm_90a -o tma_inner_offset benchmarks/tma_inner_offset.cu -lcuda
//   for c in "0 0" "1 0" "-1 0" "8 0" "0 -1" "0 8"; do ./tma_inner_offset $c 0; ./tma_inner_offset $c 1; done
//
// Arguments: w h swizzle (0: none, 1: 128 bytes). One load a process: a fault ends the context.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int W = 64, H = 8, C = 64, N = 2;
constexpr int BOX_W = 64, BOX_C = 64;

struct alignas(64) TensorMap { CUtensorMap map; };

__global__ void load_box(const __grid_constant__ TensorMap map, int w, int h, unsigned short* out) {
  __shared__ alignas(1024) unsigned short tile[BOX_C * BOX_W];
  __shared__ alignas(8) unsigned long long bar;
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.proxy.async.shared::cta;");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(BOX_C * BOX_W * 2));
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(b), "r"(w), "r"(h), "r"(0), "r"(0) : "memory");
    unsigned done = 0;
    while (!done)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}"
                   : "=r"(done) : "r"(b) : "memory");
  }
  __syncthreads();
  for (int i = threadIdx.x; i < BOX_C * BOX_W; i += blockDim.x) out[i] = tile[i];
}

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s w h swizzle\n", argv[0]); return 2; }
  const int w = atoi(argv[1]), h = atoi(argv[2]), swizzle = atoi(argv[3]);
  const size_t count = size_t(W) * H * C * N;
  std::vector<unsigned short> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<unsigned short>(i % 60000 + 1);  // no zeros
  unsigned short *x, *out;
  cudaMalloc(&x, count * 2);
  cudaMalloc(&out, BOX_C * BOX_W * 2);
  cudaMemcpy(x, host.data(), count * 2, cudaMemcpyHostToDevice);

  TensorMap tm;
  cuuint64_t dims[4] = {W, H, C, N};
  cuuint64_t strides[3] = {W * 2, cuuint64_t(W) * H * 2, cuuint64_t(W) * H * C * 2};  // bytes, dims 1..3
  cuuint32_t box[4] = {BOX_W, 1, BOX_C, 1}, steps[4] = {1, 1, 1, 1};
  const CUresult encoded = cuTensorMapEncodeTiled(
      &tm.map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, x, dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (encoded != CUDA_SUCCESS) { printf("w=%d h=%d swizzle=%d: encode failed (%d)\n", w, h, swizzle, int(encoded)); return 1; }

  load_box<<<1, 128>>>(tm, w, h, out);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("w=%d h=%d swizzle=%d: %s", w, h, swizzle, cudaGetErrorString(err));
  if (err != cudaSuccess) { printf("\n"); return 1; }
  if (!swizzle) {  // row c of the tile: x[0][c][h][w .. w + 63], zeros outside the tensor
    std::vector<unsigned short> got(BOX_C * BOX_W);
    cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int c = 0; c < BOX_C; ++c)
      for (int j = 0; j < BOX_W; ++j) {
        const int col = w + j;
        const bool inside = col >= 0 && col < W && h >= 0 && h < H;
        const unsigned short want = inside ? host[(size_t(c) * H + h) * W + col] : 0;
        wrong += got[c * BOX_W + j] != want;
      }
    printf(", %d of %d elements wrong", wrong, BOX_C * BOX_W);
  }
  printf("\n");
  return 0;
}
