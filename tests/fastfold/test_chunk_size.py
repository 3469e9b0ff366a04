"""A chunk size is judged in one place (issue 36): `fastfold.model.options.check_chunk_size`. The same values are
accepted, and refused with the same line, whichever way they come: `suite fold --chunk_size`, a `--config` file's
`chunk_size` (also the fold recipe's YAML), and the Python API (`InferenceOptions`, `ModelSpec`, `ModelSettings`).
Before, `ModelSpec` took `True` while the others refused it, each with its own message."""

from __future__ import annotations

import pytest

from lowmem.fastfold.model import InferenceOptions
from lowmem.fastfold.model.options import check_chunk_size
from lowmem.fastfold.run import ModelSpec
from lowmem.fastfold.run.settings import ModelSettings
from lowmem.suite.cli import build_parser, main
from lowmem.suite.commands.fold import fold_settings
from lowmem.utils.errors import InputError

# value (Python and YAML), its command-line text, accepted
CASES = [(True, "True", False), (0, "0", False), (-1, "-1", False), ("auto", "auto", True), (8, "8", True)]


def _line(value) -> str | None:
    """The one check's line for `value` (None when it is accepted)."""
    try:
        check_chunk_size(value)
    except ValueError as exc:
        return str(exc)
    return None


def _typed(text: str):
    """What the flag hands on: its text as a number or 'auto' when it is one, else the text itself."""
    return int(text) if text.lstrip("-").isdigit() else text


def _python(value) -> dict[str, str | None]:
    """Each Python holder's answer: None when it took `value` unchanged, else its refusal."""
    out = {}
    for holder in (InferenceOptions, ModelSpec, ModelSettings):
        try:
            assert holder(chunk_size=value).chunk_size == value
            out[holder.__name__] = None
        except ValueError as exc:
            out[holder.__name__] = str(exc)
    return out


def _from_flag(text: str):
    argv = ["fold", "x.fasta", "--chunk_size", text]
    return fold_settings(build_parser(argv).parse_args(argv)).model.chunk_size


def _config(tmp_path, value):
    config = tmp_path / "fold.yaml"
    config.write_text(f"chunk_size: {value}\n")
    return config


def _from_file(config):
    argv = ["fold", "x.fasta", "--config", str(config)]
    return fold_settings(build_parser(argv).parse_args(argv)).model.chunk_size


@pytest.mark.parametrize(("value", "text", "accepted"), CASES)
def test_one_answer_from_the_flag_the_file_and_python(tmp_path, value, text, accepted):
    line = _line(value)
    assert (line is None) == accepted
    assert _python(value) == dict.fromkeys(("InferenceOptions", "ModelSpec", "ModelSettings"), line)
    config = _config(tmp_path, value)
    if accepted:
        assert _from_flag(text) == value and _from_file(config) == value
        return
    with pytest.raises(InputError) as info:
        _from_file(config)
    assert str(info.value) == f"{config}: {line}"
    # the flag hands on its text when it is no number ('True'): the same check, naming the text as typed
    with pytest.raises(InputError) as info:
        _from_flag(text)
    assert str(info.value) == f"--{_line(_typed(text))}"
    assert _line(_typed(text)) == line or text == "True"


def test_the_line_names_the_value_as_given():
    assert _line(True) == "chunk_size must be a positive int or 'auto', got True"
    assert _line(-1) == "chunk_size must be a positive int or 'auto', got -1"
    assert _line("True") == "chunk_size must be a positive int or 'auto', got 'True'"
    assert _line(None) is None and _line("auto") is None and _line(1) is None


@pytest.mark.parametrize(("value", "text"), [(v, t) for v, t, accepted in CASES if not accepted])
def test_suite_fold_refuses_in_one_line_with_exit_2_before_any_work(tmp_path, capsys, value, text):
    out = tmp_path / "o"
    assert main(["fold", "x.fasta", "--output_dir", str(out), "--chunk_size", text]) == 2
    assert capsys.readouterr().err.splitlines() == [f"suite fold: error: --{_line(_typed(text))}"]
    config = _config(tmp_path, value)
    assert main(["fold", "x.fasta", "--output_dir", str(out), "--config", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"suite fold: error: {config}: {_line(value)}"]
    assert not out.exists()


@pytest.mark.parametrize(("value", "text", "accepted"), CASES)
def test_the_fold_recipe_yaml_gives_the_same_answer(tmp_path, value, text, accepted):
    from lowmem.recipes.fold import recipe_settings

    config = _config(tmp_path, value)
    if accepted:
        assert recipe_settings(config)[0].model.chunk_size == value
        return
    with pytest.raises(InputError) as info:
        recipe_settings(config)
    assert str(info.value) == f"{config}: {_line(value)}"
