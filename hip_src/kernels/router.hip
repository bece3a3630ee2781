// Fused score function + exact Top-k router with opt-in Quantile Balancing (QB) histogram, and the
// serving form (biased_topk) -- a port of TransformerEngine's QB router design to 32-lane logical
// warps (wave32 and wave64).
//
// Compile-time constants (-D): AMDQB_NUM_EXPERTS (E), AMDQB_IN_DTYPE (0 fp32, 1 fp16, 2 bf16),
// AMDQB_SCORE (0 sigmoid, 1 sqrtsoftplus, 2 softmax), AMDQB_WAVE_SIZE.
//
// Precision contract (amdqb.ref.router): logits are converted to fp32 on load; activation, biased
// scores, selection, normalisation, the QB cutoff and the histogram arithmetic are fp32 without
// contraction; probs are written in the logits dtype (round to nearest even).
//
// Selection contract (amdqb.ref.ordering): experts are ranked by (value descending, id ascending)
// through a monotone int32 key (-0.0 == +0.0, NaN below -inf); padding lanes (id >= E) rank below
// every expert. The Top-n (n = k, or k + 1 under QB) is exact:
//   1. each lane holds VPL = ceil(E/32) experts (id = j*32 + lane) in registers;
//   2. lower bound: the n-th best of the 32 lane maxima (bitonic sort across the warp), valid for
//      n <= 32: the n lanes with the best maxima hold n distinct experts at or above it;
//   3. candidates at or above the bound are compacted (warp prefix sum) into a per-warp buffer of
//      CAP = 64 entries; if they overflow (or n > 32) the bound is recomputed exactly: bitwise
//      binary search on the key gives the n-th key, ties at that key are taken in id order via
//      warp ballots, so exactly n candidates remain;
//   4. pairwise ranks among the candidates give the Top-n in selection order; membership of every
//      expert is a local compare against the k-th element.
// QB: Top-(k+1) of u = s + b, alpha = u of the (k+1)-th, the first k are routed; for every expert
// r = alpha - s_j, scale = fp32(B) / (U - L), bin = clamp(floor((r - L) * scale), 0, B - 1) in fp32
// (NaN -> 0); fused mode adds 1 to hist[j * B + bin] with a device atomic in the epilogue,
// two-kernel mode writes alpha and amdqb_qb_hist recomputes the bins from the logits with the
// exact formula. The fused epilogue derives its bins through qb_bin_of_logit: an approximate
// sigmoid where its error bound provably cannot change the bin, the exact formula elsewhere, so
// every bin equals the exact one and both modes give identical histograms. (QB is sigmoid-only at
// the op level.)
#include "amdqb_prelude.h"

using namespace amdqb;

#ifndef AMDQB_NUM_EXPERTS
#error "AMDQB_NUM_EXPERTS must be defined"
#endif
#ifndef AMDQB_IN_DTYPE
#define AMDQB_IN_DTYPE 0
#endif
#ifndef AMDQB_SCORE
#define AMDQB_SCORE 0
#endif

// Resident blocks per SM the NVIDIA compiler must allow (caps the registers per thread): the
// router is latency-bound, so occupancy buys throughput until spills cost more than it gains.
// ptxas (CUDA 13, sm_90) at 256 threads: E <= 256 fits 64 registers at 4 blocks with no spill;
// E = 896 / 1024 take 80 registers at 3 blocks with a few spilled words; E >= 2048 spills even
// at 2 blocks, so those keep the compiler's choice.
#ifndef AMDQB_ROUTER_MIN_BLOCKS
#define AMDQB_ROUTER_MIN_BLOCKS (AMDQB_NUM_EXPERTS <= 256 ? 4 : AMDQB_NUM_EXPERTS <= 1024 ? 3 : 1)
#endif

#ifndef AMDQB_TRACE_OVERFLOW
#define AMDQB_TRACE_OVERFLOW()  // the host emulator counts candidate overflows (test coverage)
#endif

#define AMDQB_SCORE_SIGMOID 0
#define AMDQB_SCORE_SQRTSOFTPLUS 1
#define AMDQB_SCORE_SOFTMAX 2

