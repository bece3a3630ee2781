// Host emulation of the GPU execution model used by hip_src kernels (tests only).
//
// Every GPU thread of a block is a fiber (its own stack, switched in user space) on the calling
// thread; blocks run one after the other, the blocks of a thread block cluster
// (amdqb_emu_set_cluster before the launch) together. A fiber runs until it waits at a barrier or
// exits; the scheduler then resumes the next fiber whose barrier has opened, in thread order on
// even rounds and in reverse order on odd ones (no kernel may depend on either). Every thread
// waiting while none can run is a deadlock: the emulator aborts with a message. Shared memory is
// a per-block arena poisoned with 0xA5 bytes. Kernels are called through `void** args`, the same
// convention as cuLaunchKernel / hipModuleLaunchKernel kernelParams. Two lane models:
//
// * Substitutes (default): the prelude's emulator branches. Warp primitives are barrier-
//   synchronised exchanges between the 32 threads of a logical warp, so a primitive called under
//   lane-divergent control flow deadlocks (the emulator aborts the process with a message) instead
//   of silently working. On wave64 the emulated 64-bit ballot fills the other logical warp's half
//   with garbage, so the prelude must select its own half.
// * AMDGCN (AMDQB_EMU_AMDGCN, with the target's macros: __GFX9__ / __gfx942__, __GFX12__ /
//   __gfx1250__, ...): the prelude compiles its AMD branches and calls the AMDGCN cross-lane
//   builtins, defined below as models of the hardware operations on waves of AMDQB_WAVE_SIZE
//   lanes (threads t / AMDQB_WAVE_SIZE of a block form a wave; a block's last wave may be
//   partial: its missing lanes are inactive). Each operation is an exchange among the wave's
//   threads, so it too deadlocks under divergence. Inactive source lanes read as the hardware
//   reads them: 0 for ds_bpermute / ds_swizzle and for DPP / permlane with bound_ctrl, the old
//   value without it, garbage for readlane; ballots have 0 bits there. An operation that the
//   emulated target lacks (a DPP control of another generation, an unknown swizzle mode) aborts.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// Fibers switch stacks with a register save of their own on x86-64, with ucontext elsewhere or
// where AMDQB_EMU_UCONTEXT is set (which the tests use to run the fallback on x86-64 too).
#if defined(__x86_64__) && !defined(AMDQB_EMU_UCONTEXT)
#define AMDQB_EMU_REGISTER_SWITCH 1
#else
#define AMDQB_EMU_REGISTER_SWITCH 0
#include <ucontext.h>
#endif

#define AMDQB_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline

struct amdqb_dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// The running fiber's ids (the scheduler swaps them in and out with it).
extern amdqb_dim3 threadIdx;
extern amdqb_dim3 blockIdx;
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

// A barrier among the fibers of a launch, with std::barrier's contract: arrive() returns a token
// (the phase it arrived in), wait(token) returns once that phase has completed (the fiber yields
// until then), arrive_and_drop() counts as an arrival now and leaves every later phase.
struct Bar {
  explicit Bar(int n) : expected(n) {}
  int expected, arrived = 0;
  unsigned long long phase = 0;
  unsigned long long arrive() {
    const unsigned long long token = phase;
    if (++arrived == expected) complete();
    return token;
  }
  void wait(unsigned long long token);
  void arrive_and_wait() { wait(arrive()); }
  void arrive_and_drop() {
    if (--expected > 0 && arrived == expected) complete();
  }
  void complete() {
    arrived = 0;
    ++phase;
  }
};

struct Warp {
  explicit Warp() : bar(32) {}
  Bar bar;
  int vals[32];
  std::atomic<int> exited{0};
};

// A hardware wave of the AMDGCN model: `lanes` active lanes (a prefix of AMDQB_WAVE_SIZE). A
// cross-lane operation is an exchange among the lanes of the caller's row: the 32-lane half of the
// wave for a 32-lane primitive (AMDQB_LANES(32) in the prelude), the whole wave otherwise. The two
// halves of a wave64 may diverge (two logical warps), the lanes of one row may not.
struct Wave {
  explicit Wave(int n) : lanes(n) {
    for (int h = 0; h * 32 < n; ++h) half[h].reset(new Bar(n - 32 * h < 32 ? n - 32 * h : 32));
    whole.reset(new Bar(n));
  }
  int lanes;
  std::unique_ptr<Bar> half[2], whole;
  std::atomic<int> exited_half[2] = {0, 0};
  uint32_t vals[64];
};

