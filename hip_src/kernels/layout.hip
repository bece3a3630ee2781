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

// Bits of a bucket id below num_experts (0 for one bucket).
AMDQB_DEVICE int bucket_bits(int num_experts) {
  int bits = 0;
  while (bits < 31 && (1 << bits) < num_experts) ++bits;
  return bits;
}

// The lanes whose bucket equals the caller's, for buckets in [-1, 2^bits): a ballot for "valid"
// and one per bit. Its cost does not grow with the distinct buckets in the warp, where a
// hardware match (or a loop over shuffles) serialises on them (E = 256: ~30 distinct buckets in a
// chunk of 32 random routes).
AMDQB_DEVICE u32 bucket_peers(int e, int bits) {
  const bool valid = e >= 0;
  const u32 v = ballot32(valid);
  u32 peers = valid ? v : ~v;
  for (int k = 0; k < bits; ++k) {  // uniform across the warp
    const bool set = ((e >> k) & 1) != 0;
    const u32 m = ballot32(set);
    peers &= set ? m : ~m;
  }
  return peers;
}

// Deterministic slot of each lane's route among the warp's 32 in flat order: lanes with the same
// expert e (>= 0, < 2^bits) rank in lane order after next[e], and the lowest of them advances
// next[e] by their count. Returns next[e] + rank (unused for e < 0). The caller warp_syncs before
// the next call, so that its leaders see the update.
AMDQB_DEVICE int warp_claim_slot(int* next, int e, int lane, int bits) {
  const u32 peers = bucket_peers(e, bits);
  const int leader = lowest_bit(peers);
#if defined(AMDQB_AMDGCN)
  // AMD: every peer reads the bucket's slot itself before the leader advances it (an LDS read in
  // place of the leader's read, where broadcasting it would cost a ds_bpermute per claim).
  const int start = e >= 0 ? next[e] : 0;
  warp_sync();
  if (e >= 0 && lane == leader) next[e] = (int)((u32)start + (u32)popc32(peers));
#else
  int start = 0;
  if (e >= 0 && lane == leader) {
    start = next[e];
    next[e] = (int)((u32)start + (u32)popc32(peers));  // int32 slots wrap (the caller's counters)
  }
  start = shfl_i32(start, leader);
#endif
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
// tile_counts[tile * E + e], every entry written. Dynamic shared memory: num_experts ints.
template <typename IdT>
AMDQB_DEVICE void det_tile_hist(const IdT* ids, i64 n, int num_experts, int* tile_counts) {
  AMDQB_DYN_SHARED(hist);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  allow_dependent_launch();  // the scan (pass 2) is launched as this pass's dependent
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
  const int bits = bucket_bits(num_experts);
  for (int c = 0; c < AMDQB_DET_ITEMS; ++c) {
    const i64 i = base + (i64)c * 32 + lane;
    const int e = e_next;
    if (c + 1 < AMDQB_DET_ITEMS) e_next = i + 32 < n ? expert_of(ids, i + 32, num_experts) : -1;
    const int slot = warp_claim_slot(next, e, lane, bits);
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
                                                  int* tile_counts) {                              \
    det_tile_hist<IdT>(ids, n, num_experts, tile_counts);                                          \
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

// Exclusive prefix sum over the block of one u32 per thread (wrapping arithmetic), and the block's
// total to every thread. Two levels of logical-warp shuffle scans: no serial loop over the block's
// threads. `warp_sums` holds blockDim.x / 32 + 1 entries (the last one: the total). Two barriers;
// every thread must call it.
AMDQB_DEVICE u32 block_exclusive_sum_u32(u32 v, u32* warp_sums, u32& total) {
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
    if (lane == 31) warp_sums[32] = wincl;          // lanes past the warps add 0: the total
  }
  block_sync();
  total = warp_sums[32];
  return warp_sums[warp] + (incl - v);
}

// Saturating u32 addition at 2^31 (a compact offset at or past it fits no int32 row); a, b <= 2^31.
constexpr u32 kOffsetSat = 0x80000000u;
AMDQB_DEVICE u32 sat_add(u32 a, u32 b) { return a >= kOffsetSat - b ? kOffsetSat : a + b; }

AMDQB_DEVICE u32 warp_inclusive_sat_u32(u32 v) {
  return warp_inclusive_scan_u32(v, [](u32 a, u32 b) { return sat_add(a, b); });
}

// Exclusive saturating prefix sum over the block (block_exclusive_sum_u32's scheme with sat_add: the
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

// [lo, hi): the contiguous run of [0, n) this thread owns in a block scan over n entries, at most
// ceil(n / blockDim.x) of them, in thread order.
struct ThreadRun {
  int lo, hi;
};
AMDQB_DEVICE ThreadRun thread_run(int n) {
  const int nt = (int)blockDim.x;
  const int per = (n + nt - 1) / nt;
  const int lo = (int)threadIdx.x * per < n ? (int)threadIdx.x * per : n;
  return {lo, lo + per < n ? lo + per : n};
}

// Compact offsets: offsets[e] = the sum of max(counters[e'], 0) over e' < e, -1 once it reaches
// 2^31; each thread owns a contiguous run of experts (thread_run). One block.
AMDQB_DEVICE void compact_offsets(int n, const int* counters, int* offsets, u32* warp_sums) {
  const ThreadRun owned = thread_run(n);
  const int lo = owned.lo, hi = owned.hi;
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
// vLLM's layout with a deterministic order (amdqb.ref.layout.moe_align_block_size), plus the
// conventions of the compat modules (amdqb.backends.calls.AlignCall): each bucket's routes,
// ascending flat index, start at the exclusive cumsum of the padded counts
// ceil(count / block_size) * block_size; sorted_ids holds flat route indices and the sentinel n
// elsewhere; expert_ids[j] is the bucket owning rows [j * block_size, (j + 1) * block_size)
// (minus owner_shift, or through the expert map), tail_value past the padded total; post_pad[0]
// is the padded total.
//
// Bucket of a route with id v: v + id_shift (SGLang's -1 .. E - 2 ids in buckets 0 .. E - 1), or
// expert_map[v] (map_mode 1: vLLM's global -> local filter); outside [0, E) it is skipped.
//
// amdqb_align: one block per tile of routes. tiles == 1 (small M): the block counts the buckets
// itself -- the whole op is one launch. tiles > 1: amdqb_align_hist counts every tile first
// (tile_counts [tiles, E]) and each rank block sums the columns for the totals and its tile's
// base (launched as the histogram's dependent). The sentinel goes over all of sorted_ids first
// (the single block before its barriers; else amdqb_align_hist, which the rank pass waits for),
// so the route slots overwrite it; with flags bit 2 the caller's padding stays (no sentinel). The
// block then scans the padded counts, writes its slice of expert_ids, and ranks its tile's routes:
// warp w owns a contiguous run of chunks of 32 routes, counts them per bucket, and walks them in
// flat order claiming slots (warp_claim_slot). Dynamic shared memory: (1 + warps) * E ints.
//
// ceil(count / block_size) * block_size in u32 (the op checked that the padded total fits int32),
// a mask for the usual power-of-two block sizes: the rank pass computes it for every expert, and
// the 64-bit division it replaced is a long software routine on GPUs.
AMDQB_DEVICE u32 padded_count(int count, int block_size) {
  const u32 c = (u32)count, b = (u32)block_size;
  return (b & (b - 1)) == 0 ? (c + b - 1) & ~(b - 1) : (c + b - 1) / b * b;
}

// Arguments of amdqb_align_hist / amdqb_align (amdqb.backends.hip.layout.AlignParams mirrors it).
struct AlignParams {
  const void* ids;         // n ids in memory order, int32 (or int64: flags bit 0)
  const void* expert_map;  // map_mode != 0: [map_len] int32 (or int64: flags bit 1)
  int* tile_counts;        // [tiles, num_experts] (tiles > 1)
  int* sorted_ids;         // [sorted_len]
  int* expert_ids;         // [num_blocks]
  int* post_pad;           // [1]
  i64 n;
  i64 sorted_len;
  i32 num_experts;  // buckets
  i32 block_size;
  i32 tile;  // routes per tile, a multiple of 32 * warps
  i32 tiles;
  i32 num_blocks;
  i32 id_shift;
  i32 map_len;
  i32 map_mode;  // 0 none, 1 filter ids through the map, 2 map the blocks' experts
  i32 owner_shift;
  i32 tail_value;
  i32 flags;        // bit 0, 1: int64 ids, map; bit 2: no sentinel (the caller's padding stays)
  i32 rank_warps;   // warps that rank (the first ones); the others help count and fill
  i32 warp_run;     // routes per ranking warp: whole chunks of 32, rank_warps of them cover a tile
  i32 tile_blocks;  // entries of expert_ids each block writes, ceil(num_blocks / tiles)
};

namespace {

AMDQB_DEVICE i64 load_id(const void* p, i64 i, bool wide) {
  return wide ? static_cast<const i64*>(p)[i] : (i64) static_cast<const i32*>(p)[i];
}

// Bucket of the route id v, or -1 (skipped). 64-bit compares: an int64 id of 2^32 + 3 must skip,
// not alias bucket 3.
AMDQB_DEVICE int bucket_of_id(const AlignParams& p, i64 v) {
  if (p.map_mode == 1)
    v = v >= 0 && v < p.map_len ? load_id(p.expert_map, v, p.flags & 2) : -1;
  else
    v += p.id_shift;
  return v >= 0 && v < p.num_experts ? (int)v : -1;
}

// Bucket of route i, or -1 (skipped).
AMDQB_DEVICE int bucket_of(const AlignParams& p, i64 i) {
  return bucket_of_id(p, load_id(p.ids, i, p.flags & 1));
}

// dst[0, len) = value, by thread `thread` of `threads`: 16-byte stores after a scalar head up to
// 16-byte alignment (a 4-byte store per slot was a fourth of a one-block align of 512 routes on
// sm_90, most of its slots being padding).
AMDQB_DEVICE void fill_i32(int* dst, i64 len, int value, i64 thread, i64 threads) {
  const i64 misaligned = (i64)((16 - (reinterpret_cast<u64>(dst) & 15)) & 15) >> 2;
  const i64 head = misaligned < len ? misaligned : len;
  for (i64 i = thread; i < head; i += threads) dst[i] = value;
  const i64 vecs = (len - head) >> 2;
  for (i64 i = thread; i < vecs; i += threads) store_i32x4(dst + head + 4 * i, value);
  for (i64 i = head + 4 * vecs + thread; i < len; i += threads) dst[i] = value;
}

}  // namespace

// expert_ids[j] for j = first, first + stride, ... below end: the bucket owning rows
// [j * block_size, (j + 1) * block_size) (a binary search of the padded starts in LDS), through
// the map or minus owner_shift; the tail value past the padded total.
AMDQB_DEVICE void write_expert_ids(const AlignParams& p, const int* start, i64 total, int first,
                                   int end, int stride) {
  const int E = p.num_experts;
  for (int j = first; j < end; j += stride) {
    const i64 row = (i64)j * p.block_size;
    int value;
    if (row < total) {
      int a = 0, b = E - 1;  // start[0] == 0 <= row: the owner lies in [a, b]
      while (a < b) {
        const int mid = (a + b + 1) >> 1;
        if (start[mid] <= row)
          a = mid;
        else
          b = mid - 1;
      }
      value = p.map_mode == 2 ? (int)load_id(p.expert_map, a, p.flags & 2) : a - p.owner_shift;
    } else {
      value = p.tail_value;
      if (p.map_mode == 2) {  // the map read at the tail value, PyTorch's negative indexing
        const int at = value < 0 ? value + p.map_len : value;
        if (at >= 0 && at < p.map_len) value = (int)load_id(p.expert_map, at, p.flags & 2);
      }
    }
    p.expert_ids[j] = value;
  }
}

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align_hist(AlignParams p) {
  AMDQB_DYN_SHARED(hist);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  allow_dependent_launch();  // the rank pass is launched as this pass's dependent
  for (int e = tid; e < p.num_experts; e += nt) hist[e] = 0;
  // the sentinel over sorted_ids; the rank pass, which waits for this grid, writes the routes
  if (!(p.flags & 4))
    fill_i32(p.sorted_ids, p.sorted_len, (int)p.n, (i64)blockIdx.x * nt + tid, (i64)gridDim.x * nt);
  block_sync();
  const i64 t0 = (i64)blockIdx.x * p.tile;
  const i64 t1 = t0 + p.tile < p.n ? t0 + p.tile : p.n;
  // 8 ids per thread loaded before any is counted (a load per LDS atomic would leave each thread
  // one L2 round trip at a time)
  constexpr int BATCH = 8;
  for (i64 k0 = t0 + tid; k0 < t1; k0 += (i64)BATCH * nt) {
    int b[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const i64 i = k0 + (i64)u * nt;
      b[u] = i < t1 ? bucket_of(p, i) : -1;
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u)
      if (b[u] >= 0) atomic_add_shared(&hist[b[u]], 1);
  }
  block_sync();
  int* out = p.tile_counts + (i64)blockIdx.x * p.num_experts;
  for (int e = tid; e < p.num_experts; e += nt) out[e] = hist[e];
}

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align(AlignParams p) {
  AMDQB_DYN_SHARED(lds);
  AMDQB_SHARED(u32, warp_sums, 33);
  // chunks of 32 buckets a lane keeps from the count to the walk. The kernel runs as one block
  // for small M, where its straight-line code is fetched cold: loops stay rolled (no unrolled
  // per-expert or per-chunk copies of the walk; an unrolled build was 254 KiB of SASS on sm_90).
  constexpr int CACHED = 4;
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int lane = lane_id();
  const int w = warp_in_block();
  const int warps = p.rank_warps;  // the first ones rank; the others help count and fill
  const int E = p.num_experts;
  const int bits = bucket_bits(E);
  int* start = lds;     // [E]: padded start of each bucket
  int* next = lds + E;  // [warps][E]: per-warp counts, then each warp's running slot (relative)
  const i64 t0 = (i64)blockIdx.x * p.tile;
  const i64 t1 = t0 + p.tile < p.n ? t0 + p.tile : p.n;
  const i64 run = p.warp_run;
  const i64 r0 = t0 + (i64)w * run;
  const i64 r1 = w >= warps ? r0 : r0 + run < t1 ? r0 + run : t1;  // no run past the ranking warps
  int* mine = next + (w < warps ? w : 0) * E;

  // 1. One block: the ids first, so that their latency overlaps the zeroing and the sentinel
  // (their buckets are taken after the barrier). Several blocks keep the later loads: loading
  // early in both kernels of the two-launch path took 5.68 -> 6.33 us at 2048 routes (H100,
  // E=256, k=8, block 64), where one block gains 0.07-0.32 us at 64-8192 routes.
  const bool early = p.tiles == 1;
  i64 first[CACHED];
#pragma unroll
  for (int c = 0; c < CACHED; ++c) {
    const i64 i = r0 + (i64)c * 32 + lane;
    first[c] = early && i < r1 ? load_id(p.ids, i, p.flags & 1) : -1;
  }
  // Zeroed per-warp rows; one block: the sentinel over sorted_ids, written before the barriers
  // that order it before the route slots (several: amdqb_align_hist wrote it).
  for (int i = tid; i < warps * E; i += nt) next[i] = 0;
  if (p.tiles == 1 && !(p.flags & 4)) fill_i32(p.sorted_ids, p.sorted_len, (int)p.n, tid, nt);
  block_sync();

  // 2. Per-warp counts of the warp's run; its buckets stay in registers for the walk (the first
  // CACHED chunks: one read of the ids).
  int cached[CACHED];
#pragma unroll
  for (int c = 0; c < CACHED; ++c) {
    const i64 i = r0 + (i64)c * 32 + lane;
    cached[c] = i >= r1 ? -1 : early ? bucket_of_id(p, first[c]) : bucket_of(p, i);
  }
#pragma unroll
  for (int c = 0; c < CACHED; ++c)
    if (cached[c] >= 0) atomic_add_shared(&mine[cached[c]], 1);
  for (i64 i = r0 + (i64)CACHED * 32 + lane; i < r1; i += 32) {
    const int b = bucket_of(p, i);
    if (b >= 0) atomic_add_shared(&mine[b], 1);
  }
  if (p.tiles > 1) wait_for_prior_grid();  // tile_counts (and the sentinel fill): amdqb_align_hist
  block_sync();

  // 3. Each warp's first slot in each bucket relative to the bucket's padded start (earlier tiles
  // + earlier warps of the tile), the buckets' padded sizes and their exclusive cumsum, the padded
  // starts. A thread owns a contiguous run of buckets, so that the block scan takes its sizes from
  // registers: two barriers for the scan and one after, where a strided pass, a barrier and a
  // separate scan of the sizes in LDS took five.
  const ThreadRun owned = thread_run(E);
  const int e0 = owned.lo, e1 = owned.hi;
  u32 own = 0;  // the padded sizes of this thread's buckets
#pragma unroll 1
  for (int e = e0; e < e1; ++e) {
    int before = 0, total = 0;
    if (p.tiles > 1) {
      // the column in batches of COLS independent loads (one at a time, each add would wait
      // for its own L2 round trip)
      constexpr int COLS = 8;
      for (int t0c = 0; t0c < p.tiles; t0c += COLS) {
        int c[COLS];
#pragma unroll
        for (int q = 0; q < COLS; ++q)
          c[q] = t0c + q < p.tiles ? p.tile_counts[(i64)(t0c + q) * E + e] : 0;
#pragma unroll
        for (int q = 0; q < COLS; ++q) {
          before += t0c + q < (int)blockIdx.x ? c[q] : 0;
          total += c[q];
        }
      }
    }
    // the warps' counts in batches of ROWS independent loads (one at a time, each add waited
    // for its LDS round trip); the warps are a power of two
    constexpr int ROWS = 8;
    int r = before;
    const int batched = warps & ~(ROWS - 1);
#pragma unroll 1
    for (int v0 = 0; v0 < batched; v0 += ROWS) {
      int c[ROWS];
#pragma unroll
      for (int q = 0; q < ROWS; ++q) c[q] = next[(v0 + q) * E + e];
#pragma unroll
      for (int q = 0; q < ROWS; ++q) {
        next[(v0 + q) * E + e] = r;
        r += c[q];
      }
    }
#pragma unroll 1
    for (int v = batched; v < warps; ++v) {
      const int c = next[v * E + e];
      next[v * E + e] = r;
      r += c;
    }
    const u32 size = padded_count(p.tiles > 1 ? total : r, p.block_size);
    start[e] = (int)size;  // read back below by this thread alone
    own += size;
  }
  u32 padded_total;
  u32 at = block_exclusive_sum_u32(own, warp_sums, padded_total);
#pragma unroll 1
  for (int e = e0; e < e1; ++e) {
    const u32 size = (u32)start[e];
    start[e] = (int)at;
    at += size;
  }
  block_sync();
  const i64 total = (i64)padded_total;

  // 4. This block's slice of expert_ids, the padded total: by the warps that do not rank where
  // there are any, so that the ranking warps go on to their walk at once.
  {
    const int j0 = (int)blockIdx.x * p.tile_blocks;
    const int j1 = j0 + p.tile_blocks < p.num_blocks ? j0 + p.tile_blocks : p.num_blocks;
    const int h0 = nt > 32 * warps ? 32 * warps : 0;  // the first thread that writes
    if (tid >= h0) write_expert_ids(p, start, total, j0 + tid - h0, j1, nt - h0);
    if (blockIdx.x == 0 && tid == h0) p.post_pad[0] = (int)total;
  }

  // 5. Ranks in flat order, 32 routes at a time: the lowest peer advances the bucket's slot. The
  // cached buckets shift down one chunk per step (register moves, no indexing); past them the
  // next chunk's bucket is loaded one step ahead (the walk is sequential).
  i64 i = r0 + lane;
  int b_next = i + (i64)CACHED * 32 < r1 ? bucket_of(p, i + (i64)CACHED * 32) : -1;
#pragma unroll 1
  for (i64 c0 = r0; c0 < r1; c0 += 32, i += 32) {  // uniform across the warp
    const int b = cached[0];
#pragma unroll
    for (int c = 0; c + 1 < CACHED; ++c) cached[c] = cached[c + 1];
    cached[CACHED - 1] = b_next;
    const i64 ahead = i + (i64)(CACHED + 1) * 32;
    b_next = ahead < r1 ? bucket_of(p, ahead) : -1;
    const int slot = warp_claim_slot(mine, b, lane, bits);
    if (b >= 0) {
      const i64 at = (i64)start[b] + slot;
      if (at < p.sorted_len) p.sorted_ids[at] = (int)i;
    }
    warp_sync();  // mine[] updates visible to the next chunk's leaders
  }
}

// The planned form (past hip.align.single_block_routes up to hip.align.plan_max_routes routes; a
// power of two routes, 4 or more, to a tile): the scan leaves the rank blocks' critical path.
// amdqb_align_plan's block 0 counts every tile ([tiles, E] in LDS), scans the padded totals and
// writes each tile's absolute first slot per bucket to tile_counts, every expert_ids entry and the
// padded total; its other blocks write the sentinel over sorted_ids. amdqb_align_place, its
// dependent, ranks its tile's routes among the tile's (per-warp counts, their prefix, the walk)
// before it waits for the plan, so that after the wait a route's slot is one load of its tile's
// base and a store. Dynamic shared memory: (tiles + 1) * E ints for the plan, warps * E for the
// place blocks; a ranking warp walks at most ALIGN_CACHED chunks.
constexpr int ALIGN_CACHED = 4;

// The column col[0], col[stride], ... col[(count - 1) * stride] of LDS rows replaced by its
// exclusive prefix sum; returns the column's total. Eight independent LDS loads at a time (one at
// a time, each add waits for its own round trip).
AMDQB_DEVICE int column_exclusive_prefix(int* col, int count, int stride) {
  constexpr int ROWS = 8;
  int r = 0;
#pragma unroll 1
  for (int v0 = 0; v0 < count; v0 += ROWS) {
    int c[ROWS];
#pragma unroll
    for (int q = 0; q < ROWS; ++q) c[q] = v0 + q < count ? col[(v0 + q) * stride] : 0;
#pragma unroll
    for (int q = 0; q < ROWS; ++q) {
      if (v0 + q < count) col[(v0 + q) * stride] = r;
      r += c[q];
    }
  }
  return r;
}

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS_MIN(1024, 1) amdqb_align_plan(AlignParams p) {
  AMDQB_DYN_SHARED(lds);
  AMDQB_SHARED(u32, warp_sums, 33);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  allow_dependent_launch();  // the place blocks rank their tiles meanwhile
  // blocks past the first: the sentinel (the place pass, which waits for this grid, writes the
  // route slots over it)
  if (blockIdx.x > 0) {
    if (!(p.flags & 4))
      fill_i32(p.sorted_ids, p.sorted_len, (int)p.n, (i64)(blockIdx.x - 1) * nt + tid,
               (i64)(gridDim.x - 1) * nt);
    return;
  }
  const int E = p.num_experts;
  const int tiles = p.tiles;
  int* hist = lds;                    // [tiles][E]: counts, then each tile's exclusive prefix
  int* sizes = lds + (i64)tiles * E;  // [E]: padded size of each bucket

  // 1. Every tile's counts (tiles of a power of two routes; n < 2^31: 32-bit indices). int32 ids
  // without a map at a 16-byte boundary: 8 per thread in flight, four to a load, the first ones
  // loaded before the LDS is zeroed (one block counts them all, so its instructions per route and
  // its first load's latency bound it); else 8 at a time, one to a load.
  int shift = 0;
  while ((1 << shift) < p.tile) ++shift;
  const u32 n = (u32)p.n;
  const u32 nbuckets = (u32)E, id_shift = (u32)p.id_shift;
  const bool vec = !(p.flags & 1) && p.map_mode != 1 && (reinterpret_cast<u64>(p.ids) & 15) == 0;
  const u32 done = vec ? n & ~3u : 0;
  const int* ids = static_cast<const int*>(p.ids);
  constexpr int VECS = 2;
  const u32 step = 4 * (u32)nt;
  int v[VECS][4];
  auto load = [&](u32 q0) {
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
      const u32 q = q0 + (u32)u * step;
      if (q < done) {
        load_i32x4(ids + q, v[u]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) v[u][c] = -1 - p.id_shift;  // no bucket
      }
    }
  };
  load(4 * (u32)tid);
  for (int i = tid; i < tiles * E; i += nt) hist[i] = 0;
  block_sync();
  for (u32 q0 = 4 * (u32)tid; q0 < done; q0 += VECS * step) {
    if (q0 != 4 * (u32)tid) load(q0);
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
      int* row = hist + ((q0 + (u32)u * step) >> shift) * nbuckets;  // 4 | tile
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const u32 b = (u32)v[u][c] + id_shift;  // wraps past [0, E) for ids out of range
        if (b < nbuckets) atomic_add_shared(&row[b], 1);
      }
    }
  }
  constexpr int BATCH = 8;
  for (u32 k0 = done + (u32)tid; k0 < n; k0 += (u32)(BATCH * nt)) {
    int b[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const u32 i = k0 + (u32)(u * nt);
      b[u] = i < n ? bucket_of(p, i) : -1;
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const u32 i = k0 + (u32)(u * nt);
      if (b[u] >= 0) atomic_add_shared(&hist[(i >> shift) * nbuckets + (u32)b[u]], 1);
    }
  }
  block_sync();

  // 2. Per bucket, each tile's exclusive prefix over the tiles (8 LDS loads at a time) and the
  // padded size; the block scan of the sizes (a thread owns a contiguous run of buckets).
  const ThreadRun owned = thread_run(E);
  u32 own = 0;
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    const u32 size = padded_count(column_exclusive_prefix(hist + e, tiles, E), p.block_size);
    sizes[e] = (int)size;  // read back below by this thread alone
    own += size;
  }
  u32 padded_total;
  u32 at = block_exclusive_sum_u32(own, warp_sums, padded_total);

  // 3. Each bucket's thread writes the tiles' first slots and the bucket's expert_ids entries
  // (no barrier and no search of the starts: the thread has its buckets' starts in registers);
  // the entries past the padded total get the tail value; the padded total.
  const u32 bs = (u32)p.block_size;
  const u32 blocks = p.num_blocks > 0 ? (u32)p.num_blocks : 0u;
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    const u32 size = (u32)sizes[e];
#pragma unroll 1
    for (int t = 0; t < tiles; ++t) p.tile_counts[(i64)t * E + e] = (int)at + hist[t * E + e];
    if (size > 0) {
      const int value =
          p.map_mode == 2 ? (int)load_id(p.expert_map, e, p.flags & 2) : e - p.owner_shift;
      const u32 j1 = (at + size) / bs < blocks ? (at + size) / bs : blocks;
      for (u32 j = at / bs; j < j1; ++j) p.expert_ids[j] = value;
    }
    at += size;
  }
  int tail = p.tail_value;
  if (p.map_mode == 2) {  // the map read at the tail value, PyTorch's negative indexing
    const int at2 = tail < 0 ? tail + p.map_len : tail;
    if (at2 >= 0 && at2 < p.map_len) tail = (int)load_id(p.expert_map, at2, p.flags & 2);
  }
  for (u32 j = padded_total / bs + (u32)tid; j < blocks; j += (u32)nt) p.expert_ids[j] = tail;
  if (tid == 0) p.post_pad[0] = (int)padded_total;
}

