// Instruction-fetch cost of a cold kernel on NVIDIA: one warp runs the same 64 KiB straight-line
// block twice (cold, then warm) and reads clock64 around each pass. docs/serving.md cites it.
//   nvcc -arch=sm_90 -O3 -o /tmp/icache scripts/probes/icache.cu && /tmp/icache
#include <cstdio>
#include <cuda_runtime.h>

#define R8(X) X X X X X X X X
#define STEP                                                                                       \
  a0 = a0 * 1.0001f + 0.5f;                                                                        \
  a1 = a1 * 1.0001f + 0.5f;                                                                        \
  a2 = a2 * 1.0001f + 0.5f;                                                                        \
  a3 = a3 * 1.0001f + 0.5f;                                                                        \
  a4 = a4 * 1.0001f + 0.5f;                                                                        \
  a5 = a5 * 1.0001f + 0.5f;                                                                        \
  a6 = a6 * 1.0001f + 0.5f;                                                                        \
  a7 = a7 * 1.0001f + 0.5f;

__global__ void body(float* out, long long* cyc, float x) {
  float a0 = x, a1 = x + 1, a2 = x + 2, a3 = x + 3, a4 = x + 4, a5 = x + 5, a6 = x + 6, a7 = x + 7;
  long long t[3];
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    t[pass] = clock64();
    asm volatile("" ::: "memory");
    R8(R8(R8(STEP)))  // 512 steps of 8 FFMA: 4096 instructions, 64 KiB of SASS
    asm volatile("" : "+f"(a0), "+f"(a1), "+f"(a2), "+f"(a3), "+f"(a4), "+f"(a5), "+f"(a6), "+f"(a7));
  }
  t[2] = clock64();
  if (threadIdx.x == 0) {
    cyc[0] = t[1] - t[0];
    cyc[1] = t[2] - t[1];
  }
  out[threadIdx.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

int main() {
  float* out;
  long long* cyc;
  cudaMalloc(&out, 4096);
  cudaMalloc(&cyc, 64);
  long long h[2];
  for (int i = 0; i < 4; ++i) {
    body<<<1, 32>>>(out, cyc, 1.0f);
    cudaDeviceSynchronize();
    cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);
    printf("first pass %lld cycles, second pass %lld\n", h[0], h[1]);
  }
  return 0;
}
