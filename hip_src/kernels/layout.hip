// Route rows: give every route (t, j) of topk_ids a unique slot of its expert.
//
// Contract (amdqb.ref.layout): ids outside [0, E) are dropped (row -1, claim nothing); a valid route
// to expert e claims slot counters[e] + rank (counters are the caller's offsets, updated in place);
// masked layout (capacity >= 0): row = e * capacity + slot, slots >= capacity dropped (row -1);
// compact layout (capacity < 0 here): the route kernels store the slot and
// amdqb_route_compact_* adds offset[e] (the exclusive cumsum of the updated counters) afterwards.
// Order inside an expert is unspecified for the atomic and lds kernels (any interleaving of the
// atomics), ascending flat route index for the det_* kernels. counts: the lds kernels add each
// block's accepted routes to counts (zero-filled by the op); the atomic and det_* paths have
// amdqb_route_finalize derive them from a snapshot of the counters taken before the call.
//
// Offsets are 64-bit (route count up to 2^31 - 1, the op checks it); rows are int32 (the op checks
// E * capacity <= INT32_MAX).
//
// Any counter value is memory-safe and gives the oracle's outcome: slots are int32 with wrapping
// (u32) arithmetic, and a negative slot (a negative counter, or one past int32) gets no row and no
// count; the compact offsets are the exclusive cumsum of the updated counters clamped at 0,
// saturating at 2^31 (stored as -1: no row fits), and amdqb_route_compact_* keeps a row only when
// its slot lies below the expert's updated counter and the row fits int32, taking each route it
// drops off counts (none for consistent counters).
#include "amdqb_prelude.h"

using namespace amdqb;

// Compile-time constants (-D, from the hip.route.* entries of amdqb/configs via
// amdqb.backends.hip._spec.layout_module; the launchers' grid arithmetic reads the same entries):
//   AMDQB_ROUTE_BLOCK   threads per block of the lds kernel     AMDQB_ROUTE_ITEMS  routes per thread
//   AMDQB_DET_ITEMS     32-route chunks per deterministic tile  AMDQB_SCAN_EXPERTS experts per scan
#if !defined(AMDQB_ROUTE_BLOCK) || !defined(AMDQB_ROUTE_ITEMS) || !defined(AMDQB_DET_ITEMS) ||     \
    !defined(AMDQB_SCAN_EXPERTS)
#error "layout.hip needs its -D constants (amdqb.backends.hip._spec.layout_module)"
#endif
#if 256 % AMDQB_SCAN_EXPERTS != 0
#error "AMDQB_SCAN_EXPERTS must divide the scan block of 256 threads"
#endif

namespace {

template <typename IdT>
AMDQB_DEVICE int expert_of(const IdT* ids, i64 i, int num_experts) {
  // Compare in 64 bits: an int64 id of 2^32 + 3 must drop, not alias expert 3.
  const i64 v = (i64)ids[i];
  return (v >= 0 && v < (i64)num_experts) ? (int)v : -1;
}

// How many of the `count` slots from slot `first` (an int32 counter value: when it wrapped past
// int32, every slot of the interval is negative as int32) lie in [0, capacity), or in [0, 2^31) in
// the compact layout (capacity < 0).
AMDQB_DEVICE int slots_within(int first, int count, int capacity) {
  const i64 lo = first > 0 ? (i64)first : 0;
  const i64 lim = capacity < 0 ? ((i64)1 << 31) : (i64)capacity;
  const i64 end = (i64)first + count;
  const i64 hi = end < lim ? end : lim;
  return hi > lo ? (int)(hi - lo) : 0;
}

// Deterministic slot of each lane's route among the warp's 32 in flat order: lanes with the same
// expert e (>= 0) rank in lane order after next[e], and the lowest of them advances next[e] by
// their count. Returns next[e] + rank (unused for e < 0). e lies in [-1, num_experts). The caller
// warp_syncs before the next call, so that its leaders see the update.
AMDQB_DEVICE int warp_claim_slot(int* next, int e, int lane, int num_experts) {
  const u32 peers = match_any_in(e, -1, num_experts);
  const int leader = lowest_bit(peers);
  int start = 0;
  if (e >= 0 && lane == leader) {
    start = next[e];
    next[e] = (int)((u32)start + (u32)popc32(peers));  // int32 slots wrap (the caller's counters)
  }
  start = shfl_i32(start, leader);
  return (int)((u32)start + (u32)popc32(peers & lanemask_lt()));
}

AMDQB_DEVICE int place(int e, int slot, int capacity) {
  if (slot < 0) return -1;        // a negative counter, or one past int32: no row
  if (capacity < 0) return slot;  // compact: offset added by amdqb_route_compact_*
  return slot < capacity ? e * capacity + slot : -1;
}

// "old": one device-scope atomic per valid route.
template <typename IdT>
AMDQB_DEVICE void route_atomic(const IdT* ids, i64 n, int num_experts, int capacity, int* counters,
                               int* rows) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int e = expert_of(ids, i, num_experts);
    int row = -1;
    if (e >= 0) row = place(e, atomic_add_global(&counters[e], 1), capacity);
    rows[i] = row;
  }
}

