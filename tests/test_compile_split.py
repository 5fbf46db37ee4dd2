"""Split points and the split scan: L layers give L opaque regions and L + 1 pieces."""

import operator

import pytest
import torch
from torch import fx

import kiln.ops  # noqa: F401  registers the ops and their @split_op declarations
from kiln.compile import compile_model, effective_split_ops
from kiln.compile.config import CompilationConfig
from kiln.compile.split import check_split_ops, is_split_node, op_name, subgraph_ids


def test_split_ops_come_from_decorators_and_config_with_their_source():
    ops = {op.name: op.source for op in effective_split_ops(["aten::mm", "kiln::attention"])}
    assert ops["kiln::kv_cache_write"].startswith("decorator at ")
    assert "attention.py" in ops["kiln::attention"]  # declared at the op, not duplicated by config
    assert ops["aten::mm"] == "config"
    assert list(ops).count("kiln::attention") == 1


def test_unknown_split_op_is_a_start_up_error(tiny_llama):
    with pytest.raises(ValueError, match="'kiln::no_such_op' .* not a registered torch op"):
        compile_model(tiny_llama, CompilationConfig(splitting_ops=["kiln::no_such_op"]), 64)
    check_split_ops(effective_split_ops(["aten.mm"]))  # 'ns.op' spelling is accepted


def test_scan_matches_packets_and_overloads_and_merges_consecutive_split_ops():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    w = graph.call_function(torch.ops.kiln.kv_cache_write, (a, a, "l0"))  # packet
    graph.call_function(torch.ops.kiln.attention.default, (a, a, a, w, a, "l0", 1.0))  # overload
    b = graph.call_function(torch.ops.aten.relu.default, (a,))
    graph.output(b)
    names = {op.name for op in effective_split_ops()}
    assert op_name(torch.ops.kiln.attention) == op_name(torch.ops.kiln.attention.default) == "kiln::attention"
    ids, opaque = subgraph_ids(graph, names)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    assert [ids[n] for n in nodes] == [0, 1, 1, 2]
    assert opaque == {1}
    assert is_split_node(nodes[1], names) and is_split_node(nodes[2], names)


@pytest.mark.parametrize("merge", [True, False])
def test_the_items_of_a_split_ops_tuple_stay_in_its_region(merge):
    # kiln::rotary_kv_cache_write returns (q, k, written): a piece between it and attention
    # would take the tuple as an input, which no piece can be compiled for.
    graph = fx.Graph()
    x, pos, cache = graph.placeholder("x"), graph.placeholder("pos"), graph.placeholder("cache")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    rotated = graph.call_function(torch.ops.kiln.rotary_kv_cache_write.default, (pos, a, a, a, cache, "l0"))
    q, k, w = (graph.call_function(operator.getitem, (rotated, i)) for i in range(3))
    graph.call_function(torch.ops.kiln.attention.default, (q, k, a, w, a, "l0", 1.0))
    graph.output(graph.call_function(torch.ops.aten.relu.default, (a,)))
    ids, opaque = subgraph_ids(graph, {op.name for op in effective_split_ops()}, merge)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    assert [ids[n] for n in nodes] == ([0, 1, 1, 1, 1, 1, 2] if merge else [0, 1, 1, 1, 1, 2, 3])
    assert opaque == ({1} if merge else {1, 2})


@pytest.mark.parametrize("num_layers", [1, 2, 4, 30])
def test_layers_give_opaque_regions_and_pieces(tiny_llama_factory, num_layers):
    model = tiny_llama_factory(num_layers)
    compiled = compile_model(model, CompilationConfig(mode=3, piece_compiler="eager"), 32)
    ids, pos = torch.randint(0, 512, (6,)), torch.arange(6)
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=0, atol=0)
    stats = compiled.stats
    assert stats["opaque_regions"] == num_layers
    assert stats["pieces"] == num_layers + 1
    # first (embedding + layer 0 up to attention), middle (identical across layers), last
    assert stats["unique_pieces"] == min(num_layers + 1, 3)
    assert len(compiled.backend.pieces.uniques) == stats["unique_pieces"]


def test_each_opaque_region_holds_the_kv_write_and_its_attention(tiny_llama):
    seen = {}

    def record(gm, example_inputs):
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(tiny_llama.forward, fullgraph=True, backend=record)(torch.randint(0, 512, (5,)), torch.arange(5))
    from kiln.compile.split import split_graph

    split = split_graph(seen["gm"], {op.name for op in effective_split_ops()})
    assert len(split.regions) == 2 and len(split.pieces) == 3
    for name in split.regions:
        targets = [op_name(n.target) for n in getattr(split.module, name).graph.nodes if n.op == "call_function"]
        assert targets == ["kiln::kv_cache_write", "kiln::attention"]


def test_every_piece_returns_a_tuple_without_split_modules_tuple_return(tiny_llama):
    """torch < 2.12 has no tuple_return; kiln rewrites the split graph the same way."""
    from torch.fx.passes.split_module import split_module

    from kiln.compile.split import _return_tuples
    from kiln.forward_context import set_forward_context

    captured = []

    def record(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    ids = torch.arange(8)
    with set_forward_context(None, {}):
        torch.compile(tiny_llama, backend=record, fullgraph=True)(ids, ids)
    torch._dynamo.reset()
    gm, inputs = captured[0]
    sub_ids, _ = subgraph_ids(gm.graph, {op.name for op in effective_split_ops()})
    split = _return_tuples(split_module(gm, gm, lambda n: sub_ids[n], keep_original_order=True))
    for name, sub in split.named_children():
        output = next(n for n in sub.graph.nodes if n.op == "output")
        assert isinstance(output.args[0], tuple), name
    with set_forward_context(None, {}):
        torch.testing.assert_close(split(*inputs), gm(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("num_layers", [1, 2, 4])
def test_without_the_merge_each_split_op_is_its_own_region(tiny_llama_factory, num_layers):
    """SGLang's scan (-cc.merge_consecutive_split_ops=false): the KV write and attention are
    two regions, with no piece between them (nothing runs there); tokens as eager's."""
    from kiln import LLM, SamplingParams

    model = tiny_llama_factory(num_layers)
    config = CompilationConfig(mode=3, piece_compiler="eager", merge_consecutive_split_ops=False)
    compiled = compile_model(model, config, 32)
    ids, pos = torch.randint(0, 512, (6,)), torch.arange(6)
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=0, atol=0)
    stats = compiled.stats
    assert (stats["opaque_regions"], stats["pieces"]) == (2 * num_layers, num_layers + 1)
    regions = [getattr(compiled.backend.program.graph, name) for name in compiled.backend.program.regions]
    assert all(len([n for n in r.graph.nodes if n.op == "call_function"]) == 1 for r in regions)
    if num_layers == 2:  # through the engine, Inductor pieces: the same greedy tokens as eager
        kw = dict(device="cpu", max_num_batched_tokens=32, num_kv_blocks=64)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        prompt = [[5, 9, 13, 2, 7]]
        eager = LLM("tiny-llama", **kw).generate(prompt, params, use_tqdm=False)[0].token_ids
        split = LLM("tiny-llama", compilation={"merge_consecutive_split_ops": False}, **kw)
        assert split.generate(prompt, params, use_tqdm=False)[0].token_ids == eager
        assert split.engine.runner.compiled.stats["opaque_regions"] == 2 * 2


def test_the_merge_setting_must_be_a_bool():
    with pytest.raises(ValueError, match="merge_consecutive_split_ops must be true or false"):
        CompilationConfig(merge_consecutive_split_ops="no")
