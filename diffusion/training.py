"""The training-step math of diffusers' text-to-image, LoRA and DreamBooth scripts, as plain functions.

One step (Ho et al. 2020, "Denoising Diffusion Probabilistic Models", Alg. 1, latent form of Rombach et al.
2022): encode images to latents `z0 = vae(x).sample * scaling_factor`, draw noise `eps` and timesteps `t`,
form `z_t = sqrt(acp_t) z0 + sqrt(1 - acp_t) eps`, predict with the UNet conditioned on the text encoder's
hidden states, and regress onto `eps` (epsilon) or `v = sqrt(acp_t) eps - sqrt(1 - acp_t) z0` (v-prediction).
Min-SNR weighting follows Hang et al. 2023 ("Efficient Diffusion Training via Min-SNR Weighting Strategy")
as diffusers implements it; DreamBooth's prior preservation adds `prior_loss_weight` times the same loss on
class images (Ruiz et al. 2023).

All randomness of a step comes from `step_generator(seed, step, micro_batch, rank)`, so a resumed run draws
exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "EMA",
    "LossConfig",
    "SAMPLE_REFUSAL",
    "StepNoise",
    "compute_snr",
    "diffusion_loss",
    "draw_step_noise",
    "edm_loss",
    "encode_latents",
    "euler_of",
    "is_edm_scheduler",
    "snr_weights",
    "step_generator",
]


SAMPLE_REFUSAL = ("not supported: of diffusers' SD/SDXL training scripts only train_text_to_image_sdxl.py takes it, "
                  "and it trains the UNet's output minus the noise against the clean latents, which a scheduler with "
                  "prediction_type 'sample' (reading the output as the clean latents) does not sample from; the "
                  "other scripts stop on it. Train epsilon or v_prediction")
"""Why `prediction_type` 'sample' is refused (v0.40.0's scripts: the SDXL full fine-tune's `model_pred = model_pred
- noise; target = model_input`, the others' `ValueError("Unknown prediction type")` in the first step)."""


@dataclass(kw_only=True)
class LossConfig:
    """The loss of one training step."""

    prediction_type: str | None = "epsilon"
    """What the UNet predicts: `epsilon` (the noise) or `v_prediction` (the velocity); None in a run's settings
    means the scheduler's, filled in before training (`FineTuneConfig.loss_config`)."""
    snr_gamma: float | None = None
    """Min-SNR gamma (5.0 is the paper's choice); None for the plain MSE."""
    noise_offset: float = 0.0
    """Scale of the per-channel constant added to the noise (0 disables; a negative scale is applied as given)."""
    prior_loss_weight: float = 1.0
    """Weight of the class-image loss under prior preservation."""
    with_prior_preservation: bool = False
    """The second half of each batch holds class images (DreamBooth prior preservation)."""
    input_perturbation: float = 0.0
    """Scale of the extra noise in the UNet's input only, not in the target (Ning et al. 2023); 0 disables."""
    dream_training: bool = False
    """DREAM (Zhou et al. 2023): a no-grad prediction's error, scaled by `sqrt(1 - alpha_bar_t) **
    dream_detail_preservation`, is added to the noisy input and to the target (epsilon prediction only)."""
    dream_detail_preservation: float = 1.0
    """DREAM's detail-preservation exponent."""
    edm_style: bool = False
    """EDM-style training with the folder's (non-EDM) noise schedule, through Euler's sigmas (train_dreambooth_lora_
    sdxl.py's `--do_edm_style_training`); a folder with an EDM scheduler trains EDM-style without it."""

    def __post_init__(self) -> None:
        if self.dream_training and self.prediction_type not in (None, "epsilon"):
            raise ValueError("dream_training: DREAM is defined for prediction_type epsilon only, got "
                             f"{self.prediction_type!r}")
        if self.prediction_type == "sample":
            raise ValueError(f"prediction_type 'sample': {SAMPLE_REFUSAL}")
        if self.prediction_type not in (None, "epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {self.prediction_type!r}")
        # Negative noise_offset, input_perturbation, prior_loss_weight and dream_detail_preservation are taken
        # as diffusers' scripts take them (the same formulas); a gamma <= 0 makes every weight 0 (nothing trains)
        # or negative (the gradients reversed).
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise ValueError(f"snr_gamma must be > 0 (0 weights every loss by 0: nothing would train; a negative "
                             f"gamma reverses the gradients), got {self.snr_gamma}")


@dataclass
class StepNoise:
    """The random draws of one step: VAE sample noise, diffusion noise, timesteps (and input perturbation).

    `latent_eps: [B, C, h, w]`, `noise: [B, C, h, w]`, `timesteps: [B]` (int64), `perturbation` like noise or None.
    """

    latent_eps: torch.Tensor
    noise: torch.Tensor
    timesteps: torch.Tensor
    perturbation: torch.Tensor | None = None


def step_generator(seed: int, step: int, micro_batch: int = 0, rank: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on its arguments."""
    digest = hashlib.blake2b(f"{seed}/{step}/{micro_batch}/{rank}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def draw_step_noise(
    shape: tuple[int, ...], num_timesteps: int, generator: torch.Generator, noise_offset: float = 0.0,
    input_perturbation: float = 0.0,
) -> StepNoise:
    """Draw the noise of one step for latents of `shape` `[B, C, h, w]` (on CPU, float32); the standard normal
    `perturbation` only with `input_perturbation` (drawn last, so the other draws do not depend on it)."""
    latent_eps = torch.randn(shape, generator=generator)
    noise = torch.randn(shape, generator=generator)
    if noise_offset:
        noise = noise + noise_offset * torch.randn(shape[0], shape[1], 1, 1, generator=generator)
    timesteps = torch.randint(0, num_timesteps, (shape[0],), generator=generator, dtype=torch.long)
    perturbation = torch.randn(shape, generator=generator) if input_perturbation else None
    return StepNoise(latent_eps=latent_eps, noise=noise, timesteps=timesteps, perturbation=perturbation)


def encode_latents(vae: Any, pixel_values: torch.Tensor, latent_eps: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled VAE latents `[B, 4, h, w]` of `pixel_values: [B, 3, H, W]` in [-1, 1]: `z * scaling_factor`, or
    `(z - latents_mean) * scaling_factor / latents_std` for a VAE config with latent statistics.

    `latent_eps` is the standard normal draw of the posterior sample (`mean + std * eps`); None gives the mean.
    """
    dist = vae.encode(pixel_values.to(vae.dtype)).latent_dist
    z = dist.mean if latent_eps is None else dist.mean + dist.std * latent_eps.to(dist.mean)
    mean, std = (getattr(vae.config, k, None) for k in ("latents_mean", "latents_std"))
    if mean is None and std is None:
        return z * vae.config.scaling_factor
    # a VAE with latent statistics (Playground v2.5's): normalised as train_dreambooth_lora_sdxl.py does
    shape = (1, -1, *([1] * (z.ndim - 2)))
    mean = torch.zeros(()) if mean is None else torch.tensor(mean).view(shape)
    std = torch.ones(()) if std is None else torch.tensor(std).view(shape)
    return (z - mean.to(z)) * vae.config.scaling_factor / std.to(z)


def latent_shape(vae: Any, pixel_values: torch.Tensor) -> tuple[int, int, int, int]:
    """The shape of `encode_latents(vae, pixel_values)` without running the VAE."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    b, _, h, w = pixel_values.shape
    return (b, vae.config.latent_channels, h // factor, w // factor)


def compute_snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio `acp_t / (1 - acp_t)` per timestep; `timesteps: [B]` -> `[B]` float32."""
    acp = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)[timesteps]
    return acp / (1.0 - acp)


def snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR loss weights `[B]`: min(snr, gamma)/snr (epsilon) or min(snr, gamma)/(snr + 1) (v)."""
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1.0) if prediction_type == "v_prediction" else clipped / snr


def _per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))


def diffusion_loss(
    unet: Any,
    scheduler: Any,
    latents: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    cfg: LossConfig,
    perturbation: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar training loss of one batch.

    `latents: [B, C, h, w]`, `encoder_hidden_states: [B, L, D]`, `noise` like latents, `timesteps: [B]`.
    Under prior preservation the second half of the batch holds the class images. With
    `cfg.input_perturbation`, the UNet's input is noised with `noise + input_perturbation * perturbation`
    while the target keeps `noise` (diffusers' `--input_perturbation`).
    """
    if cfg.edm_style or is_edm_scheduler(scheduler):
        return edm_loss(unet, scheduler, latents, encoder_hidden_states, noise, timesteps, cfg)
    noisy_with = noise
    if cfg.input_perturbation:
        if perturbation is None:
            raise ValueError("input_perturbation needs the step's perturbation draw")
        noisy_with = noise + cfg.input_perturbation * perturbation
    noisy = scheduler.add_noise(latents, noisy_with, timesteps)
    if cfg.prediction_type == "epsilon":
        target = noise
    else:
        target = scheduler.get_velocity(latents, noise, timesteps)
    if cfg.dream_training:
        noisy, target = _dream(unet, scheduler, noisy, target, noise, timesteps, encoder_hidden_states,
                               cfg.dream_detail_preservation)
    pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False)[0]
    per_sample = _per_sample_mse(pred, target)
    if cfg.snr_gamma is not None:
        snr = compute_snr(scheduler.alphas_cumprod, timesteps)
        per_sample = per_sample * snr_weights(snr, cfg.snr_gamma, cfg.prediction_type)
    if not cfg.with_prior_preservation:
        return per_sample.mean()
    instance, prior = per_sample.chunk(2)
    return instance.mean() + cfg.prior_loss_weight * prior.mean()


