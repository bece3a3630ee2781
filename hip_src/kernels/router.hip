// Fused score function + exact Top-k router with opt-in Quantile Balancing (QB) histogram, and the
// serving form (biased_topk): one token per row of 32 lanes (a logical warp), or on wave64 AMD of
// 64 (the whole wave).
//
// Compile-time constants (-D, amdqb.backends.hip._spec.router_module, from amdqb/configs):
//   AMDQB_NUM_EXPERTS (E), AMDQB_IN_DTYPE (0 fp32, 1 fp16, 2 bf16), AMDQB_SCORE (0 sigmoid,
//   1 sqrtsoftplus, 2 softmax), AMDQB_APPROX_ACTIVATION (0 exact), AMDQB_TIE_FREE (1: rank
//   sigmoid scores by b - sigmoid(-z) instead of s + b), AMDQB_MARGIN_LDS (1: amdqb_router
//   counts the fused log_margin histogram in LDS, qb_mode kQbMarginLds), AMDQB_MOMENTS (1: the
//   log_margin histogram is int64 [3, E, B] with the in-bin moments), AMDQB_ROUTER_WARPS
//   (tokens in flight per block), AMDQB_ROUTER_CAP (candidate buffer, the largest Top-n),
//   AMDQB_ROUTER_MIN_BLOCKS (NVIDIA register cap), AMDQB_DECODE_EPW (experts per warp of the
//   decode kernel), AMDQB_QB_HIST_BLOCK / _UNROLL / _MIN_BLOCKS (the histogram pass), and
//   AMDQB_WAVE_SIZE, AMDQB_PREFILTER (1: amdqb_router selects through the bounded approximate
//   sigmoid first and computes the exact scores of the candidates only; sigmoid without the
//   tie-free order or log_margin QB, E <= 32 * RW; the same outputs, bit for bit).
//
// Precision contract (amdqb.ref.router): logits are converted to fp32 on load; activation, biased
// scores, selection, normalisation, the QB cutoff and the histogram arithmetic are fp32 without
// contraction; the activations are torch's bits (amdqb_activation.h); probs are written in the
// logits dtype (round to nearest even). Sums over the k routes (routes_sum) and the pre-softmax
// row sum run in a fixed order: lane l of a logical warp sums its entries l, l + 32, ... in order,
// then a butterfly over lane distances 16, 8, 4, 2, 1 -- torch's warp softmax (E <= 1024) and TE's
// warp reductions.
//
// Selection contract (amdqb.ref.ordering): experts are ranked by (value descending, id ascending)
// through a monotone int32 key (-0.0 == +0.0, NaN below -inf); padding lanes (id >= E) rank below
// every expert. Each lane of a row of RW lanes holds VPL = ceil(E/RW) experts in registers (RW =
// 32: id = j*32 + lane; RW = 64: each 32-lane half holds a contiguous half of the ids in that
// layout, so logical lane l's entries l, l + 32, ... are lane l's, then lane 32 + l's) and the
// Top-n (n = k, or k + 1 under QB) comes from select_top (amdqb_select.h); membership of every
// expert is a local compare against the k-th element.
// QB: Top-(k+1) of the selection values (u = s + b, or v = b - c with AMDQB_TIE_FREE), alpha =
// the (k+1)-th value, the first k are routed. Uniform binning, for every expert: r = alpha - s_j,
// scale = fp32(B) / (U - L), bin = clamp(floor((r - L) * scale), 0, B - 1) in fp32 (NaN -> 0);
// the fused mode adds 1 to hist[j * B + bin] with a device atomic in the epilogue (bins through
// qb_bin_of_logit, bit for bit the exact formula), the two-kernel mode writes alpha and
// amdqb_qb_hist recomputes the bins from the logits. log_margin binning: the router bins the
// margin d = alpha - value_j of every expert from its key on the expert's own axis (margin_bin_at;
// bounds holds the inverse scales [E]); the fused mode adds them up with atomics (amdqb_router:
// the bins at or above the cutoff's in 8-bit LDS counters, kQbMarginLds), the two-kernel mode
// stores them as bytes [T, E] for amdqb_qb_hist_bins. All modes give identical histograms. The
// AMDQB_MOMENTS build counts into the int64 plane 0 of a [3, E, B] histogram and adds each
// fine-key pair's in-bin position u and u * u to planes 1 and 2 (amdqb.ref.router.
// qb_histogram_counts): the fused modes with 64-bit device atomics, the two-kernel mode through a
// byte of each position beside the bins, summed by amdqb_qb_hist_bins in LDS.
// (QB is sigmoid-only at the op level.)
#include "amdqb_prelude.h"
#include "amdqb_activation.h"
#include "amdqb_qb_bins.h"
#include "amdqb_router_params.h"
#include "amdqb_select.h"

using namespace amdqb;

#if !defined(AMDQB_NUM_EXPERTS) || !defined(AMDQB_IN_DTYPE) || !defined(AMDQB_SCORE) ||            \
    !defined(AMDQB_TIE_FREE) || !defined(AMDQB_MARGIN_LDS) || !defined(AMDQB_MOMENTS) ||           \
    !defined(AMDQB_ROUTER_WARPS) || !defined(AMDQB_ROUTER_CAP) ||                                  \
    !defined(AMDQB_ROUTER_MIN_BLOCKS) || !defined(AMDQB_DECODE_EPW) ||                             \
    !defined(AMDQB_QB_HIST_BLOCK) || !defined(AMDQB_QB_HIST_UNROLL) ||                             \
    !defined(AMDQB_QB_HIST_MIN_BLOCKS) || !defined(AMDQB_PREFILTER)
#error "router.hip needs its -D constants (amdqb.backends.hip._spec.router_module)"
#endif
#if AMDQB_ROUTER_CAP % 32 != 0 || AMDQB_ROUTER_WARPS * 32 > 1024
#error "AMDQB_ROUTER_CAP must be a multiple of 32 and AMDQB_ROUTER_WARPS at most 32"
#endif

#define AMDQB_SCORE_SIGMOID 0
#define AMDQB_SCORE_SQRTSOFTPLUS 1
#define AMDQB_SCORE_SOFTMAX 2
#if AMDQB_PREFILTER && (AMDQB_SCORE != AMDQB_SCORE_SIGMOID || AMDQB_TIE_FREE ||                    \
                        AMDQB_MARGIN_LDS || AMDQB_APPROX_ACTIVATION)
#error "AMDQB_PREFILTER is the exact sigmoid router's build (no tie-free order, margin LDS, approx)"
#endif

