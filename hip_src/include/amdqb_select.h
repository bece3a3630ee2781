// Exact Top-n selection over a 32-lane logical warp (amdqb.ref.ordering): experts ranked by a
// monotone int32 key (value descending), then id ascending; -0.0 == +0.0, NaN below every number.
//
// Each lane holds V keys, key[j] of the expert with id j * 32 + lane (callers map these local ids
// to their own), padding slots holding kInt32Min. select_top<CAP> writes the Top-n into per-warp
// buffers in selection order:
//   1. lower bound: the n-th best of the 32 lane maxima (bitonic sort across the warp), valid for
//      n <= 32 -- the n lanes with the best maxima hold n distinct experts at or above it;
//   2. candidates with a key at or above the bound are compacted (warp prefix sum) into a buffer
//      of CAP entries; if they overflow (or n > 32) the bound is recomputed exactly: a bitwise
//      binary search on the key gives the n-th key, ties at that key are taken in id order via
//      warp ballots, so exactly n candidates remain;
//   3. pairwise ranks among the candidates give the Top-n in selection order.
// Every lane of the warp must call these (warp primitives inside); n is the same in every lane of
// the wave (a kernel argument: the AMD branch reads the n-th lane with v_readlane).
#pragma once

#include "amdqb_prelude.h"

// A hook the CPU emulator defines to count candidate overflows (test coverage); nothing elsewhere.
#ifndef AMDQB_TRACE_OVERFLOW
#define AMDQB_TRACE_OVERFLOW()
#endif

namespace amdqb {

AMDQB_DEVICE bool at_or_ahead(i32 k, i32 id, i32 bk, i32 bid) {
  return k > bk || (k == bk && id <= bid);
}

#if defined(AMDQB_AMDGCN)
// AMD: the bitonic network's compare-exchanges written out with the stride a template argument, so
// that each shuffle is a fixed permute (DPP / ds_swizzle / permlanex16) before any loop pass.
// Elsewhere the loops below (NVIDIA's instruction stream as measured).
template <int STRIDE>
AMDQB_DEVICE void merge_step(i32& k, i32& id, int lane) {
  const i32 ok = shfl_xor_i32(k, STRIDE);
  const i32 oid = shfl_xor_i32(id, STRIDE);
  const bool other_ahead = ahead(ok, oid, k, id);
  if (((lane & STRIDE) == 0) == other_ahead) {
    k = ok;
    id = oid;
  }
}
template <int SIZE, int STRIDE>
AMDQB_DEVICE void sort_step(i32& k, i32& id, int lane) {
  const i32 ok = shfl_xor_i32(k, STRIDE);
  const i32 oid = shfl_xor_i32(id, STRIDE);
  const bool lower = (lane & STRIDE) == 0;
  const bool desc = (lane & SIZE) == 0;
  const bool other_ahead = ahead(ok, oid, k, id);
  if ((lower == desc) ? other_ahead : !other_ahead) {
    k = ok;
    id = oid;
  }
}
#endif

// The bitonic merge (strides 16 .. 1) of one (key, id) pair per lane into selection order: the 32
// pairs must form a bitonic sequence (e.g. lanes 0-15 in order, lanes 16-31 in reverse order).
AMDQB_DEVICE void warp_merge_desc(i32& k, i32& id, int lane) {
#if defined(AMDQB_AMDGCN)
  merge_step<16>(k, id, lane);
  merge_step<8>(k, id, lane);
  merge_step<4>(k, id, lane);
  merge_step<2>(k, id, lane);
  merge_step<1>(k, id, lane);
#else
#pragma unroll
  for (int stride = 16; stride > 0; stride >>= 1) {
    const i32 ok = shfl_xor_i32(k, stride);
    const i32 oid = shfl_xor_i32(id, stride);
    const bool other_ahead = ahead(ok, oid, k, id);
    if (((lane & stride) == 0) == other_ahead) {  // the lower lane keeps the pair ahead
      k = ok;
      id = oid;
    }
  }
#endif
}

// Bitonic sort of one (key, id) pair per lane, descending in the selection order: bitonic runs of
// 2 .. 16 lanes in alternating directions, then the final merge of all 32.
AMDQB_DEVICE void warp_sort_desc(i32& k, i32& id, int lane) {
#if defined(AMDQB_AMDGCN)
  sort_step<2, 1>(k, id, lane);
  sort_step<4, 2>(k, id, lane);
  sort_step<4, 1>(k, id, lane);
  sort_step<8, 4>(k, id, lane);
  sort_step<8, 2>(k, id, lane);
  sort_step<8, 1>(k, id, lane);
  sort_step<16, 8>(k, id, lane);
  sort_step<16, 4>(k, id, lane);
  sort_step<16, 2>(k, id, lane);
  sort_step<16, 1>(k, id, lane);
#else
#pragma unroll
  for (int size = 2; size < 32; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const i32 ok = shfl_xor_i32(k, stride);
      const i32 oid = shfl_xor_i32(id, stride);
      const bool lower = (lane & stride) == 0;
      const bool desc = (lane & size) == 0;
      const bool other_ahead = ahead(ok, oid, k, id);
      if ((lower == desc) ? other_ahead : !other_ahead) {
        k = ok;
        id = oid;
      }
    }
  }
#endif
  warp_merge_desc(k, id, lane);
}