namespace {

constexpr int E = AMDQB_NUM_EXPERTS;
constexpr int VPL = (E + 31) / 32;  // experts per lane
constexpr int NBYTES = (E + 7) / 8;  // bitmap bytes per token
constexpr int WARPS = 8;             // logical warps (tokens in flight) per block of 256 threads
constexpr int CAP = 64;              // candidate buffer per warp; also the largest n supported

enum MapKind { kMapNone = 0, kByteMap = 1, kBitMap = 2, kIdx16 = 3, kIdx32 = 4, kIdx64 = 5 };
enum QbMode { kQbNone = 0, kQbFused = 1, kQbAlpha = 2 };

#if AMDQB_IN_DTYPE == 0
typedef float in_t;
AMDQB_DEVICE float to_f32(in_t x) { return x; }
AMDQB_DEVICE in_t from_f32(float x) { return x; }
#elif AMDQB_IN_DTYPE == 1
typedef u16 in_t;
AMDQB_DEVICE float to_f32(in_t x) { return half_to_float(x); }
AMDQB_DEVICE in_t from_f32(float x) { return float_to_half(x); }
#else
typedef u16 in_t;
AMDQB_DEVICE float to_f32(in_t x) { return bf16_to_float(x); }
AMDQB_DEVICE in_t from_f32(float x) { return float_to_bf16(x); }
#endif

[[maybe_unused]] AMDQB_DEVICE float neg_inf() { return bits_float(0xff800000u); }

// Sigmoid 1 / (1 + e^-z) with an IEEE division, in two steps so that callers can keep the common
// case free of branches. e^-z is the hardware 2^x of -z * log2(e) (ex2.approx.ftz / v_exp_f32),
// the lowering of Triton's tl.exp that the Triton backend uses: scores lie a few 2^-22 from the
// true sigmoid (the argument's rounding, |z| * 2^-24 relative, and the 2^x's error, scaled by
// s (1 - s) <= 1/4), within 1e-6 of torch.sigmoid; selection, ties and the QB bins are exact given
// these scores (the contract), and every kernel of the module computes the same ones. The library
// expf (-DAMDQB_SIGMOID_APPROX_EXP=0, kept for comparisons) is a few ulp from the true value but
// costs ~6 more instructions per element: H200, graph replay, E=896 k=16 (bench/results/
// h200_2026-11-30_s7/call1/tune.md), router 57.9 vs 61.1 us at T=16384 and 17.0 vs 18.0 at 4096,
// QB two-kernel 93.2 vs 97.0 and 29.3 vs 30.1.
// On NVIDIA, ptxas expands the division into a fast path -- the hardware reciprocal and one
// Newton step, used when the divisor's exponent is in range -- and a CALL to a slow path; with one
// call per expert the scheduler cannot interleave the experts' arithmetic (28 call sites per token
// at E = 896). sigmoid_fast writes that fast path out: the same instructions, so the same bits, for
// every divisor d = 1 + e^-z in [1, 2^126) (the exponent range ptxas sends to its fast path
// includes it). sigmoid_fast_ok(d) says when it applies: false for d >= 2^126 (z below about
// -87.3) and NaN, where the division is used. -DAMDQB_SIGMOID_DIVISION_ONLY=1 turns the fast path
// off (the test that compares the two).
#ifndef AMDQB_SIGMOID_APPROX_EXP
#define AMDQB_SIGMOID_APPROX_EXP 1
#endif
AMDQB_DEVICE float sigmoid_divisor(float z) {
#if AMDQB_SIGMOID_APPROX_EXP
  return 1.0f + approx_exp2(z * -1.44269504088896341f);
#else
  return 1.0f + expf(-z);
#endif
}
AMDQB_DEVICE bool sigmoid_fast_ok(float d) {
#if defined(AMDQB_CUDA) && !defined(AMDQB_SIGMOID_DIVISION_ONLY)
  return d < 8.50705917e37f;  // 2^126
#else
  (void)d;
  return false;  // AMD and the emulator: the compiler's own division (no call to avoid)
#endif
}
AMDQB_DEVICE float sigmoid_fast(float d) {
#if defined(AMDQB_CUDA)
  const float r = approx_rcp(d);  // rcp.approx.ftz.f32
  return fmaf(r, -fmaf(d, r, -1.0f), r);
#else
  return 1.0f / d;
#endif
}

// Element-wise activation (sigmoid / sqrtsoftplus); the identity for softmax, whose row
// statistics are applied by scores_from_raw. The same function feeds the router and amdqb_qb_hist.
AMDQB_DEVICE float act_elementwise(float z) {
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
  const float d = sigmoid_divisor(z);
  return sigmoid_fast_ok(d) ? sigmoid_fast(d) : 1.0f / d;
#elif AMDQB_SCORE == AMDQB_SCORE_SQRTSOFTPLUS
  const float sp = z > 20.0f ? z : log1pf(expf(z));  // torch softplus, threshold 20
  return sqrtf(sp);
#else
  return z;
#endif
}

// floor(x) clamped to [0, num_bins - 1]; NaN -> bin 0. fmaxf returns the number when x is NaN
// (IEEE maxNum; x is an arithmetic result, never a signalling NaN), and clamping before the floor
// gives the same integer (both bounds are integers), so the floor and the conversion can be one
// instruction (sm_90: F2I.FLOOR; 3 instructions where the compare-and-select form took 8).
AMDQB_DEVICE int clamp_bin(float x, int num_bins) {
  return (int)floorf(fminf(fmaxf(x, 0.0f), (float)(num_bins - 1)));
}

// QB bin of a required bias r (TE's arithmetic: multiply by the fp32 scale, no reciprocal width).
AMDQB_DEVICE int qb_bin(float r, float lower, float scale, int num_bins) {
  return clamp_bin((r - lower) * scale, num_bins);
}

#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
// |sigmoid_approx(z) - act_elementwise(z)| <= kSigmoidApproxErr for every finite z: both lie within
// a few 2^-22 (absolute) of the true sigmoid -- the hardware 2^x's relative error, and that of
// rounding its argument z * log2(e) (|z| * 2^-24 relative, times s * (1 - s) <= e^-|z|), scaled by
// s * (1 - s) <= 1/4; the reciprocal's by s <= 1; flushed denormals below 2^-126 -- so 2^-19
// leaves a wide margin. The emulator's exp2 is nearly exact, so it simulates a larger error
// instead: a deterministic perturbation of up to 0.95 of a 2^-14 bound, far beyond the rounding
// slack, so that the CPU tests fail if the exactness check below ever trusts a bin it should not.
#if defined(AMDQB_EMU)
constexpr float kSigmoidApproxErr = 1.0f / 16384.0f;
#else
constexpr float kSigmoidApproxErr = 1.0f / 524288.0f;
#endif

AMDQB_DEVICE float sigmoid_approx(float z) {
  float s = approx_rcp(1.0f + approx_exp2(z * -1.44269504088896341f));
#if defined(AMDQB_EMU)
  const u32 h = float_bits(z) * 2654435761u;
  s += ((float)(h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 1.9f * kSigmoidApproxErr;
#endif
  return s;
}
#endif

// A token's QB cutoff with the per-token constants of the fused epilogue's bin fast path
// (computed once per token, used for its E experts).
struct QbCut {
  float alpha;   // the (k+1)-th biased score
  float pos0;    // (alpha - lower) * scale: the bin position of a zero score
  float margin;  // error bound of the fast bin position (NaN or inf: the fast path is off)
};

// x = pos0 - s * scale (one FMA) differs from the exact position fl(fl(fl(alpha - s_exact) - lower)
// * scale) by at most |scale| * kSigmoidApproxErr plus the roundings of both paths: 2^-24 times
// |scale| (|alpha - lower| + |alpha| + 1 + |alpha| + 1 + |lower|) + |pos0| + |x| + |x_exact|, with
// |x|, |x_exact| <= |pos0| + 2 |scale| (scores lie in [0, 1]). The margin takes 16 units of 2^-24
// on each term where 3 suffice, which also covers the roundings of the margin and of x +- margin.
AMDQB_DEVICE QbCut qb_cut(float alpha, float lower, float scale) {
  QbCut c;
  c.alpha = alpha;
  c.pos0 = (alpha - lower) * scale;
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
  constexpr float kSlack = 1.0f / 1048576.0f;  // 2^-20
  const float as = fabsf(scale);
  c.margin = as * (kSigmoidApproxErr + kSlack * (fabsf(alpha) + 1.0f + fabsf(lower))) +
             kSlack * (fabsf(c.pos0) + 2.0f * as);
#else
  c.margin = 0.0f;
#endif
  return c;
}

// Sigmoid fast path of the QB bin of the expert with logit z: true (and bin set) when no integer
// lies within the margin of the approximate position x, so that the exact position, within the
// margin of x, has the same floor; false -- the exact formula decides -- near a bin edge (about 2
// margins per bin, rare) and for any non-finite value (NaN compares unequal, so lo is a number
// where it is used; inf - inf is NaN). It spends one FMA and two hardware approximations per
// element instead of the IEEE exp and division.
AMDQB_DEVICE bool qb_bin_fast(const QbCut& c, float z, float scale, int num_bins, int& bin) {
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
  const float x = fmaf(-sigmoid_approx(z), scale, c.pos0);
  const float lo = floorf(x - c.margin);
  if (lo == floorf(x + c.margin)) {
    bin = clamp_bin(lo, num_bins);
    return true;
  }
#else
  (void)c, (void)z, (void)scale, (void)num_bins, (void)bin;
#endif
  return false;
}

// QB bin of the expert with logit z for the token cutoff c: bit for bit
// qb_bin(c.alpha - act_elementwise(z), lower, scale, num_bins).
AMDQB_DEVICE int qb_bin_of_logit(const QbCut& c, float z, float lower, float scale, int num_bins) {
  int bin;
  if (qb_bin_fast(c, z, scale, num_bins, bin)) return bin;
  return qb_bin(c.alpha - act_elementwise(z), lower, scale, num_bins);
}

AMDQB_DEVICE bool valid_slot(int j, int lane) { return j < VPL - 1 || j * 32 + lane < E; }

// The token's logits of expert j*32 + lane, every load issued before any arithmetic uses them.
// The order matters on NVIDIA: ptxas expands each IEEE division of the activation into a fast path
// plus a CALL to a slow path and never moves a load across a call, so loads interleaved with the
// activations wait a full DRAM round trip each (the H200 ncu profile of that form: 28 serial loads
// per token, half of all stall cycles). keep_loaded pins the batch.
AMDQB_DEVICE void load_row(const in_t* row, int lane, in_t (&raw)[VPL]) {
#pragma unroll
  for (int j = 0; j < VPL; ++j) raw[j] = valid_slot(j, lane) ? row[j * 32 + lane] : in_t(0);
#pragma unroll
  for (int j = 0; j < VPL; ++j) keep_loaded(raw[j]);
}

// Row statistics of the pre-softmax (max and sum of exp over the E logits); unused otherwise.
struct RowStats {
  float m = 0.0f;
  float sum = 1.0f;
};

// Element-wise activation of V loaded logits (valid(j) false: a padding slot, scored as logit 0):
// bit for bit act_elementwise. Sigmoid: every element through the branch-free fast path first,
// the rare divisors outside its range (z below about -87.3, NaN) redone with the division after.
template <int V, typename Valid>
AMDQB_DEVICE void activate(const in_t (&raw)[V], Valid valid, float (&s)[V]) {
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
  bool redo = false;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float d = sigmoid_divisor(valid(j) ? to_f32(raw[j]) : 0.0f);
    s[j] = sigmoid_fast(d);
    redo |= !sigmoid_fast_ok(d);
  }
  if (redo) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = sigmoid_divisor(valid(j) ? to_f32(raw[j]) : 0.0f);
      if (!sigmoid_fast_ok(d)) s[j] = 1.0f / d;
    }
  }
#else
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = act_elementwise(valid(j) ? to_f32(raw[j]) : 0.0f);
#endif
}

