// amdqb portable prelude: one kernel source compiles as
//   * HIP  (hiprtc at run time, or `clang -x hip` / hipcc offline) for AMD GPUs, wave32 or wave64;
//   * CUDA (NVRTC at run time, or nvcc offline) for NVIDIA GPUs;
//   * plain C++ on the host (AMDQB_HOST_EMU), where op_tests/hip_emu supplies the thread, warp and
//     shared-memory primitives; used to execute the kernels on the CPU in tests. With
//     AMDQB_EMU_AMDGCN as well, the cross-lane primitives compile as their AMD branches (the
//     AMDGCN builtins, which the emulator models lane by lane on waves of AMDQB_WAVE_SIZE lanes),
//     so the AMD-only code runs on the CPU too.
//
// Warp model. The free warp-level primitives below work on a *logical warp of 32 lanes*: lane =
// linear thread index % 32 inside a 1-D block. On wave64 hardware a wave holds two logical warps;
// the shuffles address lanes inside the caller's 32-lane half only and the ballot returns the half
// of the 64-bit wave ballot that belongs to the caller's logical warp. Warp<W> (below) offers the
// same primitives for logical warps of W = 32 or, on wave64 AMD, 64 lanes (a whole wave), for
// kernels written once for both widths. Warp primitives must be called by all lanes of a logical
// warp (never under lane-divergent control flow inside it). The wave size is a compile-time
// constant passed with -D AMDQB_WAVE_SIZE=32|64 (warpSize is not constexpr on HIP). Blocks are 1-D
// with blockDim.x a multiple of 32 (of 64 on wave64). On AMD the primitives lower to DPP,
// ds_swizzle, permlanex16, readlane, ballot and mbcnt (the gcn:: building blocks); ds_bpermute is
// left for shuffles whose lane pattern is only known at run time.
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
#define AMDQB_AMD_WAVES_PER_EU(w)
#elif defined(AMDQB_HIP)
#define AMDQB_DEVICE static __device__ inline __attribute__((always_inline))
#define AMDQB_KERNEL extern "C" __global__
#define AMDQB_LAUNCH_BOUNDS(n) __launch_bounds__(n)
// HIP's second launch-bounds argument means waves per EU, not blocks per SM: left to the compiler.
#define AMDQB_LAUNCH_BOUNDS_MIN(n, blocks) __launch_bounds__(n)
// At least w waves per SIMD: the compiler keeps the registers within that occupancy's budget.
#define AMDQB_AMD_WAVES_PER_EU(w) __attribute__((amdgpu_waves_per_eu(w)))
// Contraction would change results between inlining contexts (the histogram kernel must reproduce
// the router's sigmoid bit for bit); the compile flags say -ffp-contract=off as well.
#pragma clang fp contract(off)
#else
#define AMDQB_DEVICE static __device__ __forceinline__
#define AMDQB_KERNEL extern "C" __global__
#define AMDQB_LAUNCH_BOUNDS(n) __launch_bounds__(n)
// n threads per block and at least `blocks` resident blocks per SM (caps the registers per thread)
#define AMDQB_LAUNCH_BOUNDS_MIN(n, blocks) __launch_bounds__(n, blocks)
#define AMDQB_AMD_WAVES_PER_EU(w)
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

// Four copies of v at p, 16-byte aligned, in one 16-byte store.
AMDQB_DEVICE void store_i32x4(int* p, int v) {
#if defined(AMDQB_CUDA)
  *reinterpret_cast<int4*>(p) = make_int4(v, v, v, v);
#elif defined(AMDQB_HIP)
  typedef int i32x4 __attribute__((ext_vector_type(4)));
  *reinterpret_cast<i32x4*>(p) = i32x4{v, v, v, v};
#else
  for (int i = 0; i < 4; ++i) p[i] = v;
#endif
}

