"""Named architectures, for random-weight models in benchmarks and tests."""

from __future__ import annotations

from kiln.models.config import ModelArchConfig

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelArchConfig] = {
    "smollm2-135m": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,)),
    "llama-2-7b": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3-8b": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama-3.1-8b": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "llama-3-70b": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "mistral-7b": ModelArchConfig(  # v0.1, with its 4,096-token window
        "MistralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,), sliding_window=4096),
    "qwen2.5-7b": ModelArchConfig(
        "Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151645, 151643),
        qkv_bias=True),
    "qwen3-8b": ModelArchConfig(
        "Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151645, 151643),
        qk_norm=True),
    "gemma-2-9b": ModelArchConfig(
        "Gemma2ForCausalLM", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
        num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1, 107),
        sliding_window=4096, layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(42)),
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0),
    "mixtral-8x7b": ModelArchConfig(
        "MixtralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, bos_token_id=1, eos_token_ids=(2,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    "qwen3-30b-a3b": ModelArchConfig(
        "Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151645, 151643),
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    # A few-layer model for fast tests of anything that compiles.
    "tiny-llama": ModelArchConfig(
        "LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,)),
}
