"""Sharded checkpoints: saved on 2 ranks, resumed on 1 and 4 exactly as uninterrupted training (run from
test_zero.py, which shares its spawned ranks with these helpers); atomic saves; consolidation into a plain
state_dict and the `suite checkpoint consolidate` command; the scaler state; the model-only path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lowmem import core_parallel
from lowmem.core_parallel import ZeroConfig, checkpoint
from lowmem.core_parallel.loss_scaler import LossScalerConfig
from tests.core_parallel.test_zero import STEPS, make_model, make_optimizer, max_rel_err, train_zero

SAVE_AT = 3


def _setup(stage: int, seed: int, precision: str = "fp32", scaler: LossScalerConfig | None = None):
    model = make_model(seed)
    cfg = ZeroConfig(stage=stage, precision=precision, bucket_mb=1e-4, loss_scaler=scaler or LossScalerConfig())
    model, opt = core_parallel.setup(model, make_optimizer(model), cfg)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


class CollectiveStateDict(nn.Module):
    """A model whose state_dict() is a collective, as under Gemini (which gathers full tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("count", torch.tensor(4))
        self.register_state_dict_post_hook(self._gather)

    @staticmethod
    def _gather(module, state_dict, prefix, local_metadata) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(torch.zeros(1))


def save_worker(rank: int, world: int, folder: str) -> dict:
    """Train SAVE_AT steps with ZeRO-2, save, then keep training to STEPS (the uninterrupted run).

    Also saves a model-only checkpoint of a model whose state_dict() is a collective (must not hang).
    """
    model, opt, sched = _setup(stage=2, seed=0)
    train_zero(model, opt, range(SAVE_AT), rank, world, scheduler=sched)
    at_save = _numpy(model)
    core_parallel.save_checkpoint(folder, model, opt, extra={"step": SAVE_AT, "scheduler": sched.state_dict()})
    train_zero(model, opt, range(SAVE_AT, STEPS), rank, world, scheduler=sched)
    torch.manual_seed(rank)  # different values per rank: rank 0's are the ones saved
    collective = CollectiveStateDict()
    core_parallel.save_checkpoint(folder + "-model-only", collective)
    return {"at_save": at_save, "final": _numpy(model), "model_only": _numpy(collective)}


def resume_worker(rank: int, world: int, folder: str, stage: int) -> dict:
    """A fresh model (other seed) loads the checkpoint and trains the remaining steps."""
    model, opt, sched = _setup(stage=stage, seed=123)
    extra = core_parallel.load_checkpoint(folder, model, opt)
    sched.load_state_dict(extra["scheduler"])
    loaded = _numpy(model)
    train_zero(model, opt, range(extra["step"], STEPS), rank, world, scheduler=sched)
    return {"loaded": loaded, "final": _numpy(model), "lrs": [g["lr"] for g in opt.param_groups]}


def _assert_close(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = np.abs(got[k].astype(np.float64) - want[k]).max() / max(np.abs(want[k]).max(), 1e-12)
        assert err <= rtol, f"{k}: relative error {err:.3e}"


def check_saved_on_two_ranks(folder: str) -> None:
    index = json.loads(open(os.path.join(folder, checkpoint.INDEX)).read())
    assert index["world_size"] == 2 and len(index["shards"]) == 2


def check_resumed(resumed: dict, saved: dict) -> None:
    """A resumed run (resume_worker) loads the saved values exactly and ends where the uninterrupted one did."""
    _assert_close(resumed["loaded"], saved["at_save"], 0.0)
    _assert_close(resumed["final"], saved["final"], 1e-6)


def _suite(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowmem.suite", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})


def check_consolidate_command(folder: str, saved: dict, tmp_path) -> None:
    """`suite checkpoint consolidate` exits 0; a plain model loads the file strictly (safetensors + torch only);
    the model-only checkpoint of a model with a collective state_dict holds rank 0's values."""
    out = tmp_path / "model.safetensors"
    done = _suite("checkpoint", "consolidate", folder, str(out))
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout
    plain = make_model(seed=7)
    plain.load_state_dict(load_file(str(out)))
    _assert_close(_numpy(plain), saved["at_save"], 0.0)
    fresh = CollectiveStateDict()
    core_parallel.load_checkpoint(folder + "-model-only", fresh)
    _assert_close(_numpy(fresh), saved["model_only"], 0.0)


# The multi-rank runs (save on 2 ranks, resume on 4 and on 1) are in test_zero.py, sharing its spawned ranks.


@pytest.mark.parametrize("make_bad", ["missing", "not_a_checkpoint", "bad_suffix"])
def test_consolidate_command_bad_input_is_one_line_exit_2(tmp_path, make_bad):
    src = tmp_path / "ckpt"
    out = tmp_path / "model.safetensors"
    if make_bad == "not_a_checkpoint":
        src.mkdir()
        (src / checkpoint.INDEX).write_text('{"format": "something else"}')
    elif make_bad == "bad_suffix":
        core_parallel.save_checkpoint(src, make_model())
        out = tmp_path / "model.bin"
    done = _suite("checkpoint", "consolidate", str(src), str(out))
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0], done.stderr
    assert not out.exists()


def test_load_with_optimizer_does_not_call_model_state_dict(tmp_path):
    """Under Gemini model.state_dict() gathers every tensor: load_checkpoint must name tensors without it."""
    model, opt, _ = _setup(stage=2, seed=0)
    train_zero(model, opt, range(2), 0, 1)
    core_parallel.save_checkpoint(tmp_path / "c", model, opt)
    fresh, fresh_opt, _ = _setup(stage=1, seed=4)

    def forbidden(*args):
        raise AssertionError("load_checkpoint called model.state_dict()")

    fresh.register_state_dict_pre_hook(forbidden)
    core_parallel.load_checkpoint(tmp_path / "c", fresh, fresh_opt)
    assert max_rel_err(fresh, model) == 0.0
    torch.testing.assert_close(fresh.gain, model.gain, rtol=0, atol=0)


def test_fp16_scaler_state_resumes_exactly(tmp_path):
    scaler = LossScalerConfig(initial_scale=2.0**24, growth_interval=2)
    model, opt, sched = _setup(stage=2, seed=0, precision="fp16", scaler=scaler)
    train_zero(model, opt, range(3), 0, 1, scheduler=sched)
    assert opt.loss_scaler.overflows > 0  # 2**24 overflows fp16 gradients: the state is non-trivial
    core_parallel.save_checkpoint(tmp_path / "c", model, opt)
    model2, opt2, _ = _setup(stage=1, seed=5, precision="fp16", scaler=scaler)
    core_parallel.load_checkpoint(tmp_path / "c", model2, opt2)
    assert opt2.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    opt2.param_groups[0]["lr"], opt2.param_groups[1]["lr"] = (g["lr"] for g in opt.param_groups)
    train_zero(model, opt, range(3, STEPS), 0, 1)
    train_zero(model2, opt2, range(3, STEPS), 0, 1)
    assert max_rel_err(model2, model) == 0.0
    assert opt2.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    # consolidated as fp16 (the working dtype) or as the fp32 masters
    checkpoint.consolidate_checkpoint(tmp_path / "c", tmp_path / "h.safetensors")
    checkpoint.consolidate_checkpoint(tmp_path / "c", tmp_path / "f.safetensors", dtype="float32")
    assert load_file(str(tmp_path / "h.safetensors"))["a.weight"].dtype == torch.float16
    assert load_file(str(tmp_path / "f.safetensors"))["a.weight"].dtype == torch.float32


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, _ = _setup(stage=2, seed=0)
    path = tmp_path / "ckpt"
    core_parallel.save_checkpoint(path, model, opt)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_model_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        core_parallel.save_checkpoint(path, model, opt)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind


def test_model_only_path_and_reader_errors(tmp_path):
    model = make_model(seed=3)
    core_parallel.save_checkpoint(tmp_path / "m", model)
    fresh = make_model(seed=4)
    core_parallel.load_checkpoint(tmp_path / "m", fresh)
    _assert_close(_numpy(fresh), _numpy(model), 0.0)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoint.CheckpointReader(tmp_path)
    model, opt, _ = _setup(stage=2, seed=0)
    core_parallel.save_checkpoint(tmp_path / "z", model, opt)
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError):
        core_parallel.load_checkpoint(tmp_path / "z", other, torch.optim.SGD(other.parameters(), lr=0.1))
    reader = checkpoint.CheckpointReader(tmp_path / "z")
    with pytest.raises(ValueError, match="shape"):
        reader.check_param("a.weight", (2, 2))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def test_tied_weights_consolidate_into_a_strict_state_dict(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    model, opt = core_parallel.setup(model, torch.optim.Adam(model.parameters(), lr=0.1), ZeroConfig())
    opt.backward(model(torch.arange(11)).logsumexp(-1).mean())
    opt.step()
    core_parallel.save_checkpoint(tmp_path / "t", model, opt)
    core_parallel.consolidate_checkpoint(tmp_path / "t", tmp_path / "t.safetensors")
    fresh = Tied()
    fresh.load_state_dict(load_file(str(tmp_path / "t.safetensors")))
    torch.testing.assert_close(fresh.head.weight, model.head.weight, rtol=0, atol=0)


# ---- untrusted checkpoints: forged names and ranges, damaged bytes, a crash while replacing -------------------
def _saved(tmp_path, name: str = "c"):
    model, opt, _ = _setup(stage=2, seed=0)
    train_zero(model, opt, range(1), 0, 1)
    core_parallel.save_checkpoint(tmp_path / name, model, opt)
    return tmp_path / name, model


def _forge(folder, change) -> None:
    index = json.loads((folder / checkpoint.INDEX).read_text())
    change(index)
    (folder / checkpoint.INDEX).write_text(json.dumps(index))


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_fresh(folder):
    fresh, fresh_opt, _ = _setup(stage=2, seed=9)
    core_parallel.load_checkpoint(folder, fresh, fresh_opt)
    return fresh


def _assert_one_line_exit_2(folder, tmp_path, capsys, *words: str) -> None:
    """`suite checkpoint consolidate`, in this process (a subprocess costs seconds of imports)."""
    from lowmem.suite.cli import main

    capsys.readouterr()
    code = main(["checkpoint", "consolidate", str(folder), str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("where", ["dotdot", "absolute", "model_file", "link"])
def test_forged_file_names_are_refused_without_reading_outside(tmp_path, capsys, where):
    folder, _ = _saved(tmp_path)
    shard = "shard-00000-of-00001.safetensors"
    outside = tmp_path / "outside.safetensors"  # a valid copy outside the folder: reading it would succeed
    outside.write_bytes((folder / shard).read_bytes())
    forged = {"dotdot": "../outside.safetensors", "absolute": str(outside)}.get(where)
    if where == "link":
        (folder / shard).unlink()
        (folder / shard).symlink_to(outside)
    elif where == "model_file":
        (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        _forge(folder, lambda ix: ix.update(model_file="../model.safetensors"))
    else:
        def rename(ix):
            ix["shards"][forged] = ix["shards"].pop(shard)
            if "checksums" in ix:  # (so that the test also runs, and fails, on version 1)
                ix["checksums"][forged] = ix["checksums"].pop(shard)
        _forge(folder, rename)
    what = "not a regular file" if where == "link" else "not a plain file name"
    with pytest.raises(checkpoint.CheckpointError, match=what):
        _load_fresh(folder)
    _assert_one_line_exit_2(folder, tmp_path, capsys, what)


@pytest.mark.parametrize("fault", ["overlap_and_gap", "gap", "past_the_end"])
def test_ranges_must_tile_each_parameter_exactly(tmp_path, capsys, fault):
    """Overlap by one and miss one element: the element counts add up, and today's reader left the last element
    uninitialised. Every forged shard is a valid file with its checksum in the index: the tiling check decides."""
    from safetensors.torch import save_file

    folder, _ = _saved(tmp_path)
    shard = "shard-00000-of-00001.safetensors"
    tensors = load_file(str(folder / shard))
    index = json.loads((folder / checkpoint.INDEX).read_text())
    name = "a.weight"
    keys = index["params"][name]["state_keys"]
    n = tensors[f"master/{name}"].numel()
    pieces = {"overlap_and_gap": [(0, n // 2 + 1), (n // 2, n - 1)], "gap": [(0, n // 2), (n // 2 + 1, n)],
              "past_the_end": [(0, n // 2), (n // 2, n + 1)]}[fault]
    index["shards"][shard].pop(name)
    for i, (s, e) in enumerate(pieces):
        fname = f"forged-{i}.safetensors"
        padded = {k: torch.cat([tensors[f"{k}/{name}"], torch.zeros(1)]) for k in keys}
        save_file({f"{k}/{name}": padded[k][s:e].contiguous() for k in keys}, str(folder / fname))
        index["shards"][fname] = {name: [s, e]}
        index.setdefault("checksums", {})[fname] = _sha(folder / fname)
    (folder / checkpoint.INDEX).write_text(json.dumps(index))
    word = {"overlap_and_gap": "overlaps", "gap": "uncovered", "past_the_end": "outside"}[fault]
    with pytest.raises(checkpoint.CheckpointError, match=f"index.json: .*{word}"):
        _load_fresh(folder)
    _assert_one_line_exit_2(folder, tmp_path, capsys, "index.json", word)


@pytest.mark.parametrize("fname", ["shard-00000-of-00001.safetensors", "model.safetensors"])
def test_a_flipped_byte_fails_the_checksum(tmp_path, capsys, fname):
    folder, _ = _saved(tmp_path)
    data = bytearray((folder / fname).read_bytes())
    data[-3] ^= 0x10  # in the tensor data, not the header: the file still parses
    (folder / fname).write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{fname}: sha256 does not match"):
        _load_fresh(folder)
    _assert_one_line_exit_2(folder, tmp_path, capsys, fname, "sha256")


def test_version_1_checkpoints_load_unverified_with_a_warning(tmp_path, caplog):
    folder, model = _saved(tmp_path)

    def as_version_1(ix):
        ix["version"] = 1
        del ix["checksums"]
    _forge(folder, as_version_1)
    with caplog.at_level("WARNING"):
        fresh = _load_fresh(folder)
    assert max_rel_err(fresh, model) == 0.0
    assert "without verification" in caplog.text


def test_crash_between_the_renames_of_a_replace_keeps_a_loadable_checkpoint(tmp_path, monkeypatch):
    """Where no atomic exchange exists, replace_dir moves the old folder aside and the new one in: a crash between
    the two leaves no folder under the name, and loading falls back to the complete old copy. The next save
    removes that copy and the staging folder of a save killed earlier."""
    from lowmem.utils import fileio

    folder, model = _saved(tmp_path)
    other, other_opt, _ = _setup(stage=2, seed=5)
    train_zero(other, other_opt, range(2), 0, 1)
    monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)
    real_replace, calls = os.replace, []

    def crash_after_first(src, dst):
        if os.path.isdir(src):  # files (index.json) are renamed into the staging folder too
            calls.append(dst)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        core_parallel.save_checkpoint(folder, other, other_opt)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not folder.exists()
    assert max_rel_err(_load_fresh(folder), model) == 0.0
    (tmp_path / ".c.0123abcd.tmp").mkdir()  # a save killed while writing its staging folder
    core_parallel.save_checkpoint(folder, other, other_opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert max_rel_err(_load_fresh(folder), other) == 0.0


def test_replace_swaps_atomically_where_it_can(tmp_path, monkeypatch):
    """With renameat2(RENAME_EXCHANGE) (Linux) the old folder never leaves the name: a rename may not even fail."""
    from lowmem.utils import fileio

    if fileio._RENAMEAT2 is None:
        pytest.skip("no renameat2 in this C library")
    folder, _ = _saved(tmp_path)
    other, other_opt, _ = _setup(stage=2, seed=5)

    def no_renames(*args):
        raise AssertionError("os.replace of the checkpoint folder: a moment without one")

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (no_renames if os.path.isdir(src) else real_replace)(src, dst))
    core_parallel.save_checkpoint(folder, other, other_opt)
    assert max_rel_err(_load_fresh(folder), other) == 0.0


def test_every_file_and_the_folder_are_flushed_to_disk(tmp_path, monkeypatch):
    flushed: list[str] = []
    real_fsync = os.fsync

    def record(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    folder, _ = _saved(tmp_path)
    # index.json is flushed under its temporary name, then renamed (in the staging folder, flushed below)
    names = [os.path.basename(p) for p in flushed]
    for f in folder.iterdir():
        assert any(n == f.name or (n.startswith(f".{f.name}.") and n.endswith(".tmp")) for n in names), (f, names)
    assert any(p.startswith(str(tmp_path / ".c.")) and p.endswith(".tmp") for p in flushed)  # the folder itself
    assert str(tmp_path) in flushed  # its rename
