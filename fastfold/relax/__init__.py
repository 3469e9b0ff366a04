"""OpenMM/pdbfixer Amber relaxation of predicted structures (AlphaFold's protocol, OpenMM 8 units)."""

from .amber import RelaxConfig, RelaxResult, relax_protein

__all__ = ["RelaxConfig", "RelaxResult", "relax_protein"]
