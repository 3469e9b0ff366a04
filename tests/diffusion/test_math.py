"""Training-step math against a plain diffusers-style step, EMA against diffusers' EMAModel, min-SNR."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lowmem.diffusion.training import (
    EMA,
    LossConfig,
    compute_snr,
    diffusion_loss,
    draw_step_noise,
    encode_latents,
    step_generator,
)


def _reference_step(unet, scheduler, latents, hidden, noise, timesteps, prediction_type, snr_gamma, prior_weight):
    """diffusers' train_text_to_image.py / train_dreambooth.py loss, written out as the scripts do it."""
    from diffusers.training_utils import compute_snr as diffusers_snr

    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = noise if prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
    pred = unet(noisy, timesteps, hidden, return_dict=False)[0]
    if prior_weight is not None:
        pred, pred_prior = torch.chunk(pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        prior_loss = F.mse_loss(pred_prior.float(), target_prior.float(), reduction="mean")
    if snr_gamma is None:
        loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
    else:
        snr = diffusers_snr(scheduler, timesteps)
        weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
        weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
        if prior_weight is not None:
            weights = weights[: len(weights) // 2]
        loss = F.mse_loss(pred.float(), target.float(), reduction="none")
        loss = (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()
    if prior_weight is not None:
        loss = loss + prior_weight * prior_loss
    return loss


@pytest.mark.parametrize(
    "prediction_type,snr_gamma,prior",
    [("epsilon", None, False), ("epsilon", 5.0, False), ("v_prediction", 3.0, False), ("epsilon", None, True)],
)
def test_loss_equals_plain_diffusers_step(tiny, prediction_type, snr_gamma, prior):
    torch.manual_seed(1234 + int(prior))
    unet, scheduler = tiny["unet"], tiny["scheduler"]
    b = 4 if prior else 3
    latents = torch.randn(b, 4, 16, 16)
    hidden = torch.randn(b, 77, 32)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (b,))
    cfg = LossConfig(prediction_type=prediction_type, snr_gamma=snr_gamma, with_prior_preservation=prior,
                     prior_loss_weight=0.7)
    ours = diffusion_loss(unet, scheduler, latents, hidden, noise, timesteps, cfg)
    ref = _reference_step(unet, scheduler, latents, hidden, noise, timesteps, prediction_type, snr_gamma,
                          0.7 if prior else None)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_input_perturbation_equals_diffusers_step(tiny):
    """train_text_to_image.py --input_perturbation: the UNet's input is noised with noise + p * randn, the
    target stays the noise."""
    unet, scheduler = tiny["unet"], tiny["scheduler"]
    draw = draw_step_noise((3, 4, 16, 16), 1000, step_generator(0, 2), input_perturbation=0.1)
    plain = draw_step_noise((3, 4, 16, 16), 1000, step_generator(0, 2))
    # drawn last: the other draws are those of a run without it
    assert torch.equal(draw.noise, plain.noise) and torch.equal(draw.timesteps, plain.timesteps)
    assert plain.perturbation is None and draw.perturbation.shape == draw.noise.shape
    torch.manual_seed(5)
    latents, hidden = torch.randn(3, 4, 16, 16), torch.randn(3, 77, 32)
    ours = diffusion_loss(unet, scheduler, latents, hidden, draw.noise, draw.timesteps,
                          LossConfig(input_perturbation=0.1), draw.perturbation)
    noisy = scheduler.add_noise(latents, draw.noise + 0.1 * draw.perturbation, draw.timesteps)
    pred = unet(noisy, draw.timesteps, hidden, return_dict=False)[0]
    torch.testing.assert_close(ours, F.mse_loss(pred.float(), draw.noise.float()), rtol=1e-6, atol=1e-7)
    unperturbed = diffusion_loss(unet, scheduler, latents, hidden, draw.noise, draw.timesteps, LossConfig())
    assert not torch.allclose(ours, unperturbed)
    with pytest.raises(ValueError, match="perturbation"):
        diffusion_loss(unet, scheduler, latents, hidden, draw.noise, draw.timesteps, LossConfig(input_perturbation=0.1))


def test_loss_gradients_match_reference(tiny):
    unet, scheduler = tiny["unet"], tiny["scheduler"]
    ref_unet = copy.deepcopy(unet)
    torch.manual_seed(7)
    latents, hidden = torch.randn(2, 4, 16, 16), torch.randn(2, 77, 32)
    noise, timesteps = torch.randn_like(latents), torch.randint(0, 1000, (2,))
    diffusion_loss(unet, scheduler, latents, hidden, noise, timesteps, LossConfig(snr_gamma=5.0)).backward()
    _reference_step(ref_unet, scheduler, latents, hidden, noise, timesteps, "epsilon", 5.0, None).backward()
    for (name, p), q in zip(unet.named_parameters(), ref_unet.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_snr_matches_diffusers(tiny):
    from diffusers.training_utils import compute_snr as diffusers_snr

    t = torch.randint(0, 1000, (17,))
    torch.testing.assert_close(compute_snr(tiny["scheduler"].alphas_cumprod, t), diffusers_snr(tiny["scheduler"], t))


def test_encode_latents_equals_vae_sample(tiny):
    vae = tiny["vae"]
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    g = torch.Generator().manual_seed(3)
    shape = (2, 4, 16, 16)
    eps = torch.randn(shape, generator=g)
    ours = encode_latents(vae, pixels, eps)
    ref = vae.encode(pixels).latent_dist.sample(generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, ref * vae.config.scaling_factor, rtol=1e-5, atol=1e-6)


def test_step_noise_is_a_function_of_its_arguments():
    a = draw_step_noise((2, 4, 8, 8), 1000, step_generator(0, 5, 1), noise_offset=0.1)
    b = draw_step_noise((2, 4, 8, 8), 1000, step_generator(0, 5, 1), noise_offset=0.1)
    c = draw_step_noise((2, 4, 8, 8), 1000, step_generator(0, 6, 1), noise_offset=0.1)
    assert torch.equal(a.noise, b.noise) and torch.equal(a.timesteps, b.timesteps)
    assert not torch.equal(a.noise, c.noise)
    assert a.timesteps.dtype == torch.long and a.timesteps.min() >= 0 and a.timesteps.max() < 1000


def _perturb_and_update(model, ours, ref, steps: int) -> None:
    """`steps` random moves of the model's weights, each followed by an update of both EMAs."""
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ours.update()
        ref.step(model.parameters())


def test_ema_matches_diffusers_emamodel():
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    ours = EMA(model.parameters(), decay=0.99)
    ref = EMAModel(model.parameters(), decay=0.99)
    _perturb_and_update(model, ours, ref, steps=6)
    for s, r in zip(ours.shadow, ref.shadow_params):
        torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)
    state = ours.state_dict()
    again = EMA(model.parameters(), decay=0.5)
    again.load_state_dict(state)
    assert again.optimization_step == 6 and again.decay == 0.99
    assert all(torch.equal(a, b) for a, b in zip(again.shadow, ours.shadow))


@pytest.mark.parametrize("foreach,offload", [(True, False), (False, True), (True, True)])
def test_ema_foreach_and_offload_match_diffusers(foreach, offload):
    """--foreach_ema and --offload_ema change where and how the EMA is updated, not its values."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    ours = EMA(model.parameters(), decay=0.9, foreach=foreach, offload=offload)
    ref = EMAModel(model.parameters(), decay=0.9, foreach=foreach)
    _perturb_and_update(model, ours, ref, steps=5)
    for s, r in zip(ours.shadow, ref.shadow_params):
        assert s.device.type == "cpu"
        torch.testing.assert_close(s.double(), r.double(), rtol=1e-6, atol=1e-7)
    target = copy.deepcopy(model)
    ours.copy_to(target.parameters())
    for p, r in zip(target.parameters(), ref.shadow_params):
        torch.testing.assert_close(p.double(), r.double(), rtol=1e-6, atol=1e-7)


def test_loss_config_validation():
    # issue 45: 'sample' is refused with why (the one script taking it trains output - noise against x0)
    with pytest.raises(ValueError, match="prediction_type 'sample': not supported: .*train_text_to_image_sdxl.py.*"
                                         "minus the noise against the clean latents"):
        LossConfig(prediction_type="sample")
    with pytest.raises(ValueError, match="prediction_type must be 'epsilon' or 'v_prediction', got 'x0'"):
        LossConfig(prediction_type="x0")
    with pytest.raises(ValueError, match="snr_gamma"):
        LossConfig(snr_gamma=0.0)


@pytest.mark.parametrize("detail", [1.0, 0.5])
def test_dream_equals_diffusers_compute_dream(tiny, detail):
    """--dream_training: loss and gradients against diffusers' own `compute_dream_and_update_latents` step.
    The UNet runs in float64; the MSE is taken in float32, as ours and diffusers' scripts take it."""
    training_utils = pytest.importorskip("diffusers.training_utils")
    compute_dream = getattr(training_utils, "compute_dream_and_update_latents", None)
    if compute_dream is None:
        pytest.skip("this diffusers has no compute_dream_and_update_latents")
    unet, scheduler = copy.deepcopy(tiny["unet"]).double(), tiny["scheduler"]
    ref_unet = copy.deepcopy(unet)
    gen = torch.Generator().manual_seed(11)
    latents, hidden = torch.randn(3, 4, 16, 16, generator=gen).double(), torch.randn(3, 77, 32, generator=gen).double()
    noise = torch.randn(3, 4, 16, 16, generator=gen).double()
    timesteps = torch.randint(0, 1000, (3,), generator=gen)
    ours = diffusion_loss(unet, scheduler, latents, hidden, noise, timesteps,
                          LossConfig(dream_training=True, dream_detail_preservation=detail))
    noisy = scheduler.add_noise(latents, noise, timesteps)
    noisy, target = compute_dream(ref_unet, scheduler, timesteps, noise, noisy, noise, hidden, detail)
    ref = F.mse_loss(ref_unet(noisy, timesteps, hidden, return_dict=False)[0].float(), target.float())
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-8)
    ours.backward()
    ref.backward()
    for (name, p), q in zip(unet.named_parameters(), ref_unet.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
    plain = diffusion_loss(unet, scheduler, latents, hidden, noise, timesteps, LossConfig())
    assert not torch.allclose(ours, plain)  # DREAM changes the loss
    with pytest.raises(ValueError, match="epsilon"):
        LossConfig(dream_training=True, prediction_type="v_prediction")
