"""EDM-style training (issue 45) as train_dreambooth_lora_sdxl.py does it: `diffusion_loss` with an EDM scheduler
(Playground v2.5, CosXL) or with `edm_style` (`--do_edm_style_training` on another schedule) against the loss
written out by hand in float64 from Karras et al. 2022 (sigmas, preconditioning) and the script's weighting; the
latents normalised by a VAE's latent statistics; and which folders the commands take."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.diffusion.training import LossConfig, diffusion_loss, encode_latents

N = 1000


def _toy_unet(a: float = 0.7, b: float = 0.05):
    """F(x, t, h) = a x + b t + mean(h): a fixed function of all three inputs, on any dtype."""
    def unet(x, t, h, return_dict=False):
        return (a * x + b * t.to(x.dtype).view(-1, 1, 1, 1) + h.to(x.dtype).mean(dim=(1, 2)).view(-1, 1, 1, 1),)
    return unet


def _batch(b: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(b, 4, 3, 5, generator=g)
    noise = torch.randn(b, 4, 3, 5, generator=g)
    hidden = torch.randn(b, 7, 6, generator=g)
    indices = torch.tensor([0, 1, 517, N - 1][:b])
    return latents, noise, hidden, indices


def _per_sample(d: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    err = (d - x) ** 2
    if w is not None:
        err = w.view(-1, 1, 1, 1) * err
    return err.reshape(err.shape[0], -1).mean(dim=1)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_edm_scheduler_loss_is_the_preconditioned_x0_regression(prediction_type):
    from diffusers import EDMEulerScheduler

    smin, smax, sd, rho = 0.002, 80.0, 0.5, 7.0
    scheduler = EDMEulerScheduler(sigma_min=smin, sigma_max=smax, sigma_data=sd, rho=rho, num_train_timesteps=N,
                                  prediction_type=prediction_type)
    latents, noise, hidden, idx = _batch()
    got = diffusion_loss(_toy_unet(), scheduler, latents, hidden, noise, idx, LossConfig(prediction_type=None))

    x, n, h = latents.double(), noise.double(), hidden.double()
    ramp = idx.double() / N  # Karras et al. eq. 5 from sigma_max down; diffusers' EDM schedulers: N + 1 levels
    sigma = ((smax ** (1 / rho) + ramp * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho).view(-1, 1, 1, 1)
    noisy = x + sigma * n
    c_in, c_skip = 1 / (sigma**2 + sd**2).sqrt(), sd**2 / (sigma**2 + sd**2)
    c_out = (1 if prediction_type == "epsilon" else -1) * sigma * sd / (sigma**2 + sd**2).sqrt()
    f = _toy_unet()(c_in * noisy, 0.25 * sigma.log().flatten(), h)[0]
    want = _per_sample(c_skip * noisy + c_out * f, x).mean()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_edm_style_on_a_ddpm_schedule_is_euler_preconditioning_weighted_by_sigma_squared(prediction_type):
    """--do_edm_style_training: Euler's sigmas of the folder's betas, c_in = 1/sqrt(sigma^2 + 1), weight sigma^-2;
    with prior preservation the class half weighted by prior_loss_weight."""
    from diffusers import DDPMScheduler

    b0, b1 = 0.00085, 0.012
    ddpm = DDPMScheduler(num_train_timesteps=N, beta_start=b0, beta_end=b1, beta_schedule="scaled_linear",
                         prediction_type=prediction_type)
    latents, noise, hidden, idx = _batch()
    cfg = LossConfig(prediction_type=prediction_type, edm_style=True, with_prior_preservation=True,
                     prior_loss_weight=0.3)
    got = diffusion_loss(_toy_unet(), ddpm, latents, hidden, noise, idx, cfg)

    x, n, h = latents.double(), noise.double(), hidden.double()
    betas = torch.linspace(b0**0.5, b1**0.5, N, dtype=torch.float64) ** 2
    acp = torch.cumprod(1 - betas, 0)
    t = (N - 1 - idx).double()  # Euler's schedule runs from the last timestep down
    sigma = ((1 - acp[N - 1 - idx]) / acp[N - 1 - idx]).sqrt().view(-1, 1, 1, 1)
    noisy = x + sigma * n
    f = _toy_unet()(noisy / (sigma**2 + 1).sqrt(), t, h)[0]
    if prediction_type == "epsilon":
        d = noisy - sigma * f
    else:
        d = noisy / (sigma**2 + 1) - sigma / (sigma**2 + 1).sqrt() * f
    per = _per_sample(d, x, sigma.flatten() ** -2)
    want = per[:2].mean() + 0.3 * per[2:].mean()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6)


def test_snr_gamma_is_refused_with_edm():
    from diffusers import EDMEulerScheduler

    from lowmem.diffusion.errors import InputError

    latents, noise, hidden, idx = _batch()
    with pytest.raises(InputError, match="--snr_gamma: Min-SNR weighting is not supported with EDM"):
        diffusion_loss(_toy_unet(), EDMEulerScheduler(), latents, hidden, noise, idx, LossConfig(snr_gamma=5.0))


class _Dist:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std


class _Vae:
    """A VAE whose posterior is given: `encode_latents` only reads `encode(x).latent_dist` and the config."""

    dtype = torch.float32

    def __init__(self, config, mean, std):
        self.config, self._dist = type("Config", (), config), _Dist(mean, std)

    def encode(self, x):
        return type("Out", (), {"latent_dist": self._dist})


def test_latents_are_normalised_by_the_vaes_latent_statistics():
    g = torch.Generator().manual_seed(3)
    mean, std, eps = torch.randn(2, 4, 3, 3, generator=g), torch.rand(2, 4, 3, 3, generator=g), torch.randn(
        2, 4, 3, 3, generator=g)
    stats = {"latents_mean": [0.1, -0.2, 0.3, 0.0], "latents_std": [0.9, 1.1, 0.5, 2.0], "scaling_factor": 0.5}
    got = encode_latents(_Vae(stats, mean, std), torch.zeros(2, 3, 6, 6), eps)
    z = mean.double() + std.double() * eps.double()
    m = torch.tensor(stats["latents_mean"], dtype=torch.float64).view(1, 4, 1, 1)
    s = torch.tensor(stats["latents_std"], dtype=torch.float64).view(1, 4, 1, 1)
    torch.testing.assert_close(got.double(), (z - m) * 0.5 / s)
    plain = encode_latents(_Vae({"latents_mean": None, "latents_std": None, "scaling_factor": 0.5}, mean, std),
                           torch.zeros(2, 3, 6, 6))
    torch.testing.assert_close(plain, mean * 0.5)
    assert math.isfinite(float(got.sum()))


# -- which folders the commands take ------------------------------------------------------------------------------
def _playground(sdxl_folder: Path, to: Path) -> Path:
    shutil.copytree(sdxl_folder, to)
    (to / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_data": 0.5, "sigma_min": 0.002, "sigma_max": 80.0,
         "prediction_type": "epsilon"}))
    vae = to / "vae" / "config.json"
    vae.write_text(json.dumps({**json.loads(vae.read_text()), "latents_mean": [0.1] * 4, "latents_std": [0.9] * 4}))
    return to


def test_only_dreambooth_lora_sdxl_takes_an_edm_folder(tmp_path, sdxl_folder):
    from lowmem.diffusion.errors import InputError
    from lowmem.diffusion.folders import check_model_folder, training_scheduler

    folder = _playground(sdxl_folder, tmp_path / "pg")
    check_model_folder(folder, "sdxl", lora=True, dreambooth=True)
    assert type(training_scheduler(folder)).__name__ == "EDMEulerScheduler"
    for lora in (False, True):
        with pytest.raises(InputError, match="EDM scheduler, which means EDM-style training: only suite diffusion "
                                             "train_dreambooth_lora_sdxl"):
            check_model_folder(folder, "sdxl", lora=lora)
    (folder / "scheduler" / "scheduler_config.json").write_text((sdxl_folder / "scheduler" /
                                                                  "scheduler_config.json").read_text())
    with pytest.raises(InputError, match="latents_mean/latents_std .*only suite diffusion train_dreambooth_lora_sdxl"):
        check_model_folder(folder, "sdxl", lora=True)
    check_model_folder(folder, "sdxl", lora=True, dreambooth=True)


def test_dreambooth_with_custom_captions_takes_an_edm_folder_too(tmp_path, sdxl_folder, image_folder):
    """The script switches to EDM-style training from the folder whatever the data: --dataset_name with captions
    as well as --instance_data_dir; the text_to_image LoRA script on the same data is refused."""
    from lowmem.diffusion.errors import InputError
    from lowmem.diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, sdxl_script_config
    from lowmem.recipes.diffusion.launch import check_run

    folder = _playground(sdxl_folder, tmp_path / "pg")

    def config(script: str, **values):
        flags = {f.name: f.default for f in SDXL_SCRIPT_FLAGS[script]}
        return sdxl_script_config(script, {**flags, "pretrained_model_name_or_path": str(folder), "resolution": 32,
                                           "output_dir": str(tmp_path / "out"), **values})

    for data in ({"dataset_name": str(image_folder), "caption_column": "text"},
                 {"instance_data_dir": str(image_folder)}):
        cfg = config("train_dreambooth_lora_sdxl", instance_prompt="photo", **data)
        assert cfg.dreambooth
        check_run(cfg, "sdxl")
    with pytest.raises(InputError, match="EDM-style training: only suite diffusion train_dreambooth_lora_sdxl"):
        check_run(config("train_text_to_image_lora_sdxl", dataset_name=str(image_folder)), "sdxl")
