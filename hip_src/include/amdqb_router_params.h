// The one kernel parameter of amdqb_router and amdqb_router_decode, passed by value.
//
// Mirrored field for field, in this order, by amdqb.backends.hip._spec.RouterParams (a
// ctypes.Structure the launcher fills); op_tests/test_router_abi.py compiles this header and
// checks every offset and the size against it. Plain C types only (no prelude typedefs), so that
// the host compiler that checks the layout sees exactly what the kernel compilers see. Pointers
// may be null where the field's comment says so.
#pragma once

namespace amdqb {

struct RouterParams {
  const void* logits;       // [T, E] in the logits dtype (AMDQB_IN_DTYPE)
  const float* bias;        // [E], or null
  void* probs;              // [T, E] in the logits dtype, or null
  void* map;                // per map_kind (byte map, bit map, [T, k] indices), or null
  int* hist;                // QB histogram [E, B] (fused / log_margin modes), or null
  const float* bounds;      // QB bounds [2], or null
  float* alpha_out;         // [T] the QB cutoff of every token, or null
  float* w_out;             // [T, topk] fp32 weights (serving form), or null
  int* id_out;              // [T, topk] int32 ids (serving form), or null
  unsigned char* bins_out;  // [T, E] log_margin bins of the two-kernel mode, or null
  float* scores_out;        // [T, E] fp32 scores before the bias, or null
  int num_tokens;           // T
  int topk;                 // k
  int nsel;                 // experts selected: k, or k + 1 under QB
  int normalize;            // p = s / (sum of the k selected s + 1e-20)
  int softmax_pre;          // softmax over E before Top-k (else over the k selected logits)
  int map_kind;             // 0 none, 1 byte map, 2 bit map, 3/4/5 int16/32/64 indices
  int qb_mode;              // 0 none, 1 fused atomics, 2 two kernels
  int num_bins;             // B
  int qb_binning;           // 0 uniform, 1 log_margin
  int margin_bits;          // log_margin: 2^margin_bits bins per octave
  float scale;              // multiplies the weights last
};

}  // namespace amdqb