namespace {

constexpr int E = AMDQB_NUM_EXPERTS;
// Lanes per token row of amdqb_router / amdqb_router_scores: a whole wave on wave64 AMD (half the
// experts per lane of a 32-lane row: the E=896 router's selection state fits 4 waves per SIMD),
// else a 32-lane logical warp (amdqb.backends.hip.router.row_lanes says the same).
#if defined(AMDQB_AMDGCN) && AMDQB_WAVE_SIZE == 64
#define AMDQB_ROW64 1
constexpr int RW = 64;
#else
#define AMDQB_ROW64 0
constexpr int RW = 32;
#endif
typedef Warp<RW> RowWarp;
constexpr int VPL = (E + RW - 1) / RW;     // experts per lane
constexpr int NBYTES = (E + 7) / 8;        // bitmap bytes per token
constexpr int WARPS = AMDQB_ROUTER_WARPS;  // logical warps per block
constexpr int ROUTER_BLOCK = 32 * WARPS;
constexpr int ROWS = ROUTER_BLOCK / RW;  // tokens in flight per block
constexpr int CAP = AMDQB_ROUTER_CAP;    // candidate buffer per row; the largest n
static_assert(ROUTER_BLOCK % RW == 0, "whole rows per block");
static_assert(!AMDQB_PREFILTER || VPL <= 32, "the prefilter's members are one word of slot bits");

enum MapKind { kMapNone = 0, kByteMap = 1, kBitMap = 2, kIdx16 = 3, kIdx32 = 4, kIdx64 = 5 };
// two-kernel: alpha (or the bins); kQbMarginLds: log_margin counted in LDS (amdqb_router only)
enum QbMode { kQbNone = 0, kQbFused = 1, kQbAlpha = 2, kQbMarginLds = 3 };
enum QbBinning { kUniform = 0, kLogMargin = 1 };

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

// Element-wise activation (sigmoid / sqrtsoftplus); the identity for softmax, whose row
// statistics are applied by scores_from_raw. The same function feeds the router and amdqb_qb_hist.
AMDQB_DEVICE float act_elementwise(float z) {
#if AMDQB_SCORE == AMDQB_SCORE_SIGMOID
  return sigmoid(z);
#elif AMDQB_SCORE == AMDQB_SCORE_SQRTSOFTPLUS
  return sqrtsoftplus(z);
#else
  return z;
#endif
}

// Sum over the k routes of value(r), r the rank: lane l adds ranks l, l + 32, ... in order, then a
// butterfly over the lanes (warp_sum_f32) -- torch's softmax order over k <= 32 entries and TE's
// warp reduction. Every lane of the warp calls it and gets the same sum.
template <typename Value>
AMDQB_DEVICE float routes_sum(int topk, int lane, Value value) {
  float v = 0.0f;
  for (int r = lane; r < topk; r += 32) v = r == lane ? value(r) : v + value(r);
  return warp_sum_f32(v);
}

// Lane p of a row (0 .. RW - 1) and the row in the block.
AMDQB_DEVICE int row_lane() { return RW == 64 ? RowWarp::lane() : lane_id(); }
// AMD, rows of a whole wave (64 lanes on wave64, 32 on wave32): the row index is read as a scalar,
// so that the token, its row pointer and the loop over tokens are scalar too.
AMDQB_DEVICE int row_in_block() {
#if defined(AMDQB_AMDGCN) && !defined(AMDQB_EMU)
  if (RW == AMDQB_WAVE_SIZE) return __builtin_amdgcn_readfirstlane((int)threadIdx.x / RW);
#endif
  return RW == 64 ? RowWarp::index() : warp_in_block();
}

// Slot j of row lane p holds expert slot_id(j, p) (amdqb_select.h's layout: each 32-lane half of a
// 64-lane row a contiguous half of the experts); slot_base(j, p) = slot_id(j, p) - (p & 31).
AMDQB_DEVICE int slot_id(int j, int p) { return row_id<RW, VPL>(j, p); }
AMDQB_DEVICE int slot_base(int j, int p) {
  return RW == 64 ? (p >> 5) * (32 * VPL) + j * 32 : j * 32;
}
// (Row-uniform where the compiler can tell: every slot j below the last full one is valid.)
AMDQB_DEVICE bool valid_slot(int j, int p) {
  if (RW == 64) return (RW == 64 && 32 * VPL + (j + 1) * 32 <= E) || slot_id(j, p) < E;
  return j < VPL - 1 || j * 32 + p < E;
}

// The token's logits of expert j*32 + lane, every load issued before any arithmetic uses them.
// The order matters on NVIDIA: ptxas expands each IEEE division of the activation into a fast path
// plus a CALL to a slow path and never moves a load across a call, so loads interleaved with the
// activations wait a full DRAM round trip each (the H200 ncu profile of that form: 28 serial loads
// per token, half of all stall cycles). keep_loaded pins the batch.
AMDQB_DEVICE void load_row(const in_t* row, int lane, in_t (&raw)[VPL]) {
#pragma unroll
  for (int j = 0; j < VPL; ++j) raw[j] = valid_slot(j, lane) ? row[slot_id(j, lane)] : in_t(0);
#pragma unroll
  for (int j = 0; j < VPL; ++j) keep_loaded(raw[j]);
}

// Slots loaded and activated together by amdqb_router / amdqb_router_scores: all of a lane's (the
// batch above), except on AMD rows of many slots -- more than 32: 32 at a time; 17 to 32 on a
// wave64 row: 16 -- so that only one chunk's logits and scores are live beside the row's keys
// (all at once, E=4096 on wave32 (128 slots) left 64 B of scratch and 15 VGPR spills on gfx1100;
// E=2048 on wave64 (32 slots) took 143 VGPRs, 3 waves, on gfx942, in chunks of 16 108, 4 waves).
// E=896 is one chunk on every target.
#if defined(AMDQB_AMDGCN)
constexpr int CHUNK = VPL > 32 ? 32 : RW == 64 && VPL > 16 ? 16 : VPL;
#else
constexpr int CHUNK = VPL;
#endif
constexpr int NCHUNK = (VPL + CHUNK - 1) / CHUNK;

// The end of a chunk, its results r computed: on AMD (rows of several chunks) an empty asm on each
// and a point the backend's scheduler moves nothing across, so that neither the next chunk's loads
// are hoisted above this chunk's arithmetic nor this arithmetic sunk below them (the tie-free
// sigmoid, a chunk without branches, otherwise held every chunk's logits at once: 84 B of scratch
// at E=4096 on gfx1100).
template <int C>
AMDQB_DEVICE void chunk_done(float (&r)[C]) {
#if defined(AMDQB_HIP)
  if constexpr (NCHUNK > 1) {
#pragma unroll
    for (int i = 0; i < C; ++i) asm volatile("" : "+v"(r[i]));
    __builtin_amdgcn_sched_barrier(0);
  }
#else
  (void)r;
#endif
}
AMDQB_DEVICE void chunk_done() {
#if defined(AMDQB_HIP)
  if constexpr (NCHUNK > 1) __builtin_amdgcn_sched_barrier(0);
#endif
}

// The lane index as chunk c's loads read it: on AMD, rows of several chunks, taken anew (opaque_lane)
// so that the chunk's global and LDS loads are not hoisted or merged into an earlier chunk.
AMDQB_DEVICE int chunk_lane(int lane) { return NCHUNK > 1 ? opaque_lane(lane) : lane; }

// f(ChunkIndex<c>()) for c = 0 .. NCHUNK - 1 in order: the chunk index a constant in the body
// (a loop over the chunks of heavy activations is not always unrolled, and a slot index that is
// not a constant puts the row's arrays in scratch: 528 B at E=4096 sqrtsoftplus with clang-19).
template <int I>
struct ChunkIndex {
  static constexpr int value = I;
};
template <int I = 0, typename F>
AMDQB_DEVICE void for_chunks(F f) {
  if constexpr (I < NCHUNK) {
    f(ChunkIndex<I>());
    for_chunks<I + 1>(f);
  }
}
// The parameter type of those bodies: generic on AMD; elsewhere the one chunk's (NVRTC takes a
// generic lambda in device code for a host function, and NVIDIA rows are one chunk).
#if defined(AMDQB_AMDGCN)
#define AMDQB_CHUNK auto
#else
#define AMDQB_CHUNK ChunkIndex<0>
static_assert(NCHUNK == 1, "rows of several chunks are AMD's");
#endif

// Slot j0 + i of the row in raw[i] (slots past VPL: padding), loads issued before any use.
AMDQB_DEVICE bool valid_chunk_slot(int j, int lane) { return j < VPL && valid_slot(j, lane); }
AMDQB_DEVICE void load_chunk(const in_t* row, int lane, int j0, in_t (&raw)[CHUNK]) {
#pragma unroll
  for (int i = 0; i < CHUNK; ++i)
    raw[i] = valid_chunk_slot(j0 + i, lane) ? row[slot_id(j0 + i, lane)] : in_t(0);
#pragma unroll
  for (int i = 0; i < CHUNK; ++i) keep_loaded(raw[i]);
}

// Row statistics of the pre-softmax (max and sum of exp over the E logits); unused otherwise.
struct RowStats {
  float m = 0.0f;
  float sum = 1.0f;
};

// Element-wise activation of V loaded logits (valid(j) false: a padding slot, scored as logit 0):
// bit for bit act_elementwise. Sigmoid: every element through the branch-free fast path first,
// the rare divisors outside its range (z below about -87.3, NaN) redone with the division after,
// so no slow-path CALL sits between two elements' arithmetic.
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

// The tie-free selection values of V loaded logits with their biases (bias(j)): s[j] the sigmoid
// (bit for bit act_elementwise) and v[j] = bias(j) - c, c = sigmoid(-z) from the sigmoid's own
// e = e^-z: e * s for z >= 0 (relative precision kept as s saturates), 1 - s below
// (amdqb.ref.router.sigmoid_complement). Padding slots score as logit 0.
template <int V, typename Valid, typename Bias>
AMDQB_DEVICE void activate_tie_free(const in_t (&raw)[V], Valid valid, Bias bias, float (&s)[V],
                                    float (&v)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float z = valid(j) ? to_f32(raw[j]) : 0.0f;
#if AMDQB_APPROX_ACTIVATION
    const float e = approx_exp2(z * -kLog2e);
#else
    const float e = expf(-z);
#endif
    const float d = 1.0f + e;
    s[j] = sigmoid_fast_ok(d) ? sigmoid_fast(d) : 1.0f / d;
    v[j] = bias(j) - (z >= 0.0f ? e * s[j] : 1.0f - s[j]);
  }
}