// Each route's slot among its tile's routes of its bucket, in flat order (warp w ranks the routes
// [tile start + w * warp_run, + warp_run), at most CHUNKS chunks of 32; the warps past
// p.rank_warps rank nothing): per-warp counts in the LDS rows next[warps][E], their exclusive
// prefix over the warps, then each warp's walk. b[c] gets the bucket of the lane's route of chunk
// c (-1: none), slot[c] its slot; totals (if given, LDS) gets the tile's routes per bucket. Reads
// only the ids: a dependent kernel runs it before it waits.
template <int CHUNKS = ALIGN_CACHED>
AMDQB_DEVICE void rank_in_tile(const AlignParams& p, int* next, int (&b)[CHUNKS],
                               int (&slot)[CHUNKS], int* totals = nullptr) {
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int lane = lane_id();
  const int w = warp_in_block();
  const int E = p.num_experts;
  const int bits = bucket_bits(E);
  const i64 t0 = (i64)blockIdx.x * p.tile;
  const i64 t1 = t0 + p.tile < p.n ? t0 + p.tile : p.n;
  const bool ranks = w < p.rank_warps;
  const i64 r0 = t0 + (i64)w * p.warp_run;
  const i64 r1 = !ranks ? r0 : r0 + p.warp_run < t1 ? r0 + p.warp_run : t1;
  int* mine = next + (ranks ? w : 0) * E;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const i64 i = r0 + (i64)c * 32 + lane;
    b[c] = i < r1 ? bucket_of(p, i) : -1;
  }
  for (int i = tid; i < p.rank_warps * E; i += nt) next[i] = 0;
  block_sync();
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
    if (b[c] >= 0) atomic_add_shared(&mine[b[c]], 1);
  block_sync();
  // each warp's first slot in each bucket among the tile's routes (a thread owns a run of buckets)
  const ThreadRun owned = thread_run(E);
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    const int total = column_exclusive_prefix(next + e, p.rank_warps, E);
    if (totals != nullptr) totals[e] = total;
  }
  block_sync();
  // ranks in flat order, a chunk of 32 routes at a time (the lowest peer advances the slot)
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    slot[c] = 0;
    if (r0 + (i64)c * 32 < r1) {  // uniform across the warp
      slot[c] = warp_claim_slot(mine, b[c], lane, bits);
      warp_sync();  // mine[] updates visible to the next chunk's leaders
    }
  }
}

