"""diffusion: Stable Diffusion fine-tuning on diffusers, as plain PyTorch (no Lightning, no torch.distributed).

- `diffusion.tiny`: a tiny pipeline built offline from configs (tokenizer included).
- `diffusion.models`: load a pipeline folder / single file, assemble a `StableDiffusionPipeline`.
- `diffusion.data`: folder scanning with validation, preprocessing, the resumable sampler.
- `diffusion.training`: the training-step math (loss, min-SNR, noise offset, prior preservation), EMA.
- `diffusion.lora`, `diffusion.attention`, `diffusion.export`, `diffusion.sample_data`, `diffusion.config`.

The Lightning recipe is `recipes.StableDiffusionFineTune`; the command is `suite diffusion finetune`.
"""

from __future__ import annotations

from ..utils.lazy import lazy_getattr

_LAZY = {
    "FineTuneConfig": ".config",
    "TinyPipelineConfig": ".tiny",
    "build_tiny_components": ".tiny",
    "load_components": ".models",
    "make_pipeline": ".models",
    "DataConfig": ".data",
    "LossConfig": ".training",
    "EMA": ".training",
    "diffusion_loss": ".training",
    "KernelsAttnProcessor": ".attention",
    "InputError": ".errors",
}
__getattr__ = lazy_getattr(__name__, _LAZY)
__all__ = list(_LAZY)
