"""Every Trainer precision under the sharded strategies against Lightning's ddp at the same precision.

One 2-rank gloo launch trains a small LayerNorm model (the module that broke `bf16-mixed` when the strategies kept
bf16 parameters under autocast) for a few steps under ddp and every strategy name, at each precision, and returns
each run's weights next to ddp's (and the parameters' dtype). Tolerances follow the dtype, as a difference relative
to the largest weight: fp32 1e-5; the half types a few (`UNITS`) times `torch.finfo(dtype).eps`
(bf16 2**-7, fp16 2**-10).
Under `*-mixed` both keep fp32 parameters and run the same autocast forward, so they agree to fp32 rounding. Under
`*-true` ddp steps the half parameters themselves (every update rounded into the dtype, the momentum buffer kept in
it) while `core_parallel` steps fp32 master shards: up to about half a unit per step apart, ~2 units after these 4
steps (measured: docs/strategies.md, "Precision").

For `32-true`, `bf16-mixed` and `bf16-true` (`EVAL_PRECISIONS`) the same Trainer then runs `validate`, `test` and
`predict` after the fit (logged, `sync_dist` metrics and every rank's predictions against ddp's, relative to the
largest of ddp's, within the same bound), and a fresh Trainer and model (other initial weights: only the
checkpoint makes them equal) resume from the fit's `last` checkpoint (`ModelCheckpoint(save_last=True)`,
`fit(ckpt_path="last")`) for one more epoch: its weights and global step against ddp's resume, within the same bound
(measured: docs/strategies.md, "Precision").

The optimizer is SGD with momentum: Lightning's ddp at `16-true` with AdamW turns NaN in its first step (the
squared gradients and eps=1e-8 underflow in fp16), which leaves nothing to compare with.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowmem.core_parallel import run_on_ranks

logger = logging.getLogger(__name__)

NAMES = ("zero1", "zero2", "zero2_offload", "gemini", "gemini_offload", "gemini_nvme", "gemini_auto")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_BF16, _FP16 = torch.finfo(torch.bfloat16).eps, torch.finfo(torch.float16).eps
EPS = {"32-true": 1e-5 / 4, "bf16-mixed": _BF16, "16-mixed": _FP16, "bf16-true": _BF16, "16-true": _FP16}
# units of EPS (relative to the largest weight) a weight may differ by: *-true, see above; *-mixed one unit, far
# above the fp32 reduction-order differences they show (0 to 6e-8 measured)
UNITS = {"32-true": 4, "bf16-mixed": 1, "16-mixed": 1, "bf16-true": 4, "16-true": 4}
N_SAMPLES, GLOBAL_BATCH, WIDTH = 32, 8, 16
EVAL_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STAGES = ("validate", "test", "predict", "resume")
# a failure of a stage under a name and precision, as "name-precision-stage": the exact error line (xfail strict)
KNOWN_FAILURES: dict[str, str] = {}


def make_module(seed: int = 0):
    import lightning.pytorch as pl

    class LayerNormMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(WIDTH, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                                     nn.LayerNorm(32), nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x).float(), y.float())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def _loss(self, batch, name: str) -> None:
            x, y = batch
            self.log(name, nn.functional.mse_loss(self(x).float(), y.float()), sync_dist=True)

        def validation_step(self, batch, batch_idx):
            self._loss(batch, "val_loss")

        def test_step(self, batch, batch_idx):
            self._loss(batch, "test_loss")

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(N_SAMPLES, WIDTH, generator=g), torch.randn(N_SAMPLES, 4, generator=g)
            world, rank = self.trainer.world_size, self.global_rank
            return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=GLOBAL_BATCH // world)

        val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    return LayerNormMLP()


def _fit(strategy: str, precision: str, root: Path, ckpt_dir: Path | None = None, resume: bool = False):
    """Fit one epoch (`ckpt_dir`: with a `last` checkpoint there); `resume`: a fresh model from that `last`, to 2."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lowmem import recipes  # noqa: F401  (registers the strategy names)

    # On CPU Lightning turns precision="16-mixed" into bf16-mixed; the plugin, given explicitly, runs float16
    # autocast with a GradScaler for ddp and becomes ShardedPrecision("16-mixed") for ours.
    extra: dict = {"precision": precision}
    if precision == "16-mixed":
        extra = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    if ckpt_dir is not None:
        extra["callbacks"] = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2 if resume else 1,
                         logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=False, default_root_dir=str(root), **extra)
    module = make_module(seed=1 if resume else 0)  # resume: other initial weights, which the checkpoint replaces
    trainer.fit(module, ckpt_path="last" if resume else None)
    assert trainer.precision_plugin.precision == precision, (strategy, trainer.precision_plugin.precision)
    return trainer, module


