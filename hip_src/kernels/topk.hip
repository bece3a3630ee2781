// Serving top-k (amdqb.biased_topk and the vLLM / SGLang routers of amdqb.compat): score function,
// optional correction bias, optional expert groups, exact Top-k, weights, and every output the
// peers write (ids, weights, vLLM's token_expert_indices, SGLang's fused shared experts and padded
// rows), in one launch. One row of L lanes per token (several tokens per logical warp, one thread
// per token for small E), every expert held in registers, no block-wide barrier.
//
// Compile-time constants (-D, amdqb.backends.hip._spec.topk_module):
//   AMDQB_NUM_EXPERTS (E), AMDQB_IN_DTYPE (0 fp32, 1 fp16, 2 bf16), AMDQB_BIAS_DTYPE (-1 no bias,
//   else the same codes), AMDQB_SCORE (0 sigmoid, 1 sqrtsoftplus, 2 softmax over E),
//   AMDQB_APPROX_ACTIVATION (0: torch's bits), AMDQB_TOPK (k routed experts), AMDQB_ROW_LANES (L,
//   a power of two <= 32), AMDQB_SLOTS (V experts per lane), AMDQB_CONTIGUOUS (0: lane l holds
//   experts l + L * i, 1: experts l * V + i), AMDQB_ROW_ROUNDS (1: the row's Top-k by rounds of a
//   butterfly max instead of list merges), AMDQB_GROUPS (0: no groups), AMDQB_GROUP_LANES (lanes
//   per group, contiguous layout), AMDQB_TOPK_GROUP, AMDQB_GROUP_BEST (the best entries a group's
//   score sums: vLLM / SGLang 2 with a bias, 1 without; TransformerEngine k / topk_group),
//   AMDQB_DENSE (1: the TransformerEngine router's outputs over every expert -- probs in the
//   logits dtype, a byte / bit / index map, the ranked scores), AMDQB_IN_DTYPE_MATH (1: SGLang's
//   moe_fused_gate arithmetic -- the sigmoid, the bias, the biased scores and the group sums
//   rounded to the fp16 / bf16 logits dtype), AMDQB_TOPK_BLOCK (threads per block, at most),
//   AMDQB_KEY_SELECT (1: the row's Top-k over the 32-bit selection keys first).
//
// Precision contract (amdqb.ref.router.biased_topk): logits and bias are converted to fp32 on load;
// activations are torch's bits (amdqb_activation.h; softmax: exp(z - max) / sum with the sum in
// torch's warp-softmax order -- lane l of min(32, next_pow2(E)) lanes adds experts l, l + 32, ...
// in order, then a butterfly); selection values u = s + b in fp32 without contraction; weights the
// unbiased scores, renormalised by sum + 1e-20 in the order of amdqb.ref.router.routes_sum, then
// times the scaling factor.
//
// Selection contract (amdqb.ref.ordering): (u descending, expert id ascending), -0.0 == +0.0, NaN
// below every number, through the packed 64-bit entry (order key, ~id): larger entry = ahead; 0 is
// the sentinel below every expert (padding slots, experts of groups not kept). Groups: a group's
// score is the sum, in selection order, of its AMDQB_GROUP_BEST best selection values; groups
// ranked like experts (score descending, group id ascending, NaN lowest); the AMDQB_TOPK_GROUP
// best are kept and the Top-k is taken inside them. The dense (TransformerEngine) form's weights
// are the router's: sigmoid / sqrtsoftplus s / (sum + 1e-20) for k > 1, softmax over E, or the
// softmax over the k selected logits (flags bit 4) exp(z - z_max) / sum in routes_sum's order.
//
// Algorithm per row: each lane sorts its V entries (a bitonic network in registers) and keeps the
// best KP = next_pow2(k); log2(L) butterfly steps then merge the lanes' sorted lists pairwise (the
// better half of a list and its partner's reversed list is bitonic; a bitonic merge sorts it), so
// that every lane of the row ends with the row's Top-KP in selection order (L = 1: one thread per
// row, no cross-lane step). With AMDQB_ROW_ROUNDS the row's Top-k comes from k rounds instead:
// every lane offers the best entry of its sorted list, a butterfly max over the row gives every
// lane the round's winner, and the lane that held it drops it -- k log2(L) dependent shuffles
// (the merges: log2(L) steps of KP shuffles each) for a third fewer 64-bit compares and selects
// (instructions a full GPU has to issue). Both give the same list. Route r is written by lane
// r % L. Groups first combine each group's best entries across its AMDQB_GROUP_LANES lanes and
// rank the group scores.
// With AMDQB_KEY_SELECT (compact outputs, list merges) the sorts and merges run first on the
// entries' 32-bit high words alone (a compare-exchange is a max and a min: 2 instructions where
// the 64-bit entries take 8). The row's best K keys are then the exact Top-k wherever they are
// distinct, nonzero (no NaN, enough kept experts) and the k-th key belongs to one expert of the
// row (two ballots); each member lane finds its rank among them and publishes its expert and
// unbiased score there (in registers for a thread per row, else in the row's LDS). A logical
// warp in which any row fails a check runs the entries' selection instead.
#include "amdqb_prelude.h"
#include "amdqb_activation.h"