// Four int32 from p, 16-byte aligned, in one 16-byte load.
AMDQB_DEVICE void load_i32x4(const int* p, int (&v)[4]) {
#if defined(AMDQB_CUDA)
  const int4 x = *reinterpret_cast<const int4*>(p);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
#elif defined(AMDQB_HIP)
  typedef int i32x4 __attribute__((ext_vector_type(4)));
  const i32x4 x = *reinterpret_cast<const i32x4*>(p);
  v[0] = x[0], v[1] = x[1], v[2] = x[2], v[3] = x[3];
#else
  for (int i = 0; i < 4; ++i) v[i] = p[i];
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

// v, which the AMD compiler must take as computed at this point (an empty asm on its VGPR);
// elsewhere v itself. At the top of a loop body, applied to the lane index, it keeps the values
// derived from the lane (a sort network's lane masks, per-slot ids) inside the loop instead of
// hoisted and held across it -- on wave64 each lane mask is a pair of SGPRs.
AMDQB_DEVICE int opaque_lane(int v) {
#if defined(AMDQB_HIP)
  asm volatile("" : "+v"(v));
#endif
  return v;
}

// ------------------------------------------------------------------------------------------------
// Raw platform primitives
// ------------------------------------------------------------------------------------------------
// AMDQB_LANES(w) opens the AMD branch of a primitive that works on logical warps of w lanes: on the
// hardware nothing; in the emulator's AMDGCN model it scopes the cross-lane builtins the branch
// calls to the caller's logical warp (on wave64 with w = 32: its half of the wave, which the
// other half's logical warp may not share in that moment), so the model checks that the branch
// never depends on lanes outside it.
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

// AMDGCN building blocks of the primitives below: DPP moves (a VALU operand modifier, no LDS
// traffic), ds_swizzle (an LDS-pipe permute without an address operand) and permlanex16
// (gfx10+, VALU), each an exact permutation, so they keep the xor butterflies' association order.
namespace gcn {
constexpr int quad_perm(int a, int b, int c, int d) { return a | (b << 2) | (c << 4) | (d << 6); }
constexpr int kRowShr = 0x110;     // + n: lane i reads lane i - n of its row of 16 (none below n)
constexpr int kRowMirror = 0x140;  // lane i reads lane i ^ 15 of its row of 16
constexpr int kRowHalfMirror = 0x141;  // lane i reads lane i ^ 7 of its half row
#if defined(__GFX9__)
constexpr int kRowBcast15 = 0x142;  // lane 15 of each row of 16 to the next row
constexpr int kRowBcast31 = 0x143;  // lane 31 to rows 2 and 3
#else
constexpr int kRowXmask = 0x160;  // + n: lane i reads lane i ^ n of its row of 16
// permlanex16 selectors of an xor by 16 + m: lane k of the other row of 16 reads lane k ^ m.
constexpr u32 xor_select(int m, int half) {
  u32 s = 0;
  for (int k = 0; k < 8; ++k) s |= (u32)(((k + 8 * half) ^ m) & 15) << (4 * k);
  return s;
}
#endif

// v of lane (i with the DPP control CTRL); rows outside ROW_MASK and lanes without a source keep
// old.
template <int CTRL, int ROW_MASK = 0xF>
AMDQB_DEVICE int dpp(int old, int v) {
  return __builtin_amdgcn_update_dpp(old, v, CTRL, ROW_MASK, 0xF, false);
}

// v of lane i ^ M (0 < M < 32: inside the caller's 32 lanes) by the cheapest exact permutation of
// the target: quad permutes for M < 4; gfx9: row mirrors (i ^ 15, i ^ 7), composed with a quad
// permute where that takes two moves, else ds_swizzle; gfx10+: row_xmask below 16, permlanex16
// from 16.
template <int M>
AMDQB_DEVICE int xor_lanes(int v) {
  static_assert(M > 0 && M < 32, "an xor inside 32 lanes");
  if constexpr (M == 1) {
    return dpp<quad_perm(1, 0, 3, 2)>(0, v);
  } else if constexpr (M == 2) {
    return dpp<quad_perm(2, 3, 0, 1)>(0, v);
  } else if constexpr (M == 3) {
    return dpp<quad_perm(3, 2, 1, 0)>(0, v);
#if defined(__GFX9__)
  } else if constexpr (M == 7) {
    return dpp<kRowHalfMirror>(0, v);
  } else if constexpr (M == 15) {
    return dpp<kRowMirror>(0, v);
  } else if constexpr (M >= 4 && M <= 6) {
    return xor_lanes<(M ^ 7)>(dpp<kRowHalfMirror>(0, v));
  } else if constexpr (M == 8 || (M >= 12 && M <= 14)) {
    return xor_lanes<(M ^ 15)>(dpp<kRowMirror>(0, v));
  } else {
    return __builtin_amdgcn_ds_swizzle(v, 0x1f | (M << 10));  // and 31, or 0, xor M
  }
#else
  } else if constexpr (M < 16) {
    return dpp<kRowXmask + M>(0, v);
  } else {
    return (int)__builtin_amdgcn_permlanex16(0u, (u32)v, xor_select(M - 16, 0),
                                             xor_select(M - 16, 1), false, false);
  }
#endif
}

// xor_lanes of a mask known after unrolling (folds to one case), else ds_bpermute.
AMDQB_DEVICE int xor_any(int v, int mask) {
  switch (mask) {
    case 0:
      return v;
    case 1:
      return xor_lanes<1>(v);
    case 2:
      return xor_lanes<2>(v);
    case 3:
      return xor_lanes<3>(v);
    case 4:
      return xor_lanes<4>(v);
    case 5:
      return xor_lanes<5>(v);
    case 6:
      return xor_lanes<6>(v);
    case 7:
      return xor_lanes<7>(v);
    case 8:
      return xor_lanes<8>(v);
    case 9:
      return xor_lanes<9>(v);
    case 10:
      return xor_lanes<10>(v);
    case 11:
      return xor_lanes<11>(v);
    case 12:
      return xor_lanes<12>(v);
    case 13:
      return xor_lanes<13>(v);
    case 14:
      return xor_lanes<14>(v);
    case 15:
      return xor_lanes<15>(v);
    case 16:
      return xor_lanes<16>(v);
    case 17:
      return xor_lanes<17>(v);
    case 18:
      return xor_lanes<18>(v);
    case 19:
      return xor_lanes<19>(v);
    case 20:
      return xor_lanes<20>(v);
    case 21:
      return xor_lanes<21>(v);
    case 22:
      return xor_lanes<22>(v);
    case 23:
      return xor_lanes<23>(v);
    case 24:
      return xor_lanes<24>(v);
    case 25:
      return xor_lanes<25>(v);
    case 26:
      return xor_lanes<26>(v);
    case 27:
      return xor_lanes<27>(v);
    case 28:
      return xor_lanes<28>(v);
    case 29:
      return xor_lanes<29>(v);
    case 30:
      return xor_lanes<30>(v);
    case 31:
      return xor_lanes<31>(v);
    default:
      return raw_bpermute(hw_lane() ^ mask, v);
  }
}

// Inclusive scan over each 32-lane group (W = 32) or the wave64 (W = 64) with an associative op
// whose identity is 0 (op(x, 0) == x): a Hillis-Steele scan inside rows of 16 (row_shr 1, 2, 4,
// 8; lanes without a source read 0), then row 0's total into row 1 (and on W = 64 lane 31's into
// rows 2 and 3).
template <int W, typename Op>
AMDQB_DEVICE u32 inclusive_scan(u32 v, Op op) {
  v = op(v, (u32)dpp<kRowShr + 1>(0, (int)v));
  v = op(v, (u32)dpp<kRowShr + 2>(0, (int)v));
  v = op(v, (u32)dpp<kRowShr + 4>(0, (int)v));
  v = op(v, (u32)dpp<kRowShr + 8>(0, (int)v));
#if defined(__GFX9__)
  v = op(v, (u32)dpp<kRowBcast15, 0xA>(0, (int)v));
  if constexpr (W == 64) v = op(v, (u32)dpp<kRowBcast31, 0xC>(0, (int)v));
#else
  static_assert(W == 32, "wave64 logical warps are gfx9's");
  const u32 other = __builtin_amdgcn_permlanex16(0u, v, ~0u, ~0u, false, false);  // its lane 15
  if (hw_lane() & 16) v = op(v, other);
#endif
  return v;
}

// v of lane l of the caller's W lanes, l the same in every lane of the wave (an SGPR).
template <int W>
AMDQB_DEVICE int read_lane(int v, int l) {
#if AMDQB_WAVE_SIZE == 64
  if constexpr (W == 32)
    return (hw_lane() & 32) ? __builtin_amdgcn_readlane(v, l + 32)
                            : __builtin_amdgcn_readlane(v, l);
#endif
  return __builtin_amdgcn_readlane(v, l);
}

// Integer sum over the caller's W lanes (any order: wrapping adds), uniform: row_shr 1, 2, 4, 8
// leave each row of 16's total in its lane 15, read as scalars.
template <int W>
AMDQB_DEVICE int sum_i32(int v) {
  v += dpp<kRowShr + 1>(0, v);
  v += dpp<kRowShr + 2>(0, v);
  v += dpp<kRowShr + 4>(0, v);
  v += dpp<kRowShr + 8>(0, v);
  if constexpr (W == 64)
    return (int)((u32)__builtin_amdgcn_readlane(v, 15) + (u32)__builtin_amdgcn_readlane(v, 31) +
                 (u32)__builtin_amdgcn_readlane(v, 47) + (u32)__builtin_amdgcn_readlane(v, 63));
  return (int)((u32)read_lane<32>(v, 15) + (u32)read_lane<32>(v, 31));
}

// Bit l of the caller's W lanes = p of lane l.
template <int W>
AMDQB_DEVICE u64 ballot(bool p) {
#if AMDQB_WAVE_SIZE == 64
  if constexpr (W == 32) return (u32)(__builtin_amdgcn_ballot_w64(p) >> (hw_lane() & 32));
#endif
  return raw_ballot(p);
}

// Lanes below the caller among its W lanes whose p is true.
template <int W>
AMDQB_DEVICE int prefix_count(bool p) {
#if AMDQB_WAVE_SIZE == 64
  const u64 m = __builtin_amdgcn_ballot_w64(p);
  if constexpr (W == 32) {
    const u32 mine = (u32)(m >> (hw_lane() & 32));
    return (int)((hw_lane() & 32) ? __builtin_amdgcn_mbcnt_hi(mine, 0u)
                                  : __builtin_amdgcn_mbcnt_lo(mine, 0u));
  }
  return (int)__builtin_amdgcn_mbcnt_hi((u32)(m >> 32), __builtin_amdgcn_mbcnt_lo((u32)m, 0u));
#else
  return (int)__builtin_amdgcn_mbcnt_lo((u32)raw_ballot(p), 0u);
#endif
}

// Lanes of the caller's W whose v has the caller's low `bits` bits: one ballot per bit (VALU and
// scalar work only, no lane permutes); exact when v - lo lies in [0, 2^bits) in every lane.
template <int W>
AMDQB_DEVICE u64 match_bits(u32 v, int bits) {
  u64 peers = ballot<W>(true);
  for (int b = 0; b < bits; ++b) {
    const bool one = (v >> b) & 1u;
    const u64 m = ballot<W>(one);
    peers &= one ? m : ~m;
  }
  return peers;
}
}  // namespace gcn
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
// v of logical lane lane ^ mask (mask < 32). AMD: DPP / ds_swizzle / permlanex16 where the mask is
// a constant after unrolling (the butterflies and bitonic stages below), ds_bpermute otherwise.
AMDQB_DEVICE int shfl_xor_i32(int v, int mask) {
#if defined(AMDQB_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask, 32);
#elif defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::xor_any(v, mask);
#else
  // mask < 32 keeps the source inside the caller's 32-lane half of a wave64.
  return raw_bpermute(hw_lane() ^ mask, v);
#endif
}

