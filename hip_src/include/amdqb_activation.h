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

// On NVIDIA, ptxas expands an IEEE division into a fast path -- the hardware reciprocal, one
// Newton step, the quotient and one correction from its exact residual (Markstein's sequence,
// correctly rounded while every intermediate is a normal number) -- and a CALL to a slow path for
// the operands its range check (FCHK) sends there; with one call per division the scheduler
// cannot interleave the divisions of a row (28 call sites per token at E = 896). quotient_fast
// writes that fast path out: the same instructions, and the correctly rounded quotient (the
// division's bits) wherever quotient_fast_ok(a, b) holds -- |a| and |b| in [2^-60, 2^60], where
// the quotient, the reciprocal and the residual all stay normal; elsewhere (zeros and their
// signs, NaN, infinities, the tiny exponentials of a softmax) the division is used. sigmoid_fast
// is the case a = 1 for the divisors d = 1 + e^-z in [1, 2^126). -DAMDQB_DIVISION_ONLY=1 turns
// the fast paths off (the tests that prove both give the same bits build that variant). AMD and
// the CPU emulator use the compiler's own division (no call to avoid).
// Whether the written-out fast path is compiled (NVIDIA without -DAMDQB_DIVISION_ONLY).
#if defined(AMDQB_CUDA) && !defined(AMDQB_DIVISION_ONLY)
constexpr bool kQuotientFastPath = true;
#else
constexpr bool kQuotientFastPath = false;
#endif
AMDQB_DEVICE bool sigmoid_fast_ok(float d) {
  return kQuotientFastPath && d < 8.50705917e37f;  // 2^126
}
AMDQB_DEVICE float sigmoid_fast(float d) {
#if defined(AMDQB_CUDA)
  const float r = approx_rcp(d);  // rcp.approx.ftz.f32
  return fmaf(r, -fmaf(d, r, -1.0f), r);
#else
  return 1.0f / d;
#endif
}
AMDQB_DEVICE bool quotient_fast_ok(float a, float b) {
  const float ua = fabsf(a), ub = fabsf(b);
  return kQuotientFastPath && ub >= 8.67361738e-19f && ub <= 1.15292150e18f &&  // 2^-60, 2^60
         ua >= 8.67361738e-19f && ua <= 1.15292150e18f;
}
AMDQB_DEVICE float quotient_fast(float a, float b) {
#if defined(AMDQB_CUDA)
  const float y = sigmoid_fast(b);  // 1 / b: the reciprocal and its Newton step
  const float q = a * y;
  return fmaf(y, fmaf(-b, q, a), q);  // q + y (a - b q), the residual exact
#else
  return a / b;
#endif
}
// a / b, IEEE round to nearest: the fast path where it applies, else the division.
AMDQB_DEVICE float quotient(float a, float b) {
  return quotient_fast_ok(a, b) ? quotient_fast(a, b) : a / b;
}
// a[i] / b for J0 <= i < J1, IEEE: every quotient through the fast path first, then the division
// redone only where it does not apply (no CALL between two quotients of a group of 8; groups keep
// the extra registers to 8); the plain division where the fast path is not compiled.
template <int J0, int J1, int N>
AMDQB_DEVICE void divide_range(float (&a)[N], float b) {
  static_assert(0 <= J0 && J0 <= J1 && J1 <= N, "divide_range: 0 <= J0 <= J1 <= N");
  if constexpr (!kQuotientFastPath) {
#pragma unroll
    for (int i = J0; i < J1; ++i) a[i] = a[i] / b;
  } else {
    constexpr int G = 8;
#pragma unroll
    for (int g = J0; g < J1; g += G) {
      float q[G];
      bool redo = false;
#pragma unroll
      for (int i = 0; i < G; ++i) {
        if (g + i < J1) {
          q[i] = quotient_fast(a[g + i], b);
          redo |= !quotient_fast_ok(a[g + i], b);
        }
      }
      if (redo) {
#pragma unroll
        for (int i = 0; i < G; ++i)
          if (g + i < J1 && !quotient_fast_ok(a[g + i], b)) q[i] = a[g + i] / b;
      }
#pragma unroll
      for (int i = 0; i < G; ++i)
        if (g + i < J1) a[g + i] = q[i];
    }
  }
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