// "new": one tile of blockDim.x * AMDQB_ROUTE_ITEMS routes per block. LDS histogram of the tile,
// one global atomicAdd per non-empty (block, expert) reserving an interval of the expert's slots,
// then LDS-atomic ranks inside the interval. The interval also tells the block how many of its
// routes the capacity accepts, which it adds to counts (a reduction whose result is unused: no
// round trip), so no counter snapshot or finalize pass is needed. Three unconditional barriers,
// no grid-wide sync. Dynamic shared memory: num_experts ints.
template <typename IdT>
AMDQB_DEVICE void route_lds(const IdT* ids, i64 n, int num_experts, int capacity, int* counters,
                            int* counts, int* rows) {
  AMDQB_DYN_SHARED(hist);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const i64 base = (i64)blockIdx.x * nt * AMDQB_ROUTE_ITEMS;

  for (int e = tid; e < num_experts; e += nt) hist[e] = 0;
  int ex[AMDQB_ROUTE_ITEMS];
#pragma unroll
  for (int j = 0; j < AMDQB_ROUTE_ITEMS; ++j) {
    const i64 i = base + (i64)j * nt + tid;  // coalesced: item j of the block is a contiguous run
    ex[j] = i < n ? expert_of(ids, i, num_experts) : -1;
  }
  block_sync();  // 1: histogram zeroed

#pragma unroll
  for (int j = 0; j < AMDQB_ROUTE_ITEMS; ++j)
    if (ex[j] >= 0) atomic_add_shared(&hist[ex[j]], 1);
  block_sync();  // 2: tile histogram complete

  // RES_BATCH reservations per thread in flight at once: each returns its base from the L2, and
  // one at a time would leave the thread a round trip per expert (E = 4096: 4 per thread of a
  // 1024-thread block).
  constexpr int RES_BATCH = 4;
  for (int e0 = tid; e0 < num_experts; e0 += RES_BATCH * nt) {
    int c[RES_BATCH], at[RES_BATCH];
#pragma unroll
    for (int u = 0; u < RES_BATCH; ++u) {
      const int e = e0 + u * nt;
      c[u] = e < num_experts ? hist[e] : 0;
    }
#pragma unroll
    for (int u = 0; u < RES_BATCH; ++u)  // interval [at, at + c)
      at[u] = c[u] > 0 ? atomic_add_global(&counters[e0 + u * nt], c[u]) : 0;
#pragma unroll
    for (int u = 0; u < RES_BATCH; ++u) {
      if (c[u] > 0) {
        const int e = e0 + u * nt;
        hist[e] = at[u];
        const int accepted = slots_within(at[u], c[u], capacity);
        if (accepted > 0) atomic_add_global(&counts[e], accepted);
      }
    }
  }
  block_sync();  // 3: interval bases visible

#pragma unroll
  for (int j = 0; j < AMDQB_ROUTE_ITEMS; ++j) {
    const i64 i = base + (i64)j * nt + tid;
    if (i < n) {
      int row = -1;
      if (ex[j] >= 0) row = place(ex[j], atomic_add_shared(&hist[ex[j]], 1), capacity);
      rows[i] = row;
    }
  }
}

