"""torch.library.opcheck on every kiln custom op: schema (declared mutations), fake
implementations and their use under AOT dispatch with dynamic shapes.

The opaque ops are checked both bare and inside a forward context with a paged KV cache,
the way the engine calls them.
"""

import pytest
import torch

import kiln.distributed  # noqa: F401  registers the collectives
import kiln.ops  # noqa: F401  registers torch.ops.kiln.*
from kiln.forward_context import AttentionMetadata, set_forward_context
from kiln.ops.rotary import rope_cos_sin_cache

T, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 5, 4, 2, 16, 64


def _rand(*shape):
    return torch.randn(*shape)


def _cases():
    q, k, v = _rand(T, HEADS, HEAD_DIM), _rand(T, KV_HEADS, HEAD_DIM), _rand(T, KV_HEADS, HEAD_DIM)
    cache = rope_cos_sin_cache(HEAD_DIM, 64, 10000.0, None)
    ops = torch.ops.kiln
    return {
        "rms_norm": (ops.rms_norm, (_rand(T, HIDDEN), _rand(HIDDEN), 1e-5)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm, (_rand(T, HIDDEN), _rand(T, HIDDEN), _rand(HIDDEN), 1e-5)),
        "silu_and_mul": (ops.silu_and_mul, (_rand(T, 2 * HIDDEN),)),
        "gelu_tanh_and_mul": (ops.gelu_tanh_and_mul, (_rand(T, 2 * HIDDEN),)),
        # 4 experts, top 2, renormalised; an intermediate size of HIDDEN / 2
        "fused_moe": (ops.fused_moe, (_rand(T, HIDDEN), _rand(T, 4), _rand(4, HIDDEN, HIDDEN), _rand(4, HIDDEN, HIDDEN // 2),
                                      2, True)),
        "skinny_linear": (ops.skinny_linear, (_rand(T, HIDDEN), _rand(3 * HIDDEN, HIDDEN))),
        "act_and_mul_linear": (ops.act_and_mul_linear, (_rand(T, 2 * HIDDEN), _rand(3 * HIDDEN, HIDDEN), "silu")),
        "act_and_mul_linear.gelu_tanh": (ops.act_and_mul_linear,
                                         (_rand(T, 2 * HIDDEN), _rand(3 * HIDDEN, HIDDEN), "gelu_tanh")),
        "rotary_embedding": (ops.rotary_embedding, (torch.arange(T), _rand(T, HEADS * HEAD_DIM),
                                                    _rand(T, KV_HEADS * HEAD_DIM), cache, HEAD_DIM)),
        "kv_cache_write": (ops.kv_cache_write, (k, v, "layer0")),
        "rotary_kv_cache_write": (ops.rotary_kv_cache_write, (torch.arange(T), q, k, v, cache, "layer0")),
        "attention": (ops.attention, (q, k, v, torch.empty(0), torch.empty_like(q), "layer0", HEAD_DIM**-0.5)),
        # On the one-process group (no torch.distributed); tests/test_collectives.py runs them on two.
        "all_reduce": (ops.all_reduce, (_rand(T, HIDDEN), "tp")),
        "reduce_scatter": (ops.reduce_scatter, (_rand(T, HIDDEN), "tp")),
        "all_gather": (ops.all_gather, (_rand(T, HIDDEN), "tp")),
    }


def _paged_context():
    block_size, blocks = 4, 4
    kv_cache = torch.zeros(2, blocks, block_size, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        max_query_len=T, max_seq_len=T, num_actual_tokens=T, seq_lens_cpu=[T], query_start_loc_cpu=[0, T])
    return set_forward_context(meta, {"layer0": kv_cache})


def test_every_kiln_op_is_checked():
    registered = set(torch.ops.kiln)
    checked = {name.split(".")[0] for name in _cases()}  # "op.variant": a second case of one op
    assert registered == checked, f"ops without an opcheck case: {registered - checked}"


@pytest.mark.parametrize("name", sorted(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", ["kv_cache_write", "rotary_kv_cache_write", "attention"])
def test_opcheck_with_a_paged_kv_cache(name):
    op, args = _cases()[name]
    with _paged_context():
        if name == "attention":  # attention reads what the write stored
            torch.ops.kiln.kv_cache_write(args[1], args[2], "layer0")
        torch.library.opcheck(op, args)


def test_every_kiln_op_has_its_function_on_the_device_keys():
    # Compiled code calls the ops through the dispatcher: each device's key holds kiln's function
    # itself, not custom_op's Python wrappers around it (kiln.ops.custom_op.register_direct_kernels).
    from kiln.ops.custom_op import DIRECT_DEVICES, _qualnames

    assert len(_qualnames) >= 10
    for name in _qualnames.values():
        registrations = torch._C._dispatch_dump(name).splitlines()
        for key in DIRECT_DEVICES.values():
            active = [line for line in registrations if line.startswith(f"{key}: ")]
            assert len(active) == 1 and "kiln/ops/custom_op.py" in active[0], (name, registrations)


def test_a_kernel_defined_after_registration_is_refused():
    # It would reach `call` (eager layers) but not the dispatcher (compiled code): two functions for one op.
    from kiln.ops.custom_op import kernel
    from kiln.ops.norm import rms_norm_op

    with pytest.raises(RuntimeError, match="define it in kiln.ops"):
        kernel(rms_norm_op, "cpu")(lambda x, weight, eps, unit_offset=False: x)