// Scores of one token from its loaded logits: s[j] of expert j*32 + lane (0 on padding). softmax:
// softmax over the E experts when softmax_pre (its statistics go to st), else the raw logits.
AMDQB_DEVICE void scores_from_raw(const in_t (&raw)[VPL], int lane, float (&s)[VPL],
                                  int softmax_pre, RowStats& st) {
  activate(raw, [&](int j) { return valid_slot(j, lane); }, s);
#if AMDQB_SCORE == AMDQB_SCORE_SOFTMAX
  if (softmax_pre) {
    float m = neg_inf();
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) m = fmaxf(m, s[j]);
    m = warp_max_f32(m);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) sum += expf(s[j] - m);
    sum = warp_sum_f32(sum);
#pragma unroll
    for (int j = 0; j < VPL; ++j) s[j] = valid_slot(j, lane) ? expf(s[j] - m) / sum : 0.0f;
    st.m = m;
    st.sum = sum;
  }
#else
  (void)softmax_pre;
  (void)st;
#endif
}

// The score of one expert from its logit: bit for bit the value scores_from_raw gives it.
AMDQB_DEVICE float score_of(in_t raw, int softmax_pre, const RowStats& st) {
  const float v = act_elementwise(to_f32(raw));
#if AMDQB_SCORE == AMDQB_SCORE_SOFTMAX
  if (softmax_pre) return expf(v - st.m) / st.sum;
#else
  (void)softmax_pre;
  (void)st;
#endif
  return v;
}

AMDQB_DEVICE bool at_or_ahead(i32 k, i32 id, i32 bk, i32 bid) {
  return k > bk || (k == bk && id <= bid);
}

// The bitonic merge (strides 16 .. 1) of one (key, id) pair per lane into selection order: the 32
// pairs must form a bitonic sequence (e.g. lanes 0-15 in order, lanes 16-31 in reverse order).
AMDQB_DEVICE void warp_merge_desc(i32& k, i32& id, int lane) {
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
}

// Bitonic sort of one (key, id) pair per lane, descending in the selection order: bitonic runs of
// 2 .. 16 lanes in alternating directions, then the final merge of all 32.
AMDQB_DEVICE void warp_sort_desc(i32& k, i32& id, int lane) {
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

// -DAMDQB_SELECT_BY_KEY=0 (benchmarks only): candidates by the full (key, id) order, as before
// session 6, instead of the key alone. H200 (bench/results/h200_2026-11-30_s6/call3, E=896, k=16,
// probs + byte map): 61.3 vs 65.2 us at T=16384, 18.1 vs 19.2 at T=4096.
#ifndef AMDQB_SELECT_BY_KEY
#define AMDQB_SELECT_BY_KEY 1
#endif

// Top-n of the token into b.skey/sid[0..n) in selection order (n <= CAP, n <= E).
// Candidates: every expert whose key is at least the key of (bk, bid), an entry at or behind the
// n-th in the selection order -- a superset of the Top-n (one compare per expert instead of the
// (key, id) order's three; extra candidates tied on bk rank >= n and are dropped). Only if they
// overflow CAP, the exact n-th is searched and the candidates are taken by the full order.
template <int V>
AMDQB_DEVICE void select_top(const i32 (&key)[V], int n, int lane, const WarpBuffers& b) {
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
    bk = shfl_i32(lk, n - 1);
    bid = shfl_i32(lid, n - 1);
  } else {
    exact_nth(key, n, lane, bk, bid);
  }
  // (bk, bid) by reference: the overflow path below moves them to the exact n-th
  const auto by_order = [&](i32 k, i32 id) { return at_or_ahead(k, id, bk, bid); };
#if AMDQB_SELECT_BY_KEY
  const auto first = [&](i32 k, i32) { return k >= bk; };
#else
  const auto first = by_order;
#endif
  int c = count_candidates(key, lane, first);
  int incl = warp_inclusive_sum_i32(c);
  int total = shfl_i32(incl, 31);
  if (total > CAP) {  // warp-uniform; rare for real router logits
    AMDQB_TRACE_OVERFLOW();
    exact_nth(key, n, lane, bk, bid);
    c = count_candidates(key, lane, by_order);
    incl = warp_inclusive_sum_i32(c);
    total = shfl_i32(incl, 31);  // == n
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

// Whether a router call writes outputs over every expert (dense probs, byte or bit map).
AMDQB_DEVICE bool has_dense_outputs(const in_t* probs, int map_kind) {
  return probs != nullptr || map_kind == kByteMap || map_kind == kBitMap;
}

// The outputs over every expert of token t from this thread's experts e = base(j) + lane
// (valid(j): e < E; base(j) a multiple of 32): probs zeroed for the non-members (members are
// written once per rank by write_route: one division per route, not per expert), the byte map,
// and the bit map from one ballot per 32 experts. Members: at or ahead of the k-th, (ck, cid).
template <int V, typename Base, typename Valid>
AMDQB_DEVICE void write_dense_outputs(const i32 (&key)[V], Base base, Valid valid, int lane,
                                      i64 t, i32 ck, i32 cid, in_t* probs, void* map,
                                      int map_kind) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = base(j) + lane;
    const bool member = valid(j) && at_or_ahead(key[j], e, ck, cid);
    if (valid(j) && !member && probs != nullptr) probs[t * E + e] = from_f32(0.0f);
    if (valid(j) && map_kind == kByteMap) static_cast<u8*>(map)[t * E + e] = member ? 1 : 0;
    if (map_kind == kBitMap) {
      const u32 bits = ballot32(member);  // bit l = expert base(j) + l
      const int byte = base(j) / 8 + lane;
      if (lane < 4 && byte < NBYTES)
        static_cast<u8*>(map)[t * NBYTES + byte] = (u8)((bits >> (8 * lane)) & 0xffu);
    }
  }
}

