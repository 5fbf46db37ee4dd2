"""The sequence_parallel graph pass: each rank normalises only its share of the tokens.

Under tensor parallelism every row-parallel layer ends in an all-reduce, and each rank
then computes the same add + RMSNorm over all the tokens. An all-reduce is a
reduce-scatter followed by an all-gather, so the pass splits it around the norm:

    all_reduce(x) -> fused_add_rms_norm(., residual)
    becomes reduce_scatter(x) -> fused_add_rms_norm(., residual rows of this rank) -> all_gather

The communication is the same; the norm (and the residual add) work on 1/TP of the rows.
The residual stream stays split between layers: a site's residual output feeds the next
site as rows of this rank, and is gathered only for a user that needs it whole. Where the
stream starts (the vocab-parallel embedding's all-reduce) it is split the same way. No
rank number enters the graph, so every rank compiles the same code.

It needs the whole graph: the split residual crosses attention, where FX piecewise
splitting would cut it (see CompilationConfig.splitting_mode). And reduce_scatter needs
the token count to divide by the TP size, so the pass runs only for exact compile sizes
(a compile range may hold any count) and skips a site whose row count does not divide.

Matches the fused op: enable the fuse_add_rms_norm pass (or custom_ops +fused_add_rms_norm).
The collectives are kiln.distributed's ops, found by name in torch.ops.kiln.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from kiln.compile.passes.fx_edit import call, erase, getitem, is_op, outputs_of, val
from kiln.compile.passes.graph_pass import GraphPass
from kiln.compile.shapes import TokenShape

kiln = torch.ops.kiln


@dataclass
class Site:
    norm: fx.Node  # fused_add_rms_norm(all_reduce(x), residual, weight, eps)
    reduced: fx.Node  # the all_reduce feeding it
    residual: fx.Node  # an all_reduce (where the stream starts) or an earlier site's residual output
    group: str


class SequenceParallel(GraphPass):
    name = "sequence_parallel"
    order = 30
    needs_whole_graph = True

    def applies_to(self, shape: TokenShape | None) -> bool:
        return shape is not None and shape.is_size

    def __call__(self, graph: fx.Graph) -> int:
        sites = find_sites(graph)
        if sites:
            rewrite(graph, sites)
        return len(sites)


def find_sites(graph: fx.Graph) -> list[Site]:
    sites: list[Site] = []
    split_residuals: set[fx.Node] = set()  # residual outputs of earlier sites
    for node in graph.nodes:
        if not is_op(node, kiln.fused_add_rms_norm):
            continue
        a, b = node.args[:2]
        for reduced, residual in ((a, b), (b, a)):
            group = _splittable_all_reduce(reduced, node)
            if group is not None and (residual in split_residuals or _is_stream_start(residual, group)):
                sites.append(Site(node, reduced, residual, group))
                split_residuals.update(o for i, o in outputs_of(node).items() if i == 1)
                break
    return sites


def rewrite(graph: fx.Graph, sites: list[Site]) -> None:
    local: dict[fx.Node, tuple[fx.Node, str]] = {}  # a whole-rows node -> (this rank's rows of it, group)
    for site in sites:
        if site.residual not in local:  # the stream starts here: split its all-reduce too
            with graph.inserting_before(site.residual):
                rows = call(graph, kiln.reduce_scatter.default, (site.residual.args[0], site.group), like=site.residual)
            local[site.residual] = rows, site.group
        _, _, weight, eps = site.norm.args
        with graph.inserting_before(site.norm):
            x = call(graph, kiln.reduce_scatter.default, (site.reduced.args[0], site.group), like=site.reduced)
            norm = call(graph, kiln.fused_add_rms_norm.default, (x, local[site.residual][0], weight, eps),
                        like=site.norm)
            normed, residual = getitem(graph, norm, 0), getitem(graph, norm, 1)
            gathered = call(graph, kiln.all_gather.default, (normed, site.group), like=site.norm)
        outputs = outputs_of(site.norm)
        if 0 in outputs:
            outputs[0].replace_all_uses_with(gathered)
        if 1 in outputs:
            local[outputs[1]] = residual, site.group
    old = {site.norm for site in sites}
    for whole, (rows, group) in local.items():
        # A user outside the rewritten sites (a layer's first norm, or a residual returned
        # by the graph) needs all the rows back.
        if any(user not in old for user in whole.users):
            with graph.inserting_before(whole):
                gathered = call(graph, kiln.all_gather.default, (rows, group), like=whole)
            whole.replace_all_uses_with(gathered, delete_user_cb=lambda user: user not in old)
    erase(graph, [*local, *old, *(site.reduced for site in sites),
                  *(o for site in sites for o in outputs_of(site.norm).values())])


def _splittable_all_reduce(node, norm: fx.Node) -> str | None:
    """The group of an all_reduce whose only user is `norm` and whose rows divide over it."""
    if not is_op(node, kiln.all_reduce) or set(node.users) != {norm}:
        return None
    group = node.args[1]
    size = group_size(group)
    rows = val(node).shape[0]
    return group if size > 1 and isinstance(rows, int) and rows % size == 0 else None


def group_size(group: str) -> int:
    """How many ranks `group` has, asked of the collective itself: all_gather stacks one row
    per rank, and its fake (which serves meta tensors) says how many without communicating."""
    return kiln.all_gather.default(torch.empty(1, device="meta"), group).shape[0]


def _is_stream_start(node, group: str) -> bool:
    return is_op(node, kiln.all_reduce) and node.args[1] == group
