"""How long a run is, counted as diffusers' training scripts count it (train_text_to_image.py,
train_text_to_image_lora.py, train_dreambooth.py at v0.40.0), and where a resumed run starts.

The scripts' loop, in their own terms:

    num_update_steps_per_epoch = ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = max_train_steps or num_train_epochs * num_update_steps_per_epoch
    num_train_epochs = ceil(max_train_steps / num_update_steps_per_epoch)
    global_step = N of checkpoint-N (resume), first_epoch = global_step // num_update_steps_per_epoch
    for epoch in range(first_epoch, num_train_epochs):
        for each micro-batch of the epoch (from its first one, also on resume):
            an optimizer step ends every gradient_accumulation_steps micro-batches and at the epoch's last one
            if global_step >= max_train_steps: break

So a resumed run restarts its epoch from the first batch, and one resumed at or past its end still trains one
step when its epoch is not over (resume at 4 with --max_train_steps 2: step 5). `run_length` gives those numbers
and the micro-batches each epoch runs (`epoch_batches`), which the sampler follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RunLength", "run_length"]


@dataclass(frozen=True)
class RunLength:
    """The scripts' counts of one run (optimizer steps, epochs, micro-batches per rank)."""

    batches_per_epoch: int
    """Micro-batches per epoch on each rank: ceil(dataset / (train_batch_size x processes)), the last one short."""
    steps_per_epoch: int
    """Optimizer steps per epoch: ceil(batches_per_epoch / gradient_accumulation_steps)."""
    max_train_steps: int
    """--max_train_steps, else --num_train_epochs x steps_per_epoch (the LR schedule's length)."""
    num_train_epochs: int
    """ceil(max_train_steps / steps_per_epoch)."""
    start_step: int = 0
    """The optimizer step the run starts at (N of the checkpoint resumed)."""
    first_epoch: int = 0
    """start_step // steps_per_epoch: the epoch the run starts at, from its first batch."""
    end_step: int = 0
    """The optimizer step the run ends at (the scripts' loop run to its end)."""
    epoch_batches: dict[int, int] = field(default_factory=dict)
    """Epoch -> micro-batches the run goes through in it (fewer than batches_per_epoch where the loop breaks)."""

    @property
    def trains_nothing(self) -> bool:
        """Whether no optimizer step would run (a resumed run already at its end)."""
        return self.end_step <= self.start_step

    def describe_nothing(self) -> str:
        """One line saying why a run trains nothing."""
        return (f"the run is already at its end: resumed at step {self.start_step} (epoch {self.first_epoch}, "
                f"{self.steps_per_epoch} steps per epoch) and it ends at step {self.max_train_steps} "
                f"({self.num_train_epochs} epochs), so no step would be trained; give a larger --max_train_steps "
                "or --num_train_epochs")


def run_length(dataset_len: int, batch_size: int, world_size: int, gradient_accumulation_steps: int,
               max_train_steps: int | None, num_train_epochs: int, start_step: int = 0) -> RunLength:
    """The scripts' counts for a data set of `dataset_len` samples, resumed at `start_step` (0: a new run)."""
    if dataset_len < 1 or batch_size < 1 or world_size < 1 or gradient_accumulation_steps < 1:
        raise ValueError("dataset_len, batch_size, world_size and gradient_accumulation_steps must be >= 1")
    per_epoch = math.ceil(dataset_len / (batch_size * world_size))
    ga = gradient_accumulation_steps
    steps_per_epoch = math.ceil(per_epoch / ga)
    total = max_train_steps if max_train_steps is not None else num_train_epochs * steps_per_epoch
    epochs = math.ceil(total / steps_per_epoch)
    first = start_step // steps_per_epoch
    step, batches = start_step, {}
    for epoch in range(first, epochs):
        for b in range(per_epoch):
            if (b + 1) % ga == 0 or b == per_epoch - 1:
                step += 1
            if step >= total:
                batches[epoch] = b + 1
                break
        else:
            batches[epoch] = per_epoch
    return RunLength(batches_per_epoch=per_epoch, steps_per_epoch=steps_per_epoch, max_train_steps=total,
                     num_train_epochs=epochs, start_step=start_step, first_epoch=first, end_step=step,
                     epoch_batches=batches)
