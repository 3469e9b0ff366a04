"""The dynamic loss scaler: backoff, hysteresis, growth, bounds, and a state that resumes exactly."""

from __future__ import annotations

import pytest

from lowmem.core_parallel.loss_scaler import DynamicLossScaler, LossScalerConfig


def test_backoff_growth_and_bounds():
    s = DynamicLossScaler(LossScalerConfig(initial_scale=8.0, growth_interval=2, min_scale=2.0, max_scale=16.0))
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # min_scale
    s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0  # grew after growth_interval clean steps
    for _ in range(10):
        s.update(False)
    assert s.scale == 16.0  # max_scale
    assert s.overflows == 3


def test_hysteresis_delays_backoff():
    s = DynamicLossScaler(LossScalerConfig(initial_scale=8.0, hysteresis=2))
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 4.0


def test_state_round_trip_continues_identically():
    cfg = LossScalerConfig(initial_scale=2.0**10, growth_interval=3, hysteresis=2)
    a = DynamicLossScaler(cfg)
    for flag in (True, False, False, True, True, False):
        a.update(flag)
    b = DynamicLossScaler(cfg)
    b.load_state_dict(a.state_dict())
    for flag in (False, False, True, True, False, False, False):
        a.update(flag)
        b.update(flag)
        assert a.state_dict() == b.state_dict()


def test_disabled_is_one_and_ignores_state():
    s = DynamicLossScaler(enabled=False)
    s.update(True)
    s.load_state_dict({"enabled": True, "scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 1})
    assert s.scale == 1.0


@pytest.mark.parametrize(
    "field,value",
    [("initial_scale", 0.0), ("growth_factor", 1.0), ("backoff_factor", 1.5), ("growth_interval", 0),
     ("hysteresis", 0), ("min_scale", -1.0)],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        LossScalerConfig(**{field: value})


def test_enabled_follows_the_parameter_dtype_unless_given():
    """None: scaled under fp16 parameters only; True: also fp32 parameters under fp16 autocast (16-mixed);
    False: never (16-true). The ZeRO optimizer's scaler follows the config."""
    import torch

    from lowmem import core_parallel
    from lowmem.core_parallel import ZeroConfig
    from lowmem.core_parallel.loss_scaler import LossScalerConfig
    from lowmem.utils.errors import InputError

    assert LossScalerConfig().on("fp16") and not LossScalerConfig().on("fp32")
    assert LossScalerConfig(enabled=True).on("fp32") and not LossScalerConfig(enabled=False).on("fp16")
    with pytest.raises(InputError, match="enabled"):
        LossScalerConfig(enabled="yes")
    model = torch.nn.Linear(3, 2)
    config = ZeroConfig(stage=1, loss_scaler=LossScalerConfig(enabled=True))
    _, opt = core_parallel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert opt.loss_scaler.enabled
