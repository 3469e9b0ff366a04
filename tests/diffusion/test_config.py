"""`FineTuneConfig` composed of sections: every setting has exactly one generated flag, flat and nested recipe
YAMLs load, and `suite diffusion finetune` merges flag > file > default with one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pickle

import pytest

from lowmem.diffusion.config import FineTuneConfig, OptimizerSection, load_yaml_config
from lowmem.diffusion.data import DataConfig
from lowmem.diffusion.training import LossConfig
from lowmem.suite.cli import build_parser, main
from lowmem.utils.settings import settings


def _finetune_parser() -> argparse.ArgumentParser:
    parser = build_parser(["diffusion"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["diffusion"]
    return next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["finetune"]


def _args(*argv: str) -> argparse.Namespace:
    argv = ["diffusion", "finetune", *argv]
    args = build_parser(argv).parse_args(argv)
    return args


def test_every_setting_has_one_generated_flag_with_its_docstring():
    from lowmem.suite.commands import diffusion as command
    from lowmem.suite.commands import diffusion_shared as shared

    table = settings(FineTuneConfig)
    flags = {a.option_strings[0]: a for a in _finetune_parser()._actions if a.option_strings}
    assert set(flags) == {"-h", "--config"} | {f"--{name}" for name, s in table.items() if s.flaggable}
    assert [name for name, s in table.items() if not s.flaggable] == ["parallel", "extra"]  # YAML and code only
    for name, s in table.items():
        assert s.help, f"{s.key} has no docstring"
        if s.flaggable:
            assert flags[f"--{name}"].help.startswith(s.help.rstrip(".").replace("%", "%%")), name
    assert not hasattr(command, "FLAGS") and not hasattr(command, "LAUNCH_FLAGS")  # no hand-written flag table
    source = inspect.getsource(command) + inspect.getsource(shared)
    assert source.count("add_argument(") == 2, "only --config and the scripts' frozen tables are written by hand"
    assert len(table) == 87 and FineTuneConfig.field_names() == list(table)


def test_sections_are_the_owners_dataclasses_and_flat_names_read_through():
    cfg = FineTuneConfig(learning_rate=3e-4, image_interpolation_mode="bicubic", prediction_type="v_prediction",
                         tokenizer_max_length=20, rank=4)
    assert isinstance(cfg.data, DataConfig) and isinstance(cfg.loss, LossConfig)
    assert cfg.optimizer.learning_rate == cfg.learning_rate == 3e-4 and cfg.data.interpolation == "bicubic"
    assert cfg.data_config().max_length == 20 and cfg.data_config().interpolation == "bicubic"
    assert FineTuneConfig().prediction_type is None  # the run's default (the scheduler's), not LossConfig's
    assert FineTuneConfig().loss_config("v_prediction").prediction_type == "v_prediction"
    assert cfg.loss_config("epsilon").prediction_type == "v_prediction"
    with pytest.raises(AttributeError):
        cfg.learning_rate = 1.0  # read-only: the section owns the value
    same = FineTuneConfig(optimizer=OptimizerSection(learning_rate=3e-4), data=DataConfig(interpolation="bicubic"),
                          loss=LossConfig(prediction_type="v_prediction"), tokenizer_max_length=20, rank=4)
    assert same == cfg
    moved = dataclasses.replace(cfg, output_dir="elsewhere")  # what the Ray path does with paths
    assert moved.output_dir == "elsewhere" and moved.learning_rate == 3e-4 and moved.rank == 4
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(TypeError, match="learning_rat'"):
        FineTuneConfig(learning_rat=1.0)


def test_nested_recipe_equals_the_flat_one(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("rank: 4\nlearning_rate: 1e-3\nimage_interpolation_mode: bicubic\nvalidation_prompts: a cat\n")
    nested.write_text("model: {rank: 4}\noptimizer: {learning_rate: 1.0e-3}\ndata: {interpolation: bicubic}\n"
                      "validation: {validation_prompts: [a cat]}\n")
    assert load_yaml_config(flat) == load_yaml_config(nested)
    cfg = FineTuneConfig(**load_yaml_config(nested))
    assert (cfg.rank, cfg.learning_rate, cfg.image_interpolation_mode, cfg.prompts) == (4, 1e-3, "bicubic", ["a cat"])


def test_explicit_flag_beats_the_file_which_beats_the_default(tmp_path):
    from lowmem.suite.commands.diffusion import build_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("seed: 3\nlearning_rate: 1.0e-3\noptimizer:\n  adam_beta1: 0.8\n")
    cfg = build_config(_args("--config", str(recipe), "--seed", "0"))  # explicit, equal to the default: wins
    assert (cfg.seed, cfg.learning_rate, cfg.adam_beta1, cfg.adam_beta2) == (0, 1e-3, 0.8, 0.999)
    cfg = build_config(_args("--config", str(recipe), "--learning_rate", "1e-4"))
    assert (cfg.seed, cfg.learning_rate) == (3, 1e-4)
    assert build_config(_args("--rank", "2")) == FineTuneConfig(rank=2)  # no file: flags over defaults


@pytest.mark.parametrize("text, expect", [
    ("learning_rat: 1.0e-3\n", "unknown setting 'learning_rat' (did you mean 'learning_rate'?)"),
    ("optimizer:\n  adam_beta3: 0.5\n", "unknown setting 'optimizer.adam_beta3'"),
    ("resolution: big\n", "resolution: expected an integer, got 'big'"),
    ("use_ema: yes please\n", "use_ema: expected true or false, got 'yes please'"),
    ("resolution: 30\n", "resolution must be a positive multiple of 8, got 30"),
    ("data:\n  interpolation: cubic\n", "image_interpolation_mode must be one of"),
    # the parallel section (issue 20)
    ("parallel: {fsdp: {}}\n", "parallel must be null or a mapping with one key, zero or gemini"),
    ("parallel: {gemini: {tier: nvme}}\n", "parallel: gemini: got an unexpected keyword argument 'tier'"),
    ("parallel: {gemini: {offload_tier: nvme}}\n", "parallel: gemini: offload_tier='nvme' needs offload_dir"),
    ("parallel: {zero: {stage: 3}}\n", "parallel: zero: "),
    ("parallel: {zero: {precision: bf16}}\n", "parallel: zero.precision: the precision is --mixed_precision's"),
    ("strategy: zero2\nparallel: {zero: {}}\n", "strategy 'zero2' and parallel both name the strategy"),
    ("offload_dir: /x\nparallel: {gemini: {}}\n", "offload_dir goes inside parallel"),
    ("strategy: gemini\noffload_dir: /x\n", "offload_dir /x: only the strategies with an NVMe tier use it"),
])
def test_bad_recipe_is_one_line_naming_the_key_and_the_file_exit_2(tmp_path, capsys, text, expect):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    rc = main(["diffusion", "finetune", "--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"suite diffusion: error: {recipe}: ") and expect in err[0], err
    assert not (tmp_path / "out").exists()


def test_bad_flag_value_names_the_flag(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("resolution: 64\n")
    rc = main(["diffusion", "finetune", "--config", str(recipe), "--resolution", "30"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["suite diffusion: error: --resolution must be a positive multiple of 8, got 30"]


# -- the parallel section (issue 20) --------------------------------------------------------------------------
def test_parallel_section_yaml_forms_and_the_strategy_built_from_it(tmp_path):
    from lowmem.core_parallel import GeminiConfig, ZeroConfig
    from lowmem.core_parallel.loss_scaler import LossScalerConfig
    from lowmem.recipes.diffusion import build_strategy
    from lowmem.recipes.strategies import GeminiStrategy, ZeroStrategy
    from lowmem.suite.commands.diffusion import build_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"parallel:\n  gemini: {{offload_tier: nvme, offload_dir: {tmp_path / 'nvme'}, "
                      "offload_optim_frac: 0.5}\n")
    cfg = build_config(_args("--config", str(recipe)))
    want = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_optim_frac=0.5)
    assert cfg.parallel == cfg.launch.parallel == want
    strategy = build_strategy(cfg)
    assert isinstance(strategy, GeminiStrategy) and strategy.config is cfg.parallel
    # nested under its section, a zero config, loss-scaler settings as a mapping
    recipe.write_text("launch:\n  parallel: {zero: {stage: 1, offload: cpu, loss_scaler: {hysteresis: 3}}}\n")
    cfg = build_config(_args("--config", str(recipe)))
    assert cfg.parallel == ZeroConfig(stage=1, offload="cpu", loss_scaler=LossScalerConfig(hysteresis=3))
    assert isinstance(build_strategy(cfg), ZeroStrategy) and build_strategy(cfg).config is cfg.parallel
    # an explicit --strategy replaces the file's parallel (flag > file); in code both at once are refused
    cfg = build_config(_args("--config", str(recipe), "--strategy", "gemini_offload"))
    assert cfg.launch.parallel is None and cfg.parallel == GeminiConfig(offload_tier="cpu", offload_param_frac=1.0,
                                                                       offload_optim_frac=1.0)
    with pytest.raises(ValueError, match="give one"):
        FineTuneConfig(strategy="zero2", parallel=ZeroConfig())
    assert FineTuneConfig(parallel={"zero": {"stage": 1}}).parallel == ZeroConfig(stage=1)
    assert FineTuneConfig().parallel is None and build_strategy(FineTuneConfig(strategy="ddp")) == "ddp"
    with pytest.raises(ValueError, match="use_ema is not supported with the gemini"):
        FineTuneConfig(use_ema=True, parallel=GeminiConfig())


def test_the_run_s_sharding_config_is_built_once_with_the_config(tmp_path, monkeypatch, capsys):
    """`--strategy NAME [--offload_dir DIR]` becomes `cfg.parallel` where the config is built
    (`core_parallel.config_for_strategy`); a copy keeps it, a copy with another strategy builds its own; a refused
    setting leaves no temporary NVMe folder; a folder the strategy cannot use is one line naming the flag."""
    import tempfile

    from lowmem.core_parallel import GeminiConfig, ZeroConfig

    cfg = FineTuneConfig(strategy="zero2")
    assert cfg.parallel == ZeroConfig(stage=2) and cfg.launch.parallel is None and cfg.strategy == "zero2"
    assert dataclasses.replace(cfg, output_dir="elsewhere").parallel is cfg.parallel  # the Ray path's copy
    assert dataclasses.replace(cfg, devices=2).parallel == cfg.parallel  # a launch setting: built again, equal
    assert dataclasses.replace(cfg, strategy="zero1").parallel == ZeroConfig(stage=1)
    assert dataclasses.replace(cfg, strategy="ddp").parallel is None
    assert pickle.loads(pickle.dumps(cfg)).parallel == cfg.parallel  # what Ray workers get
    # gemini_nvme without a folder: one temporary folder, made once every other setting is accepted
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for refused in (dict(use_ema=True), dict(num_workers=0), dict(with_prior_preservation=True)):
        with pytest.raises(ValueError):
            FineTuneConfig(strategy="gemini_nvme", **refused)
    assert list(tmp_path.iterdir()) == []
    nvme = FineTuneConfig(strategy="gemini_nvme")
    assert [str(p) for p in tmp_path.iterdir()] == [nvme.parallel.offload_dir]
    assert nvme.parallel == GeminiConfig(offload_tier="nvme", offload_dir=nvme.parallel.offload_dir,
                                         offload_param_frac=1.0, offload_optim_frac=1.0)
    assert dataclasses.replace(nvme, seed=3).parallel is nvme.parallel and len(list(tmp_path.iterdir())) == 1
    # the flag and the script commands' launcher flag: one line naming --offload_dir
    rc = main(["diffusion", "finetune", "--strategy", "zero2", "--offload_dir", "/x", "--output_dir",
               str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["suite diffusion: error: --offload_dir /x: only the strategies with an NVMe tier use "
                               "it (gemini_nvme, gemini_auto), not --strategy zero2"], err
    rc = main(["diffusion", "train_text_to_image", "--pretrained_model_name_or_path", "x", "--train_data_dir",
               str(tmp_path), "--strategy", "gemini_nvme", "--offload_dir", " "])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["suite diffusion: error: --offload_dir must be a folder path or None, got an empty "
                               "string"], err
