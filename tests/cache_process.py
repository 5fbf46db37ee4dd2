"""A process that starts tiny-llama's compiled forward as the engine does, on a given cache root.

    python tests/cache_process.py ROOT [SIZES] [--preload]
        prints one JSON line: the compile stats, the entry key, and compiled-vs-eager error;
        --preload: start kiln.compile.cache.preload before the model is built, as the engine does

Shared by tests/test_cache.py, in-process (start) and as the "second process".
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from kiln.compile.cache import CacheRoot
from kiln.compile.cache.preload import preload_if_warm
from kiln.config import EngineConfig
from kiln.engine.runner import compile_cache, compile_forward
from kiln.engine.timeline import StartupTimeline
from kiln.forward_context import set_forward_context
from kiln.loader import load_source
from kiln.models import build_model

MAX_TOKENS = 32
HERE = Path(__file__).resolve().parent


def run_python(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process that imports kiln from this checkout; `env` on top."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def engine_config(sizes: list[int] = ()) -> EngineConfig:
    return EngineConfig(model="tiny-llama", device="cpu", max_num_batched_tokens=MAX_TOKENS,
                        compilation={"mode": 3, "compile_sizes": list(sizes), "strategy": "eager"})


# The kernel ops the engine builds this model with (they are part of the cache key).
OPS = engine_config().resolved_custom_ops()


def tiny(root: Path):
    """tiny-llama (random weights) and the compile cache the engine would give it, at `root`."""
    source = load_source("tiny-llama")
    cache = compile_cache(source, torch.float32, OPS)
    cache.root = CacheRoot(Path(root))
    return build_model(source.config, torch.float32, torch.device("cpu"), OPS, None), cache


def start(root: Path, sizes: list[int] = (), preload: bool = False):
    """tiny-llama compiled (or loaded) with the engine's own start-up path."""
    config = engine_config(sizes)
    if preload:  # as ModelRunner: before the model is built
        source = load_source("tiny-llama")
        cache = compile_cache(source, torch.float32, OPS)
        cache.root = CacheRoot(Path(root))
        preload_if_warm(config.compilation_config, cache, torch.device("cpu"))
        model = build_model(source.config, torch.float32, torch.device("cpu"), OPS, None)
    else:
        model, cache = tiny(root)
    timeline = StartupTimeline()
    compiled = compile_forward(model, config, cache, timeline)
    return model, compiled, timeline


def max_error(model, compiled, counts=(1, 4, 7, MAX_TOKENS)) -> float:
    worst = 0.0
    with torch.inference_mode(), set_forward_context(None, {}):
        for n in counts:
            ids, pos = torch.randint(0, 512, (n,)), torch.arange(n)
            want, got = model(ids, pos), compiled(ids, pos)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    root = Path(sys.argv[1])
    sizes = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 and sys.argv[2] else []
    model, compiled, timeline = start(root, sizes, preload="--preload" in sys.argv[3:])
    preload = compiled.cache.preload if compiled.cache is not None else None
    print(json.dumps({"stats": compiled.stats, "key": compiled.entry.key, "phases": timeline.as_dict()["phases_s"],
                      "max_error": max_error(model, compiled),
                      "preload": None if preload is None else {"parts": preload.parts, "errors": preload.errors}}))
