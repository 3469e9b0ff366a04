"""Every flag value diffusers' scripts accept is accepted with their meaning (issue 32): the flags of the three
scripts (tests/assets/diffusers_flags/, v0.40.0) checked value by value (0, negative, empty; None is each flag's
default, tests/diffusion/test_scripts.py), against what the scripts do with the value (read from their code)."""

from __future__ import annotations

import pytest

from lowmem.diffusion.errors import InputError
from lowmem.diffusion.scripts import HANDLING, SCRIPT_FLAGS, Refuse, script_config

SAME, FAILS, NOTHING, REVERSED = "same", "fails", "trains nothing", "reverses gradients"
# (flag, value) -> (what the scripts do, the settings it gives here (None: refused in one line), extra flags).
# SAME: the scripts run with it; here too, with the settings shown. FAILS: the scripts stop with a traceback (the
# reason given); here one line, exit 2. NOTHING / REVERSED: the scripts run, training nothing or climbing the loss;
# here one line, exit 2 ("a run that would train nothing says so").
TABLE: dict[tuple[str, object], tuple[str, str, dict | None, dict]] = {
    ("adam_beta1", 0.0): (SAME, "AdamW accepts 0", {"adam_beta1": 0.0}, {}),
    ("adam_beta1", -1.0): (FAILS, "AdamW: Invalid beta parameter", None, {}),
    ("adam_beta2", 0.0): (SAME, "AdamW accepts 0", {"adam_beta2": 0.0}, {}),
    ("adam_beta2", -1.0): (FAILS, "AdamW: Invalid beta parameter", None, {}),
    ("adam_epsilon", 0.0): (SAME, "AdamW accepts 0", {"adam_epsilon": 0.0}, {}),
    ("adam_epsilon", -1.0): (FAILS, "AdamW: Invalid epsilon value", None, {}),
    ("adam_weight_decay", 0.0): (SAME, "no decay", {"adam_weight_decay": 0.0}, {}),
    ("adam_weight_decay", -1.0): (FAILS, "AdamW: Invalid weight_decay value", None, {}),
    ("cache_dir", ""): (SAME, "unused for a local folder", {"cache_dir": ""}, {}),
    ("caption_column", ""): (FAILS, "ValueError: not a column of the data set", None, {}),
    ("checkpointing_steps", 0): (FAILS, "global_step % 0: ZeroDivisionError", None, {}),
    ("checkpointing_steps", -1): (SAME, "step % -1 == 0: every step", {"checkpointing_steps": 1}, {}),
    ("checkpoints_total_limit", 0): (SAME, "all removed before each save: the newest stays",
                                     {"checkpoints_total_limit": 0}, {}),
    ("checkpoints_total_limit", -1): (SAME, "all removed before each save: the newest stays",
                                      {"checkpoints_total_limit": -1}, {}),
    ("class_data_dir", ""): (SAME, "unused without --with_prior_preservation", {"class_data_dir": ""}, {}),
    ("class_prompt", ""): (SAME, "unused without --with_prior_preservation", {"class_prompt": ""}, {}),
    ("dataloader_num_workers", 0): (SAME, "loads in the main process", {"dataloader_num_workers": 0}, {}),
    ("dataloader_num_workers", -1): (FAILS, "DataLoader: num_workers must be >= 0", None, {}),
    ("dataset_config_name", ""): (SAME, "unused without --dataset_name", {"dataset_config_name": ""}, {}),
    ("dataset_name", ""): (FAILS, "load_dataset('') fails", None, {}),
    ("dream_detail_preservation", 0.0): (SAME, "sqrt(1 - alpha_bar) ** 0", {"dream_detail_preservation": 0.0}, {}),
    ("dream_detail_preservation", -1.0): (SAME, "sqrt(1 - alpha_bar) ** -1",
                                          {"dream_detail_preservation": -1.0}, {}),
    ("gradient_accumulation_steps", 0): (FAILS, "ceil(len / 0): ZeroDivisionError", None, {}),
    ("gradient_accumulation_steps", -1): (NOTHING, "negative steps per epoch: no epoch runs", None, {}),
    ("image_column", ""): (FAILS, "ValueError: not a column of the data set", None, {}),
    ("image_interpolation_mode", ""): (FAILS, "not a torchvision InterpolationMode", None, {}),
    ("input_perturbation", 0.0): (SAME, "off", {"input_perturbation": 0.0}, {}),
    ("input_perturbation", -1.0): (SAME, "noise + p * randn, as given", {"input_perturbation": -1.0}, {}),
    ("instance_data_dir", ""): (SAME, "Path(''): the current folder", {"instance_data_dir": "."}, {}),
    ("instance_prompt", ""): (SAME, "the empty prompt", {"instance_prompt": ""}, {}),
    ("learning_rate", 0.0): (NOTHING, "AdamW with lr 0 leaves the weights as they are", None, {}),
    ("learning_rate", -1.0): (FAILS, "AdamW: Invalid learning rate", None, {}),
    ("logging_dir", ""): (SAME, "logs in --output_dir itself", {"logging_dir": ""}, {}),
    ("lr_num_cycles", 0): (SAME, "get_scheduler(num_cycles=0)", {"lr_num_cycles": 0}, {}),
    ("lr_num_cycles", -1): (SAME, "get_scheduler(num_cycles=-1)", {"lr_num_cycles": -1}, {}),
    ("lr_power", 0.0): (SAME, "get_scheduler(power=0)", {"lr_power": 0.0}, {}),
    ("lr_power", -1.0): (SAME, "get_scheduler(power=-1)", {"lr_power": -1.0}, {}),
    ("lr_scheduler", ""): (FAILS, "SchedulerType(''): ValueError", None, {}),
    ("lr_warmup_steps", 0): (SAME, "no warm-up", {"lr_warmup_steps": 0}, {}),
    ("lr_warmup_steps", -1): (SAME, "get_scheduler(num_warmup_steps=-1)", {"lr_warmup_steps": -1}, {}),
    ("max_grad_norm", 0.0): (NOTHING, "every gradient clipped to norm 0: only weight decay moves", None, {}),
    ("max_grad_norm", -1.0): (REVERSED, "a negative clip coefficient flips every gradient", None, {}),
    ("max_train_samples", 0): (FAILS, "an empty data set: ceil(max / 0)", None, {}),
    ("max_train_samples", -1): (FAILS, "select(range(-1)) is empty: ceil(max / 0)", None, {}),
    ("max_train_steps", 0): (NOTHING, "num_train_epochs = ceil(0 / n) = 0", None, {}),
    ("max_train_steps", -1): (NOTHING, "num_train_epochs = ceil(-1 / n) = 0", None, {}),
    ("noise_offset", 0.0): (SAME, "off", {"noise_offset": 0.0}, {}),
    ("noise_offset", -1.0): (SAME, "noise += offset * randn, as given", {"noise_offset": -1.0}, {}),
    ("non_ema_revision", ""): (SAME, "a revision string for hub ids; unused for a folder", {"non_ema_revision": ""},
                               {}),
    ("num_class_images", 0): (SAME, "unused without --with_prior_preservation", {"num_class_images": 0}, {}),
    ("num_class_images", -1): (SAME, "unused without --with_prior_preservation", {"num_class_images": -1}, {}),
    ("num_train_epochs", 0): (NOTHING, "max_train_steps = 0 x n", None, {}),
    ("num_train_epochs", -1): (NOTHING, "max_train_steps = -1 x n", None, {}),
    ("num_validation_images", 0): (SAME, "range(0): no validation image", {"num_validation_images": 0}, {}),
    ("num_validation_images", -1): (SAME, "range(-1): no validation image", {"num_validation_images": 0}, {}),
    ("output_dir", ""): (FAILS, "os.makedirs(''): FileNotFoundError", None, {}),
    ("prediction_type", ""): (FAILS, "ValueError: Unknown prediction type", None, {}),
    ("pretrained_model_name_or_path", ""): (FAILS, "from_pretrained('') fails", None, {}),
    ("prior_loss_weight", 0.0): (SAME, "the class loss weighted 0", {"prior_loss_weight": 0.0}, {}),
    ("prior_loss_weight", -1.0): (SAME, "loss + w * prior_loss, as given", {"prior_loss_weight": -1.0}, {}),
    ("rank", 0): (FAILS, "peft LoraConfig: r must be positive", None, {}),
    ("rank", -1): (FAILS, "peft LoraConfig: r must be positive", None, {}),
    ("report_to", ""): (FAILS, "accelerate: Unsupported logging capability", None, {}),
    ("resolution", 0): (FAILS, "transforms.Resize(0) fails", None, {}),
    ("resolution", -1): (FAILS, "transforms.Resize(-1) fails", None, {}),
    ("resume_from_checkpoint", ""): (SAME, "falsy: a new run", {"resume_from_checkpoint": ""}, {}),
    ("revision", ""): (SAME, "a revision string for hub ids; unused for a folder", {"revision": ""}, {}),
    ("sample_batch_size", 0): (SAME, "unused unless class images are generated", {"sample_batch_size": 0}, {}),
    ("sample_batch_size", -1): (SAME, "unused unless class images are generated", {"sample_batch_size": -1}, {}),
    ("seed", 0): (SAME, "seed 0", {"seed": 0}, {}),
    ("seed", -1): (FAILS, "numpy: Seed must be between 0 and 2**32 - 1", None, {}),
    ("snr_gamma", 0.0): (NOTHING, "min(snr, 0) / snr: every loss weight 0", None, {}),
    ("snr_gamma", -1.0): (REVERSED, "negative loss weights", None, {}),
    ("tokenizer_max_length", 0): (FAILS, "captions of no token: the text encoder fails", None, {}),
    ("tokenizer_max_length", -1): (FAILS, "captions of no token: the text encoder fails", None, {}),
    ("tokenizer_name", ""): (SAME, "falsy: the pipeline's tokenizer", {"tokenizer_name": ""}, {}),
    ("tracker_project_name", ""): (SAME, "a tracker name", {"tracker_project_name": ""}, {}),
    ("train_batch_size", 0): (FAILS, "DataLoader: batch_size must be positive", None, {}),
    ("train_batch_size", -1): (FAILS, "DataLoader: batch_size must be positive", None, {}),
    ("train_data_dir", ""): (SAME, "os.path.join('', '**'): the current folder", {"train_data_dir": "."}, {}),
    ("validation_epochs", 0): (SAME, "unused without a validation prompt", {}, {}),
    ("validation_epochs", -1): (SAME, "epoch % -1 == 0: every epoch", {"validation_epochs": 1}, {}),
    ("validation_prompt", ""): (SAME, "images of the empty prompt", {"prompts": [""]}, {}),
    ("validation_prompts", ("",)): (SAME, "images of the empty prompt", {"prompts": [""]}, {}),
    ("validation_steps", 0): (SAME, "unused without a validation prompt", {}, {}),
    ("validation_steps", -1): (SAME, "global_step % -1 == 0: every step", {"validation_steps": 1}, {}),
    ("variant", ""): (FAILS, "no weights file of variant ''", None, {}),
    # values that depend on another flag
    ("num_train_epochs+max_train_steps", 0): (SAME, "recomputed from --max_train_steps", {"max_train_steps": 5},
                                               {"max_train_steps": 5}),
    ("validation_epochs+prompt", 0): (FAILS, "epoch % 0: ZeroDivisionError", None, {"validation_prompt": "a dog"}),
    ("validation_steps+prompt", 0): (FAILS, "global_step % 0: ZeroDivisionError", None,
                                     {"validation_prompt": "a dog"}),
    ("num_class_images+prior", 0): (FAILS, "index % 0: ZeroDivisionError", None,
                                    {"with_prior_preservation": True, "class_data_dir": "cls", "class_prompt": "dog"}),
}


