"""The training-step math of diffusers' SD3 and Flux DreamBooth scripts (rectified flow, Esser et al. 2024, "Scaling
Rectified Flow Transformers for High-Resolution Image Synthesis"), as plain functions.

One step: latents `x0 = (vae(x).sample - shift_factor) * scaling_factor`, noise `x1 ~ N(0, I)`, a density draw `u`
in [0, 1) (`timestep_density`: uniform, logit-normal or mode sampling, sec. 3.1 of the paper), the index
`int(u * num_train_timesteps)` into the `FlowMatchEulerDiscreteScheduler`'s (shifted) timesteps and sigmas, the
noisy input `x_s = (1 - s) x0 + s x1`, and the loss `mean(w(s) * (pred - target)^2)` with the target the velocity
`x1 - x0`, or, with SD3's `--precondition_outputs`, `x0` against the preconditioned prediction `x_s - s * pred`;
`w(s)` is `loss_weighting` (sigma_sqrt, cosmap, else 1). Under DreamBooth's prior preservation the batch's second
half holds the class images, whose loss is added times `prior_loss_weight`.

SD3 conditions its transformer on CLIP-L's and CLIP-G's penultimate hidden states, concatenated and zero-padded to
T5's width, followed by T5's (`encode_prompt_sd3`), and on both CLIPs' pooled projections; Flux on T5's hidden
states and CLIP-L's pooled output (`encode_prompt_flux`), with packed 2x2 latent patches, their positions
(`image_ids`), zero text positions and, where the transformer has it, the guidance embedding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["WEIGHTING_SCHEMES", "encode_prompt_flux", "encode_prompt_sd3", "flow_loss", "flux_forward",
           "flow_latents", "loss_weighting", "noisy_input", "schedule_points", "sd3_forward", "timestep_density"]

WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")


def timestep_density(scheme: str, n: int, generator: torch.Generator, *, logit_mean: float = 0.0,
                     logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """`n` draws `u` in [0, 1) of the scheme's timestep density (diffusers' `compute_density_for_timestep_sampling`):
    logit_normal `sigmoid(N(logit_mean, logit_std))`; mode `1 - v - mode_scale (cos(pi v / 2)^2 - 1 + v)` of a
    uniform `v`; any other scheme uniform."""
    if scheme == "logit_normal":
        return torch.sigmoid(torch.normal(logit_mean, logit_std, (n,), generator=generator))
    v = torch.rand(n, generator=generator)
    if scheme == "mode":
        return 1 - v - mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    return v


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """The loss weight of each sample: sigma_sqrt `s^-2`, cosmap `2 / (pi (1 - 2s + 2s^2))`, otherwise 1
    (diffusers' `compute_loss_weighting_for_sd3`)."""
    if scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
    return torch.ones_like(sigmas)


def schedule_points(scheduler: Any, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps `[B]`, sigmas `[B]`) of the draws `u` on the flow-matching scheduler's training schedule: the
    index `int(u * num_train_timesteps)` into its timesteps and sigmas (the scripts look the sigma of a timestep up
    in the same table)."""
    idx = (u * scheduler.config.num_train_timesteps).long()
    return scheduler.timesteps[idx], scheduler.sigmas[idx]


def flow_latents(vae: Any, pixels: torch.Tensor, latent_eps: torch.Tensor | None) -> torch.Tensor:
    """`(z - shift_factor) * scaling_factor` of the VAE posterior sample `mean + std * latent_eps` (the mean when
    `latent_eps` is None) of `pixels` in [-1, 1]."""
    dist = vae.encode(pixels.to(vae.dtype)).latent_dist
    z = dist.mean if latent_eps is None else dist.mean + dist.std * latent_eps.to(dist.mean)
    return (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


def noisy_input(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """`(1 - s) x0 + s x1`, `sigmas: [B]`."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents)
    return (1.0 - s) * latents + s * noise


def flow_loss(pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, *,
              weighting_scheme: str, precondition_outputs: bool = False, prior_preservation: bool = False,
              prior_loss_weight: float = 1.0) -> torch.Tensor:
    """The scalar loss of one batch from the transformer's prediction `pred` (latent layout, `[B, C, h, w]`)."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1))).to(latents)
    if precondition_outputs:
        pred = pred * (-s) + noisy_input(latents, noise, sigmas)
        target = latents
    else:
        target = noise - latents
    weight = loss_weighting(weighting_scheme, s)

    def mean(p: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w.float() * (p.float() - t.float()) ** 2).reshape(t.shape[0], -1).mean(1).mean()

    if not prior_preservation:
        return mean(pred, target, weight)
    (p, pp), (t, tp), (w, wp) = pred.chunk(2), target.chunk(2), weight.chunk(2)
    return mean(p, t, w) + prior_loss_weight * mean(pp, tp, wp)


# -- prompts ----------------------------------------------------------------------------------------------------
def _clip(encoder: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = encoder(ids.to(encoder.device), output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def encode_prompt_sd3(encoders: list[Any], ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """SD3's conditioning of token ids (`ids`: CLIP-L's, CLIP-G's `[B, 77]`, T5's `[B, max_sequence_length]`):
    `hidden` `[B, 77 + L, D_t5]` (both CLIPs' penultimate states side by side, zero-padded to T5's width, then T5's
    last states) and `pooled` `[B, P_l + P_g]` (both projections)."""
    (h1, p1), (h2, p2) = _clip(encoders[0], ids[0]), _clip(encoders[1], ids[1])
    t5 = encoders[2](ids[2].to(encoders[2].device))[0].to(h1.device)
    clip = torch.cat([h1, h2], dim=-1).to(t5.dtype)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {"hidden": torch.cat([clip, t5], dim=-2), "pooled": torch.cat([p1, p2], dim=-1)}


def encode_prompt_flux(encoders: list[Any], ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flux's conditioning: `hidden` T5's last hidden states `[B, L, D]`, `pooled` CLIP-L's pooled output `[B, P]`."""
    pooled = encoders[0](ids[0].to(encoders[0].device), output_hidden_states=False).pooler_output
    hidden = encoders[1](ids[1].to(encoders[1].device))[0].to(pooled.device)
    return {"hidden": hidden, "pooled": pooled.to(hidden.dtype)}


# -- the transformers' forward as the scripts call them ---------------------------------------------------------
def sd3_forward(transformer: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                ) -> torch.Tensor:
    """The SD3 transformer's prediction `[B, C, h, w]`."""
    return transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["hidden"],
                       pooled_projections=cond["pooled"], return_dict=False)[0]


def flux_forward(transformer: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor],
                 guidance_scale: float) -> torch.Tensor:
    """The Flux transformer's prediction `[B, C, h, w]`: the latents packed in 2x2 patches with their positions,
    zero text positions, `timesteps / 1000`, and `guidance_scale` for every sample where the transformer embeds
    guidance (Flux.1-dev), unpacked again."""
    from diffusers import FluxPipeline

    b, c, h, w = noisy.shape
    packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
    image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
    text_ids = torch.zeros(cond["hidden"].shape[1], 3, device=noisy.device, dtype=noisy.dtype)
    guidance = (torch.full((b,), float(guidance_scale), device=noisy.device)
                if transformer.config.guidance_embeds else None)
    pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                       pooled_projections=cond["pooled"], encoder_hidden_states=cond["hidden"], txt_ids=text_ids,
                       img_ids=image_ids, return_dict=False)[0]
    # _unpack_latents takes the pixel size and the VAE's factor; h * 8 with factor 8 is the same latent grid
    return FluxPipeline._unpack_latents(pred, h * 8, w * 8, 8)
