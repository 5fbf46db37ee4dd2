"""Breakable capture's segmentation, on the CPU with a stand-in for the CUDA graph pool.

On the GPU each segment is a CUDA graph (checked against eager by benchmarks/cudagraphs.py);
here the pool only records where segments begin and end, so the forward runs eagerly under
the dispatch mode and its cuts can be inspected.
"""

from __future__ import annotations

import pytest
import torch

from kiln.config import resolve_custom_ops
from kiln.cudagraph.breakable import SplitCall, capture_breakable
from kiln.forward_context import set_forward_context, warm_up_metadata
from kiln.models import build_model
from kiln.models.presets import PRESETS

SPLIT_OPS = {"kiln::kv_cache_write", "kiln::rotary_kv_cache_write", "kiln::attention"}


class RecordingPool:
    """Hands out segment markers instead of CUDA graphs."""

    def __init__(self):
        self.events: list[str] = []

    def begin(self):
        self.events.append("begin")
        return object()

    def end(self, graph) -> None:
        self.events.append("end")


def test_segments_end_at_each_attention_and_split_ops_are_recorded():
    cfg = PRESETS["tiny-llama"]
    model = build_model(cfg, torch.float32, torch.device("cpu"), resolve_custom_ops([], "all"), None)
    ids = torch.arange(12) % cfg.vocab_size
    pos = torch.arange(12)
    pool = RecordingPool()
    with torch.inference_mode(), set_forward_context(warm_up_metadata(12, ids.device, length=4), {}):
        expected = model(ids, pos)
        graph, out = capture_breakable(pool, model, (ids, pos), SPLIT_OPS)
    assert torch.equal(out, expected)  # the dispatch mode changes nothing it sees
    kinds = ["split" if isinstance(s, SplitCall) else "segment" for s in graph.steps]
    # L layers: L + 1 segments around L regions of (KV write, attention).
    assert kinds == ["segment", "split", "split"] * cfg.num_layers + ["segment"]
    assert pool.events == ["begin", "end"] * (cfg.num_layers + 1)
    calls = [s for s in graph.steps if isinstance(s, SplitCall)]
    # Every kernel on: the KV write is the one that rotates q and k too.
    assert [c.func._schema.name for c in calls] == ["kiln::rotary_kv_cache_write", "kiln::attention"] * cfg.num_layers
    # Attention's dummy input is the KV write's own output, kept alive by the graph.
    for write, attend in zip(calls[::2], calls[1::2]):
        assert attend.args[3] is write.outs[2]


def test_debug_replay_checks_input_addresses():
    from kiln.cudagraph.pool import CapturedCudagraph, tensor_addresses

    class Replayed:
        count = 0

        def replay(self):
            self.count += 1

    static = torch.zeros(4)
    graph = CapturedCudagraph(Replayed(), "out", tensor_addresses([static]))
    assert graph.replay(static) == "out" and graph.graph.count == 1
    with pytest.raises(RuntimeError, match="not where they were at capture"):
        graph.replay(torch.zeros(4))
    assert graph.graph.count == 1  # nothing replayed on stale addresses
