// The one kernel parameter of amdqb_router and amdqb_router_decode, passed by value.
//
// Mirrored field for field, in this order, by amdqb.backends.hip._spec.RouterParams (a
// ctypes.Structure the launcher fills); op_tests/test_router_abi.py compiles this header and
// checks every offset and the size against it. Plain C types only (no prelude typedefs), so that
// the host compiler that checks the layout sees exactly what the kernel compilers see. Pointers
// may be null where the field's comment says so.
//
// Cost: the AMD compilers load the structure's fields in wide scalar blocks, about 20 more SGPRs
// in amdqb_router_decode than 21 scalar parameters took (docs/amd_occupancy.md: at E=896 no
// occupancy changes; gfx950's E=129 decode kernel runs 7 waves per SIMD instead of 8).
#pragma once

namespace amdqb {

struct RouterParams {
  const void* logits;       // [T, E] in the logits dtype (AMDQB_IN_DTYPE)
  int num_tokens;           // T
  const float* bias;        // [E], or null
  int topk;                 // k
  int nsel;                 // experts selected: k, or k + 1 under QB
  int normalize;            // p = s / (sum of the k selected s + 1e-20)
  int softmax_pre;          // softmax over E before Top-k (else over the k selected logits)
  float scale;              // multiplies the weights last
  void* probs;              // [T, E] in the logits dtype, or null
  void* map;                // per map_kind (byte map, bit map, [T, k] indices), or null
  int map_kind;             // 0 none, 1 byte map, 2 bit map, 3/4/5 int16/32/64 indices
  int qb_mode;              // 0 none, 1 fused atomics, 2 two kernels
  int* hist;                // QB histogram [E, B] (fused / log_margin modes), or null
  const float* bounds;      // QB bounds [2], or null
  int num_bins;             // B
  float* alpha_out;         // [T] the QB cutoff of every token, or null
  float* w_out;             // [T, topk] fp32 weights (serving form), or null
  int* id_out;              // [T, topk] int32 ids (serving form), or null
  int qb_binning;           // 0 uniform, 1 log_margin
  int margin_bits;          // log_margin: 2^margin_bits bins per octave
  unsigned char* bins_out;  // [T, E] log_margin bins of the two-kernel mode, or null
};

}  // namespace amdqb
