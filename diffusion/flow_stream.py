"""A frozen text encoder that never exists whole in memory: T5-XXL (4.7B parameters, 9.5 GB in bf16) of SD3 and Flux
runs block by block, each block's weights read from the safetensors files just before it runs and released right
after (`streamed_encoder`).

The model is built on the meta device, its parameters made hollow (`core_parallel.gemini.lazy`: the right shape
and dtype, no memory, a safetensors source that reads with `pread` and drops the pages it read from the page
cache); a forward pre-hook on each unit (the token embedding, every block, the final norm) gives the unit's
parameters their values, a forward hook frees them again. The peak is one block plus activations; every forward
reads the weights again, so it suits what runs once per prompt (the pre-computed embeddings, validation prompts),
not an encoder used in every training step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

__all__ = ["hollow_transformer", "streamed_encoder", "weight_files"]

logger = logging.getLogger(__name__)


def weight_files(folder: Path, variant: str | None = None, name: str = "model") -> list[Path] | None:
    """The safetensors files `name[.variant].safetensors` of the component folder `folder` (shards in index order);
    None where there are none."""
    stem = name if variant is None else f"{name}.{variant}"
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    index = folder / f"{stem}.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        files = [folder / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if all(f.is_file() for f in files) else None


def _fill(module: torch.nn.Module, *_: Any) -> None:
    from ..core_parallel.gemini.lazy import take_value

    with torch.no_grad():
        for p in module.parameters():
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.view(-1).copy_(take_value(p))


def _release(module: torch.nn.Module, *_: Any) -> None:
    for p in module.parameters():
        p.data.untyped_storage().resize_(0)


def _units(model: Any) -> list[torch.nn.Module]:
    """The pieces loaded one at a time: the encoder's token embedding (tied to `shared`), its blocks, its norm."""
    encoder = model.encoder
    return [encoder.embed_tokens, *encoder.block, encoder.final_layer_norm]


class _Aliased:
    """A tensor source where `aliases` keys read another key's tensor (a tied weight saved once)."""

    def __init__(self, source: Any, aliases: dict[str, str]) -> None:
        self.source, self.aliases = source, aliases

    def keys(self) -> list[str]:
        return [*self.source.keys(), *self.aliases]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.source.shape(self.aliases.get(key, key))

    def dtype(self, key: str) -> torch.dtype:
        return self.source.dtype(self.aliases.get(key, key))

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self.source.read(self.aliases.get(key, key), lo, hi)

    def close(self) -> None:
        self.source.close()


def streamed_encoder(folder: Path, cls: Any, dtype: torch.dtype | None = None, variant: str | None = None,
                     device: torch.device | str = "cpu") -> Any:
    """The T5 encoder of the component folder `folder` (`cls`: `T5EncoderModel`) in `dtype` on `device`, streamed
    block by block, in eval mode without gradients; None where streaming does not apply (no safetensors, names or
    shapes that differ from the model's, buffers): the caller loads it whole. Not to be moved with `.to()` (its
    parameters hold no data between forwards): build it on the device it runs on."""
    from transformers import AutoConfig

    from ..core_parallel.gemini.lazy import SafetensorsSource, cast_parameters, hollow_parameters

    files = weight_files(folder, variant)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = cls(config)
    files_source = SafetensorsSource(files)
    # T5's input embedding is `shared`, tied: transformers 5 keeps two modules, the file one tensor
    tied = {"encoder.embed_tokens.weight": "shared.weight"}
    source = _Aliased(files_source, {k: v for k, v in tied.items() if k not in files_source.keys()})
    try:
        if any(True for _ in model.buffers()):
            raise ValueError("buffers")
        hollow_parameters(model, source, device=device)
        if model.encoder.embed_tokens is not model.shared:
            model.encoder.embed_tokens.weight = model.shared.weight  # one parameter again, read once
        covered = {id(p) for unit in _units(model) for p in unit.parameters()}
        if any(id(p) not in covered for p in model.parameters()):
            raise ValueError("parameters outside the streamed units")
    except (KeyError, ValueError, AttributeError) as exc:
        logger.info("%s: not streamed (%s); loading it whole", folder, exc)
        source.close()
        return None
    if dtype is not None:
        cast_parameters(model, dtype)
    for unit in _units(model):
        unit.register_forward_pre_hook(_fill)
        unit.register_forward_hook(_release)
    logger.info("%s: %s built without weights; its %d blocks stream from %s", folder, type(model).__name__,
                len(model.encoder.block), ", ".join(f.name for f in files))
    return model.requires_grad_(False).eval()


def hollow_transformer(folder: Path, cls: Any, variant: str | None = None) -> Any:
    """The diffusers transformer of the pipeline folder `folder` (its `transformer/`) with hollow parameters reading
    from its safetensors, for Gemini to fill its shards from (as `diffusion.streaming.load_unet_hollow` builds the
    UNet), its buffers (SD3's position embedding) read whole, in eval mode as `from_pretrained` returns it; None
    where that does not apply (no safetensors, keys that differ from the model's): the caller loads it whole."""
    from ..core_parallel.gemini.lazy import SafetensorsSource, hollow_parameters

    sub = Path(folder) / "transformer"
    files = weight_files(sub, variant, "diffusion_pytorch_model")
    if files is None:
        return None
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(sub))
    source = SafetensorsSource(files)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers())
    if set(source.keys()) != params | set(buffers):
        logger.info("%s: keys differ from the model's (or a buffer not in the file); loading it whole", sub)
        source.close()
        return None
    hollow_parameters(model, source)
    for name, b in buffers.items():  # small and saved (SD3's position embedding): read whole now
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = source.read(name).view(b.shape).to(b.dtype)
    model.register_to_config(_name_or_path=str(folder))
    logger.info("%s: %s built without weights; %d tensors stream from %s", sub, type(model).__name__, len(params),
                ", ".join(f.name for f in files))
    return model.eval()
