// expf that GCC vectorises, for the paged attention's softmax. std::exp stays a scalar call in a
// `#pragma omp simd` loop: glibc declares its vector expf only under -ffast-math, which kiln does
// not build with (it would also let the compiler reorder the sums whose rounding the kernels
// keep). Cephes' expf: 2^n times a polynomial of the remainder, within 1 ulp of exp (every 256th
// float from -87.3 to 88.3); below ln(FLT_MIN) it gives 0 (expf a subnormal), and from 88.38 to
// 88.72, where 2^n would overflow, it stays at exp(88.38). The kernel on SmolLM2's decode rows, 2
// threads: 16 at 100 tokens of context 0.128 -> 0.117 ms in fp32, 0.147 -> 0.128 in bf16
// (benchmarks/results/cpu_vector_exp_ab).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

inline float vector_exp(float x) {
    const float c = x < -87.33654f ? -87.33654f : (x > 88.37626f ? 88.37626f : x);
    // round(c / ln 2) by the 1.5 * 2^23 trick (no call, so it vectorises); n in [-126, 127].
    const float n = (c * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;  // c - n ln 2, ln 2 in two parts
    const float z = r * r;
    const float p = ((((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
                       + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r) + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    const float e = p * scale;
    if (x != x) return x;
    if (x > 88.72284f) return std::numeric_limits<float>::infinity();
    return x < -87.33654f ? 0.f : e;
}

}  // namespace