def _weights(strategy: str, trainer, module, root: Path, tag: str) -> dict[str, torch.Tensor] | None:
    """The trained weights on rank 0 (None on the others), in the dtype the model holds them in."""
    from lowmem import core_parallel

    if strategy == "ddp":
        return {k: v.detach().clone() for k, v in module.state_dict().items()} if trainer.is_global_zero else None
    trainer.strategy.state_dict_type = "sharded"  # the fp32 masters themselves, consolidated below
    trainer.save_checkpoint(root / tag)
    if not trainer.is_global_zero:
        return None
    from safetensors.torch import load_file

    return load_file(core_parallel.consolidate_checkpoint(root / tag, root / f"{tag}.safetensors"))


def _parameter_dtype(trainer) -> torch.dtype:
    """The dtype the trained model holds its parameters in (Gemini's: the chunks')."""
    manager = getattr(trainer.strategy.model, "gemini_manager", None)
    if manager is not None:
        return manager.chunks[0].full.dtype
    return next(trainer.strategy.model.parameters()).dtype


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _stages(strategy: str, precision: str, trainer, module, root: Path, tag: str, out: dict) -> None:
    """validate, test, predict on the fitted trainer, then the resume from `last`; each recorded or its error line.
    Metrics are synced (the same on every rank), predictions are each rank's own (rank 1's under "...-r1")."""
    suffix = "" if trainer.is_global_zero else "-r1"
    for stage in ("validate", "test"):
        try:
            metrics = getattr(trainer, stage)(module, verbose=False)[0]
            out[f"{tag}-{stage}"] = {k: torch.as_tensor(v).float() for k, v in metrics.items()}
        except Exception as e:
            out[f"{tag}-{stage}"] = _error(e)
    try:
        out[f"{tag}-predict{suffix}"] = {"y": torch.cat(trainer.predict(module)).float()}
    except Exception as e:
        out[f"{tag}-predict{suffix}"] = _error(e)
    try:
        trainer, module = _fit(strategy, precision, root, root / f"{tag}-ckpt", resume=True)
        weights = _weights(strategy, trainer, module, root, f"{tag}-resumed")
        if weights is not None:
            out[f"{tag}-resume"] = {k: v.float() for k, v in weights.items()}
            out[f"{tag}-resume-step"] = trainer.global_step
    except Exception as e:
        out[f"{tag}-resume"] = _error(e)


