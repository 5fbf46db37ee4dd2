"""The graph passes on tiny-llama (2 layers, fp32): the whole graph goes to Inductor
(splitting_mode "none"), with no-op elimination, add + RMSNorm fusion and re-inplacing.
One Inductor compile (one range) serves every test here."""

import pytest
import torch
from pass_probes import COPY_PROBES, FusedNorms, seen

from kiln.compile import compile_model
from kiln.compile.config import CompilationConfig
from kiln.forward_context import set_forward_context


@pytest.fixture(scope="module")
def fused_llama(tiny_llama):
    config = CompilationConfig(mode=3, splitting_mode="none", strategy="eager",
                               passes=["noop_elimination", "fuse_add_rms_norm", "reinplace",
                                       FusedNorms.name, *COPY_PROBES])
    compiled = compile_model(tiny_llama, config, max_num_batched_tokens=64)
    seen.clear()
    with torch.no_grad(), set_forward_context(None, {}):
        compiled.warm_up(lambda n: (torch.randint(0, 512, (n,)), torch.arange(n)))
    return compiled, dict(seen)


def test_add_rms_norm_fuses_at_every_residual_norm(fused_llama, tiny_llama):
    compiled, probes = fused_llama
    stats = compiled.stats
    assert stats["inductor_compiles"] == 1 and stats["cache_hits"] == 0  # the passes really ran
    # Each layer's post-attention norm, every layer's input norm but layer 0's (it has no
    # residual to add yet), and the final norm: 2 per layer.
    layers = tiny_llama.config.num_layers
    assert stats["pass_matches"]["fuse_add_rms_norm"] == 2 * layers
    assert probes["fused_norms"] == 2 * layers
    with torch.no_grad(), set_forward_context(None, {}):
        for n in (2, 7, 33, 64):
            ids, pos = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)), torch.arange(n)
            got = tiny_llama.compute_logits(compiled(ids, pos))
            want = tiny_llama.compute_logits(tiny_llama(ids, pos))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_reinplace_leaves_no_copy_of_the_attention_output(fused_llama, tiny_llama):
    # kiln::attention writes `out`; functionalized, each layer's call would clone it.
    compiled, probes = fused_llama
    layers = tiny_llama.config.num_layers
    assert compiled.stats["pass_matches"]["reinplace"] == layers
    # torch 2.11 hands the pass no clone of it (2.12 was never run here); none is left on either
    old_torch = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)
    assert (probes["copies_before"], probes["copies_after"]) == (0 if old_torch else layers, 0)
