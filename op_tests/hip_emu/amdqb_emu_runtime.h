// The emulator's runtime (amdqb_emu.h): its state, the fiber scheduler and the launch entry points.
// Included once, at the end of emu_kernels.cpp.
#pragma once

#include <pthread.h>
#include <sys/mman.h>
#include <time.h>

#include "amdqb_emu.h"

amdqb_dim3 threadIdx;
amdqb_dim3 blockIdx;
amdqb_dim3 blockDim;
amdqb_dim3 gridDim;

namespace amdqb_emu {

Block* g_block = nullptr;
Cluster* g_cluster = nullptr;
long long g_cluster_token = -1;
int g_scope = AMDQB_WAVE_SIZE;
unsigned g_cluster_x = 1;
std::atomic<long long> g_progress{0};
uint64_t g_garbage_seed = 1;
Sched* g_sched = new Sched();  // never destroyed: the library lives as long as the process
std::string g_error;

static void fiber_entry();

#if AMDQB_EMU_REGISTER_SWITCH
// Saves the callee-saved registers, the SSE control / status word and the x87 control word on the
// current stack, stores the stack pointer in *save, and resumes the context whose stack pointer is
// `to` (System V x86-64: rdi = save, rsi = to).
__attribute__((naked, noinline)) static void switch_stack(void** /*save*/, void* /*to*/) {
  __asm__ volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

// A fresh fiber's stack as switch_stack leaves a suspended one: the control words, six zeroed
// registers and fiber_entry as the return address, above it a slot for fiber_entry's own return
// address (never used) so that it starts with the stack aligned as after a call.
static void* initial_stack(char* stack, size_t bytes) {
  void** sp = reinterpret_cast<void**>(stack + bytes);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&fiber_entry);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  --sp;
  unsigned csr[2];
  __asm__ volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  std::memcpy(sp, csr, sizeof csr);
  return sp;
}
#endif

bool Sched::reserve(int n) {
  while ((int)stacks.size() < n) {
    void* m = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    mprotect(m, 4096, PROT_NONE);  // an overflow faults instead of writing another fiber's stack
    stacks.push_back(static_cast<char*>(m));
  }
  if ((int)fibers.size() < n) fibers.resize(n);
  return true;
}

void Sched::shrink(int keep) {
  while ((int)stacks.size() > keep) {
    munmap(stacks.back(), kStack);
    stacks.pop_back();
  }
  if ((int)fibers.size() > keep) fibers.resize(keep);
}

void Sched::yield() {
  Fiber& f = fibers[current];
#if AMDQB_EMU_REGISTER_SWITCH
  switch_stack(&f.sp, main_sp);
#else
  swapcontext(&f.uc, &main_uc);
#endif
}

// Runs every thread of the cluster's blocks to its exit.
void Sched::run(Cluster& cluster, int threads, unsigned x0, unsigned y, unsigned z) {
  const int n = (int)cluster.members.size() * threads;
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f = Fiber();
    f.tid = amdqb_dim3{(unsigned)(i % threads), 0, 0};
    f.bid = amdqb_dim3{x0 + (unsigned)(i / threads), y, z};
    f.block = cluster.members[i / threads].get();
    f.cluster = &cluster;
#if AMDQB_EMU_REGISTER_SWITCH
    f.sp = initial_stack(stacks[i], kStack);
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = stacks[i];
    f.uc.uc_stack.ss_size = kStack;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, &fiber_entry, 0);
#endif
  }
  int live = n;
  for (int round = 0; live > 0; ++round) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      const int i = round % 2 == 0 ? k : n - 1 - k;
      Fiber& f = fibers[i];
      if (f.done || (f.bar != nullptr && f.bar->phase == f.phase)) continue;
      f.bar = nullptr;
      threadIdx = f.tid;
      blockIdx = f.bid;
      g_block = f.block;
      g_cluster = f.cluster;
      g_cluster_token = f.cluster_token;
      g_scope = f.scope;
      current = i;
      g_progress++;
#if AMDQB_EMU_REGISTER_SWITCH
      switch_stack(&main_sp, f.sp);
#else
      swapcontext(&main_uc, &f.uc);
