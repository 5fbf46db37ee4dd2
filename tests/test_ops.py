"""The dual-implementation ops on CPU: enablement rules and agreement of the two paths."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.config import resolve_custom_ops
from kiln.forward_context import set_forward_context
from kiln.models import build_model
from kiln.models.presets import PRESETS
from kiln.ops import known_ops
from kiln.ops.rotary import rope_inv_freq


def test_custom_ops_lists():
    assert set(known_ops()) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul",
                                "rotary_embedding", "skinny_linear"}
    assert resolve_custom_ops([], "none") == frozenset()
    assert resolve_custom_ops([], "all") == frozenset(known_ops())
    assert resolve_custom_ops(["none", "+rms_norm"], "all") == {"rms_norm"}
    assert resolve_custom_ops(["all", "-silu_and_mul"], "none") == set(known_ops()) - {"silu_and_mul"}
    assert resolve_custom_ops("none,+silu_and_mul", "all") == {"silu_and_mul"}
    assert resolve_custom_ops(["all", "-skinny_linear"], "none") == set(known_ops()) - {"skinny_linear"}


def _logits(custom_ops, ids):
    model = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"), custom_ops, None)
    assert all(m.uses_kernel == (m.op_names[0] in custom_ops)
               for m in model.modules() if hasattr(m, "uses_kernel"))
    with torch.inference_mode(), set_forward_context(None, {}):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def test_kernel_path_matches_native_path():
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(0))
    native = _logits(frozenset(), ids)
    kernel = _logits(resolve_custom_ops(["all"], "none"), ids)
    torch.testing.assert_close(kernel, native, rtol=1e-5, atol=1e-5)


def test_kernel_path_is_opaque_to_dynamo():
    """With the kernel path on, Dynamo sees torch.ops.kiln.* calls, not their math."""
    model = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"),
                        resolve_custom_ops(["all"], "none"), None)
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    ids = torch.arange(8)
    with set_forward_context(None, {}):
        torch.compile(model, backend=backend, fullgraph=True)(ids, ids)
    torch._dynamo.reset()
    ops = {t.removeprefix("kiln.").split(".")[0] for t in targets if t.startswith("kiln.")}
    # With every kernel on, SiLU rides in the down projection and rotary in the KV write.
    assert ops == {"rms_norm", "fused_add_rms_norm", "act_and_mul_linear", "rotary_kv_cache_write", "attention",
                   "skinny_linear"}, ops


class _CountCalls(TorchDispatchMode):
    """The ops a forward dispatches, by name; kiln ops are seen whole (their insides run without the mode)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _forward_calls(model) -> list[str]:
    with torch.inference_mode(), set_forward_context(None, {}), _CountCalls() as counter:
        model.compute_logits(model(torch.arange(3), torch.arange(3)))
    return counter.calls


def test_skinny_linear_is_every_linear_layers_matmul():
    """On: every linear layer (qkv, o, gate_up, down, lm_head) calls kiln::skinny_linear and
    nothing else runs a matmul; off: F.linear, as before."""
    from kiln.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
    from kiln.ops.linear import skinny_linear_op

    for enabled in (True, False):
        ops = resolve_custom_ops(["none", "+skinny_linear"] if enabled else ["none"], "all")
        model = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"), ops, None)
        linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        assert len(linears) == 4 * PRESETS["tiny-llama"].num_layers + 1
        assert all(m.matmul is (skinny_linear_op if enabled else torch.nn.functional.linear) for m in linears)
        calls = _forward_calls(model)
        skinny, linear = calls.count("skinny_linear"), sum(calls.count(name) for name in ("linear", "mm", "addmm", "matmul"))
        assert (skinny, linear) == ((len(linears), 0) if enabled else (0, len(linears))), (skinny, linear)


def _tiny_gemma2():
    import dataclasses

    return dataclasses.replace(PRESETS["gemma-2-9b"], vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               layer_types=PRESETS["gemma-2-9b"].layer_types[:2])


