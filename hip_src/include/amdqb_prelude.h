// amdqb portable prelude: one kernel source compiles as
//   * HIP  (hiprtc at run time, or `clang -x hip` / hipcc offline) for AMD GPUs, wave32 or wave64;
//   * CUDA (NVRTC at run time, or nvcc offline) for NVIDIA GPUs;
//   * plain C++ on the host (AMDQB_HOST_EMU), where op_tests/hip_emu supplies the thread, warp and
//     shared-memory primitives; used to execute the kernels on the CPU in tests. With
//     AMDQB_EMU_AMDGCN as well, the cross-lane primitives compile as their AMD branches (the
//     AMDGCN builtins, which the emulator models lane by lane on waves of AMDQB_WAVE_SIZE lanes),
//     so the AMD-only code runs on the CPU too.
//
// Warp model. Every warp-level primitive below works on a *logical warp of 32 lanes*: lane =
// linear thread index % 32 inside a 1-D block. On wave64 hardware a wave holds two logical warps;
// the shuffles address lanes inside the caller's 32-lane half only and the ballot returns the half
// of the 64-bit wave ballot that belongs to the caller's logical warp. Warp primitives must be
// called by all 32 lanes of a logical warp (never under lane-divergent control flow). The wave
// size is a compile-time constant passed with -D AMDQB_WAVE_SIZE=32|64 (warpSize is not constexpr
// on HIP). Blocks are 1-D with blockDim.x a multiple of 32 (of 64 on wave64).
//
// Precision. No fast math: callers compile with fp contraction off. fp16/bf16 conversions are done
// on the bit patterns with round-to-nearest-even, exactly like torch's `.to(dtype)` (subnormals,
// overflow to inf, NaN kept NaN).
//
// The header needs no system or vendor header under NVRTC/hiprtc.
#pragma once

#if defined(AMDQB_HOST_EMU)
#define AMDQB_EMU 1
#if defined(AMDQB_EMU_AMDGCN)
#define AMDQB_AMDGCN                                                                               \
  1  // cross-lane operations: the AMDGCN builtins (host models, op_tests/hip_emu)
#endif
#elif defined(__HIP__) || defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__)
#define AMDQB_HIP 1
#define AMDQB_AMDGCN 1  // cross-lane operations: the AMDGCN builtins
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define AMDQB_CUDA 1
#else
#error "amdqb_prelude.h: compile as HIP (hiprtc, clang -x hip), CUDA (NVRTC, nvcc) or host emu"
#endif

#if defined(AMDQB_HIP) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#ifndef AMDQB_WAVE_SIZE
#if defined(AMDQB_CUDA)
#define AMDQB_WAVE_SIZE 32
#else
#error "AMDQB_WAVE_SIZE must be defined (-D AMDQB_WAVE_SIZE=32 or 64)"
#endif
#endif
#if AMDQB_WAVE_SIZE != 32 && AMDQB_WAVE_SIZE != 64
#error "AMDQB_WAVE_SIZE must be 32 or 64"
#endif
#if defined(AMDQB_CUDA) && AMDQB_WAVE_SIZE != 32
#error "CUDA warps have 32 lanes"
#endif
#if defined(AMDQB_HIP) && defined(__AMDGCN_WAVEFRONT_SIZE)
#if __AMDGCN_WAVEFRONT_SIZE != AMDQB_WAVE_SIZE
#error "AMDQB_WAVE_SIZE does not match the target's wavefront size"
#endif
#endif

#define AMDQB_LWARP 32

// ------------------------------------------------------------------------------------------------
// Qualifiers
// ------------------------------------------------------------------------------------------------
#if defined(AMDQB_EMU)
// The emulator header (included first) defines __global__, __device__, threadIdx, ... .
#define AMDQB_DEVICE static inline
#define AMDQB_KERNEL extern "C"
#define AMDQB_LAUNCH_BOUNDS(n)
#define AMDQB_LAUNCH_BOUNDS_MIN(n, blocks)
#elif defined(AMDQB_HIP)
#define AMDQB_DEVICE static __device__ inline __attribute__((always_inline))
#define AMDQB_KERNEL extern "C" __global__
#define AMDQB_LAUNCH_BOUNDS(n) __launch_bounds__(n)
// HIP's second launch-bounds argument means waves per EU, not blocks per SM: left to the compiler.
#define AMDQB_LAUNCH_BOUNDS_MIN(n, blocks) __launch_bounds__(n)
// Contraction would change results between inlining contexts (the histogram kernel must reproduce
// the router's sigmoid bit for bit); the compile flags say -ffp-contract=off as well.
#pragma clang fp contract(off)
#else
#define AMDQB_DEVICE static __device__ __forceinline__
#define AMDQB_KERNEL extern "C" __global__
#define AMDQB_LAUNCH_BOUNDS(n) __launch_bounds__(n)
// n threads per block and at least `blocks` resident blocks per SM (caps the registers per thread)
#define AMDQB_LAUNCH_BOUNDS_MIN(n, blocks) __launch_bounds__(n, blocks)
#endif