// Value of `v` held by logical lane `src` (0..31) of the caller's logical warp. AMD: a source lane
// the compiler knows (a constant after unrolling) is read with v_readlane, else ds_bpermute.
AMDQB_DEVICE int shfl_i32(int v, int src) {
#if defined(AMDQB_CUDA)
  return __shfl_sync(0xffffffffu, v, src, 32);
#else
  AMDQB_LANES(32);
#if defined(AMDQB_AMDGCN)
  if (__builtin_constant_p(src)) return gcn::read_lane<32>(v, src & 31);
#endif
  return raw_bpermute((hw_lane() & ~31) | (src & 31), v);
#endif
}

// shfl_i32 for a source lane that is the same in every lane of the wave (a kernel argument, a
// constant): AMD reads it with v_readlane (scalar), no LDS-pipe permute.
AMDQB_DEVICE int bcast_i32(int v, int src) {
#if defined(AMDQB_CUDA)
  return __shfl_sync(0xffffffffu, v, src, 32);
#elif defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::read_lane<32>(v, src);
#else
  return shfl_i32(v, src);
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

// Bit l = (v of logical lane l == the caller's v). CUDA: one match instruction; AMD: a ballot per
// bit of v (32); the emulator's substitutes: 32 shuffles.
AMDQB_DEVICE u32 match_any_i32(int v) {
#if defined(AMDQB_CUDA)
  return __match_any_sync(0xffffffffu, v);
#elif defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return (u32)gcn::match_bits<32>((u32)v, 32);
#else
  u32 peers = 0;
#pragma unroll
  for (int src = 0; src < 32; ++src) peers |= (u32)(shfl_i32(v, src) == v) << src;
  return peers;
#endif
}

// match_any_i32 for values known to lie in [lo, hi) in every lane (lo, hi the same in every lane):
// AMD needs a ballot per bit of hi - lo - 1 only (e.g. 10 for 896 experts and a drop marker).
AMDQB_DEVICE u32 match_any_in(int v, int lo, int hi) {
#if defined(AMDQB_CUDA)
  (void)lo, (void)hi;
  return __match_any_sync(0xffffffffu, v);
#elif defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  const u32 span = (u32)(hi - lo);
  const int bits = span <= 1u ? 0 : 32 - __builtin_clz(span - 1u);
  return (u32)gcn::match_bits<32>((u32)(v - lo), bits);
#else
  (void)lo, (void)hi;
  return match_any_i32(v);
#endif
}

// Starts fetching the line of p into the L1 (NVIDIA; gfx1250: global_prefetch); a no-op elsewhere.
AMDQB_DEVICE void prefetch_l1(const void* p) {
#if defined(AMDQB_CUDA)
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#elif defined(AMDQB_HIP)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

// Number of lanes below the caller whose predicate is true.
AMDQB_DEVICE int warp_prefix_count(bool p) {
#if defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::prefix_count<32>(p);
#else
  return popc32(ballot32(p) & lanemask_lt());
#endif
}

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

// Thread block clusters (NVIDIA sm_90+; the CPU emulator): the blocks of a cluster are resident
// together and reach each other's shared memory. cluster_arrive() (release: the caller's earlier
// writes, shared and global, become visible to the cluster) and cluster_wait() (acquire: returns
// once every thread of the cluster has arrived) split the cluster barrier; every thread of every
// block calls each of them the same number of times, arrive before wait, and a block must not
// exit while another block may still read its shared memory. cluster_load_i32(p, block) reads
// the int at the same shared-memory offset as p (dynamic shared memory) in block `block` of the
// cluster. AMD targets have no clusters: AMDQB_HAS_CLUSTERS is not defined there and the kernels
// that need them are not built.
#if defined(AMDQB_EMU) || (defined(AMDQB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define AMDQB_HAS_CLUSTERS 1
AMDQB_DEVICE void cluster_arrive() {
#if defined(AMDQB_EMU)
  amdqb_emu_cluster_arrive();
#else
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
AMDQB_DEVICE void cluster_wait() {
#if defined(AMDQB_EMU)
  amdqb_emu_cluster_wait();
#else
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
AMDQB_DEVICE int cluster_load_i32(const int* p, int block) {
#if defined(AMDQB_EMU)
  return *reinterpret_cast<const int*>(amdqb_emu_cluster_map(p, block));
#else
  const u32 local = (u32)__cvta_generic_to_shared(p);
  u32 remote;
  int v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(block));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
#endif
}
#endif

// Butterfly all-reduce: every lane ends with the same value (fp add is commutative, so the two
// partners of each step compute bitwise-identical sums). Integer sums may run in any order (AMD:
// a row_shr tree and scalar reads); the fp sum and max keep the butterfly over lane distances 16,
// 8, 4, 2, 1 on every platform.
AMDQB_DEVICE int warp_sum_i32(int v) {
#if defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::sum_i32<32>(v);
#else
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += shfl_xor_i32(v, m);
  return v;
#endif
}
// AMD: the steps written out, so that each shuffle's mask is a constant before any loop pass (the
// 31-way permute switch of shfl_xor_i32 folds at once); elsewhere the loop (NVIDIA's instruction
// stream as measured).
AMDQB_DEVICE float warp_sum_f32(float v) {
#if defined(AMDQB_AMDGCN)
  v += shfl_xor_f32(v, 16);
  v += shfl_xor_f32(v, 8);
  v += shfl_xor_f32(v, 4);
  v += shfl_xor_f32(v, 2);
  v += shfl_xor_f32(v, 1);
#else
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += shfl_xor_f32(v, m);
#endif
  return v;
}
AMDQB_DEVICE float warp_max_f32(float v) {
#if defined(AMDQB_AMDGCN)
  v = fmaxf(v, shfl_xor_f32(v, 16));
  v = fmaxf(v, shfl_xor_f32(v, 8));
  v = fmaxf(v, shfl_xor_f32(v, 4));
  v = fmaxf(v, shfl_xor_f32(v, 2));
  v = fmaxf(v, shfl_xor_f32(v, 1));
#else
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, shfl_xor_f32(v, m));
#endif
  return v;
}

// Inclusive prefix sum over the logical warp, wrapping (modulo 2^32) arithmetic.
AMDQB_DEVICE u32 warp_inclusive_sum_u32(u32 v) {
#if defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::inclusive_scan<32>(v, [](u32 a, u32 b) { return a + b; });
#else
  const int lane = lane_id();
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u32 o = (u32)shfl_i32((int)v, lane - d);
    if (lane >= d) v += o;
  }
  return v;
#endif
}

// Inclusive prefix sum over the logical warp (int view of the wrapping u32 scan).
AMDQB_DEVICE int warp_inclusive_sum_i32(int v) { return (int)warp_inclusive_sum_u32((u32)v); }

// Inclusive scan over the logical warp with an associative op(u32, u32) whose identity is 0
// (op(x, 0) == x: a sum, a saturating sum). AMD: the DPP scan (gcn::inclusive_scan).
template <typename Op>
AMDQB_DEVICE u32 warp_inclusive_scan_u32(u32 v, Op op) {
#if defined(AMDQB_AMDGCN)
  AMDQB_LANES(32);
  return gcn::inclusive_scan<32>(v, op);
#else
  const int lane = lane_id();
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u32 o = (u32)shfl_i32((int)v, lane - d);
    if (lane >= d) v = op(v, o);
  }
  return v;
#endif
}