// Deterministic 1/3: per-tile histograms (tile = 32 * AMDQB_DET_ITEMS routes) into
// tile_counts[tile * E + e], every entry written. fill (nullable): the grid also writes fill_val
// over fill[0, fill_len) (the align sentinel, at no extra launch). Dynamic shared memory:
// num_experts ints.
template <typename IdT>
AMDQB_DEVICE void det_tile_hist(const IdT* ids, i64 n, int num_experts, int* tile_counts, int* fill,
                                i64 fill_len, int fill_val) {
  AMDQB_DYN_SHARED(hist);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  allow_dependent_launch();  // the scan (pass 2) is launched as this pass's dependent
  if (fill != nullptr) {
    const i64 stride = (i64)gridDim.x * nt;
    for (i64 i = (i64)blockIdx.x * nt + tid; i < fill_len; i += stride) fill[i] = fill_val;
  }
  const i64 tile = 32LL * AMDQB_DET_ITEMS;
  const i64 base = (i64)blockIdx.x * tile;
  for (int e = tid; e < num_experts; e += nt) hist[e] = 0;
  block_sync();
  // DET_HIST_BATCH ids per thread loaded before any is counted (a load per LDS atomic would leave
  // each thread one L2 round trip at a time).
  constexpr int DET_HIST_BATCH = 8;
  for (i64 k0 = tid; k0 < tile; k0 += (i64)DET_HIST_BATCH * nt) {
    int ex[DET_HIST_BATCH];
#pragma unroll
    for (int u = 0; u < DET_HIST_BATCH; ++u) {
      const i64 k = k0 + (i64)u * nt;
      ex[u] = k < tile && base + k < n ? expert_of(ids, base + k, num_experts) : -1;
    }
#pragma unroll
    for (int u = 0; u < DET_HIST_BATCH; ++u)
      if (ex[u] >= 0) atomic_add_shared(&hist[ex[u]], 1);
  }
  block_sync();
  int* out = tile_counts + (i64)blockIdx.x * num_experts;
  for (int e = tid; e < num_experts; e += nt) out[e] = hist[e];
}

// Deterministic 3/3: one logical warp (block of 32 threads) per tile walks its routes in flat
// order, 32 at a time, each route's slot from warp_claim_slot over the running slots in LDS.
// Dynamic shared memory: num_experts ints.
template <typename IdT>
AMDQB_DEVICE void det_rank(const IdT* ids, i64 n, int num_experts, int capacity,
                           const int* tile_base, int* rows) {
  AMDQB_DYN_SHARED(next);
  const int lane = lane_id();
  const i64 base = (i64)blockIdx.x * 32 * AMDQB_DET_ITEMS;
  const int* tb = tile_base + (i64)blockIdx.x * num_experts;
  // The next chunk's id is loaded before this chunk is ranked: the walk is sequential, and a
  // load per step would leave it one global round trip per chunk. The first one goes out before
  // the wait for the scan (this pass is its dependent launch; the ids come from earlier kernels).
  int e_next = base + lane < n ? expert_of(ids, base + lane, num_experts) : -1;
  wait_for_prior_grid();
  for (int e = lane; e < num_experts; e += 32) next[e] = tb[e];
  warp_sync();
  for (int c = 0; c < AMDQB_DET_ITEMS; ++c) {
    const i64 i = base + (i64)c * 32 + lane;
    const int e = e_next;
    if (c + 1 < AMDQB_DET_ITEMS) e_next = i + 32 < n ? expert_of(ids, i + 32, num_experts) : -1;
    const int slot = warp_claim_slot(next, e, lane, num_experts);
    if (i < n) rows[i] = e >= 0 ? place(e, slot, capacity) : -1;
    warp_sync();  // next[] updates visible to the next chunk's leaders
  }
}

