"""The real SmolLM2 (embedded weights) compiled piecewise: same greedy tokens as eager.

Greedy decoding re-runs the whole sequence each step without a forward context, so the
attention op attends causally within the fresh keys; no KV cache is involved.
"""

import pytest
import torch

from kiln.compile import compile_model
from kiln.compile.config import CompilationConfig

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_model(smollm2):
    from kiln.models import build_model

    return build_model(smollm2.config, torch.float32, torch.device("cpu"), frozenset(), smollm2.weights())


def _greedy(forward, model, ids: list[int]) -> list[int]:
    ids = list(ids)
    for _ in range(NEW_TOKENS):
        hidden = forward(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids


def test_greedy_tokens_match_eager(smollm2, smollm2_model):
    compiled = compile_model(smollm2_model, CompilationConfig(), max_num_batched_tokens=128)
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = smollm2.tokenizer.encode(prompt)
            want = _greedy(smollm2_model, smollm2_model, ids)
            got = _greedy(compiled, smollm2_model, ids)
            assert got == want, (prompt, smollm2.tokenizer.decode(got), smollm2.tokenizer.decode(want))
    stats = compiled.stats
    assert (stats["pieces"], stats["opaque_regions"], stats["unique_pieces"]) == (31, 30, 3)
    assert stats["graphs_seen"] == 1 and stats["inductor_compiles"] == 3