// A hook the CPU emulator defines to count logical warps whose keys tie (test coverage); nothing
// elsewhere.
#ifndef AMDQB_TRACE_TIED_KEYS
#define AMDQB_TRACE_TIED_KEYS()
#endif

using namespace amdqb;

#if !defined(AMDQB_NUM_EXPERTS) || !defined(AMDQB_IN_DTYPE) || !defined(AMDQB_BIAS_DTYPE) ||       \
    !defined(AMDQB_SCORE) || !defined(AMDQB_TOPK) || !defined(AMDQB_ROW_LANES) ||                  \
    !defined(AMDQB_SLOTS) || !defined(AMDQB_CONTIGUOUS) || !defined(AMDQB_ROW_ROUNDS) ||           \
    !defined(AMDQB_GROUPS) || !defined(AMDQB_GROUP_LANES) || !defined(AMDQB_TOPK_GROUP) ||         \
    !defined(AMDQB_GROUP_BEST) || !defined(AMDQB_DENSE) || !defined(AMDQB_IN_DTYPE_MATH) ||        \
    !defined(AMDQB_TOPK_BLOCK) || !defined(AMDQB_KEY_SELECT)
#error "topk.hip needs its -D constants (amdqb.backends.hip._spec.topk_module)"
#endif

namespace {

// The smallest power of two >= n, for n <= 64 (an expression: NVRTC compiles no host functions).
#define AMDQB_POW2_AT_LEAST(n)                                                                     \
  ((n) <= 1 ? 1 : (n) <= 2 ? 2 : (n) <= 4 ? 4 : (n) <= 8 ? 8 : (n) <= 16 ? 16 : (n) <= 32 ? 32 : 64)

constexpr int E = AMDQB_NUM_EXPERTS;
constexpr int K = AMDQB_TOPK;
constexpr int L = AMDQB_ROW_LANES;
constexpr int V = AMDQB_SLOTS;
constexpr bool CONTIGUOUS = AMDQB_CONTIGUOUS != 0;
constexpr bool ROUNDS = AMDQB_ROW_ROUNDS != 0;  // the row's Top-k by rounds of a butterfly max
constexpr int GROUPS = AMDQB_GROUPS;
constexpr int GROUP_LANES = AMDQB_GROUP_LANES;
constexpr int TOPK_GROUP = AMDQB_TOPK_GROUP;
constexpr int GROUP_BEST = AMDQB_GROUP_BEST;  // entries a group's score sums
constexpr int GBP = AMDQB_POW2_AT_LEAST(GROUP_BEST);
constexpr bool DENSE = AMDQB_DENSE != 0;  // the TE router's outputs (probs, maps) over every expert
constexpr bool IN_MATH = AMDQB_IN_DTYPE_MATH != 0 && AMDQB_IN_DTYPE != 0;
constexpr int BLOCK = AMDQB_TOPK_BLOCK;
constexpr bool HAS_BIAS = AMDQB_BIAS_DTYPE >= 0;
constexpr bool SOFTMAX = AMDQB_SCORE == 2;
constexpr int ROWS = 32 / L;                   // token rows per logical warp
constexpr int KP = AMDQB_POW2_AT_LEAST(K);     // length of the sorted lists the lanes merge
constexpr int NSORT = AMDQB_POW2_AT_LEAST(V);  // the lane's sorting network
constexpr int SOFTMAX_LANES = E < 32 ? AMDQB_POW2_AT_LEAST(E) : 32;  // torch's warp-softmax lanes
// torch's warp-softmax lanes a row lane stands for (strided layout with fewer lanes: lane l holds
// the experts of torch's lanes l, l + L, ...; slot i belongs to torch's lane l + L * (i % SVL))
constexpr int SVL = SOFTMAX_LANES > L ? SOFTMAX_LANES / L : 1;
// Per-row LDS: the unbiased scores for the weights (bias), or the exponentials for the softmax sum
// of the contiguous layout.
constexpr bool ROW_LDS = HAS_BIAS || (SOFTMAX && CONTIGUOUS);
// The row's Top-k over the selection keys alone first (compact outputs, list merges), the exact
// entries only where the keys tie.
constexpr bool KEY_SELECT = AMDQB_KEY_SELECT != 0 && !DENSE && !ROUNDS;

static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "AMDQB_ROW_LANES: a power of two <= 32");
static_assert(L * V >= E, "the row's lanes must hold every expert");
static_assert(K >= 1 && K <= E && KP <= 32, "1 <= k <= min(E, 32)");
static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "AMDQB_TOPK_BLOCK: whole logical warps");
static_assert(V <= 64 && GROUP_BEST >= 1 && GROUP_BEST <= 32, "AMDQB_SLOTS / AMDQB_GROUP_BEST");
static_assert(GROUPS == 0 || CONTIGUOUS, "groups use the contiguous layout");
static_assert(GROUPS == 0 ||
                  (GROUPS * GROUP_LANES <= L && E % GROUPS == 0 && (E / GROUPS) == GROUP_LANES * V),
              "each group spans AMDQB_GROUP_LANES whole lanes");