// Exact n-th element of the token (n <= E): bitwise binary search on the offset-binary key for
// the n-th largest key, then the (n - #greater)-th expert with that key in id order.
template <int V>
AMDQB_DEVICE void exact_nth(const i32 (&key)[V], int n, int lane, i32& out_key, i32& out_id) {
  u32 thr = 0;
  for (int b = 31; b >= 0; --b) {
    const u32 cand = thr | (1u << b);
    int c = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) c += ((u32)key[j] ^ 0x80000000u) >= cand ? 1 : 0;
    if (warp_sum_i32(c) >= n) thr = cand;
  }
  const i32 kstar = (i32)(thr ^ 0x80000000u);
  int g = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) g += key[j] > kstar ? 1 : 0;
  const int need = n - warp_sum_i32(g);  // >= 1 ties to take, smallest ids first
  int running = 0;
  i32 found = -1;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const u32 m = ballot32(key[j] == kstar);  // id order inside a row j is lane order
    const int pc = popc32(m);
    if (found < 0 && running + pc >= need) {  // warp-uniform
      const int idx = need - running - 1;
      const bool me = ((m >> lane) & 1u) && popc32(m & lanemask_lt()) == idx;
      found = j * 32 + lowest_bit(ballot32(me));
    }
    running += pc;
  }
  out_key = kstar;
  out_id = found;
}

// How many of the lane's experts satisfy pred(key, id).
template <int V, typename Pred>
AMDQB_DEVICE int count_candidates(const i32 (&key)[V], int lane, Pred pred) {
  int c = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) c += pred(key[j], j * 32 + lane) ? 1 : 0;
  return c;
}

struct WarpBuffers {
  i32* ckey;
  i32* cid;
  i32* skey;
  i32* sid;
  float* ss;
};

// Appends the lane's experts that satisfy pred(key, id) to b.ckey/cid from slot pos on.
template <int V, typename Pred>
AMDQB_DEVICE void append_candidates(const i32 (&key)[V], int lane, int pos, const WarpBuffers& b,
                                    Pred pred) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const i32 id = j * 32 + lane;
    if (pred(key[j], id)) {
      b.ckey[pos] = key[j];
      b.cid[pos] = id;
      ++pos;
    }
  }
}

// Top-n of the token into b.skey/sid[0..n) in selection order (n <= CAP, n <= the experts held).
// Candidates: every expert whose key is at least the key of (bk, bid), an entry at or behind the
// n-th in the selection order -- a superset of the Top-n (one compare per expert instead of the
// (key, id) order's three; extra candidates tied on bk rank >= n and are dropped). Only if they
// overflow CAP, the exact n-th is searched and the candidates are taken by the full order.
template <int CAP, int V>
AMDQB_DEVICE void select_top(const i32 (&key)[V], int n, int lane, const WarpBuffers& b) {
  static_assert(CAP % 32 == 0 && CAP >= 32, "the candidate buffer holds whole warps of entries");
  i32 bk, bid;
  if (n <= 32) {
    i32 lk = key[0], lid = lane;
#pragma unroll
    for (int j = 1; j < V; ++j)
      if (key[j] > lk) {  // strict: the lane's earliest (smallest id) maximum
        lk = key[j];
        lid = j * 32 + lane;
      }
    warp_sort_desc(lk, lid, lane);
    bk = bcast_i32(lk, n - 1);  // n: the same in every lane of the wave
    bid = bcast_i32(lid, n - 1);
  } else {
    exact_nth(key, n, lane, bk, bid);
  }
  // (bk, bid) by reference: the overflow path below moves them to the exact n-th
  const auto by_order = [&](i32 k, i32 id) { return at_or_ahead(k, id, bk, bid); };
  const auto first = [&](i32 k, i32) { return k >= bk; };
  int c = count_candidates(key, lane, first);
  int incl = warp_inclusive_sum_i32(c);
  int total = bcast_i32(incl, 31);
  if (total > CAP) {  // warp-uniform; rare for real router logits
    AMDQB_TRACE_OVERFLOW();
    exact_nth(key, n, lane, bk, bid);
    c = count_candidates(key, lane, by_order);
    incl = warp_inclusive_sum_i32(c);
    total = bcast_i32(incl, 31);  // == n
    append_candidates(key, lane, incl - c, b, by_order);
  } else {
    append_candidates(key, lane, incl - c, b, first);
  }
  warp_sync();
#pragma unroll
  for (int q = 0; q < CAP / 32; ++q) {
    const int slot = lane + 32 * q;
    if (slot < total) {
      const i32 mk = b.ckey[slot], mid = b.cid[slot];
      int rank = 0;
      for (int m = 0; m < total; ++m) rank += ahead(b.ckey[m], b.cid[m], mk, mid) ? 1 : 0;
      if (rank < n) {
        b.skey[rank] = mk;
        b.sid[rank] = mid;
      }
    }
  }
  warp_sync();
}

}  // namespace amdqb