def _train_matrix(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out: dict = {}
    for precision in PRECISIONS:
        for strategy in ("ddp", *NAMES):
            tag = f"{strategy}-{precision}"
            t0 = time.perf_counter()
            ckpt_dir = root / f"{tag}-ckpt" if precision in EVAL_PRECISIONS else None
            try:
                trainer, module = _fit(strategy, precision, root, ckpt_dir)
                weights = _weights(strategy, trainer, module, root, tag)
            except Exception as e:  # recorded per configuration, so one failure does not hide the rest
                out[tag] = _error(e)
                continue
            if weights is not None:
                out[tag] = {k: v.float() for k, v in weights.items()}
                out[f"{tag}-dtype"] = str(_parameter_dtype(trainer))
            t1 = time.perf_counter()
            if ckpt_dir is not None:
                _stages(strategy, precision, trainer, module, root, tag, out)
            out[f"{tag}-s"], out[f"{tag}-stages-s"] = t1 - t0, time.perf_counter() - t1
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    t0 = time.perf_counter()
    results = run_on_ranks(_train_matrix, 2, str(root), backend="none", timeout=420, env={"OMP_NUM_THREADS": "1"})
    logger.info("precision matrix took %.1fs (of which validate/test/predict/resume %.1fs on rank 0)",
                time.perf_counter() - t0, sum(v for k, v in results[0].items() if k.endswith("-stages-s")))
    return {**results[0], **{k: v for k, v in results[1].items() if k.endswith("-r1")}}


def max_difference(got: dict, ref: dict) -> float:
    """Largest |got - ref| over all weights, relative to the largest |ref|."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    scale = max(float(v.abs().max()) for v in ref.values())
    return max(float((got[k] - ref[k]).abs().max()) for k in ref) / scale


@pytest.mark.distributed
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", NAMES)
def test_precision_matches_ddp(matrix, name, precision):
    ref, got = matrix[f"ddp-{precision}"], matrix[f"{name}-{precision}"]
    assert isinstance(ref, dict), f"ddp at {precision}: {ref}"
    assert isinstance(got, dict), f"{name} at {precision}: {got}"
    initial = {k: v.float() for k, v in make_module().state_dict().items()}
    tolerance = UNITS[precision] * EPS[precision]
    diff = max_difference(got, ref)
    logger.info("%s %s: max weight difference vs ddp %.2e (relative to the largest weight)", name, precision, diff)
    assert diff <= tolerance, f"{name} at {precision}: {diff:.2e} > {tolerance:.2e}"
    # the comparison means something: training moved the weights well beyond the tolerance
    assert max_difference(ref, initial) > 5 * tolerance
    assert matrix[f"{name}-{precision}-dtype"] == matrix[f"ddp-{precision}-dtype"]


def _stage_cases():
    for precision in EVAL_PRECISIONS:
        for name in NAMES:
            for stage in STAGES:
                error = KNOWN_FAILURES.get(f"{name}-{precision}-{stage}")
                marks = [pytest.mark.xfail(strict=True, reason=error)] if error else []
                yield pytest.param(name, precision, stage, marks=marks, id=f"{name}-{precision}-{stage}")


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "precision", "stage"), list(_stage_cases()))
def test_stage_after_fit_matches_ddp(matrix, name, precision, stage):
    """validate / test / predict on the fitted Trainer, and the resume from `last`, give ddp's results."""
    tolerance = UNITS[precision] * EPS[precision]
    keys = [f"-{stage}", "-predict-r1"] if stage == "predict" else [f"-{stage}"]
    for key in keys:
        ref, got = matrix[f"ddp-{precision}{key}"], matrix[f"{name}-{precision}{key}"]
        assert isinstance(ref, dict), f"ddp at {precision}, {key[1:]}: {ref}"
        assert isinstance(got, dict), f"{name} at {precision}, {key[1:]}: {got}"
        assert ref and set(got) == set(ref), (sorted(got), sorted(ref))
        diff = max_difference(got, ref)
        logger.info("%s %s %s: max difference vs ddp %.2e", name, precision, key[1:], diff)
        assert diff <= tolerance, f"{name} at {precision}, {key[1:]}: {diff:.2e} > {tolerance:.2e}"
    if stage == "predict":  # every sample of each rank's half predicted
        assert matrix[f"{name}-{precision}-predict"]["y"].shape == (N_SAMPLES // 2, 4)
    if stage == "resume":  # the comparison means something: the added epoch moved ddp's weights beyond the bound
        assert matrix[f"{name}-{precision}-resume-step"] == matrix[f"ddp-{precision}-resume-step"] == 8
        assert max_difference(matrix[f"ddp-{precision}-resume"], matrix[f"ddp-{precision}"]) > 4 * tolerance



def test_64_true_is_refused_in_one_line_when_the_trainer_is_built():
    import lightning.pytorch as pl

    from lowmem import recipes  # noqa: F401

    with pytest.raises(ValueError, match=r"precision='64-true' is not supported .* strategy='ddp'"):
        pl.Trainer(strategy="zero2", accelerator="cpu", devices=1, precision="64-true")


def test_mixed_keeps_fp32_parameters_true_converts():
    from lowmem.recipes.precision import ShardedPrecision

    for precision, core, autocast in (("bf16-mixed", "fp32", torch.bfloat16), ("16-mixed", "fp32", torch.float16),
                                      ("bf16-true", "bf16", None), ("16-true", "fp16", None)):
        plugin = ShardedPrecision(precision)
        assert (plugin.core_precision, plugin.autocast_dtype) == (core, autocast), precision
    module = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert ShardedPrecision("bf16-mixed").convert_module(module)[1].weight.dtype == torch.float32
    assert ShardedPrecision("bf16-true").convert_module(module)[1].weight.dtype == torch.bfloat16


def test_mixed_forward_keeps_no_half_copies_of_the_weights():
    """Under `*-mixed` the forward's autocast runs without its weight cache (with it, the half copy of every weight
    used lives until the forward ends: the chunks Gemini released stay in memory as copies). Same casts, so the
    same outputs as torch's default autocast."""
    from lowmem.recipes.precision import ShardedPrecision

    layer = nn.Linear(64, 64)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
    plugin = ShardedPrecision("bf16-mixed")
    plugin.device_type = "cpu"
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
        got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize(("strategy", "kwargs", "message"), [
    ("ZeroStrategy", {"stage": 2, "bukcet_mb": 1}, "'bukcet_mb'; did you mean 'bucket_mb'"),
    ("GeminiStrategy", {"chunk_md": 4}, "'chunk_md'; did you mean 'chunk_mb'"),
    ("ZeroStrategy", {"timeout": 5}, "'timeout'; did you mean 'collective_timeout_s'"),
])
def test_unknown_strategy_keyword_is_a_type_error_naming_it(strategy, kwargs, message):
    from lowmem import recipes

    with pytest.raises(TypeError, match=message):
        getattr(recipes, strategy)(**kwargs)
    recipes.ZeroStrategy(stage=1, process_group_backend="gloo", bucket_mb=1)  # DDPStrategy's own keywords still work


def test_misspelled_strategy_name_suggests_ours():
    from lowmem.core_parallel.presets import config_for_strategy

    with pytest.raises(ValueError, match="'zer02' is not a strategy name; did you mean 'zero2'"):
        config_for_strategy("zer02")
    assert config_for_strategy("ddp") is None and config_for_strategy("fsdp") is None