static_assert(!(SOFTMAX && CONTIGUOUS) || L >= SOFTMAX_LANES,
              "the softmax sum needs torch's warp-softmax lanes inside the row");
static_assert(!(DENSE && !CONTIGUOUS) || L >= 8, "the strided bit map packs a byte per 8 lanes");

#if AMDQB_IN_DTYPE == 0
typedef float in_t;
AMDQB_DEVICE float in_f32(in_t x) { return x; }
AMDQB_DEVICE in_t out_of_f32(float x) { return x; }
#elif AMDQB_IN_DTYPE == 1
typedef u16 in_t;
AMDQB_DEVICE float in_f32(in_t x) { return half_to_float(x); }
AMDQB_DEVICE in_t out_of_f32(float x) { return float_to_half(x); }
#else
typedef u16 in_t;
AMDQB_DEVICE float in_f32(in_t x) { return bf16_to_float(x); }
AMDQB_DEVICE in_t out_of_f32(float x) { return float_to_bf16(x); }
#endif
// fp32 -> the logits dtype -> fp32 (IN_MATH's arithmetic in the input dtype), else the identity.
AMDQB_DEVICE float in_round(float x) { return IN_MATH ? in_f32(out_of_f32(x)) : x; }

#if AMDQB_BIAS_DTYPE == 1
typedef u16 bias_t;
AMDQB_DEVICE float bias_f32(bias_t x) { return half_to_float(x); }
#elif AMDQB_BIAS_DTYPE == 2
typedef u16 bias_t;
AMDQB_DEVICE float bias_f32(bias_t x) { return bf16_to_float(x); }
#else
typedef float bias_t;
AMDQB_DEVICE float bias_f32(bias_t x) { return x; }
#endif

// Expert of slot i of lane l of a row.
AMDQB_DEVICE int expert_at(int l, int i) { return CONTIGUOUS ? l * V + i : l + L * i; }

// ---- packed selection entries ----------------------------------------------------------------
AMDQB_DEVICE u64 entry(i32 key, i32 id) {
  return ((u64)((u32)key ^ 0x80000000u) << 32) | (u64)(~(u32)id);
}
AMDQB_DEVICE i32 entry_id(u64 p) { return (i32)(~(u32)p); }
AMDQB_DEVICE float entry_value(u64 p) { return key_value((i32)((u32)(p >> 32) ^ 0x80000000u)); }
AMDQB_DEVICE void order_desc(u64& a, u64& b) {
  const u64 hi = a > b ? a : b;
  const u64 lo = a > b ? b : a;
  a = hi;
  b = lo;
}
// Selection keys alone (the entries' high words): a max and a min, one instruction each.
AMDQB_DEVICE void order_desc(u32& a, u32& b) {
  const u32 hi = a > b ? a : b;
  const u32 lo = a > b ? b : a;
  a = hi;
  b = lo;
}
AMDQB_DEVICE u64 max_of(u64 a, u64 b) { return a > b ? a : b; }
AMDQB_DEVICE u32 max_of(u32 a, u32 b) { return a > b ? a : b; }
AMDQB_DEVICE u64 shfl_xor_u64(u64 v, int mask) {
  const u32 lo = (u32)shfl_xor_i32((int)(u32)v, mask);
  const u32 hi = (u32)shfl_xor_i32((int)(u32)(v >> 32), mask);
  return ((u64)hi << 32) | lo;
}
AMDQB_DEVICE u32 shfl_xor_any(u32 v, int mask) { return (u32)shfl_xor_i32((int)v, mask); }
AMDQB_DEVICE u64 shfl_xor_any(u64 v, int mask) { return shfl_xor_u64(v, mask); }
AMDQB_DEVICE u64 shfl_u64(u64 v, int src) {
  const u32 lo = (u32)shfl_i32((int)(u32)v, src);
  const u32 hi = (u32)shfl_i32((int)(u32)(v >> 32), src);
  return ((u64)hi << 32) | lo;
}

// Bitonic sort of a[0, N) into descending order (N a power of two).
template <typename T, int N>
AMDQB_DEVICE void sort_desc(T (&a)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          if ((i & size) == 0)
            order_desc(a[i], a[j]);
          else
            order_desc(a[j], a[i]);
        }
      }
    }
  }
}