// ------------------------------------------------------------------------------------------------
// Logical warps of W lanes: Warp<32> everywhere, Warp<64> on wave64 AMD (CDNA)
// ------------------------------------------------------------------------------------------------
// The primitives above as one type per width, for kernels written once for both widths. A logical
// warp of W lanes is W consecutive threads of a 1-D block (lane = threadIdx.x % W); W = 64 is a
// whole wave64 and needs the AMD branches (AMDQB_AMDGCN with AMDQB_WAVE_SIZE 64); kWarpLanes is
// the widest width of the build (64 there, else 32). Contracts of every member: all W lanes call
// it together (never under control flow that diverges inside the logical warp; the two 32-lane
// logical warps of a wave64 may diverge from each other); masks have bit l for lane l (u32 for
// W = 32, u64 for W = 64); results are the same in every lane unless said otherwise.
//   lane(), index()       lane in the logical warp, logical warp in the block (per lane)
//   lanemask_lt()         bits of the lanes below the caller (per lane)
//   ballot(p)             bits of the lanes whose p is true
//   prefix_count(p)       lanes below the caller whose p is true (per lane)
//   shfl_xor(v, m)        v of lane ^ m, m < W (per lane; exact permutes for constant m < 32)
//   shfl(v, src)          v of lane src, src per lane (per lane; ds_bpermute on AMD)
//   bcast(v, src)         v of lane src, src the same in every lane of the wave (AMD: readlane)
//   sum_i32(v)            wrapping sum (order free)
//   sum_f32(v)            fp32 sum in a fixed order: the butterfly 16, 8, 4, 2, 1 inside each 32
//                         lanes, then (W = 64) the lower 32's sum plus the upper 32's
//   max_f32(v)            fmaxf over the lanes (the same order as sum_f32)
//   inclusive_sum_u32(v)  wrapping inclusive prefix sum (per lane)
//   inclusive_scan_u32(v, op)  inclusive scan with an associative op whose identity is 0 (per lane)
//   match_any(v)          bits of the lanes whose v equals the caller's (per lane)
//   match_any_in(v,lo,hi) the same for v in [lo, hi) in every lane (lo, hi uniform): cheaper on AMD
//   sync()                orders the logical warp's shared-memory accesses
template <int W>
struct Warp;

