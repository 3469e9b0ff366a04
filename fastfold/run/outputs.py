"""One target's output files (the layout is `fastfold.run.pipeline`'s docstring): every model's PDB, mmCIF and
confidence JSON, then for the best ranked model (AlphaFold's ranking) its structure, relaxed when asked, its
confidence JSON and plots, `ranking.json`, `ranking_debug.json`, `features.json`, the MSA coverage plot and, written
last, `timings.json` (the record `fastfold.run.resume` reads). pLDDT goes to the B-factor column (or 100 - pLDDT).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...utils.fileio import atomic_write
from ..data.features import make_sequence_features
from ..data.targets import Target
from ..io.protein import Protein
from .stages import ComplexTarget, GapTarget, Prediction

__all__ = ["prediction_to_protein", "write_output_dict", "write_pae_json", "write_target_outputs"]

def prediction_to_protein(target: Target, prediction: Prediction, b_factors: np.ndarray | None = None) -> Protein:
    """The predicted structure as a `Protein` (1-based residue numbers, pLDDT as B-factors by default); a
    complex's chains in feature order, each with its chain ID and residues numbered from 1."""
    raw = make_sequence_features(target.sequence)
    plddt = np.repeat(prediction.plddt[:, None], 37, axis=1) if b_factors is None else b_factors
    if isinstance(target, GapTarget):  # AlphaFold-Gap: a chain ID per record, the residue-index gap kept
        return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"],
                       target.residue_index() + 1, plddt, chain_index=target.chain_index(),
                       chain_ids=target.chain_ids)
    if not isinstance(target, ComplexTarget):
        return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"],
                       raw["residue_index"] + 1, plddt)
    ranges = target.chain_ranges()
    numbers = np.concatenate([np.arange(1, end - start + 1) for _, start, end in ranges])
    index = np.concatenate([np.full(end - start, k) for k, (_, start, end) in enumerate(ranges)])
    return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"], numbers, plddt,
                   chain_index=index, chain_ids=tuple(c.chain_id for c, _, _ in ranges))