struct Block {
  explicit Block(int n, size_t dyn_bytes) : bar(n), dyn(dyn_bytes + 16, (char)0xA5) {
    warps.reserve((n + 31) / 32);
    for (int i = 0; i < (n + 31) / 32; ++i) warps.emplace_back(new Warp());
    for (int i = 0; i < n; i += AMDQB_WAVE_SIZE)
      waves.emplace_back(new Wave(n - i < AMDQB_WAVE_SIZE ? n - i : AMDQB_WAVE_SIZE));
  }
  Bar bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<std::unique_ptr<Wave>> waves;
  std::vector<char> dyn;
  std::map<std::string, std::vector<char>> statics;
};

// The blocks of a thread block cluster (run together: one fiber per GPU thread of every block)
// and its barrier; a grid without clusters runs each block as a cluster of one.
struct Cluster {
  Cluster(int blocks, int threads, size_t dyn_bytes) : bar(blocks * threads) {
    for (int i = 0; i < blocks; ++i) members.emplace_back(new Block(threads, dyn_bytes));
  }
  Bar bar;
  std::vector<std::unique_ptr<Block>> members;
};

// The running fiber's state (the scheduler swaps it in and out with the fiber).
extern Block* g_block;
extern Cluster* g_cluster;
extern long long g_cluster_token;  // the phase of a cluster_arrive not yet waited on, else -1
extern int g_scope;                // lanes of the row the running cross-lane primitive works on
extern unsigned g_cluster_x;       // blocks per cluster of the next launch (amdqb_emu_set_cluster)
extern std::atomic<long long> g_progress;
extern uint64_t g_garbage_seed;

// One GPU thread: its stack and saved context, and its share of the state above.
struct Fiber {
  void* sp = nullptr;  // the saved stack pointer (x86-64)
#if !AMDQB_EMU_REGISTER_SWITCH
  ucontext_t uc;
#endif
  amdqb_dim3 tid, bid;
  Block* block = nullptr;
  Cluster* cluster = nullptr;
  long long cluster_token = -1;
  int scope = AMDQB_WAVE_SIZE;
  const Bar* bar = nullptr;  // the barrier it waits at (nullptr: runnable), until `phase` ends
  unsigned long long phase = 0;
  bool done = false;
};

// The fibers of one cluster of blocks (one block without clusters) and their stacks.
struct Sched {
  static constexpr size_t kStack = 512 << 10;  // bytes per fiber, a guard page at the bottom
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  int current = -1;
  void* main_sp = nullptr;
#if !AMDQB_EMU_REGISTER_SWITCH
  ucontext_t main_uc;
#endif
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;

  bool reserve(int n);  // false when the host refused the stacks' memory
  void shrink(int keep);
  void run(Cluster& cluster, int threads, unsigned x0, unsigned y, unsigned z);
  void yield();  // back to the scheduler
};
extern Sched* g_sched;

inline void Bar::wait(unsigned long long token) {
  if (phase != token) return;
  Fiber& f = g_sched->fibers[g_sched->current];
  f.bar = this;
  f.phase = token;
  g_sched->yield();
}

inline Warp& my_warp() {
  Warp& w = *g_block->warps[threadIdx.x / 32];
  if (w.exited.load()) {
    std::fprintf(stderr, "amdqb_emu: warp primitive after a lane of the warp exited\n");
    std::abort();
  }
  return w;
}

// The row scope of a cross-lane primitive (AMDQB_LANES in the prelude), restored on exit.
struct LaneScope {
  explicit LaneScope(int lanes) : saved(g_scope) { g_scope = lanes; }
  ~LaneScope() { g_scope = saved; }
  int saved;
};

[[noreturn]] inline void fail(const char* what, int value) {
  std::fprintf(stderr, "amdqb_emu: %s (0x%x)\n", what, value);
  std::abort();
}