// Sorts a bitonic a[0, N) into descending order.
template <typename T, int N>
AMDQB_DEVICE void merge_desc(T (&a)[N]) {
#pragma unroll
  for (int stride = N >> 1; stride > 0; stride >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((i & stride) == 0) order_desc(a[i], a[i + stride]);
  }
}

// The best M of a[0, N) (powers of two), sorted descending into a[0, M); the rest is scratch.
// M >= N is the full sort. Else every run of M is sorted descending (the bitonic stages up to
// M, the last one all descending), then runs merge pairwise, keeping their best M: a run and its
// partner reversed form a bitonic sequence whose element-wise maxima are the best M of both,
// bitonic again (one merge). N = 8, M = 2 (Mixtral's k = 2 on one thread per row): 7
// compare-exchanges and 6 maxima where the full sort takes 24 compare-exchanges.
template <int M, typename T, int N>
AMDQB_DEVICE void top_desc(T (&a)[N]) {
  if (M >= N) {
    sort_desc(a);
    return;
  }
#pragma unroll
  for (int size = 2; size <= M; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          if (size == M || (i & size) == 0)
            order_desc(a[i], a[j]);
          else
            order_desc(a[j], a[i]);
        }
      }
    }
  }
#pragma unroll
  for (int width = M; width < N; width <<= 1) {
#pragma unroll
    for (int base = 0; base < N; base += 2 * width) {
      T c[M < N ? M : 1];
#pragma unroll
      for (int i = 0; i < M && i < N; ++i) c[i] = max_of(a[base + i], a[base + width + M - 1 - i]);
      merge_desc(c);
#pragma unroll
      for (int i = 0; i < M && i < N; ++i) a[base + i] = c[i];
    }
  }
}

// The best N of the union of the caller's sorted list and that of lane (lane ^ mask), sorted:
// both partners end with the same list.
template <typename T, int N>
AMDQB_DEVICE void merge_with(T (&a)[N], int mask) {
  T c[N];
#pragma unroll
  for (int i = 0; i < N; ++i)
    c[i] = max_of(a[i], shfl_xor_any(a[N - 1 - i], mask));  // the partner's list, reversed
  merge_desc(c);
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = c[i];
}

// The row's best K, sorted, into every lane's a[0, K) (a[K, N) zero), from each lane's sorted
// list a[0, N) (N >= K): K rounds of a butterfly max over the row's L lanes; the lane that held
// the round's winner drops it (entries are distinct; 0 is the sentinel below every expert).
template <int N>
AMDQB_DEVICE void row_top_rounds(u64 (&a)[N]) {
  u64 out[N];
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = 0;
#pragma unroll
  for (int r = 0; r < K; ++r) {
    u64 best = a[0];
#pragma unroll
    for (int m = 1; m < L; m <<= 1) {
      const u64 other = shfl_xor_u64(best, m);
      best = other > best ? other : best;
    }
    out[r] = best;
    if (r + 1 < K) {
      const bool drop = best != 0 && a[0] == best;
#pragma unroll
      for (int i = 0; i + 1 < N; ++i) a[i] = drop ? a[i + 1] : a[i];
      a[N - 1] = drop ? 0 : a[N - 1];
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = out[i];
}

// The fp32 value of a selection key (an entry's high word).
AMDQB_DEVICE float value_of(u32 key) { return key_value((i32)(key ^ 0x80000000u)); }
AMDQB_DEVICE float value_of(u64 p) { return entry_value(p); }

// How many of the row's best K keys a[0, K) lie above x: the compares independent, summed in a
// tree (a member's rank).
template <int N>
AMDQB_DEVICE int count_above(const u32 (&a)[N], u32 x) {
  int c[KP];
#pragma unroll
  for (int r = 0; r < KP; ++r) c[r] = r < K && a[r] > x ? 1 : 0;
#pragma unroll
  for (int d = KP >> 1; d > 0; d >>= 1)
#pragma unroll
    for (int r = 0; r < d; ++r) c[r] += c[r + d];
  return c[0];
}

// The lane's part of the row's selection over T = u64 entries (exact) or u32 keys (their high
// words: equal keys come out in any order): the lane's best KP sorted into top[] (zero when its
// group is not kept); returns whether the lane's group is kept. Groups: each group's best
// GROUP_BEST over its lanes (sorted lists merged like the row's), its score (their values summed
// in selection order) and its rank among the groups (score descending, group id ascending).
template <typename T>
AMDQB_DEVICE bool row_select(const T (&mine)[V], T (&top)[KP], int rl, int rw) {
  T srt[NSORT];
#pragma unroll
  for (int i = 0; i < NSORT; ++i) srt[i] = i < V ? mine[i] : T(0);
  // the entries the row's lists need: its Top-KP, and a group's best GBP
  top_desc<(GROUPS > 0 && GBP > KP) ? GBP : KP>(srt);
#pragma unroll
  for (int i = 0; i < KP; ++i) top[i] = i < NSORT ? srt[i] : T(0);
  if (GROUPS == 0) return true;
  T best[GBP];
#pragma unroll
  for (int i = 0; i < GBP; ++i) best[i] = i < NSORT ? srt[i] : T(0);
#pragma unroll
  for (int m = 1; m < GROUP_LANES; m <<= 1) merge_with(best, m);
  float score = value_of(best[0]);
#pragma unroll
  for (int i = 1; i < GROUP_BEST; ++i) score = in_round(score + value_of(best[i]));
  const int group = rl / GROUP_LANES;
  const u64 gentry = group < GROUPS ? entry(order_key(score), group) : 0;
  int ahead = 0;
#pragma unroll
  for (int g = 0; g < GROUPS; ++g)
    ahead += shfl_u64(gentry, rw * L + g * GROUP_LANES) > gentry ? 1 : 0;
  const bool kept = group < GROUPS && ahead < TOPK_GROUP;
  if (!kept) {
#pragma unroll
    for (int i = 0; i < KP; ++i) top[i] = T(0);
  }
  return kept;
}

// Element-wise activation of V loaded logits; sigmoid: every element through the branch-free
// fast path first, the rare divisors outside its range (z below about -87.3, NaN) redone with the
// division after (amdqb_activation.h), so no slow-path CALL sits between two elements.
AMDQB_DEVICE void activate(const float (&z)[V], float (&s)[V]) {
#if AMDQB_SCORE == 0
  bool redo = false;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float d = sigmoid_divisor(z[i]);
    s[i] = sigmoid_fast(d);
    redo |= !sigmoid_fast_ok(d);
  }
  if (redo) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = sigmoid_divisor(z[i]);
      if (!sigmoid_fast_ok(d)) s[i] = 1.0f / d;
    }
  }