def _required(script: str) -> dict:
    base = {"pretrained_model_name_or_path": "base"}
    if script == "train_dreambooth":
        return {**base, "instance_data_dir": "inst", "instance_prompt": "a sks dog"}
    return {**base, "train_data_dir": "data"}


def _probes(flag) -> list:
    if flag.action or flag.choices or isinstance(HANDLING[flag.name], Refuse):
        return []
    if flag.nargs == "+":
        return [("",)]  # one empty prompt (argparse gives a list; a tuple here, to key the table)
    return {int: [0, -1], float: [0.0, -1.0], str: [""]}.get(flag.type, [])


def test_the_table_covers_every_value_of_every_flag():
    wanted = {(f.name, repr(v)) for flags in SCRIPT_FLAGS.values() for f in flags for v in _probes(f)}
    have = {(flag, repr(value)) for flag, value in TABLE}
    assert not wanted - have, f"values of the scripts' flags not in the table: {sorted(wanted - have)}"


@pytest.mark.parametrize("script", list(SCRIPT_FLAGS))
def test_each_value_as_the_scripts_take_it(script):
    defaults = {f.name: f.default for f in SCRIPT_FLAGS[script]}
    problems = []
    for (key, value), (verdict, why, settings, extra) in TABLE.items():
        flag = key.split("+")[0]
        if flag not in defaults:
            continue
        values = {**defaults, **_required(script), **extra, flag: list(value) if isinstance(value, tuple) else value}
        try:
            cfg = script_config(script, values)
        except InputError as exc:
            line = str(exc)
            if settings is not None:
                problems.append(f"--{flag}={value!r} ({why}): refused here: {line}")
            elif "\n" in line or f"--{flag}" not in line:
                problems.append(f"--{flag}={value!r}: the refusal does not name the flag in one line: {line}")
            continue
        if settings is None:
            problems.append(f"--{flag}={value!r}: accepted here, but the scripts: {verdict} ({why})")
            continue
        for name, want in settings.items():
            if getattr(cfg, name) != want:
                problems.append(f"--{flag}={value!r} ({why}): {name} = {getattr(cfg, name)!r}, expected {want!r}")
    assert not problems, "\n".join(problems)


def test_checkpoint_limits_below_one_keep_the_newest(tmp_path):
    from lowmem.recipes.diffusion.checkpoints import CheckpointEvery

    for limit, left in ((0, []), (-1, []), (1, []), (2, ["checkpoint-4"]), (3, ["checkpoint-2", "checkpoint-4"])):
        for step in (2, 4):
            (tmp_path / f"checkpoint-{step}").mkdir(exist_ok=True)
        CheckpointEvery(tmp_path, 2, limit)._prune()  # before a save: limit - 1 stay (the save makes limit)
        assert sorted(p.name for p in tmp_path.iterdir()) == left, limit