// Slots c * CHUNK .. of s taken as computed at this point, and the scheduling barrier of
// chunk_done (AMD rows of several chunks; nothing otherwise): a loop over s chunk by chunk
// with this at each chunk's start and end keeps one chunk's arithmetic in flight.
AMDQB_DEVICE void chunk_pin(float (&s)[VPL], int c) {
#if defined(AMDQB_HIP)
  if constexpr (NCHUNK > 1) {
#pragma unroll
    for (int i = 0; i < CHUNK; ++i)
      if (c * CHUNK + i < VPL) asm volatile("" : "+v"(s[c * CHUNK + i]));
    __builtin_amdgcn_sched_barrier(0);
  }
#else
  (void)s;
  (void)c;
#endif
}
AMDQB_DEVICE void chunk_pin(float& x) {
#if defined(AMDQB_HIP)
  if constexpr (NCHUNK > 1) {
    asm volatile("" : "+v"(x));
    __builtin_amdgcn_sched_barrier(0);
  }
#else
  (void)x;
#endif
}

// The softmax over E of the activated logits s when softmax_pre (its statistics go to st);
// nothing otherwise. xfer: 32 floats of LDS for the row (64-lane rows: the lower half's running
// sums). The loops over the slots run CHUNK slots at a time (chunk_pin).
AMDQB_DEVICE void softmax_scores(float (&s)[VPL], int lane, int softmax_pre, RowStats& st,
                                 float* xfer) {
#if AMDQB_SCORE == AMDQB_SCORE_SOFTMAX
  if (softmax_pre) {
    float m = neg_inf();
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) m = fmaxf(m, s[j]);
    m = RowWarp::max_f32(m);  // order-free: expf(x - m) is the same for m = +0.0 and -0.0
#if AMDQB_ROW64
    // Logical lane l's entries l, l + 32, ... are lane l's, then lane 32 + l's (the upper half
    // holds the later ids): the upper lane continues the lower lane's running sum, handed over
    // through LDS; the upper half's butterfly gives the row's sum.
    for_chunks([&](AMDQB_CHUNK ch) {
      constexpr int c = decltype(ch)::value;
      chunk_pin(s, c);
#pragma unroll
      for (int j = c * CHUNK; j < (c + 1) * CHUNK && j < VPL; ++j) s[j] = expf(s[j] - m);
      chunk_pin(s, c);
    });
    float sum = 0.0f;
    if (lane < 32) {
#pragma unroll
      for (int j = 0; j < VPL; ++j)
        if (valid_slot(j, lane)) sum += s[j];
      xfer[lane] = sum;
    }
    RowWarp::sync();
    if (lane >= 32) {
      sum = xfer[lane & 31];
#pragma unroll
      for (int j = 0; j < VPL; ++j)
        if (valid_slot(j, lane)) sum += s[j];
    }
    RowWarp::sync();  // xfer is free again
    sum = warp_sum_f32(sum);
    sum = bits_float((u32)RowWarp::bcast((int)float_bits(sum), 32));
    for_chunks([&](AMDQB_CHUNK ch) {
      constexpr int c = decltype(ch)::value;
      chunk_pin(s, c);
#pragma unroll
      for (int j = c * CHUNK; j < (c + 1) * CHUNK && j < VPL; ++j)
        s[j] = valid_slot(j, lane) ? s[j] / sum : 0.0f;
      chunk_pin(s, c);
    });
#else
    (void)xfer;
    float sum = 0.0f;
    for_chunks([&](AMDQB_CHUNK ch) {
      constexpr int c = decltype(ch)::value;
      chunk_pin(s, c);
#pragma unroll
      for (int j = c * CHUNK; j < (c + 1) * CHUNK && j < VPL; ++j)
        if (valid_slot(j, lane)) sum += expf(s[j] - m);
      chunk_pin(sum);
    });
    sum = warp_sum_f32(sum);
    for_chunks([&](AMDQB_CHUNK ch) {
      constexpr int c = decltype(ch)::value;
      chunk_pin(s, c);
#pragma unroll
      for (int j = c * CHUNK; j < (c + 1) * CHUNK && j < VPL; ++j)
        s[j] = valid_slot(j, lane) ? expf(s[j] - m) / sum : 0.0f;
      chunk_pin(s, c);
    });
#endif
    st.m = m;
    st.sum = sum;
  }
#else
  (void)softmax_pre;
  (void)st;
  (void)xfer;
#endif
}

// Scores of one token from its loaded logits: s[j] of expert slot_id(j, lane) (0 on padding).
AMDQB_DEVICE void scores_from_raw(const in_t (&raw)[VPL], int lane, float (&s)[VPL],
                                  int softmax_pre, RowStats& st, float* xfer) {
  activate(raw, [&](int j) { return valid_slot(j, lane); }, s);
  softmax_scores(s, lane, softmax_pre, st, xfer);
}

// scores_from_raw over the row's logits, loaded CHUNK slots at a time.
AMDQB_DEVICE void row_scores(const in_t* row, int lane, float (&s)[VPL], int softmax_pre,
                             RowStats& st, float* xfer) {
  if constexpr (NCHUNK == 1) {
    in_t raw[VPL];
    load_row(row, lane, raw);
    scores_from_raw(raw, lane, s, softmax_pre, st, xfer);
  } else {
    for_chunks([&](AMDQB_CHUNK ch) {
      constexpr int c = decltype(ch)::value;
      in_t raw[CHUNK];
      float sc[CHUNK];
      const int cl = chunk_lane(lane);
      load_chunk(row, cl, c * CHUNK, raw);
      activate(raw, [&](int i) { return valid_chunk_slot(c * CHUNK + i, cl); }, sc);
      chunk_done(sc);
#pragma unroll
      for (int i = 0; i < CHUNK; ++i)
        if (c * CHUNK + i < VPL) s[c * CHUNK + i] = sc[i];
    });
    softmax_scores(s, lane, softmax_pre, st, xfer);
  }
}

// The element-wise activations of the row's logits, CHUNK slots at a time: out(j, s, v) for every
// slot j, s bit for bit act_elementwise and v the tie-free selection value with AMDQB_TIE_FREE
// (activate_tie_free; bias(j, lane) read for the valid slots only), else 0.
template <typename Bias, typename Out>
AMDQB_DEVICE void row_elementwise(const in_t* row, int lane, Bias bias, Out out) {
  for_chunks([&](AMDQB_CHUNK ch) {
    constexpr int c = decltype(ch)::value;
    in_t raw[CHUNK];
    float sc[CHUNK], v[CHUNK];
    const int cl = chunk_lane(lane);
    load_chunk(row, cl, c * CHUNK, raw);
    const auto valid = [&](int i) { return valid_chunk_slot(c * CHUNK + i, cl); };
#if AMDQB_TIE_FREE
    activate_tie_free(
        raw, valid, [&](int i) { return valid(i) ? bias(c * CHUNK + i, cl) : 0.0f; }, sc, v);
    chunk_done(v);
#else
    (void)bias;
    activate(raw, valid, sc);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) v[i] = 0.0f;
#endif
    chunk_done(sc);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i)
      if (c * CHUNK + i < VPL) out(c * CHUNK + i, sc[i], v[i]);
  });
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

