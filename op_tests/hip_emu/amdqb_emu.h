// Host emulation of the GPU execution model used by hip_src kernels (tests only).
//
// Every GPU thread of a block is a std::thread; blocks run one after the other. Warp primitives
// are barrier-synchronised exchanges between the 32 threads of a logical warp, so a primitive
// called under lane-divergent control flow deadlocks (the watchdog aborts the process with a
// message) instead of silently working. On wave64 the emulated 64-bit ballot fills the other
// logical warp's half with garbage, so the prelude must select its own half. Shared memory is a
// per-block arena poisoned with 0xA5 bytes. Kernels are called through `void** args`, the same
// convention as cuLaunchKernel / hipModuleLaunchKernel kernelParams.
#pragma once

#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define AMDQB_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline

struct amdqb_dim3 {
  unsigned x = 1, y = 1, z = 1;
};

extern thread_local amdqb_dim3 threadIdx;
extern thread_local amdqb_dim3 blockIdx;
extern amdqb_dim3 blockDim;
extern amdqb_dim3 gridDim;

#include <math.h>  // expf, log1pf, sqrtf, floorf, fmaxf in the global namespace, as on the GPU

// The bounded sigmoid approximation (amdqb_activation.h): the host's exp2 is nearly exact, so the
// emulator simulates a larger error instead -- a deterministic perturbation of up to 0.95 of a
// 2^-14 bound, far beyond the rounding slack -- so that the CPU tests fail if a caller ever trusts
// a result the bound does not cover (the fused QB epilogue's bin fast path).
#define AMDQB_APPROX_SIGMOID_ERR (1.0f / 16384.0f)
#define AMDQB_EMU_PERTURB_APPROX_SIGMOID(z, s)                                                     \
  ((s) + ((float)((amdqb::float_bits(z) * 2654435761u) >> 8) * (1.0f / 16777216.0f) - 0.5f) *      \
             1.9f * AMDQB_APPROX_SIGMOID_ERR)

namespace amdqb_emu {

struct Warp {
  explicit Warp() : bar(32) {}
  std::barrier<> bar;
  int vals[32];
  std::atomic<int> exited{0};
};

struct Block {
  explicit Block(int n, size_t dyn_bytes) : bar(n), dyn(dyn_bytes + 16, (char)0xA5) {
    warps.reserve((n + 31) / 32);
    for (int i = 0; i < (n + 31) / 32; ++i) warps.emplace_back(new Warp());
  }
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<char> dyn;
  std::mutex mu;
  std::map<std::string, std::vector<char>> statics;
};

extern Block* g_block;
extern std::atomic<long long> g_progress;
extern uint64_t g_garbage_seed;
struct Pool;
extern Pool* g_pool;

inline Warp& my_warp() {
  Warp& w = *g_block->warps[threadIdx.x / 32];
  if (w.exited.load()) {
    std::fprintf(stderr, "amdqb_emu: warp primitive after a lane of the warp exited\n");
    std::abort();
  }
  return w;
}

}  // namespace amdqb_emu

inline void amdqb_emu_syncthreads() {
  amdqb_emu::g_progress++;
  amdqb_emu::g_block->bar.arrive_and_wait();
}

inline void amdqb_emu_syncwarp() {
  amdqb_emu::g_progress++;
  amdqb_emu::my_warp().bar.arrive_and_wait();
}

inline int amdqb_emu_bpermute(int src_hw_lane, int v) {
  amdqb_emu::Warp& w = amdqb_emu::my_warp();
  const int hw = (int)(threadIdx.x % AMDQB_WAVE_SIZE);
  if ((src_hw_lane & ~31) != (hw & ~31) || src_hw_lane < 0 || src_hw_lane >= AMDQB_WAVE_SIZE) {
    std::fprintf(stderr, "amdqb_emu: bpermute from lane %d outside the logical warp of lane %d\n",
                 src_hw_lane, hw);
    std::abort();
  }
  amdqb_emu::g_progress++;
  w.vals[threadIdx.x & 31] = v;
  w.bar.arrive_and_wait();
  const int r = w.vals[src_hw_lane & 31];
  w.bar.arrive_and_wait();
  return r;
}