// Compact layout, final pass of one route holding slot *row (-1: dropped already): the row
// offsets[e] + slot when the slot lies below the expert's updated counter and the row fits int32
// (offsets[e] == -1: past int32); otherwise -1, and the route comes off counts[e].
AMDQB_DEVICE void compact_row(int* row, int e, const int* offsets, const int* counters,
                              int* counts) {
  const int slot = *row;
  if (slot < 0) return;
  const int off = offsets[e];
  const i64 r = (i64)off + slot;
  if (off >= 0 && slot < counters[e] && r <= (i64)0x7fffffff) {
    *row = (int)r;
  } else {
    *row = -1;
    atomic_add_global(&counts[e], -1);
  }
}

}  // namespace

// ---- kernels ------------------------------------------------------------------------------------
#define AMDQB_ROUTE_KERNELS(SUFFIX, IdT)                                                           \
  AMDQB_KERNEL void amdqb_route_atomic_##SUFFIX(const IdT* ids, i64 n, int num_experts,            \
                                                int capacity, int* counters, int* rows) {          \
    route_atomic<IdT>(ids, n, num_experts, capacity, counters, rows);                              \
  }                                                                                                \
  AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(AMDQB_ROUTE_BLOCK)                                         \
      amdqb_route_lds_##SUFFIX(const IdT* ids, i64 n, int num_experts, int capacity,               \
                               int* counters, int* counts, int* rows) {                            \
    route_lds<IdT>(ids, n, num_experts, capacity, counters, counts, rows);                         \
  }                                                                                                \
  AMDQB_KERNEL void amdqb_route_det_hist_##SUFFIX(const IdT* ids, i64 n, int num_experts,          \
                                                  int* tile_counts, int* fill, i64 fill_len,       \
                                                  int fill_val) {                                  \
    det_tile_hist<IdT>(ids, n, num_experts, tile_counts, fill, fill_len, fill_val);                \
  }                                                                                                \
  AMDQB_KERNEL void amdqb_route_det_rank_##SUFFIX(const IdT* ids, i64 n, int num_experts,          \
                                                  int capacity, const int* tile_base, int* rows) { \
    det_rank<IdT>(ids, n, num_experts, capacity, tile_base, rows);                                 \
  }                                                                                                \
  AMDQB_KERNEL void amdqb_route_compact_##SUFFIX(const IdT* ids, i64 n, int num_experts,           \
                                                 const int* offsets, const int* counters,          \
                                                 int* counts, int* rows) {                         \
    const i64 stride = (i64)gridDim.x * blockDim.x;                                                \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {                 \
      const int e = expert_of(ids, i, num_experts);                                                \
      if (e >= 0) compact_row(rows + i, e, offsets, counters, counts);                             \
    }                                                                                              \
  }

AMDQB_ROUTE_KERNELS(i32, i32)
AMDQB_ROUTE_KERNELS(i64, i64)

