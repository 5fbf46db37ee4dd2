"""Capture: opt-in, dynamic token dim, loud failures, and dispatch that skips Dynamo.

These use the eager piece compiler (no Inductor), so they cost Dynamo time only.
"""

import inspect

import pytest
import torch

from kiln.compile import CaptureError, compile_dynamic, compile_model
from kiln.compile.config import CompilationConfig
from kiln.compile.pieces import PieceRunner

SPLIT_ONLY = CompilationConfig(mode=3, piece_compiler="eager")


def _inputs(n):
    return torch.randint(0, 512, (n,)), torch.arange(n)


def _line_of(text: str) -> int:
    """The line of this file that contains `text` (so the tests survive edits above them)."""
    lines, start = inspect.getsourcelines(Toy)
    return start + next(i for i, line in enumerate(lines) if text in line)


@compile_dynamic(dynamic_arg_dims={"x": 0, "positions": 0})
class Toy(torch.nn.Module):
    """A model whose forward has one of several shape bugs, picked by `kind`."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, positions):
        if self.kind == "branch" and x.shape[0] > 4:  # BRANCH
            x = x * 2
        if self.kind == "view":
            x = x.view(5, 8)  # VIEW
        if self.kind == "graph_break" and x.sum() > 0:  # GRAPH BREAK
            x = x + 1
        return x @ self.w + positions[:, None]


class Undecorated(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_undecorated_model_runs_eagerly():
    compiled = compile_model(Undecorated(), CompilationConfig(), 16)
    assert compiled.capture is None
    assert "not decorated" in compiled.describe()
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))


def test_mode_0_runs_eagerly(tiny_llama):
    compiled = compile_model(tiny_llama, CompilationConfig(mode=0), 16)
    assert compiled.capture is None and compiled.describe() == "eager (mode 0)"
    ids, pos = _inputs(5)
    assert torch.equal(compiled(ids, pos), tiny_llama(ids, pos))


def test_decorator_rejects_unknown_argument():
    with pytest.raises(TypeError, match="no argument.*input_idz"):
        compile_dynamic(dynamic_arg_dims={"input_idz": 0})(Undecorated)


@pytest.mark.parametrize("mark", ["backed", "unbacked"])
def test_shape_branch_is_caught_at_capture_naming_the_line(mark):
    compiled = compile_model(Toy("branch"), CompilationConfig(mode=3, piece_compiler="eager",
                                                             dynamic_shapes_mark=mark), 64)
    with pytest.raises(CaptureError, match=rf"depends on the number of tokens.*:{_line_of('# BRANCH')}\b"):
        compiled(torch.randn(6, 8), torch.arange(6.0))
    assert compiled.stats["pieces"] == 0  # failed before anything was compiled


def test_size_baked_into_a_view_is_caught_at_capture():
    compiled = compile_model(Toy("view"), SPLIT_ONLY, 64)
    with pytest.raises(CaptureError, match=rf"(?s)depends on the number of tokens.*:{_line_of('# VIEW')} .*Eq\("):
        compiled(torch.randn(5, 8), torch.arange(5.0))


def test_graph_break_names_file_line_and_what_to_do():
    compiled = compile_model(Toy("graph_break"), SPLIT_ONLY, 64)
    with pytest.raises(CaptureError, match=rf"(?s)graph break in Toy.forward at .*test_compile_capture.py:"
                                           rf"{_line_of('# GRAPH BREAK')}:.*@split_op"):
        compiled(torch.randn(5, 8), torch.arange(5.0))


def test_later_calls_skip_dynamo(tiny_llama, monkeypatch):
    compiled = compile_model(tiny_llama, SPLIT_ONLY, 64)
    compiled(*_inputs(7))
    calls = []
    original = PieceRunner.__call__
    monkeypatch.setattr(PieceRunner, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    # Under "force_eager" Dynamo runs the original Python instead of compiled code; the
    # pieces still running proves the call never went through Dynamo's frame evaluation.
    ids, pos = _inputs(5)
    with torch.compiler.set_stance("force_eager"):
        out = compiled(ids, pos)
    assert len(calls) == 3  # one per piece
    torch.testing.assert_close(out, tiny_llama(ids, pos), rtol=0, atol=0)
    assert compiled.stats["graphs_seen"] == 1


def test_no_recompile_across_token_counts(tiny_llama):
    compiled = compile_model(tiny_llama, CompilationConfig(mode=3, piece_compiler="eager",
                                                           compile_ranges=[8, 32], compile_sizes=[3]), 64)
    for n in (5, 1, 3, 8, 9, 32, 33, 64):
        ids, pos = _inputs(n)
        torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=0, atol=0)
    assert compiled.stats["graphs_seen"] == 1
    with pytest.raises(ValueError, match=r"65 tokens is outside \[1, 64\]"):
        compiled(*_inputs(65))


def test_two_models_of_one_class_get_their_own_graphs(tiny_llama_factory):
    # Different depth and attention scale: neither may leak into the other's capture.
    one, three = tiny_llama_factory(1), tiny_llama_factory(3, head_dim=8)
    c1, c3 = compile_model(one, SPLIT_ONLY, 32), compile_model(three, SPLIT_ONLY, 32)
    ids, pos = _inputs(6)
    torch.testing.assert_close(c1(ids, pos), one(ids, pos), rtol=0, atol=0)
    torch.testing.assert_close(c3(ids, pos), three(ids, pos), rtol=0, atol=0)
    assert (c1.stats["opaque_regions"], c3.stats["opaque_regions"]) == (1, 3)


def test_a_one_token_first_call_waits_to_capture(tiny_llama):
    compiled = compile_model(tiny_llama, SPLIT_ONLY, 32)
    ids, pos = _inputs(1)
    torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=0, atol=0)
    assert compiled.stats["graphs_seen"] == 0
    compiled(*_inputs(4))
    assert compiled.stats["graphs_seen"] == 1


def test_debug_guards_fail_on_recompile(tiny_llama):
    config = CompilationConfig(mode=3, piece_compiler="eager", debug_guards=True)
    compiled = compile_model(tiny_llama, config, 32)
    for n in (6, 2, 32):
        ids, pos = _inputs(n)
        torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=0, atol=0)
    with pytest.raises(CaptureError, match="would recompile"):
        compiled(*_inputs(33))


def test_mode_2_with_a_named_backend(tiny_llama):
    compiled = compile_model(tiny_llama, CompilationConfig(mode=2, backend="eager"), 32)
    for n in (6, 1, 32):
        ids, pos = _inputs(n)
        torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=0, atol=0)
    assert compiled.stats["graphs_seen"] == 1 and compiled.capture.direct is not None
    assert "Dynamo once" in compiled.describe()


@pytest.mark.parametrize("mode, first", [(3, 16), (2, 64)])
def test_warm_up_captures_with_few_tokens_in_mode_3(tiny_llama, mode, first):
    """Mode 3 captures with 16 tokens and compiles every range then; mode 2's backend tunes
    for the capture call's count, so it gets the most tokens."""
    calls = []

    def inputs(n):
        calls.append(n)
        return _inputs(n)

    config = CompilationConfig(mode=mode, piece_compiler="eager", backend="eager", compile_ranges=[8])
    compiled = compile_model(tiny_llama, config, 64)
    compiled.warm_up(inputs)
    assert calls == [first]
    if mode == 3:
        assert set(compiled.backend.pieces.by_shape) == set(compiled.backend.plan.all_shapes())


