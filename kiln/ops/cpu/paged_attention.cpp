// Paged attention on the CPU: one call for a whole step (decode rows and prefill chunks mixed),
// reading K and V where they lie in the paged cache. Each work item is a tile of consecutive query
// tokens of one sequence and one KV head: its rows (tokens x the GQA group's query heads) share
// every K/V load and walk the context in chunks of keys with an online softmax (a running max and
// sum per row), so memory stays O(rows x head_dim) per item, with no L x L mask and no repeated
// K/V. Decode rows and short chunks take 8-token tiles and SIMD loops; a sequence with 64 or more
// queries takes 64-token tiles whose scores and P V are ATen matmuls. Scores and sums are fp32
// whatever the cache's dtype.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "float_bits.h"
#include "vector_exp.h"

namespace {

constexpr int64_t kChunk = 32;          // keys scored before the accumulators are rescaled once
constexpr int64_t kQueryTile = 8;       // query tokens of one sequence that share each K/V load
constexpr int64_t kDirectRows = 4;      // rows (tokens x group) up to which keys are not transposed
constexpr int64_t kPrefillTile = 64;    // query tokens per item where a sequence has many (matmuls)
constexpr int64_t kPrefillChunk = 256;  // keys per matmul there

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = as_float(src[d]);
}

struct Item {
    int64_t seq, first_token, num_tokens;  // a tile of consecutive query tokens of one sequence
};

