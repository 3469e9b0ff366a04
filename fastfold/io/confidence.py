"""Confidence outputs: the JSON of pLDDT / pTM / PAE, the PNG plots of pLDDT and PAE, and the MSA coverage plot
ColabFold draws."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from ...utils.fileio import atomic_write

__all__ = ["MAX_PAE", "chain_confidences", "confidence_dict", "msa_coverage", "plot_msa_coverage", "plot_pae",
           "plot_plddt", "write_confidence_json"]

MSA_GAP = 21
"""The gap's index in the `msa` feature (AlphaFold's HHblits order mapped to ours)."""

MAX_PAE = 31.75
"""AlphaFold's PAE cap in Angstrom: the centre of the last of its 64 PAE bins (0.5 Angstrom wide, edges to 31)
(`max_predicted_aligned_error` in its confidence JSON), the fixed top of its PAE colour scale."""


def confidence_dict(plddt: np.ndarray, ptm: float | None = None, pae: np.ndarray | None = None) -> dict[str, Any]:
    """`plddt` `[N]` in 0..100, optional `ptm` and `pae` `[N, N]` (Angstrom) as JSON-ready values."""
    plddt = np.asarray(plddt, dtype=np.float64)
    out: dict[str, Any] = {"plddt": [round(float(x), 2) for x in plddt], "mean_plddt": round(float(plddt.mean()), 2)}
    if ptm is not None:
        out["ptm"] = round(float(ptm), 4)
    if pae is not None:
        pae = np.asarray(pae, dtype=np.float64)
        out["pae"] = [[round(float(x), 2) for x in row] for row in pae]
        out["max_pae"] = MAX_PAE  # AlphaFold's field: the cap of the scale, not this matrix's maximum
    return out


def chain_confidences(plddt: np.ndarray, pae: np.ndarray | None, chains: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-chain and interface confidences of a complex (JSON-ready).

    `chains`: in the order of the residues, each with `chain_id`, `name` and `residues` `[start, end)`.
    Returns `chains` (each with its mean pLDDT), and with `pae` `[N, N]` (row: aligned residue, column: scored
    residue) `chain_pair_pae` and `chain_pair_pae_min` `[n_chains, n_chains]`: entry [i][j] is the mean (the
    minimum) PAE over residues aligned on chain i and scored on chain j; off the diagonal, the interface."""
    plddt = np.asarray(plddt, dtype=np.float64)
    out: dict[str, Any] = {"chains": [
        {"chain_id": c["chain_id"], "name": c["name"], "residues": [int(c["residues"][0]), int(c["residues"][1])],
         "mean_plddt": round(float(plddt[c["residues"][0]:c["residues"][1]].mean()), 2)} for c in chains]}
    if pae is not None:
        pae = np.asarray(pae, dtype=np.float64)
        blocks = [[pae[a["residues"][0]:a["residues"][1], b["residues"][0]:b["residues"][1]] for b in chains]
                  for a in chains]
        out["chain_pair_pae"] = [[round(float(x.mean()), 2) for x in row] for row in blocks]
        out["chain_pair_pae_min"] = [[round(float(x.min()), 2) for x in row] for row in blocks]
    return out


def write_confidence_json(path: str | Path, confidence: dict[str, Any]) -> None:
    with atomic_write(path) as f:
        json.dump(confidence, f)


def _save(fig, path: str | Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    with atomic_write(path, "wb") as f:
        f.write(buf.getvalue())


def _mark(fig, mark: str) -> None:
    """A large red stamp across the figure (e.g. "RANDOM WEIGHTS"), so a plot cannot pass for a real one."""
    if mark:
        fig.text(0.5, 0.5, mark, ha="center", va="center", rotation=20, fontsize=28, color="red", alpha=0.45,
                 weight="bold")


def plot_plddt(path: str | Path, plddt: np.ndarray, title: str, mark: str = "") -> None:
    """Per-residue pLDDT line plot with AlphaFold's confidence bands; `mark` is stamped across it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    for lo, hi, colour in ((0, 50, "#ff7d45"), (50, 70, "#ffdb13"), (70, 90, "#65cbf3"), (90, 100, "#0053d6")):
        ax.axhspan(lo, hi, color=colour, alpha=0.15, lw=0)
    ax.plot(np.arange(1, len(plddt) + 1), plddt, color="black", lw=1)
    ax.set(xlabel="residue", ylabel="pLDDT", ylim=(0, 100), xlim=(1, max(len(plddt), 2)), title=title)
    _mark(fig, mark)
    _save(fig, path)
    plt.close(fig)


def plot_pae(path: str | Path, pae: np.ndarray, title: str, mark: str = "",
             chains: list[tuple[str, int, int]] | None = None) -> None:
    """Predicted aligned error heat map (scored residue vs aligned residue) on AlphaFold's fixed 0..31.75
    Angstrom scale, so plots of different models compare by colour; `mark` is stamped across it. `chains`
    (chain ID, start, end) of a complex: a line at each chain boundary and the chain IDs on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(pae, cmap="Greens_r", vmin=0, vmax=MAX_PAE)
    fig.colorbar(im, ax=ax, label="expected position error (Å)")
    ax.set(xlabel="scored residue", ylabel="aligned residue", title=title)
    if chains and len(chains) > 1:
        for _, _, end in chains[:-1]:
            ax.axhline(end - 0.5, color="black", lw=1.2)
            ax.axvline(end - 0.5, color="black", lw=1.2)
        centres = [(start + end - 1) / 2 for _, start, end in chains]
        top = ax.secondary_xaxis("top")
        top.set_xticks(centres, [c for c, _, _ in chains])
        right = ax.secondary_yaxis("right")
        right.set_yticks(centres, [c for c, _, _ in chains])
    _mark(fig, mark)
    _save(fig, path)
    plt.close(fig)


def msa_coverage(msa: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ColabFold's MSA coverage picture (`plot_msa_v2`) for one chain: `msa` `[S, N]` (the `msa` feature, query
    first, gap = 21).

    Returns (`image` `[S, N]`, `coverage` `[N]`, `identity` `[S]`): each row's sequence identity to the query
    (identical positions over the query's length, as ColabFold counts it), rows sorted from the most to the
    least identical; `image` holds a row's identity at its aligned (non-gap) positions and NaN at gaps;
    `coverage` counts the non-gap rows at each position."""
    msa = np.asarray(msa)
    aligned = msa != MSA_GAP
    identity = (msa == msa[:1]).mean(axis=1)
    order = np.argsort(-identity, kind="stable")
    image = np.where(aligned, identity[:, None], np.nan)[order].astype(np.float32)
    return image, aligned.sum(axis=0), identity[order]


def plot_msa_coverage(path: str | Path, msa: np.ndarray, title: str) -> None:
    """The MSA coverage plot as ColabFold draws it: one line per sequence over the positions it covers,
    coloured by its identity to the query (rainbow, 0..1), most identical at the bottom, and the number of
    sequences covering each position in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image, coverage, _ = msa_coverage(msa)
    rows, n = image.shape
    fig, ax = plt.subplots(figsize=(8, 5))
    im = ax.imshow(image, interpolation="nearest", aspect="auto", cmap="rainbow_r", vmin=0, vmax=1, origin="lower",
                   extent=(0, n, 0, rows))
    ax.plot(np.arange(n) + 0.5, coverage, color="black")
    ax.set(xlim=(0, n), ylim=(0, rows), xlabel="positions", ylabel="sequences", title=title)
    fig.colorbar(im, ax=ax, label="sequence identity to query")
    _save(fig, path)
    plt.close(fig)