#elif AMDQB_SCORE == 1
#pragma unroll
  for (int i = 0; i < V; ++i) s[i] = sqrtsoftplus(z[i]);
#else
#pragma unroll
  for (int i = 0; i < V; ++i) s[i] = z[i];  // softmax: the row statistics follow
#endif
}

// Butterfly reductions over the row's first n lanes (n a power of two <= L).
template <int N>
AMDQB_DEVICE float row_sum(float v) {
#pragma unroll
  for (int m = N >> 1; m > 0; m >>= 1) v += shfl_xor_f32(v, m);
  return v;
}
AMDQB_DEVICE float row_max(float v) {
#pragma unroll
  for (int m = L >> 1; m > 0; m >>= 1) v = fmaxf(v, shfl_xor_f32(v, m));
  return v;
}

}  // namespace

// Arguments of amdqb_topk, passed by value (amdqb.backends.hip.topk.TopkParams mirrors it).
struct TopkParams {
  const void* logits;      // [T, E] in the logits dtype, rows row_stride elements apart
  const void* bias;        // [E] correction bias in AMDQB_BIAS_DTYPE (unused without)
  float* weights;          // nullable [T, out_k] fp32
  void* ids;               // nullable [T, out_k] int32 or int64 (flags bit 1)
  i32* token_expert_idx;   // nullable [T, K] int32: j * T + t (vLLM's fused_topk)
  const void* non_padded;  // nullable device scalar (int32, or int64 with flags bit 2)
  void* probs;             // dense: nullable [T, E] in the logits dtype
  void* map;               // dense: nullable, per map_kind
  float* scores;           // dense: nullable [T, E] fp32, the ranked scores before the bias
  i64 row_stride;
  i64 tokens;
  i64 non_padded_rows;  // rows at or past it get ids -1 when non_padded is NULL (else unused)
  i32 out_k;            // K + num_shared
  i32 num_shared;       // fused shared experts E .. E + num_shared - 1 in the last slots
  float scale;          // the routed weights' factor (1 for none)
  float shared_weight;  // shared experts' weight (flags bit 3 clear)
  float shared_div;     // flags bit 3: shared weight = routed sum / shared_div
  i32 flags;            // bit 0 renormalize, 1 int64 ids, 2 int64 non_padded, 3 shared from sum,
                        // 4 softmax over the k selected logits (no softmax over E)
  i32 map_kind;         // dense: 0 none, 1 byte map [T, E], 2 bit map [T, ceil(E / 8)],
                        // 3 / 4 / 5 int16 / int32 / int64 ids [T, K] in selection order
  i32 pad_;
};

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(BLOCK) amdqb_topk(TopkParams p) {
  constexpr int WARPS = BLOCK / 32;
  AMDQB_SHARED(float, sh_row, ROW_LDS ? WARPS * ROWS * E : 1);
  AMDQB_SHARED(u8, sh_bits, DENSE && CONTIGUOUS ? WARPS * ROWS * E : 1);
  AMDQB_SHARED(i32, sh_sel_id, KEY_SELECT ? WARPS * ROWS * KP : 1);
  AMDQB_SHARED(float, sh_sel_s, KEY_SELECT && HAS_BIAS ? WARPS * ROWS * KP : 1);
  const int lane = lane_id();
  const int w = warp_in_block();
  const int rl = lane % L;  // lane inside the token's row
  const int rw = lane / L;  // row inside the logical warp
  const i64 first = ((i64)blockIdx.x * (blockDim.x >> 5) + w) * ROWS;
  if (first >= p.tokens) return;  // uniform across the logical warp
  const i64 t = first + rw;
  const bool live = t < p.tokens;  // rows past T run along (warp primitives), store nothing
  float* my_row = sh_row + (w * ROWS + rw) * E;
  u8* my_bits = sh_bits + (w * ROWS + rw) * E;
  (void)my_row;
  (void)my_bits;
  const bool post_softmax = SOFTMAX && (p.flags & 16);  // TE: top-k of the logits, then softmax

  // Logits and bias: every load in flight before any arithmetic.
  const in_t* row = static_cast<const in_t*>(p.logits) + (live ? t : 0) * p.row_stride;
  in_t raw[V];
  float b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = expert_at(rl, i);
    const bool valid = live && e < E;
    raw[i] = valid ? row[e] : in_t(0);
    b[i] = 0.0f;
    if (HAS_BIAS && valid) b[i] = bias_f32(static_cast<const bias_t*>(p.bias)[e]);
  }