def test_a_range_is_tuned_for_its_largest_count():
    from kiln.compile.shapes import TokenShape, size_hint

    assert size_hint(TokenShape(9, 64)) == 64 and size_hint(TokenShape(4, 4)) == 4


def test_kernel_path_ops_capture_with_one_token_symbol():
    """With every op on its kernel path (the -O1 default) positions meet the hidden states
    only inside the rotary op: its fake says they share the token count."""
    import dataclasses

    from kiln.models import build_model
    from kiln.models.presets import PRESETS
    from kiln.ops.custom_op import known_ops

    cfg = dataclasses.replace(PRESETS["tiny-llama"], num_layers=2)
    model = build_model(cfg, torch.float32, torch.device("cpu"), frozenset(known_ops()) - {"skinny_linear"}, None)
    compiled = compile_model(model, SPLIT_ONLY, 64)
    ids, pos = _inputs(6)
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos), rtol=0, atol=0)
    assert compiled.stats["graphs_seen"] == 1


def test_piecewise_mode_with_one_token_at_most_fails_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="needs max_num_batched_tokens >= 2"):
        compile_model(tiny_llama, SPLIT_ONLY, 1)
    compile_model(tiny_llama, CompilationConfig(mode=2, backend="eager"), 1)  # one static graph serves