// Shared memory. All shared memory is declared through these macros so that the emulator can
// give each block its own (poisoned) arena.
#if defined(AMDQB_EMU)
#define AMDQB_SHARED(type, name, count)                                                            \
  type* name = reinterpret_cast<type*>(amdqb_emu_static_smem(#name, sizeof(type) * (count)))
#define AMDQB_DYN_SHARED(name) int* name = reinterpret_cast<int*>(amdqb_emu_dyn_smem())
#else
#define AMDQB_SHARED(type, name, count) __shared__ type name[count]
#define AMDQB_DYN_SHARED(name) extern __shared__ int name[]
#endif

// Work-item ids and sizes (HIP): clang's AMDGPU builtins, for hiprtc and offline builds alike. The
// HIP 5.2 headers read them through __ockl_get_local_id() and friends, which are calls into a
// device library: unresolved under -nogpulib, and each call a real call (stack, clobbered
// registers) until the library is linked in. The macros shadow the header's objects; their
// members are plain unsigned values, as in CUDA. gridDim: the dispatch packet's grid size (work
// items) over the block size, which HIP launches make an exact multiple; valid for every code
// object version, unlike the implicit argument holding the block count (v5 and later only).
#if defined(AMDQB_HIP)
namespace amdqb {
struct Dim3U {
  unsigned x, y, z;
};
static __device__ inline __attribute__((always_inline)) Dim3U hip_thread_idx() {
  return {__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),
          __builtin_amdgcn_workitem_id_z()};
}
static __device__ inline __attribute__((always_inline)) Dim3U hip_block_idx() {
  return {__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),
          __builtin_amdgcn_workgroup_id_z()};
}
static __device__ inline __attribute__((always_inline)) Dim3U hip_block_dim() {
  return {(unsigned)__builtin_amdgcn_workgroup_size_x(),
          (unsigned)__builtin_amdgcn_workgroup_size_y(),
          (unsigned)__builtin_amdgcn_workgroup_size_z()};
}
static __device__ inline __attribute__((always_inline)) Dim3U hip_grid_dim() {
  const Dim3U b = hip_block_dim();
  return {__builtin_amdgcn_grid_size_x() / b.x, __builtin_amdgcn_grid_size_y() / b.y,
          __builtin_amdgcn_grid_size_z() / b.z};
}
}  // namespace amdqb
#define threadIdx (::amdqb::hip_thread_idx())
#define blockIdx (::amdqb::hip_block_idx())
#define blockDim (::amdqb::hip_block_dim())
#define gridDim (::amdqb::hip_grid_dim())
#endif

