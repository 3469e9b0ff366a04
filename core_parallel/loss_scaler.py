"""Dynamic loss scaling for fp16 training (pure: the caller decides what counts as an overflow).

The loss is multiplied by `scale` before backward so small fp16 gradients do not flush to zero. When any
rank sees an inf/nan gradient the step is skipped everywhere and the scale backs off (after `hysteresis`
overflows in a row); after `growth_interval` clean steps it grows. The full state, counters included, is
in `state_dict()` so a resumed run continues exactly. With `enabled=False` (fp32, bf16) the scale is 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..utils.errors import InputError

__all__ = ["DynamicLossScaler", "LossScalerConfig"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LossScalerConfig:
    """Settings of the dynamic loss scaler (used only under fp16)."""

    initial_scale: float = 2.0**16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """Multiplier applied after `growth_interval` steps without overflow (> 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied on overflow (in (0, 1))."""
    growth_interval: int = 1000
    """Clean steps between two growths."""
    hysteresis: int = 1
    """Overflows in a row tolerated before backing off (1: back off at once)."""
    min_scale: float = 1.0
    """The scale never goes below this."""
    max_scale: float = 2.0**24
    """The scale never goes above this."""
    enabled: bool | None = None
    """Whether the loss is scaled: None (default) under fp16 parameters only; True also for fp32 parameters run
    under fp16 autocast (Lightning's `16-mixed`); False never (Lightning's `16-true` scales no loss)."""

    def on(self, precision: str) -> bool:
        """Whether the scaler runs for parameters kept in `precision` ("fp32", "fp16", "bf16")."""
        return precision == "fp16" if self.enabled is None else self.enabled

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise InputError(f"enabled must be True, False or None, got {self.enabled!r}")
        if not self.initial_scale > 0:
            raise InputError(f"initial_scale must be > 0, got {self.initial_scale}")
        if not self.growth_factor > 1:
            raise InputError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise InputError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise InputError(f"growth_interval must be >= 1, got {self.growth_interval}")
        if self.hysteresis < 1:
            raise InputError(f"hysteresis must be >= 1, got {self.hysteresis}")
        if not 0 < self.min_scale <= self.max_scale:
            raise InputError(f"min_scale must be in (0, max_scale={self.max_scale}], got {self.min_scale}")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise InputError(
                f"initial_scale must be in [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}], "
                f"got {self.initial_scale}"
            )


class DynamicLossScaler:
    """Holds the current scale and updates it from the (already globally agreed) overflow flag."""

    def __init__(self, config: LossScalerConfig | None = None, *, enabled: bool = True) -> None:
        self.config = config or LossScalerConfig()
        self.enabled = enabled
        self._scale = float(self.config.initial_scale) if enabled else 1.0
        self._growth_tracker = 0
        self._hysteresis_tracker = self.config.hysteresis
        self.overflows = 0
        """Steps skipped because of an overflow, in total."""

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by (1.0 when disabled)."""
        return self._scale

    def update(self, overflow: bool) -> None:
        """Record one step's outcome: back off on overflow, grow after enough clean steps."""
        if not self.enabled:
            return
        cfg = self.config
        if overflow:
            self.overflows += 1
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * cfg.backoff_factor, cfg.min_scale)
                self._hysteresis_tracker = cfg.hysteresis
            logger.info("gradient overflow: step skipped, loss scale now %g", self._scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker >= cfg.growth_interval:
            self._scale = min(self._scale * cfg.growth_factor, cfg.max_scale)
            self._growth_tracker = 0
            self._hysteresis_tracker = cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: scale, counters and whether scaling is on (JSON-able)."""
        return {
            "enabled": self.enabled,
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output. A disabled scaler ignores a saved scale (bf16/fp32 resume)."""
        if not self.enabled:
            return
        if not state.get("enabled", True):
            logger.info("checkpoint has no loss scale (saved without fp16): keeping scale %g", self._scale)
            return
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
        self.overflows = int(state.get("overflows", 0))