// Deterministic 2/3: per expert, exclusive scan over the tiles (in tile order) starting at
// start[e] (nullptr: 0); tile_counts becomes the tiles' first slots and totals[e] the end (route
// rows: start = totals = the counters). A block of SCAN_EXPERTS x SCAN_GROUPS threads: each thread
// sums one contiguous group of tiles of one expert, the group sums are scanned in LDS, and each
// thread writes its group's slots. Loads go out in batches of SCAN_BATCH (kept in registers when a
// group has no more tiles than that, i.e. up to 128 tiles: M = 8192, k = 16 gives 128 tiles of
// 1024 routes): a serial walk over the tiles would cost one L2 round trip per tile (the H200
// profile of a batched-but-serial form: 6.8 us for 64 tiles).
// consecutive experts per scan group (32: a warp reads 128 bytes)
constexpr int SCAN_EXPERTS = AMDQB_SCAN_EXPERTS;
constexpr int SCAN_GROUPS = 256 / SCAN_EXPERTS;  // tile groups per expert (blockDim.x = 256)
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(256)
    amdqb_route_det_scan(int num_tiles, int num_experts, int* tile_counts, const int* start,
                         int* totals) {
  constexpr int SCAN_BATCH = 16;
  AMDQB_SHARED(int, part, 256);  // SCAN_GROUPS x SCAN_EXPERTS
  const int el = (int)threadIdx.x % SCAN_EXPERTS;
  const int g = (int)threadIdx.x / SCAN_EXPERTS;
  const int e = (int)blockIdx.x * SCAN_EXPERTS + el;
  const bool live = e < num_experts;
  const int per = (num_tiles + SCAN_GROUPS - 1) / SCAN_GROUPS;
  const int t0 = g * per < num_tiles ? g * per : num_tiles;
  const int t1 = t0 + per < num_tiles ? t0 + per : num_tiles;
  auto at = [&](int t) -> int* { return tile_counts + (i64)t * num_experts + e; };
  // Launched as the histogram pass's dependent, and the rank pass is launched as this one's: every
  // block waits for the histograms (so the rank pass, waiting for this grid, also waits for them).
  allow_dependent_launch();
  wait_for_prior_grid();

  int c[SCAN_BATCH];
  int sum = 0;
  if (per <= SCAN_BATCH) {
#pragma unroll
    for (int u = 0; u < SCAN_BATCH; ++u) {
      c[u] = live && t0 + u < t1 ? *at(t0 + u) : 0;
      sum += c[u];
    }
  } else {
    for (int b = t0; b < t1; b += SCAN_BATCH) {
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) c[u] = live && b + u < t1 ? *at(b + u) : 0;
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) sum += c[u];
    }
  }
  part[g * SCAN_EXPERTS + el] = sum;
  block_sync();
  // Slots are int32 with wrapping arithmetic (u32): the caller's counters may hold any value.
  if (g == 0 && live) {
    u32 run = start != nullptr ? (u32)start[e] : 0u;
    for (int v = 0; v < SCAN_GROUPS; ++v) {
      const int x = part[v * SCAN_EXPERTS + el];
      part[v * SCAN_EXPERTS + el] = (int)run;
      run += (u32)x;
    }
    totals[e] = (int)run;
  }
  block_sync();
  if (!live) return;
  u32 run = (u32)part[g * SCAN_EXPERTS + el];
  if (per <= SCAN_BATCH) {
#pragma unroll
    for (int u = 0; u < SCAN_BATCH; ++u) {
      if (t0 + u < t1) {
        *at(t0 + u) = (int)run;
        run += (u32)c[u];
      }
    }
  } else {
    for (int b = t0; b < t1; b += SCAN_BATCH) {
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) c[u] = b + u < t1 ? *at(b + u) : 0;
#pragma unroll
      for (int u = 0; u < SCAN_BATCH; ++u) {
        if (b + u < t1) {
          *at(b + u) = (int)run;
          run += (u32)c[u];
        }
      }
    }
  }
}

// Routes of this call whose slot of expert e lies in [0, capacity) ([0, 2^31) compact): the
// counter delta (modulo 2^32: below 2^31 routes) from the counter before the call.
AMDQB_DEVICE int accepted_routes(int e, int capacity, const int* before, const int* counters) {
  return slots_within(before[e], (int)((u32)counters[e] - (u32)before[e]), capacity);
}

// Exclusive prefix sum over the block of one u32 per thread (wrapping arithmetic). Two levels of
// logical-warp shuffle scans: no serial loop over the block's threads.
// `warp_sums` holds blockDim.x / 32 entries. Two barriers; every thread must call it.
AMDQB_DEVICE u32 block_exclusive_sum_u32(u32 v, u32* warp_sums) {
  const int lane = lane_id();
  const int warp = warp_in_block();
  const int warps = (int)(blockDim.x >> 5);
  const u32 incl = warp_inclusive_sum_u32(v);
  if (lane == 31) warp_sums[warp] = incl;
  block_sync();
  if (warp == 0) {
    const u32 w = lane < warps ? warp_sums[lane] : 0u;
    const u32 wincl = warp_inclusive_sum_u32(w);
    if (lane < warps) warp_sums[lane] = wincl - w;  // exclusive warp offsets
  }
  block_sync();
  return warp_sums[warp] + (incl - v);
}

