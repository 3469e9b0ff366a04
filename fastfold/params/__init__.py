"""AlphaFold parameter files <-> the fastfold models: one room for the name tables, the array I/O, the sizes read
from a file, and both model kinds.

- `table`: the pieces both tables are built from (`PREFIX`, `Row`, `Leaf`, `ParamsError`, the row builders);
- `arrays`: AlphaFold-named arrays <-> a model's parameters (`ParamLayout`, `NpzArrays`, the one check);
- `sizes`: a model's sizes from the shapes of a file's arrays;
- `monomer`: AlphaFold2 (`params_model_{1..5}[_ptm].npz`, OpenFold `.pt`): `from_params`, `save_params`, ...;
- `multimer`: AlphaFold-Multimer (`params_model_N_multimer[_v2|_v3].npz`): `multimer.load_model`, ...;
- `checks`: a file checked against the model that must read it, before any work (`check_param_file`).

The AlphaFold2 names are exported here (`from lowmem.fastfold.params import from_params, save_params`);
AlphaFold-Multimer's share their names, so they are reached through their module
(`from lowmem.fastfold.params import multimer; multimer.load_model(path)`).
"""

from __future__ import annotations

from . import monomer
from .checks import check_param_file
from .monomer import *  # noqa: F403 - the AlphaFold2 names, `monomer.__all__`

__all__ = [*monomer.__all__, "check_param_file"]