#if AMDQB_PREFILTER
// The selection keys of the bounded approximate sigmoid (sigmoid_bounded_approx, plus bias[e]
// where bias is given), CHUNK slots at a time; padding slots kInt32Min.
AMDQB_DEVICE void approximate_keys(const in_t* row, int lane, const float* bias, i32 (&key)[VPL]) {
  for_chunks([&](AMDQB_CHUNK ch) {
    constexpr int c = decltype(ch)::value;
    in_t raw[CHUNK];
    const int cl = chunk_lane(lane);
    load_chunk(row, cl, c * CHUNK, raw);
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
      const int j = c * CHUNK + i;
      if (j < VPL) {
        if (valid_slot(j, cl)) {
          const float sa = sigmoid_bounded_approx(to_f32(raw[i]));
          key[j] = order_key(bias != nullptr ? sa + bias[slot_id(j, cl)] : sa);
        } else {
          key[j] = kInt32Min;
        }
      }
    }
  });
}

// Bit j set where slot j of row lane p holds one of the routes sid[0..topk) (distinct ids).
AMDQB_DEVICE u32 route_slots(const i32* sid, int topk, int p) {
  u32 bits = 0u;
  for (int r = 0; r < topk; ++r) {
    const i32 id = sid[r];  // the same address in every lane: a broadcast
    const int h = RW == 64 ? id / (32 * VPL) : 0;
    const int rem = id - h * 32 * VPL;
    if (h * 32 + (rem & 31) == p) bits |= 1u << (rem >> 5);
  }
  return bits;
}
#endif

// Whether a router call writes outputs over every expert (dense probs, byte or bit map).
AMDQB_DEVICE bool has_dense_outputs(const in_t* probs, int map_kind) {
  return probs != nullptr || map_kind == kByteMap || map_kind == kBitMap;
}

// The outputs over every expert of token t from this thread's experts e = base(j) + lane
// (valid(j): e < E; base(j) a multiple of 32): probs zeroed for the non-members (members are
// written once per rank by write_route: one division per route, not per expert), the byte map,
// and the bit map from one ballot per 32 experts. Members: is_member(j) of the valid slots.
template <int V, typename Base, typename Valid, typename Member>
AMDQB_DEVICE void write_dense_outputs(Base base, Valid valid, Member is_member, int lane, i64 t,
                                      in_t* probs, void* map, int map_kind) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = base(j) + lane;
    const bool member = valid(j) && is_member(j);
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

// The LDS histogram of kQbMarginLds: expert e's bins half + r (0 <= r < half) as 8-bit counters,
// 4 a word, in planes of E words (bins 4q .. 4q + 3 of every expert in plane q): a warp's lanes
// hold consecutive experts, so their counters lie in consecutive words, 32 banks, and a word's
// index is one multiply-add by the constant E.
AMDQB_DEVICE int margin_lds_words(int half) { return E * ((half + 3) >> 2); }
AMDQB_DEVICE int margin_lds_word(int e, int r) { return (r >> 2) * E + e; }

// log_margin QB: the margin bin of every expert e = base(j) + lane of token t from its key (the
// selection value), on the expert's axis inv[e]; fused: one device atomic per (token, expert) into
// hist, two-kernel: the bin as a byte of bins_out [T, E]; kQbMarginLds: the bins at or above the
// cutoff's (d >= 0: every expert but the k routed) as 8-bit counters of the block's LDS histogram
// lds (margin_lds_word), the routed experts' bins with device atomics.
// The mode is tested once per token, and the axes are loaded MARGIN_GROUP at a time before their
// bins are taken (sm_90, E=896: a test and a load behind it per pair left 28 dependent L1 round
// trips per token).
// AMD: 4. Against one at a time, E=896 keeps its waves (one at a time: gfx942's fp16 router 7 -> 6)
// and a lower main-loop model; E=4096 loses one (gfx950's decode form, gfx1250's router), as with 2
// or 8.
#if defined(AMDQB_AMDGCN)
constexpr int MARGIN_GROUP = 4;
#else
constexpr int MARGIN_GROUP = 8;
#endif
template <int V, typename Base, typename Valid, typename Out>
AMDQB_DEVICE void for_margin_bins(const i32 (&key)[V], Base base, Valid valid, int lane,
                                  float alpha, const float* inv, int half, int fine, Out out) {
#pragma unroll
  for (int j0 = 0; j0 < V; j0 += MARGIN_GROUP) {
    float axis[MARGIN_GROUP];
#pragma unroll
    for (int g = 0; g < MARGIN_GROUP; ++g) {
      const int j = j0 + g;
      axis[g] = j < V && valid(j) ? inv[base(j) + lane] : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < MARGIN_GROUP; ++g) {
      const int j = j0 + g;
      if (j < V && valid(j))
        out(base(j) + lane, margin_bin_at(alpha - key_value(key[j]), axis[g], half, fine));
    }
  }
}

// Adds c to bin i of the histogram's counts: int32 [E, B], or plane 0 of the AMDQB_MOMENTS build's
// int64 [3, E, B].
AMDQB_DEVICE void add_count(int* hist, i64 i, int c) {
#if AMDQB_MOMENTS
  atomic_add_global(reinterpret_cast<u64*>(hist) + i, (u64)c);
#else
  atomic_add_global(hist + i, c);
#endif
}

// The AMDQB_MOMENTS build: a fine-key pair's in-bin position u (m.u >= 0) and u * u added to bin i
// of planes 1 and 2 of the int64 [3, E, B] histogram (plane = E * B entries).
AMDQB_DEVICE void add_moments(int* hist, i64 i, i64 plane, MarginBin m) {
#if AMDQB_MOMENTS
  if (m.u >= 0) {
    u64* const sums = reinterpret_cast<u64*>(hist) + plane + i;
    atomic_add_global(sums, (u64)m.u);
    atomic_add_global(sums + plane, (u64)(m.u * m.u));
  }
#else
  (void)hist, (void)i, (void)plane, (void)m;
#endif
}

// The two-kernel mode writes each pair's bin as a byte of bins_out [T, E]; the AMDQB_MOMENTS build
// also its in-bin position, max(u, 0), as a byte of the plane after it (bins_out [2, T, E]; tokens
// = T): amdqb_qb_hist_bins sums both, and a pair off the fine keys adds 0 to the moments, as in
// the oracle.
template <int V, typename Base, typename Valid>
AMDQB_DEVICE void margin_bins_out(const i32 (&key)[V], Base base, Valid valid, int lane, i64 t,
                                  i64 tokens, float alpha, const float* inv, int num_bins, int fine,
                                  int qb_mode, int* hist, u8* bins_out, int* lds) {
  const int half = num_bins >> 1;
  const i64 plane = (i64)E * num_bins;
  if (AMDQB_MARGIN_LDS && qb_mode == kQbMarginLds) {
    for_margin_bins(key, base, valid, lane, alpha, inv, half, fine, [&](int e, MarginBin m) {
      const i64 i = (i64)e * num_bins + m.bin;
      if (m.bin >= half)
        atomic_add_shared(&lds[margin_lds_word(e, m.bin - half)], 1 << (8 * ((m.bin - half) & 3)));
      else
        add_count(hist, i, 1);
      add_moments(hist, i, plane, m);
    });
  } else if (qb_mode == kQbFused || qb_mode == kQbMarginLds) {  // the latter: a build without LDS
    for_margin_bins(key, base, valid, lane, alpha, inv, half, fine, [&](int e, MarginBin m) {
      const i64 i = (i64)e * num_bins + m.bin;
      add_count(hist, i, 1);
      add_moments(hist, i, plane, m);
    });
  } else {
    u8* const row = bins_out + t * E;
    for_margin_bins(key, base, valid, lane, alpha, inv, half, fine, [&](int e, MarginBin m) {
      row[e] = (u8)m.bin;
      if (AMDQB_MOMENTS) row[tokens * E + e] = (u8)(m.u > 0 ? m.u : 0);
    });
    (void)tokens;
  }
}