@pytest.mark.parametrize("family, activation", [("llama", "silu_and_mul"), ("gemma2", "gelu_tanh_and_mul")])
def test_down_projection_takes_the_activation_where_gemv_and_activation_kernels_are_on(family, activation):
    """With skinny_linear and the MLP's activation kernel (SiLU for Llama, GELU-tanh for Gemma 2)
    both on, each MLP calls kiln::act_and_mul_linear instead of the pair, and the logits are
    exactly the pair's; with either off, nothing is fused."""
    cfg = PRESETS["tiny-llama"] if family == "llama" else _tiny_gemma2()
    layers = cfg.num_layers
    logits = {}
    for names in (["none", "+skinny_linear", f"+{activation}"], ["none", "+skinny_linear"], ["none", f"+{activation}"]):
        model = build_model(cfg, torch.float32, torch.device("cpu"), resolve_custom_ops(names, "all"), None)
        calls = _forward_calls(model)
        fused = len(names) == 3
        assert calls.count("act_and_mul_linear") == (layers if fused else 0), names
        assert calls.count(activation) == (0 if fused or f"+{activation}" not in names else layers), names
        assert all((mlp.act is None) == fused for mlp in model.modules() if type(mlp).__name__ == "LlamaMLP")
        with torch.inference_mode(), set_forward_context(None, {}):
            logits[tuple(names)] = model.compute_logits(model(torch.arange(5), torch.arange(5)))
    fused, *unfused = logits.values()
    assert all(torch.equal(fused, other) for other in unfused)


def test_llama31_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    preset = PRESETS["llama-3.1-8b"]
    hf = transformers.LlamaConfig(**preset.to_hf())
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(preset.head_dim, preset.rope_theta, preset.rope_scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_unknown_rope_scaling_is_an_error():
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_skinny_linear_is_on_by_default_on_cuda_and_for_bf16_on_the_cpu(monkeypatch):
    from kiln.config import EngineConfig

    cpu = EngineConfig(model="tiny-llama", device="cpu").resolved_custom_ops()
    assert "rms_norm" in cpu and "skinny_linear" not in cpu  # fp32 packs nothing: F.linear directly
    assert "skinny_linear" in EngineConfig(model="tiny-llama", device="cpu", dtype="bfloat16").resolved_custom_ops()
    asked = EngineConfig(model="tiny-llama", device="cpu", custom_ops=["all", "+skinny_linear"])
    assert "skinny_linear" in asked.resolved_custom_ops()
    monkeypatch.setattr("kiln.config.has_cuda_gpu", lambda: True)  # the config only, nothing runs
    assert "skinny_linear" in EngineConfig(model="tiny-llama", device="cuda").resolved_custom_ops()


def test_inductor_compiles_take_the_norm_and_gemv_kernels_by_default(monkeypatch):
    # Inductor's fused norm and cuBLAS sum a row in another order than the kernels (eager's
    # path), which flips bf16 roundings and then greedy tokens; the other ops are Inductor's to
    # fuse. A CPU engine in fp32 drops the linear op (its CPU kernel only packs bf16 weights).
    from kiln.compile.config import CompilationConfig
    from kiln.config import EngineConfig, default_custom_ops

    assert resolve_custom_ops(default_custom_ops(CompilationConfig.level(2)), "none") == {
        "rms_norm", "fused_add_rms_norm", "skinny_linear"}
    # On CUDA every kernel: Inductor's rotary beside kiln's KV write is three launches to kiln's one.
    assert resolve_custom_ops(default_custom_ops(CompilationConfig.level(2), "cuda"), "none") == set(known_ops())
    compiled = EngineConfig(model="tiny-llama", device="cpu", compilation=CompilationConfig.level(2))
    assert compiled.resolved_custom_ops() == {"rms_norm", "fused_add_rms_norm"}
    eager = EngineConfig(model="tiny-llama", device="cpu", compilation=CompilationConfig.level(0))
    assert eager.resolved_custom_ops() == set(known_ops()) - {"skinny_linear"}
    asked = EngineConfig(model="tiny-llama", device="cpu", compilation=CompilationConfig.level(2), custom_ops=["none"])
    assert asked.resolved_custom_ops() == frozenset()
    monkeypatch.setattr("kiln.config.has_cuda_gpu", lambda: True)  # the config only, nothing runs
    on_gpu = EngineConfig(model="tiny-llama", device="cuda", compilation=CompilationConfig.level(2))
    assert on_gpu.default_custom_ops == ["all"] and on_gpu.resolved_custom_ops() == set(known_ops())
