"""Test-only graph passes that observe the post-grad graph at a point in the pipeline and
record what they saw in `seen`, for tests to read."""

import torch
from torch import fx

from kiln.compile.passes.fx_edit import is_op
from kiln.compile.passes.graph_pass import GraphPass

aten = torch.ops.aten
COPIES = (aten.clone.default, aten.copy_.default, aten.copy.default)
seen: dict[str, int] = {}


def copies_when_defunctionalized(graph: fx.Graph) -> int:
    """Copy nodes left once every functionalized call is turned back into the mutating op
    the way Inductor does it without re-inplacing: a clone per mutated base."""
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized

    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    decompose_auto_functionalized(fx.GraphModule(graph.owning_module, copy).graph)
    return sum(is_op(n, *COPIES) for n in copy.nodes)


class CopiesBeforeReinplace(GraphPass):
    name = "probe_copies_before_reinplace"
    order = 89

    def __call__(self, graph):
        seen["copies_before"] = copies_when_defunctionalized(graph)
        return 0


class CopiesAfterReinplace(GraphPass):
    name = "probe_copies_after_reinplace"
    order = 91

    def __call__(self, graph):
        seen["copies_after"] = copies_when_defunctionalized(graph)
        return 0


class FusedNorms(GraphPass):
    name = "probe_fused_norms"
    order = 21  # right after fuse_add_rms_norm

    def __call__(self, graph):
        seen["fused_norms"] = sum(is_op(n, torch.ops.kiln.fused_add_rms_norm) for n in graph.nodes)
        return 0


COPY_PROBES = [CopiesBeforeReinplace.name, CopiesAfterReinplace.name]


class Collectives(GraphPass):
    name = "probe_collectives"
    order = 31  # right after sequence_parallel

    def __call__(self, graph):
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            seen[op] = sum(is_op(n, getattr(torch.ops.kiln, op)) for n in graph.nodes)
        return 0