// Stores route r0 + c * 32 + lane of each chunk at base[b[c]] + slot[c] (base: LDS or global).
template <int CHUNKS = ALIGN_CACHED>
AMDQB_DEVICE void store_ranked(const AlignParams& p, const int* base, const int (&b)[CHUNKS],
                               const int (&slot)[CHUNKS]) {
  const i64 r0 = (i64)blockIdx.x * p.tile + (i64)warp_in_block() * p.warp_run;
  const int lane = lane_id();
  int at[CHUNKS];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) at[c] = b[c] >= 0 ? base[b[c]] : 0;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const i64 s = (i64)at[c] + slot[c];
    if (b[c] >= 0 && s < p.sorted_len) p.sorted_ids[s] = (int)(r0 + (i64)c * 32 + lane);
  }
}

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align_place(AlignParams p) {
  AMDQB_DYN_SHARED(next);  // [warps][E]: per-warp counts, then each warp's running slot in the tile
  int b[ALIGN_CACHED], slot[ALIGN_CACHED];
  rank_in_tile(p, next, b, slot);
  wait_for_prior_grid();  // tile_counts (the bases) and the sentinel: amdqb_align_plan
  store_ranked(p, p.tile_counts + (i64)blockIdx.x * p.num_experts, b, slot);
}