#pragma unroll
  for (int i = 0; i < V; ++i) keep_loaded(raw[i]);
  float z[V], s[V];
#pragma unroll
  for (int i = 0; i < V; ++i) z[i] = in_f32(raw[i]);
  activate(z, s);

  if (SOFTMAX && !post_softmax) {
    // the row's maximum as a tree (its order only decides the sign of a zero maximum, which
    // e^(s - m) does not see)
    float mx[NSORT];
#pragma unroll
    for (int i = 0; i < NSORT; ++i)
      mx[i] = i < V && expert_at(rl, i) < E ? s[i < V ? i : 0] : bits_float(0xff800000u);
#pragma unroll
    for (int d = NSORT >> 1; d > 0; d >>= 1)
#pragma unroll
      for (int i = 0; i < d; ++i) mx[i] = fmaxf(mx[i], mx[i + d]);
    const float m = row_max(mx[0]);
    float ex[V];  // padding slots 1: a quotient inside the fast path's range
#pragma unroll
    for (int i = 0; i < V; ++i) ex[i] = expert_at(rl, i) < E ? expf(s[i] - m) : 1.0f;
    float sum = 0.0f;
    if (!CONTIGUOUS) {  // lane l holds experts l, l + L, ...: torch's order
      // each of torch's lanes this lane stands for adds its experts in order; the butterfly's
      // steps between them (d >= L) run in registers, the rest over the row's lanes
      // (each sum starts at its first exponential: 0 + x is x, an exponential is never -0)
      float part[SVL];
#pragma unroll
      for (int j = 0; j < SVL; ++j)
        part[j] = j < V && expert_at(rl, j) < E ? ex[j < V ? j : 0] : 0.0f;
#pragma unroll
      for (int i = SVL; i < V; ++i)
        if (expert_at(rl, i) < E) part[i % SVL] += ex[i];
#pragma unroll
      for (int d = SVL >> 1; d > 0; d >>= 1)
#pragma unroll
        for (int j = 0; j < SVL; ++j)
          if ((j & d) == 0) part[j] = part[j] + part[j + d];
      sum = row_sum<(SOFTMAX_LANES < L ? SOFTMAX_LANES : L)>(part[0]);
    } else {  // the exponentials through the row's LDS, re-read in torch's order
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (expert_at(rl, i) < E) my_row[expert_at(rl, i)] = ex[i];
      warp_sync();
      if (rl < SOFTMAX_LANES)
        for (int e = rl; e < E; e += SOFTMAX_LANES) sum += my_row[e];
      sum = row_sum<SOFTMAX_LANES>(sum);
      warp_sync();  // the row's LDS is rewritten below
    }
    divide_range<0, V>(ex, sum);
#pragma unroll
    for (int i = 0; i < V; ++i) s[i] = ex[i];
  }
  if (IN_MATH) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      s[i] = in_round(s[i]);
      b[i] = in_round(b[i]);
    }
  }

  // Selection keys (the entries' high words; 0 also where a slot holds no expert) and the
  // entries (order key, ~id) built from them where the exact order is needed.
  u32 ukey[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {  // a select, not a branch per slot
    const u32 key = (u32)order_key(HAS_BIAS ? in_round(s[i] + b[i]) : s[i]) ^ 0x80000000u;
    ukey[i] = live && expert_at(rl, i) < E ? key : 0u;
  }
  auto entries = [&](u64(&mine)[V]) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = expert_at(rl, i);
      mine[i] = live && e < E ? ((u64)ukey[i] << 32) | (u64)(~(u32)e) : 0;
    }
  };

  // Routes r < k: every lane of the row ends with the row's sorted top[] and the routes' unbiased
  // weights wk[] (their sum in routes_sum's order below, in registers, so that each lane can
  // write any route).
  u64 top[KP];
  float wk[KP];
  bool kept = true;   // the lane's group is among the kept ones (dense outputs)
  float zmax = 0.0f;  // post softmax: the largest selected logit
  bool exact = true;
  if (KEY_SELECT) {
    // The row's best keys alone (the entries' high words: one-instruction compares), exact
    // where they are distinct, nonzero and the k-th key belongs to one expert only; else (a
    // tie, a NaN or too few kept experts in some row of the logical warp) the entries below.
    u32 key[V];
#pragma unroll
    for (int i = 0; i < V; ++i) key[i] = ukey[i];
    u32 kt[KP];
    if (!row_select(key, kt, rl, rw)) {
#pragma unroll
      for (int i = 0; i < V; ++i) key[i] = 0;
    }
#pragma unroll
    for (int m = 1; m < L; m <<= 1) merge_with(kt, m);
    const u32 kth = kt[K - 1];
    bool fast = kth != 0;
#pragma unroll
    for (int r = 0; r + 1 < K; ++r) fast = fast && kt[r] > kt[r + 1];
    int same = 0;  // this lane's experts with the k-th key
#pragma unroll
    for (int i = 0; i < V; ++i) same += key[i] == kth ? 1 : 0;
    const u32 row_bits = L == 32 ? ~0u : ((1u << L) - 1u) << (rw * L);
    const u32 holders = ballot32(same != 0) & row_bits;
    const u32 multiple = ballot32(same > 1) & row_bits;
    fast = !live || (fast && popc32(holders) == 1 && multiple == 0);
    exact = ballot32(!fast) != 0;  // the same in every lane of the logical warp
    if (exact) AMDQB_TRACE_TIED_KEYS();
    if (!exact) {
      // Each route's expert (and unbiased score) at its rank: a lane that holds a whole row
      // selects them in registers, rows of several lanes exchange them through the row's LDS.
      i32 rid[KP];
      float rs[KP];
#pragma unroll
      for (int r = 0; r < KP; ++r) {
        rid[r] = 0;
        rs[r] = 0.0f;
      }
      i32* sel_id = sh_sel_id + (w * ROWS + rw) * KP;
      float* sel_s = sh_sel_s + (w * ROWS + rw) * KP;
      (void)sel_id;
      (void)sel_s;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const bool member = key[i] != 0 && key[i] >= kth;
        if (L > 1 && K > 4 && ballot32(member) == 0) continue;  // no route in this slot
        if (member) {
          const int rank = count_above(kt, key[i]);
          if (L == 1) {
#pragma unroll
            for (int r = 0; r < K; ++r) {
              rid[r] = rank == r ? expert_at(rl, i) : rid[r];
              rs[r] = rank == r ? s[i] : rs[r];
            }
          } else {
            sel_id[rank] = expert_at(rl, i);
            if (HAS_BIAS) sel_s[rank] = s[i];
          }
        }
      }
      if (L > 1) {
        warp_sync();
#pragma unroll
        for (int r = 0; r < K; ++r) {
          if (r % L == rl) rid[r] = sel_id[r];  // route r is lane r % L's to write
          if (HAS_BIAS) rs[r] = sel_s[r];
        }
      }
#pragma unroll
      for (int r = 0; r < KP; ++r) {
        top[r] = 0;
        wk[r] = 0.0f;
        if (r < K) {
          top[r] = ((u64)kt[r] << 32) | (u64)(~(u32)rid[r]);
          wk[r] = HAS_BIAS ? rs[r] : value_of(kt[r]);
        }
      }
    }
  }
  if (exact) {
    // The unbiased scores go to the row's LDS for the compact weights.
    if (HAS_BIAS) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (live && expert_at(rl, i) < E) my_row[expert_at(rl, i)] = s[i];
    }
    u64 mine[V];
    entries(mine);
    kept = row_select(mine, top, rl, rw);
    if (ROUNDS) {
      row_top_rounds(top);
    } else {
#pragma unroll
      for (int m = 1; m < L; m <<= 1) merge_with(top, m);
    }
    if (HAS_BIAS) warp_sync();  // the row's scores are in LDS
    zmax = entry_value(top[0]);
