"""Layer stamping: Dynamo traces a repeated layer once, kiln inlines the stamped copies, and
the graph is the one a plain trace gives, each layer's ops naming that layer. Both mechanisms:
nested_compile_region (torch >= 2.12) and kiln's own (any torch; what torch 2.11 gets)."""

import pytest
import torch

from kiln.compile import CaptureError, compile_dynamic, compile_model, layer_stamping, repeated_layer
from kiln.compile.config import CompilationConfig

needs_stamping = pytest.mark.skipif(not layer_stamping.supported(),
                                    reason="torch has no nested_compile_region(reuse_hash_fn=...) (< 2.12)")

MECHANISMS = [pytest.param("nested_compile_region", marks=needs_stamping), "kiln"]
graphs: list = []
INPUTS = (torch.arange(6) * 37 % 512, torch.arange(6))


@torch._dynamo.register_backend(name="kiln_test_record")
def _record(gm, example_inputs):
    graphs.append(gm)
    return gm.forward


def _ops(gm) -> list:
    """Each call in order, with its string arguments (an attention op's layer name)."""
    return [(str(n.target), [a for a in n.args if isinstance(a, str)], n.meta["example_value"].shape
             if isinstance(n.meta.get("example_value"), torch.Tensor) else None)
            for n in gm.graph.nodes if n.op == "call_function"]


def _capture(model, stamp: bool, mechanism: str = "auto"):
    graphs.clear()
    compiled = compile_model(model, CompilationConfig(mode=2, backend="kiln_test_record",
                                                      stamp_repeated_layers=stamp, stamp_mechanism=mechanism), 32)
    out = compiled(*INPUTS)
    assert len(graphs) == 1
    return graphs[0], out, compiled.stats


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("odd_layer", [False, True])
def test_stamped_graph_is_the_plain_trace(tiny_llama_factory, odd_layer, mechanism):
    model = tiny_llama_factory(5)
    if odd_layer:  # a layer unlike the others must be traced, not stamped from another
        model.model.layers[3].post_attention_layernorm.eps = 1e-2
    plain, plain_out, plain_stats = _capture(model, stamp=False)
    stamped, stamped_out, stats = _capture(model, stamp=True, mechanism=mechanism)
    assert plain_stats["stamped_layers"] == 0
    # layer 0 (no residual yet) and layer 1 are traced; so is layer 3 when it differs
    assert stats["stamped_layers"] == (2 if odd_layer else 3)
    assert not [n for n in stamped.graph.nodes if n.op == "call_function" and ("invoke_subgraph" in str(n.target)
                                                                              or "kiln_stamp" in str(n.target))]
    assert _ops(stamped) == _ops(plain)
    names = [args[0] for target, args, _ in _ops(stamped) if target == "kiln.attention.default"]
    assert names == [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    torch.testing.assert_close(stamped_out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(stamped_out, model(*INPUTS), rtol=1e-5, atol=1e-5)
    if odd_layer:
        eps = [n.args for n in stamped.graph.nodes if n.op == "call_function" and "add" in str(n.target)
               and 1e-2 in n.args]
        assert len(eps) == 1


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_piecewise_capture_stamps_and_matches_eager(tiny_llama_factory, caplog, mechanism):
    model = tiny_llama_factory(4)
    compiled = compile_model(model, CompilationConfig(mode=3, piece_compiler="eager", stamp_mechanism=mechanism), 32)
    ids, pos = torch.randint(0, 512, (7,)), torch.arange(7)
    with caplog.at_level("INFO", logger="kiln.compile"):
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=0, atol=0)
    assert "Dynamo traced 2 of 4 repeated layers and stamped the other 2" in caplog.text
    stats = compiled.stats
    assert stats["stamped_layers"] == 2
    assert (stats["pieces"], stats["unique_pieces"], stats["opaque_regions"]) == (5, 3, 4)
    # the layer classes are themselves again after the capture; kiln's mechanism leaves each
    # layer the list its stamped calls' weights are read from
    assert "forward" in type(model.model.layers[0]).__dict__
    for layer in model.model.layers:
        for attr in (layer_stamping.KEY_ATTR, layer_stamping.INDEX_ATTR):
            assert not hasattr(layer, attr)
        kept = getattr(layer, layer_stamping.WEIGHTS_ATTR, None)
        if mechanism == "kiln":
            assert [id(t) for t in kept] == [id(t) for t in [*layer.parameters(), *layer.buffers()]]
        else:
            assert kept is None


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_calls_after_a_stamped_capture_run_dynamo_s_code_and_match_eager(tiny_llama_factory, mechanism):
    # Mode 2 keeps running Dynamo's bytecode after the capture; it reads each stamped call's
    # weights from where the trace found them (on torch 2.11 every second call raised).
    model = tiny_llama_factory(4)
    compiled = compile_model(model, CompilationConfig(mode=2, backend="aot_eager", stamp_mechanism=mechanism), 32)
    for n in (7, 7, 12, 3):
        ids, pos = torch.randint(0, 512, (n,)), torch.arange(n)
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)
    assert compiled.stats["stamped_layers"] == 2