// The ranked tiled form (tiles > 1 past the planned form, launched as amdqb_align_hist's
// dependent): each block ranks its tile's routes before it waits (rank_in_tile), then sums the
// tile columns of tile_counts -- the routes of earlier tiles and the total of each bucket --, scans
// the padded totals, writes its slice of expert_ids and stores its routes. A column's loads all go
// out at once: the G = max(1, threads / E) thread groups each sum every G-th tile (a thread one
// bucket, or several when E exceeds the threads), and the groups' partial sums meet in LDS.
// Dynamic shared memory: (warps + 2 * G + 2) * E ints.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align_tiles(AlignParams p) {
  AMDQB_DYN_SHARED(lds);
  AMDQB_SHARED(u32, warp_sums, 33);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int E = p.num_experts;
  const int groups = nt >= E ? nt / E : 1;
  int* next = lds;                          // [warps][E]: rank_in_tile's rows
  int* part = lds + (i64)p.rank_warps * E;  // [2][groups][E]: earlier tiles, all tiles
  int* start = part + 2 * (i64)groups * E;  // [E]: padded start of each bucket
  int* base = start + E;                    // [E]: this tile's first slot per bucket
  int b[ALIGN_CACHED], slot[ALIGN_CACHED];
  rank_in_tile(p, next, b, slot);
  wait_for_prior_grid();  // tile_counts and the sentinel: amdqb_align_hist

  // 1. Partial column sums: thread t of group g = t / E sums bucket t % E over tiles g, g + G, ...
  // (E > threads: buckets t, t + threads, ... over every tile), 16 loads in flight.
  {
    const int g = nt >= E ? tid / E : 0;
    const int tiles = p.tiles;
    const int self = (int)blockIdx.x;
    constexpr int BATCH = 16;
#pragma unroll 1
    for (int e = nt >= E ? tid % E : tid; g < groups && e < E; e += nt) {
      int before = 0, total = 0;
#pragma unroll 1
      for (int t0 = g; t0 < tiles; t0 += BATCH * groups) {
        int c[BATCH];
#pragma unroll
        for (int q = 0; q < BATCH; ++q) {
          const int t = t0 + q * groups;
          c[q] = t < tiles ? p.tile_counts[(i64)t * E + e] : 0;
        }
#pragma unroll
        for (int q = 0; q < BATCH; ++q) {
          before += t0 + q * groups < self ? c[q] : 0;
          total += c[q];
        }
      }
      part[(i64)g * E + e] = before;
      part[(i64)(groups + g) * E + e] = total;
      if (nt >= E) break;  // one bucket a thread
    }
  }
  block_sync();

  // 2. Per bucket (a thread owns a contiguous run): the groups' sums, the padded size; the block
  // scan of the sizes; the padded starts and this tile's bases.
  const ThreadRun owned = thread_run(E);
  u32 own = 0;
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    int before = 0, total = 0;
    for (int g = 0; g < groups; ++g) {
      before += part[(i64)g * E + e];
      total += part[(i64)(groups + g) * E + e];
    }
    const u32 size = padded_count(total, p.block_size);
    start[e] = (int)size;  // read back below by this thread alone
    base[e] = before;
    own += size;
  }
  u32 padded_total;
  u32 at = block_exclusive_sum_u32(own, warp_sums, padded_total);
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    const u32 size = (u32)start[e];
    start[e] = (int)at;
    base[e] += (int)at;
    at += size;
  }
  block_sync();

  // 3. The routes, then this block's slice of expert_ids and the padded total.
  store_ranked(p, base, b, slot);
  const int j0 = (int)blockIdx.x * p.tile_blocks;
  const int j1 = j0 + p.tile_blocks < p.num_blocks ? j0 + p.tile_blocks : p.num_blocks;
  write_expert_ids(p, start, (i64)padded_total, j0 + tid, j1, nt);
  if (blockIdx.x == 0 && tid == 0) p.post_pad[0] = (int)padded_total;
}

