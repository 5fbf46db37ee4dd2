"""The sequence_parallel pass on tiny-llama at TP=2 (two gloo processes, fp32): each
all-reduce before a residual norm becomes reduce-scatter -> norm on half the tokens ->
all-gather, for exact compile sizes only; outputs stay those of the eager TP model.
One whole-graph compile per rank, the two ranks in parallel."""

import os
import tempfile

import pytest
import torch
from pass_probes import Collectives, seen

from kiln.compile import compile_model
from kiln.compile.config import CompilationConfig, parse_compilation_args
from kiln.compile.passes.sequence_parallel import SequenceParallel
from kiln.compile.shapes import TokenShape
from kiln.distributed import building_for, destroy_tensor_parallel
from kiln.distributed.launcher import Workers, join_as_rank0
from kiln.forward_context import set_forward_context
from kiln.models import build_model
from kiln.models.presets import PRESETS

SP = ["fuse_add_rms_norm", "sequence_parallel", Collectives.name]
TOKENS = torch.tensor([1, 15, 300, 7, 42, 99, 3, 250])


def _sequence_parallel_run(state) -> dict:
    """This rank's tiny-llama compiled with the pass for 8 tokens (an exact size, even),
    against the same model eager."""
    with building_for(state):
        model = build_model(PRESETS["tiny-llama"], torch.float32, torch.device("cpu"), frozenset(), None)
    config = CompilationConfig(mode=3, splitting_mode="inductor_partition", passes=SP, compile_sizes=[8])
    compiled = compile_model(model, config, max_num_batched_tokens=8)
    seen.clear()
    with torch.no_grad(), set_forward_context(None, {}):
        diff = (compiled(TOKENS, torch.arange(8)) - model(TOKENS, torch.arange(8))).abs().max().item()
    return {"diff": diff, "collectives": dict(seen), "matches": compiled.stats["pass_matches"]}


def _worker(state, conn) -> None:
    # Its own Inductor cache: the passes must run here too, not be served rank 0's artifact.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-sp-rank1-")
    torch.set_num_threads(1)
    conn.send(_sequence_parallel_run(state))
    conn.recv()  # None: stop


def test_sequence_parallel_rewrites_every_residual_norm_at_tp2():
    workers = Workers(2, "cpu", _worker, ())
    try:
        runs = [_sequence_parallel_run(join_as_rank0(workers)), *workers.gather()]
    finally:
        workers.shutdown()
        destroy_tensor_parallel()
    layers = PRESETS["tiny-llama"].num_layers
    for rank, run in enumerate(runs):
        # Every add + RMSNorm after an all-reduce: 2 per layer (layer 0's input norm has no add).
        assert run["matches"]["fuse_add_rms_norm"] == run["matches"]["sequence_parallel"] == 2 * layers, rank
        # The embedding's all-reduce and each layer's two are all split; a gather after each
        # rewritten norm, and one for layer 0's input norm, which needs every row.
        assert run["collectives"] == {"all_reduce": 0, "reduce_scatter": 1 + 2 * layers,
                                      "all_gather": 1 + 2 * layers}, rank
        assert run["diff"] <= 1e-5, (rank, run["diff"])


def test_sequence_parallel_runs_for_exact_sizes_only():
    # A compile range may hold token counts that do not divide by the TP size; a size that
    # does not divide is skipped site by site, when the pass sees the graph.
    sp = SequenceParallel()
    assert sp.applies_to(TokenShape(8, 8)) and not sp.applies_to(TokenShape(1, 8))


def test_sequence_parallel_with_fx_splitting_fails_at_start_up_naming_the_fix():
    with pytest.raises(ValueError, match="needs the whole graph.*-cc.splitting_mode=inductor_partition"):
        parse_compilation_args(["-O2", "-cc.passes=fuse_add_rms_norm,sequence_parallel"])
    with pytest.raises(ValueError, match="-cc.splitting_mode=inductor_partition"):
        CompilationConfig(passes=["sequence_parallel"], splitting_mode="fx")