// One exchange among the lanes of the caller's row (g_scope lanes: its half of a wave64 or the
// whole wave): every lane publishes `v`, then `read(vals, lanes, lane, in_row)` computes the
// caller's result from the published values; `lanes`: the wave's active lanes, `in_row(l)`:
// whether lane l belongs to the caller's row (a lane outside it is not executing with the
// caller: what it holds is unknown to the row).
template <typename Read>
inline auto wave_exchange(uint32_t v, Read read) {
  Wave& w = *g_block->waves[threadIdx.x / AMDQB_WAVE_SIZE];
  const int lane = (int)(threadIdx.x % AMDQB_WAVE_SIZE);
  const int scope = g_scope;
  if (scope != 32 && scope != AMDQB_WAVE_SIZE) fail("row width not 32 or the wave size", scope);
  const int base = lane & ~(scope - 1);
  const bool whole = scope == AMDQB_WAVE_SIZE;
  Bar& bar = whole ? *w.whole : *w.half[lane / 32];
  if (w.exited_half[lane / 32].load() || (whole && w.exited_half[(lane / 32) ^ 1].load()))
    fail("cross-lane operation after a lane of its row exited", lane);
  const auto in_row = [=](int l) { return l >= base && l < base + scope; };
  g_progress++;
  w.vals[lane] = v;
  bar.arrive_and_wait();
  if (w.exited_half[lane / 32].load() || (whole && w.exited_half[(lane / 32) ^ 1].load()))
    fail("cross-lane operation while a lane of its row exited", lane);
  const auto r = read(w.vals, w.lanes, lane, in_row);
  bar.arrive_and_wait();
  return r;
}

// What a read of an inactive lane's VGPR returns where the hardware leaves it undefined.
inline uint32_t garbage(int lane) { return 0xA5A5A5A5u ^ (uint32_t)lane * 0x9E3779B9u; }

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

#if defined(AMDQB_EMU_AMDGCN)
// ------------------------------------------------------------------------------------------------
// AMDGCN cross-lane builtins (the AMDGPU ISA documents' semantics, per lane of the caller's wave)
// ------------------------------------------------------------------------------------------------
#if !defined(__GFX9__) && !defined(__GFX10__) && !defined(__GFX11__) && !defined(__GFX12__)
#error "AMDQB_EMU_AMDGCN needs the target's generation macro (__GFX9__, __GFX11__, __GFX12__, ...)"
#endif
#if defined(__GFX9__) && AMDQB_WAVE_SIZE != 64
#error "gfx9 runs wave64"
#endif

