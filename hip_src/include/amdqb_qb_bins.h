// Quantile Balancing histogram bins, in fp32 without contraction:
//   uniform (K3, amdqb.ref.router.qb_bin_index): r = alpha - s_j, scale = fp32(B) / (U - L),
//     bin = clamp(floor((r - L) * scale), 0, B - 1); a NaN r counts in bin 0;
//   log_margin (amdqb.ref.router.qb_margin_bin_index): the biased margin d = alpha - u_j on expert
//     j's own axis (inv_j, the reciprocal of its scale): the half-octave level
//     L = ((bits(1 + |d| * inv_j) & 0x7fffffff) >> 22) - 254, the key L on the F fine keys and
//     F + ((L - F) >> 3) beyond (4-octave coarse keys, at least 0); d > 0 counts in bin B/2 + 1 + min(key, B/2 - 2), d < 0 in
//     B/2 - 1 - min(key, B/2 - 1), d == 0 in bin B/2; a NaN d counts in bin 0. A fine-key pair's
//     position inside its bin feeds the histogram's in-bin moments (margin_bin_at).
#pragma once

#include "amdqb_activation.h"

namespace amdqb {

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

// A token's QB cutoff with the per-token constants of the bin fast path below (computed once per
// token, used for its E experts).
struct QbCut {
  float alpha;   // the (k+1)-th biased score
  float pos0;    // (alpha - lower) * scale: the bin position of a zero score
  float margin;  // error bound of the fast bin position (NaN or inf: the fast path is off)
};

// x = pos0 - s * scale (one FMA) differs from the exact position fl(fl(fl(alpha - s_exact) - lower)
// * scale) by at most |scale| * AMDQB_APPROX_SIGMOID_ERR plus the roundings of both paths: 2^-24
// times |scale| (|alpha - lower| + |alpha| + 1 + |alpha| + 1 + |lower|) + |pos0| + |x| + |x_exact|,
// with |x|, |x_exact| <= |pos0| + 2 |scale| (scores lie in [0, 1]). The margin takes 16 units of
// 2^-24 on each term where 3 suffice, which also covers the roundings of the margin and of
// x +- margin.
AMDQB_DEVICE QbCut qb_cut(float alpha, float lower, float scale) {
  QbCut c;
  c.alpha = alpha;
  c.pos0 = (alpha - lower) * scale;
  constexpr float kSlack = 1.0f / 1048576.0f;  // 2^-20
  const float as = fabsf(scale);
  c.margin = as * (AMDQB_APPROX_SIGMOID_ERR + kSlack * (fabsf(alpha) + 1.0f + fabsf(lower))) +
             kSlack * (fabsf(c.pos0) + 2.0f * as);
  return c;
}

// Fast path of the QB bin of the expert with logit z: true (and bin set) when no integer lies
// within the margin of the approximate position x, so that the exact position, within the margin
// of x, has the same floor; false -- the exact formula decides -- near a bin edge (about 2 margins
// per bin, rare) and for any non-finite value (NaN compares unequal, so lo is a number where it is
// used; inf - inf is NaN). It spends one FMA and two hardware approximations per element instead
// of the library exp and the IEEE division.
AMDQB_DEVICE bool qb_bin_fast(const QbCut& c, float z, float scale, int num_bins, int& bin) {
  const float x = fmaf(-sigmoid_bounded_approx(z), scale, c.pos0);
  const float lo = floorf(x - c.margin);
  if (lo == floorf(x + c.margin)) {
    bin = clamp_bin(lo, num_bins);
    return true;
  }
  return false;
}

// QB bin of the expert with logit z for the token cutoff c: bit for bit
// qb_bin(c.alpha - sigmoid(z), lower, scale, num_bins).
AMDQB_DEVICE int qb_bin_of_logit(const QbCut& c, float z, float lower, float scale, int num_bins) {
  int bin;
  if (qb_bin_fast(c, z, scale, num_bins, bin)) return bin;
  return qb_bin(c.alpha - sigmoid(z), lower, scale, num_bins);
}

// log_margin bin of the biased margin d: inv = 1/eps of the expert's margin axis, half = B / 2,
// fine = F (amdqb.ref.router.margin_fine_keys), and the margin's position inside its bin
// (amdqb.ref.router.qb_margin_in_bin): u, the top kMomentBits of y's 22 fraction bits below its
// half-octave level (255 - u for d < 0: those bins descend with |d|), -1 off the fine keys (d
// zero or NaN, a coarse or clamped key). Integer arithmetic on the float bits: the same bin on
// every device. Selects, no branches: the router bins every (token, expert) pair, and a branch
// per pair kept each pair's axis load behind its own test (sm_90: one L1 round trip per pair).
// Callers that do not use u leave its instructions to dead-code elimination.
constexpr int kMomentBits = 8;  // amdqb.ref.router.MARGIN_MOMENT_BITS
constexpr int kMomentMax = (1 << kMomentBits) - 1;
struct MarginBin {
  int bin;
  int u;
};
AMDQB_DEVICE MarginBin margin_bin_at(float d, float inv, int half, int fine) {
  const float y = 1.0f + fabsf(d) * inv;
  // |y|'s bits: a NaN y (unchecked bounds) is the same bin on every device whatever its sign bit
  const u32 bits = float_bits(y) & 0x7fffffffu;
  const int level = (int)(bits >> 22) - 254;
  int key = level < fine ? level : fine + ((level - fine) >> 3);
  key = key < 0 ? 0 : key;  // y >= 1 for every valid scale; unchecked bounds stay in the row
  const int up = half + 1 + (key < half - 2 ? key : half - 2);
  const int down = half - 1 - (key < half - 1 ? key : half - 1);
  const int bin = d > 0.0f ? up : d == 0.0f ? half : down;  // d == 0: the token's own cutoff
  const int pos = (int)(bits >> (22 - kMomentBits)) & kMomentMax;
  const bool on_fine = level >= 0 && level < fine && d != 0.0f && d == d;
  MarginBin m;
  m.bin = d != d ? 0 : bin;
  m.u = on_fine ? (d < 0.0f ? kMomentMax - pos : pos) : -1;
  return m;
}

}  // namespace amdqb