#if defined(AMDQB_HAS_CLUSTERS)
// The cluster form (NVIDIA sm_90+; past hip.align.single_block_routes up to
// hip.align.cluster_max_routes routes): one launch of one thread block cluster of p.tiles blocks.
// Block r ranks tile r (rank_in_tile) and keeps the tile's routes per bucket in its LDS; after the
// cluster barrier each block reads every tile's count of its buckets from the peers' LDS (the
// routes of earlier tiles, each bucket's total), scans the padded totals and stores its routes,
// then writes its slice of expert_ids. The cluster's threads write the sentinel over sorted_ids
// first: the barrier's release / acquire orders it before every block's route stores. The warps
// past p.rank_warps (blocks of at least min(E, 1024) threads, so that a thread owns one bucket in
// the sums and the scan) rank nothing. Dynamic shared memory: (warps + 3) * E ints.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align_cluster(AlignParams p) {
  AMDQB_DYN_SHARED(lds);
  // under the #if, clang-format 19 splits this macro's arguments over two lines
  // clang-format off
  AMDQB_SHARED(u32, warp_sums, 33);
  // clang-format on
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int E = p.num_experts;
  const int self = (int)blockIdx.x;
  const int blocks = p.tiles;
  int* next = lds;                                 // [warps][E]: rank_in_tile's rows
  int* tile_total = next + (i64)p.rank_warps * E;  // [E]: this tile's routes per bucket
  int* start = tile_total + E;                     // [E]: padded start of each bucket
  int* base = start + E;                           // [E]: this tile's first slot per bucket
  if (!(p.flags & 4))  // the sentinel, before the barrier that orders it before the routes
    fill_i32(p.sorted_ids, p.sorted_len, (int)p.n, (i64)self * nt + tid, (i64)blocks * nt);
  // 8 chunks of 32 routes a warp: 32 warps rank 8192 routes, and a block whose LDS holds fewer
  // warps' rows (large E) still ranks a whole tile
  constexpr int CHUNKS = 8;
  int b[CHUNKS], slot[CHUNKS];
  rank_in_tile<CHUNKS>(p, next, b, slot, tile_total);
  cluster_arrive();  // tile_total for the peers; the sentinel before their routes
  cluster_wait();

  // 1. Per bucket (a thread owns a contiguous run): the tiles' counts from the cluster's LDS, the
  // padded size; the block scan of the sizes; the padded starts and this tile's bases.
  const ThreadRun owned = thread_run(E);
  u32 own = 0;
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    int before = 0, total = 0;
    constexpr int BATCH = 8;  // independent loads in flight (a portable cluster has 8 blocks)