// Route r of token t (expert id, weight wr) into probs, the index map and the weight / id outputs.
AMDQB_DEVICE void write_route(i64 t, int topk, int r, i32 id, float wr, in_t* probs, void* map,
                              int map_kind, float* w_out, int* id_out) {
  const i64 o = t * topk + r;
  if (probs != nullptr) probs[t * E + id] = from_f32(wr);
  if (map_kind == kIdx16) static_cast<i16*>(map)[o] = (i16)id;
  if (map_kind == kIdx32) static_cast<i32*>(map)[o] = id;
  if (map_kind == kIdx64) static_cast<i64*>(map)[o] = (i64)id;
  if (w_out != nullptr) {
    w_out[o] = wr;
    id_out[o] = id;
  }
}

// Fused QB: one device atomic per (token, expert) into hist, the bin derived from the logit.
template <int V, typename Base, typename Valid>
AMDQB_DEVICE void add_fused_bins(const in_t (&raw)[V], Base base, Valid valid, int lane,
                                 const QbCut& cut, float lower, float scale, int num_bins,
                                 int* hist) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (valid(j)) {
      const int bin = qb_bin_of_logit(cut, to_f32(raw[j]), lower, scale, num_bins);
      atomic_add_global(&hist[(i64)(base(j) + lane) * num_bins + bin], 1);
    }
  }
}

}  // namespace

// -DAMDQB_ROUTER_STOP=k (benchmarks only, bench/tune_router_occupancy.py): amdqb_router skips
// every token's work after stage k (0 loads, 1 scores and keys, 2 selection, 3 cutoff and weights),
// writing one value that depends on the work so far -- the time of each stage, not a result.
#if defined(AMDQB_ROUTER_STOP)
#define AMDQB_ROUTER_STAGE(k, value)                                    \
  if (AMDQB_ROUTER_STOP == k) {                                         \
    if (lane == 0 && probs != nullptr) probs[t * E] = from_f32((float)(value)); \
    continue;                                                           \
  }
#else
#define AMDQB_ROUTER_STAGE(k, value)
#endif

// One logical warp per token, WARPS tokens per block, persistent grid-stride loop over tokens.
//   nsel = topk (+1 under QB); normalize: p = s / (sum_selected s + 1e-20); softmax_pre: scores are
//   the softmax over E (else, for AMDQB_SCORE softmax, the selected logits are softmax-ed);
//   probs (nullable) [T, E] in the logits dtype; map (nullable) per map_kind; hist/bounds for
//   qb_mode 1, alpha_out for qb_mode 2; w_out/id_out (nullable) [T, topk] fp32 / int32.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS_MIN(256, AMDQB_ROUTER_MIN_BLOCKS)
    amdqb_router(const in_t* logits, int num_tokens, const float* bias, int topk, int nsel,
                 int normalize, int softmax_pre, float scale, in_t* probs, void* map, int map_kind,
                 int qb_mode, int* hist, const float* bounds, int num_bins, float* alpha_out,
                 float* w_out, int* id_out) {
  AMDQB_SHARED(i32, sh_ckey, WARPS * CAP);
  AMDQB_SHARED(i32, sh_cid, WARPS * CAP);
  AMDQB_SHARED(i32, sh_skey, WARPS * CAP);
  AMDQB_SHARED(i32, sh_sid, WARPS * CAP);
  AMDQB_SHARED(float, sh_ss, WARPS * CAP);
  const int lane = lane_id();
  const int w = warp_in_block();
  const WarpBuffers b{sh_ckey + w * CAP, sh_cid + w * CAP, sh_skey + w * CAP, sh_sid + w * CAP,
                      sh_ss + w * CAP};
  const bool post_softmax = AMDQB_SCORE == AMDQB_SCORE_SOFTMAX && !softmax_pre;
  // The QB histogram pass that may follow is launched as a dependent: its blocks take the SMs
  // this persistent grid's blocks leave, and zero their LDS while the last tokens finish.
  allow_dependent_launch();

  float qb_lower = 0.0f, qb_scale = 0.0f;
  if (qb_mode == kQbFused) {
    qb_lower = bounds[0];
    qb_scale = (float)num_bins / (bounds[1] - qb_lower);
  }

  // The warp's first token is prefetched before the bias is staged in LDS, so that at decode
  // sizes (one token per warp) the two fetches overlap instead of costing two round trips; the
  // bias is then read from LDS by every token. (A prefetch, not a load into registers: a row
  // held across the loop would cost VPL registers.)
  AMDQB_SHARED(float, sh_bias, E);
  const i64 t_first = (i64)blockIdx.x * WARPS + w;
  if (t_first < num_tokens)
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) prefetch_l1(logits + t_first * E + j * 32 + lane);
  if (bias != nullptr)
    for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) sh_bias[e] = bias[e];
  block_sync();

  for (i64 t = t_first; t < num_tokens; t += (i64)gridDim.x * WARPS) {
    const in_t* row = logits + t * E;
    // Only the selection keys stay in registers through the selection (VPL registers rather than
    // 2 * VPL with the scores: the H200 profile found this kernel latency-bound at 25% occupancy,
    // limited by registers); the few selected experts' scores are recomputed below from their
    // logits, which the L1/L2 still hold, bit for bit as here.
    i32 key[VPL];
    RowStats st;
    {
      in_t raw[VPL];
      float s[VPL];
      load_row(row, lane, raw);
      AMDQB_ROUTER_STAGE(0, to_f32(raw[0]) + to_f32(raw[VPL - 1]))
      scores_from_raw(raw, lane, s, softmax_pre, st);
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        if (valid_slot(j, lane)) {
          const float u = bias != nullptr ? s[j] + sh_bias[j * 32 + lane] : s[j];
          key[j] = order_key(u);
        } else {
          key[j] = kInt32Min;  // padding: ids >= E rank below every expert
        }
      }
    }
    AMDQB_ROUTER_STAGE(1, key[0] + key[VPL - 1])
    select_top(key, nsel, lane, b);
    AMDQB_ROUTER_STAGE(2, b.sid[lane])