// out[e] = the sum of value(e') over e' < e, for e in [0, n) (wrapping u32 arithmetic): each thread
// owns a contiguous run of experts, whose sums are scanned across the block. Every thread calls it.
template <typename F>
AMDQB_DEVICE void block_exclusive_cumsum(int n, F value, int* out, u32* warp_sums) {
  const int nt = (int)blockDim.x;
  const int per = (n + nt - 1) / nt;
  const int lo = (int)threadIdx.x * per < n ? (int)threadIdx.x * per : n;
  const int hi = lo + per < n ? lo + per : n;
  u32 sum = 0;
  for (int e = lo; e < hi; ++e) sum += value(e);
  u32 run = block_exclusive_sum_u32(sum, warp_sums);
  for (int e = lo; e < hi; ++e) {
    const u32 v = value(e);  // read before the write: out may be where value reads (in place)
    out[e] = (int)run;
    run += v;
  }
}

// Saturating u32 addition at 2^31 (a compact offset at or past it fits no int32 row); a, b <= 2^31.
constexpr u32 kOffsetSat = 0x80000000u;
AMDQB_DEVICE u32 sat_add(u32 a, u32 b) { return a >= kOffsetSat - b ? kOffsetSat : a + b; }

AMDQB_DEVICE u32 warp_inclusive_sat_u32(u32 v) {
  return warp_inclusive_scan_u32(v, [](u32 a, u32 b) { return sat_add(a, b); });
}

// Exclusive saturating prefix sum over the block (block_exclusive_sum_u32 with sat_add: the
// exclusive values come from the lane / warp before, not by subtraction). Every thread calls it.
AMDQB_DEVICE u32 block_exclusive_sat_u32(u32 v, u32* warp_sums) {
  const int lane = lane_id();
  const int warp = warp_in_block();
  const int warps = (int)(blockDim.x >> 5);
  const u32 incl = warp_inclusive_sat_u32(v);
  const u32 prev = (u32)shfl_i32((int)incl, lane - 1);
  const u32 excl = lane == 0 ? 0u : prev;
  if (lane == 31) warp_sums[warp] = incl;
  block_sync();
  if (warp == 0) {
    const u32 w = lane < warps ? warp_sums[lane] : 0u;
    const u32 wincl = warp_inclusive_sat_u32(w);
    const u32 wprev = (u32)shfl_i32((int)wincl, lane - 1);
    if (lane < warps) warp_sums[lane] = lane == 0 ? 0u : wprev;
  }
  block_sync();
  return sat_add(warp_sums[warp], excl);
}

// Compact offsets: offsets[e] = the sum of max(counters[e'], 0) over e' < e, -1 once it reaches
// 2^31; each thread owns a contiguous run of experts (as block_exclusive_cumsum). One block.
AMDQB_DEVICE void compact_offsets(int n, const int* counters, int* offsets, u32* warp_sums) {
  const int nt = (int)blockDim.x;
  const int per = (n + nt - 1) / nt;
  const int lo = (int)threadIdx.x * per < n ? (int)threadIdx.x * per : n;
  const int hi = lo + per < n ? lo + per : n;
  auto value = [=](int e) -> u32 { return counters[e] > 0 ? (u32)counters[e] : 0u; };
  u32 sum = 0;
  for (int e = lo; e < hi; ++e) sum = sat_add(sum, value(e));
  u32 run = block_exclusive_sat_u32(sum, warp_sums);
  for (int e = lo; e < hi; ++e) {
    offsets[e] = run >= kOffsetSat ? -1 : (int)run;
    run = sat_add(run, value(e));
  }
}

