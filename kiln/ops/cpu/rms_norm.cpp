// RMSNorm and residual add + RMSNorm on the CPU, one pass per row. The native path (kiln/ops/norm.py)
// spends ~20 us on nine small ATen calls for a decode step's 16 x 576 bf16 rows; this is one call.
// It rounds where the native path does: the residual sum to the input dtype, the normalised row to
// the input dtype before the weight multiplies it (HF's LlamaRMSNorm), or with unit_offset the
// row times (1 + w) in fp32, rounded once (HF's Gemma2RMSNorm). The sum of squares is fp32 in
// another order than torch's mean, so results may differ from native by an ulp.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "float_bits.h"

namespace {

template <typename T>
void norm_rows(const T* x, const T* residual_in, T* residual_out, const T* weight, T* out, int64_t rows,
               int64_t hidden, float eps, bool unit_offset) {
    // Rows are independent; a decode step's few rows stay on one thread (a parallel region costs more).
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(hidden, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> row(hidden);
        for (int64_t r = begin; r < end; ++r) {
            const T* xr = x + r * hidden;
            float* v = row.data();
            if (residual_in != nullptr) {
                const T* rr = residual_in + r * hidden;
                T* ro = residual_out + r * hidden;
#pragma omp simd
                for (int64_t d = 0; d < hidden; ++d) {
                    const T sum = from_float<T>(as_float(xr[d]) + as_float(rr[d]));
                    ro[d] = sum;
                    v[d] = as_float(sum);
                }
            } else {
#pragma omp simd
                for (int64_t d = 0; d < hidden; ++d) v[d] = as_float(xr[d]);
            }
            float squares = 0.f;
#pragma omp simd reduction(+ : squares)
            for (int64_t d = 0; d < hidden; ++d) squares += v[d] * v[d];
            const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
            T* o = out + r * hidden;
            if (unit_offset) {
#pragma omp simd
                for (int64_t d = 0; d < hidden; ++d) o[d] = from_float<T>(v[d] * inv * (1.f + as_float(weight[d])));
            } else {
#pragma omp simd
                for (int64_t d = 0; d < hidden; ++d)
                    o[d] = from_float<T>(as_float(weight[d]) * as_float(from_float<T>(v[d] * inv)));
            }
        }
    });
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* what) {
    TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), what, ": x must be contiguous");
    TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1), what,
                ": weight must be a contiguous [", x.size(-1), "]");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), what, ": weight and x must share a dtype");
}

template <typename F>
void dispatch(const at::Tensor& x, const char* what, F&& run) {
    switch (x.scalar_type()) {
        case at::kFloat: run(float{}); break;
        case at::kBFloat16: run(at::BFloat16{}); break;
        case at::kHalf: run(at::Half{}); break;
        default: TORCH_CHECK(false, what, ": float32, bfloat16 or float16 only, got ", x.scalar_type());
    }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
    check(x, weight, "rms_norm");
    at::Tensor out = at::empty_like(x);
    const int64_t hidden = x.size(-1), rows = hidden == 0 ? 0 : x.numel() / hidden;
    dispatch(x, "rms_norm", [&](auto zero) {
        using T = decltype(zero);
        norm_rows<T>(x.data_ptr<T>(), nullptr, nullptr, weight.data_ptr<T>(), out.data_ptr<T>(), rows, hidden,
                     static_cast<float>(eps), unit_offset);
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps, bool unit_offset) {
    check(x, weight, "fused_add_rms_norm");
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
                "fused_add_rms_norm: residual must be contiguous, with x's shape and dtype");
    at::Tensor out = at::empty_like(x), new_residual = at::empty_like(x);
    const int64_t hidden = x.size(-1), rows = hidden == 0 ? 0 : x.numel() / hidden;
    dispatch(x, "fused_add_rms_norm", [&](auto zero) {
        using T = decltype(zero);
        norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), new_residual.data_ptr<T>(), weight.data_ptr<T>(),
                     out.data_ptr<T>(), rows, hidden, static_cast<float>(eps), unit_offset);
    });
    return {out, new_residual};
}