#pragma unroll
    for (int q = 0; q < CAP / 32; ++q) {
      const int r = lane + 32 * q;
      if (r < nsel) b.ss[r] = score_of(row[b.sid[r]], softmax_pre, st);
    }
    warp_sync();

    // Route cutoff (k-th element) and weights.
    const i32 ck = b.skey[topk - 1], cid = b.sid[topk - 1];
    float denom = 1.0f, zmax = 0.0f;
    if (post_softmax) {
      zmax = b.ss[0];
      denom = 0.0f;
      for (int r = 0; r < topk; ++r) denom += expf(b.ss[r] - zmax);
    } else if (normalize) {
      float sum = 0.0f;
      for (int r = 0; r < topk; ++r) sum += b.ss[r];
      denom = sum + 1e-20f;
    }
    auto weight = [&](float v) -> float {
      float p;
      if (post_softmax)
        p = expf(v - zmax) / denom;
      else
        p = normalize ? v / denom : v;
      return p * scale;
    };
    AMDQB_ROUTER_STAGE(3, denom + (float)ck)

    const auto base = [](int j) { return j * 32; };
    const auto valid = [&](int j) { return valid_slot(j, lane); };
    if (has_dense_outputs(probs, map_kind))
      write_dense_outputs(key, base, valid, lane, t, ck, cid, probs, map, map_kind);
#pragma unroll
    for (int q = 0; q < CAP / 32; ++q) {
      const int r = lane + 32 * q;
      if (r < topk)
        write_route(t, topk, r, b.sid[r], weight(b.ss[r]), probs, map, map_kind, w_out, id_out);
    }

    if (qb_mode != kQbNone) {
      const i32 aid = b.sid[topk];  // the (k+1)-th: the cutoff alpha
      const float alpha = bias != nullptr ? b.ss[topk] + sh_bias[aid] : b.ss[topk];
      if (qb_mode == kQbAlpha) {
        if (lane == 0) alpha_out[t] = alpha;
      } else {
        const QbCut cut = qb_cut(alpha, qb_lower, qb_scale);
        in_t raw[VPL];  // QB is sigmoid-only: the bin needs the logit alone
        load_row(row, lane, raw);
        add_fused_bins(raw, base, valid, lane, cut, qb_lower, qb_scale, num_bins, hist);
      }
    }
    warp_sync();  // the next token reuses this warp's buffers
  }
}

// Decode form of the router and of biased_topk (element-wise scores: sigmoid, sqrtsoftplus): one
// block of DEC_WARPS logical warps per token, so that the token's dependent chain (loads,
// activations, selection) is spread over the block instead of one warp -- at decode sizes that
// chain is the whole kernel time. Thread (w, lane) holds the DEC_EPT experts
// e = j * DEC_THREADS + w * 32 + lane, j < DEC_EPT.
//   1. each warp selects its own Top-n with select_top (its local ids j * 32 + lane are ordered as
//      the global ids, so the warp's selection order is the token's);
//   2. the warps' sorted lists are merged. n <= 32: a tree of bitonic merges, ceil(log2(warps))
//      rounds; in each, warp i takes lists 2i and 2i + 1, lane l keeping the better of A[l] and
//      B[31 - l] (the top half of their bitonic merge), and five compare-exchange stages sort
//      them (the H200 timing of the alternative below at n = 16, 7 warps: 2.4 us of the kernel's
//      5.3). n > 32: by rank, an entry's rank in the union being its position in its own list
//      plus, for every other list, the number of entries ahead of it there (a binary search).
//      (value, id) pairs are distinct, so both give the one selection order;
//   3. warp 0 writes the k routes (weights from the same scores and the same sequential sum as
//      amdqb_router, so both kernels give identical bits); the dense outputs and the fused QB
//      bins are written by every thread for its own experts.
#ifndef AMDQB_DECODE_EPW
#define AMDQB_DECODE_EPW 128  // experts per warp (_ops.DECODE_EPW, which says why)
#endif
// ceil(E / EPW) logical warps, rounded up to an even count (whole 64-lane waves on wave64), <= 8
constexpr int DEC_WARPS_RAW = (E + AMDQB_DECODE_EPW - 1) / AMDQB_DECODE_EPW;
constexpr int DEC_WARPS_EVEN = DEC_WARPS_RAW > 1 ? (DEC_WARPS_RAW + 1) / 2 * 2 : 1;
constexpr int DEC_WARPS = DEC_WARPS_EVEN < 8 ? DEC_WARPS_EVEN : 8;
constexpr int DEC_THREADS = 32 * DEC_WARPS;
constexpr int DEC_EPT = (E + DEC_THREADS - 1) / DEC_THREADS;  // experts per thread

namespace {
// Global id of warp w's local id j * 32 + lane.
AMDQB_DEVICE i32 global_id(int w, i32 lid) {
  return (lid >> 5) * DEC_THREADS + w * 32 + (lid & 31);
}

// Entries of warp w's sorted list (keys, local ids)[0, len) ahead of (k, id) in the selection
// order (id global).
AMDQB_DEVICE int count_ahead_sorted(const i32* keys, const i32* ids, int w, int len, i32 k,
                                   i32 id) {
  int lo = 0, hi = len;  // answer in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (ahead(keys[mid], global_id(w, ids[mid]), k, id))
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}
}  // namespace

// -DAMDQB_DECODE_STOP=k (benchmarks only, bench/tune_router_occupancy.py): the kernel returns after
// stage k (0 loads, 1 scores and keys, 2 per-warp selection, 3 merge), writing one value that
// depends on the work so far -- the time of each stage, not a result.
#if defined(AMDQB_DECODE_STOP)
#define AMDQB_DECODE_STAGE(k, value)                             \
  if (AMDQB_DECODE_STOP == k) {                                  \
    if (tid < nsel && id_out != nullptr) id_out[t * topk + (tid % topk)] = (int)(value); \
    return;                                                      \
  }
#else
#define AMDQB_DECODE_STAGE(k, value)
#endif

