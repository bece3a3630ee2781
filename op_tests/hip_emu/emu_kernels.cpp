// Host build of the hip_src kernels for the CPU emulator (see amdqb_emu.h). Compiled by
// op_tests/hip_emu/runtime.py with -I hip_src/include -I hip_src/kernels and the kernel defines.
#include "amdqb_emu.h"

#if defined(AMDQB_EMU_ROUTER)
static std::atomic<long long> g_overflows{0};
#define AMDQB_TRACE_OVERFLOW()                                                                     \
  do {                                                                                             \
    if (amdqb::lane_id() == 0) g_overflows++;                                                      \
  } while (0)
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
#include "topk.hip"
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
#else
#error                                                                                             \
    "define AMDQB_EMU_ROUTER, AMDQB_EMU_ROUTER_BWD, AMDQB_EMU_TOPK, AMDQB_EMU_ROUTE or AMDQB_EMU_CONVERT"
#endif

AMDQB_EMU_RUNTIME_DEFINITIONS