// kQbMarginLds: adds the block's LDS counters (margin_lds_word's planes, 4 bins of 8 bits a word)
// to hist with one device atomic per non-zero bin. The launcher keeps a block's tokens at most
// 255, so that no counter wraps.
AMDQB_DEVICE void flush_margin_lds(const int* lds, int num_bins, int* hist) {
  const int half = num_bins >> 1;
  for (int i = (int)threadIdx.x; i < margin_lds_words(half); i += (int)blockDim.x) {
    const u32 word = (u32)lds[i];
    if (word == 0u) continue;
    const int q = i / E, e = i - q * E, b0 = half + 4 * q;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int c = (int)((word >> (8 * v)) & 0xffu);
      if (c != 0) add_count(hist, (i64)e * num_bins + b0 + v, c);
    }
  }
}
}  // namespace

// The fields of a RouterParams as the kernels' local names (the logits dtype's pointers typed).
#define AMDQB_ROUTER_PARAMS(p)                                                                     \
  const in_t* const logits = static_cast<const in_t*>((p).logits);                                 \
  const float* const bias = (p).bias;                                                              \
  in_t* const probs = static_cast<in_t*>((p).probs);                                               \
  void* const map = (p).map;                                                                       \
  int* const hist = (p).hist;                                                                      \
  const float* const bounds = (p).bounds;                                                          \
  float* const alpha_out = (p).alpha_out;                                                          \
  float* const w_out = (p).w_out;                                                                  \
  int* const id_out = (p).id_out;                                                                  \
  u8* const bins_out = (p).bins_out;                                                               \
  const int num_tokens = (p).num_tokens, topk = (p).topk, nsel = (p).nsel;                         \
  const int normalize = (p).normalize, softmax_pre = (p).softmax_pre, map_kind = (p).map_kind;     \
  const int qb_mode = (p).qb_mode, num_bins = (p).num_bins, qb_binning = (p).qb_binning;           \
  const int margin_fine = (p).margin_fine;                                                         \
  const float scale = (p).scale

// The kernel's arguments as each stage of a token reads them: on AMD hardware re-read from the
// kernel-argument segment there, in every token (scalar loads, the scalar cache's), so that neither
// they nor the conditions derived from them stay in SGPRs through the whole loop (the E=896 wave64
// router spilled 40 of them into VGPR lanes); elsewhere the parameter itself. opaque_row: the
// same for the row index (the row's LDS buffer addresses).
#if defined(AMDQB_HIP)
typedef const __attribute__((address_space(4))) RouterParams* KernelParams;
AMDQB_DEVICE KernelParams kernel_params(const RouterParams&) {
  auto p =
      (KernelParams)__builtin_amdgcn_kernarg_segment_ptr();  // RouterParams is the only argument
  asm volatile("" : "+s"(p));  // a new pointer in every token: the loads stay here
  return p;
}
AMDQB_DEVICE int opaque_row(int w) {
  asm volatile("" : "+s"(w));
  return w;
}
#else
typedef const RouterParams* KernelParams;
AMDQB_DEVICE KernelParams kernel_params(const RouterParams& p) { return &p; }
AMDQB_DEVICE int opaque_row(int w) { return w; }
#endif

// One logical warp per token, WARPS tokens per block, persistent grid-stride loop over tokens.
//   nsel = topk (+1 under QB); normalize: p = s / (sum_selected s + 1e-20); softmax_pre: scores are
//   the softmax over E (else, for AMDQB_SCORE softmax, the selected logits are softmax-ed);
//   probs (nullable) [T, E] in the logits dtype; map (nullable) per map_kind; hist/bounds for
//   qb_mode 1 and 3, alpha_out for qb_mode 2 (and, nullable, the caller's cutoffs in any QB mode);
//   w_out/id_out (nullable) [T, topk] fp32 / int32. qb_mode 3 (log_margin): dynamic shared memory
//   of margin_lds_words(B / 2) ints, at most 255 tokens per block.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS_MIN(ROUTER_BLOCK, AMDQB_ROUTER_MIN_BLOCKS)
    amdqb_router(const RouterParams params) {
  AMDQB_ROUTER_PARAMS(params);
  AMDQB_SHARED(i32, sh_ckey, ROWS * CAP);
  AMDQB_SHARED(i32, sh_cid, ROWS * CAP);
  AMDQB_SHARED(i32, sh_skey, ROWS * CAP);
  AMDQB_SHARED(i32, sh_sid, ROWS * CAP);
  AMDQB_SHARED(float, sh_ss, ROWS * CAP);
  const int lane0 = row_lane();  // 0 .. RW - 1 (lane, below; l32: the lane in its 32-lane half)
  const int w = row_in_block();
  const WarpBuffers b{sh_ckey + w * CAP, sh_cid + w * CAP, sh_skey + w * CAP, sh_sid + w * CAP,
                      sh_ss + w * CAP};
  const bool post_softmax = AMDQB_SCORE == AMDQB_SCORE_SOFTMAX && !softmax_pre;
  // The QB histogram pass that may follow is launched as a dependent: its blocks take the SMs
  // this persistent grid's blocks leave, and zero their LDS while the last tokens finish.
  allow_dependent_launch();

  float qb_lower = 0.0f, qb_scale = 0.0f;
  if (qb_mode == kQbFused && qb_binning == kUniform) {
    qb_lower = bounds[0];
    qb_scale = (float)num_bins / (bounds[1] - qb_lower);
  }

  // The warp's first token is prefetched before the bias is staged in LDS, so that at decode
  // sizes (one token per warp) the two fetches overlap instead of costing two round trips; the
  // bias is then read from LDS by every token. (A prefetch, not a load into registers: a row
  // held across the loop would cost VPL registers.)
  AMDQB_SHARED(float, sh_bias, E);
  const i64 t_first = (i64)blockIdx.x * ROWS + w;
  if (t_first < num_tokens)
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane0)) prefetch_l1(logits + t_first * E + slot_id(j, lane0));
  if (bias != nullptr)
    for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) sh_bias[e] = bias[e];
  // kQbMarginLds (the AMDQB_MARGIN_LDS build): the block's 8-bit bin counters, dynamic shared
  // memory zeroed here
#if AMDQB_MARGIN_LDS
  AMDQB_DYN_SHARED(margin_lds);
  if (qb_mode == kQbMarginLds)
    for (int i = (int)threadIdx.x; i < margin_lds_words(num_bins >> 1); i += (int)blockDim.x)
      margin_lds[i] = 0;
#else
  int* const margin_lds = nullptr;
#endif
  block_sync();

  for (i64 t = t_first; t < num_tokens; t += (i64)gridDim.x * ROWS) {
    const int lane = opaque_lane(lane0), l32 = lane & 31;
#if defined(AMDQB_HIP)
    // The selection's arguments, read again here (kernel_params).
    const KernelParams ip = kernel_params(params);
    const in_t* const logits = static_cast<const in_t*>(ip->logits);
    const float* const bias = ip->bias;
    const int nsel = ip->nsel, softmax_pre = ip->softmax_pre;
    const bool post_softmax = AMDQB_SCORE == AMDQB_SCORE_SOFTMAX && !softmax_pre;
    const int wr = RW == AMDQB_WAVE_SIZE ? opaque_row(w) : w;
    const WarpBuffers b{sh_ckey + wr * CAP, sh_cid + wr * CAP, sh_skey + wr * CAP,
                        sh_sid + wr * CAP, sh_ss + wr * CAP};
#endif
    const in_t* row = logits + t * E;
    // Only the selection keys stay in registers through the selection (VPL registers rather than
    // 2 * VPL with the scores: the H200 profile found this kernel latency-bound at 25% occupancy,
    // limited by registers); the few selected experts' scores are recomputed below from their
    // logits, which the L1/L2 still hold, bit for bit as here.
    i32 key[VPL];
    RowStats st;
    // The selection key of expert e from its score (the exact keys' and the candidates' alike)
    const auto biased_key = [&](float sc, int e) {
      return order_key(bias != nullptr ? sc + sh_bias[e] : sc);
    };
    const auto exact_keys = [&]() {
#if AMDQB_TIE_FREE
      (void)biased_key;  // the tie-free keys are b - c
      row_elementwise(
          row, lane, [&](int j, int cl) { return sh_bias[slot_id(j, cl)]; },
          [&](int j, float, float v) { key[j] = valid_slot(j, lane) ? order_key(v) : kInt32Min; });
#else
      float s[VPL];
      row_scores(row, lane, s, softmax_pre, st, b.ss);
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        if (valid_slot(j, lane)) {
          key[j] = biased_key(s[j], slot_id(j, lane));
        } else {
          key[j] = kInt32Min;  // padding: ids >= E rank below every expert
        }
      }
#endif
    };
