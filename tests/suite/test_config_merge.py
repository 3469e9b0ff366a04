"""One merge rule for command-line flags and a config file: explicit flag > file > default, even when the
explicit value equals the default (before, `suite fold --seed 0` lost to `seed: 3` in the file)."""

from __future__ import annotations

import argparse

from lowmem.suite.cli import build_parser


def _parse(argv):
    return build_parser(argv).parse_args(argv)


def test_the_namespace_holds_the_given_settings_only():
    """What `utils.settings.merge` counts as given: the flags typed (a setting's flag has no default in the
    namespace) and the positionals given (None when left out)."""
    from lowmem.fastfold.run.settings import FoldSettings
    from lowmem.utils.settings import merge

    args = _parse(["fold", "x.fasta", "--seed", "0", "--no-relax"])
    assert {"seed", "relax"} <= set(vars(args)) and "num_recycle" not in vars(args) and "output_dir" not in vars(args)
    assert args.template_mmcif_dir is None  # a positional left out
    values, origin = merge(FoldSettings, args, {"output_dir": "o", "seed": 3}, "f.yaml")
    assert values == {"fasta_path": "x.fasta", "seed": 0, "relax": False, "output_dir": "o"}
    assert origin == {"fasta_path": "--fasta_path", "seed": "--seed", "relax": "--relax", "output_dir": "f.yaml"}
    assert merge(FoldSettings, argparse.Namespace(seed=None), {"seed": 3})[0] == {"seed": 3}


def test_fold_explicit_default_value_beats_the_file_which_beats_the_default(tmp_path):
    from lowmem.suite.commands.fold import fold_settings

    config = tmp_path / "fold.yaml"
    config.write_text("seed: 3\nnum_recycle: 2\n")
    args = _parse(["fold", "x.fasta", "--config", str(config), "--seed", "0"])
    fold_settings(args)
    assert args.seed == 0  # given explicitly, equal to the default: still wins
    assert args.num_recycle == 2  # not given: the file's
    args = _parse(["fold", "x.fasta", "--config", str(config)])
    fold_settings(args)
    assert (args.seed, args.num_recycle) == (3, 2)
