"""recipes: Lightning strategies (registered by name on import) and the Lightning recipes of both apps.

`from lowmem.recipes import ZeroStrategy, GeminiStrategy, DAPStrategy, StableDiffusionFineTune, ...`.
Importing `recipes` registers the strategy names with Lightning, so `Trainer(strategy="zero2")` works.
"""

from __future__ import annotations

import importlib

from ..utils.lazy import lazy_getattr

_LAZY = {
    "ZeroStrategy": ".strategies",
    "GeminiStrategy": ".strategies",
    "DAPStrategy": ".dap",
    "load_sharded_checkpoint": ".checkpoints",
    "convert_sharded_checkpoint": ".checkpoints",
    "StableDiffusionFineTune": ".diffusion",
    "ImageCaptionData": ".diffusion",
    "AlphaFoldPredictor": ".fold",
    "FoldDataModule": ".fold",
    "FoldPredictionWriter": ".fold",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

# Modules whose import registers strategy names with Lightning's StrategyRegistry.
_REGISTERING = (".strategies", ".dap")
for _module in _REGISTERING:
    importlib.import_module(_module, __name__)

__all__ = list(_LAZY)