namespace amdqb {

typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
typedef short i16;
typedef unsigned short u16;
typedef unsigned char u8;

constexpr i32 kInt32Min = (-2147483647 - 1);

// ------------------------------------------------------------------------------------------------
// Bit casts, bit counts
// ------------------------------------------------------------------------------------------------
AMDQB_DEVICE u32 float_bits(float f) {
#if defined(AMDQB_CUDA)
  return __float_as_uint(f);
#elif defined(AMDQB_HIP)
  return __builtin_bit_cast(u32, f);
#else
  u32 u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

AMDQB_DEVICE float bits_float(u32 u) {
#if defined(AMDQB_CUDA)
  return __uint_as_float(u);
#elif defined(AMDQB_HIP)
  return __builtin_bit_cast(float, u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}

AMDQB_DEVICE int popc32(u32 x) {
#if defined(AMDQB_CUDA)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Index of the lowest set bit; x must be non-zero.
AMDQB_DEVICE int lowest_bit(u32 x) {
#if defined(AMDQB_CUDA)
  return __ffs((int)x) - 1;
#else
  return __builtin_ctz(x);
#endif
}

// Pins a loaded value at this point of the program: every load feeding the values passed here is
// issued before any code that follows. NVIDIA only, where ptxas never moves a load across the
// CALL of an IEEE division's slow path (see load_row in router.hip); the AMD compiler batches loads
// by itself (s_waitcnt), and the host emulator has nothing to schedule.
AMDQB_DEVICE void keep_loaded(u32& v) {
#if defined(AMDQB_CUDA)
  asm volatile("" : "+r"(v));
#else
  (void)v;
#endif
}
AMDQB_DEVICE void keep_loaded(u16& v) {
#if defined(AMDQB_CUDA)
  asm volatile("" : "+h"(v));
#else
  (void)v;
#endif
}
AMDQB_DEVICE void keep_loaded(float& v) {
  u32 b = float_bits(v);  // the same register
  keep_loaded(b);
  v = bits_float(b);
}

// ------------------------------------------------------------------------------------------------
// Raw platform primitives
// ------------------------------------------------------------------------------------------------
// AMDQB_LANES(w) opens the AMD branch of a primitive that works on rows of w lanes: on the
// hardware nothing; in the emulator's AMDGCN model it scopes the cross-lane builtins the branch
// calls to the caller's row (on wave64 with w = 32: its half of the wave, which the other half's
// logical warp may not share in that moment), so the model checks that the branch never depends
// on lanes outside the row.
#if defined(AMDQB_EMU) && defined(AMDQB_AMDGCN)
#define AMDQB_LANES(w) const ::amdqb_emu::LaneScope amdqb_lane_scope_(w)
#else
#define AMDQB_LANES(w)
#endif

#if defined(AMDQB_AMDGCN)
// Lane inside the hardware wave (independent of the block shape).
AMDQB_DEVICE int hw_lane() {
#if AMDQB_WAVE_SIZE == 64
  return (int)__builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
#else
  return (int)__builtin_amdgcn_mbcnt_lo(~0u, 0u);
#endif
}
AMDQB_DEVICE int raw_bpermute(int src_hw_lane, int v) {
  return __builtin_amdgcn_ds_bpermute(src_hw_lane << 2, v);
}
AMDQB_DEVICE u64 raw_ballot(bool p) {
#if AMDQB_WAVE_SIZE == 64
  return __builtin_amdgcn_ballot_w64(p);
#else
  return (u64)__builtin_amdgcn_ballot_w32(p);
#endif
}
#elif defined(AMDQB_EMU)
AMDQB_DEVICE int hw_lane() { return (int)(threadIdx.x % AMDQB_WAVE_SIZE); }
AMDQB_DEVICE int raw_bpermute(int src_hw_lane, int v) { return amdqb_emu_bpermute(src_hw_lane, v); }
AMDQB_DEVICE u64 raw_ballot(bool p) { return amdqb_emu_ballot(p); }
#endif

// Lane inside the 32-lane logical warp.
AMDQB_DEVICE int lane_id() {
#if defined(AMDQB_CUDA)
  return (int)(threadIdx.x & 31u);
#else
  return hw_lane() & 31;
#endif
}

// Logical warp index inside the block.
AMDQB_DEVICE int warp_in_block() { return (int)(threadIdx.x >> 5); }

AMDQB_DEVICE u32 lanemask_lt() { return (1u << lane_id()) - 1u; }

// ------------------------------------------------------------------------------------------------
// Logical-warp primitives (32 lanes)
// ------------------------------------------------------------------------------------------------
AMDQB_DEVICE int shfl_xor_i32(int v, int mask) {
#if defined(AMDQB_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask, 32);
#else
  AMDQB_LANES(32);
  // mask < 32 keeps the source inside the caller's 32-lane half of a wave64.
  return raw_bpermute(hw_lane() ^ mask, v);
#endif
}

// Value of `v` held by logical lane `src` (0..31) of the caller's logical warp.
AMDQB_DEVICE int shfl_i32(int v, int src) {
#if defined(AMDQB_CUDA)
  return __shfl_sync(0xffffffffu, v, src, 32);
#else
  AMDQB_LANES(32);
  return raw_bpermute((hw_lane() & ~31) | (src & 31), v);
#endif
}

AMDQB_DEVICE float shfl_xor_f32(float v, int mask) {
  return bits_float((u32)shfl_xor_i32((int)float_bits(v), mask));
}
AMDQB_DEVICE float shfl_f32(float v, int src) {
  return bits_float((u32)shfl_i32((int)float_bits(v), src));
}

// Bit l = predicate of logical lane l.
AMDQB_DEVICE u32 ballot32(bool p) {
#if defined(AMDQB_CUDA)
  return __ballot_sync(0xffffffffu, p);
#elif AMDQB_WAVE_SIZE == 64
  AMDQB_LANES(32);
  return (u32)(raw_ballot(p) >> (hw_lane() & 32));
#else
  AMDQB_LANES(32);
  return (u32)raw_ballot(p);
#endif
}

// Bit l = (v of logical lane l == the caller's v). CUDA: one match instruction; elsewhere 32
// shuffles (independent of each other, so they pipeline).
AMDQB_DEVICE u32 match_any_i32(int v) {
#if defined(AMDQB_CUDA)
  return __match_any_sync(0xffffffffu, v);
#else
  u32 peers = 0;
#pragma unroll
  for (int src = 0; src < 32; ++src) peers |= (u32)(shfl_i32(v, src) == v) << src;
  return peers;
#endif
}

// Starts fetching the line of p into the L1 (NVIDIA); a no-op elsewhere.
AMDQB_DEVICE void prefetch_l1(const void* p) {
#if defined(AMDQB_CUDA)
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// Number of lanes below the caller whose predicate is true.
AMDQB_DEVICE int warp_prefix_count(bool p) { return popc32(ballot32(p) & lanemask_lt()); }

// Orders the caller's shared-memory accesses with those of the other lanes of its logical warp.
AMDQB_DEVICE void warp_sync() {
#if defined(AMDQB_CUDA)
  __syncwarp();
#elif defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  // Lanes of a wave run in lock step; a wavefront-scope fence orders the LDS accesses and the
  // wave barrier keeps the compiler from moving them across.
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  amdqb_emu_syncwarp();
#endif
}

// Programmatic dependent launch (NVIDIA sm_90+; nothing elsewhere). A kernel launched with the
// runtime's launch_dependent may start while the kernel before it in the stream is still running:
// it must call wait_for_prior_grid() before it touches that kernel's outputs (the wait returns once
// the prior grid has completed and its writes are visible); what earlier kernels wrote is complete
// already, since the prior kernel itself started after them. allow_dependent_launch() lets the
// dependent grid's blocks be scheduled as soon as this grid's blocks have all issued it (without
// it, as they exit). Both are no-ops for ordinary launches.
AMDQB_DEVICE void wait_for_prior_grid() {
#if defined(AMDQB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
AMDQB_DEVICE void allow_dependent_launch() {
#if defined(AMDQB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

AMDQB_DEVICE void block_sync() {
#if defined(AMDQB_CUDA)
  __syncthreads();
#elif defined(AMDQB_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  amdqb_emu_syncthreads();
#endif
}

// Butterfly all-reduce: every lane ends with the same value (fp add is commutative, so the two
// partners of each step compute bitwise-identical sums).
AMDQB_DEVICE int warp_sum_i32(int v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += shfl_xor_i32(v, m);
  return v;
}
AMDQB_DEVICE float warp_sum_f32(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += shfl_xor_f32(v, m);
  return v;
}
AMDQB_DEVICE float warp_max_f32(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, shfl_xor_f32(v, m));
  return v;
}

// Inclusive prefix sum over the logical warp, wrapping (modulo 2^32) arithmetic.
AMDQB_DEVICE u32 warp_inclusive_sum_u32(u32 v) {
  const int lane = lane_id();
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u32 o = (u32)shfl_i32((int)v, lane - d);
    if (lane >= d) v += o;
  }
  return v;
}

// Inclusive prefix sum over the logical warp (int view of the wrapping u32 scan).
AMDQB_DEVICE int warp_inclusive_sum_i32(int v) { return (int)warp_inclusive_sum_u32((u32)v); }

// ------------------------------------------------------------------------------------------------
// Atomics (relaxed; device scope for global memory, workgroup scope for shared memory)
// ------------------------------------------------------------------------------------------------
AMDQB_DEVICE int atomic_add_global(int* p, int v) {
#if defined(AMDQB_CUDA)
  return atomicAdd(p, v);
#elif defined(AMDQB_HIP) && defined(__HIP_MEMORY_SCOPE_AGENT)
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

AMDQB_DEVICE int atomic_add_shared(int* p, int v) {
#if defined(AMDQB_CUDA)
  return atomicAdd(p, v);
#elif defined(AMDQB_HIP) && defined(__HIP_MEMORY_SCOPE_WORKGROUP)
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

// ------------------------------------------------------------------------------------------------
// fp16 / bf16 <-> fp32, on bit patterns (u16), round to nearest even like torch
// ------------------------------------------------------------------------------------------------
AMDQB_DEVICE float half_to_float(u16 h) {
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu;
  const u32 mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0u) {
    // zero / subnormal: mant * 2^-24, exact in fp32
    const float f = (float)mant * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

AMDQB_DEVICE u16 float_to_half(float f) {
  const u32 x = float_bits(f);
  const u32 sign = (x >> 16) & 0x8000u;
  const u32 ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (u16)(sign | 0x7e00u);   // NaN (torch: quiet NaN, sign kept)
  if (ax >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                              // normal half
    const u32 r = ax - 0x38000000u;                     // rebias exponent 127 -> 15
    u32 h = r >> 13;
    const u32 rem = r & 0x1fffu;
    h += (rem > 0x1000u) || (rem == 0x1000u && (h & 1u));
    return (u16)(sign | h);
  }
  const u32 e = ax >> 23;
  if (e < 102u) return (u16)sign;  // below half of the smallest subnormal: rounds to zero
  const u32 m = (ax & 0x7fffffu) | 0x800000u;
  const u32 shift = 126u - e;  // 14..24
  u32 h = m >> shift;
  const u32 rem = m & ((1u << shift) - 1u);
  const u32 half = 1u << (shift - 1u);
  h += (rem > half) || (rem == half && (h & 1u));
  return (u16)(sign | h);
}

AMDQB_DEVICE float bf16_to_float(u16 b) { return bits_float((u32)b << 16); }

AMDQB_DEVICE u16 float_to_bf16(float f) {
  const u32 x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;  // NaN (torch's canonical bf16 NaN)
  return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------------------------------------
// Approximate transcendentals, for fast paths that are followed by an exactness check
// ------------------------------------------------------------------------------------------------
// Hardware 2^x / reciprocal (sm_90: MUFU.EX2 / MUFU.RCP; AMD: v_exp_f32 / v_rcp_f32), each within
// a few 2^-22 relative of the true value on normal inputs; denormal inputs and results flush to
// zero (an absolute error below 2^-126). Issued as the bare instructions: the library forms
// (__expf, __fdividef) add denormal range fix-ups that a bounded fast path does not need. Callers
// either bound the error and fall back to an exact formula where the bound leaves any doubt, or
// (the router's sigmoid, approx_exp2) define their result through the instruction and say so.
AMDQB_DEVICE float approx_exp2(float x) {
#if defined(AMDQB_CUDA)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#elif defined(AMDQB_HIP)
  return __builtin_amdgcn_exp2f(x);
#else
  return exp2f(x);  // the emulator perturbs the result it derives from this (router.hip)
#endif
}
AMDQB_DEVICE float approx_rcp(float x) {
#if defined(AMDQB_CUDA)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#elif defined(AMDQB_HIP)
  return __builtin_amdgcn_rcpf(x);
#else
  return 1.0f / x;
#endif
}

// ------------------------------------------------------------------------------------------------
// Selection order (amdqb.ref.ordering): value descending, id ascending, -0.0 == +0.0, NaN lowest
// ------------------------------------------------------------------------------------------------
// Monotone int32 key: a < b (as floats) iff key(a) < key(b); NaN -> INT32_MIN (below -inf).
AMDQB_DEVICE i32 order_key(float v) {
  if (v != v) return kInt32Min;
  i32 k = (i32)float_bits(v);
  if (k < 0) k ^= 0x7fffffff;
  if (k == -1) k = 0;  // -0.0 -> +0.0
  return k;
}

// The fp32 value of a key (the inverse of order_key; -0.0 comes back as +0.0, the NaN key as a
// NaN).
AMDQB_DEVICE float key_value(i32 k) { return bits_float((u32)(k < 0 ? k ^ 0x7fffffff : k)); }

// Is (ka, ida) ahead of (kb, idb) in the selection order?
AMDQB_DEVICE bool ahead(i32 ka, i32 ida, i32 kb, i32 idb) {
  return ka > kb || (ka == kb && ida < idb);
}

}  // namespace amdqb
