// The Python module of kiln's CPU kernels (built by kiln/ops/cpu/extension.py).
#include <torch/extension.h>

#include <tuple>
#include <vector>

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& block_tables, const std::vector<int64_t>& seq_lens,
                     const std::vector<int64_t>& query_start, double scale, int64_t window, double softcap);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps, bool unit_offset);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_attention", &paged_attention, "paged attention over a step's tokens (CPU)");
    m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
    m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add, then RMSNorm of each row (CPU)");
    m.def("write_kv", &write_kv, "a step's keys and values into the paged KV cache (CPU)");
}
