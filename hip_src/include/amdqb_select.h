// Exact Top-n selection over a row of W lanes (amdqb.ref.ordering): experts ranked by a monotone
// int32 key (value descending), then id ascending; -0.0 == +0.0, NaN below every number.
//
// A row is a 32-lane logical warp (W = 32), or on wave64 AMD a whole wave (W = 64). Lane p holds V
// keys, key[j] of the expert with id row_id<W, V>(j, p) = h * 32V + j * 32 + l (h = p / 32, l =
// p % 32): each 32-lane half holds a contiguous half of the ids in the 32-lane layout (W = 32: id
// j * 32 + p); callers map these local ids to their own, padding slots holding kInt32Min.
// select_top<CAP, W> writes the Top-n into per-row buffers in selection order:
//   1. lower bound: the n-th best of the lane maxima, valid for n <= 32 -- a bitonic sort of each
//      32 lanes' maxima (W = 64: then the top 32 of both halves' sorted lists, merged in both) puts
//      the n-th best maximum in lane n - 1, and the n lanes with the best maxima hold n distinct
//      experts at or above it;
//   2. candidates with a key at or above the bound are compacted (row prefix sum) into a buffer
//      of CAP entries; if they overflow (or n > 32) the bound is recomputed exactly: a bitwise
//      binary search on the key gives the n-th key, ties at that key are taken in id order, so
//      exactly n candidates remain;
//   3. pairwise ranks among the candidates give the Top-n in selection order.
// Every lane of the row must call these (row primitives inside); n is the same in every lane of
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

// Local id of slot j of lane p of a W-lane row of V slots per lane (the header's layout).
template <int W, int V>
AMDQB_DEVICE i32 row_id(int j, int p) {
  static_assert(W == 32 || W == 64, "rows of 32 or 64 lanes");
  if constexpr (W == 64)
    return (p >> 5) * (32 * V) + j * 32 + (p & 31);
  else
    return j * 32 + p;
}

// Bits of the largest local id of a W-lane row of V slots per lane.
AMDQB_DEVICE constexpr int id_bits(int ids) {
  int b = 0;
  while ((1 << b) < ids) ++b;
  return b;
}

#if defined(AMDQB_AMDGCN)
// AMD: a lane's set of slots as bits (bit j % 32 of word j / 32 for slot j), one VGPR per 32
// slots where a compare per slot would hold a lane mask each (an SGPR pair on wave64).
template <int V>
struct SlotBits {
  static constexpr int kWords = (V + 31) / 32;
  u32 w[kWords];
};
template <int V>
AMDQB_DEVICE bool slot_in(const SlotBits<V>& s, int j) {
  return (s.w[j >> 5] >> (j & 31)) & 1u;
}
template <int V>
AMDQB_DEVICE int slot_count(const SlotBits<V>& s) {
  int c = 0;
#pragma unroll
  for (int q = 0; q < SlotBits<V>::kWords; ++q) c += popc32(s.w[q]);
  return c;
}

// The slots j < lim of V (lim in [0, V]).
template <int V>
AMDQB_DEVICE SlotBits<V> slots_below(int lim) {
  SlotBits<V> m;
#pragma unroll
  for (int q = 0; q < SlotBits<V>::kWords; ++q) {
    const int r = lim - 32 * q;
    m.w[q] = r >= 32 ? ~0u : r <= 0 ? 0u : (1u << r) - 1u;
  }
  return m;
}

// Slots whose key satisfies pred(key), taken at this point (an empty asm on each word keeps the
// compiler from recomputing them from the compares later, each compare's lane mask held).
template <int V, typename Pred>
AMDQB_DEVICE SlotBits<V> slots_where(const i32 (&key)[V], Pred pred) {
  SlotBits<V> m;
#pragma unroll
  for (int q = 0; q < SlotBits<V>::kWords; ++q) m.w[q] = 0u;
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (pred(key[j])) m.w[j >> 5] |= 1u << (j & 31);
#if defined(AMDQB_HIP)
#pragma unroll
  for (int q = 0; q < SlotBits<V>::kWords; ++q) asm volatile("" : "+v"(m.w[q]));
#endif
  return m;
}