def _write_text(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def _write_structure(folder: Path, stem: str, protein: Protein, remark: str, pred: Prediction) -> list[str]:
    """PDB and ModelCIF; `pred.plddt` [N] goes to the ModelCIF QA metrics (the B-factors may hold 100 - pLDDT),
    with pTM and ipTM when the model gives them."""
    from ..io.protein import to_mmcif, to_pdb

    scores = {k: v for k, v in (("pTM", pred.ptm), ("ipTM", pred.iptm)) if v is not None}
    method = "AlphaFold-Multimer" if pred.iptm is not None else "AlphaFold2 monomer"
    _write_text(folder / f"{stem}.pdb", to_pdb(protein, remark=remark))
    _write_text(folder / f"{stem}.cif", to_mmcif(protein, name=stem, plddt=pred.plddt, title=remark, scores=scores,
                                                 method=method))
    return [f"{stem}.pdb", f"{stem}.cif"]


def _chain_table(target: Target) -> list[dict[str, Any]] | None:
    if not isinstance(target, ComplexTarget):
        return None
    return [{"chain_id": c.chain_id, "name": c.name, "residues": [start, end]} for c, start, end in
            target.chain_ranges()]


def _write_confidence(folder: Path, name: str, pred: Prediction, mark: str = "", plots: bool = True,
                      chains: list[dict[str, Any]] | None = None) -> list[str]:
    """`<name>_confidence.json` (pLDDT, pTM, PAE; for a complex also ipTM, the ranking confidence, per-chain
    pLDDT and the chain-pair PAE) and, with `plots`, the pLDDT and PAE plots (chain boundaries drawn)."""
    from ..io.confidence import chain_confidences, confidence_dict, plot_pae, plot_plddt, write_confidence_json

    confidence = confidence_dict(pred.plddt, pred.ptm, pred.pae)
    if pred.iptm is not None:
        confidence.update(iptm=round(float(pred.iptm), 4), ranking_confidence=round(float(pred.ranking_confidence), 4))
    if chains is not None:
        confidence.update(chain_confidences(pred.plddt, pred.pae, chains))
    write_confidence_json(folder / f"{name}_confidence.json", confidence)
    files = [f"{name}_confidence.json"]
    if not plots:
        return files
    plot_plddt(folder / f"{name}_plddt.png", pred.plddt, f"{name}: mean pLDDT {pred.plddt.mean():.1f}", mark=mark)
    files.append(f"{name}_plddt.png")
    if pred.pae is not None:
        title = f"{name}: pTM {pred.ptm:.3f}" + (f", ipTM {pred.iptm:.3f}" if pred.iptm is not None else "")
        bounds = None if chains is None else [(c["chain_id"], *c["residues"]) for c in chains]
        plot_pae(folder / f"{name}_pae.png", pred.pae, title, mark=mark, chains=bounds)
        files.append(f"{name}_pae.png")
    return files


def write_pae_json(path: Path, pred: Prediction) -> list[str]:
    """The AlphaFold-DB PAE file that PAE viewers and ChimeraX read, `[{"predicted_aligned_error": [[...]],
    "max_predicted_aligned_error": 31.75}]` (Å, two decimals), for a model with a PAE head; else nothing."""
    if pred.pae is None:
        return []
    from ..io.confidence import MAX_PAE

    entry = {"predicted_aligned_error": np.round(pred.pae.astype(np.float64), 2).tolist(),
             "max_predicted_aligned_error": MAX_PAE}
    _write_text(path, json.dumps([entry], separators=(",", ":")))
    return [path.name]


def write_output_dict(path: Path, pred: Prediction) -> list[str]:
    """Every model output (`Prediction.outputs`, kept with `ModelSpec.keep_outputs`) as one `.npz` of plain
    arrays (`numpy.load(path)` reads it without pickle), OpenFold's `--save_outputs` in a safe format."""
    if pred.outputs is None:
        return []
    with atomic_write(path, "wb") as f:
        np.savez(f, **pred.outputs)
    return [path.name]


def _plot_mark(remark: str) -> str:
    return "RANDOM WEIGHTS" if "RANDOM WEIGHTS" in remark else ""


def write_target_outputs(
    target: Target,
    predictions: dict[str, Prediction],
    folder: str | Path,
    relax_config: Any = None,
    timings: dict[str, float] | None = None,
    remark: str = "",
    features_info: dict[str, Any] | None = None,
    fingerprint: dict[str, Any] | None = None,
    subtract_plddt: bool = False,
    msa: np.ndarray | None = None,
) -> list[str]:
    """Write every output file of one target (module docstring) and return their names.

    `predictions` maps model label -> Prediction; every one gets its PDB, mmCIF and confidence JSON (and
    plots when there are several); the best ranked one is relaxed (when `relax_config` is given) and
    written under the target's name. `features_info` (what the features were made of) goes to
    `features.json`; `fingerprint` (what made the outputs) to `timings.json`, which is written last;
    `timings` (seconds per stage) gets the relaxation time added. `subtract_plddt`: B-factors are 100 - pLDDT.
    `msa` (the raw `msa` feature `[S, N]`): its coverage plot, as ColabFold draws it, to `<target>_coverage.png`.
    """

    def protein(pred: Prediction) -> Protein:
        b = None if not subtract_plddt else np.repeat(100.0 - pred.plddt[:, None], 37, axis=1)
        return prediction_to_protein(target, pred, b)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    timings = timings if timings is not None else {}
    files = []
    mark = _plot_mark(remark)
    chains = _chain_table(target)
    for label, pred in predictions.items():
        stem = f"{target.name}_{label}"
        files += _write_structure(folder, f"{stem}_unrelaxed", protein(pred), remark, pred)
        files += _write_confidence(folder, stem, pred, mark, plots=len(predictions) > 1, chains=chains)
        files += write_pae_json(folder / f"{stem}_predicted_aligned_error.json", pred)
        files += write_output_dict(folder / f"{stem}_output_dict.npz", pred)
    metric = _ranking_metric(predictions)
    ranked = sorted(predictions, key=lambda k: -predictions[k].ranking_score(metric))
    best = predictions[ranked[0]]
    unrelaxed = protein(best)
    files += _write_structure(folder, f"{target.name}_unrelaxed", unrelaxed, f"{remark} model {ranked[0]}".strip(),
                              best)
    relax_summary = None
    if relax_config is not None:
        relax_summary, relaxed = _relax_best(folder, target.name, unrelaxed, best, relax_config, remark, timings)
        files += relaxed
    files += _write_confidence(folder, target.name, best, mark, chains=chains)
    files += _write_ranking(folder, predictions, ranked, metric)
    files += _write_inputs(folder, target.name, features_info, msa)
    record = {"target": target.name, "description": target.description, "length": len(target.sequence),
              **({"chains": chains} if chains is not None else {}), "timings": timings,
              "mean_plddt": float(best.plddt.mean()), "relax": relax_summary,
              "inputs": features_info, "fingerprint": fingerprint, "files": files}
    _write_text(folder / "timings.json", json.dumps(record, indent=2))
    return [*files, "timings.json"]


def _ranking_metric(predictions: dict[str, Prediction]) -> str:
    if all(p.iptm is not None for p in predictions.values()):
        return "iptm+ptm"  # AlphaFold-Multimer's ranking confidence, 0.8 ipTM + 0.2 pTM
    return "mean_plddt"  # AlphaFold ranks monomer models, `_ptm` ones too, by mean pLDDT


def _relax_best(folder: Path, name: str, unrelaxed: Protein, best: Prediction, relax_config: Any, remark: str,
                timings: dict[str, float]) -> tuple[dict[str, Any], list[str]]:
    """Relax the best model (`fastfold.relax`) and write `<name>_relaxed.pdb|.cif`; returns the relaxation's
    summary (for `timings.json`) and the files written. Its seconds go to `timings["relax"]`."""
    import time

    from .. import relax

    t0 = time.perf_counter()
    try:
        result = relax.relax_protein(unrelaxed, relax_config)
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the unrelaxed files and timings.json are written; the reason is kept
        timings["relax"] = time.perf_counter() - t0
        for suffix in (".pdb", ".cif"):  # an older relaxed file of this target must not pass for this run's
            (folder / f"{name}_relaxed{suffix}").unlink(missing_ok=True)
        reason = str(exc).splitlines()[0] if str(exc) else ""
        return {"seconds": timings["relax"], "converged": False, "relaxed": False,
                "problem": f"cannot be relaxed: {type(exc).__name__}: {reason}"}, []
    summary = result.summary()
    timings["relax"] = result.seconds
    if result.chirality_changed or result.cis_changed:
        # AlphaFold's relaxation keeps chirality and cis/trans peptides: a result that broke them is refused
        # (and an older relaxed file of this target removed, so none can pass for this run's)
        for suffix in (".pdb", ".cif"):
            (folder / f"{name}_relaxed{suffix}").unlink(missing_ok=True)
        summary["refused"] = True
        return summary, []
    tag = "relaxed" if result.converged else f"relaxed, NOT CONVERGED ({result.violations_after} violating)"
    return summary, _write_structure(folder, f"{name}_relaxed", result.protein, f"{remark} {tag}".strip(), best)


def _write_ranking(folder: Path, predictions: dict[str, Prediction], ranked: list[str], metric: str) -> list[str]:
    """`ranking.json` (the order and each model's score under `metric`) and AlphaFold's `ranking_debug.json`."""
    ranking = {"order": ranked, "scores": {k: predictions[k].ranking_score(metric) for k in ranked}, "metric": metric}
    _write_text(folder / "ranking.json", json.dumps(ranking, indent=2))
    # AlphaFold's file: mean pLDDT per model and the order the outputs were ranked in
    debug: dict[str, Any] = {"plddts": {k: float(predictions[k].plddt.mean()) for k in ranked}}
    if all(p.ptm is not None for p in predictions.values()):  # extra information; not the ranking of monomers
        debug["ptms"] = {k: float(predictions[k].ptm) for k in ranked}
    if metric == "iptm+ptm":  # AlphaFold-Multimer's ranking_debug.json: the ranking confidence under "iptm+ptm"
        debug["iptms"] = {k: float(predictions[k].iptm) for k in ranked}
        debug["iptm+ptm"] = {k: float(predictions[k].ranking_confidence) for k in ranked}
    debug["order"] = ranked
    _write_text(folder / "ranking_debug.json", json.dumps(debug, indent=4))
    return ["ranking.json", "ranking_debug.json"]


def _write_inputs(folder: Path, name: str, features_info: dict[str, Any] | None, msa: np.ndarray | None) -> list[str]:
    """`features.json` (what the features were made of) and the MSA coverage plot, for those given."""
    files = []
    if features_info is not None:
        _write_text(folder / "features.json", json.dumps(features_info, indent=2))
        files.append("features.json")
    if msa is not None:
        from ..io.confidence import plot_msa_coverage

        depth = f"{len(msa)} sequence{'s' if len(msa) != 1 else ''}"
        plot_msa_coverage(folder / f"{name}_coverage.png", msa, f"{name}: sequence coverage ({depth})")
        files.append(f"{name}_coverage.png")
    return files
