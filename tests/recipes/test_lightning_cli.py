"""ZeroStrategy / GeminiStrategy under LightningCLI: every config field is a typed keyword of the strategy (issue 44).

The signature is generated from `ZeroConfig` / `GeminiConfig` (`recipes.strategy_options`); a field missing from it
fails here. One 2-rank launch runs `LightningCLI(...).fit` from a YAML whose `trainer.strategy` names each class with
`init_args` (config fields as plain keywords), and compares the weights with the plain single-process loop.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowmem.core_parallel import GeminiConfig, ZeroConfig, run_on_ranks

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the test extra installs it)")

import lightning.pytorch as pl  # noqa: E402

CASES = {
    "zero": ("lowmem.recipes.ZeroStrategy", {"stage": 1, "bucket_mb": 0.5, "overlap": False}),
    "gemini": ("lowmem.recipes.GeminiStrategy", {"offload": "cpu", "chunk_mb": 1, "prefetch": 0}),
}


class CliModule(pl.LightningModule):
    """A linear regression, full batch of 8 split over the ranks, SGD with momentum."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        x, y = _data()
        world, rank = self.trainer.world_size, self.global_rank
        return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=4 // world)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)


def _reference(epochs: int) -> dict[str, torch.Tensor]:
    module = CliModule()
    opt = module.configure_optimizers()
    x, y = _data()
    for _ in range(epochs):
        for i in range(0, 12, 4):
            nn.functional.mse_loss(module.net(x[i:i + 4]), y[i:i + 4]).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _yaml(path: Path, class_path: str, init_args: dict, devices: int) -> Path:
    import yaml

    config = {"trainer": {
        "accelerator": "cpu", "devices": devices, "max_epochs": 2, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "use_distributed_sampler": False,
        "default_root_dir": str(path.parent),
        "strategy": {"class_path": class_path, "init_args": init_args}}}
    path.write_text(yaml.safe_dump(config))
    return path


def _cli_fit(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch.cli import LightningCLI

    out = {}
    for kind, (class_path, init_args) in CASES.items():
        config = _yaml(Path(root) / f"{kind}.yaml", class_path, init_args, world)
        cli = LightningCLI(CliModule, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
        strategy = cli.trainer.strategy
        out[kind] = {
            "class": type(strategy).__name__,
            "config": dataclasses.asdict(strategy.config),
            "weights": {k: v.detach().clone() for k, v in cli.model.state_dict().items()},
        }
    return out


@pytest.mark.parametrize("config_cls", [ZeroConfig, GeminiConfig])
def test_every_config_field_is_a_typed_documented_keyword(config_cls):
    from lowmem.recipes import GeminiStrategy, ZeroStrategy
    from lowmem.recipes.strategy_options import field_docs

    cls = ZeroStrategy if config_cls is ZeroConfig else GeminiStrategy
    params = inspect.signature(cls).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), "options hidden in **kwargs"
    hints = typing.get_type_hints(config_cls)
    docs = field_docs(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.name == "precision":  # the Trainer's
            assert f.name not in params
            continue
        assert f.name in params, f"{config_cls.__name__}.{f.name} is not a keyword of {cls.__name__}"
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        annotation = params[f.name].annotation
        assert annotation == hints[f.name] or annotation == hints[f.name] | None, f.name
        assert docs[f.name] and f"    {f.name}: " in cls.__doc__, f"{f.name} undocumented"


def test_keywords_at_their_defaults_count_as_not_given():
    """Signature tools (jsonargparse) pass every keyword; beside config= only values that differ are refused."""
    from lowmem.recipes import GeminiStrategy, ZeroStrategy

    config = GeminiConfig(chunk_mb=2)
    assert GeminiStrategy(config=config, prefetch=1, offload_param_frac=None).config is config
    with pytest.raises(TypeError, match=r"\['prefetch'\] come from config="):
        GeminiStrategy(config=config, prefetch=3)
    assert ZeroStrategy(config=ZeroConfig(stage=1), bucket_mb=25.0).config.stage == 1
    # offload="cpu" puts every chunk off the device unless a fraction is given, also 0.0
    assert GeminiStrategy(offload="cpu").config.offload_param_frac == 1.0
    assert GeminiStrategy(offload="cpu", offload_param_frac=0.0).config.offload_param_frac == 0.0


def _cli_error(config: Path, capsys) -> str:
    """What LightningCLI says about `config`: its parser's exit message, or the error of instantiating the classes."""
    from lightning.pytorch.cli import LightningCLI

    with pytest.raises((SystemExit, ValueError)) as caught:
        LightningCLI(CliModule, args=["--config", str(config)], run=False)
    return f"{caught.value}\n{capsys.readouterr().err}"


def test_cli_bad_value_is_the_configs_one_line(tmp_path, capsys):
    config = _yaml(tmp_path / "bad.yaml", "lowmem.recipes.GeminiStrategy", {"chunk_mb": -1}, 1)
    assert "chunk_mb must be a positive number of MiB or None, got -1" in _cli_error(config, capsys)
    config = _yaml(tmp_path / "typo.yaml", "lowmem.recipes.ZeroStrategy", {"bukcet_mb": 1}, 1)
    assert "Option 'bukcet_mb' is not accepted" in _cli_error(config, capsys)


@pytest.mark.distributed
def test_lightning_cli_fits_with_init_args_on_two_ranks(tmp_path):
    results = run_on_ranks(_cli_fit, 2, str(tmp_path), backend="none", timeout=150, env={"OMP_NUM_THREADS": "1"})
    expected = _reference(2)
    for kind, (_, init_args) in CASES.items():
        got = results[0][kind]
        assert got["class"] == ("ZeroStrategy" if kind == "zero" else "GeminiStrategy")
        for key, value in init_args.items():
            if key == "offload":
                assert got["config"]["offload_tier"] == value and got["config"]["offload_param_frac"] == 1.0
            else:
                assert got["config"][key] == value, key
        for rank in (0, 1):
            for name, ref in expected.items():
                torch.testing.assert_close(results[rank][kind]["weights"][name], ref, rtol=1e-5, atol=1e-6)