// counts[e] = routes of this call whose slot lies in [0, capacity) / [0, 2^31) (accepted_routes;
// amdqb_route_compact_* then takes off the routes the compact rule drops); before == nullptr:
// counts are already written (the lds kernels), only the offsets are computed.
// Masked layout (offsets == nullptr): elementwise, any grid.
// Compact layout: also the offsets (compact_offsets); one block. Static shared memory: 32 u32.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024)
    amdqb_route_finalize(int num_experts, int capacity, const int* before, const int* counters,
                         int* counts, int* offsets) {
  if (offsets == nullptr) {  // uniform across the grid
    const int stride = (int)(gridDim.x * blockDim.x);
    for (int e = (int)(blockIdx.x * blockDim.x + threadIdx.x); e < num_experts; e += stride)
      counts[e] = accepted_routes(e, capacity, before, counters);
    return;
  }
  AMDQB_SHARED(u32, warp_sums, 32);
  if (before != nullptr)
    for (int e = (int)threadIdx.x; e < num_experts; e += (int)blockDim.x)
      counts[e] = accepted_routes(e, capacity, before, counters);
  compact_offsets(num_experts, counters, offsets, warp_sums);
}

// ---- moe_align_block_size -------------------------------------------------------------------------
// vLLM's layout with a deterministic order (amdqb.ref.layout.moe_align_block_size): each expert's
// routes, ascending flat index, start at the exclusive cumsum of the padded counts
// ceil(count / block_size) * block_size; sorted_ids holds flat route indices and the sentinel n
// elsewhere; expert_ids[j] is the expert owning rows [j * block_size, (j + 1) * block_size), 0 past
// the padded total; post_pad[0] is the padded total. Pass 1 = amdqb_route_det_hist_* (with the
// sentinel fill), pass 2 = amdqb_route_det_scan (start 0, totals), pass 3 = amdqb_align_rank_*:
// one block of W = blockDim.x / 32 logical warps per 32 * AMDQB_DET_ITEMS-route tile, warp w taking
// the w-th run of AMDQB_DET_ITEMS / W chunks, so the tile's routes are ranked W runs at a time
// instead of one 32-route chunk at a time. The tile's experts are staged in LDS first (every load
// in flight at once: the ranking walk is sequential per warp and would otherwise wait for one
// global load per chunk). Dynamic shared memory: (W + 1) * num_experts + 32 * AMDQB_DET_ITEMS ints.
// ceil(count / block_size) * block_size in u32 (the op checked that the padded total fits int32),
// a mask for the usual power-of-two block sizes: the rank pass computes it for every expert, and
// the 64-bit division it replaced is a long software routine on GPUs.
AMDQB_DEVICE u32 padded_count(int count, int block_size) {
  const u32 c = (u32)count, b = (u32)block_size;
  return (b & (b - 1)) == 0 ? (c + b - 1) & ~(b - 1) : (c + b - 1) / b * b;
}

template <typename IdT>
AMDQB_DEVICE void align_rank(const IdT* ids, i64 n, int num_experts, int block_size,
                             const int* tile_base, const int* totals, int* sorted_ids,
                             int* expert_ids, int num_blocks_out, int* post_pad) {
  AMDQB_DYN_SHARED(lds);
  AMDQB_SHARED(u32, warp_sums, 32);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int lane = lane_id();
  const int w = warp_in_block();
  const int warps = nt >> 5;
  constexpr int TILE = 32 * AMDQB_DET_ITEMS;
  int* start = lds;                           // [E]: padded start of each expert
  int* next = lds + num_experts;              // [W][E]: per-warp counts, then running slots
  int* tile_ex = next + warps * num_experts;  // [TILE]: expert of each route (-1: dropped)
  const i64 tile0 = (i64)blockIdx.x * TILE;
  // The tile's experts first: the ids come from earlier kernels, so they load while the scan this
  // pass is launched after (as its dependent) finishes; its outputs (tile_base, totals) after the
  // wait. The tile's first slots of this thread's first PF experts load now with everything else
  // rather than after three barriers (the rest, E > PF * blockDim.x, load where they are used).
  for (int k = tid; k < TILE; k += nt)
    tile_ex[k] = tile0 + k < n ? expert_of(ids, tile0 + k, num_experts) : -1;
  wait_for_prior_grid();
  constexpr int PF = 4;
  const int* my_base = tile_base + (i64)blockIdx.x * num_experts;
  int tb[PF];
#pragma unroll
  for (int u = 0; u < PF; ++u) tb[u] = tid + u * nt < num_experts ? my_base[tid + u * nt] : 0;

  // Padded starts (the op checked that the padded total fits int32): the padded counts staged in
  // LDS with every load in flight at once, then scanned in place (each thread's run of experts read
  // from LDS, not one global round trip per expert and pass).
  for (int e = tid; e < num_experts; e += nt) start[e] = (int)padded_count(totals[e], block_size);
  block_sync();
  block_exclusive_cumsum(num_experts, [=](int e) { return (u32)start[e]; }, start, warp_sums);
  for (int i = tid; i < warps * num_experts; i += nt) next[i] = 0;
  block_sync();
  const i64 total = (i64)start[num_experts - 1] + padded_count(totals[num_experts - 1], block_size);

  // Per-warp counts of the warp's run of the tile.
  const int chunks = AMDQB_DET_ITEMS / warps;
  const int run0 = w * chunks * 32;  // the warp's run inside the tile
  int* mine = next + w * num_experts;
  for (int c = 0; c < chunks; ++c) {
    const int e = tile_ex[run0 + c * 32 + lane];
    if (e >= 0) atomic_add_shared(&mine[e], 1);
  }
  block_sync();

  // First slot of every (warp, expert): padded start + earlier tiles + earlier warps of the tile
  // (the warp loop unrolled so that its LDS loads go out together).
  auto first_slots = [&](int e, int base) {
    int r = start[e] + base;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      if (v < warps) {
        const int c = next[v * num_experts + e];
        next[v * num_experts + e] = r;
        r += c;
      }
    }
  };
