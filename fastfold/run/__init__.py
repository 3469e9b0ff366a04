"""A fold run: FASTA -> alignments -> features -> model -> relaxation -> files, one room with one entry.

    from lowmem.fastfold.run import FoldConfig, ModelSpec, fold, read_fold_targets

    targets, _ = read_fold_targets("targets.fasta")
    results = fold(targets, FoldConfig(output_dir="out", models=[ModelSpec(param_path="params_model_1_ptm.npz")]))

`fold` (`entry`) is what `suite fold`, the Lightning recipe (`recipes.fold`) and Python users share: every input
checked up front (`preflight.check_inputs`), the targets folded (`pipeline.fold_targets`), every output layout
written (`write_layouts`: OpenFold's `predictions/` with `FoldConfig.output_layout="openfold"`). The modules, from
the bottom up:

- `settings`: what the user types (`FoldSettings`: flags, `--config` keys, the recipe's YAML keys);
- `stages`: one target's stages (`ModelSpec`, `load_model`, `features_for_model`, `predict` -> `Prediction`,
  `target_features`, `Models`);
- `config`: the run (`FoldConfig`, `prediction_runs`, `weights_remark`);
- `outputs`: one target's files (`write_target_outputs`); `resume`: its record and fingerprint;
  `target`: its predictions and files (`predict_all`, `outputs_job`); `results`: what happened (`TargetResult`);
- `ray_session`, `workflow` (FastFold's `--enable_workflow`), `cluster` (`--ray_address`): Ray;
- `pipeline`: the scheduling (`fold_targets`, `feature_stream`, `dap_session`);
- `preflight`: the checks; `layout`: OpenFold's layout; `entry`: `fold`, `read_fold_targets`, `write_layouts`.

Per target, `<output_dir>/<name>/` holds `<name>_<model>_unrelaxed.pdb|.cif` and `<name>_<model>_prediction.npz`
per model (the npz lets an interrupted run resume), then for the best model (AlphaFold's ranking: mean pLDDT for
monomer models, `_ptm` ones too; 0.8 ipTM + 0.2 pTM for multimer) `<name>_unrelaxed.pdb|.cif`,
`<name>_relaxed.pdb|.cif`, `<name>_confidence.json`, `<name>_plddt.png`, `<name>_pae.png` (pTM models),
`ranking.json` and, written last, `timings.json`: a target is complete when `timings.json` lists files that all
exist. Complexes (AlphaFold-Multimer models, `model_N_multimer[_v2|_v3]`) are `ComplexTarget`s
(`read_complex_targets`), written as one PDB/mmCIF with a chain ID per chain, ipTM and chain-pair PAE in the
confidence JSON. Names resolve on first use (importing this package imports neither torch nor Ray).
"""

from __future__ import annotations

from ...utils.lazy import lazy_getattr

_LAZY = {
    "AlignmentConfig": "..data.targets",
    "Target": "..data.targets",
    "read_targets": "..data.targets",
    "read_alignment_dir": "..data.targets",
    "run_alignment_tools": "..data.targets",
    "target_raw_features": "..data.targets",
    "ComplexTarget": ".stages",
    "GapTarget": ".stages",
    "ModelSpec": ".stages",
    "Prediction": ".stages",
    "features_for_model": ".stages",
    "load_model": ".stages",
    "predict": ".stages",
    "read_complex_targets": ".stages",
    "FEATURE_INFO": ".stages",
    "FoldConfig": ".config",
    "TargetResult": ".results",
    "inputs_summary": ".results",
    "write_target_outputs": ".outputs",
    "prediction_to_protein": ".outputs",
    "is_complete": ".resume",
    "target_fingerprint": ".resume",
    "dap_session": ".pipeline",
    "feature_stream": ".pipeline",
    "fold_targets": ".pipeline",
    "check_inputs": ".preflight",
    "fold": ".entry",
    "read_fold_targets": ".entry",
    "write_layouts": ".entry",
    "FoldSettings": ".settings",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
