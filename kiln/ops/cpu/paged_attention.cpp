// Paged attention on the CPU: one call for a whole step (decode rows and prefill chunks mixed),
// reading K and V where they lie in the paged cache. Each work item is one query token and one
// KV head: its GQA group of query heads walks the token's context in chunks of keys with an
// online softmax (a running max and sum per head), so memory stays O(group x head_dim) per item,
// no L x L mask and no repeated K/V. Scores and sums are fp32 whatever the cache's dtype.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;  // keys scored before the accumulators are rescaled once

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out, const at::Tensor& block_tables,
            const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& query_start, double scale,
            int64_t window, double softcap) {
    const int64_t num_q_heads = query.size(1), head_dim = query.size(2);
    const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim, block_stride = block_size * slot_stride;
    const T* q_base = query.data_ptr<T>();
    const T* k_base = kv_cache.data_ptr<T>();
    const T* v_base = k_base + num_blocks * block_stride;
    T* out_base = out.data_ptr<T>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int64_t table_stride = block_tables.stride(0);

    // Work items: (token, kv head) for every query token of every sequence.
    std::vector<int64_t> token_seq;
    for (size_t s = 0; s + 1 < query_start.size(); ++s)
        for (int64_t t = query_start[s]; t < query_start[s + 1]; ++t) token_seq.push_back(static_cast<int64_t>(s));
    const int64_t num_items = static_cast<int64_t>(token_seq.size()) * num_kv_heads;
    const float f_scale = static_cast<float>(scale), f_cap = static_cast<float>(softcap);

    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(group * head_dim), acc(group * head_dim), scores(group * kChunk);
        std::vector<float> running_max(group), running_sum(group);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t index = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t seq = token_seq[index];
            const int64_t t = query_start[0] + index;  // the items follow the tokens, in order
            const int64_t num_queries = query_start[seq + 1] - query_start[seq];
            const int64_t position = seq_lens[seq] - num_queries + (t - query_start[seq]);
            const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
            const int32_t* table = tables + seq * table_stride;
            for (int64_t g = 0; g < group; ++g) {
                const T* src = q_base + (t * num_q_heads + kv_head * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * f_scale;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
            std::fill(running_sum.begin(), running_sum.end(), 0.f);
            for (int64_t start = first; start <= position; start += kChunk) {
                const int64_t count = std::min<int64_t>(kChunk, position + 1 - start);
                for (int64_t c = 0; c < count; ++c) {
                    const int64_t key = start + c;
                    const T* k = k_base + table[key / block_size] * block_stride + (key % block_size) * slot_stride +
                                 kv_head * head_dim;
                    for (int64_t g = 0; g < group; ++g) {
                        const float* qg = q.data() + g * head_dim;
                        float dot = 0.f;
                        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
                        if (f_cap > 0.f) dot = f_cap * std::tanh(dot / f_cap);
                        scores[g * kChunk + c] = dot;
                    }
                }
                for (int64_t g = 0; g < group; ++g) {
                    float* sg = scores.data() + g * kChunk;
                    float chunk_max = *std::max_element(sg, sg + count);
                    const float new_max = std::max(running_max[g], chunk_max);
                    const float rescale = std::exp(running_max[g] - new_max);  // 0 on the first chunk
                    float sum = 0.f;
                    for (int64_t c = 0; c < count; ++c) {
                        sg[c] = std::exp(sg[c] - new_max);
                        sum += sg[c];
                    }
                    running_sum[g] = running_sum[g] * rescale + sum;
                    running_max[g] = new_max;
                    float* ag = acc.data() + g * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
                }
                for (int64_t c = 0; c < count; ++c) {
                    const int64_t key = start + c;
                    const T* v = v_base + table[key / block_size] * block_stride + (key % block_size) * slot_stride +
                                 kv_head * head_dim;
                    for (int64_t g = 0; g < group; ++g) {
                        const float p = scores[g * kChunk + c];
                        float* ag = acc.data() + g * head_dim;
                        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
                    }
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                T* dst = out_base + (t * num_q_heads + kv_head * group + g) * head_dim;
                const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d] * inv);
            }
        }
    });
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& block_tables, const std::vector<int64_t>& seq_lens,
                     const std::vector<int64_t>& query_start, double scale, int64_t window, double softcap) {
    TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [tokens, heads, head_dim]");
    TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
                "out must be a contiguous tensor of query's shape and dtype");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                "kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache and query must share a dtype");
    TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
                "query heads must be a multiple of the cache's kv heads, with the same head_dim");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
                "block_tables must be int32 [seqs, blocks] with contiguous rows");
    TORCH_CHECK(query_start.size() == seq_lens.size() + 1, "query_start needs one entry more than seq_lens");
    switch (query.scalar_type()) {
        case at::kFloat:
            attend<float>(query, kv_cache, out, block_tables, seq_lens, query_start, scale, window, softcap);
            break;
        case at::kBFloat16:
            attend<at::BFloat16>(query, kv_cache, out, block_tables, seq_lens, query_start, scale, window, softcap);
            break;
        case at::kHalf:
            attend<at::Half>(query, kv_cache, out, block_tables, seq_lens, query_start, scale, window, softcap);
            break;
        default:
            TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 only, got ", query.scalar_type());
    }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_attention", &paged_attention, "paged attention over a step's tokens (CPU)");
}
