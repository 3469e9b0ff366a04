"""Random but valid inputs and parameters for tests, demos and benchmarks (no data, no downloads).

`random_batch(config, n_res=..., n_seq=..., n_extra=..., n_templ=..., n_recycle=...)` returns processed
features with AlphaFold's names and layout, the recycling iterations on the trailing axis (OpenFold).
"""

from __future__ import annotations

import torch
from torch import nn

from ..common import residue_constants as rc
from ..common.geometry import atom14_to_atom37, frames_to_atom14_positions, pseudo_beta, torsion_angles_to_frames
from ..common.rigid import Rigid, quat_to_rot
from .config import AlphaFoldConfig

__all__ = ["random_atom37", "random_batch", "random_multimer_batch", "randomize_parameters"]


def _table(name: str, aatype: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.as_tensor(getattr(rc, name))[aatype].to(dtype)


def random_atom37(
    aatype: torch.Tensor, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residues with ideal geometry, random torsions and random backbone frames along a rough chain.

    aatype: [*, N] (0..19). Returns atom37 positions [*, N, 37, 3] and the atom37 mask [*, N, 37].
    """
    shape = aatype.shape
    quat = torch.randn(*shape, 4, generator=generator, dtype=dtype)
    rot = quat_to_rot(quat / quat.norm(dim=-1, keepdim=True))
    trans = torch.cumsum(torch.randn(*shape, 3, generator=generator, dtype=dtype) * 2.2, dim=-2)
    angles = torch.randn(*shape, 7, 2, generator=generator, dtype=dtype)
    angles = angles / angles.norm(dim=-1, keepdim=True)
    frames = torsion_angles_to_frames(aatype, Rigid(rot, trans), angles)
    atom14 = frames_to_atom14_positions(aatype, frames)
    to14 = _table("restype_atom37_to_atom14", aatype, torch.long)
    mask37 = _table("restype_atom37_mask", aatype, dtype)
    return atom14_to_atom37(atom14, to14, mask37), mask37


def _msa_feat(msa: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[S, N, 49]: one-hot (23), has_deletion, deletion_value, cluster profile (23), deletion mean."""
    s, n = msa.shape
    one_hot = nn.functional.one_hot(msa, 23).float()
    has_del = (torch.rand(s, n, generator=generator) < 0.1).float()
    del_value = torch.atan(torch.rand(s, n, generator=generator) * 3 * has_del / 3.0) * (2 / torch.pi)
    profile = torch.softmax(torch.randn(s, n, 23, generator=generator) * 2, dim=-1)
    del_mean = torch.rand(s, n, 1, generator=generator) * 0.3
    return torch.cat([one_hot, has_del[..., None], del_value[..., None], profile, del_mean], dim=-1)


def _templates(aatype: torch.Tensor, n_templ: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    n = aatype.shape[-1]
    t_aatype = torch.where(
        torch.rand(n_templ, n, generator=generator) < 0.7,
        aatype,
        torch.randint(0, 20, (n_templ, n), generator=generator),
    )
    pos, mask = random_atom37(t_aatype, generator)
    drop = (torch.rand(n_templ, n, 1, generator=generator) < 0.15).to(mask.dtype)  # unresolved residues
    mask = mask * (1 - drop)
    pos = pos * mask[..., None]
    pb, pb_mask = pseudo_beta(t_aatype, pos, mask)
    return {
        "template_aatype": t_aatype,
        "template_all_atom_positions": pos.float(),
        "template_all_atom_masks": mask.float(),
        "template_mask": torch.ones(n_templ),
        "template_pseudo_beta": pb.float(),
        "template_pseudo_beta_mask": pb_mask.float(),
    }


def _one_cycle(aatype: torch.Tensor, n_seq: int, n_extra: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    n = aatype.shape[0]
    msa = torch.randint(0, 21, (n_seq, n), generator=generator)
    msa[0] = aatype
    extra = torch.randint(0, 23, (n_extra, n), generator=generator)
    has_break = torch.zeros(n, 1)
    return {
        "target_feat": torch.cat([has_break, nn.functional.one_hot(aatype, 21).float()], dim=-1),
        "msa_feat": _msa_feat(msa, generator),
        "msa_mask": torch.ones(n_seq, n),
        "extra_msa": extra,
        "extra_msa_mask": (torch.rand(n_extra, n, generator=generator) < 0.9).float(),
        "extra_has_deletion": (torch.rand(n_extra, n, generator=generator) < 0.1).float(),
        "extra_deletion_value": torch.rand(n_extra, n, generator=generator) * 0.5,
    }


def random_batch(
    config: AlphaFoldConfig,
    *,
    n_res: int,
    n_seq: int = 4,
    n_extra: int = 5,
    n_templ: int = 2,
    n_recycle: int = 1,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A processed feature batch: every feature `[..., n_recycle + 1]` (the MSA features resampled per pass).

    Template features are included when `config.template.enabled` (`n_templ` templates).
    """
    g = torch.Generator().manual_seed(seed)
    aatype = torch.randint(0, 20, (n_res,), generator=g)
    static = {
        "aatype": aatype,
        "residue_index": torch.arange(n_res) + 3 * (torch.arange(n_res) >= n_res // 2),  # a chain break
        "seq_mask": torch.ones(n_res),
        "atom14_atom_exists": _table("restype_atom14_mask", aatype),
        "residx_atom14_to_atom37": _table("restype_atom14_to_atom37", aatype, torch.long),
        "residx_atom37_to_atom14": _table("restype_atom37_to_atom14", aatype, torch.long),
        "atom37_atom_exists": _table("restype_atom37_mask", aatype),
    }
    if config.template.enabled:
        static.update(_templates(aatype, n_templ, g))
    cycles = [_one_cycle(aatype, n_seq, n_extra, g) for _ in range(n_recycle + 1)]
    batch = {k: torch.stack([v] * (n_recycle + 1), dim=-1) for k, v in static.items()}
    batch.update({k: torch.stack([c[k] for c in cycles], dim=-1) for k in cycles[0]})
    return batch


@torch.no_grad()
def randomize_parameters(model: nn.Module, seed: int = 0, scale: float = 1.0) -> nn.Module:
    """Fill every parameter with Gaussian noise (std `scale / sqrt(fan_in)` for matrices, `0.1*scale`
    around 1 for LayerNorm weights, `0.1*scale` for biases), so no part of the network is trivially zero."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if p.dim() >= 2:
            p.copy_(noise * scale / p.shape[-1] ** 0.5)
        elif name.endswith("weight") and "layer_norm" in name:
            p.copy_(1 + 0.1 * scale * noise)
        else:
            p.copy_(0.1 * scale * noise)
    return model


def random_multimer_batch(
    chains: tuple[int, ...] | list[int],
    *,
    entities: tuple[int, ...] | list[int] | None = None,
    n_seq: int = 4,
    n_extra: int = 5,
    n_templ: int = 2,
    n_recycle: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A processed AlphaFold-Multimer batch (`fastfold.model.multimer.FEATURE_NAMES`, recycling passes on the
    trailing axis) for chains of the given lengths. `entities[i]` (1-based, default one entity per chain)
    groups chains of one entity: copies share the sequence and count `sym_id` 1, 2, ...; absent template atoms
    are zero."""
    g = torch.Generator().manual_seed(seed)
    entities = list(entities) if entities is not None else list(range(1, len(chains) + 1))
    if len(entities) != len(chains):
        raise ValueError("random_multimer_batch: one entity per chain")
    seqs: dict[int, torch.Tensor] = {}
    aatype, residue_index, asym, entity, sym = [], [], [], [], []
    copies: dict[int, int] = {}
    for i, (length, e) in enumerate(zip(chains, entities)):
        if e in seqs and seqs[e].shape[0] != length:
            raise ValueError("random_multimer_batch: copies of one entity must have the same length")
        seqs.setdefault(e, torch.randint(0, 20, (length,), generator=g))
        copies[e] = copies.get(e, 0) + 1
        aatype.append(seqs[e])
        residue_index.append(torch.arange(length))
        asym.append(torch.full((length,), i + 1))
        entity.append(torch.full((length,), e))
        sym.append(torch.full((length,), copies[e]))
    aa = torch.cat(aatype)
    n = aa.shape[0]
    static = {
        "aatype": aa,
        "residue_index": torch.cat(residue_index),
        "asym_id": torch.cat(asym),
        "entity_id": torch.cat(entity),
        "sym_id": torch.cat(sym),
        "seq_mask": torch.ones(n),
        "target_feat": nn.functional.one_hot(aa, 21).float(),
        "residx_atom37_to_atom14": _table("restype_atom37_to_atom14", aa, torch.long),
        "atom37_atom_exists": _table("restype_atom37_mask", aa),
    }
    t = _templates(aa, n_templ, g)
    static.update(
        template_aatype=t["template_aatype"],
        template_all_atom_positions=t["template_all_atom_positions"],
        template_all_atom_mask=t["template_all_atom_masks"],
    )
    cycles = []
    for _ in range(n_recycle + 1):
        msa = torch.randint(0, 21, (n_seq, n), generator=g)
        msa[0] = aa
        has_del = torch.rand(n_extra, n, generator=g) < 0.1
        cycles.append({
            "msa_feat": _msa_feat(msa, g),
            "msa_mask": (torch.rand(n_seq, n, generator=g) < 0.95).float().index_fill_(0, torch.tensor([0]), 1.0),
            "extra_msa": torch.randint(0, 23, (n_extra, n), generator=g),
            "extra_msa_mask": (torch.rand(n_extra, n, generator=g) < 0.9).float(),
            "extra_deletion_matrix": torch.randint(0, 6, (n_extra, n), generator=g).float() * has_del,
        })
    batch = {k: torch.stack([v] * (n_recycle + 1), dim=-1) for k, v in static.items()}
    batch.update({k: torch.stack([c[k] for c in cycles], dim=-1) for k in cycles[0]})
    return batch
