"""recipes: Lightning strategies (registered by name on import) and the Lightning recipes of both apps.

`from recipes import ZeroStrategy, GeminiStrategy, DAPStrategy, StableDiffusionFineTune, ...`.
Importing `recipes` registers the strategy names with Lightning, so `Trainer(strategy="zero2")` works.
"""

from __future__ import annotations

import importlib

from core_parallel._lazy import lazy_getattr

_LAZY = {
    "ZeroStrategy": "recipes.strategies",
    "GeminiStrategy": "recipes.strategies",
    "DAPStrategy": "recipes.dap",
    "StableDiffusionFineTune": "recipes.diffusion",
    "ImageCaptionData": "recipes.diffusion",
    "AlphaFoldPredictor": "recipes.fold",
    "FoldDataModule": "recipes.fold",
    "FoldPredictionWriter": "recipes.fold",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

# Modules whose import registers strategy names with Lightning's StrategyRegistry.
_REGISTERING = ("recipes.strategies", "recipes.dap")
for _module in _REGISTERING:
    importlib.import_module(_module)

__all__ = list(_LAZY)