namespace amdqb_emu {
constexpr int kWave = AMDQB_WAVE_SIZE;

// Source lane of DPP control `ctrl` for lane `lane` (-1: out of bounds), or abort where the
// emulated target lacks the control: quad_perm, row_shl / row_shr / row_ror, row_mirror and
// row_half_mirror everywhere; wave_shl / wave_rol / wave_shr / wave_ror and row_bcast:15 / :31 on
// gfx9 only; row_share / row_xmask from gfx10.
inline int dpp_source(int ctrl, int lane) {
  const int row = lane & ~15, in_row = lane & 15;
  if (ctrl >= 0x000 && ctrl <= 0x0ff) return (lane & ~3) | ((ctrl >> (2 * (lane & 3))) & 3);
  if (ctrl >= 0x101 && ctrl <= 0x10f) {  // row_shl:n
    const int n = ctrl & 15;
    return in_row + n <= 15 ? lane + n : -1;
  }
  if (ctrl >= 0x111 && ctrl <= 0x11f) {  // row_shr:n
    const int n = ctrl & 15;
    return in_row >= n ? lane - n : -1;
  }
  if (ctrl >= 0x121 && ctrl <= 0x12f) return row | ((in_row - (ctrl & 15)) & 15);  // row_ror:n
  if (ctrl == 0x140) return row | (15 - in_row);                                   // row_mirror
  if (ctrl == 0x141) return (lane & ~7) | (7 - (lane & 7));  // row_half_mirror
#if defined(__GFX9__)
  if (ctrl == 0x130) return lane + 1 < kWave ? lane + 1 : -1;  // wave_shl:1
  if (ctrl == 0x134) return (lane + 1) % kWave;                // wave_rol:1
  if (ctrl == 0x138) return lane >= 1 ? lane - 1 : -1;         // wave_shr:1
  if (ctrl == 0x13c) return (lane + kWave - 1) % kWave;        // wave_ror:1
  if (ctrl == 0x142) return row >= 16 ? row - 1 : -1;          // row_bcast:15
  if (ctrl == 0x143) return lane >= 32 ? 31 : -1;              // row_bcast:31
#else
  if (ctrl >= 0x150 && ctrl <= 0x15f) return row | (ctrl & 15);             // row_share:n
  if (ctrl >= 0x160 && ctrl <= 0x16f) return row | (in_row ^ (ctrl & 15));  // row_xmask:n
#endif
  fail("DPP control not available on the emulated target", ctrl);
}

// What lane `lane` reads from lane `from` (-1: out of bounds) of the published `vals`: `inactive`
// for an out-of-bounds or inactive source, garbage for one outside the caller's row.
template <typename InRow>
inline uint32_t source(const uint32_t* vals, int lanes, int from, InRow in_row, uint32_t inactive) {
  if (from < 0 || from >= lanes) return inactive;
  return in_row(from) ? vals[from] : garbage(from);
}

// v_mov_b32_dpp with `old` in the destination: lanes outside row_mask / bank_mask keep old; a
// lane whose source is out of bounds or inactive gets 0 with bound_ctrl, else keeps old.
inline int update_dpp(int old, int src, int ctrl, int row_mask, int bank_mask, bool bound_ctrl) {
  return (int)wave_exchange(
      (uint32_t)src, [&](const uint32_t* vals, int lanes, int lane, auto in_row) {
        if (!((row_mask >> (lane >> 4)) & 1) || !((bank_mask >> ((lane & 15) >> 2)) & 1))
          return (uint32_t)old;
        return source(vals, lanes, dpp_source(ctrl, lane), in_row, bound_ctrl ? 0u : (uint32_t)old);
      });
}

// permlane16 / permlanex16 (gfx10+): lane i reads lane sel[i % 16] of its own row of 16
// (permlane16) or of the other row of 16 in its 32-lane half (permlanex16); sel: 16 nibbles, 0-7
// in sel_lo. An inactive source gives 0 with bound_ctrl, else old (fetch_inactive: its value).
inline unsigned permlane(bool cross, unsigned old, unsigned src, unsigned sel_lo, unsigned sel_hi,
                         bool fetch_inactive, bool bound_ctrl) {
  return wave_exchange(src, [&](const uint32_t* vals, int lanes, int lane, auto in_row) {
    const int k = lane & 15;
    const int nib = (int)(((k < 8 ? sel_lo : sel_hi) >> (4 * (k & 7))) & 15u);
    const int from = (cross ? ((lane & ~31) | (~lane & 16)) : (lane & ~15)) | nib;
    if (from >= lanes && fetch_inactive) return garbage(from);
    return source(vals, lanes, from, in_row, bound_ctrl ? 0u : old);
  });
}
}  // namespace amdqb_emu

// ds_bpermute_b32: lane i reads lane (addr / 4) mod wave size; an inactive lane reads as 0.
inline int __builtin_amdgcn_ds_bpermute(int addr, int v) {
  return (int)amdqb_emu::wave_exchange(
      (uint32_t)v, [&](const uint32_t* vals, int lanes, int, auto in_row) {
        const int from = (int)(((unsigned)addr >> 2) & (amdqb_emu::kWave - 1));
        return amdqb_emu::source(vals, lanes, from, in_row, 0u);
      });
}