#endif
      f.cluster_token = g_cluster_token;
      f.scope = g_scope;
      ran = true;
      live -= f.done ? 1 : 0;
    }
    if (!ran) {
      std::fprintf(stderr,
                   "amdqb_emu: every live thread waits at a barrier that cannot open "
                   "(a divergent warp primitive?)\n");
      std::abort();
    }
  }
  current = -1;
  g_block = nullptr;
  g_cluster = nullptr;
}

// A fiber's life: the kernel, then its exit (it leaves every barrier of its warp, wave, block and
// cluster), then back to the scheduler for good.
static void fiber_entry() {
  Sched& s = *g_sched;
  s.body(s.ctx);
  const int t = (int)threadIdx.x;
  Block& block = *g_block;
  if (g_cluster_token >= 0) fail("exit between cluster_arrive and _wait", t);
  block.warps[t / 32]->exited.store(1);
  block.warps[t / 32]->bar.arrive_and_drop();
  Wave& wave = *block.waves[t / AMDQB_WAVE_SIZE];
  wave.exited_half[(t % AMDQB_WAVE_SIZE) / 32].store(1);
  wave.half[(t % AMDQB_WAVE_SIZE) / 32]->arrive_and_drop();
  wave.whole->arrive_and_drop();
  block.bar.arrive_and_drop();
  g_cluster->bar.arrive_and_drop();
  s.fibers[s.current].done = true;
  s.yield();
  fail("a finished fiber resumed", t);
}

// Aborts the process when a launch makes no progress for 20 s (a kernel loop that never ends: a
// wait at a barrier that cannot open is caught by the scheduler at once). One thread per library,
// started with its first launch.
static std::atomic<int> g_running{0};
static void* watchdog(void*) {
  long long last = -1;
  int idle = 0;
  for (;;) {
    const timespec tick{0, 200 * 1000 * 1000};
    nanosleep(&tick, nullptr);
    const long long now = g_progress.load();
    idle = g_running.load() && now == last ? idle + 1 : 0;
    last = now;
    if (idle > 100) {
      std::fprintf(stderr, "amdqb_emu: no progress for 20 s (a kernel loop that never ends?)\n");
      std::abort();
    }
  }
  return nullptr;
}

int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem, void (*body)(void*),
             void* ctx) {
  static bool watched = false;
  if (!watched) {
    pthread_t tid;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 << 10);
    watched = pthread_create(&tid, &attr, &watchdog, nullptr) == 0;
    pthread_attr_destroy(&attr);
  }
  gridDim = amdqb_dim3{gx, gy, gz};
  blockDim = amdqb_dim3{bx, 1, 1};
  g_error.clear();
  const unsigned cx = g_cluster_x;
  g_cluster_x = 1;
  if (cx == 0 || gx % cx != 0 || (size_t)cx * bx > 8192) {
    g_error = "cluster of " + std::to_string(cx) + " blocks for a grid of " + std::to_string(gx) +
              " blocks of " + std::to_string(bx) + " threads";
    return 1;
  }
  Sched& s = *g_sched;
  if (!s.reserve((int)(cx * bx))) {
    g_error = "no memory for " + std::to_string(cx * bx) + " fiber stacks";
    return 1;
  }
  s.body = body;
  s.ctx = ctx;
  g_running = 1;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x0 = 0; x0 < gx; x0 += cx) {
        Cluster cluster((int)cx, (int)bx, smem);
        g_garbage_seed = g_garbage_seed * 6364136223846793005ull + 1442695040888963407ull;
        s.run(cluster, (int)bx, x0, y, z);
      }
  g_running = 0;
  return 0;
}

}  // namespace amdqb_emu

extern "C" const char* amdqb_emu_last_error() { return amdqb_emu::g_error.c_str(); }
// blocks per cluster (along x) of the next launch; 1 after it
extern "C" void amdqb_emu_set_cluster(unsigned cx) { amdqb_emu::g_cluster_x = cx; }
// frees the stacks beyond the first `keep` (the runtime trims the libraries it has not launched
// lately)
extern "C" void amdqb_emu_trim(int keep) { amdqb_emu::g_sched->shrink(keep); }
