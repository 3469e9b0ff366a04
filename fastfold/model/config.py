"""Configuration of the AlphaFold2 monomer model: one small dataclass per component.

Sizes follow AlphaFold2 suppl. Table and the released configs (`model_1` .. `model_5`, `_ptm`).
`fastfold.params.from_params` reads every size from the parameter file; `preset(name)` supplies only what a
file cannot say (structure-module layers, distogram breaks, pipeline sizes, recycles).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

__all__ = [
    "AlphaFoldConfig",
    "EvoformerStackConfig",
    "HeadsConfig",
    "PipelineConfig",
    "StructureModuleConfig",
    "TemplateConfig",
    "model_names",
    "preset",
    "tiny",
]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


@dataclass(kw_only=True)
class EvoformerStackConfig:
    """One Evoformer-style stack: the main Evoformer, the extra-MSA stack (AlphaFold2 suppl. Alg. 6, 18)."""

    num_blocks: int = 48
    """Number of blocks."""
    c_m: int = 256
    """MSA channels (c_m; c_e = 64 for the extra-MSA stack)."""
    c_z: int = 128
    """Pair channels."""
    msa_heads: int = 8
    """Heads of MSA row attention and of MSA column (global) attention."""
    msa_head_dim: int = 32
    """Channels per head of MSA row attention (8 in the extra-MSA stack)."""
    column_head_dim: int = 32
    """Channels per head of MSA column attention (8 for the extra-MSA global column attention)."""
    column_attention: str = "full"
    """Column attention over the MSA: "full" (Alg. 8) or "global" (Alg. 19, the extra-MSA stack)."""
    msa_transition_factor: int = 4
    """Hidden width of the MSA transition as a multiple of c_m."""
    opm_channels: int = 32
    """Channels of the outer-product-mean projections."""
    tri_mul_channels: int = 128
    """Hidden channels of the triangle multiplications."""
    pair_heads: int = 4
    """Heads of the triangle attentions."""
    pair_head_dim: int = 32
    """Channels per head of the triangle attentions."""
    pair_transition_factor: int = 4
    """Hidden width of the pair transition as a multiple of c_z."""
    c_s: int = 384
    """Single-representation channels of the final projection (main Evoformer only; ignored for extra MSA)."""

    def __post_init__(self) -> None:
        _positive(self, "num_blocks", "c_m", "c_z", "msa_heads", "msa_head_dim", "column_head_dim")
        _positive(self, "msa_transition_factor", "opm_channels", "tri_mul_channels", "pair_heads", "pair_head_dim")
        _positive(self, "pair_transition_factor", "c_s")
        if self.column_attention not in ("full", "global"):
            raise ValueError(
                f"EvoformerStackConfig.column_attention must be 'full' or 'global', got {self.column_attention!r}"
            )


@dataclass(kw_only=True)
class TemplateConfig:
    """Template embedding: pair stack, pointwise attention, torsion-angle features (AlphaFold2 suppl. 1.7.1)."""

    enabled: bool = True
    """Whether the model embeds templates (models 1 and 2 do; models 3-5 have no template weights)."""
    c_t: int = 64
    """Template pair channels."""
    num_blocks: int = 2
    """Blocks of the template pair stack (Alg. 16)."""
    pair_heads: int = 4
    """Heads of the template triangle attentions."""
    pair_head_dim: int = 16
    """Channels per head of the template triangle attentions."""
    tri_mul_channels: int = 64
    """Hidden channels of the template triangle multiplications."""
    pair_transition_factor: int = 2
    """Hidden width of the template pair transition as a multiple of c_t."""
    pointwise_heads: int = 4
    """Heads of the template pointwise attention (Alg. 17)."""
    pointwise_head_dim: int = 16
    """Channels per head of the template pointwise attention."""
    dgram_bins: int = 39
    """Bins of the template pseudo-beta distogram."""
    dgram_min_bin: float = 3.25
    """Lower edge of the first template distogram bin, Angstrom."""
    dgram_max_bin: float = 50.75
    """Lower edge of the last template distogram bin, Angstrom."""
    embed_torsion_angles: bool = True
    """Whether template torsion-angle features are appended to the MSA (all released monomer models do)."""

    def __post_init__(self) -> None:
        _positive(self, "c_t", "num_blocks", "pair_heads", "pair_head_dim", "tri_mul_channels")
        _positive(self, "pair_transition_factor", "pointwise_heads", "pointwise_head_dim", "dgram_bins")
        if not self.dgram_min_bin < self.dgram_max_bin:
            raise ValueError("TemplateConfig.dgram_min_bin must be below dgram_max_bin")


@dataclass(kw_only=True)
class StructureModuleConfig:
    """Structure module (AlphaFold2 suppl. Alg. 20) with invariant point attention (Alg. 22)."""

    c_s: int = 384
    """Single-representation channels."""
    c_z: int = 128
    """Pair channels."""
    num_layers: int = 8
    """Iterations of the shared-weight fold block (not in the parameter file)."""
    ipa_heads: int = 12
    """Heads of invariant point attention."""
    ipa_scalar_qk: int = 16
    """Scalar query/key channels per head."""
    ipa_scalar_v: int = 16
    """Scalar value channels per head."""
    ipa_point_qk: int = 4
    """Query/key points per head."""
    ipa_point_v: int = 8
    """Value points per head."""
    transition_layers: int = 3
    """Linear layers of the single transition."""
    c_resnet: int = 128
    """Hidden channels of the angle resnet."""
    resnet_blocks: int = 2
    """Residual blocks of the angle resnet."""
    position_scale: float = 10.0
    """Fold-block translations times this are Angstrom (the block works in nanometre-like units)."""

    def __post_init__(self) -> None:
        _positive(self, "c_s", "c_z", "num_layers", "ipa_heads", "ipa_scalar_qk", "ipa_scalar_v")
        _positive(self, "ipa_point_qk", "ipa_point_v", "transition_layers", "c_resnet", "resnet_blocks")
        if self.position_scale <= 0:
            raise ValueError("StructureModuleConfig.position_scale must be positive")


@dataclass(kw_only=True)
class HeadsConfig:
    """Output heads (AlphaFold2 suppl. 1.9)."""

    plddt_bins: int = 50
    """Bins of the pLDDT head."""
    plddt_channels: int = 128
    """Hidden channels of the pLDDT head."""
    distogram_bins: int = 64
    """Bins of the distogram head."""
    distogram_first_break: float = 2.3125
    """First distogram bin edge, Angstrom."""
    distogram_last_break: float = 21.6875
    """Last distogram bin edge, Angstrom."""
    masked_msa_classes: int = 23
    """Classes of the masked-MSA head."""
    resolved_atoms: int = 37
    """Outputs of the experimentally-resolved head."""
    pae_bins: int = 64
    """Bins of the predicted-aligned-error head (`_ptm` models)."""
    pae_max_error_bin: float = 31.0
    """Last predicted-aligned-error bin edge, Angstrom."""
    tm: bool = False
    """Whether the model has the predicted-aligned-error / pTM head (the `_ptm` models)."""

    def __post_init__(self) -> None:
        _positive(self, "plddt_bins", "plddt_channels", "distogram_bins", "masked_msa_classes", "resolved_atoms")
        _positive(self, "pae_bins")


@dataclass(kw_only=True)
class PipelineConfig:
    """What the feature pipeline needs to know for a model: not part of the network or its file."""

    max_msa_clusters: int = 512
    """MSA cluster centres (rows of `msa_feat`)."""
    max_extra_msa: int = 5120
    """Extra-MSA rows."""
    max_templates: int = 4
    """Templates given to the model."""
    num_recycle: int = 3
    """Recycling iterations; the batch's trailing axis has num_recycle + 1 entries."""

    def __post_init__(self) -> None:
        _positive(self, "max_msa_clusters", "max_extra_msa", "max_templates")
        if self.num_recycle < 0:
            raise ValueError("PipelineConfig.num_recycle must be >= 0")