// Exact Top-n candidates of lane p (n <= E): the slots of the experts at or ahead of the n-th in
// the selection order. A bitwise binary search on the offset-binary key finds the n-th largest
// key; the ties at it are taken in id order, the need-th tie's id the largest x with fewer than
// `need` ties below it (a bitwise search on the id as well). The lane's ids are row_id(0, p) +
// 32 j, increasing in j, so the ties below an id are the tie bits of a prefix of slots: counts
// and row sums only, no per-slot mask held through the searches.
template <int W, int V>
AMDQB_DEVICE SlotBits<V> exact_candidates(const i32 (&key)[V], int n, int p) {
  typedef Warp<W> Row;
  u32 thr = 0;
#pragma unroll 1  // the rare path: rolled, so it holds few registers besides the keys
  for (int b = 31; b >= 0; --b) {
    const u32 cand = thr | (1u << b);
    const i32 kc = (i32)(cand ^ 0x80000000u);  // key >= kc <=> offset-binary key >= cand
    int c = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) c += key[j] >= kc ? 1 : 0;
    if (Row::sum_i32(c) >= n) thr = cand;
  }
  const i32 kstar = (i32)(thr ^ 0x80000000u);
  const SlotBits<V> gt = slots_where(key, [&](i32 k) { return k > kstar; });
  const SlotBits<V> tie = slots_where(key, [&](i32 k) { return k == kstar; });
  const int need = n - Row::sum_i32(slot_count(gt));  // >= 1 ties to take, smallest ids first
  const int base = row_id<W, V>(0, p);
  // slots of the lane whose id is below x: ceil((x - base) / 32), within [0, V]
  const auto below = [&](i32 x) {
    const int d = x - base;
    return slots_below<V>(d <= 0 ? 0 : (d + 31) >> 5 < V ? (d + 31) >> 5 : V);
  };
  i32 found = 0;
#pragma unroll 1
  for (int b = id_bits(W * V) - 1; b >= 0; --b) {
    const i32 cand = found | (1 << b);
    const SlotBits<V> m = below(cand);
    int c = 0;
#pragma unroll
    for (int q = 0; q < SlotBits<V>::kWords; ++q) c += popc32(tie.w[q] & m.w[q]);
    if (Row::sum_i32(c) < need) found = cand;
  }
  const SlotBits<V> upto = below(found + 1);
  SlotBits<V> sel;
#pragma unroll
  for (int q = 0; q < SlotBits<V>::kWords; ++q) sel.w[q] = gt.w[q] | (tie.w[q] & upto.w[q]);
  return sel;
}
#else
// Exact n-th element of the token (n <= E): bitwise binary search on the offset-binary key for
// the n-th largest key, then the (n - #greater)-th expert with that key in id order.
template <int W, int V>
AMDQB_DEVICE void exact_nth(const i32 (&key)[V], int n, int p, i32& out_key, i32& out_id) {
  static_assert(W == 32, "64-lane rows are AMD's");
  typedef Warp<W> Row;
  u32 thr = 0;
  for (int b = 31; b >= 0; --b) {
    const u32 cand = thr | (1u << b);
    int c = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) c += ((u32)key[j] ^ 0x80000000u) >= cand ? 1 : 0;
    if (Row::sum_i32(c) >= n) thr = cand;
  }
  const i32 kstar = (i32)(thr ^ 0x80000000u);
  int g = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) g += key[j] > kstar ? 1 : 0;
  const int need = n - Row::sum_i32(g);  // >= 1 ties to take, smallest ids first
  int running = 0;
  i32 found = -1;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const u32 m = ballot32(key[j] == kstar);  // id order inside a row j is lane order
    const int pc = popc32(m);
    if (found < 0 && running + pc >= need) {  // warp-uniform
      const int idx = need - running - 1;
      const bool me = ((m >> p) & 1u) && popc32(m & lanemask_lt()) == idx;
      found = j * 32 + lowest_bit(ballot32(me));
    }
    running += pc;
  }
  out_key = kstar;
  out_id = found;
}
#endif

// How many of the lane's experts satisfy pred(key, id).
template <int W, int V, typename Pred>
AMDQB_DEVICE int count_candidates(const i32 (&key)[V], int p, Pred pred) {
  int c = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) c += pred(key[j], row_id<W, V>(j, p)) ? 1 : 0;
  return c;
}

struct WarpBuffers {
  i32* ckey;
  i32* cid;
  i32* skey;
  i32* sid;
  float* ss;
};