def is_edm_scheduler(scheduler: Any) -> bool:
    """Whether `scheduler` is one of diffusers' EDM schedulers (`EDM` in its class name, as the script tests it)."""
    return "EDM" in type(scheduler).__name__


_EULER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def euler_of(scheduler: Any) -> Any:
    """The `EulerDiscreteScheduler` of the training scheduler's folder config (`folder_config`, set by
    `diffusion.folders.training_scheduler`; else its own config), built once: what train_dreambooth_lora_sdxl.py
    trains `--do_edm_style_training` with on a folder whose scheduler is not EDM."""
    if scheduler not in _EULER:
        from diffusers import EulerDiscreteScheduler

        _EULER[scheduler] = EulerDiscreteScheduler.from_config(getattr(scheduler, "folder_config", None)
                                                               or scheduler.config)
    return _EULER[scheduler]


def edm_loss(unet: Any, scheduler: Any, latents: torch.Tensor, encoder_hidden_states: torch.Tensor,
             noise: torch.Tensor, indices: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """The scalar loss of EDM-style training as train_dreambooth_lora_sdxl.py (v0.40.0) computes it (Karras et al.
    2022, "Elucidating the Design Space of Diffusion-Based Generative Models", sec. 5 and table 1).

    `indices: [B]` are the step's uniform draws in [0, num_train_timesteps): the noise level of sample i is
    `sigma = scheduler.sigmas[indices[i]]` and the UNet's time input `scheduler.timesteps[indices[i]]`
    (`c_noise = 0.25 ln sigma` for an EDM scheduler). The noisy latents `x + sigma * noise` enter the UNet scaled by
    `c_in`; its output `F` becomes the denoised estimate `D = c_skip x_noisy + c_out F`, regressed on the clean
    latents. An EDM scheduler (Playground v2.5, CosXL) gives `c_in = 1 / sqrt(sigma^2 + sigma_data^2)`, `c_skip =
    sigma_data^2 / (sigma^2 + sigma_data^2)`, `c_out = +-sigma sigma_data / sqrt(sigma^2 + sigma_data^2)` (-: v)
    and no weighting; any other schedule (`cfg.edm_style`, Euler's sigmas of the folder's betas) `c_in = 1 /
    sqrt(sigma^2 + 1)`, epsilon `D = x_noisy - sigma F`, v `D = x_noisy / (sigma^2 + 1) - sigma F / sqrt(sigma^2 +
    1)`, weighted by `sigma^-2`. As in the script, the paper's loss weighting `lambda(sigma)` (table 1) is not
    used (its comment: numerical problems), and sigma is drawn uniformly over the schedule's levels, not the
    paper's log-normal.
    """
    from .errors import InputError

    if cfg.snr_gamma is not None:
        raise InputError("--snr_gamma: Min-SNR weighting is not supported with EDM-style training (diffusers' "
                         "script refuses it with --do_edm_style_training and fails on it with an EDM folder)")
    edm = is_edm_scheduler(scheduler)
    if not edm:
        scheduler = euler_of(scheduler)
    idx = indices.cpu().long()
    timesteps = scheduler.timesteps[idx].to(latents.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    sigmas = scheduler.sigmas[idx].to(device=latents.device, dtype=noisy.dtype)
    sigmas = sigmas.view(-1, *([1] * (noisy.ndim - 1)))
    inputs = scheduler.precondition_inputs(noisy, sigmas) if edm else noisy / (sigmas**2 + 1) ** 0.5
    pred = unet(inputs, timesteps, encoder_hidden_states, return_dict=False)[0]
    if edm:
        pred = scheduler.precondition_outputs(noisy, pred, sigmas)
    elif cfg.prediction_type == "epsilon":
        pred = pred * (-sigmas) + noisy
    else:
        pred = pred * (-sigmas / (sigmas**2 + 1) ** 0.5) + noisy / (sigmas**2 + 1)
    err = (pred.float() - latents.float()) ** 2
    if not edm:
        err = (sigmas**-2.0).float() * err
    per_sample = err.reshape(err.shape[0], -1).mean(dim=1)
    if not cfg.with_prior_preservation:
        return per_sample.mean()
    instance, prior = per_sample.chunk(2)
    return instance.mean() + cfg.prior_loss_weight * prior.mean()


def _dream(unet: Any, scheduler: Any, noisy: torch.Tensor, target: torch.Tensor, noise: torch.Tensor,
           timesteps: torch.Tensor, hidden: torch.Tensor, detail: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DREAM's rectified input and target: `delta = (noise - eps_hat) * sqrt(1 - a_t) ** detail` from a
    prediction without gradient; `noisy + sqrt(1 - a_t) * delta`, `target + delta`."""
    alpha_bar = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].view(-1, *([1] * (noisy.ndim - 1)))
    sigma = (1.0 - alpha_bar) ** 0.5
    with torch.no_grad():
        eps_hat = unet(noisy, timesteps, hidden, return_dict=False)[0]
    delta = ((noise - eps_hat) * sigma**detail).detach().to(noisy.dtype)
    return noisy + (sigma * delta).to(noisy.dtype), target + delta.to(target.dtype)


class EMA:
    """Exponential moving average of parameters, with diffusers' `EMAModel` decay schedule (no warm-up).

    At update `n` (counting from 1), with `s = n - 1`: `d = 0` when `s == 0`, else `min(decay, (1 + s) / (10 + s))`;
    then `shadow = d * shadow + (1 - d) * param`. The shadow copies are float32 on the parameters' device.
    """

    def __init__(self, params: Any, decay: float = 0.9999, *, foreach: bool = False, offload: bool = False,
                 start: Any = None) -> None:
        """Track `params`; the shadows start as copies of `start` (same shapes and order; default: `params`
        themselves), e.g. the UNet of another hub revision (diffusers' --non_ema_revision)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.params = [p for p in params]
        first = self.params if start is None else list(start)
        if len(first) != len(self.params) or any(a.shape != b.shape for a, b in zip(first, self.params)):
            raise ValueError("the EMA's start values do not match the tracked parameters (count or shapes)")
        # offload: the shadows live in CPU memory and are updated there (diffusers' --offload_ema)
        self.shadow = [s.detach().float().to("cpu" if offload else p.device, copy=True)
                       for s, p in zip(first, self.params)]
        self.decay = decay
        self.foreach = foreach
        self.optimization_step = 0

    def current_decay(self) -> float:
        """The decay applied by the next `update()`."""
        s = self.optimization_step  # diffusers: max(0, n - 1) for update n = optimization_step + 1
        return 0.0 if s == 0 else min(self.decay, (1 + s) / (10 + s))

    @torch.no_grad()
    def update(self) -> None:
        """Move the shadows towards the current parameters."""
        d = self.current_decay()
        self.optimization_step += 1
        if self.foreach and self.shadow:  # one multi-tensor kernel (diffusers' --foreach_ema); same values
            torch._foreach_lerp_(self.shadow, [p.detach().float().to(s.device) for s, p in zip(self.shadow,
                                                                                                self.params)], 1.0 - d)
            return
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float().to(s.device), 1.0 - d)

    @torch.no_grad()
    def copy_to(self, params: Any) -> None:
        """Write the shadows into `params` (same order as the tracked ones)."""
        for s, p in zip(self.shadow, params):
            p.copy_(s.to(p.dtype))

    def state_dict(self) -> dict[str, Any]:
        """The shadows, the step count and the decay."""
        return {"shadow": [s.clone() for s in self.shadow], "optimization_step": self.optimization_step,
                "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; the parameter list must match."""
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, expected {len(self.shadow)}")
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)
        self.optimization_step = int(state["optimization_step"])
        self.decay = float(state["decay"])
