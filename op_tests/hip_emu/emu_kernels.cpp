// Host build of the hip_src kernels for the CPU emulator (see amdqb_emu.h). Compiled by
// op_tests/hip_emu/runtime.py with -I hip_src/include -I hip_src/kernels and the kernel defines.
#include "amdqb_emu.h"

#if defined(AMDQB_EMU_ROUTER)
#include "router.hip"
AMDQB_EMU_REGISTER(amdqb_router)
AMDQB_EMU_REGISTER(amdqb_qb_hist)
AMDQB_EMU_REGISTER(amdqb_scores)
#elif defined(AMDQB_EMU_ROUTE)
#include "route.hip"
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
#else
#error "define AMDQB_EMU_ROUTER or AMDQB_EMU_ROUTE"
#endif

AMDQB_EMU_RUNTIME_DEFINITIONS
