"""`FineTuneConfig`: every setting of one fine-tuning run, named as diffusers' training scripts name its flag.

A recipe YAML (`recipes/configs/diffusion_*.yaml`) is a flat mapping of these field names; `--config FILE`
reads one and command-line flags override it. The component configs (`DataConfig`, `LossConfig`) are
derived from it, so each component sees only its own settings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import DataConfig
from .errors import InputError
from .training import LossConfig

__all__ = ["INTERPOLATION_MODES", "LR_SCHEDULERS", "MIXED_PRECISION", "REPORT_TO", "VALIDATION_SCHEDULERS",
           "FineTuneConfig", "load_yaml_config"]

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
REPORT_TO = ("tensorboard", "csv", "wandb", "all")
VALIDATION_SCHEDULERS = ("DPMSolverMultistepScheduler", "DDPMScheduler")
# torchvision's InterpolationMode names (what diffusers' --image_interpolation_mode takes) that PIL can do
INTERPOLATION_MODES = ("nearest", "nearest_exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


@dataclass(kw_only=True)
class FineTuneConfig:
    """One Stable Diffusion fine-tuning run (full, LoRA or DreamBooth)."""

    pretrained_model_name_or_path: str | None = None
    """A diffusers pipeline folder, a hub id present in the local Hugging Face cache, or a single
    .safetensors/.ckpt file; None for the tiny built-in pipeline."""
    revision: str | None = None
    """Hub revision of a cached model (branch, tag or commit)."""
    variant: str | None = None
    """Weight-file variant to load (`fp16` reads `*.fp16.safetensors`)."""
    cache_dir: str | None = None
    """Hugging Face cache folder for hub ids (models and datasets)."""
    tokenizer_name: str | None = None
    """A tokenizer folder (or cached hub id) to use instead of the pipeline's."""
    tokenizer_max_length: int | None = None
    """Token length of captions (default: the tokenizer's model_max_length)."""
    dataset_name: str | None = None
    """A local dataset folder (imagefolder) or a dataset in the Hugging Face cache (needs `datasets`)."""
    dataset_config_name: str | None = None
    """Configuration of `dataset_name` (needs `datasets`)."""
    max_train_samples: int | None = None
    """Train on this many samples (a seeded random subset)."""
    image_interpolation_mode: str = "bilinear"
    """Resampling filter of the resize: nearest, bilinear, bicubic, box, hamming or lanczos."""
    train_data_dir: str | None = None
    """An imagefolder (metadata.jsonl or .txt captions); None (and no instance data) for the built-in set."""
    image_column: str = "image"
    """metadata.jsonl key of the image path when it is not `file_name`."""
    caption_column: str = "text"
    """metadata.jsonl key of the caption."""
    instance_data_dir: str | None = None
    """DreamBooth: folder of instance images."""
    instance_prompt: str | None = None
    """DreamBooth: the prompt of every instance image."""
    class_data_dir: str | None = None
    """DreamBooth: folder of class images (generated up to num_class_images when short)."""
    class_prompt: str | None = None
    """DreamBooth: the prompt of every class image."""
    with_prior_preservation: bool = False
    """DreamBooth: add the prior-preservation loss on class images."""
    prior_loss_weight: float = 1.0
    """Weight of the prior-preservation loss."""
    num_class_images: int = 100
    """DreamBooth: class images wanted; missing ones are generated before training."""
    resolution: int = 32
    """Training image side in pixels (a multiple of 8)."""
    center_crop: bool = False
    """Centre crop instead of a random crop."""
    random_flip: bool = False
    """Random horizontal flips."""
    skip_bad_images: bool = False
    """Skip unreadable images with a warning and a count instead of stopping."""
    train_batch_size: int = 1
    """Images per device per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    max_train_steps: int | None = None
    """Optimizer steps; overrides num_train_epochs."""
    num_train_epochs: int = 1
    """Passes over the data when max_train_steps is not given."""
    learning_rate: float = 1e-4
    """Peak learning rate."""
    scale_lr: bool = False
    """Multiply the learning rate by accumulation steps x batch size x devices."""
    lr_scheduler: str = "constant"
    """Learning-rate schedule (diffusers.optimization names)."""
    lr_warmup_steps: int = 0
    """Warm-up steps of the schedule."""
    lr_num_cycles: int = 1
    """Hard restarts of cosine_with_restarts."""
    lr_power: float = 1.0
    """Power of the polynomial schedule."""
    use_8bit_adam: bool = False
    """bitsandbytes' 8-bit AdamW (CUDA only)."""
    allow_tf32: bool = False
    """Allow TF32 matmuls and convolutions on Ampere and later GPUs."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_weight_decay: float = 1e-2
    """AdamW weight decay."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    rank: int | None = None
    """LoRA rank; when given, LoRA adapters are trained instead of the whole UNet."""
    train_text_encoder: bool = False
    """Also train the text encoder (its LoRA adapter under --rank)."""
    use_ema: bool = False
    """Keep an EMA of the UNet weights and export it."""
    ema_decay: float = 0.9999
    """EMA decay."""
    foreach_ema: bool = False
    """Update the EMA with torch's foreach (multi-tensor) kernels (same values, fewer kernel launches)."""
    offload_ema: bool = False
    """Keep the EMA weights in CPU memory (updated there; same values)."""
    snr_gamma: float | None = None
    """Min-SNR weighting gamma (None: plain MSE)."""
    noise_offset: float = 0.0
    """Noise offset scale."""
    input_perturbation: float = 0.0
    """Scale of the extra noise added to the model input only (Ning et al. 2023; 0.1 recommended)."""
    dream_training: bool = False
    """DREAM training (Zhou et al. 2023; epsilon prediction only)."""
    dream_detail_preservation: float = 1.0
    """DREAM's detail-preservation exponent."""
    prediction_type: str | None = None
    """epsilon or v_prediction; None keeps the scheduler's."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass."""
    mixed_precision: str = "no"
    """no, fp16 or bf16: autocast for training, frozen models in that dtype."""
    checkpointing_steps: int = 500
    """Write checkpoint-N/ every this many steps."""
    checkpoints_total_limit: int | None = None
    """Keep at most this many checkpoints (oldest removed)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint-N folder, or `latest` (the newest in output_dir)."""
    validation_prompt: str | None = None
    """Prompt of the validation images (none without it)."""
    validation_prompts: list[str] | None = None
    """Several validation prompts (a grid each); with validation_prompt, both are used."""
    validation_epochs: int | None = None
    """Validate every this many epochs instead of every validation_steps."""
    validation_scheduler: str | None = None
    """Scheduler of the validation images: DPMSolverMultistepScheduler or DDPMScheduler (default: the base's)."""
    sample_batch_size: int = 4
    """Images per pipeline call when generating class images."""
    prior_generation_precision: str | None = None
    """dtype of class-image generation: no/fp32, fp16 or bf16 (default: the training dtype)."""
    skip_save_text_encoder: bool = False
    """Export the pipeline without its text encoder."""
    num_validation_images: int = 4
    """Images per validation grid."""
    validation_steps: int = 100
    """Validate every this many steps (and at the end)."""
    num_inference_steps: int = 25
    """Denoising steps for validation and class images."""
    seed: int = 0
    """Seed of data order, augmentation, noise and timesteps."""
    output_dir: str = "sd-model-finetuned"
    """Where the pipeline (or LoRA weights), checkpoints, validation images and logs go."""
    strategy: str = "auto"
    """Lightning strategy name: auto, ddp, zero1, zero2, zero2_offload, gemini, gemini_offload, ..."""
    offload_dir: str | None = None
    """Folder of the NVMe tier (gemini_nvme, gemini_auto); passed to the strategy object, local and on Ray."""
    devices: int = 1
    """Processes (devices) per node."""
    num_nodes: int = 1
    """Nodes."""
    attention_backend: str = "auto"
    """kernels.attention backend: auto, triton or torch."""
    ray_address: str | None = None
    """Ray cluster address (`auto` for a local one); trains with Ray Train when given."""
    num_workers: int | None = None
    """Ray workers (default: devices x num_nodes)."""
    dataloader_num_workers: int = 0
    """Data-loading worker processes."""
    report_to: str = "tensorboard"
    """tensorboard (with CSV), csv, wandb (with CSV; when installed) or all."""
    tracker_project_name: str = "text2image-fine-tune"
    """Project name for wandb."""
    logging_dir: str = "logs"
    """Log folder inside output_dir."""
    log_every_n_steps: int = 10
    """A plain progress line (step, loss, images/s, ETA) every this many steps when stdout is not a terminal."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings for user code; unused here."""

    def __post_init__(self) -> None:
        self._check_ranges()
        self._check_choices()
        self._check_dreambooth()

    def _check_ranges(self) -> None:
        if self.resolution < 8 or self.resolution % 8:
            raise ValueError(f"resolution must be a positive multiple of 8, got {self.resolution}")
        positive = ("train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "checkpointing_steps",
                    "validation_steps", "num_inference_steps", "devices", "num_nodes", "num_validation_images",
                    "lr_num_cycles", "sample_batch_size", "log_every_n_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_train_steps", "rank", "checkpoints_total_limit", "num_workers", "max_train_samples",
                     "validation_epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in ("lr_warmup_steps", "max_grad_norm", "num_class_images", "dataloader_num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tokenizer_max_length is not None and self.tokenizer_max_length < 2:
            raise ValueError(f"tokenizer_max_length must be >= 2, got {self.tokenizer_max_length}")
        if not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"ema_decay must be in [0, 1], got {self.ema_decay}")

    def _check_choices(self) -> None:
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, "
                             f"got {self.mixed_precision!r}")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {self.attention_backend!r}")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"report_to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        if self.image_interpolation_mode not in INTERPOLATION_MODES:
            raise ValueError(f"image_interpolation_mode must be one of {', '.join(INTERPOLATION_MODES)}, "
                             f"got {self.image_interpolation_mode!r}")
        if self.validation_scheduler not in (None, *VALIDATION_SCHEDULERS):
            raise ValueError(f"validation_scheduler must be one of {', '.join(VALIDATION_SCHEDULERS)}, "
                             f"got {self.validation_scheduler!r}")
        if self.prior_generation_precision not in (None, "no", "fp32", "fp16", "bf16"):
            raise ValueError(f"prior_generation_precision must be no, fp32, fp16 or bf16, "
                             f"got {self.prior_generation_precision!r}")
        if isinstance(self.validation_prompts, str):
            self.validation_prompts = [self.validation_prompts]
        if self.dataset_name and (self.train_data_dir or self.instance_data_dir):
            raise ValueError("dataset_name excludes train_data_dir and instance_data_dir")
        if self.prediction_type not in (None, "epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be epsilon or v_prediction, got {self.prediction_type!r}")
        LossConfig(prediction_type=self.prediction_type or "epsilon", snr_gamma=self.snr_gamma,
                   noise_offset=self.noise_offset, prior_loss_weight=self.prior_loss_weight,
                   input_perturbation=self.input_perturbation, dream_training=self.dream_training,
                   dream_detail_preservation=self.dream_detail_preservation)
        if self.use_ema and self.strategy.startswith("gemini"):
            raise ValueError("use_ema is not supported with the gemini strategies (parameters live in shards); "
                             "use zero2 or ddp")

    def _check_dreambooth(self) -> None:
        if self.instance_data_dir and not self.instance_prompt:
            raise ValueError("instance_prompt is required with instance_data_dir")
        if self.instance_data_dir and self.train_data_dir:
            raise ValueError("train_data_dir and instance_data_dir exclude each other")
        if self.with_prior_preservation:
            if not self.instance_data_dir:
                raise ValueError("with_prior_preservation needs instance_data_dir (DreamBooth)")
            if not self.class_data_dir or not self.class_prompt:
                raise ValueError("with_prior_preservation needs class_data_dir and class_prompt")

    # -- derived component configs --------------------------------------------------------------------------
    @property
    def prompts(self) -> list[str]:
        """The validation prompts (validation_prompt first, then validation_prompts)."""
        return [*([self.validation_prompt] if self.validation_prompt else []), *(self.validation_prompts or [])]

    @property
    def lora(self) -> bool:
        """True when LoRA adapters are trained instead of full weights."""
        return self.rank is not None

    def data_config(self) -> DataConfig:
        """The data component's settings."""
        return DataConfig(resolution=self.resolution, center_crop=self.center_crop, random_flip=self.random_flip,
                          image_column=self.image_column, caption_column=self.caption_column,
                          skip_bad_images=self.skip_bad_images, interpolation=self.image_interpolation_mode,
                          max_length=self.tokenizer_max_length or 77)

    def loss_config(self, scheduler_prediction_type: str = "epsilon") -> LossConfig:
        """The loss settings; `prediction_type` falls back to the scheduler's."""
        return LossConfig(prediction_type=self.prediction_type or scheduler_prediction_type,
                          snr_gamma=self.snr_gamma, noise_offset=self.noise_offset,
                          prior_loss_weight=self.prior_loss_weight, input_perturbation=self.input_perturbation,
                          with_prior_preservation=self.with_prior_preservation, dream_training=self.dream_training,
                          dream_detail_preservation=self.dream_detail_preservation)

    def total_steps(self, dataset_len: int, world_size: int) -> int:
        """Optimizer steps of the run: max_train_steps, else epochs x steps per epoch."""
        if self.max_train_steps is not None:
            return self.max_train_steps
        per_epoch = math.ceil(dataset_len / (self.train_batch_size * world_size))
        return self.num_train_epochs * math.ceil(per_epoch / self.gradient_accumulation_steps)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names a recipe YAML may set."""
        return [f.name for f in dataclasses.fields(cls)]


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The flat mapping in a recipe YAML, with unknown keys reported as `InputError`."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(f"{path}: cannot read the config ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of setting names, got {type(data).__name__}")
    known = set(FineTuneConfig.field_names())
    for key in data:
        if key not in known:
            raise InputError(f"{path}: unknown setting '{key}'")
    return data
