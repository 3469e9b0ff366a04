"""`suite bench diffusion --frontier` (issue 47): its pieces that need no training run (the runs themselves are the
published rows' commands): the disk's speed, the traffic read back from a run's CSV log, and bad options."""

from __future__ import annotations

import argparse

import pytest

from lowmem.suite.bench import diffusion, frontier
from lowmem.suite.errors import UsageError


def test_disk_speed_writes_and_reads_the_file_and_leaves_nothing(tmp_path):
    got = frontier.disk_speed(str(tmp_path), mib=16)
    assert got["read_mb_s"] > 0 and got["write_mb_s"] > 0 and isinstance(got["direct_io"], bool)
    assert list(tmp_path.iterdir()) == []


def test_traffic_is_the_median_per_step_after_the_first_of_each_traffic_column(tmp_path):
    log = tmp_path / "logs" / "csv"
    log.mkdir(parents=True)
    (log / "metrics.csv").write_text(
        "disk_read_mib,images_per_s,step,tier_mib/nvme->device,train_loss\n"
        "900,,0,800,1.0\n"
        "10,0.5,1,100,0.9\n"
        "30,0.5,2,300,0.8\n"
        "20,0.5,3,200,0.7\n")
    assert frontier._traffic(str(tmp_path)) == {"disk_read_mib": 20.0, "nvme->device": 200.0}
    assert frontier._traffic(str(tmp_path / "missing")) == {}


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    diffusion.add_arguments(parser)
    return parser.parse_args(["--frontier", *flags])


@pytest.mark.parametrize("flags, match", [
    (["--frontier_rows", "full,flux"], "--frontier_rows: unknown 'flux'"),
    (["--budgets", "1/6,half"], "--budgets '1/6,half'"),
])
def test_bad_frontier_options_are_one_line_before_anything_runs(tmp_path, flags, match):
    args = _args(*flags, "--work", str(tmp_path / "w"))
    with pytest.raises(UsageError, match=match):
        diffusion.run(args)
    assert not (tmp_path / "w").exists()


def test_every_side_starts_with_the_model_folder_out_of_the_page_cache(tmp_path, monkeypatch):
    """The SDXL row's pipeline lies outside the row's folder (written once): it is dropped from the page cache before
    the plain loop and before ours, so neither reads what another side left cached (charged to nobody)."""
    base = str(tmp_path / "sdxl-pipeline")
    monkeypatch.setattr(frontier, "disk_speed", lambda folder: {"read_mb_s": 1.0, "write_mb_s": 1.0,
                                                                "direct_io": True})
    monkeypatch.setattr(frontier, "_commands", lambda row, opts, folder: (
        ["plain"], ["diffusion", "x", "--pretrained_model_name_or_path", base]))
    drops = []

    def rows(sides, labels, *, drop, batch, compare=True):
        drops.append(list(drop))
        return [{**label, "returncode": 0, "peak_mib": 100.0, "step_s": 1.0, "command": "c"} for label in labels]

    monkeypatch.setattr(frontier, "whole_rows", rows)
    monkeypatch.setattr(frontier, "publish", lambda *a, **k: None)
    monkeypatch.setattr(frontier, "save_figure", lambda *a, **k: None)
    args = _args("--frontier_rows", "sdxl-lora", "--budgets", "1/2", "--work", str(tmp_path / "w"))
    frontier.run_frontier(diffusion._defaults(args), args)
    assert len(drops) == 2 and all(base in d for d in drops), drops