template <>
struct Warp<32> {
  typedef u32 mask_t;
  static constexpr int kLanes = 32;
  AMDQB_DEVICE int lane() { return lane_id(); }
  AMDQB_DEVICE int index() { return warp_in_block(); }
  AMDQB_DEVICE mask_t lanemask_lt() { return ::amdqb::lanemask_lt(); }
  AMDQB_DEVICE mask_t ballot(bool p) { return ballot32(p); }
  AMDQB_DEVICE int prefix_count(bool p) { return warp_prefix_count(p); }
  AMDQB_DEVICE int shfl_xor(int v, int m) { return shfl_xor_i32(v, m); }
  AMDQB_DEVICE int shfl(int v, int src) { return shfl_i32(v, src); }
  AMDQB_DEVICE int bcast(int v, int src) { return bcast_i32(v, src); }
  AMDQB_DEVICE int sum_i32(int v) { return warp_sum_i32(v); }
  AMDQB_DEVICE float sum_f32(float v) { return warp_sum_f32(v); }
  AMDQB_DEVICE float max_f32(float v) { return warp_max_f32(v); }
  AMDQB_DEVICE u32 inclusive_sum_u32(u32 v) { return warp_inclusive_sum_u32(v); }
  template <typename Op>
  AMDQB_DEVICE u32 inclusive_scan_u32(u32 v, Op op) {
    return warp_inclusive_scan_u32(v, op);
  }
  AMDQB_DEVICE mask_t match_any(int v) { return match_any_i32(v); }
  AMDQB_DEVICE mask_t match_any_in(int v, int lo, int hi) {
    return ::amdqb::match_any_in(v, lo, hi);
  }
  AMDQB_DEVICE void sync() { warp_sync(); }
};