@dataclass(kw_only=True)
class AlphaFoldConfig:
    """The whole monomer model (AlphaFold2 suppl. Alg. 2)."""

    c_m: int = 256
    """MSA channels."""
    c_z: int = 128
    """Pair channels."""
    c_s: int = 384
    """Single channels."""
    c_e: int = 64
    """Extra-MSA channels."""
    target_feat_dim: int = 22
    """Channels of `target_feat`."""
    msa_feat_dim: int = 49
    """Channels of `msa_feat`."""
    extra_msa_feat_dim: int = 25
    """Channels of the extra-MSA features (23-class one-hot, has-deletion, deletion value)."""
    max_relative_feature: int = 32
    """Clip of the relative position encoding (Alg. 4)."""
    recycle_bins: int = 15
    """Bins of the recycled pseudo-beta distogram (Alg. 32)."""
    recycle_min_bin: float = 3.25
    """Lower edge of the first recycling distogram bin, Angstrom."""
    recycle_max_bin: float = 20.75
    """Lower edge of the last recycling distogram bin, Angstrom."""
    evoformer: EvoformerStackConfig = field(default_factory=EvoformerStackConfig)
    """The main Evoformer stack."""
    extra_msa: EvoformerStackConfig = field(
        default_factory=lambda: EvoformerStackConfig(
            num_blocks=4, c_m=64, msa_head_dim=8, column_head_dim=8, column_attention="global"
        )
    )
    """The extra-MSA stack."""
    template: TemplateConfig = field(default_factory=TemplateConfig)
    """Template embedding."""
    structure_module: StructureModuleConfig = field(default_factory=StructureModuleConfig)
    """Structure module."""
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    """Output heads."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Feature-pipeline sizes for this model (not used by the network)."""

    def __post_init__(self) -> None:
        _positive(self, "c_m", "c_z", "c_s", "c_e", "target_feat_dim", "msa_feat_dim", "extra_msa_feat_dim")
        _positive(self, "max_relative_feature", "recycle_bins")
        checks = [
            ("evoformer.c_m", self.evoformer.c_m, self.c_m),
            ("evoformer.c_z", self.evoformer.c_z, self.c_z),
            ("evoformer.c_s", self.evoformer.c_s, self.c_s),
            ("extra_msa.c_m", self.extra_msa.c_m, self.c_e),
            ("extra_msa.c_z", self.extra_msa.c_z, self.c_z),
            ("structure_module.c_s", self.structure_module.c_s, self.c_s),
            ("structure_module.c_z", self.structure_module.c_z, self.c_z),
        ]
        for name, got, want in checks:
            if got != want:
                raise ValueError(f"AlphaFoldConfig.{name} is {got} but the model's channel size is {want}")
        if self.extra_msa.column_attention != "global" or self.evoformer.column_attention != "full":
            raise ValueError("AlphaFoldConfig: extra_msa.column_attention must be 'global', evoformer's 'full'")

    def replace(self, **changes: object) -> AlphaFoldConfig:
        """A copy with top-level fields changed."""
        return dataclasses.replace(self, **changes)


