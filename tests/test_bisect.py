"""kiln bisect finds a divergence planted in one op of one piece, and names both.

The plant is an extra backend: it compiles every piece with AOT-eager, but in one piece
it rewrites one op's result. Numbers and tokens are separate verdicts, so the tests also
plant a change that keeps tokens and one that changes them.
"""

import operator
import os
import subprocess
import sys

import pytest
import torch

from kiln.tools.bisect import bisect, relative_error, render, to_json

PROMPT = list(range(5, 17))
PIECE = "submod_2"  # layer 0's o_proj and MLP, layer 1 up to its attention


@pytest.fixture(scope="module")
def model(tiny_llama_factory):
    return tiny_llama_factory(3)


def planted(change, *args, piece=PIECE, where="mlp.act"):
    """A piece compiler that replaces the result x of the first operator.mul under module
    `where` of `piece` by change(x, *args)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    hit = {}

    def compiler(gm, example_inputs):
        for node in gm.graph.nodes:
            path = list((node.meta.get("nn_module_stack") or {}).values())
            if (gm.meta.get("piece") == piece and node.target is operator.mul and path
                    and path[-1][0].endswith(where)):
                hit["node"] = node.name
                with gm.graph.inserting_after(node):
                    changed = gm.graph.call_function(change, (node, *args))
                node.replace_all_uses_with(changed, delete_user_cb=lambda user: user is not changed)
                gm.recompile()
                break
        return aot_eager(gm, example_inputs)

    return compiler, hit


def test_names_the_planted_piece_and_op_and_the_other_stages_pass(model):
    compiler, hit = planted(operator.mul, 1.001)
    report = bisect(model, PROMPT, extra_backends={"planted": compiler}, new_tokens=8)
    stages = {s.name: s for s in report.stages}
    for name in ("dynamo+eager", "aot_eager", "inductor"):
        assert stages[name].error <= report.tolerance == 1e-4, name
        assert stages[name].tokens == stages["eager"].tokens, name
    bad = stages["planted"]
    assert report.first_divergence is bad
    assert bad.divergence.piece == PIECE
    assert bad.divergence.op.node == hit["node"]
    assert bad.divergence.op.op == "operator.mul"
    assert bad.divergence.op.where.modules == "model.layers.0.mlp.act"
    assert "kiln/ops/activation.py" in bad.divergence.op.where.source
    assert bad.divergence.op.error == pytest.approx(1e-3, rel=0.05)
    # A 0.1% change is far beyond fp32 tolerance but too small to move a greedy token.
    assert bad.tokens == stages["eager"].tokens
    text = render(report)
    assert f"first divergence at planted, piece {PIECE}" in text
    assert f"first op: {hit['node']} = operator.mul(" in text
    assert "tokens: every stage equals eager" in text
    assert to_json(report)["first_divergence"] == "planted"


def test_tokens_are_a_separate_verdict_from_tolerance(model):
    # Negating the last piece's final-norm scale flips every logit: a relative error of 2,
    # inside a tolerance of 3 on purpose, and different tokens.
    compiler, hit = planted(operator.neg, piece="submod_6", where="model.norm")
    report = bisect(model, PROMPT, extra_backends={"flip": compiler}, stages=["flip"], tolerance=3.0,
                    new_tokens=4)
    flip = report.stages[-1]
    assert hit and flip.error == pytest.approx(2.0, rel=1e-3)
    assert report.first_divergence is None
    assert flip.tokens != report.stages[0].tokens
    text = render(report)
    assert "numerics: every stage within 3e+00" in text
    assert "tokens: flip differs from eager at generated token 0" in text


def test_relative_error():
    want = torch.tensor([3.0, 4.0])
    assert relative_error(want, want) == 0
    assert relative_error(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1)
    assert relative_error(torch.tensor([float("nan"), 4.0]), want) == float("inf")
    assert relative_error(torch.ones(3), torch.zeros(3)) == pytest.approx(3**0.5)


def test_cli_prints_the_stages():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "kiln.cli", "bisect", "--model", "tiny-llama", "--prompt",
                          "hello there", "--tokens", "4", "--stages", "aot_eager"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "dynamo+eager  0.0e+00 (whole model) ok" in run.stdout
    assert "aot_eager" in run.stdout and "numerics: every stage within 1e-04" in run.stdout