inline unsigned long long amdqb_emu_ballot(bool p) {
  amdqb_emu::Warp& w = amdqb_emu::my_warp();
  amdqb_emu::g_progress++;
  w.vals[threadIdx.x & 31] = p ? 1 : 0;
  w.bar.arrive_and_wait();
  unsigned long long m = 0;
  for (int i = 0; i < 32; ++i) m |= (unsigned long long)(w.vals[i] & 1) << i;
  w.bar.arrive_and_wait();
#if AMDQB_WAVE_SIZE == 64
  // The other logical warp of the wave: garbage that the prelude must shift away / truncate.
  const unsigned long long junk =
      0x9e3779b97f4a7c15ull * (amdqb_emu::g_garbage_seed + threadIdx.x / 64);
  if (threadIdx.x & 32) return (m << 32) | (junk & 0xffffffffull);
  return m | (junk << 32);
#else
  return m;
#endif
}

inline void* amdqb_emu_dyn_smem() { return amdqb_emu::g_block->dyn.data(); }

inline void* amdqb_emu_static_smem(const char* name, size_t bytes) {
  amdqb_emu::Block* b = amdqb_emu::g_block;
  std::lock_guard<std::mutex> lock(b->mu);
  auto it = b->statics.find(name);
  if (it == b->statics.end())
    it = b->statics.emplace(name, std::vector<char>(bytes, (char)0xA5)).first;
  return it->second.data();
}

namespace amdqb_emu {

template <typename... A, size_t... I>
void call_impl(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
void call_with(void (*fn)(A...), void** args) {
  call_impl(fn, args, std::index_sequence_for<A...>{});
}

void run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem, void (*body)(void*),
              void* ctx);

// Persistent worker threads (creating 256 threads per block dominated the run time).
struct Pool {
  std::mutex mu;
  std::condition_variable cv, done_cv;
  std::vector<std::thread> workers;
  long long gen = 0;
  int active = 0, remaining = 0;
  int limit = 1 << 30;  // workers with an index at or above it exit (shrink)
  std::function<void(int)> task;

  void loop(int idx) {
    long long seen = 0;
    for (;;) {
      std::function<void(int)> t;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return gen != seen; });
        seen = gen;
        if (idx >= limit) return;
        if (idx >= active) continue;
        t = task;
      }
      t(idx);
      std::lock_guard<std::mutex> l(mu);
      if (--remaining == 0) done_cv.notify_all();
    }
  }
  void run(int n, std::function<void(int)> f) {
    {
      std::lock_guard<std::mutex> l(mu);
      while ((int)workers.size() < n) {
        const int idx = (int)workers.size();
        workers.emplace_back([this, idx] { loop(idx); });
      }
      task = std::move(f);
      active = n;
      remaining = n;
      ++gen;
    }
    cv.notify_all();
    std::unique_lock<std::mutex> l(mu);
    done_cv.wait(l, [&] { return remaining == 0; });
  }
  // Joins the workers beyond `keep`. Every emulator library has its own pool, so a 1024-thread
  // block left idle in each would exhaust the process's threads (pid_max) over a test run.
  void shrink(int keep) {
    if ((int)workers.size() <= keep) return;
    {
      std::lock_guard<std::mutex> l(mu);
      limit = keep;
      active = 0;
      ++gen;
    }
    cv.notify_all();
    for (size_t i = (size_t)keep; i < workers.size(); ++i) workers[i].join();
    workers.erase(workers.begin() + keep, workers.end());
    std::lock_guard<std::mutex> l(mu);
    limit = 1 << 30;
  }
};

}  // namespace amdqb_emu