// ds_swizzle_b32: bit-mask mode (offset[15] = 0: within groups of 32 lanes, lane j reads
// ((j & and) | or) ^ xor, the masks offset[4:0], [9:5], [14:10]) and quad-permute mode
// (offset[15] = 1, offset[14:8] = 0: lane j of each group of 4 reads lane offset[2j+1:2j]); an
// inactive lane reads as 0.
inline int __builtin_amdgcn_ds_swizzle(int v, int offset) {
  const bool bitmask = (offset & 0x8000) == 0;
  if (!bitmask && (offset & 0x7f00) != 0) amdqb_emu::fail("ds_swizzle mode not modelled", offset);
  return (int)amdqb_emu::wave_exchange(
      (uint32_t)v, [&](const uint32_t* vals, int lanes, int lane, auto in_row) {
        int from;
        if (bitmask) {
          const int j = lane & 31, and_mask = offset & 31, or_mask = (offset >> 5) & 31;
          from = (lane & ~31) | (((j & and_mask) | or_mask) ^ ((offset >> 10) & 31));
        } else {
          from = (lane & ~3) | ((offset >> (2 * (lane & 3))) & 3);
        }
        return amdqb_emu::source(vals, lanes, from, in_row, 0u);
      });
}

inline int __builtin_amdgcn_update_dpp(int old, int src, int ctrl, int row_mask, int bank_mask,
                                       bool bound_ctrl) {
  return amdqb_emu::update_dpp(old, src, ctrl, row_mask, bank_mask, bound_ctrl);
}

// mov_dpp: update_dpp with an undefined old value.
inline int __builtin_amdgcn_mov_dpp(int src, int ctrl, int row_mask, int bank_mask,
                                    bool bound_ctrl) {
  const int undefined = (int)amdqb_emu::garbage((int)(threadIdx.x % amdqb_emu::kWave) + 64);
  return amdqb_emu::update_dpp(undefined, src, ctrl, row_mask, bank_mask, bound_ctrl);
}

#if !defined(__GFX9__)
inline unsigned __builtin_amdgcn_permlane16(unsigned old, unsigned src, unsigned sel_lo,
                                            unsigned sel_hi, bool fi, bool bound_ctrl) {
  return amdqb_emu::permlane(false, old, src, sel_lo, sel_hi, fi, bound_ctrl);
}
inline unsigned __builtin_amdgcn_permlanex16(unsigned old, unsigned src, unsigned sel_lo,
                                             unsigned sel_hi, bool fi, bool bound_ctrl) {
  return amdqb_emu::permlane(true, old, src, sel_lo, sel_hi, fi, bound_ctrl);
}
#endif

// v_readlane_b32 / v_readfirstlane_b32: one lane's value to every lane of the row (an SGPR); the
// first active lane of the row is its first (active lanes are a prefix); an inactive lane's
// value is garbage.
inline int __builtin_amdgcn_readlane(int v, int src_lane) {
  if (src_lane < 0 || src_lane >= amdqb_emu::kWave) amdqb_emu::fail("readlane", src_lane);
  // the lane index is a scalar operand: the same in every lane of the row
  const bool uniform = amdqb_emu::wave_exchange(
      (uint32_t)src_lane, [&](const uint32_t* vals, int lanes, int, auto in_row) {
        for (int l = 0; l < lanes; ++l)
          if (in_row(l) && vals[l] != (uint32_t)src_lane) return false;
        return true;
      });
  if (!uniform) amdqb_emu::fail("readlane with a lane index that differs across the row", src_lane);
  return (int)amdqb_emu::wave_exchange(
      (uint32_t)v, [&](const uint32_t* vals, int lanes, int, auto in_row) {
        return amdqb_emu::source(vals, lanes, src_lane, in_row, amdqb_emu::garbage(src_lane));
      });
}
inline int __builtin_amdgcn_readfirstlane(int v) {
  return (int)amdqb_emu::wave_exchange((uint32_t)v, [](const uint32_t* vals, int, int lane, auto) {
    return vals[lane & ~(amdqb_emu::g_scope - 1)];
  });
}

// Ballots: bit l = the predicate of active lane l (0 for an inactive lane, garbage for one
// outside the caller's row).
inline unsigned long long __builtin_amdgcn_ballot_w64(bool p) {
  return amdqb_emu::wave_exchange(
      p ? 1u : 0u, [](const uint32_t* vals, int lanes, int, auto in_row) {
        unsigned long long m = 0;
        for (int i = 0; i < amdqb_emu::kWave; ++i)
          m |= (unsigned long long)(amdqb_emu::source(vals, lanes, i, in_row, 0u) & 1u) << i;
        return m;
      });
}
#if AMDQB_WAVE_SIZE == 32
inline unsigned __builtin_amdgcn_ballot_w32(bool p) {
  return (unsigned)__builtin_amdgcn_ballot_w64(p);
}
#endif

