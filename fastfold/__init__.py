"""fastfold: AlphaFold2-style protein structure inference (FastFold flavour).

`from lowmem.fastfold import AlphaFold`; `fastfold.parallelize_dap(model, group)`. Names resolve on first use.
"""

from __future__ import annotations

from ..utils.lazy import lazy_getattr

_LAZY = {
    "AlphaFold": ".model",
    "InferenceOptions": ".model",
    "parallelize_dap": ".dap",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
