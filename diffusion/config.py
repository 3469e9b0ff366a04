"""`FineTuneConfig`: every setting of one fine-tuning run, composed of sections, each setting named as diffusers'
training scripts name its flag.

The sections are the owners' dataclasses where one exists (`data`: `DataConfig`, `loss`: `LossConfig`) and small
sections here for the rest (model, dataset, optimizer, train, ema, validation, output, launch, ray). Every leaf
field is one setting with a flat name (`utils.settings`): `suite diffusion finetune`'s flags are generated
from them, and a recipe YAML (`recipes/configs/diffusion_*.yaml`) sets them as flat keys (`learning_rate: 1e-4`)
or nested by section (`optimizer: {learning_rate: 1e-4}`); flags given on the command line override the file.

`FineTuneConfig(learning_rate=1e-4, rank=4)` takes the flat names too, and `cfg.learning_rate` reads one
(read-only; `dataclasses.replace(cfg, output_dir=...)` makes a changed copy). One reads more than its setting:
`cfg.parallel` is the run's sharding config, built and validated once with the config (the `parallel` setting as
given, or the `core_parallel.ZeroConfig` / `GeminiConfig` that `--strategy` and `--offload_dir` name).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core_parallel.gemini.config import GeminiConfig
from ..core_parallel.loss_scaler import LossScalerConfig
from ..core_parallel.presets import config_for_strategy
from ..core_parallel.zero.config import ZeroConfig
from ..kernels.backend import BACKENDS as KERNEL_BACKENDS
from ..utils.settings import assemble, read_yaml, section, settings
from .data import DataConfig
from .training import LossConfig

__all__ = ["INTERPOLATION_MODES", "LR_SCHEDULERS", "MIXED_PRECISION", "PARALLEL_KINDS", "REPORT_TO",
           "VALIDATION_SCHEDULERS", "parallel_from_mapping",
           "DatasetSection", "EmaSection", "FineTuneConfig", "LaunchSection", "ModelSection", "OptimizerSection",
           "OutputSection", "RaySection", "TrainSection", "ValidationSection", "load_yaml_config"]

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
REPORT_TO = ("tensorboard", "csv", "wandb", "all")
VALIDATION_SCHEDULERS = ("DPMSolverMultistepScheduler", "DDPMScheduler")
# torchvision's InterpolationMode names (what diffusers' --image_interpolation_mode takes) that PIL can do
INTERPOLATION_MODES = ("nearest", "nearest_exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


def _at_least(obj: Any, bound: int | float, names: tuple[str, ...], optional: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if (value is not None or not optional) and value < bound:
            raise ValueError(f"{name} must be >= {bound}, got {value}")


def _one_of(name: str, value: Any, choices: Any, optional: bool = False) -> None:
    if (value is not None or not optional) and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(kw_only=True)
class ModelSection:
    """The pipeline to fine-tune, what is trained and how it runs."""

    pretrained_model_name_or_path: str | None = None
    """A diffusers pipeline folder, a hub id present in the local Hugging Face cache, or a single
    .safetensors/.ckpt file; None for the tiny built-in pipeline."""
    revision: str | None = None
    """Hub revision of a cached model (branch, tag or commit)."""
    non_ema_revision: str | None = None
    """Hub revision holding the non-EMA UNet weights: the trained UNet starts from it, the EMA from --revision
    (default: --revision)."""
    variant: str | None = None
    """Weight-file variant to load (`fp16` reads `*.fp16.safetensors`)."""
    cache_dir: str | None = None
    """Hugging Face cache folder for hub ids (models and datasets)."""
    tokenizer_name: str | None = None
    """A tokenizer folder (or cached hub id) to use instead of the pipeline's."""
    tokenizer_max_length: int | None = None
    """Token length of captions (default: the tokenizer's model_max_length)."""
    text_encoder_use_attention_mask: bool = False
    """Give the text encoder the tokenizer's attention mask (padding masked) in training."""
    rank: int | None = None
    """LoRA rank; when given, LoRA adapters are trained instead of the whole UNet."""
    train_text_encoder: bool = False
    """Also train the text encoder (its LoRA adapter under --rank)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass."""
    attention_backend: str = "auto"
    """kernels.attention backend: auto, triton or torch."""

    def __post_init__(self) -> None:
        _at_least(self, 1, ("rank",), optional=True)
        if self.tokenizer_max_length is not None and self.tokenizer_max_length < 2:
            raise ValueError(f"tokenizer_max_length must be >= 2, got {self.tokenizer_max_length}")
        _one_of("attention_backend", self.attention_backend, KERNEL_BACKENDS)