def test_a_torch_without_reuse_hash_fn_stamps_with_kiln_s_own_mechanism(tiny_llama_factory, monkeypatch, caplog):
    monkeypatch.setattr(layer_stamping, "supported", lambda: False)  # torch 2.11, the GPU machine's
    model = tiny_llama_factory(4)
    plain, _, _ = _capture(model, stamp=False)
    with caplog.at_level("INFO", logger="kiln.compile"):
        stamped, out, stats = _capture(model, stamp=True)
    assert stats["stamped_layers"] == 2 and "4 repeated layers, kiln mechanism" in caplog.text
    assert _ops(stamped) == _ops(plain)
    torch.testing.assert_close(out, model(*INPUTS), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'nested_compile_region' needs torch >= 2.12.*use 'auto' or 'kiln'"):
        _capture(model, stamp=True, mechanism="nested_compile_region")


def test_stamp_settings_are_checked():
    with pytest.raises(ValueError, match="stamp_repeated_layers must be true or false"):
        CompilationConfig(stamp_repeated_layers="yes")
    with pytest.raises(ValueError, match="stamp_mechanism must be one of auto, nested_compile_region, kiln"):
        CompilationConfig(stamp_mechanism="sometimes")


def test_path_change_reads_the_layer_from_a_weight_name():
    assert layer_stamping._path_change("model.layers.1.mlp.w", "model.layers.12.mlp.w") == \
        ("model.layers.1", "model.layers.12")
    assert layer_stamping._path_change("a.b", "a.b") is None


@repeated_layer
class _Twice(torch.nn.Module):
    def forward(self, x):
        return x * 2


@compile_dynamic(dynamic_arg_dims={"x": 0})
class _RankChanging(torch.nn.Module):
    """Two alike layers, called on inputs of different ranks: not stampable."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Twice(), _Twice()

    def forward(self, x):
        return self.b(self.a(x).unsqueeze(0))


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_layers_called_on_unlike_inputs_fail_at_capture_naming_the_setting(mechanism):
    compiled = compile_model(_RankChanging(), CompilationConfig(mode=2, backend="eager", stamp_mechanism=mechanism), 32)
    with pytest.raises(CaptureError, match="not alike: set -cc.stamp_repeated_layers=false"):
        compiled(torch.ones(4, 3))
    off = compile_model(_RankChanging(), CompilationConfig(mode=2, backend="eager", stamp_repeated_layers=False), 32)
    torch.testing.assert_close(off(torch.ones(4, 3)), torch.full((1, 4, 3), 4.0))


@repeated_layer
class _Named(torch.nn.Module):
    """A layer without weights whose op names it: kiln cannot tell stamped calls apart."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        torch.ops.kiln.kv_cache_write(x.view(-1, 1, x.shape[-1]), x.view(-1, 1, x.shape[-1]), self.name)
        return x * 2


@compile_dynamic(dynamic_arg_dims={"x": 0})
class _Unweighted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Named("a"), _Named("b")

    def forward(self, x):
        return self.b(self.a(x))


@needs_stamping
def test_stamped_layers_that_cannot_be_told_apart_fail_at_capture():
    compiled = compile_model(_Unweighted(), CompilationConfig(mode=2, backend="eager",
                                                          stamp_mechanism="nested_compile_region"), 32)
    with pytest.raises(CaptureError, match=r"cannot tell which layer's names \(\['a'\]\)"):
        compiled(torch.ones(4, 3))


def test_kiln_s_mechanism_names_a_weightless_stamped_layer_by_its_call():
    # kiln's own stamps know which layer each call is, so weights are not needed to rename.
    graphs.clear()
    compiled = compile_model(_Unweighted(), CompilationConfig(mode=2, backend="kiln_test_record",
                                                          stamp_mechanism="kiln"), 32)
    compiled(torch.ones(4, 3))
    names = [n.args[2] for n in graphs[0].graph.nodes if "kv_cache_write" in str(n.target)]
    assert names == ["a", "b"] and compiled.stats["stamped_layers"] == 1


@compile_dynamic(dynamic_arg_dims={"x": 0})
class _ReadsOutside(torch.nn.Module):
    """Layers that read a value computed outside their arguments (a closure over the model)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Scaled(self), _Scaled(self)

    def forward(self, x):
        self.scale = x.sum()
        return self.b(self.a(x))


@repeated_layer
class _Scaled(torch.nn.Module):
    def __init__(self, owner):
        super().__init__()
        self.owner = [owner]

    def forward(self, x):
        return x * self.owner[0].scale


def test_kiln_s_mechanism_refuses_a_layer_that_reads_outside_its_arguments():
    compiled = compile_model(_ReadsOutside(), CompilationConfig(mode=2, backend="eager", stamp_mechanism="kiln"), 32)
    with pytest.raises(CaptureError, match="computed outside its arguments.*stamp_repeated_layers=false"):
        compiled(torch.ones(4, 3))


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_layer_class_that_inherits_its_forward_is_stamped_and_restored(tiny_llama_factory, mechanism):
    from kiln.models.llama import LlamaDecoderLayer

    @repeated_layer
    class Inherited(LlamaDecoderLayer):
        pass

    model = tiny_llama_factory(3)
    for layer in model.model.layers:
        layer.__class__ = Inherited
    _, out, stats = _capture(model, stamp=True, mechanism=mechanism)
    assert stats["stamped_layers"] == 1
    assert "forward" not in Inherited.__dict__ and Inherited.forward is LlamaDecoderLayer.forward
    torch.testing.assert_close(out, model(*INPUTS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_an_eager_call_while_stamping_runs_the_layers_as_written(tiny_llama_factory, mechanism):
    # A caller's eager call of the model while a capture's stamping is on (another thread, or
    # work run while the pieces compile) runs the layers as written.
    model = tiny_llama_factory(3)
    expected = model(*INPUTS)
    with layer_stamping.stamping(model, mechanism):
        torch.testing.assert_close(model(*INPUTS), expected, rtol=0, atol=0)


def test_gemma2_sliding_and_global_layers_are_two_kinds():
    """Gemma 2's layers differ only in their attention window (a constant of the attention op):
    two kinds, alternating, each traced once."""
    import dataclasses

    from kiln.compile.layer_stamping import layer_kinds
    from kiln.models import build_model
    from kiln.models.presets import PRESETS

    cfg = dataclasses.replace(PRESETS["gemma-2-9b"], vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_layers=5, num_heads=4, num_kv_heads=2, head_dim=16,
                              layer_types=PRESETS["gemma-2-9b"].layer_types[:5])
    model = build_model(cfg, torch.float32, torch.device("cpu"), frozenset(), None)
    assert layer_kinds(model) == [[f"model.layers.{i}" for i in (0, 2, 4)], ["model.layers.1", "model.layers.3"]]
