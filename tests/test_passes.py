"""The pass manager and the generic passes (kiln.compile.passes): uuid and cache key,
per-shape opt-out, match counts, graph dumps, no-op elimination, re-inplacing.

Graph-level tests run on make_fx graphs (no Inductor); the few Inductor compiles here are
of toy functions (a second or two each).
"""

import importlib.util
import sys

import pytest
import torch
from pass_probes import COPY_PROBES, seen
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.compile import compile_dynamic, compile_model
from kiln.compile.cache import CompileCache
from kiln.compile.config import CompilationConfig
from kiln.compile.passes.fx_edit import is_op
from kiln.compile.passes.graph_pass import GraphPass
from kiln.compile.passes.manager import PassManager
from kiln.compile.passes.noop_elimination import NoOpElimination
from kiln.compile.passes.target import compiling
from kiln.compile.shapes import TokenShape

aten, prims = torch.ops.aten, torch.ops.prims


class CountMuls(GraphPass):
    """A test pass: counts multiplications, rewrites nothing, runs for exact sizes only."""

    name = "test_count_muls"
    order = 50

    def applies_to(self, shape):
        return shape is not None and shape.is_size

    def __call__(self, graph):
        return sum(is_op(n, aten.mul.Tensor) for n in graph.nodes)


@compile_dynamic(dynamic_arg_dims={"x": 0})
class ThreeMuls(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2) * 3 * x


def test_pass_opts_out_per_range_counts_matches_and_dumps(tmp_path):
    config = CompilationConfig(mode=3, passes=["test_count_muls"], compile_sizes=[4],
                               pass_dump_dir=str(tmp_path))
    compiled = compile_model(ThreeMuls(), config, max_num_batched_tokens=8)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), ThreeMuls()(x))  # size 4: the pass runs
    assert compiled.stats["pass_matches"] == {"test_count_muls": 3}
    compiled(torch.randn(6, 3))  # range [1, 8]: the pass opts out
    assert compiled.stats["inductor_compiles"] == 2
    assert compiled.stats["pass_matches"] == {"test_count_muls": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["submod_0-size_4"]
    dumps = sorted(p.name for p in (tmp_path / "submod_0-size_4").iterdir())
    assert dumps == ["00-test_count_muls-after.py", "00-test_count_muls-before.py"]
    assert "torch.ops.aten.mul.Tensor" in (tmp_path / "submod_0-size_4" / dumps[1]).read_text()


PASS_SOURCE = '''
from kiln.compile.passes.graph_pass import GraphPass


class EditedPass(GraphPass):
    name = "test_edited_pass"
    order = 50

    def __call__(self, graph):
        return {matches}
'''


def _load_pass_module(path, matches: int, monkeypatch):
    path.write_text(PASS_SOURCE.format(matches=matches))
    spec = importlib.util.spec_from_file_location("kiln_test_edited_pass", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)


def test_uuid_follows_pass_source_config_and_shape(tmp_path, monkeypatch):
    path = tmp_path / "edited_pass.py"
    _load_pass_module(path, 0, monkeypatch)
    before = PassManager(["test_edited_pass"]).uuid()
    assert PassManager(["test_edited_pass"]).uuid() == before  # stable
    _load_pass_module(path, 1, monkeypatch)  # the same pass, its source edited
    assert PassManager(["test_edited_pass"]).uuid() != before
    # The config: which passes run.
    assert PassManager(["noop_elimination"]).uuid() != PassManager(["noop_elimination", "reinplace"]).uuid()
    # Inside a compile the uuid also says which passes opted out of the shape, so Inductor
    # never serves an artifact built with a pass to a shape that opted out of it.
    manager = PassManager(["test_count_muls"])
    with compiling("submod_0", TokenShape(4, 4)):
        size = manager.uuid()
    with compiling("submod_0", TokenShape(1, 8)):
        assert manager.uuid() != size


def test_pass_uuid_is_in_the_compile_cache_key():
    cache = CompileCache.from_env({"architecture": "three-muls"})

    def config_factor(passes):
        compiled = compile_model(ThreeMuls(), CompilationConfig(mode=3, passes=passes), 8, cache=cache)
        return compiled._model_cache()

    plain, counted, noop = config_factor([]), config_factor(["test_count_muls"]), config_factor(["noop_elimination"])
    assert plain.factors["config"]["passes"] is None
    assert counted.factors["config"]["passes"] == PassManager(["test_count_muls"]).uuid()
    assert len({plain.prekey, counted.prekey, noop.prekey}) == 3


def test_unknown_pass_and_bad_combinations_fail_at_start_up():
    with pytest.raises(ValueError, match="'fuse_norms' is not a graph pass; known: .*fuse_add_rms_norm"):
        CompilationConfig(passes=["fuse_norms"])
    with pytest.raises(ValueError, match="piece_compiler 'inductor'"):
        CompilationConfig.level(1, passes=["noop_elimination"])
    with pytest.raises(ValueError, match="splitting_mode 'inductor_partition'"):
        CompilationConfig(splitting_mode="none", splitting_ops=["kiln::attention"])


def _noop_candidates(x):
    a = aten.view.default(x, [-1, 8])  # identity, though -1 is not literally the size
    b = aten.slice.Tensor(a, 0, 0, 9223372036854775807)  # the whole dim
    c = prims.convert_element_type.default(b, torch.float32)  # already float32
    d = aten._to_copy.default(c, dtype=torch.float32)
    kept = [aten.view.default(d, [-1, 2, 4]), aten.slice.Tensor(d, 1, 0, 4),
            prims.convert_element_type.default(d, torch.float64), aten.reshape.default(d, [-1])]
    return [t * 2 for t in kept]


def test_noop_elimination_removes_identities_only():
    x = torch.randn(6, 8)
    gm = make_fx(_noop_candidates, tracing_mode="symbolic")(x)

    def count(*ops):
        return sum(is_op(n, *ops) for n in gm.graph.nodes)

    views = (aten.view.default, aten._unsafe_view.default, aten.slice.Tensor)
    conversions = (prims.convert_element_type.default, aten._to_copy.default)
    before = [t.clone() for t in gm(x)]
    assert (count(*views), count(*conversions)) == (5, 3)
    assert NoOpElimination()(gm.graph) == 4
    gm.recompile()
    assert (count(*views), count(*conversions)) == (3, 1)
    for got, want in zip(gm(x), before):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(gm(torch.ones(3, 8)), _noop_candidates(torch.ones(3, 8))))


OLD_TORCH = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)


@torch.library.custom_op("kiln_test::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, factor: float) -> None:
    x.mul_(factor)


def _mutations(x, y):
    tmp = y * 2
    scale_(tmp, 3.0)  # an intermediate: written in place, no clone
    scale_(x, 0.5)  # a graph input: written in place, no clone and no copy_ back
    return tmp + 1


def test_reinplace_removes_the_copies_of_functionalized_mutations():
    manager = PassManager(["reinplace", *COPY_PROBES])
    seen.clear()
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    want_x, want = x * 0.5, y * 6 + 1
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager, fx_graph_cache=False):
        got = torch.compile(_mutations, backend="inductor", fullgraph=True)(x, y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, want_x)
    # torch 2.13 hands the pass two clones (one per mutated tensor) and the copy_ back into x;
    # torch 2.11 hands it one copy (2.12 was never run here). None after, on both.
    assert seen == {"copies_before": 1 if OLD_TORCH else 3, "copies_after": 0}
    assert manager.monitor.counters.pass_matches["reinplace"] == 2
