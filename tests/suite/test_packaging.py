"""Honest packaging: a diffusion-only install is small (fold and Ray packages are extras), a missing extra is
one line naming it, and every layer raises the same `InputError`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLD_DISTS = {"openmm", "pdbfixer", "matplotlib", "gemmi", "biopython", "hmmer", "modelcif"}


def _name(req: str) -> str:
    return req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()


def test_fold_and_ray_packages_are_extras_not_core_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in meta["dependencies"]}
    extras = meta["optional-dependencies"]
    assert not core & (FOLD_DISTS | {"ray"}), core & (FOLD_DISTS | {"ray"})
    assert {_name(r) for r in extras["fold"]} == FOLD_DISTS
    assert {_name(r) for r in extras["ray"]} == {"ray"}
    assert any(r.startswith("lowmem-suite[") and "fold" in r and "ray" in r for r in extras["test"])
    # every declared requirement has a lower bound (the versions a lowest-version install would pick)
    for req in meta["dependencies"] + extras["fold"] + extras["ray"]:
        assert ">=" in req, f"{req}: no lower bound"


# Child interpreter in which the optional packages cannot be imported, as on a diffusion-only install.
_BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = {"openmm", "pdbfixer", "matplotlib", "gemmi", "Bio", "ray", "pyhmmer"}
    DISTS = {"openmm", "pdbfixer", "matplotlib", "gemmi", "biopython", "ray", "hmmer"}
    class Hide:  # every finder answers "not found" for the blocked packages, as when they are not installed
        def __init__(self, finder):
            self.finder = finder
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                return None
            return self.finder.find_spec(name, path, target)
        def find_distributions(self, *args, **kwargs):  # importlib.metadata: no record of them either
            find = getattr(self.finder, "find_distributions", None)
            for dist in find(*args, **kwargs) if find else ():
                if (dist.metadata["Name"] or "").lower() not in DISTS:
                    yield dist
        def __getattr__(self, attr):
            return getattr(self.finder, attr)
    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
""")


def test_diffusion_and_strategies_work_without_the_fold_and_ray_extras():
    code = _BLOCKER + textwrap.dedent("""
        import contextlib, io, sys
        import lowmem.recipes
        from lowmem.recipes import GeminiStrategy, StableDiffusionFineTune, ZeroStrategy
        from lowmem.diffusion.config import FineTuneConfig
        from lowmem.suite.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["diffusion", "finetune", "--help"])
            except SystemExit as e:
                assert e.code == 0, e.code
        assert "--pretrained_model_name_or_path" in out.getvalue()
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT.parent)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_missing_extra_is_one_line_naming_it_with_exit_code_2(monkeypatch, capsys):
    from lowmem.suite import cli

    fake = types.ModuleType("fake_command")
    fake.add_arguments = lambda parser: None

    def run(args):
        raise ModuleNotFoundError("No module named 'openmm.app'", name="openmm.app")

    fake.run = run
    monkeypatch.setitem(cli.COMMANDS, "fakefold", (".commands._fakefold", "test"))
    monkeypatch.setitem(sys.modules, cli.__package__ + ".commands._fakefold", fake)
    assert cli.main(["fakefold"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "openmm" in err and "lowmem-suite[fold]" in err, err

    def other(args):  # an ImportError of a required package stays a traceback: it is a broken install
        raise ModuleNotFoundError("No module named 'safetensors'", name="safetensors")

    fake.run = other
    with pytest.raises(ModuleNotFoundError):
        cli.main(["fakefold"])


def test_one_input_error_for_every_layer():
    from lowmem.diffusion.errors import InputError as DiffusionInputError
    from lowmem.suite.errors import UsageError
    from lowmem.utils.errors import InputError

    assert DiffusionInputError is InputError and UsageError is InputError
    assert issubclass(InputError, ValueError)