#if AMDQB_PREFILTER
    // The keys of the bounded approximate sigmoid first; the candidates' exact keys are those of
    // exact_keys, bit for bit. Rows the approximation cannot decide select from the exact keys.
    approximate_keys(row, lane, bias != nullptr ? sh_bias : nullptr, key);
    const bool decided = select_top_prefiltered<CAP, RW>(
        key, nsel, lane, b, AMDQB_APPROX_SIGMOID_ERR,
        [&](i32 id) { return biased_key(sigmoid(to_f32(row[id])), id); });
    if (!decided) {
      exact_keys();
      select_top<CAP, RW>(key, nsel, lane, b);
    }
#else
    exact_keys();
    select_top<CAP, RW>(key, nsel, lane, b);
#endif
#pragma unroll
    for (int q = 0; q < CAP / RW; ++q) {
      const int r = lane + RW * q;
      if (r < nsel) b.ss[r] = score_of(row[b.sid[r]], softmax_pre, st);
    }
    RowWarp::sync();

    {
#if defined(AMDQB_HIP)
      // The output stage's arguments, read again here (kernel_params).
      const KernelParams op = kernel_params(params);
      in_t* const probs = static_cast<in_t*>(op->probs);
      void* const map = op->map;
      int* const hist = op->hist;
      const float* const bounds = op->bounds;
      float* const alpha_out = op->alpha_out;
      float* const w_out = op->w_out;
      int* const id_out = op->id_out;
      u8* const bins_out = op->bins_out;
      const int topk = op->topk, normalize = op->normalize, map_kind = op->map_kind;
      const int qb_mode = op->qb_mode, num_bins = op->num_bins, qb_binning = op->qb_binning;
      const int margin_fine = op->margin_fine;
      const float scale = op->scale;
      float qb_lower = 0.0f, qb_scale = 0.0f;
      if (qb_mode == kQbFused && qb_binning == kUniform) {
        qb_lower = bounds[0];
        qb_scale = (float)num_bins / (bounds[1] - qb_lower);
      }
#endif
      // Route cutoff (k-th element) and weights. The sums over the k routes run in the order of
      // routes_sum: post-softmax torch.softmax's over the k selected logits, the sigmoid /
      // sqrtsoftplus normalisation TE's; on 64-lane rows each half computes the same sum.
      float denom = 1.0f, zmax = 0.0f;
      if (post_softmax) {
        zmax = b.ss[0];  // the largest selected logit
        denom = routes_sum(topk, l32, [&](int r) { return expf(b.ss[r] - zmax); });
      } else if (normalize) {
        denom = routes_sum(topk, l32, [&](int r) { return b.ss[r]; }) + 1e-20f;
      }
      auto weight = [&](float v) -> float {
        float p;
        if (post_softmax)
          p = expf(v - zmax) / denom;
        else
          p = normalize ? v / denom : v;
        return p * scale;
      };

      const auto base = [&](int j) { return slot_base(j, lane); };
      const auto valid = [&](int j) { return valid_slot(j, lane); };
      if (has_dense_outputs(probs, map_kind)) {
#if AMDQB_PREFILTER
        // key[] may hold the approximate keys: the members are the routes' slots
        const u32 routed = route_slots(b.sid, topk, lane);
        write_dense_outputs<VPL>(
            base, valid, [&](int j) { return ((routed >> j) & 1u) != 0u; }, l32, t, probs, map,
            map_kind);
#else
        const i32 ck = b.skey[topk - 1], cid = b.sid[topk - 1];
        write_dense_outputs<VPL>(
            base, valid, [&](int j) { return at_or_ahead(key[j], base(j) + l32, ck, cid); }, l32, t,
            probs, map, map_kind);
#endif
      }
#pragma unroll
      for (int q = 0; q < CAP / RW; ++q) {
        const int r = lane + RW * q;
        if (r < topk)
          write_route(t, topk, r, b.sid[r], weight(b.ss[r]), probs, map, map_kind, w_out, id_out);
      }

      if (qb_mode != kQbNone) {
        const float alpha = key_value(b.skey[topk]);  // the (k+1)-th selection value
        if (alpha_out != nullptr && lane == 0) alpha_out[t] = alpha;  // kQbAlpha: always given
        // (not in the prefilter build, by the launcher's rule: its keys may be approximate, and
        // log_margin bins every expert's key)
        if (!AMDQB_PREFILTER && qb_binning == kLogMargin) {
          margin_bins_out(key, base, valid, l32, t, num_tokens, alpha, bounds, num_bins,
                          margin_fine, qb_mode, hist, bins_out, margin_lds);
        } else if (qb_mode == kQbFused) {
          const QbCut cut = qb_cut(alpha, qb_lower, qb_scale);
          // QB is sigmoid-only: the bin needs the logit alone
          for_chunks([&](AMDQB_CHUNK ch) {
            constexpr int c = decltype(ch)::value;
            in_t raw[CHUNK];
            load_chunk(row, chunk_lane(lane), c * CHUNK, raw);
            add_fused_bins(
                raw, [&](int i) { return base(c * CHUNK + i); },
                [&](int i) { return valid_chunk_slot(c * CHUNK + i, lane); }, l32, cut, qb_lower,
                qb_scale, num_bins, hist);
            chunk_done();
          });
        }
      }
    }
    RowWarp::sync();  // the next token reuses this row's buffers
  }
#if AMDQB_MARGIN_LDS
  {
#if defined(AMDQB_HIP)
    // the flush's arguments, read again here (kernel_params): nothing stays live through the loop
    const KernelParams fp = kernel_params(params);
    const int qb_mode = fp->qb_mode, num_bins = fp->num_bins;
    int* const hist = fp->hist;
#endif
    if (qb_mode == kQbMarginLds) {
      block_sync();
      flush_margin_lds(margin_lds, num_bins, hist);
    }
  }
#endif
}