#pragma unroll
  for (int u = 0; u < PF; ++u)
    if (tid + u * nt < num_experts) first_slots(tid + u * nt, tb[u]);
  for (int e = tid + PF * nt; e < num_experts; e += nt) first_slots(e, my_base[e]);
  block_sync();

  // Ranks in flat order, 32 routes at a time: the lowest peer advances the expert's slot. (Finding
  // the peer sets of 4 chunks ahead of the slot updates was slower on the H200: 2.9 vs 1.9 us for
  // this stage at M = 8192 -- match_any is costly, and interleaved with the LDS chain it hides.)
  for (int c = 0; c < chunks; ++c) {
    const int k = run0 + c * 32 + lane;
    const int e = tile_ex[k];
    const int slot = warp_claim_slot(mine, e, lane, num_experts);
    if (e >= 0) sorted_ids[slot] = (int)(tile0 + k);
    warp_sync();  // mine[] updates visible to the next chunk's leaders
  }

  // This block's slice of expert_ids: the last expert whose padded start is at or before the
  // block's first row (empty experts share the next one's start, so the last is the owner).
  const int jper = (num_blocks_out + (int)gridDim.x - 1) / (int)gridDim.x;
  const int j0 = (int)blockIdx.x * jper;
  const int j1 = j0 + jper < num_blocks_out ? j0 + jper : num_blocks_out;
  for (int j = j0 + tid; j < j1; j += nt) {
    const i64 row = (i64)j * block_size;
    int owner = 0;
    if (row < total) {
      int a = 0, b = num_experts - 1;  // start[0] == 0 <= row: the answer lies in [a, b]
      while (a < b) {
        const int mid = (a + b + 1) >> 1;
        if (start[mid] <= row)
          a = mid;
        else
          b = mid - 1;
      }
      owner = a;
    }
    expert_ids[j] = owner;
  }
  if (blockIdx.x == 0 && tid == 0) post_pad[0] = (int)total;
}

#define AMDQB_ALIGN_KERNEL(SUFFIX, IdT)                                                            \
  AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(256) amdqb_align_rank_##SUFFIX(                            \
      const IdT* ids, i64 n, int num_experts, int block_size, const int* tile_base,                \
      const int* totals, int* sorted_ids, int* expert_ids, int num_blocks_out, int* post_pad) {    \
    align_rank<IdT>(ids, n, num_experts, block_size, tile_base, totals, sorted_ids, expert_ids,    \
                    num_blocks_out, post_pad);                                                     \
  }

AMDQB_ALIGN_KERNEL(i32, i32)
AMDQB_ALIGN_KERNEL(i64, i64)
