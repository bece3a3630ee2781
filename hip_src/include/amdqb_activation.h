// Element-wise router activations, fp32, bit for bit what torch computes on the same device:
//   sigmoid(z)      = 1 / (1 + e^-z), IEEE division, e^-z from the library expf (libdevice
//                     __nv_expf under NVRTC / nvcc, ocml's __ocml_exp_f32 under HIP), as
//                     torch.sigmoid's kernels compute it;
//   sqrtsoftplus(z) = sqrt(softplus(z)), softplus(z) = z for z > 20 (torch's threshold), else
//                     log1pf(expf(z)); IEEE sqrtf.
// Compile with fp contraction off (the flags of amdqb.backends.hip._spec do).
//
// AMDQB_APPROX_ACTIVATION=1 is the explicit opt-in approximate form: e^-z through the hardware
// 2^x of -z * log2(e) (ex2.approx / v_exp_f32, the lowering of Triton's tl.exp), a few 2^-22 from
// the true sigmoid and no longer torch's bits.
#pragma once

#include "amdqb_prelude.h"

#ifndef AMDQB_APPROX_ACTIVATION
// 0: exact (torch's bits); 1: the opt-in approximation
#error "AMDQB_APPROX_ACTIVATION must be defined (0 or 1)"
#endif

// |sigmoid_bounded_approx(z) - sigmoid(z)| <= AMDQB_APPROX_SIGMOID_ERR for every finite z: both
// lie within a few 2^-22 (absolute) of the true sigmoid -- the hardware 2^x's relative error, and
// that of rounding its argument z * log2(e) (|z| * 2^-24 relative, times s (1 - s) <= e^-|z|),
// scaled by s (1 - s) <= 1/4; the reciprocal's by s <= 1; flushed denormals below 2^-126 -- so
// 2^-19 leaves a wide margin. The CPU emulator, whose exp2 is nearly exact, sets a larger bound
// and perturbs its approximation up to it (op_tests/hip_emu/amdqb_emu.h), so that the CPU tests
// fail if a caller ever trusts a result the bound does not cover.
#ifndef AMDQB_APPROX_SIGMOID_ERR
#define AMDQB_APPROX_SIGMOID_ERR (1.0f / 524288.0f)
#endif

namespace amdqb {

constexpr float kLog2e = 1.44269504088896341f;

// 1 + e^-z: the divisor of the sigmoid.
AMDQB_DEVICE float sigmoid_divisor(float z) {
#if AMDQB_APPROX_ACTIVATION
  return 1.0f + approx_exp2(z * -kLog2e);
#else
  return 1.0f + expf(-z);
#endif
}

// On NVIDIA, ptxas expands an IEEE division into a fast path -- the hardware reciprocal and one
// Newton step, used when the divisor's exponent is in range -- and a CALL to a slow path; with one
// call per expert the scheduler cannot interleave the experts' arithmetic (28 call sites per token
// at E = 896). sigmoid_fast writes that fast path out: the same instructions, so the same bits, for
// every divisor d = 1 + e^-z in [1, 2^126) (the exponent range ptxas sends to its fast path
// includes it). sigmoid_fast_ok(d) says when it applies: false for d >= 2^126 (z below about
// -87.3) and NaN, where the division is used. -DAMDQB_SIGMOID_DIVISION_ONLY=1 turns the fast path
// off (the test that proves both give the same bits builds that variant).
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

AMDQB_DEVICE float sigmoid(float z) {
  const float d = sigmoid_divisor(z);
  return sigmoid_fast_ok(d) ? sigmoid_fast(d) : 1.0f / d;
}

AMDQB_DEVICE float sqrtsoftplus(float z) {
  const float sp = z > 20.0f ? z : log1pf(expf(z));  // torch's softplus, threshold 20
  return sqrtf(sp);
}

// The bounded approximation of the sigmoid (hardware 2^x and reciprocal), for callers that check
// the bound and fall back to sigmoid() where it leaves any doubt (the fused QB bin fast path).
AMDQB_DEVICE float sigmoid_bounded_approx(float z) {
  float s = approx_rcp(1.0f + approx_exp2(z * -kLog2e));
#if defined(AMDQB_EMU_PERTURB_APPROX_SIGMOID)
  s = AMDQB_EMU_PERTURB_APPROX_SIGMOID(z, s);
#endif
  return s;
}

}  // namespace amdqb