_MODEL_NAME = re.compile(r"model_([1-5])(_ptm)?")


def model_names() -> list[str]:
    """The released monomer model names: model_1 .. model_5 and model_1_ptm .. model_5_ptm."""
    return [f"model_{i}{s}" for s in ("", "_ptm") for i in range(1, 6)]


def preset(name: str) -> AlphaFoldConfig:
    """The configuration of a released monomer model, e.g. "model_1" or "model_3_ptm".

    Models 1-2 use templates (and give 4 of the 512 MSA clusters to them); models 3-5 do not. Models 2 and 5
    use 1024 extra-MSA rows, the others 5120.
    """
    match = _MODEL_NAME.fullmatch(name)
    if not match:
        raise ValueError(f"preset: unknown model name {name!r}; expected one of {', '.join(model_names())}")
    index, ptm = int(match.group(1)), bool(match.group(2))
    templates = index in (1, 2)
    return AlphaFoldConfig(
        template=TemplateConfig(enabled=templates),
        heads=HeadsConfig(tm=ptm),
        pipeline=PipelineConfig(
            max_msa_clusters=508 if templates else 512, max_extra_msa=1024 if index in (2, 5) else 5120
        ),
    )


def tiny(*, templates: bool = True, tm: bool = True) -> AlphaFoldConfig:
    """A very small model with every component, for tests and the demo (seconds on one CPU core)."""
    c_m, c_z, c_s, c_e = 16, 8, 16, 8
    stack = dict(
        c_z=c_z,
        msa_heads=2,
        msa_head_dim=4,
        column_head_dim=4,
        opm_channels=4,
        tri_mul_channels=6,
        pair_heads=2,
        pair_head_dim=4,
        msa_transition_factor=2,
        pair_transition_factor=2,
        c_s=c_s,
    )
    return AlphaFoldConfig(
        c_m=c_m,
        c_z=c_z,
        c_s=c_s,
        c_e=c_e,
        max_relative_feature=4,
        evoformer=EvoformerStackConfig(num_blocks=2, c_m=c_m, **stack),
        extra_msa=EvoformerStackConfig(num_blocks=1, c_m=c_e, column_attention="global", **stack),
        template=TemplateConfig(
            enabled=templates,
            c_t=6,
            num_blocks=1,
            pair_heads=2,
            pair_head_dim=3,
            tri_mul_channels=5,
            pointwise_heads=2,
            pointwise_head_dim=3,
        ),
        structure_module=StructureModuleConfig(
            c_s=c_s,
            c_z=c_z,
            num_layers=2,
            ipa_heads=2,
            ipa_scalar_qk=4,
            ipa_scalar_v=3,
            ipa_point_qk=2,
            ipa_point_v=3,
            c_resnet=8,
        ),
        heads=HeadsConfig(plddt_bins=10, plddt_channels=8, distogram_bins=12, pae_bins=9, tm=tm),
        pipeline=PipelineConfig(max_msa_clusters=5, max_extra_msa=7, max_templates=2, num_recycle=1),
    )