// Appends the lane's experts that satisfy pred(key, id) to b.ckey/cid from slot pos on, within
// the CAP slots of the buffer.
template <int CAP, int W, int V, typename Pred>
AMDQB_DEVICE void append_candidates(const i32 (&key)[V], int p, int pos, const WarpBuffers& b,
                                    Pred pred) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const i32 id = row_id<W, V>(j, p);
    if (pred(key[j], id) && pos < CAP) {
      b.ckey[pos] = key[j];
      b.cid[pos] = id;
      ++pos;
    }
  }
}

#if defined(AMDQB_AMDGCN)
// Appends the lane's slots in sel to b.ckey/cid from slot pos on, within the CAP slots of the
// buffer.
template <int CAP, int W, int V>
AMDQB_DEVICE void append_slots(const i32 (&key)[V], int p, int pos, const WarpBuffers& b,
                               const SlotBits<V>& sel) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (slot_in(sel, j) && pos < CAP) {
      b.ckey[pos] = key[j];
      b.cid[pos] = row_id<W, V>(j, p);
      ++pos;
    }
  }
}
#endif

// The lanes' maxima (each lane's earliest, smallest-id one), sorted descending over the row's
// first 32 lanes (W = 64: the top 32 of both halves' maxima, which the upper half shares): lane
// r holds the r-th, so lane n - 1's is at or behind the n-th expert of the row for n <= 32.
template <int W, int V>
AMDQB_DEVICE void sorted_lane_maxima(const i32 (&key)[V], int p, const WarpBuffers& b, i32& lk,
                                     i32& lid) {
  typedef Warp<W> Row;
  lk = key[0];
  lid = row_id<W, V>(0, p);
#pragma unroll
  for (int j = 1; j < V; ++j)
    if (key[j] > lk) {  // strict: the lane's earliest (smallest id) maximum
      lk = key[j];
      lid = row_id<W, V>(j, p);
    }
  warp_sort_desc(lk, lid, p & 31);  // each 32 lanes
  if constexpr (W == 64) {
    // The top 32 of the 64 maxima in both halves: lane p takes the better of its own and lane
    // 63 - p's (both halves sorted descending, one read reversed: a bitonic sequence), then the
    // merge sorts it. Through the candidate buffer, free until the caller's compaction.
    b.ckey[p] = lk;
    b.cid[p] = lid;
    Row::sync();
    const i32 ok = b.ckey[63 - p], oid = b.cid[63 - p];
    Row::sync();
    if (ahead(ok, oid, lk, lid)) {
      lk = ok;
      lid = oid;
    }
    warp_merge_desc(lk, lid, p & 31);
  }
}