// Defines `extern "C" int amdqb_emu_launch_<kernel>(gx, gy, gz, bx, smem, void** args)`.
#define AMDQB_EMU_REGISTER(kernel)                                                                 \
  extern "C" int amdqb_emu_launch_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx,     \
                                           unsigned long long smem, void** args) {                 \
    struct Ctx {                                                                                   \
      void** args;                                                                                 \
    } ctx{args};                                                                                   \
    amdqb_emu::run_grid(                                                                           \
        gx, gy, gz, bx, (size_t)smem,                                                              \
        [](void* c) { amdqb_emu::call_with(&kernel, static_cast<Ctx*>(c)->args); }, &ctx);         \
    return 0;                                                                                      \
  }

#define AMDQB_EMU_RUNTIME_DEFINITIONS                                                              \
  thread_local amdqb_dim3 threadIdx;                                                               \
  thread_local amdqb_dim3 blockIdx;                                                                \
  amdqb_dim3 blockDim;                                                                             \
  amdqb_dim3 gridDim;                                                                              \
  namespace amdqb_emu {                                                                            \
  Block* g_block = nullptr;                                                                        \
  std::atomic<long long> g_progress{0};                                                            \
  uint64_t g_garbage_seed = 1;                                                                     \
  Pool* g_pool = new Pool(); /* never destroyed: workers die with the process */                   \
  void run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem,                   \
                void (*body)(void*), void* ctx) {                                                  \
    gridDim = amdqb_dim3{gx, gy, gz};                                                              \
    blockDim = amdqb_dim3{bx, 1, 1};                                                               \
    std::mutex done_mu;                                                                            \
    std::condition_variable done_cv;                                                               \
    bool done = false;                                                                             \
    std::thread watchdog([&] {                                                                     \
      long long last = -1;                                                                         \
      int idle = 0;                                                                                \
      std::unique_lock<std::mutex> lock(done_mu);                                                  \
      while (!done_cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return done; })) {      \
        long long now = g_progress.load();                                                         \
        idle = (now == last) ? idle + 1 : 0;                                                       \
        last = now;                                                                                \
        if (idle > 100) {                                                                          \
          std::fprintf(stderr, "amdqb_emu: no progress for 20 s (divergent warp primitive?)\n");   \
          std::abort();                                                                            \
        }                                                                                          \
      }                                                                                            \
    });                                                                                            \
    for (unsigned z = 0; z < gz; ++z)                                                              \
      for (unsigned y = 0; y < gy; ++y)                                                            \
        for (unsigned x = 0; x < gx; ++x) {                                                        \
          Block block((int)bx, smem);                                                              \
          g_block = &block;                                                                        \
          g_garbage_seed = g_garbage_seed * 6364136223846793005ull + 1442695040888963407ull;       \
          g_pool->run((int)bx, [&](int t) {                                                        \
            threadIdx = amdqb_dim3{(unsigned)t, 0, 0};                                             \
            blockIdx = amdqb_dim3{x, y, z};                                                        \
            body(ctx);                                                                             \
            g_progress++;                                                                          \
            block.warps[t / 32]->exited.store(1);                                                  \
            block.warps[t / 32]->bar.arrive_and_drop();                                            \
            block.bar.arrive_and_drop();                                                           \
          });                                                                                      \
          g_block = nullptr;                                                                       \
        }                                                                                          \
    g_pool->shrink(256); /* keep the common block size's workers */                                \
    {                                                                                              \
      std::lock_guard<std::mutex> lock(done_mu);                                                   \
      done = true;                                                                                 \
    }                                                                                              \
    done_cv.notify_all();                                                                          \
    watchdog.join();                                                                               \
  }                                                                                                \
  }                                                                                                \
  /* the runtime trims the pools of the libraries it has not launched lately */                    \
  extern "C" void amdqb_emu_trim(int keep) { amdqb_emu::g_pool->shrink(keep); }
