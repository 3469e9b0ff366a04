"""One merge rule for command-line flags and a config file: explicit flag > file > default, even when the
explicit value equals the default (before, `suite fold --seed 0` lost to `seed: 3` in the file)."""

from __future__ import annotations

from lowmem.suite.cli import _explicit_flags, build_parser


def _parse(argv):
    args = build_parser(argv).parse_args(argv)
    args.explicit_flags = _explicit_flags(argv)
    return args


def test_explicit_flags_are_the_given_ones_only():
    argv = ["fold", "x.fasta", "--seed", "0", "--no-relax"]
    explicit = _parse(argv).explicit_flags
    assert {"seed", "relax", "fasta_path", "command"} <= explicit
    assert "num_recycle" not in explicit and "output_dir" not in explicit and "log_level" not in explicit


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