@dataclass(kw_only=True)
class DatasetSection:
    """Where the training images come from (an imagefolder, a dataset, DreamBooth's instance and class images)."""

    dataset_name: str | None = None
    """A local dataset folder (imagefolder) or a dataset in the Hugging Face cache (needs `datasets`)."""
    dataset_config_name: str | None = None
    """Configuration of `dataset_name` (needs `datasets`)."""
    max_train_samples: int | None = None
    """Train on this many samples (a seeded random subset)."""
    train_data_dir: str | None = None
    """An imagefolder (metadata.jsonl or .txt captions); None (and no instance data) for the built-in set."""
    instance_data_dir: str | None = None
    """DreamBooth: folder of instance images."""
    instance_prompt: str | None = None
    """DreamBooth: the prompt of every instance image."""
    class_data_dir: str | None = None
    """DreamBooth: folder of class images (generated up to num_class_images when short)."""
    class_prompt: str | None = None
    """DreamBooth: the prompt of every class image."""
    num_class_images: int = 100
    """DreamBooth: class images wanted; missing ones are generated before training."""
    sample_batch_size: int = 4
    """Images per pipeline call when generating class images."""
    prior_generation_precision: str | None = None
    """dtype of class-image generation: no/fp32, fp16 or bf16 (default: the training dtype)."""
    dataloader_num_workers: int = 0
    """Data-loading worker processes."""

    def __post_init__(self) -> None:
        # sample_batch_size and num_class_images matter only under prior preservation (FineTuneConfig checks them)
        _at_least(self, 1, ("max_train_samples",), optional=True)
        _at_least(self, 0, ("dataloader_num_workers",))
        if self.prior_generation_precision not in (None, "no", "fp32", "fp16", "bf16"):
            raise ValueError(f"prior_generation_precision must be no, fp32, fp16 or bf16, "
                             f"got {self.prior_generation_precision!r}")
        if self.dataset_name and (self.train_data_dir or self.instance_data_dir):
            raise ValueError("dataset_name excludes train_data_dir and instance_data_dir")
        if self.instance_data_dir and self.instance_prompt is None:
            raise ValueError("instance_prompt is required with instance_data_dir")
        if self.instance_data_dir and self.train_data_dir:
            raise ValueError("train_data_dir and instance_data_dir exclude each other")


