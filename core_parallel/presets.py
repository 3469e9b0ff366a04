"""The strategy names as sharding configs: `zero1` ... `gemini_auto` each stand for one `ZeroConfig` / `GeminiConfig`.

```python
config_for_strategy("gemini_nvme", offload_dir="/nvme/run1")   # GeminiConfig(offload_tier="nvme", ...)
config_for_strategy("ddp")                                      # None: nothing sharded here
gemini_config(offload="cpu", chunk_mb=64)                       # GeminiStrategy's keywords as its config
```

One table, `PRESETS`, read both ways: an app turns `--strategy NAME [--offload_dir DIR]` into its config here
(`config_for_strategy`), and `recipes.strategies` registers every name with Lightning as the strategy of its kind
with the same keywords, so `Trainer(strategy=NAME)` holds the same config. The configs validate themselves
(`GeminiConfig.__post_init__` is the one check of the NVMe folder); this module adds the one rule a name brings,
which names take a folder. No Lightning, no process group; the one side effect is the temporary folder of an NVMe
tier named without one.
"""

from __future__ import annotations

import difflib
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..utils.errors import InputError
from .gemini.config import OFFLOAD_TIERS, GeminiConfig
from .zero.config import ZeroConfig

__all__ = ["GEMINI_OFFLOADS", "PRESETS", "Preset", "check_strategy_name", "config_for_strategy", "gemini_config"]

logger = logging.getLogger(__name__)

GEMINI_OFFLOADS = ("none", "cpu", "nvme")
"""Values of `gemini_config(offload=...)` (and `GeminiStrategy(offload=...)`): the off-device tier in one word."""


@dataclass(frozen=True)
class Preset:
    """What one strategy name stands for."""

    kind: str
    """"zero" (a `ZeroConfig`) or "gemini" (a `GeminiConfig`, through `gemini_config`)."""
    description: str
    """One line for Lightning's strategy registry."""
    keywords: Mapping[str, Any] = field(default_factory=dict)
    """The `ZeroConfig` fields, or `gemini_config`'s keywords (the strategy's keywords under Lightning)."""
    takes_offload_dir: bool = False
    """An `offload_dir` puts the off-device data on the NVMe tier in that folder; refused for the other names."""


PRESETS: dict[str, Preset] = {
    "zero1": Preset("zero", "ZeRO stage 1: optimizer state and master weights sharded", {"stage": 1}),
    "zero2": Preset("zero", "ZeRO stage 2: gradients sharded too", {"stage": 2}),
    "zero2_offload": Preset("zero", "ZeRO stage 2, master weights and optimizer state in CPU memory",
                            {"stage": 2, "offload": "cpu"}),
    "gemini": Preset("gemini", "Gemini (chunked ZeRO-3), all on the device"),
    "gemini_offload": Preset("gemini", "Gemini, optimizer state and master weights in CPU memory", {"offload": "cpu"}),
    "gemini_nvme": Preset("gemini", "Gemini, optimizer state and master weights on NVMe (a temporary folder)",
                          {"offload": "nvme"}, takes_offload_dir=True),
    "gemini_auto": Preset("gemini", "Gemini with auto placement within the device budget", {"placement": "auto"},
                          takes_offload_dir=True),
}
"""Strategy name -> what it stands for. Names not here (Lightning's `auto`, `ddp`, ...) shard nothing here."""


def config_for_strategy(name: str, *, offload_dir: str | os.PathLike | None = None,
                        memory_budget: str | int | None = None) -> ZeroConfig | GeminiConfig | None:
    """The `ZeroConfig` / `GeminiConfig` that the strategy `name` stands for (precision fp32), with `offload_dir` as
    its NVMe folder; None for names that shard nothing here. `gemini_nvme` without a folder gets a new temporary one;
    so does `gemini_auto` with a `memory_budget` (the whole process's, `GeminiConfig.memory_budget`).

    One `InputError` naming `offload_dir` for a folder given with a name that has no NVMe tier.
    """
    preset = PRESETS.get(name)
    if preset is None:
        check_strategy_name(name)
    if offload_dir is not None and not (preset and preset.takes_offload_dir):
        takers = ", ".join(n for n, p in PRESETS.items() if p.takes_offload_dir)
        raise InputError(f"offload_dir {offload_dir}: only the strategies with an NVMe tier use it ({takers}), "
                         f"not --strategy {name}")
    if preset is None:
        return None
    keywords = dict(preset.keywords)
    if offload_dir is not None:
        keywords.update(offload="nvme", offload_dir=offload_dir)
    if memory_budget is not None:
        if keywords.get("placement") != "auto":
            raise InputError(f"memory_budget {memory_budget}: only gemini_auto places the model by a budget, not "
                             f"--strategy {name}")
        keywords.update(offload="nvme", memory_budget=memory_budget)
    return ZeroConfig(**keywords) if preset.kind == "zero" else gemini_config(**keywords)


def check_strategy_name(name: str) -> None:
    """One `InputError` for a name that is not ours but close to one of ours (`zer02`: did you mean 'zero2'?); other
    names (Lightning's `auto`, `ddp`, ...) pass."""
    if name in PRESETS:
        return
    close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.8)
    if close:
        raise InputError(f"strategy {name!r} is not a strategy name; did you mean {close[0]!r}?")


def gemini_config(*, offload: str | None = None, **fields: Any) -> GeminiConfig:
    """The `GeminiConfig` of `GeminiStrategy`'s keywords: `GeminiConfig`'s fields, and `offload`, the off-device tier
    in one word ("cpu" or "nvme": `offload_tier`, and under static placement every chunk's master weights and
    optimizer state go there, fractions 1.0 unless given; "none": the "cpu" tier, fractions unchanged). The NVMe tier
    without `offload_dir` gets a new temporary folder (removed again if the config refuses the other fields).

    `offload` and `offload_tier` must agree (one `InputError`); the tier and its folder are the config's to judge.
    """
    if offload is not None and offload not in GEMINI_OFFLOADS:
        raise InputError(f"offload must be one of {', '.join(GEMINI_OFFLOADS)}, got {offload!r}")
    tier = fields.pop("offload_tier", None)
    if offload in OFFLOAD_TIERS and tier is not None and tier != offload:
        raise InputError(f"offload={offload!r} and offload_tier={tier!r} name different tiers; give one of them")
    if offload == "none" and tier == "nvme":
        raise InputError("offload='none' and offload_tier='nvme' disagree; use offload='nvme'")
    if offload in OFFLOAD_TIERS:
        tier = offload
    elif offload == "none" and tier is None:
        tier = "cpu"
    folder = fields.pop("offload_dir", None)
    folder = os.fspath(folder) if folder is not None else None
    made = tier == "nvme" and folder is None
    if made:
        folder = tempfile.mkdtemp(prefix="suite-offload-")
        logger.info("gemini NVMe tier in %s", folder)
    if fields.get("placement", "static") == "static" and offload in ("cpu", "nvme"):
        fields = {"offload_param_frac": 1.0, "offload_optim_frac": 1.0, **fields}
    try:
        return GeminiConfig(offload_tier=tier, offload_dir=folder, **fields)
    except BaseException:
        if made:
            os.rmdir(folder)
        raise
