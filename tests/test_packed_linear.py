"""bf16 linear weights prepacked for oneDNN on the CPU (kiln/ops/cpu/packed_linear.py): the same
bits as F.linear, found by the ops through the graph's ordinary weight, gone with the weight."""

import gc

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM, SamplingParams
from kiln.config import resolve_custom_ops
from kiln.models import build_model
from kiln.models.presets import PRESETS
from kiln.ops.cpu import packed_linear
from kiln.ops.linear import act_and_mul_linear_op, kiln_linear_weights, skinny_linear_op

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _tiny_model(ops):
    model = build_model(PRESETS["tiny-llama"], torch.bfloat16, torch.device("cpu"), resolve_custom_ops(ops, "none"),
                        None)
    for p in model.parameters():
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (4096, 64)])
def test_packed_matmul_is_f_linear_to_the_bit(rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.nn.Parameter(torch.randn(*shape, generator=gen).to(torch.bfloat16) * 0.05, requires_grad=False)
    assert packed_linear.pack_linear_weights([weight]) == weight.numel() * 2
    x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
    y = packed_linear.packed_linear(x, weight)
    assert y is not None and torch.equal(y, F.linear(x, weight))
    assert torch.equal(skinny_linear_op(x.view(1, rows, -1), weight), F.linear(x, weight).view(1, rows, -1))
    # The activation rides along into the same packed matmul.
    gated = torch.randn(rows, 2 * shape[1], generator=gen).to(torch.bfloat16)
    assert torch.equal(act_and_mul_linear_op(gated, weight, "silu"),
                       F.linear(F.silu(gated[:, :shape[1]]) * gated[:, shape[1]:], weight))


def test_only_kiln_linear_layers_pack_and_entries_die_with_their_weights():
    model = _tiny_model(["none", "+skinny_linear"])
    linears = [m for m in model.modules() if getattr(m, "matmul", None) is skinny_linear_op]
    assert {id(w) for w in kiln_linear_weights(model)} == {id(m.weight) for m in linears}
    packed = packed_linear.pack_linear_weights(kiln_linear_weights(model))
    assert linears and packed == sum(m.weight.numel() * 2 for m in linears)
    keys = {packed_linear._key(m.weight) for m in linears}
    assert keys <= set(packed_linear._packed)
    x = torch.randn(3, PRESETS["tiny-llama"].hidden_size).to(torch.bfloat16)
    assert packed_linear.packed_linear(x.float(), linears[0].weight) is None  # dtypes differ: F.linear's
    del model, linears
    gc.collect()
    assert not keys & set(packed_linear._packed), "a freed weight's packed twin outlived it"
    # Layers without kiln's op are not listed, fp32 weights are left alone.
    assert kiln_linear_weights(_tiny_model(["none"])) == []
    assert packed_linear.pack_linear_weights([torch.randn(8, 4)]) == 0


def test_bf16_engine_tokens_equal_with_and_without_packed_weights():
    prompts = [[5, 6, 7, 8], list(range(20, 51))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64, block_size=16, max_model_len=128)
    packed = LLM("tiny-llama", **kw)
    assert "skinny_linear" in packed.engine.runner.custom_ops
    weights = kiln_linear_weights(packed.engine.runner.model)
    assert weights and all(packed_linear._key(w) in packed_linear._packed for w in weights)
    plain = LLM("tiny-llama", custom_ops=["all", "-skinny_linear"], **kw)
    ours, theirs = packed.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
