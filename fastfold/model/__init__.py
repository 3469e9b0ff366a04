"""fastfold.model: the AlphaFold2 monomer network, one module per algorithm of the supplement.

from lowmem.fastfold.model import AlphaFold, InferenceOptions, config
model = AlphaFold(config.tiny())                       # or fastfold.params.from_params("params_model_1.npz")
out = model(batch, InferenceOptions(chunk_size=4))
"""

from __future__ import annotations

from . import config
from .alphafold import AlphaFold
from .config import AlphaFoldConfig
from .options import InferenceOptions

__all__ = ["AlphaFold", "AlphaFoldConfig", "InferenceOptions", "config"]
