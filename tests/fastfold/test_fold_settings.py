"""`suite fold`'s settings come from one typed config (`fastfold.run.settings.FoldSettings`, issue 20 "one typed config
path"): every setting has a flag and a YAML key and round-trips through both; one merge rule (explicit flag > file >
default, an explicit value equal to the default included); a bad key or value is one line naming the file and the
key, exit 2; the Lightning recipe reads the same file into the same settings."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing

import pytest
import yaml

from lowmem.fastfold.run.settings import FLAGLESS, FoldSettings
from lowmem.suite.cli import build_parser, main
from lowmem.suite.commands.fold import fold_settings
from lowmem.utils.errors import InputError
from lowmem.utils.settings import settings

TABLE = settings(FoldSettings)
FLAGGED = [n for n in TABLE if n not in FLAGLESS]

# The defaults of suite fold's flags before they were generated (tests/assets/cli_flags.json before issue 20's
# change; the frozen file now shows SUPPRESS, since a flag is in the namespace only when given)
OLD_DEFAULTS = {
    "bfd_database_path": None, "chunk_size": None, "cpus": 2, "devices": 1, "hhblits_binary_path": "hhblits",
    "hhsearch_binary_path": "hhsearch", "inplace": False, "jackhmmer_binary_path": "jackhmmer",
    "kalign_binary_path": "kalign", "max_template_date": None, "mgnify_database_path": None,
    "model_device": "auto", "model_name": "model_1_ptm", "model_preset": None, "relax": True, "num_recycle": None,
    "num_seeds": 1, "num_workers": None, "obsolete_pdbs_path": None, "output_dir": "fold_outputs", "overwrite": False,
    "param_path": None, "pdb70_database_path": None, "precision": "fp32", "random_model_size": "tiny",
    "ray_address": None, "relax_max_iterations": 0, "relax_max_minutes": 10.0, "relax_max_passes": 20,
    "relax_platform": "auto", "seed": 0, "single_sequence": False, "subtract_plddt": False,
    "template_mmcif_dir": None, "uniprot_database_path": None, "uniref30_database_path": None,
    "uniref90_database_path": None, "use_precomputed_alignments": None,
}


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


def _get(fs: FoldSettings, name: str):
    return functools.reduce(getattr, TABLE[name].path, fs)


def _other(name: str):
    """A valid value of the setting `name` that is not its default."""
    s = TABLE[name]
    default = s.default
    if name == "max_template_date":
        return "2020-05-14"
    if name == "chunk_size":
        return 7
    tp = s.type
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType) else (tp,)
    tp = next(a for a in args if a is not type(None))
    if tp is bool:
        return not default
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    if tp is int:
        return (default or 0) + 3
    if tp is float:
        return 2.5
    return f"x_{name}"


def _flag(name: str, value) -> list[str]:
    if isinstance(value, bool):
        if name == "relax":
            return ["--relax" if value else "--no-relax"]
        assert value, name  # store_true flags: only True can be given
        return [f"--{name}"]
    return [f"--{name}", str(value)]


def _file(tmp_path, values: dict, name: str = "fold.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return path


def test_the_defaults_users_see_are_the_old_flags_defaults():
    assert {n: TABLE[n].default for n in FLAGGED} == OLD_DEFAULTS


def test_every_setting_but_the_positional_and_the_recipes_has_a_flag():
    parser = build_parser(["fold"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["fold"]
    options = {o for a in sub._actions for o in a.option_strings}
    assert all(f"--{n}" in options for n in FLAGGED), sorted(n for n in FLAGGED if f"--{n}" not in options)
    assert not {f"--{n}" for n in FLAGLESS} & options
    assert {"fasta_path", "template_mmcif_dir"} <= {a.dest for a in sub._actions if not a.option_strings}


@pytest.mark.parametrize("name", FLAGGED)
def test_each_setting_round_trips_through_its_flag_and_its_yaml_keys(tmp_path, name):
    value = _other(name)
    fs = fold_settings(_parse(["fold", "x.fasta", *_flag(name, value)]))
    assert _get(fs, name) == value
    flat = fold_settings(_parse(["fold", "x.fasta", "--config", str(_file(tmp_path, {name: value}))]))
    assert _get(flat, name) == value
    nested: dict = {}
    node = nested
    for part in TABLE[name].path[:-1]:
        node = node.setdefault(part, {})
    node[TABLE[name].path[-1]] = value  # the owner's field name (alignment.sources.precomputed_dir)
    deep = fold_settings(_parse(["fold", "x.fasta", "--config", str(_file(tmp_path, nested, "nested.yaml"))]))
    assert _get(deep, name) == value
    untouched = fold_settings(_parse(["fold", "x.fasta"]))
    assert _get(untouched, name) == TABLE[name].default


@pytest.mark.parametrize("name", FLAGLESS)
def test_flagless_settings_have_a_yaml_key(tmp_path, name):
    value = "in.fasta" if name == "fasta_path" else _other(name)
    fs = fold_settings(_parse(["fold", "--config", str(_file(tmp_path, {name: value}))]))
    assert _get(fs, name) == value


@pytest.mark.parametrize("name", FLAGGED)
def test_explicit_flag_beats_the_file_which_beats_the_default(tmp_path, name):
    value, default = _other(name), TABLE[name].default
    config = str(_file(tmp_path, {name: value}))
    assert _get(fold_settings(_parse(["fold", "x.fasta", "--config", config])), name) == value
    if default is None or (default is False):
        return  # None cannot be typed; a store_true flag gives only True
    explicit = fold_settings(_parse(["fold", "x.fasta", "--config", config, *_flag(name, default)]))
    assert _get(explicit, name) == default  # equal to the default, and given: it wins over the file


def test_explicit_seed_zero_beats_seed_three_in_the_file_without_suites_main(tmp_path):
    """The namespace holds only the given flags: the rule needs nothing from suite's main."""
    config = str(_file(tmp_path, {"seed": 3, "num_recycle": 2}))
    argv = ["fold", "x.fasta", "--config", config, "--seed", "0"]
    fs = fold_settings(build_parser(argv).parse_args(argv))
    assert (fs.run.seed, fs.run.num_recycle) == (0, 2)