// The pairwise ranks of the total <= CAP candidates in b.ckey/cid: the first n in selection order
// into b.skey/sid. Every lane of the row calls it after the candidates are written and synced.
template <int CAP, int W>
AMDQB_DEVICE void rank_candidates(int n, int p, const WarpBuffers& b, int total) {
  typedef Warp<W> Row;
#pragma unroll
  for (int q = 0; q < CAP / W; ++q) {
    const int slot = p + W * q;
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
  Row::sync();
}

// Top-n of the token into b.skey/sid[0..n) in selection order (n <= CAP, n <= the experts held),
// lane p of a W-lane row. Candidates: every expert whose key is at least the key of (bk, bid), an
// entry at or behind the n-th in the selection order -- a superset of the Top-n (one compare per
// expert instead of the (key, id) order's three; extra candidates tied on bk rank >= n and are
// dropped). Only if they overflow CAP, the exact n-th is searched and the candidates are taken by
// the full order.
template <int CAP, int W = 32, int V>
AMDQB_DEVICE void select_top(const i32 (&key)[V], int n, int p, const WarpBuffers& b) {
  static_assert(CAP % 32 == 0 && CAP >= W, "the candidate buffer holds whole rows of entries");
  typedef Warp<W> Row;
  i32 bk = 0;
  const auto first = [&](i32 k, i32) { return k >= bk; };
#if defined(AMDQB_AMDGCN)
  // AMD: one exact path for n > 32 and the overflow, its candidates as slot bits (SlotBits)
  int c = 0, incl = 0, total = CAP + 1;
  if (n <= 32) {
    i32 lk, lid;
    sorted_lane_maxima<W>(key, p, b, lk, lid);
    bk = Row::bcast(lk, n - 1);  // n: the same in every lane of the wave (W = 64: lane n - 1
                                 // of the lower half, whose list the upper half shares)
    c = count_candidates<W>(key, p, first);
    incl = (int)Row::inclusive_sum_u32((u32)c);
    total = Row::bcast(incl, W - 1);
    if (total > CAP) AMDQB_TRACE_OVERFLOW();  // row-uniform; rare for real router logits
  }
  if (total > CAP) {
    const SlotBits<V> sel = exact_candidates<W>(key, n, p);
    c = slot_count(sel);
    incl = (int)Row::inclusive_sum_u32((u32)c);
    total = Row::bcast(incl, W - 1);  // == n
    append_slots<CAP, W>(key, p, incl - c, b, sel);
  } else {
    append_candidates<CAP, W>(key, p, incl - c, b, first);
  }
#else
  i32 bid = 0;
  // (bk, bid) by reference: the exact path below moves them to the exact n-th
  const auto by_order = [&](i32 k, i32 id) { return at_or_ahead(k, id, bk, bid); };
  if (n <= 32) {
    i32 lk, lid;
    sorted_lane_maxima<W>(key, p, b, lk, lid);
    bk = Row::bcast(lk, n - 1);    // n: the same in every lane of the wave (W = 64: lane n - 1
    bid = Row::bcast(lid, n - 1);  // of the lower half, whose list the upper half shares)
  } else {
    exact_nth<W>(key, n, p, bk, bid);
  }
  int c = count_candidates<W>(key, p, first);
  int incl = (int)Row::inclusive_sum_u32((u32)c);
  int total = Row::bcast(incl, W - 1);
  if (total > CAP) {  // warp-uniform; rare for real router logits
    AMDQB_TRACE_OVERFLOW();
    exact_nth<W>(key, n, p, bk, bid);
    c = count_candidates<W>(key, p, by_order);
    incl = (int)Row::inclusive_sum_u32((u32)c);
    total = Row::bcast(incl, W - 1);  // == n
    append_candidates<CAP, W>(key, p, incl - c, b, by_order);
  } else {
    append_candidates<CAP, W>(key, p, incl - c, b, first);
  }
#endif
  // n <= CAP candidates for a consistent order; the buffer bounds the reads whatever the counts
  if (total > CAP) total = CAP;
  Row::sync();
  rank_candidates<CAP, W>(n, p, b, total);
}

// Top-n through approximate keys (amdqb_router's AMDQB_PREFILTER build): akey[] orders values va
// within err of the exact ones (|va - v| <= err before the fp32 rounding both take), and
// exact_key(id) gives expert id's exact key. With vt the n-th best lane maximum of va (at most the
// n-th best va), every exact Top-n member has va >= vt - 2d, d = err + (2|vt| + 4) 2^-22 (err and
// both roundings' half ulps); the experts at or above fl(vt - 3d) are the candidates, their
// exact keys computed, and the pairwise ranks give b.skey/sid[0..n) as select_top does. Returns
// false (row-uniform, nothing written) where it cannot decide: n > 32, vt not finite or beyond
// 1e30, or more than CAP candidates; the caller then selects from the exact keys.
template <int CAP, int W = 32, int V, typename ExactKey>
AMDQB_DEVICE bool select_top_prefiltered(const i32 (&akey)[V], int n, int p, const WarpBuffers& b,
                                         float err, ExactKey exact_key) {
  static_assert(CAP % 32 == 0 && CAP >= W, "the candidate buffer holds whole rows of entries");
  typedef Warp<W> Row;
  if (n > 32) return false;
  i32 lk, lid;
  sorted_lane_maxima<W>(akey, p, b, lk, lid);
  const float vt = key_value(Row::bcast(lk, n - 1));
  if (!(fabsf(vt) <= 1e30f)) return false;  // NaN, infinities, values whose margin overflows
  const float d = err + (2.0f * fabsf(vt) + 4.0f) * (1.0f / 4194304.0f);
  const i32 lo = order_key(vt - 3.0f * d);
  const auto cand = [&](i32 k, i32) { return k >= lo; };
  const int c = count_candidates<W>(akey, p, cand);
  const int incl = (int)Row::inclusive_sum_u32((u32)c);
  const int total = Row::bcast(incl, W - 1);
  if (total > CAP) {
    AMDQB_TRACE_OVERFLOW();
    return false;
  }
  append_candidates<CAP, W>(akey, p, incl - c, b, cand);
  Row::sync();
#pragma unroll
  for (int q = 0; q < CAP / W; ++q) {
    const int slot = p + W * q;
    if (slot < total) b.ckey[slot] = exact_key(b.cid[slot]);
  }
  Row::sync();
  rank_candidates<CAP, W>(n, p, b, total);
  return true;
}

}  // namespace amdqb
