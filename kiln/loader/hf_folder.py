"""HF checkpoint folders: config.json, one or many *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelArchConfig


class HFCheckpoint:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{self.folder} has no config.json; pass an HF model folder, "
                                    f"a .gguf file or a preset name")
        self.hf_config = json.loads(config_path.read_text())
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [self.folder / s for s in shards]
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder} has no *.safetensors files (kiln does not read "
                                    f"pickled .bin checkpoints; convert them with safetensors first)")
        return files

    def config(self) -> ModelArchConfig:
        return ModelArchConfig.from_hf(self.hf_config)

    def tokenizer(self) -> Tokenizer | None:
        if not (self.folder / "tokenizer.json").exists():
            return None
        return Tokenizer.from_folder(self.folder, self.config().eos_token_ids)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def save_hf_folder(folder: str | Path, cfg: ModelArchConfig,
                   tensors: dict[str, torch.Tensor], max_shard_bytes: int = 2 << 30) -> None:
    """Write HF-named tensors as sharded safetensors plus config.json (tests, conversions)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