def test_positional_template_dir_and_its_flag_beat_the_file(tmp_path):
    config = str(_file(tmp_path, {"template_mmcif_dir": "from_file"}))
    assert fold_settings(_parse(["fold", "x.fasta", "--config", config])).alignment.sources.template_mmcif_dir == (
        "from_file")
    fs = fold_settings(_parse(["fold", "x.fasta", "positional", "--config", config]))
    assert fs.alignment.sources.template_mmcif_dir == "positional"
    fs = fold_settings(_parse(["fold", "x.fasta", "positional", "--template_mmcif_dir", "flag", "--config", config]))
    assert fs.alignment.sources.template_mmcif_dir == "flag"


def test_chunk_size_takes_an_int_or_auto_on_both_sides(tmp_path, capsys):
    assert fold_settings(_parse(["fold", "x.fasta", "--chunk_size", "auto"])).model.chunk_size == "auto"
    assert fold_settings(_parse(["fold", "x.fasta", "--chunk_size", "16"])).model.chunk_size == 16
    config = str(_file(tmp_path, {"chunk_size": "auto"}))
    assert fold_settings(_parse(["fold", "x.fasta", "--config", config])).model.chunk_size == "auto"
    # the one chunk-size check's line (fastfold.model.options.check_chunk_size), exit 2
    assert main(["fold", "x.fasta", "--chunk_size", "big"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chunk_size" in err[0] and "'big'" in err[0] and "'auto'" in err[0], err


@pytest.mark.parametrize(("text", "words"), [
    ("seeed: 3\n", "unknown setting 'seeed' (did you mean 'seed'?)"),
    ("cpus: many\n", "cpus: expected an integer, got 'many'"),
    ("relax: maybe\n", "relax: expected true or false, got 'maybe'"),
    ("relax_platform: GPU\n", "relax_platform: expected one of 'auto', 'CPU', 'CUDA', got 'GPU'"),
    ("relax_max_passes: 0\n", "relax_max_passes must be >= 1, got 0"),
    ("run:\n  num_seeds: 0\n", "num_seeds must be >= 1, got 0"),
    ("cpus: 0\n", "cpus must be >= 1, got 0"),  # AlignmentConfig's own check, in the user's spelling
    ("max_template_date: 2021-13-01\n", "max_template_date '2021-13-01': expected YYYY-MM-DD"),
    ("chunk_size: 0\n", "chunk_size must be a positive int or 'auto', got 0"),
    ("model: fast\n", "model: expected a mapping (a section), got 'fast'"),
    # translation flags, not settings: what to write instead
    ("gpus: 2\n", "gpus: an OpenFold/FastFold command-line flag, translated on the command line only; in a config "
                  "file write 'devices: N' instead"),
    ("trace_model: true\n", "trace_model: an OpenFold/FastFold command-line flag"),
])
def test_bad_yaml_is_one_line_naming_the_file_and_the_key_exit_2(tmp_path, capsys, text, words):
    config = tmp_path / "fold.yaml"
    config.write_text(text)
    assert main(["fold", "x.fasta", "--config", str(config), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{config}: {words}" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("flags", "words"), [
    (["--cpus", "0"], "--cpus must be >= 1, got 0"),
    (["--max_template_date", "2021-13-01"], "--max_template_date '2021-13-01': expected YYYY-MM-DD"),
    (["--num_workers", "-1"], "--num_workers must be >= 0, got -1"),
])
def test_bad_flag_values_name_the_flag(tmp_path, capsys, flags, words):
    config = tmp_path / "fold.yaml"
    config.write_text("cpus: 3\n")  # a good file: the flag is named, not the file
    assert main(["fold", "x.fasta", "--config", str(config), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and str(config) not in err[0], err


RECIPE = {
    "fasta_path": "in.fasta", "output_dir": "out", "model_name": "model_3", "param_path": None,
    "precision": "bf16", "chunk_size": "auto", "seed": 5, "use_precomputed_alignments": "aln",
    "single_sequence": True, "template_mmcif_dir": "mmcif", "num_workers": 0, "relax": True, "overwrite": True,
    "devices": 2, "accelerator": "gpu", "random_model_size": "full", "max_template_date": "2021-10-14",
    "relaxation": {"relax_platform": "CPU", "relax_max_minutes": 2},
    "alignment": {"cpus": 4, "sources": {"kalign_binary_path": "/opt/kalign"}},
}


def test_recipe_and_suite_fold_read_a_file_into_the_same_settings(tmp_path):
    from lowmem.recipes.fold import load_recipe, recipe_settings

    config = _file(tmp_path, RECIPE)
    from_recipe, given = recipe_settings(config)
    from_cli = fold_settings(_parse(["fold", "--config", str(config)]))
    assert from_recipe == from_cli
    assert from_cli != FoldSettings() and given >= {"fasta_path", "chunk_size", "cpus", "relax_platform"}
    loaded = load_recipe(config)
    assert loaded["predictor"] == {"model_name": "model_3", "param_path": None, "precision": "bf16",
                                   "chunk_size": "auto", "seed": 5, "tiny": False}
    assert loaded["trainer"] == {"strategy": "dap", "devices": 2, "accelerator": "gpu"}
    assert loaded["data"]["alignments_dir"] == "aln" and loaded["data"]["cpus"] == 4
    assert loaded["data"]["kalign_binary_path"] == "/opt/kalign" and loaded["data"]["fasta"] == "in.fasta"
    relax = loaded["writer"]["relax_config"]
    assert (relax.platform, relax.max_seconds) == ("CPU", 120.0) and loaded["writer"]["overwrite"] is True


@pytest.mark.parametrize("text", ["seeed: 3\n", "cpus: 0\n", "precision: fp8\n"])
def test_recipe_refuses_what_suite_fold_refuses_with_the_same_line(tmp_path, capsys, text):
    from lowmem.recipes.fold import load_recipe

    config = tmp_path / "fold.yaml"
    config.write_text(text)
    with pytest.raises(InputError) as info:
        load_recipe(config)
    assert main(["fold", "x.fasta", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"suite fold: error: {info.value}"


def test_recipe_refuses_a_setting_it_has_no_argument_for(tmp_path):
    from lowmem.recipes.fold import load_recipe

    config = _file(tmp_path, {"num_seeds": 2})
    with pytest.raises(InputError, match=rf"^{config}: num_seeds: a suite fold setting the recipe does not take"):
        load_recipe(config)


def test_settings_build_the_run_config(tmp_path):
    """FoldConfig is built from the settings: the flags reach the models, alignment, relax and run fields."""
    from lowmem.suite.commands.fold import _build_config, _read_targets

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAK\n>b\nMKVL\n")
    args = _parse(["fold", str(fasta), "--single_sequence", "--model_name", "model_3,model_4", "--seed", "4",
                   "--chunk_size", "8", "--relax_max_passes", "3", "--num_seeds", "2", "--cpus", "5",
                   "--max_template_date", "2020-01-02", "--output_dir", str(tmp_path / "o"), "--model_device", "cpu",
                   "--num_workers", "0", "--subtract_plddt"])
    fs = fold_settings(args)
    cfg = _build_config(fs, args, _read_targets(args))
    assert [m.model_name for m in cfg.models] == ["model_3", "model_4"]
    assert {(m.seed, m.chunk_size, m.device, m.tiny) for m in cfg.models} == {(4, 8, "cpu", True)}
    assert (cfg.alignment.cpus, cfg.alignment.max_template_date, cfg.alignment.single_sequence) == (
        5, "2020-01-02", True)
    assert (cfg.relax.max_outer_iterations, cfg.seed, cfg.num_seeds, cfg.num_workers, cfg.subtract_plddt) == (
        3, 4, 2, 0, True)
    assert dataclasses.replace(fs.alignment.sources, max_template_date="2020-01-02") == cfg.alignment
