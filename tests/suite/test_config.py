"""The generic typed-settings module: flags, YAML loading and the one merge rule from a config dataclass."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from typing import Literal

import pytest

from lowmem.utils.errors import InputError
from lowmem.utils.settings import add_flags, build, from_mapping, merge, read_yaml, section, settings


@dataclass(kw_only=True)
class _Inner:
    size: int = 4
    """Size of the thing."""
    mode: Literal["a", "b"] = "a"
    """Mode, a or b."""
    scale: float = 1.0
    """Scale factor."""
    hidden: int = 7
    """Derived by the owner; not a setting."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


@dataclass(kw_only=True)
class _Outer:
    name: str | None = None
    """A name."""
    tags: list[str] | None = None
    """Some tags."""
    verbose: bool = False
    """Talk more."""
    fast: bool = True
    """Go fast."""
    inner: _Inner = section(_Inner, default=functools.partial(_Inner, size=8), rename={"size": "inner_size"},
                            hide=("hidden",))
    """The inner section."""
    extra: dict = field(default_factory=dict)
    """Free-form."""


def _parser(defaults: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, _Outer, defaults=defaults)
    return p


def test_settings_are_the_leaf_fields_with_flat_names_and_the_composed_defaults():
    table = settings(_Outer)
    assert list(table) == ["name", "tags", "verbose", "fast", "inner_size", "mode", "scale", "extra"]
    assert table["inner_size"].path == ("inner", "size") and table["inner_size"].default == 8  # the section's default
    assert table["mode"].help == "Mode, a or b." and "hidden" not in table
    assert not table["extra"].flaggable and table["tags"].flaggable


def test_flags_have_types_choices_help_and_no_default_unless_asked():
    p = _parser()
    actions = {a.dest: a for a in p._actions}
    assert set(actions) == {"help", "name", "tags", "verbose", "fast", "inner_size", "mode", "scale"}
    assert actions["inner_size"].type is int and actions["scale"].type is float
    assert actions["mode"].choices == ("a", "b") and actions["tags"].nargs == "+"
    assert actions["inner_size"].help == "Size of the thing (default: 8)" and actions["name"].help == "A name."
    assert isinstance(actions["fast"], argparse.BooleanOptionalAction)  # a True default can be turned off
    assert vars(p.parse_args([])) == {}  # nothing given: nothing in the namespace
    assert vars(p.parse_args(["--inner_size", "3", "--no-fast", "--tags", "x", "y"])) == {
        "inner_size": 3, "fast": False, "tags": ["x", "y"]}
    assert vars(_parser(defaults=True).parse_args([]))["inner_size"] == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])


def test_yaml_nested_and_flat_keys_give_the_same_settings(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("inner_size: 3\nmode: b\nscale: 1e-3\ntags: one\n")
    nested.write_text("inner:\n  size: 3\n  mode: b\n  scale: 1.0e-3\ntags: [one]\n")
    assert read_yaml(flat, _Outer) == read_yaml(nested, _Outer) == {
        "inner_size": 3, "mode": "b", "scale": 1e-3, "tags": ["one"]}
    assert from_mapping({"inner": {"inner_size": 5}}, _Outer, "x") == {"inner_size": 5}  # flat name in its section


@pytest.mark.parametrize("text, expect", [
    ("sise: 3\n", "unknown setting 'sise'"),
    ("inner:\n  hidden: 3\n", "unknown setting 'inner.hidden'"),
    ("inner_size: three\n", "inner_size: expected an integer, got 'three'"),
    ("inner:\n  size: 2.5\n", "inner.size: expected an integer, got 2.5"),
    ("mode: c\n", "mode: expected one of 'a', 'b', got 'c'"),
    ("verbose: 1\n", "verbose: expected true or false, got 1"),
    ("inner: 3\n", "inner: expected a mapping (a section), got 3"),
    ("inner_size: 3\ninner:\n  size: 4\n", "inner.size: set twice (also as inner_size)"),
    ("- a\n", "expected a mapping of setting names, got list"),
])
def test_bad_file_is_one_input_error_naming_the_key_and_the_file(tmp_path, text, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        read_yaml(path, _Outer)
    assert str(info.value).startswith(f"{path}: ") and expect in str(info.value), str(info.value)


def test_merge_explicit_flag_beats_the_file_which_beats_the_default():
    p = _parser()
    file_values = {"inner_size": 3, "scale": 2.0}
    # an explicit flag whose value equals the default still beats the file
    values, origin = merge(_Outer, p.parse_args(["--inner_size", "8"]), file_values, "f.yaml")
    cfg = build(_Outer, values, origin)
    assert (cfg.inner.size, cfg.inner.scale, cfg.inner.mode) == (8, 2.0, "a")
    assert origin == {"inner_size": "--inner_size", "scale": "f.yaml"}
    # the flag given, the file's value for the other: one rule, what the namespace holds (not None) is given
    values, _ = merge(_Outer, p.parse_args(["--scale", "1.0"]), file_values, "f.yaml")
    cfg = build(_Outer, values)
    assert (cfg.inner.size, cfg.inner.scale) == (3, 1.0)
    assert build(_Outer, {}).inner.size == 8  # neither: the composed default


def test_refused_value_names_the_flag_or_the_file():
    with pytest.raises(InputError, match=r"^--inner_size must be >= 1, got 0$"):
        build(_Outer, {"inner_size": 0}, {"inner_size": "--inner_size"})
    with pytest.raises(InputError, match=r"^f\.yaml: inner_size must be >= 1, got 0$"):
        build(_Outer, {"inner_size": 0}, {"inner_size": "f.yaml"})


def test_two_settings_with_one_flat_name_are_refused():
    @dataclass(kw_only=True)
    class Clash:
        size: int = 1
        inner: _Inner = section(_Inner)

    with pytest.raises(TypeError, match="setting 'size'"):
        settings(Clash)


@pytest.mark.parametrize("text, expect", [
    ("seed: three\n", "seed: expected an integer, got 'three'"),
    ("relax: 1\n", "relax: expected true or false, got 1"),
    ("precision: fp8\n", "precision: expected one of 'fp32', 'bf16', 'fp64', got 'fp8'"),
    ("chunk_size: 0\n", "chunk_size must be a positive int or 'auto', got 0"),
    ("max_recycles: 3\n", "unknown setting 'max_recycles'"),
])
def test_fold_config_values_are_checked_as_the_flags_check_them(tmp_path, text, expect):
    from lowmem.suite.cli import build_parser
    from lowmem.suite.commands.fold import fold_settings

    config = tmp_path / "fold.yaml"
    config.write_text(text)
    argv = ["fold", "x.fasta", "--config", str(config)]
    args = build_parser(argv).parse_args(argv)
    with pytest.raises(InputError) as info:
        fold_settings(args)
    assert str(info.value).startswith(f"{config}: ") and expect in str(info.value), str(info.value)


def test_fold_config_values_take_the_flags_types(tmp_path):
    from lowmem.suite.cli import build_parser
    from lowmem.suite.commands.fold import fold_settings

    config = tmp_path / "fold.yaml"
    config.write_text("max_template_date: 2021-10-14\nchunk_size: 64\nrelax_max_minutes: 2\nnum_recycle: null\n"
                      "relax: false\n")
    argv = ["fold", "x.fasta", "--config", str(config)]
    args = build_parser(argv).parse_args(argv)
    fold_settings(args)
    assert (args.max_template_date, args.chunk_size, args.relax_max_minutes, args.num_recycle, args.relax) == (
        "2021-10-14", 64, 2.0, None, False)