// The router in its decode form: amdqb_router's arguments and outputs (probs, every routing map,
// weights/ids, QB cutoff or fused histogram), bit for bit, for the element-wise scores (the op
// sends softmax to amdqb_router).
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(DEC_THREADS)
    amdqb_router_decode(const in_t* logits, int num_tokens, const float* bias, int topk, int nsel,
                        int normalize, int softmax_pre, float scale, in_t* probs, void* map,
                        int map_kind, int qb_mode, int* hist, const float* bounds, int num_bins,
                        float* alpha_out, float* w_out, int* id_out) {
  (void)softmax_pre;  // amdqb_router's signature; the op sends softmax scores to amdqb_router
  AMDQB_SHARED(i32, sh_ckey, DEC_WARPS * CAP);
  AMDQB_SHARED(i32, sh_cid, DEC_WARPS * CAP);
  AMDQB_SHARED(i32, sh_skey, DEC_WARPS * CAP);  // each warp's Top-n (local ids)
  AMDQB_SHARED(i32, sh_sid, DEC_WARPS * CAP);
  AMDQB_SHARED(float, sh_score, DEC_THREADS * DEC_EPT);  // scores by expert id
  AMDQB_SHARED(float, sh_biased, DEC_THREADS * DEC_EPT);  // score + bias by expert id
  AMDQB_SHARED(i32, sh_top, CAP);                        // the token's Top-n ids, in order
  const int lane = lane_id();
  const int w = warp_in_block();
  const int tid = (int)threadIdx.x;
  const i64 t = blockIdx.x;
  if (t >= num_tokens) return;  // uniform across the block
  const in_t* row = logits + t * E;
  auto valid = [&](int j) { return j * DEC_THREADS + tid < E; };

  in_t raw[DEC_EPT];
  float bv[DEC_EPT];
#pragma unroll
  for (int j = 0; j < DEC_EPT; ++j) {  // logits and bias: one batch of loads
    const int e = j * DEC_THREADS + tid;
    raw[j] = valid(j) ? row[e] : in_t(0);
    bv[j] = bias != nullptr && valid(j) ? bias[e] : 0.0f;
  }
  AMDQB_DECODE_STAGE(0, to_f32(raw[0]) + bv[0])
  float s[DEC_EPT];
  activate(raw, valid, s);
  i32 key[DEC_EPT];
#pragma unroll
  for (int j = 0; j < DEC_EPT; ++j) {
    const int e = j * DEC_THREADS + tid;
    const float biased = bias != nullptr ? s[j] + bv[j] : s[j];
    key[j] = valid(j) ? order_key(biased) : kInt32Min;
    if (valid(j)) {
      sh_score[e] = s[j];
      sh_biased[e] = biased;  // the cutoffs below read it instead of reloading the bias
    }
  }

  const WarpBuffers b{sh_ckey + w * CAP, sh_cid + w * CAP, sh_skey + w * CAP, sh_sid + w * CAP,
                      nullptr};
  AMDQB_DECODE_STAGE(1, key[0] + key[DEC_EPT - 1])
  select_top(key, nsel, lane, b);  // local ids; the merge maps them to global ids
  AMDQB_DECODE_STAGE(2, b.sid[lane])
  block_sync();

  // Only the outputs over every expert (dense probs / maps, the fused histogram) need the whole
  // block after the selection; otherwise warp 0 finishes alone (no barrier after the last round).
  const bool block_outputs = has_dense_outputs(probs, map_kind) || qb_mode == kQbFused;
  if (DEC_WARPS > 1 && nsel <= 32) {  // uniform
    // Merge tree. Lists live in (src_k, src_i) at stride CAP; round r writes (dst_k, dst_i), and
    // the two swap: the barrier opening each round orders the reads of one round before the
    // writes of the next. select_top's candidate buffers are free once every warp has passed the
    // first barrier. Missing entries are sentinels that rank after every expert. The last round
    // (warp 0 alone) writes the token's list straight to sh_top.
    i32 *src_k = sh_skey, *src_i = sh_sid, *dst_k = sh_ckey, *dst_i = sh_cid;
    for (int lists = DEC_WARPS, round = 0; lists > 1; lists = (lists + 1) >> 1, ++round) {
      if (round > 0) block_sync();
      if (w < (lists + 1) >> 1) {
        i32 ak = kInt32Min, ai = 0x7fffffff, bk = kInt32Min, bi = 0x7fffffff;
        const int la = 2 * w, lb = 2 * w + 1, rb = 31 - lane;
        if (lane < nsel) {
          ak = src_k[la * CAP + lane];
          ai = round == 0 ? global_id(la, src_i[la * CAP + lane]) : src_i[la * CAP + lane];
        }
        if (lb < lists && rb < nsel) {
          bk = src_k[lb * CAP + rb];
          bi = round == 0 ? global_id(lb, src_i[lb * CAP + rb]) : src_i[lb * CAP + rb];
        }
        if (ahead(bk, bi, ak, ai)) {
          ak = bk;
          ai = bi;
        }
        warp_merge_desc(ak, ai, lane);
        if (lists == 2) {
          if (lane < nsel) sh_top[lane] = ai;
        } else {
          dst_k[w * CAP + lane] = ak;
          dst_i[w * CAP + lane] = ai;
        }
      }
      i32* tk = src_k;
      i32* ti = src_i;
      src_k = dst_k, src_i = dst_i, dst_k = tk, dst_i = ti;
    }
    if (block_outputs)
      block_sync();
    else if (w == 0)
      warp_sync();
    else
      return;
  } else {
    if (DEC_WARPS == 1) {  // local ids are the global ids
      for (int r = tid; r < nsel; r += 32) sh_top[r] = sh_sid[r];
    } else {
      for (int c = tid; c < DEC_WARPS * nsel; c += DEC_THREADS) {
        const int v0 = c / nsel, r0 = c - v0 * nsel;
        const i32 k0 = sh_skey[v0 * CAP + r0], id0 = global_id(v0, sh_sid[v0 * CAP + r0]);
        int rank = r0;
#pragma unroll
        for (int v = 0; v < DEC_WARPS; ++v)
          if (v != v0)
            rank += count_ahead_sorted(sh_skey + v * CAP, sh_sid + v * CAP, v, nsel, k0, id0);
        if (rank < nsel) sh_top[rank] = id0;
      }
    }
    block_sync();
  }
  AMDQB_DECODE_STAGE(3, sh_top[tid % nsel])

  if (w == 0) {
    // Lane r % 32 holds the score of rank r (CAP / 32 registers); the normalisation sums them in
    // rank order, as amdqb_router does, through shuffles rather than a chain of LDS loads.
    i32 id[CAP / 32];
    float v[CAP / 32];
#pragma unroll
    for (int q = 0; q < CAP / 32; ++q) {
      const int r = lane + 32 * q;
      id[q] = r < topk ? sh_top[r] : 0;
      v[q] = r < topk ? sh_score[id[q]] : 0.0f;
    }
    float denom = 1.0f;
    if (normalize) {
      float sum = 0.0f;
#pragma unroll
      for (int q = 0; q < CAP / 32; ++q)
        for (int r = 32 * q; r < topk && r < 32 * q + 32; ++r) sum += shfl_f32(v[q], r - 32 * q);
      denom = sum + 1e-20f;
    }
#pragma unroll
    for (int q = 0; q < CAP / 32; ++q) {
      const int r = lane + 32 * q;
      if (r < topk)
        write_route(t, topk, r, id[q], (normalize ? v[q] / denom : v[q]) * scale, probs, map,
                    map_kind, w_out, id_out);
    }
  }

  // Dense outputs, each thread for its own experts (coalesced across the block). Membership is a
  // compare against the k-th selected's key, computed from the same biased score as the
  // selection's.
  const auto base = [&](int j) { return j * DEC_THREADS + w * 32; };
  if (has_dense_outputs(probs, map_kind)) {
    const i32 cid = sh_top[topk - 1];
    write_dense_outputs(key, base, valid, lane, t, order_key(sh_biased[cid]), cid, probs, map,
                        map_kind);
  }

  if (qb_mode != kQbNone) {
    const float alpha = sh_biased[sh_top[topk]];  // the (k+1)-th: the cutoff alpha
    if (qb_mode == kQbAlpha) {
      if (tid == 0) alpha_out[t] = alpha;
    } else {
      const float lower = bounds[0];
      const float qscale = (float)num_bins / (bounds[1] - lower);
      add_fused_bins(raw, base, valid, lane, qb_cut(alpha, lower, qscale), lower, qscale,
                     num_bins, hist);
    }
  }
}