#pragma unroll 1
    for (int r0 = 0; r0 < blocks; r0 += BATCH) {
      int c[BATCH];
#pragma unroll
      for (int q = 0; q < BATCH; ++q)
        c[q] = r0 + q < blocks ? cluster_load_i32(tile_total + e, r0 + q) : 0;
#pragma unroll
      for (int q = 0; q < BATCH; ++q) {
        before += r0 + q < self ? c[q] : 0;
        total += c[q];
      }
    }
    const u32 size = padded_count(total, p.block_size);
    start[e] = (int)size;  // read back below by this thread alone
    base[e] = before;
    own += size;
  }
  cluster_arrive();  // this block's reads of the peers' LDS are done (each waits before it exits)
  u32 padded_total;
  u32 at = block_exclusive_sum_u32(own, warp_sums, padded_total);
#pragma unroll 1
  for (int e = owned.lo; e < owned.hi; ++e) {
    const u32 size = (u32)start[e];
    start[e] = (int)at;
    base[e] += (int)at;
    at += size;
  }
  block_sync();

  // 2. The routes, this block's slice of expert_ids and the padded total.
  store_ranked<CHUNKS>(p, base, b, slot);
  const i64 total = (i64)padded_total;
  const int j0 = self * p.tile_blocks;
  const int j1 = j0 + p.tile_blocks < p.num_blocks ? j0 + p.tile_blocks : p.num_blocks;
  write_expert_ids(p, start, total, j0 + tid, j1, nt);
  if (self == 0 && tid == 0) p.post_pad[0] = (int)total;
  cluster_wait();
}
#endif  // AMDQB_HAS_CLUSTERS