#pragma unroll
    for (int r = 0; r < KP; ++r) {
      wk[r] = 0.0f;
      if (r < K) {
        wk[r] = HAS_BIAS ? my_row[entry_id(top[r])] : entry_value(top[r]);
        if (post_softmax) wk[r] = expf(wk[r] - zmax);
      }
    }
  }
  float acc[KP];
#pragma unroll
  for (int r = 0; r < KP; ++r) acc[r] = wk[r];
#pragma unroll
  for (int d = KP >> 1; d > 0; d >>= 1)
#pragma unroll
    for (int r = 0; r < KP; ++r)
      if ((r & d) == 0) acc[r] = acc[r] + acc[r + d];
  const float sum = acc[0];
  const bool renorm = (p.flags & 1) || post_softmax;
  const float divisor = post_softmax ? sum : sum + 1e-20f;
  auto weight = [&](float v) { return (renorm ? quotient(v, divisor) : v) * p.scale; };

  if (DENSE) {
    // The dense outputs of this lane's experts: members are the kept entries at or ahead of the
    // k-th (entries are distinct); weights from the lane's own scores, as the routes'.
    const u64 kth = top[K - 1];
    u64 mine[V];
    entries(mine);
    bool member[V];
#pragma unroll
    for (int i = 0; i < V; ++i) member[i] = kept && mine[i] != 0 && mine[i] >= kth;
    if (p.map_kind == 2) {  // bit e % 8 of byte e / 8: one ballot per slot (strided rows)
      if (!CONTIGUOUS) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const u32 bits =
              (u32)(((u64)ballot32(member[i]) >> (rw * L)) & (L == 32 ? ~0u : (1u << L) - 1u));
          const int byte = L * i / 8 + rl;
          if (live && rl < (L + 7) / 8 && byte < (E + 7) / 8)
            static_cast<u8*>(p.map)[t * ((E + 7) / 8) + byte] = (u8)((bits >> (8 * rl)) & 0xffu);
        }
      } else {  // the row's flags through LDS, packed a byte per lane step
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (expert_at(rl, i) < E) my_bits[expert_at(rl, i)] = member[i] ? 1 : 0;
        warp_sync();
        for (int byte = rl; byte < (E + 7) / 8; byte += L) {
          u32 v = 0;
          for (int j = 0; j < 8 && byte * 8 + j < E; ++j) v |= (u32)my_bits[byte * 8 + j] << j;
          if (live) static_cast<u8*>(p.map)[t * ((E + 7) / 8) + byte] = (u8)v;
        }
      }
    }
    if (!live) return;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int e = expert_at(rl, i);
      if (e >= E) continue;
      const i64 at = t * E + e;
      if (p.probs != nullptr) {
        const float v = post_softmax ? expf(z[i] - zmax) : s[i];
        static_cast<in_t*>(p.probs)[at] = out_of_f32(member[i] ? weight(v) : 0.0f);
      }
      if (p.map_kind == 1) static_cast<u8*>(p.map)[at] = member[i] ? 1 : 0;
      if (p.scores != nullptr) p.scores[at] = s[i];
    }
