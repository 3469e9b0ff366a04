"""`GeminiConfig.offload_tier`: one explicit field for where off-device data lives; `offload_dir` required for
"nvme" and refused for "cpu"; a folder alone still means NVMe, with a DeprecationWarning; the tier moves data,
never numbers."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from lowmem.core_parallel.gemini import OFFLOAD_TIERS, GeminiConfig, setup_gemini
from lowmem.utils.errors import InputError
from tests.core_parallel.gemini_helpers import build, train_reference, train_sharded


def test_the_tier_defaults_to_cpu_and_nvme_names_its_folder(tmp_path):
    assert OFFLOAD_TIERS == ("cpu", "nvme")
    assert (GeminiConfig().offload_tier, GeminiConfig().offload_dir) == ("cpu", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path))
        assert dataclasses.replace(cfg, offload_param_frac=0.5).offload_tier == "nvme"
    assert (cfg.offload_tier, cfg.offload_dir) == ("nvme", str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(offload_tier="cpu", offload_dir="/x"), r"offload_dir='/x' applies to offload_tier='nvme' only"),
        (dict(offload_tier="nvme"), r"offload_tier='nvme' needs offload_dir"),
        (dict(offload_tier="disk"), r"offload_tier must be one of \('cpu', 'nvme'\), got 'disk'"),
        (dict(offload_tier="disk", offload_dir="/x"), r"offload_tier must be one of"),
        (dict(offload_tier="nvme", offload_dir=" "), r"offload_dir must be a folder path"),
    ],
    ids=["cpu_with_folder", "nvme_without_folder", "unknown", "unknown_with_folder", "blank_folder"],
)
def test_bad_tier_combinations_are_one_clear_input_error(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a warning and then an error
        with pytest.raises(InputError, match=message):
            GeminiConfig(**kwargs)


def test_a_folder_alone_still_means_nvme_with_a_deprecation_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match="name the tier") as record:
        cfg = GeminiConfig(placement="auto", offload_dir=str(tmp_path))
    assert record[0].filename == __file__  # points at the caller
    assert (cfg.placement, cfg.offload_tier, cfg.offload_dir) == ("auto", "nvme", str(tmp_path))


def _train(tier: str, folder, dtype=torch.float32) -> tuple[dict, dict]:
    model, opt = build("adam")
    cfg = GeminiConfig(chunk_mb=40 * 4 / 2**20, offload_param_frac=1.0, offload_optim_frac=1.0, offload_tier=tier,
                       offload_dir=str(folder) if tier == "nvme" else None)
    model, opt = setup_gemini(model, opt, cfg)
    train_sharded(0, 1, model, opt, range(3))
    report = model.memory_report()["bytes"]
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.gemini_manager.close()
    return out, report


def test_the_tier_moves_data_not_numbers(tmp_path):
    on_cpu, cpu_report = _train("cpu", None)
    on_nvme, nvme_report = _train("nvme", tmp_path / "nvme")
    assert cpu_report["cpu"]["params"] > 0 and cpu_report["nvme"]["params"] == 0
    assert nvme_report["nvme"]["params"] == cpu_report["cpu"]["params"] and nvme_report["cpu"]["params"] == 0
    model, opt = build("adam")
    ref, _ = train_reference("adam", range(3), state=(model.double(), opt))  # float64 reference
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(on_nvme[name], on_cpu[name], rtol=0, atol=0)  # bit for bit
        torch.testing.assert_close(on_cpu[name].double(), want, rtol=1e-5, atol=1e-6, msg=name)


def test_the_presets_leave_the_folder_to_the_config(tmp_path, monkeypatch):
    """`core_parallel.presets` (the strategy names, GeminiStrategy's keywords) checks no folder itself: the config's
    one check answers, its deprecation warning points at the caller, and a temporary folder made for an NVMe tier
    named without one is removed again when the config refuses the other fields."""
    import tempfile

    from lowmem.core_parallel.presets import config_for_strategy, gemini_config

    with pytest.warns(DeprecationWarning, match="name the tier") as record:
        cfg = gemini_config(offload_dir=str(tmp_path))
    assert record[0].filename == __file__ and (cfg.offload_tier, cfg.offload_param_frac) == ("nvme", 0.0)
    with pytest.raises(InputError, match=r"offload_dir='/x' applies to offload_tier='nvme' only; offload_tier='cpu'"):
        gemini_config(offload="none", offload_dir="/x")
    auto = config_for_strategy("gemini_auto", offload_dir=str(tmp_path))
    assert auto == GeminiConfig(placement="auto", offload_tier="nvme", offload_dir=str(tmp_path))
    assert config_for_strategy("gemini_auto") == GeminiConfig(placement="auto") and config_for_strategy("ddp") is None
    with pytest.raises(InputError, match="^offload_dir /x: only the strategies with an NVMe tier"):
        config_for_strategy("gemini_offload", offload_dir="/x")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(InputError, match="prefetch"):
        gemini_config(offload="nvme", prefetch=-1)
    assert list((tmp_path / "tmp").iterdir()) == []
