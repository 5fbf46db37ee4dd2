// A step's keys and values into the paged KV cache (CPU). The Python reference needs a host
// check for padding slots and two index_copy_ calls a layer (~60 us under cProfile at 16 decodes, SmolLM2
// bf16); here a token is two row copies, and a padding slot (-1) is skipped where it is met.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
    // kv_cache [2, blocks, block_size, kv_heads, head_dim]; key and value [tokens, kv_heads * head_dim],
    // each token's row contiguous (rows may be strided: views of the fused qkv projection).
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                "write_kv: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
    const int64_t row = kv_cache.size(3) * kv_cache.size(4);
    const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
    for (const at::Tensor* t : {&key, &value}) {
        TORCH_CHECK(t->dim() == 2 && t->size(1) == row && t->stride(1) == 1,
                    "write_kv: keys and values must be [tokens, ", row, "] with contiguous rows");
        TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), "write_kv: keys and values must have the cache's "
                    "dtype ", kv_cache.scalar_type(), ", got ", t->scalar_type());
    }
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                slot_mapping.numel() <= key.size(0) && key.size(0) == value.size(0),
                "write_kv: slot_mapping must be contiguous int64 with one slot per token");
    const int64_t tokens = slot_mapping.numel(), bytes = row * kv_cache.element_size();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
        TORCH_CHECK(slots[t] < num_slots, "write_kv: slot ", slots[t], " is past the cache's ", num_slots);
    }
    auto* k_cache = static_cast<char*>(kv_cache.data_ptr());
    auto* v_cache = k_cache + num_slots * bytes;
    const auto* k = static_cast<const char*>(key.data_ptr());
    const auto* v = static_cast<const char*>(value.data_ptr());
    const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
    // A prompt chunk is thousands of rows; a decode step a handful (one thread: no fork-join).
    at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            if (slots[t] < 0) continue;
            std::memcpy(k_cache + slots[t] * bytes, k + t * k_stride, bytes);
            std::memcpy(v_cache + slots[t] * bytes, v + t * v_stride, bytes);
        }
    });
}