// One item of a sequence with many queries: flash attention with ATen matmuls on fp32 tiles
// (S = Q K^T over 256 keys, then P V), which run at the BLAS rate the scalar loops cannot reach.
template <typename T>
void attend_tile_gemm(const T* q_base, const T* k_base, const T* v_base, T* out_base, const int32_t* table,
                      int64_t first_token, int64_t num_tokens, int64_t first_position, int64_t kv_head,
                      int64_t group, int64_t num_q_heads, int64_t head_dim, int64_t block_size,
                      int64_t block_stride, int64_t slot_stride, float scale, int64_t window, float cap) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t rows = num_tokens * group, last_position = first_position + num_tokens - 1;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
    auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor q = at::empty({rows, head_dim}, options), acc = at::zeros({rows, head_dim}, options);
    at::Tensor keys = at::empty({kPrefillChunk, head_dim}, options);
    at::Tensor values = at::empty({kPrefillChunk, head_dim}, options);
    float* qp = q.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const T* src = q_base + ((first_token + r / group) * num_q_heads + kv_head * group + r % group) * head_dim;
        to_float(src, qp + r * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qp[r * head_dim + d] *= scale;
    }
    std::vector<float> running_max(rows, neg_inf), running_sum(rows, 0.f);
    float* ap = acc.data_ptr<float>();
    for (int64_t start = first_key; start <= last_position; start += kPrefillChunk) {
        const int64_t count = std::min<int64_t>(kPrefillChunk, last_position + 1 - start);
        float* kp = keys.data_ptr<float>();
        float* vp = values.data_ptr<float>();
        for (int64_t c = 0; c < count; ++c) {
            const int64_t index = start + c;
            const int64_t offset = table[index / block_size] * block_stride + (index % block_size) * slot_stride +
                                   kv_head * head_dim;
            to_float(k_base + offset, kp + c * head_dim, head_dim);
            to_float(v_base + offset, vp + c * head_dim, head_dim);
        }
        at::Tensor scores = at::mm(q, keys.narrow(0, 0, count).t());  // [rows, count]
        float* sp = scores.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
            float* sr = sp + r * count;
            const int64_t position = first_position + r / group;
            float chunk_max = neg_inf;
            for (int64_t c = 0; c < count; ++c) {
                const int64_t index = start + c;
                if (index > position || (window > 0 && index <= position - window)) {
                    sr[c] = neg_inf;
                } else {
                    if (cap > 0.f) sr[c] = cap * std::tanh(sr[c] / cap);
                    chunk_max = std::max(chunk_max, sr[c]);
                }
            }
            if (chunk_max == neg_inf) {  // none of these keys is this row's
                std::fill(sr, sr + count, 0.f);
                continue;
            }
            const float new_max = std::max(running_max[r], chunk_max);
            const float rescale = std::exp(running_max[r] - new_max);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < count; ++c) {
                sr[c] = vector_exp(sr[c] - new_max);
                sum += sr[c];
            }
            running_sum[r] = running_sum[r] * rescale + sum;
            running_max[r] = new_max;
            float* ar = ap + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ar[d] *= rescale;
        }
        acc.addmm_(scores, values.narrow(0, 0, count));
    }
    for (int64_t r = 0; r < rows; ++r) {
        T* dst = out_base + ((first_token + r / group) * num_q_heads + kv_head * group + r % group) * head_dim;
        const float inv = running_sum[r] > 0.f ? 1.f / running_sum[r] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(ap[r * head_dim + d] * inv);
    }
}

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
    const float f_scale = static_cast<float>(scale), f_cap = static_cast<float>(softcap);
    const float neg_inf = -std::numeric_limits<float>::infinity();

    std::vector<Item> tiles;
    for (size_t s = 0; s + 1 < query_start.size(); ++s) {
        const int64_t queries = query_start[s + 1] - query_start[s];
        const int64_t step = queries >= kPrefillTile ? kPrefillTile : kQueryTile;
        for (int64_t t = query_start[s]; t < query_start[s + 1]; t += step)
            tiles.push_back({static_cast<int64_t>(s), t, std::min(step, query_start[s + 1] - t)});
    }
    const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;

    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
        const int64_t max_rows = kQueryTile * group;
        std::vector<float> q(max_rows * head_dim), acc(max_rows * head_dim), scores(max_rows * kChunk);
        std::vector<float> running_max(max_rows), running_sum(max_rows), key(head_dim);
        std::vector<float> keys_t(head_dim * kChunk), values(kChunk * head_dim);
        for (int64_t item = begin; item < end; ++item) {
            const Item& tile = tiles[item / num_kv_heads];
            const int64_t kv_head = item % num_kv_heads, rows = tile.num_tokens * group;
            const int64_t num_queries = query_start[tile.seq + 1] - query_start[tile.seq];
            // Row r = (token r / group, head r % group); its position in the sequence:
            const int64_t first_position =
                seq_lens[tile.seq] - num_queries + (tile.first_token - query_start[tile.seq]);
            const int64_t last_position = first_position + tile.num_tokens - 1;
            const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
            const int32_t* table = tables + tile.seq * table_stride;
            if (tile.num_tokens > kQueryTile) {
                attend_tile_gemm(q_base, k_base, v_base, out_base, table, tile.first_token, tile.num_tokens,
                                 first_position, kv_head, group, num_q_heads, head_dim, block_size, block_stride,
                                 slot_stride, f_scale, window, f_cap);
                continue;
            }
            for (int64_t r = 0; r < rows; ++r) {
                const T* src = q_base + ((tile.first_token + r / group) * num_q_heads + kv_head * group + r % group) *
                                            head_dim;
                to_float(src, q.data() + r * head_dim, head_dim);
                for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] *= f_scale;
            }
            std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
            std::fill(running_max.begin(), running_max.begin() + rows, neg_inf);
            std::fill(running_sum.begin(), running_sum.begin() + rows, 0.f);
            for (int64_t start = first_key; start <= last_position; start += kChunk) {
                const int64_t count = std::min<int64_t>(kChunk, last_position + 1 - start);
                // Causal, and inside the window: the key at `position` itself always counts.
                auto finish = [&](int64_t r, int64_t c, float s) {
                    const int64_t position = first_position + r / group, k_index = start + c;
                    if (k_index > position || (window > 0 && k_index <= position - window)) {
                        s = neg_inf;
                    } else if (f_cap > 0.f) {
                        s = f_cap * std::tanh(s / f_cap);
                    }
                    scores[r * kChunk + c] = s;
                };
                if (rows <= kDirectRows) {
                    // A decode token's few rows: each key's scores as dot products straight from the
                    // cache; the transpose below costs more than it saves for so few rows.
                    for (int64_t c = 0; c < count; ++c) {
                        const int64_t index = start + c;
                        const int64_t offset = table[index / block_size] * block_stride +
                                               (index % block_size) * slot_stride + kv_head * head_dim;
                        const T* kp = k_base + offset;
                        to_float(v_base + offset, values.data() + c * head_dim, head_dim);
                        for (int64_t r = 0; r < rows; ++r) {
                            const float* qr = q.data() + r * head_dim;
                            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                            for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * as_float(kp[d]);
                            finish(r, c, dot);
                        }
                    }
                } else {
                    // The chunk's keys transposed ([head_dim][kChunk], zero past `count`) and its
                    // values ([kChunk][head_dim]), in fp32: every row's scores are then
                    // multiply-adds across the keys, with no horizontal sums.
                    for (int64_t c = 0; c < kChunk; ++c) {
                        if (c < count) {
                            const int64_t index = start + c;
                            const int64_t offset = table[index / block_size] * block_stride +
                                                   (index % block_size) * slot_stride + kv_head * head_dim;
                            to_float(k_base + offset, key.data(), head_dim);
                            to_float(v_base + offset, values.data() + c * head_dim, head_dim);
                            for (int64_t d = 0; d < head_dim; ++d) keys_t[d * kChunk + c] = key[d];
                        } else {
                            for (int64_t d = 0; d < head_dim; ++d) keys_t[d * kChunk + c] = 0.f;
                        }
                    }
                    for (int64_t r = 0; r < rows; ++r) {
                        float row_scores[kChunk] = {};
                        const float* qr = q.data() + r * head_dim;
                        for (int64_t d = 0; d < head_dim; ++d) {
                            const float qd = qr[d];
                            const float* kd = keys_t.data() + d * kChunk;
#pragma omp simd
                            for (int64_t c = 0; c < kChunk; ++c) row_scores[c] += qd * kd[c];
                        }
                        for (int64_t c = 0; c < count; ++c) finish(r, c, row_scores[c]);
                    }
                }
                for (int64_t r = 0; r < rows; ++r) {
                    float* sr = scores.data() + r * kChunk;
                    const float chunk_max = *std::max_element(sr, sr + count);
                    if (chunk_max == neg_inf) continue;  // no key of this chunk is this row's: its p stay 0
                    const float new_max = std::max(running_max[r], chunk_max);
                    const float rescale = std::exp(running_max[r] - new_max);  // 0 before the row's first key
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t c = 0; c < count; ++c) {
                        sr[c] = vector_exp(sr[c] - new_max);
                        sum += sr[c];
                    }
                    running_sum[r] = running_sum[r] * rescale + sum;
                    running_max[r] = new_max;
                    float* ar = acc.data() + r * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) ar[d] *= rescale;
                }
                for (int64_t r = 0; r < rows; ++r) {
                    float* ar = acc.data() + r * head_dim;
                    for (int64_t c = 0; c < count; ++c) {
                        const float p = scores[r * kChunk + c];
                        if (p == 0.f || p == neg_inf) continue;
                        const float* vc = values.data() + c * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * vc[d];
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                T* dst = out_base +
                         ((tile.first_token + r / group) * num_q_heads + kv_head * group + r % group) * head_dim;
                const float inv = running_sum[r] > 0.f ? 1.f / running_sum[r] : 0.f;
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(acc[r * head_dim + d] * inv);
            }
        }
    });
}

}  // namespace

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
