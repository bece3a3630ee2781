// Backward of the fused router (TransformerEngine's formulas, amdqb.backends.torch.router_bwd):
// the gradient to the logits from the gradient to the probs, through the normalisation over the
// routed experts and the activation. The routed set comes from the forward (its routing map).
//
// Compile-time constants (-D, amdqb.backends.hip._spec.router_bwd_module):
//   AMDQB_NUM_EXPERTS (E), AMDQB_IN_DTYPE (the logits' dtype: 0 fp32, 1 fp16, 2 bf16),
//   AMDQB_GRAD_DTYPE (grad_probs' dtype, the same codes), AMDQB_SCORE (0 sigmoid, 1 sqrtsoftplus,
//   2 softmax), AMDQB_ROW_LANES (L, a power of two <= 32), AMDQB_SLOTS (V = ceil(E / L)).
//
// One row of L lanes per token (lane l holds experts l + L * i), several tokens per logical warp
// when E is small; the row sums are butterflies over the row's lanes. Precision: fp32, without
// contraction; the activations are torch's (amdqb_activation.h); the sums' order differs from
// torch's (the results agree to fp32 rounding, not bit for bit).
//   g = grad_probs * scale, 0 off the routed set;
//   softmax, pre:  act = softmax(z) over E, grad = act * (g - sum(g * act));
//   softmax, post: act = softmax over the routed logits (0 elsewhere), the same formula;
//   sigmoid / sqrtsoftplus: with k > 1, d = sum_routed act + 1e-20,
//     g = g / d - sum(g * act) / d^2 on the routed set; then times act * (1 - act) (sigmoid) or
//     dsoftplus / (2 act + 1e-20), dsoftplus = 1 for z > 20 else sigmoid(z) (sqrtsoftplus).
#include "amdqb_prelude.h"
#include "amdqb_activation.h"

using namespace amdqb;

#if !defined(AMDQB_NUM_EXPERTS) || !defined(AMDQB_IN_DTYPE) || !defined(AMDQB_GRAD_DTYPE) ||       \
    !defined(AMDQB_SCORE) || !defined(AMDQB_ROW_LANES) || !defined(AMDQB_SLOTS)
#error "router_bwd.hip needs its -D constants (amdqb.backends.hip._spec.router_bwd_module)"
#endif

namespace {

constexpr int E = AMDQB_NUM_EXPERTS;
constexpr int L = AMDQB_ROW_LANES;
constexpr int V = AMDQB_SLOTS;
constexpr int ROWS = 32 / L;
static_assert(L >= 1 && L <= 32 && (L & (L - 1)) == 0, "AMDQB_ROW_LANES: a power of two <= 32");
static_assert(L * V >= E, "the row's lanes must hold every expert");

#if AMDQB_IN_DTYPE == 0
typedef float in_t;
AMDQB_DEVICE float in_f32(in_t x) { return x; }
#elif AMDQB_IN_DTYPE == 1
typedef u16 in_t;
AMDQB_DEVICE float in_f32(in_t x) { return half_to_float(x); }
#else
typedef u16 in_t;
AMDQB_DEVICE float in_f32(in_t x) { return bf16_to_float(x); }
#endif
#if AMDQB_GRAD_DTYPE == 0
typedef float grad_t;
AMDQB_DEVICE float grad_f32(grad_t x) { return x; }
#elif AMDQB_GRAD_DTYPE == 1
typedef u16 grad_t;
AMDQB_DEVICE float grad_f32(grad_t x) { return half_to_float(x); }
#else
typedef u16 grad_t;
AMDQB_DEVICE float grad_f32(grad_t x) { return bf16_to_float(x); }
#endif

AMDQB_DEVICE float row_sum(float v) {
#pragma unroll
  for (int m = L >> 1; m > 0; m >>= 1) v += shfl_xor_f32(v, m);
  return v;
}
[[maybe_unused]] AMDQB_DEVICE float row_max(float v) {
#pragma unroll
  for (int m = L >> 1; m > 0; m >>= 1) v = fmaxf(v, shfl_xor_f32(v, m));
  return v;
}

}  // namespace

// Arguments of amdqb_router_bwd (amdqb.backends.hip.router_bwd.RouterBwdParams mirrors it).
struct RouterBwdParams {
  const void* grad_probs;  // [T, E] in AMDQB_GRAD_DTYPE
  const void* logits;      // [T, E] in AMDQB_IN_DTYPE
  const u8* routed;        // [T, E] bool
  float* grad_logits;      // [T, E] fp32
  i64 tokens;
  i32 topk;
  i32 use_pre_softmax;
  float scale;
  i32 pad_;
};

AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(256) amdqb_router_bwd(RouterBwdParams p) {
  const int lane = lane_id();
  const int rl = lane % L;
  const int rw = lane / L;
  const i64 first = ((i64)blockIdx.x * (blockDim.x >> 5) + warp_in_block()) * ROWS;
  if (first >= p.tokens) return;  // uniform across the logical warp
  const i64 t = first + rw;
  const bool live = t < p.tokens;  // rows past T run along (warp primitives), store nothing
  const i64 base = (live ? t : 0) * E;
  const in_t* zrow = static_cast<const in_t*>(p.logits) + base;
  const grad_t* grow = static_cast<const grad_t*>(p.grad_probs) + base;
  float z[V], g[V];
  bool on[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = rl + L * i;
    const bool valid = live && e < E;
    z[i] = valid ? in_f32(zrow[e]) : 0.0f;
    g[i] = valid ? grad_f32(grow[e]) : 0.0f;
    on[i] = valid && p.routed[base + e] != 0;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) g[i] = on[i] ? g[i] * p.scale : 0.0f;

  float out[V];
#if AMDQB_SCORE == 2
  // act: softmax over every expert (pre) or over the routed ones (post); grad = act (g - <g, act>)
  const bool pre = p.use_pre_softmax != 0;
  float m = bits_float(0xff800000u);  // -inf
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const bool counts = pre ? (live && rl + L * i < E) : on[i];
    if (counts) m = fmaxf(m, z[i]);
  }
  m = row_max(m);
  float act[V], sum = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const bool counts = pre ? (live && rl + L * i < E) : on[i];
    act[i] = counts ? expf(z[i] - m) : 0.0f;
    sum += act[i];
  }
  sum = row_sum(sum);
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    act[i] = act[i] / sum;
    dot += g[i] * act[i];
  }
  dot = row_sum(dot);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = (pre || on[i]) ? act[i] * (g[i] - dot) : 0.0f;
#else
  float act[V];
#pragma unroll
  for (int i = 0; i < V; ++i) act[i] = AMDQB_SCORE == 0 ? sigmoid(z[i]) : sqrtsoftplus(z[i]);
  if (p.topk > 1) {
    float denom = 0.0f, weighted = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float a = on[i] ? act[i] : 0.0f;
      denom += a;
      weighted += g[i] * a;
    }
    denom = row_sum(denom) + 1e-20f;
    weighted = row_sum(weighted);
#pragma unroll
    for (int i = 0; i < V; ++i) g[i] = on[i] ? g[i] / denom - weighted / (denom * denom) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
#if AMDQB_SCORE == 0
    out[i] = g[i] * act[i] * (1.0f - act[i]);
#else
    const float dsoft = z[i] > 20.0f ? 1.0f : sigmoid(z[i]);
    out[i] = g[i] * dsoft / (2.0f * act[i] + 1e-20f);
#endif
  }
#endif
  if (!live) return;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = rl + L * i;
    if (e < E) p.grad_logits[base + e] = out[i];
  }
}