#pragma unroll
    for (int r = 0; r < K; ++r) {
      if (r % L != rl) continue;  // route r is lane r % L's to write
      const i64 o = t * K + r;
      const int id = entry_id(top[r]);
      if (p.map_kind == 3) static_cast<i16*>(p.map)[o] = (i16)id;
      if (p.map_kind == 4) static_cast<i32*>(p.map)[o] = id;
      if (p.map_kind == 5) static_cast<i64*>(p.map)[o] = (i64)id;
    }
    return;
  }

  if (!live) return;
  // the routes' weights, every quotient of the row through the fast path first
  if (renorm) divide_range<0, K>(wk, divisor);
  const bool padded_row =
      p.non_padded != nullptr
          ? t >= ((p.flags & 4) ? static_cast<const i64*>(p.non_padded)[0]
                                : (i64) static_cast<const i32*>(p.non_padded)[0])
          : t >= p.non_padded_rows;
  const i64 o = t * p.out_k;
  auto store = [&](int r, i64 out_id, float out_w) {
    if (padded_row) out_id = -1;
    p.weights[o + r] = out_w;
    if (p.flags & 2)
      static_cast<i64*>(p.ids)[o + r] = out_id;
    else
      static_cast<i32*>(p.ids)[o + r] = (i32)out_id;
  };
#pragma unroll
  for (int r = 0; r < K; ++r) {
    if (r % L != rl) continue;  // route r is lane r % L's to write
    store(r, entry_id(top[r]), wk[r] * p.scale);
    if (p.token_expert_idx != nullptr) p.token_expert_idx[t * K + r] = (i32)(r * p.tokens + t);
  }
  // fused shared experts E + (r - K), r = K .. out_k - 1, each by lane r % L
  const float shared_w = (p.flags & 8) ? quotient(sum, p.shared_div) : p.shared_weight;
  for (int r = K + ((rl - K % L + L) % L); r < p.out_k; r += L) store(r, E + (r - K), shared_w);
}
