// Host build of the hip_src kernels for the CPU emulator (see amdqb_emu.h). Compiled by
// op_tests/hip_emu/runtime.py with -I hip_src/include -I hip_src/kernels and the kernel defines.
#include "amdqb_emu.h"

// A kernel's trace hook counting logical warps: lane 0 of each adds one to `counter`.
#define AMDQB_EMU_COUNT_WARP(counter)                                                              \
  do {                                                                                             \
    if (amdqb::lane_id() == 0) counter++;                                                          \
  } while (0)

#if defined(AMDQB_EMU_ROUTER)
static std::atomic<long long> g_overflows{0};
#define AMDQB_TRACE_OVERFLOW() AMDQB_EMU_COUNT_WARP(g_overflows)
#include "router.hip"
extern "C" long long amdqb_emu_overflows() { return g_overflows.load(); }
AMDQB_EMU_REGISTER(amdqb_router)
AMDQB_EMU_REGISTER(amdqb_qb_hist)
AMDQB_EMU_REGISTER(amdqb_qb_hist_bins)
AMDQB_EMU_REGISTER(amdqb_router_decode)
AMDQB_EMU_REGISTER(amdqb_router_scores)
#elif defined(AMDQB_EMU_ROUTER_BWD)
#include "router_bwd.hip"
AMDQB_EMU_REGISTER(amdqb_router_bwd)
#elif defined(AMDQB_EMU_TOPK)
static std::atomic<long long> g_tied_keys{0};
#define AMDQB_TRACE_TIED_KEYS() AMDQB_EMU_COUNT_WARP(g_tied_keys)
#include "topk.hip"
extern "C" long long amdqb_emu_tied_keys() { return g_tied_keys.load(); }
AMDQB_EMU_REGISTER(amdqb_topk)
#elif defined(AMDQB_EMU_ROUTE)
#include "layout.hip"
AMDQB_EMU_REGISTER(amdqb_route_atomic_i32)
AMDQB_EMU_REGISTER(amdqb_route_atomic_i64)
AMDQB_EMU_REGISTER(amdqb_route_lds_i32)
AMDQB_EMU_REGISTER(amdqb_route_lds_i64)
AMDQB_EMU_REGISTER(amdqb_route_det_hist_i32)
AMDQB_EMU_REGISTER(amdqb_route_det_hist_i64)
AMDQB_EMU_REGISTER(amdqb_route_det_rank_i32)
AMDQB_EMU_REGISTER(amdqb_route_det_rank_i64)
AMDQB_EMU_REGISTER(amdqb_route_compact_i32)
AMDQB_EMU_REGISTER(amdqb_route_compact_i64)
AMDQB_EMU_REGISTER(amdqb_route_det_scan)
AMDQB_EMU_REGISTER(amdqb_route_finalize)
AMDQB_EMU_REGISTER(amdqb_align_hist)
AMDQB_EMU_REGISTER(amdqb_align)
AMDQB_EMU_REGISTER(amdqb_align_plan)
AMDQB_EMU_REGISTER(amdqb_align_place)
AMDQB_EMU_REGISTER(amdqb_align_tiles)
AMDQB_EMU_REGISTER(amdqb_align_cluster)
#elif defined(AMDQB_EMU_CONVERT)
// The prelude's scalar helpers, called directly from Python.
#include "amdqb_prelude.h"
extern "C" void amdqb_emu_f32_to_f16(const float* x, unsigned short* y, long long n) {
  for (long long i = 0; i < n; ++i) y[i] = amdqb::float_to_half(x[i]);
}
extern "C" void amdqb_emu_f32_to_bf16(const float* x, unsigned short* y, long long n) {
  for (long long i = 0; i < n; ++i) y[i] = amdqb::float_to_bf16(x[i]);
}
extern "C" void amdqb_emu_f16_to_f32(const unsigned short* x, float* y, long long n) {
  for (long long i = 0; i < n; ++i) y[i] = amdqb::half_to_float(x[i]);
}
extern "C" void amdqb_emu_bf16_to_f32(const unsigned short* x, float* y, long long n) {
  for (long long i = 0; i < n; ++i) y[i] = amdqb::bf16_to_float(x[i]);
}
extern "C" void amdqb_emu_order_key(const float* x, int* y, long long n) {
  for (long long i = 0; i < n; ++i) y[i] = amdqb::order_key(x[i]);
}
#elif defined(AMDQB_EMU_LANES)
// The AMDGCN model's builtins one at a time, for op_tests/test_amd_lane_model.py: every lane t of
// a block applies builtin `op` to in[t] (old[t]: the old value / address / accumulator) in rows of
// `scope` lanes and writes out[t].
#include "amdqb_prelude.h"
#if !defined(AMDQB_EMU_AMDGCN)
#error "AMDQB_EMU_LANES needs the AMDGCN model (AMDQB_EMU_AMDGCN)"
#endif
extern "C" void amdqb_emu_lane_op(const int* in, const int* old, int* out, int op, int a, int b,
                                  int c, int d, int scope) {
  const amdqb_emu::LaneScope row(scope);
  const int t = (int)threadIdx.x, v = in[t], o = old[t];
  int r = 0;
  switch (op) {
    case 0:
      r = __builtin_amdgcn_ds_bpermute(o, v);
      break;
    case 1:
      r = __builtin_amdgcn_ds_swizzle(v, a);
      break;
    case 2:
      r = __builtin_amdgcn_update_dpp(o, v, a, b, c, d != 0);
      break;
    case 3:
      r = __builtin_amdgcn_readlane(v, a);
      break;
    case 4:
      r = __builtin_amdgcn_readfirstlane(v);
      break;
    case 5:
      r = (int)(__builtin_amdgcn_ballot_w64(v != 0) >> (a ? 32 : 0));
      break;
    case 6:
      r = (int)__builtin_amdgcn_mbcnt_lo((unsigned)v, (unsigned)o);
      break;
    case 7:
      r = (int)__builtin_amdgcn_mbcnt_hi((unsigned)v, (unsigned)o);
      break;
#if !defined(__GFX9__)
    case 8:
      r = (int)__builtin_amdgcn_permlanex16((unsigned)o, (unsigned)v, a, b, c, d);
      break;
    case 9:
      r = (int)__builtin_amdgcn_permlane16((unsigned)o, (unsigned)v, a, b, c, d);
      break;
#endif
    default:
      amdqb_emu::fail("no such lane op", op);
  }
  out[t] = r;
}
AMDQB_EMU_REGISTER(amdqb_emu_lane_op)
#elif defined(AMDQB_EMU_PRIMS)
// The prelude's logical-warp primitives one at a time, for op_tests/test_amd_warp_primitives.py:
// lane t of a block applies primitive `op` of Warp<width> to in[t] (aux[t]: a per-lane source
// lane) and writes out[t] (out2[t]: the upper 32 bits of a 64-bit mask).
#include "amdqb_prelude.h"
using namespace amdqb;
template <int W>
static void warp_op(const int* in, const int* aux, int* out, int* out2, int op, int arg) {
  typedef Warp<W> L;
  const int t = (int)threadIdx.x, v = in[t];
  u64 r = 0;
  switch (op) {
    case 0:
      r = (u32)L::shfl_xor(v, arg);
      break;
    case 1:
      r = (u32)L::shfl(v, aux[t]);
      break;
    case 2:
      r = (u32)L::bcast(v, arg);
      break;
    case 3:
      r = (u32)L::sum_i32(v);
      break;
    case 4:
      r = float_bits(L::sum_f32(bits_float((u32)v)));
      break;
    case 5:
      r = float_bits(L::max_f32(bits_float((u32)v)));
      break;
    case 6:
      r = L::inclusive_sum_u32((u32)v);
      break;
    case 7:
      r = L::ballot(v & 1);
      break;
    case 8:
      r = (u32)L::prefix_count(v & 1);
      break;
    case 9:
      r = L::match_any(v);
      break;
    case 10:
      r = L::match_any_in(v, -1, arg);
      break;
    case 11:
      r = L::lanemask_lt();
      break;
    case 12:
      r = (u32)L::lane() | ((u32)L::index() << 8);
      break;
    case 13:  // a saturating scan at arg (the layout kernels' compact offsets)
      r = L::inclusive_scan_u32(
          (u32)v, [arg](u32 a, u32 b) { return a >= (u32)arg - b ? (u32)arg : a + b; });
      break;
    case 14:  // divergence: the odd lanes wait at the block barrier, the even ones in a shuffle
      if (t & 1)
        block_sync();
      else
        r = (u32)L::shfl_xor(v, 2);
      break;
    case 15:  // a primitive after the odd lanes of the warp exited
      if (t & 1) return;
      r = (u32)L::shfl_xor(v, 2);
      break;
    default:
      std::abort();
  }
  out[t] = (int)(u32)r;
  out2[t] = (int)(u32)(r >> 32);
}
extern "C" void amdqb_emu_warp_op(const int* in, const int* aux, int* out, int* out2, int op,
                                  int arg, int width) {
  if (width == 32) {
    warp_op<32>(in, aux, out, out2, op, arg);
  } else {
#if defined(AMDQB_AMDGCN) && AMDQB_WAVE_SIZE == 64  // Warp<64>: wave64 AMD
    warp_op<64>(in, aux, out, out2, op, arg);
#else
    std::abort();
#endif
  }
}
AMDQB_EMU_REGISTER(amdqb_emu_warp_op)
#else
#error "define AMDQB_EMU_<ROUTER | ROUTER_BWD | TOPK | ROUTE | CONVERT | LANES | PRIMS>"
#endif

#include "amdqb_emu_runtime.h"