// QB two-kernel histogram: grid (ceil(E / experts_per_block), token slices). Each block builds an
// LDS histogram [experts_per_block, B] of its (expert, token) slice from the recomputed scores and
// the router's cutoffs, then flushes the non-zero bins with global atomics. Threads map to
// (token, expert) with the expert fastest, so a warp reads runs of consecutive logits, and the
// blocks of one slice walk the same token rows at about the same time (neighbouring blocks read
// neighbouring 32-byte pieces of each row). Equal shares of the (group, token) plane per block,
// which would keep all 132 SMs of an H200 busy at E = 896 instead of 112, measured slower: 14.1 /
// 26.6 / 52.0 / 100.8 against 12.8 / 25.8 / 49.6 / 89.8 us for QB two-kernel at T = 1024 / 4096 /
// 8192 / 16384 (bench/results/h200_2026-11-30_s7/call{2,3}): blocks starting mid-group read
// their pieces of a row at different times, and shares spanning two groups flush twice.
// Tokens are walked last to first (AMDQB_QB_HIST_REVERSE): the router before this pass ends on the
// last tokens, whose logits the L2 cache may still hold when the logits exceed it. H200, QB
// two-kernel at T = 1024 / 4096 / 16384: 11.8 / 24.2 / 85.4 us, first to last 11.7 / 24.4 / 89.1
// (bench/results/h200_2026-11-30_s7/call4/tune.md).
// Bins here come from the exact formula: the approximate-sigmoid fast path of the fused epilogue
// (qb_bin_fast) needs per-token constants, and loading them (8 or 16 bytes per element instead of
// the 4-byte cutoff) made this pass slower on the H200 (ncu at T=16384, E=896: 47 us with the
// cutoff alone, 58 us with the 16-byte cut), while the sigmoid is branch-free here either way.
// Grouping the fused epilogue's bins 8 at a time was slower (13.6 vs 12.6 us at T=256).
// Dynamic shared memory: experts_per_block * num_bins ints. Block size: a multiple of
// experts_per_block up to AMDQB_QB_HIST_MAX_BLOCK (_ops.QB_HIST_BLOCK; the tuner builds larger).
#ifndef AMDQB_QB_HIST_MAX_BLOCK
#define AMDQB_QB_HIST_MAX_BLOCK 1024
#endif
// vec = 4: each thread takes 4 consecutive experts of a token with one vector load (the host
// passes it when E and experts_per_block are multiples of 4 and the logits 4-element aligned), so
// the loads, the cutoff load and the address arithmetic are shared by 4 elements; vec = 1: one.
namespace {
struct alignas(4 * sizeof(in_t)) in_x4 {
  in_t v[4];
};
template <int VEC>
struct HistLoad {
  typedef in_t type;
};
template <>
struct HistLoad<4> {
  typedef in_x4 type;
};
AMDQB_DEVICE in_t hist_raw(in_t q, int) { return q; }
AMDQB_DEVICE in_t hist_raw(const in_x4& q, int v) { return q.v[v]; }
AMDQB_DEVICE float hist_element(in_t q, int) { return to_f32(q); }
AMDQB_DEVICE float hist_element(const in_x4& q, int v) { return to_f32(q.v[v]); }
// The scores of one step go through activate: every element's fast sigmoid first, the rare
// divisions after, so no slow-path CALL sits between two elements' arithmetic. H200, T=16384:
// 96.7 vs 99.9 us for QB two-kernel end to end with one act_elementwise per element
// (-DAMDQB_QB_HIST_TWO_PHASE=0, benchmarks only; bench/results/h200_2026-11-30_s6/call3). The
// scalar form (8 elements per step) keeps one act_elementwise per element: there the same change
// had measured slower (122 vs 111 us, bench/results/h200_2026-11-29_s5/call10).
#ifndef AMDQB_QB_HIST_TWO_PHASE
#define AMDQB_QB_HIST_TWO_PHASE 1
#endif

template <int VEC, int UNROLL>
AMDQB_DEVICE void qb_hist_slice(const in_t* logits, const float* alpha, int count, int step,
                                int* lh, float lower, float scale, int num_bins) {
  // count tokens of this thread, step rows apart (negative: downwards); logits and alpha point at
  // the first one. The pointers advance by a precomputed stride (a 64-bit index recomputed per
  // load cost more instructions than the element's arithmetic on sm_90).
  // UNROLL tokens per step: their logit and cutoff loads are issued back to back before any LDS
  // atomic, so each thread keeps that many global loads in flight (one at a time left the kernel
  // latency-bound: ncu on the H200 showed 14% DRAM throughput, 67% of cycles with no eligible
  // warp). The per-element arithmetic is unchanged, and counts do not depend on order.
  typedef typename HistLoad<VEC>::type load_t;
  const i64 row_step = (i64)step * E;
  for (; count >= UNROLL; count -= UNROLL) {
    load_t z[UNROLL];
    float a[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      z[u] = *reinterpret_cast<const load_t*>(logits + u * row_step);
      a[u] = alpha[u * step];
    }
    logits += UNROLL * row_step;
    alpha += UNROLL * step;
    if (AMDQB_QB_HIST_TWO_PHASE && VEC == 4) {  // compile-time
      in_t flat[UNROLL * VEC];
      float sc[UNROLL * VEC];
#pragma unroll
      for (int i = 0; i < UNROLL * VEC; ++i) flat[i] = hist_raw(z[i / VEC], i % VEC);
      activate(flat, [](int) { return true; }, sc);
#pragma unroll
      for (int i = 0; i < UNROLL * VEC; ++i) {
        const int bin = qb_bin(a[i / VEC] - sc[i], lower, scale, num_bins);
        atomic_add_shared(&lh[(i % VEC) * num_bins + bin], 1);
      }
    } else {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float sv = act_elementwise(hist_element(z[u], v));
          atomic_add_shared(&lh[v * num_bins + qb_bin(a[u] - sv, lower, scale, num_bins)], 1);
        }
    }
  }
  for (; count > 0; --count, logits += row_step, alpha += step) {
    const load_t z = *reinterpret_cast<const load_t*>(logits);
    const float a = *alpha;
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      atomic_add_shared(&lh[v * num_bins + qb_bin(a - act_elementwise(hist_element(z, v)), lower,
                                                    scale, num_bins)],
                        1);
  }
}
}  // namespace

