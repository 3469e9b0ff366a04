"""The keywords of `ZeroStrategy` / `GeminiStrategy`, generated from their config dataclasses.

Every field of `core_parallel.ZeroConfig` / `GeminiConfig` (but `precision`, which is the Trainer's) is an explicit,
typed, documented keyword of the strategy: `declare_keywords` writes the strategy's `__init__.__signature__` from the
dataclass fields (their type hints, defaults and attribute docstrings) and appends their documentation to the class
docstring's `Args:` section. The dataclass is the one source, so a new config field is a new strategy keyword with no
second list to keep in step. Tools that read signatures (LightningCLI / jsonargparse, `help()`, `inspect`) see
`GeminiStrategy(chunk_mb: float | None = None, ...)`, and a YAML

```yaml
trainer:
  strategy:
    class_path: lowmem.recipes.GeminiStrategy
    init_args: {offload: cpu, chunk_mb: 1}
```

is typed and checked as Python is: the strategy builds the config, whose `__post_init__` gives the same one-line
`InputError` naming the field.

Signature tools pass every keyword, defaults included. A keyword at its signature default therefore counts as not
given (`keywords_given`): beside `config=` only the ones that differ are refused, and Gemini's static offload
fractions default to None ("0.0, or 1.0 under offload='cpu'/'nvme'") so that an explicit value is told apart.
The Lightning strategy arguments the sharded strategies use (`accelerator`, `cluster_environment`,
`process_group_backend`, ...) are taken from `DDPStrategy`'s own signature; the DDP wrapper's (`ddp_comm_hook`, ...)
are left out, as no wrapper is built.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

__all__ = ["LIGHTNING_KEYWORDS", "config_keywords", "declare_keywords", "field_docs", "keywords_given"]

_DDP_WRAPPER_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period", "timeout")


def _lightning_parameters() -> list[inspect.Parameter]:
    hints = typing.get_type_hints(DDPStrategy.__init__)
    params = []
    for p in inspect.signature(DDPStrategy.__init__).parameters.values():
        if p.name == "self" or p.name in _DDP_WRAPPER_ONLY or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        params.append(p.replace(kind=p.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)))
    return params


LIGHTNING_KEYWORDS: tuple[str, ...] = tuple(p.name for p in _lightning_parameters())
"""The Lightning strategy arguments the sharded strategies take and pass on to `DDPStrategy`."""


def field_docs(config_cls: type) -> dict[str, str]:
    """The attribute docstring of each field of the dataclass `config_cls` (the string literal after it), one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def config_keywords(config_cls: type, skip: tuple[str, ...] = ("precision",),
                    overrides: dict[str, tuple[Any, Any]] | None = None) -> list[inspect.Parameter]:
    """One keyword-only parameter per field of `config_cls` (but `skip`), with its type hint and default;
    `overrides` maps a field to its (annotation, default) on the strategy."""
    hints = typing.get_type_hints(config_cls)
    overrides = overrides or {}
    params = []
    for f in dataclasses.fields(config_cls):
        if f.name in skip or not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        annotation, default = overrides.get(f.name, (hints[f.name], default))
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
    return params


def declare_keywords(cls: type, config_cls: type, overrides: dict[str, tuple[Any, Any, str]] | None = None) -> None:
    """Give `cls.__init__` (which takes the config fields in `**kwargs`) the signature: its own named parameters,
    every field of `config_cls` (`config_keywords`), then `LIGHTNING_KEYWORDS`; and document the fields under the
    class docstring's `Args:`. `overrides`: field -> (annotation, default, doc) where the strategy's keyword differs
    from the field (a default that means "decided by another keyword")."""
    init = cls.__init__
    hints = typing.get_type_hints(init)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in own}
    overrides = overrides or {}
    fields = [p for p in config_keywords(config_cls, overrides={k: v[:2] for k, v in overrides.items()})
              if p.name not in names]
    lightning = [p for p in _lightning_parameters() if p.name not in names]
    init.__signature__ = inspect.Signature([*own, *fields, *lightning])  # type: ignore[attr-defined]
    docs = field_docs(config_cls)
    doc = inspect.cleandoc(cls.__doc__ or "")
    if "Args:" not in doc:
        doc += "\n\nArgs:"
    documented = {line.strip().partition(":")[0] for line in doc.partition("Args:")[2].splitlines()}
    lines = [f"    {p.name}: {overrides[p.name][2] if p.name in overrides else docs.get(p.name, '')}".rstrip()
             for p in fields if p.name not in documented]
    lines += [f"    {p.name}: Lightning's `DDPStrategy` argument, passed on." for p in lightning]
    cls.__doc__ = doc + "\n" + "\n".join(lines) + "\n"


def keywords_given(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less those equal to their default in `cls.__init__`'s signature (a signature tool passes them all)."""
    params = inspect.signature(cls.__init__).parameters
    given = {}
    for name, value in kwargs.items():
        p = params.get(name)
        if p is None or p.default is inspect.Parameter.empty or not _same(value, p.default):
            given[name] = value
    return given


def _same(value: Any, default: Any) -> bool:
    if type(value) is not type(default):  # 1 == 1.0 == True: an explicit True for a 1 is still given
        return False
    try:
        return bool(value == default)
    except Exception:  # a tensor or an object without a plain ==
        return False