// Decode form of the router and of biased_topk (element-wise scores: sigmoid, sqrtsoftplus): one
// block of DEC_WARPS logical warps per token, so that the token's dependent chain (loads,
// activations, selection) is spread over the block instead of one warp -- at decode sizes that
// chain is the whole kernel time. Thread (w, lane) holds the DEC_EPT experts
// e = j * DEC_THREADS + w * 32 + lane, j < DEC_EPT.
//   1. each warp selects its own Top-n with select_top (its local ids j * 32 + lane are ordered as
//      the global ids, so the warp's selection order is the token's);
//   2. the warps' sorted lists are merged by a tree of bitonic merges, ceil(log2(warps)) rounds;
//      in each, warp i takes lists 2i and 2i + 1, lane l keeping the better of A[l] and B[31 - l]
//      (the top half of their bitonic merge), and five compare-exchange stages sort them (a
//      merge by rank -- each entry's position in its own list plus a binary search in every
//      other -- took 2.4 us of the kernel's 5.3 on the H200 at n = 16, 7 warps);
//   3. warp 0 writes the k routes (weights from the same scores and the same sequential sum as
//      amdqb_router, so both kernels give identical bits); the dense outputs and the fused QB
//      bins are written by every thread for its own experts.
// n <= DEC_CAP = 32 (the op sends a larger Top-n to amdqb_router): each warp's candidate and
// sorted lists hold 32 entries, which keeps the block's LDS at E floats + 4 KiB (E=896: 8 blocks
// of 256 threads in the 64 KiB of a gfx942 CU).
constexpr int DEC_WARPS_RAW = (E + AMDQB_DECODE_EPW - 1) / AMDQB_DECODE_EPW;
constexpr int DEC_WARPS_EVEN = DEC_WARPS_RAW > 1 ? (DEC_WARPS_RAW + 1) / 2 * 2 : 1;
constexpr int DEC_WARPS = DEC_WARPS_EVEN < 8 ? DEC_WARPS_EVEN : 8;
constexpr int DEC_THREADS = 32 * DEC_WARPS;
constexpr int DEC_EPT = (E + DEC_THREADS - 1) / DEC_THREADS;  // experts per thread
constexpr int DEC_CAP = 32;  // the largest Top-n, a warp's list (amdqb.backends.hip.router)
static_assert(DEC_CAP == 32, "one rank a lane of warp 0 writes the routes");

namespace {
// Global id of warp w's local id j * 32 + lane.
AMDQB_DEVICE i32 global_id(int w, i32 lid) {
  return (lid >> 5) * DEC_THREADS + w * 32 + (lid & 31);
}
}  // namespace

// The router in its decode form: amdqb_router's arguments and outputs (probs, every routing map,
// weights/ids, QB cutoff or fused histogram), bit for bit, for the element-wise scores (the op
// sends softmax to amdqb_router).
// AMD: 8 waves per SIMD up to E = 1024 (4 experts per thread), where the LDS allows 8 blocks and
// the registers fit that budget without spills; beyond, the compiler's choice.
#if AMDQB_NUM_EXPERTS <= 1024
#define AMDQB_DECODE_WAVES AMDQB_AMD_WAVES_PER_EU(8)
#else
#define AMDQB_DECODE_WAVES
#endif
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(DEC_THREADS) AMDQB_DECODE_WAVES
    amdqb_router_decode(const RouterParams params) {
  AMDQB_ROUTER_PARAMS(params);
  (void)softmax_pre;  // amdqb_router's parameters; the op sends softmax scores to amdqb_router
  AMDQB_SHARED(i32, sh_ckey, DEC_WARPS * DEC_CAP);
  AMDQB_SHARED(i32, sh_cid, DEC_WARPS * DEC_CAP);
  AMDQB_SHARED(i32, sh_skey, DEC_WARPS * DEC_CAP);  // each warp's Top-n (local ids)
  AMDQB_SHARED(i32, sh_sid, DEC_WARPS * DEC_CAP);
  AMDQB_SHARED(float, sh_score, E);  // scores by expert id
  AMDQB_SHARED(i32, sh_top, DEC_CAP);  // the token's Top-n ids, in order
  AMDQB_SHARED(i32, sh_topkey, DEC_CAP);  // and their keys (the cutoffs: amdqb_router's key_value)
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
  float s[DEC_EPT];
#if AMDQB_TIE_FREE
  float v[DEC_EPT];
  activate_tie_free(raw, valid, [&](int j) { return bv[j]; }, s, v);
#else
  activate(raw, valid, s);
#endif
  i32 key[DEC_EPT];
#pragma unroll
  for (int j = 0; j < DEC_EPT; ++j) {
    const int e = j * DEC_THREADS + tid;
#if AMDQB_TIE_FREE
    const float biased = v[j];
#else
    const float biased = bias != nullptr ? s[j] + bv[j] : s[j];
#endif
    key[j] = valid(j) ? order_key(biased) : kInt32Min;
    if (valid(j)) sh_score[e] = s[j];
  }

  const WarpBuffers b{sh_ckey + w * DEC_CAP, sh_cid + w * DEC_CAP, sh_skey + w * DEC_CAP,
                      sh_sid + w * DEC_CAP, nullptr};
  select_top<DEC_CAP>(key, nsel, lane, b);  // local ids; the merge maps them to global ids
  block_sync();

  // Only the outputs over every expert (dense probs / maps, the fused histogram) need the whole
  // block after the selection; otherwise warp 0 finishes alone (no barrier after the last round).
  const bool block_outputs = has_dense_outputs(probs, map_kind) || qb_mode == kQbFused ||
                             (qb_mode != kQbNone && qb_binning == kLogMargin);
  if (DEC_WARPS > 1) {
    // Merge tree. Lists live in (src_k, src_i) at stride DEC_CAP; round r writes (dst_k, dst_i),
    // and the two swap: the barrier opening each round orders the reads of one round before the
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
          ak = src_k[la * DEC_CAP + lane];
          ai = round == 0 ? global_id(la, src_i[la * DEC_CAP + lane]) : src_i[la * DEC_CAP + lane];
        }
        if (lb < lists && rb < nsel) {
          bk = src_k[lb * DEC_CAP + rb];
          bi = round == 0 ? global_id(lb, src_i[lb * DEC_CAP + rb]) : src_i[lb * DEC_CAP + rb];
        }
        if (ahead(bk, bi, ak, ai)) {
          ak = bk;
          ai = bi;
        }
        warp_merge_desc(ak, ai, lane);
        if (lists == 2) {
          if (lane < nsel) {
            sh_top[lane] = ai;
            sh_topkey[lane] = ak;
          }
        } else {
          dst_k[w * DEC_CAP + lane] = ak;
          dst_i[w * DEC_CAP + lane] = ai;
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
  } else {  // one warp: its local ids are the global ids
    if (tid < nsel) {
      sh_top[tid] = sh_sid[tid];
      sh_topkey[tid] = sh_skey[tid];
    }
    block_sync();
  }

  if (w == 0) {
    // Lane r holds the score of rank r (a Top-n of at most DEC_CAP = 32); the normalisation sums
    // them in the order of routes_sum (one rank a lane), as amdqb_router does.
    const bool routed = lane < topk;
    const i32 id = routed ? sh_top[lane] : 0;
    const float v = routed ? sh_score[id] : 0.0f;
    const float denom = normalize ? warp_sum_f32(v) + 1e-20f : 1.0f;
    if (routed)
      write_route(t, topk, lane, id, (normalize ? v / denom : v) * scale, probs, map, map_kind,
                  w_out, id_out);
  }

  // Dense outputs, each thread for its own experts (coalesced across the block). Membership is a
  // compare against the k-th selected's key, computed from the same biased score as the
  // selection's.
  const auto base = [&](int j) { return j * DEC_THREADS + w * 32; };
  if (has_dense_outputs(probs, map_kind)) {
    const i32 ck = sh_topkey[topk - 1], cid = sh_top[topk - 1];
    write_dense_outputs<DEC_EPT>(
        base, valid, [&](int j) { return at_or_ahead(key[j], base(j) + lane, ck, cid); }, lane, t,
        probs, map, map_kind);
  }

  if (qb_mode != kQbNone) {
    const float alpha = key_value(sh_topkey[topk]);              // the (k+1)-th: the cutoff alpha
    if (alpha_out != nullptr && tid == 0) alpha_out[t] = alpha;  // kQbAlpha: always given
    if (qb_binning == kLogMargin) {
      margin_bins_out(key, base, valid, lane, t, num_tokens, alpha, bounds, num_bins, margin_fine,
                      qb_mode, hist, bins_out, nullptr);
    } else if (qb_mode == kQbFused) {
      const float lower = bounds[0];
      const float qscale = (float)num_bins / (bounds[1] - lower);
      add_fused_bins(raw, base, valid, lane, qb_cut(alpha, lower, qscale), lower, qscale, num_bins,
                     hist);
    }
  }
}

