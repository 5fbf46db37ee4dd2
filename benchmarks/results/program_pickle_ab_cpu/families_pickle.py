# Each model family's split program through the compile cache: written as nodes (not torch's code
# format), loaded warm without Dynamo, same output as the cold start.
import dataclasses, sys, tempfile, torch
from pathlib import Path
from kiln.compile import compile_model
from kiln.compile.cache import CacheRoot, CompileCache
from kiln.compile.config import CompilationConfig
from kiln.models import build_model
from kiln.models.presets import PRESETS

base = PRESETS["tiny-llama"]
families = {
    "llama": {},
    "qwen2 (qkv bias)": dict(qkv_bias=True),
    "qwen3 (qk norm)": dict(architecture="Qwen3ForCausalLM", qk_norm=True),
    "gemma2": dict(architecture="Gemma2ForCausalLM", tie_word_embeddings=True, sliding_window=8,
                   layer_types=("sliding_attention", "full_attention"), hidden_act="gelu_pytorch_tanh",
                   query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "mixtral (moe)": dict(architecture="MixtralForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3 moe": dict(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
}
def inputs(n):
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 512, (n,), generator=g), torch.arange(n)
for name, arch in families.items():
    cfg = dataclasses.replace(base, **arch)
    torch.manual_seed(0)
    model = build_model(cfg, torch.float32, torch.device("cpu"), frozenset(), None)
    root = Path(tempfile.mkdtemp())
    config = CompilationConfig(mode=3, piece_compiler="inductor", strategy="lazy")
    cold = compile_model(model, config, 64, cache=CompileCache(CacheRoot(root), {"t": name}, "tiny"))
    cold.warm_up(inputs)
    data = (cold.entry.path / "graph.pkl").read_bytes()
    warm = compile_model(model, config, 64, cache=CompileCache(CacheRoot(root), {"t": name}, "tiny"))
    warm.warm_up(inputs)
    ids, pos = inputs(9)
    with torch.no_grad():
        diff = (warm(ids, pos) - cold(ids, pos)).abs().max().item()
    print(f"{name:18s} nodes format {b'reduce_graph_module' not in data}, warm graphs_seen {warm.stats['graphs_seen']}, "
          f"pieces loaded {warm.stats['pieces_loaded']}, max |warm - cold| {diff:.1e}", flush=True)
