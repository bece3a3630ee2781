// What counting an align's routes costs in one block against one block per 1024 routes (NVIDIA):
// E=256 buckets, n uniform int32 ids, LDS atomics; graph replay of 20 launches, median of 21
// samples of 10 replays, the empty kernel beside. docs/serving.md cites it.
//   nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/align_count scripts/probes/align_count.cu && /tmp/align_count
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <vector>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e = (x);                                                                           \
    if (e != cudaSuccess) {                                                                        \
      printf("error %s at line %d\n", cudaGetErrorString(e), __LINE__);                            \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

__global__ void empty_k(int* p) {
  if (threadIdx.x == 0 && p[0] == 12345) p[1] = 1;
}

// One block of 1024 threads counts all n routes, 8 ids a thread in flight (two 16-byte loads),
// as amdqb_align_plan's first block does.
__global__ void __launch_bounds__(1024) one_block_k(const int* ids, int n, int* out) {
  __shared__ int hist[256];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int vecs = n / 4;
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  __syncthreads();
  for (int q = tid; q < vecs; q += 2 * nt) {
    const int4 a = reinterpret_cast<const int4*>(ids)[q];
    const int4 b =
        q + nt < vecs ? reinterpret_cast<const int4*>(ids)[q + nt] : make_int4(-1, -1, -1, -1);
    const int xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if ((unsigned)xs[c] < 256u) atomicAdd(&hist[xs[c]], 1);
  }
  __syncthreads();
  for (int e = tid; e < 256; e += nt) out[e] = hist[e];
}

// One block of 256 threads per 1024 routes (a tile histogram each, as amdqb_align_hist).
__global__ void __launch_bounds__(256) per_tile_k(const int* ids, int n, int* out) {
  __shared__ int hist[256];
  const int tid = threadIdx.x;
  const int4 v = reinterpret_cast<const int4*>(ids)[blockIdx.x * 256 + tid];
  hist[tid] = 0;
  __syncthreads();
  const int xs[4] = {v.x, v.y, v.z, v.w};
  for (int c = 0; c < 4; ++c)
    if ((unsigned)xs[c] < 256u) atomicAdd(&hist[xs[c]], 1);
  __syncthreads();
  out[blockIdx.x * 256 + tid] = hist[tid];
}

template <typename F>
float graph_us(F launch, cudaStream_t s) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 20; ++i) launch();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, s));
  std::vector<float> ts;
  for (int r = 0; r < 21; ++r) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < 10; ++i) CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f / 200.f);
  }
  std::sort(ts.begin(), ts.end());
  return ts[10];
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int most = 65536;
  std::vector<int> h(most);
  srand(1);
  for (int i = 0; i < most; ++i) h[i] = rand() % 256;
  int *ids, *out;
  CK(cudaMalloc(&ids, most * 4));
  CK(cudaMalloc(&out, 64 * 256 * 4));
  CK(cudaMemcpy(ids, h.data(), most * 4, cudaMemcpyHostToDevice));
  printf("empty kernel %.2f us\n", graph_us([&] { empty_k<<<1, 32, 0, s>>>(out); }, s));
  printf("one block, n=0 %.2f us\n",
         graph_us([&] { one_block_k<<<1, 1024, 0, s>>>(ids, 0, out); }, s));
  for (int n : {4096, 16384, 65536}) {
    const float one = graph_us([&] { one_block_k<<<1, 1024, 0, s>>>(ids, n, out); }, s);
    const float tiles = graph_us([&] { per_tile_k<<<n / 1024, 256, 0, s>>>(ids, n, out); }, s);
    std::vector<int> got(256);
    one_block_k<<<1, 1024, 0, s>>>(ids, n, out);
    CK(cudaMemcpy(got.data(), out, 1024, cudaMemcpyDeviceToHost));
    long sum = 0;
    for (int e = 0; e < 256; ++e) sum += got[e];
    printf("n=%d one block %.2f us, a block per 1024 routes (%d) %.2f us, counted %ld\n", n, one,
           n / 1024, tiles, sum);
  }
  return 0;
}