// QB two-kernel histogram: grid (ceil(E / experts_per_block), token slices). Each block builds an
// LDS histogram [experts_per_block, B] of its (expert, token) slice from the recomputed scores and
// the router's cutoffs, then flushes the non-zero bins with global atomics. Threads map to
// (token, expert) with the expert fastest, so a warp reads runs of consecutive logits, and the
// blocks of one slice walk the same token rows at about the same time (neighbouring blocks read
// neighbouring 32-byte pieces of each row). Bins come from the exact formula (the fused
// epilogue's fast path needs per-token constants, 8 or 16 bytes per token instead of the 4-byte
// cutoff). Dynamic shared memory: experts_per_block * num_bins ints. Block size:
// AMDQB_QB_HIST_BLOCK, a multiple of experts_per_block.
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
// divisions after, so no slow-path CALL sits between two elements' arithmetic (the scalar form
// keeps one activation per element).
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
    if (VEC == 4) {  // compile-time
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

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS_MIN(AMDQB_QB_HIST_BLOCK, AMDQB_QB_HIST_MIN_BLOCKS)
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
  // cutoffs are the router's output. (The bounds and logits come from earlier kernels.)
  wait_for_prior_grid();
  if (tt < rows_per_pass && sub * vec < ne && t0 + tt < t1) {
    const int count = (int)((t1 - t0 - tt - 1) / rows_per_pass) + 1;  // this thread's tokens
    // Tokens are walked last to first: the router before this pass ends on the last tokens, whose
    // logits the L2 may still hold when the logits exceed it.
    const i64 t = t0 + tt + (i64)(count - 1) * rows_per_pass;
    const int step = -rows_per_pass;
    int* h = lh + sub * vec * num_bins;
    const in_t* first = logits + t * E + e0 + sub * vec;
    if (vec == 4)  // uniform
      qb_hist_slice<4, AMDQB_QB_HIST_UNROLL>(first, alpha + t, count, step, h, lower, scale,
                                             num_bins);
    else
      qb_hist_slice<1, 8>(first, alpha + t, count, step, h, lower, scale, num_bins);
  }
  block_sync();

  // Non-zero bins only, each with one global atomic: an atomic add returns nothing to wait for,
  // where a read-modify-write by a bin's sole owner waits for its load.
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

// log_margin two-kernel histogram: the router's bins (bytes [T, E]) counted per expert. Grid
// (ceil(E / experts_per_block), token slices); each block counts its (expert, token) slice into an
// LDS histogram [experts_per_block, B + 1] and flushes the non-zero bins with global atomics. The
// row padding puts the same bin of neighbouring experts in different banks: with B a multiple of
// 32 the near-cutoff bins every expert counts would otherwise serialise a warp's atomics. vec = 4:
// each thread reads 4 consecutive experts' bins with one 32-bit load (E and experts_per_block
// multiples of 4), else 1. Dynamic shared memory: experts_per_block * (num_bins + 1) ints. The
// AMDQB_MOMENTS build reads the positions' plane after the bins (bins [2, T, E]) and adds u and
// u * u into two more LDS planes of that size (int32: the launcher keeps a slice at most
// MOMENTS_MAX_SLICE tokens, 32768 * 255^2 < 2^31), flushed into planes 1 and 2 of the int64
// [3, E, B] histogram with the counts in plane 0.
constexpr int kPlanes = AMDQB_MOMENTS ? 3 : 1;
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(AMDQB_QB_HIST_BLOCK)
    amdqb_qb_hist_bins(const u8* bins, int num_tokens, int num_bins, int experts_per_block,
                       int tokens_per_slice, int vec, int* hist) {
  AMDQB_DYN_SHARED(lh);
  const int tid = (int)threadIdx.x;
  const int nt = (int)blockDim.x;
  const int epb = experts_per_block;
  const int stride = num_bins + 1;
  const int lds_plane = epb * stride;
  const int e0 = (int)blockIdx.x * epb;
  const int ne = E - e0 < epb ? E - e0 : epb;
  const i64 t0 = (i64)blockIdx.y * tokens_per_slice;
  const i64 t1 = t0 + tokens_per_slice < num_tokens ? t0 + tokens_per_slice : (i64)num_tokens;
  for (int i = tid; i < kPlanes * lds_plane; i += nt) lh[i] = 0;
  block_sync();
  wait_for_prior_grid();  // the bins are the router's output
  const int per_row = epb / vec;
  const int sub = tid % per_row;
  const int rows_per_pass = nt / per_row;
  [[maybe_unused]] const i64 positions = (i64)num_tokens * E;  // the positions' plane (moments)
  if (tid / per_row < rows_per_pass && sub * vec < ne) {
    int* h = lh + sub * vec * stride;
    for (i64 t = t0 + tid / per_row; t < t1; t += rows_per_pass) {
      const u8* p = bins + t * E + e0 + sub * vec;
      if (vec == 4) {
        const u32 word = *reinterpret_cast<const u32*>(p);
#if AMDQB_MOMENTS
        const u32 pos = *reinterpret_cast<const u32*>(p + positions);
#endif
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          int* const slot = &h[v * stride + ((word >> (8 * v)) & 0xffu)];
          atomic_add_shared(slot, 1);
#if AMDQB_MOMENTS
          const int u = (int)((pos >> (8 * v)) & 0xffu);
          if (u != 0) {
            atomic_add_shared(slot + lds_plane, u);
            atomic_add_shared(slot + 2 * lds_plane, u * u);
          }
#endif
        }
      } else {
        int* const slot = &h[*p];
        atomic_add_shared(slot, 1);
#if AMDQB_MOMENTS
        const int u = p[positions];
        if (u != 0) {
          atomic_add_shared(slot + lds_plane, u);
          atomic_add_shared(slot + 2 * lds_plane, u * u);
        }
#endif
      }
    }
  }
  block_sync();
  const i64 first = (i64)e0 * num_bins;
  for (int i = tid; i < ne * num_bins; i += nt) {
    const int at = (i / num_bins) * stride + i % num_bins;
    const int c = lh[at];
    if (c != 0) add_count(hist, first + i, c);
#if AMDQB_MOMENTS
    const i64 plane = (i64)E * num_bins;
    u64* const sums = reinterpret_cast<u64*>(hist) + plane + first + i;
    const u32 s1 = (u32)lh[at + lds_plane], s2 = (u32)lh[at + 2 * lds_plane];
    if (s1 != 0u) atomic_add_global(sums, (u64)s1);
    if (s2 != 0u) atomic_add_global(sums + plane, (u64)s2);
#endif
  }
}

// The scores the router ranks, before the bias (RouterCall.write_scores): fp32 [T, E] into out,
// bit for bit those of amdqb_router / amdqb_router_decode (the same activation code; softmax: over
// E when softmax_pre). A pass of its own, launched only when the scores are asked for: written
// from inside the router the scores cost registers through the selection (the tie-free build on
// gfx942 lost half its waves). One logical warp per token.
AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(ROUTER_BLOCK)
    amdqb_router_scores(const in_t* logits, int num_tokens, float* out, int softmax_pre) {
  AMDQB_SHARED(float, sh_xfer, ROWS * 32);
  const int lane = row_lane();
  float* const xfer = sh_xfer + row_in_block() * 32;
  for (i64 t = (i64)blockIdx.x * ROWS + row_in_block(); t < num_tokens;
       t += (i64)gridDim.x * ROWS) {
    const in_t* row = logits + t * E;
#if AMDQB_TIE_FREE || AMDQB_SCORE != AMDQB_SCORE_SOFTMAX
    // element-wise scores (the sigmoid does not depend on the bias): each chunk stored as computed
    (void)softmax_pre;
    (void)xfer;
    row_elementwise(
        row, lane, [](int, int) { return 0.0f; },
        [&](int j, float s, float) {
          if (valid_slot(j, lane)) out[t * E + slot_id(j, lane)] = s;
        });
#else
    float s[VPL];
    RowStats st;
    row_scores(row, lane, s, softmax_pre, st, xfer);
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (valid_slot(j, lane)) out[t * E + slot_id(j, lane)] = s[j];
#endif
  }
}