#if defined(AMDQB_AMDGCN) && AMDQB_WAVE_SIZE == 64
constexpr int kWarpLanes = 64;

template <>
struct Warp<64> {
  typedef u64 mask_t;
  static constexpr int kLanes = 64;
  AMDQB_DEVICE int lane() { return hw_lane(); }
  AMDQB_DEVICE int index() { return (int)(threadIdx.x >> 6); }
  AMDQB_DEVICE mask_t lanemask_lt() { return (1ull << hw_lane()) - 1ull; }
  AMDQB_DEVICE mask_t ballot(bool p) {
    AMDQB_LANES(64);
    return raw_ballot(p);
  }
  AMDQB_DEVICE int prefix_count(bool p) {
    AMDQB_LANES(64);
    return gcn::prefix_count<64>(p);
  }
  AMDQB_DEVICE int shfl_xor(int v, int m) {
    AMDQB_LANES(64);
    return m < 32 ? gcn::xor_any(v, m) : raw_bpermute(hw_lane() ^ m, v);
  }
  AMDQB_DEVICE int shfl(int v, int src) {
    AMDQB_LANES(64);
    return raw_bpermute(src & 63, v);
  }
  AMDQB_DEVICE int bcast(int v, int src) {
    AMDQB_LANES(64);
    return __builtin_amdgcn_readlane(v, src);
  }
  AMDQB_DEVICE int sum_i32(int v) {
    AMDQB_LANES(64);
    return gcn::sum_i32<64>(v);
  }
  AMDQB_DEVICE float sum_f32(float v) {
    const float half = warp_sum_f32(v);  // each 32 lanes' butterfly
    AMDQB_LANES(64);
    const u32 bits = float_bits(half);
    return bits_float((u32)__builtin_amdgcn_readlane((int)bits, 0)) +
           bits_float((u32)__builtin_amdgcn_readlane((int)bits, 32));
  }
  AMDQB_DEVICE float max_f32(float v) {
    const float half = warp_max_f32(v);
    AMDQB_LANES(64);
    const u32 bits = float_bits(half);
    return fmaxf(bits_float((u32)__builtin_amdgcn_readlane((int)bits, 0)),
                 bits_float((u32)__builtin_amdgcn_readlane((int)bits, 32)));
  }
  AMDQB_DEVICE u32 inclusive_sum_u32(u32 v) {
    AMDQB_LANES(64);
    return gcn::inclusive_scan<64>(v, [](u32 a, u32 b) { return a + b; });
  }
  template <typename Op>
  AMDQB_DEVICE u32 inclusive_scan_u32(u32 v, Op op) {
    AMDQB_LANES(64);
    return gcn::inclusive_scan<64>(v, op);
  }
  AMDQB_DEVICE mask_t match_any(int v) {
    AMDQB_LANES(64);
    return gcn::match_bits<64>((u32)v, 32);
  }
  AMDQB_DEVICE mask_t match_any_in(int v, int lo, int hi) {
    AMDQB_LANES(64);
    const u32 span = (u32)(hi - lo);
    return gcn::match_bits<64>((u32)(v - lo), span <= 1u ? 0 : 32 - __builtin_clz(span - 1u));
  }
  AMDQB_DEVICE void sync() {
    AMDQB_LANES(64);
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
  }
};
#else
constexpr int kWarpLanes = 32;
#endif

// ------------------------------------------------------------------------------------------------
// Atomics (relaxed; device scope for global memory, workgroup scope for shared memory)
// ------------------------------------------------------------------------------------------------
// T: int, or u64 (the int64 planes of the QB histogram's in-bin moments)
template <typename T>
AMDQB_DEVICE T atomic_add_global(T* p, T v) {
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