// v_mbcnt_lo / hi: acc + the set bits of mask below the lane (lo: lanes 0-31, hi: lanes 32-63).
inline unsigned __builtin_amdgcn_mbcnt_lo(unsigned mask, unsigned acc) {
  const int lane = (int)(threadIdx.x % amdqb_emu::kWave);
  return acc + (unsigned)__builtin_popcount(lane >= 32 ? mask : mask & ((1u << lane) - 1u));
}
inline unsigned __builtin_amdgcn_mbcnt_hi(unsigned mask, unsigned acc) {
  const int lane = (int)(threadIdx.x % amdqb_emu::kWave);
  return acc + (unsigned)__builtin_popcount(lane < 32 ? 0u : mask & ((1u << (lane - 32)) - 1u));
}

// The lanes of a row run in lock step on the hardware: the model reproduces that with an exchange
// among the row's threads; fences are the host's.
inline void __builtin_amdgcn_wave_barrier() {
  amdqb_emu::wave_exchange(0u, [](const uint32_t*, int, int, auto) { return 0; });
}
#define __builtin_amdgcn_fence(order, scope) __atomic_thread_fence(order)
#endif  // AMDQB_EMU_AMDGCN

inline void* amdqb_emu_dyn_smem() { return amdqb_emu::g_block->dyn.data(); }

// The cluster barrier, split like the hardware's: arrive, then wait on that arrival.
inline void amdqb_emu_cluster_arrive() {
  using namespace amdqb_emu;
  if (g_cluster_token >= 0) fail("cluster_arrive twice without a cluster_wait", 0);
  g_progress++;
  g_cluster_token = (long long)g_cluster->bar.arrive();
}
inline void amdqb_emu_cluster_wait() {
  using namespace amdqb_emu;
  if (g_cluster_token < 0) fail("cluster_wait without a cluster_arrive", 0);
  g_progress++;
  const unsigned long long token = (unsigned long long)g_cluster_token;
  g_cluster_token = -1;
  g_cluster->bar.wait(token);
}
// The address at p's offset in the dynamic shared memory of block `rank` of the caller's cluster.
inline const void* amdqb_emu_cluster_map(const void* p, int rank) {
  using namespace amdqb_emu;
  const std::vector<char>& mine = g_block->dyn;
  const char* c = static_cast<const char*>(p);
  if (c < mine.data() || c >= mine.data() + mine.size())
    fail("cluster load outside the dynamic shared memory", 0);
  if (rank < 0 || rank >= (int)g_cluster->members.size()) fail("cluster load of no block", rank);
  return g_cluster->members[rank]->dyn.data() + (c - mine.data());
}

inline void* amdqb_emu_static_smem(const char* name, size_t bytes) {
  amdqb_emu::Block* b = amdqb_emu::g_block;
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

// Runs the grid: 0, or 1 with the reason in amdqb_emu_last_error() when the host refused the
// emulator a resource (the fibers' stacks). No C++ exception reaches the caller: through ctypes it
// would abort Python.
int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem, void (*body)(void*),
             void* ctx);

}  // namespace amdqb_emu

// Defines `extern "C" int amdqb_emu_launch_<kernel>(gx, gy, gz, bx, smem, void** args)`.
#define AMDQB_EMU_REGISTER(kernel)                                                                 \
  extern "C" int amdqb_emu_launch_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx,     \
                                           unsigned long long smem, void** args) {                 \
    struct Ctx {                                                                                   \
      void** args;                                                                                 \
    } ctx{args};                                                                                   \
    return amdqb_emu::run_grid(                                                                    \
        gx, gy, gz, bx, (size_t)smem,                                                              \
        [](void* c) { amdqb_emu::call_with(&kernel, static_cast<Ctx*>(c)->args); }, &ctx);         \
  }