@dataclass(kw_only=True)
class OptimizerSection:
    """AdamW and the learning-rate schedule."""

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

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0 (0 would train nothing), got {self.learning_rate}")
        # lr_num_cycles and lr_warmup_steps go to diffusers' get_scheduler as given (any integer, as the scripts)
        _at_least(self, 0, ("max_grad_norm", "adam_epsilon", "adam_weight_decay"))
        for name in ("adam_beta1", "adam_beta2"):  # what torch's AdamW accepts
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        _one_of("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)


@dataclass(kw_only=True)
class TrainSection:
    """Batches, length, precision and seed of the training loop."""

    train_batch_size: int = 1
    """Images per device per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    max_train_steps: int | None = None
    """Optimizer steps; overrides num_train_epochs."""
    num_train_epochs: int = 1
    """Passes over the data when max_train_steps is not given."""
    mixed_precision: str = "no"
    """no, fp16 or bf16: autocast for training, frozen models in that dtype."""
    allow_tf32: bool = False
    """Allow TF32 matmuls and convolutions on Ampere and later GPUs."""
    seed: int = 0
    """Seed of data order, augmentation, noise and timesteps."""

    def __post_init__(self) -> None:
        _at_least(self, 1, ("train_batch_size", "gradient_accumulation_steps"))
        if self.max_train_steps is not None and self.max_train_steps < 1:
            raise ValueError(f"max_train_steps must be >= 1 (the run would train no step), got {self.max_train_steps}")
        if self.max_train_steps is None and self.num_train_epochs < 1:  # with max_train_steps it is not used
            raise ValueError(f"num_train_epochs must be >= 1 without max_train_steps (the run would train no step), "
                             f"got {self.num_train_epochs}")
        if self.seed < 0:  # numpy's seed, which the scripts' set_seed sets too, must be >= 0
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        _one_of("mixed_precision", self.mixed_precision, MIXED_PRECISION)


@dataclass(kw_only=True)
class EmaSection:
    """The exponential moving average of the UNet weights."""

    use_ema: bool = False
    """Keep an EMA of the UNet weights and export it."""
    ema_decay: float = 0.9999
    """EMA decay."""
    foreach_ema: bool = False
    """Update the EMA with torch's foreach (multi-tensor) kernels (same values, fewer kernel launches)."""
    offload_ema: bool = False
    """Keep the EMA weights in CPU memory (updated there; same values)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"ema_decay must be in [0, 1], got {self.ema_decay}")


@dataclass(kw_only=True)
class ValidationSection:
    """The validation images (and the denoising steps of class images)."""

    validation_prompt: str | None = None
    """Prompt of the validation images (none without it)."""
    validation_prompts: list[str] | None = None
    """Several validation prompts (a grid each); with validation_prompt, both are used."""
    validation_epochs: int | None = None
    """Validate every this many epochs instead of every validation_steps."""
    validation_scheduler: str | None = None
    """Scheduler of the validation images: DPMSolverMultistepScheduler or DDPMScheduler (default: the base's)."""
    num_validation_images: int = 4
    """Images per validation grid (0: none are generated)."""
    validation_steps: int = 100
    """Validate every this many steps (and at the end)."""
    num_inference_steps: int = 25
    """Denoising steps for validation and class images."""

    def __post_init__(self) -> None:
        _at_least(self, 0, ("num_validation_images",))  # 0: no validation images (the scripts' meaning)
        _at_least(self, 1, ("validation_steps", "num_inference_steps"))
        _at_least(self, 1, ("validation_epochs",), optional=True)
        _one_of("validation_scheduler", self.validation_scheduler, VALIDATION_SCHEDULERS, optional=True)
        if isinstance(self.validation_prompts, str):
            self.validation_prompts = [self.validation_prompts]


@dataclass(kw_only=True)
class OutputSection:
    """What the run writes where: the result, checkpoints and logs."""

    output_dir: str = "sd-model-finetuned"
    """Where the pipeline (or LoRA weights), checkpoints, validation images and logs go."""
    skip_save_text_encoder: bool = False
    """Export the pipeline without its text encoder."""
    checkpointing_steps: int = 500
    """Write checkpoint-N/ every this many steps."""
    checkpoints_total_limit: int | None = None
    """Keep at most this many checkpoints: before each save the oldest are removed so that limit - 1 remain (as
    diffusers' scripts do; a limit <= 1 keeps only the newest)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint-N folder, or `latest` (the newest in output_dir)."""
    report_to: str = "tensorboard"
    """tensorboard (with CSV), csv, wandb (with CSV; when installed) or all."""
    tracker_project_name: str = "text2image-fine-tune"
    """Project name for wandb."""
    logging_dir: str = "logs"
    """Log folder inside output_dir."""
    log_every_n_steps: int = 10
    """A plain progress line (step, loss, images/s, ETA) every this many steps when stdout is not a terminal."""

    def __post_init__(self) -> None:
        _at_least(self, 1, ("checkpointing_steps", "log_every_n_steps"))
        _one_of("report_to", self.report_to, REPORT_TO)


PARALLEL_KINDS = {"zero": ZeroConfig, "gemini": GeminiConfig}
"""The keys of the `parallel` setting's YAML form: `parallel: {gemini: {offload_tier: nvme, offload_dir: /x}}`."""


def parallel_from_mapping(value: Any) -> ZeroConfig | GeminiConfig | None:
    """A `parallel` setting as written in YAML (one key, `zero` or `gemini`, holding the config's fields; null
    for no sharding) as the config object; a config object is returned as is. `ValueError` naming `parallel`
    for any other form or a field the config refuses."""
    if value is None or isinstance(value, (ZeroConfig, GeminiConfig)):
        return value
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in PARALLEL_KINDS:
        raise ValueError(f"parallel must be null or a mapping with one key, zero or gemini (e.g. "
                         f"{{gemini: {{offload_tier: nvme, offload_dir: /x}}}}), got {value!r}")
    (kind, fields), = value.items()
    fields = dict(fields or {})
    if not all(isinstance(k, str) for k in fields):
        raise ValueError(f"parallel: {kind}: expected a mapping of field names, got {fields!r}")
    if isinstance(fields.get("loss_scaler"), dict):
        try:
            fields["loss_scaler"] = LossScalerConfig(**fields["loss_scaler"])
        except TypeError as exc:
            raise ValueError(f"parallel: {kind}.loss_scaler: {exc}") from None
    if "precision" in fields:
        raise ValueError(f"parallel: {kind}.precision: the precision is --mixed_precision's; leave it out")
    try:
        return PARALLEL_KINDS[kind](**fields)
    except TypeError as exc:
        known = ", ".join(f.name for f in dataclasses.fields(PARALLEL_KINDS[kind]) if f.name != "precision")
        raise ValueError(f"parallel: {kind}: {str(exc).split('() ', 1)[-1]} (fields: {known})") from None
    except ValueError as exc:  # the config's own refusal (an InputError)
        raise ValueError(f"parallel: {kind}: {exc}") from None


@dataclass(kw_only=True)
class LaunchSection:
    """Processes, nodes and the Lightning strategy (what `accelerate launch` and its config set for diffusers)."""

    strategy: str = "auto"
    """Lightning strategy name: auto, ddp, zero1, zero2, zero2_offload, gemini, gemini_offload, gemini_nvme,
    gemini_auto (each names a `parallel` config), or another strategy Lightning registers."""
    offload_dir: str | None = None
    """Folder of the NVMe tier (gemini_nvme, gemini_auto); it becomes the `parallel` config's offload_dir."""
    memory_budget: str | None = None
    """gemini_auto: memory the whole run may hold at once (e.g. 6GiB; RAM on CPU, device memory on a GPU). What
    fits stays resident, the rest streams from the NVMe tier (--offload_dir, or a temporary folder)."""
    parallel: ZeroConfig | GeminiConfig | None = None
    """The sharding config itself, instead of --strategy (config files and code): `{zero: {stage: 2, ...}}`
    (core_parallel.ZeroConfig's fields) or `{gemini: {placement: auto, offload_tier: nvme, offload_dir: /x,
    ...}}` (GeminiConfig's); null: from --strategy and --offload_dir."""
    devices: int = 1
    """Processes (devices) per node."""
    num_nodes: int = 1
    """Nodes."""
    sharding: ZeroConfig | GeminiConfig | None = field(default=None, init=False, repr=False, compare=False)
    """Not a setting: the run's sharding config (`FineTuneConfig.parallel`), `build_sharding`'s."""

    def __post_init__(self) -> None:
        _at_least(self, 1, ("devices", "num_nodes"))
        self.parallel = parallel_from_mapping(self.parallel)
        if self.parallel is not None:
            if self.strategy != "auto":
                raise ValueError(f"strategy {self.strategy!r} and parallel both name the strategy; give one "
                                 "(an explicit --strategy replaces a config file's parallel)")
            if self.offload_dir is not None:
                raise ValueError("offload_dir goes inside parallel (gemini: {offload_tier: nvme, offload_dir: ...})")
            if self.memory_budget is not None:
                raise ValueError("memory_budget goes inside parallel (gemini: {placement: auto, memory_budget: ...})")
        elif self.memory_budget is not None and self.strategy != "gemini_auto":
            raise ValueError(f"memory_budget {self.memory_budget}: only --strategy gemini_auto places the model by a "
                             f"budget, not {self.strategy}")
            if self.parallel.precision != "fp32":
                raise ValueError("parallel: precision is --mixed_precision's; leave the config's at fp32")

    def build_sharding(self) -> ZeroConfig | GeminiConfig | None:
        """The run's sharding config, built once: `parallel` as given, else the config `strategy` and `offload_dir`
        name (`core_parallel.config_for_strategy`: a folder for a strategy without an NVMe tier is refused, the
        config validates itself, gemini_nvme without a folder gets a temporary one); None for strategies that shard
        nothing here (auto, ddp, Lightning's own). Kept in `sharding`: a copy of the section (`dataclasses.replace`)
        builds its own."""
        if self.sharding is None:
            given = self.parallel
            self.sharding = given if given is not None else config_for_strategy(
                self.strategy, offload_dir=self.offload_dir, memory_budget=self.memory_budget)
        return self.sharding


@dataclass(kw_only=True)
class RaySection:
    """Training on a Ray cluster (Ray Train workers)."""

    ray_address: str | None = None
    """Ray cluster address (`auto` for a local one); trains with Ray Train when given."""
    num_workers: int | None = None
    """Ray workers (default: devices x num_nodes)."""

    def __post_init__(self) -> None:
        _at_least(self, 1, ("num_workers",), optional=True)


@dataclass(kw_only=True, init=False)
class FineTuneConfig:
    """One Stable Diffusion fine-tuning run (full, LoRA or DreamBooth), composed of sections.

    Takes sections (`FineTuneConfig(optimizer=OptimizerSection(...))`) and/or flat settings
    (`FineTuneConfig(learning_rate=1e-4)`); a flat setting overrides the section given beside it. Every flat
    setting is also a read-only attribute (`cfg.learning_rate` is `cfg.optimizer.learning_rate`).
    """

    model: ModelSection = section(ModelSection)
    """The pipeline, what is trained and the attention backend."""
    dataset: DatasetSection = section(DatasetSection)
    """Where the training images come from."""
    data: DataConfig = section(DataConfig, rename={"interpolation": "image_interpolation_mode"},
                               hide=("max_length", "attention_mask", "default_caption"))
    """How images become training tensors (`data_config()` adds the caption length from tokenizer_max_length and
    the attention mask from text_encoder_use_attention_mask)."""
    loss: LossConfig = section(LossConfig, default=functools.partial(LossConfig, prediction_type=None),
                               hide=("edm_style",))
    """The loss (`loss_config()` fills a prediction_type of None with the scheduler's)."""
    optimizer: OptimizerSection = section(OptimizerSection)
    """AdamW and the learning-rate schedule."""
    train: TrainSection = section(TrainSection)
    """Batches, length, precision and seed."""
    ema: EmaSection = section(EmaSection)
    """The EMA of the UNet."""
    validation: ValidationSection = section(ValidationSection)
    """Validation images."""
    output: OutputSection = section(OutputSection)
    """Result, checkpoints and logs."""
    launch: LaunchSection = section(LaunchSection)
    """Processes, nodes and strategy."""
    ray: RaySection = section(RaySection)
    """Ray Train."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings for user code; unused here."""

    def __init__(self, **values: Any) -> None:
        given = assemble(type(self), values)
        for f in dataclasses.fields(self):
            setattr(self, f.name, given[f.name] if f.name in given else f.default_factory())
        self.__post_init__()

    def __post_init__(self) -> None:
        # the checks that need two sections; each section checks its own fields
        if self.use_ema and (self.strategy.startswith("gemini") or isinstance(self.launch.parallel, GeminiConfig)):
            raise ValueError("use_ema is not supported with the gemini strategies (parameters live in shards); "
                             "use zero2 or ddp")
        if self.caption_column is None and not (self.instance_data_dir or self.dataset_name
                                                and self.instance_prompt is not None):
            raise ValueError("caption_column None (every image with the instance prompt) needs dataset_name and "
                             "instance_prompt")
        if self.with_prior_preservation:
            if not (self.instance_data_dir or self.dataset_name and self.instance_prompt is not None):
                raise ValueError("with_prior_preservation needs instance_data_dir, or dataset_name with "
                                 "instance_prompt (DreamBooth)")
            if self.class_data_dir is None or self.class_prompt is None:
                raise ValueError("with_prior_preservation needs class_data_dir and class_prompt")
            if self.num_class_images < 1:  # diffusers' DreamBooth data set indexes class images modulo this
                raise ValueError(f"num_class_images must be >= 1 with with_prior_preservation, got "
                                 f"{self.num_class_images}")
        # last, once every other setting is accepted: a refused one leaves no temporary NVMe folder behind
        self.launch.build_sharding()

    @property
    def parallel(self) -> ZeroConfig | GeminiConfig | None:
        """The run's sharding config, validated once: the `parallel` setting as given (`launch.parallel`), else the
        `ZeroConfig` / `GeminiConfig` that `strategy` and `offload_dir` name; None when nothing is sharded here."""
        return self.launch.sharding

    # -- derived component configs --------------------------------------------------------------------------
    @property
    def prompts(self) -> list[str]:
        """The validation prompts (validation_prompt first, then validation_prompts)."""
        return [*([self.validation_prompt] if self.validation_prompt is not None else []),
                *(self.validation_prompts or [])]

    @property
    def lora(self) -> bool:
        """True when LoRA adapters are trained instead of full weights."""
        return self.rank is not None

    @property
    def dreambooth(self) -> bool:
        """True for DreamBooth: instance images with `instance_prompt`, or a dataset with it (custom captions)."""
        return bool(self.instance_data_dir) or bool(self.dataset_name and self.instance_prompt is not None)

    def data_config(self) -> DataConfig:
        """The data component's settings (captions padded to tokenizer_max_length, else 77; their attention masks
        with text_encoder_use_attention_mask; DreamBooth from a dataset, dataset_name with instance_prompt: the
        instance prompt for images without a caption, as train_dreambooth_lora_sdxl.py)."""
        return dataclasses.replace(self.data, max_length=self.tokenizer_max_length or 77,
                                   attention_mask=self.text_encoder_use_attention_mask,
                                   default_caption=self.instance_prompt if self.dataset_name else None)

    def loss_config(self, scheduler_prediction_type: str = "epsilon") -> LossConfig:
        """The loss settings; `prediction_type` falls back to the scheduler's; EDM-style training from the SDXL
        settings (`extra["sdxl"].do_edm_style_training`)."""
        edm = bool(getattr(self.extra.get("sdxl"), "do_edm_style_training", False))
        return dataclasses.replace(self.loss, prediction_type=self.prediction_type or scheduler_prediction_type,
                                   edm_style=edm)

    def total_steps(self, dataset_len: int, world_size: int) -> int:
        """Optimizer steps of the run: max_train_steps, else epochs x steps per epoch."""
        if self.max_train_steps is not None:
            return self.max_train_steps
        per_epoch = math.ceil(dataset_len / (self.train_batch_size * world_size))
        return self.num_train_epochs * math.ceil(per_epoch / self.gradient_accumulation_steps)

    @classmethod
    def field_names(cls) -> list[str]:
        """The flat setting names (flags, and keys a recipe YAML may set)."""
        return list(settings(cls))


def _flat_property(path: tuple[str, ...], doc: str) -> property:
    def get(self: FineTuneConfig) -> Any:
        value = self
        for name in path:
            value = getattr(value, name)
        return value

    return property(get, doc=doc)


for _s in settings(FineTuneConfig).values():
    if len(_s.path) > 1 and _s.name not in vars(FineTuneConfig):  # `parallel` is the run's config, defined above
        setattr(FineTuneConfig, _s.name, _flat_property(_s.path, _s.help))
del _s


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The settings in a recipe YAML as flat name -> value (flat keys, or nested by section); an unknown key or a
    value of the wrong type is one `InputError` naming the key and the file."""
    return read_yaml(path, FineTuneConfig)