// Tokens per step of the vector form (4 experts each), and the resident blocks per SM the
// compiler must allow (NVIDIA). H200, QB two-kernel end to end (E=896, 1024 threads, 8 experts
// per block): one block per SM (64 registers, no spill) against two (32 registers, spills) at
// T = 1024 / 4096 / 8192 / 16384: 12.8 / 25.8 / 49.6 / 89.8 vs 13.2 / 26.9 / 51.3 / 93.1 us with
// one expert group per block (bench/results/h200_2026-11-30_s7/call2/tune.md); 4 tokens per step
// 12.9 / 26.5 / 51.2 / 91.0. As committed (dependent launch, reverse walk; call4): 11.7 / 24.0 /
// 48.3 / 85.2 vs 14.2 / 32.1 / 57.9 / 105.1 with two blocks per SM. Earlier (s6/call4, 2 blocks,
// T=4096 / 16384): 2 tokens 30.7 / 96.8, 8 tokens 34.5 / 114.0.
#ifndef AMDQB_QB_HIST_UNROLL
#define AMDQB_QB_HIST_UNROLL 2
#endif
#ifndef AMDQB_QB_HIST_MIN_BLOCKS
#define AMDQB_QB_HIST_MIN_BLOCKS 1
#endif
#ifndef AMDQB_QB_HIST_REVERSE
#define AMDQB_QB_HIST_REVERSE 1
#endif
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS_MIN(AMDQB_QB_HIST_MAX_BLOCK, AMDQB_QB_HIST_MIN_BLOCKS)
    amdqb_qb_hist(const in_t* logits, int num_tokens, const float* alpha, const float* bounds,
                  int num_bins, int experts_per_block, int tokens_per_slice, int vec, int* hist) {
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID  // QB is sigmoid-only (the op refuses other scores)
  AMDQB_DYN_SHARED(lh);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int epb = experts_per_block;
  const int e0 = (int)blockIdx.x * epb;
  const int ne = E - e0 < epb ? E - e0 : epb;
  const i64 t0 = (i64)blockIdx.y * tokens_per_slice;
  const i64 t1 = t0 + tokens_per_slice < num_tokens ? t0 + tokens_per_slice : (i64)num_tokens;

  for (int i = tid; i < epb * num_bins; i += nt) lh[i] = 0;
  block_sync();

  const float lower = bounds[0];
  const float scale = (float)num_bins / (bounds[1] - lower);
  const int per_row = epb / vec;  // threads per token row
  const int sub = tid % per_row;
  const int rows_per_pass = nt / per_row;
  const int tt = tid / per_row;
  // Launched as the router's dependent (NVIDIA): the zeroing above overlaps the router's tail; the
  // cutoffs are the router's output. (The bounds and logits come from earlier kernels.) H200, QB
  // two-kernel at T = 1024 / 4096 / 16384: 11.8 / 24.2 / 85.4 us, as an ordinary launch 12.7 /
  // 25.0 / 85.5 (bench/results/h200_2026-11-30_s7/call4/tune.md).
  wait_for_prior_grid();
  if (tt < rows_per_pass && sub * vec < ne && t0 + tt < t1) {
    const int count = (int)((t1 - t0 - tt - 1) / rows_per_pass) + 1;  // this thread's tokens
    // first token and stride of the walk: t0 + tt upwards, or its last token downwards
    const i64 t = AMDQB_QB_HIST_REVERSE ? t0 + tt + (i64)(count - 1) * rows_per_pass : t0 + tt;
    const int step = AMDQB_QB_HIST_REVERSE ? -rows_per_pass : rows_per_pass;
    int* h = lh + sub * vec * num_bins;
    const in_t* first = logits + t * E + e0 + sub * vec;
    if (vec == 4)  // uniform
      qb_hist_slice<4, AMDQB_QB_HIST_UNROLL>(first, alpha + t, count, step, h, lower, scale,
                                             num_bins);
    else
      qb_hist_slice<1, 8>(first, alpha + t, count, step, h, lower, scale, num_bins);
  }
  block_sync();

  // Non-zero bins only, each with one global atomic. A plain read-modify-write by the sole owner
  // of a bin (one token slice) measured slower on the H200 (T=1024 / 16384: 15.5 / 98.9 vs 14.3 /
  // 96.0 us, bench/results/h200_2026-11-30_s7/call1/tune.md): an atomic add returns nothing to wait
  // for, a read-modify-write waits for its load. Starting the LDS rows from the global counts
  // (loaded during the router's tail) and storing every bin back plainly was slower still: 12.86 /
  // 26.34 / 85.90 vs 11.71 / 24.96 / 85.42 us at T = 1024 / 4096 / 16384
  // (bench/results/h200_2026-11-30_s8/call6/tune.md).
  int* block_hist = hist + (i64)e0 * num_bins;  // rows e0 .. e0 + ne - 1 are contiguous
  for (int i = tid; i < ne * num_bins; i += nt) {
    const int c = lh[i];
    if (c != 0) atomic_add_global(block_hist + i, c);
  }
#else
  (void)logits, (void)num_tokens, (void)alpha, (void)bounds, (void)num_bins;
  (void)experts_per_block, (void)tokens_per_slice, (void)vec, (void)hist;
#endif
}

// fp32 scores exactly as amdqb_router computes them (softmax: over E), for tests and the oracle
// comparison. One logical warp per token.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(256)
    amdqb_scores(const in_t* logits, int num_tokens, float* out) {
  const int lane = lane_id();
  for (i64 t = (i64)blockIdx.x * WARPS + warp_in_block(); t < num_tokens;
       t += (i64)gridDim.x * WARPS) {
    float s[VPL];
    in_t raw[VPL];
    RowStats st;
    load_row(logits + t * E, lane, raw);
    scores_from_raw(raw, lane, s, 1, st);
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) out[t * E + j * 32 + lane] = s[j];
  }
}
