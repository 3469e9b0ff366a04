"""Amber relaxation of a predicted structure, as AlphaFold defines it, with OpenMM 8 units.

Protocol (AlphaFold2 suppl. 1.8.6): pdbfixer clean-up (standard residues, missing heavy atoms and
hydrogens), Amber99SB force field without solvent, hydrogen-bond constraints, harmonic restraints on
heavy atoms to their starting positions, energy minimisation; then, while residues violate bond lengths
or clash, those residues lose their restraints and the structure is minimised again.

DISCREPANCY: AlphaFold passes its tolerance as an energy (2.39 kcal/mol); OpenMM 8 takes a force and
rejects an energy. We pass a force, `tolerance` kJ/mol/nm (10 by default, OpenMM's own default and
OpenFold's choice).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import time

import numpy as np

from ..common import residue_constants as rc
from ..io.protein import Protein, to_pdb
from .violations import find_violations

__all__ = ["RelaxConfig", "RelaxResult", "relax_protein"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RelaxConfig:
    """Settings of the Amber relaxation (AlphaFold's values by default)."""

    stiffness: float = 10.0
    """Restraint spring constant on heavy atoms, kcal/mol/Angstrom^2."""
    tolerance: float = 10.0
    """Minimiser convergence: the largest force component, kJ/mol/nm (an OpenMM 8 force)."""
    max_iterations: int = 0
    """Minimiser iterations per pass; 0 runs until converged."""
    max_outer_iterations: int = 20
    """Passes of the violation loop."""
    max_attempts: int = 5
    """Tries of one pass when OpenMM raises (NaN coordinates); each retry jitters the start by 0.2 A x try."""
    platform: str = "auto"
    """OpenMM platform: "auto" (CUDA when present, else CPU), "CPU" or "CUDA"."""

    def __post_init__(self) -> None:
        if self.stiffness < 0:
            raise ValueError(f"RelaxConfig.stiffness must be >= 0, got {self.stiffness}")
        if self.tolerance <= 0:
            raise ValueError(f"RelaxConfig.tolerance must be > 0, got {self.tolerance}")
        for name in ("max_iterations", "max_outer_iterations", "max_attempts"):
            if getattr(self, name) < (0 if name == "max_iterations" else 1):
                raise ValueError(f"RelaxConfig.{name} is out of range: {getattr(self, name)}")
        if self.platform not in ("auto", "CPU", "CUDA"):
            raise ValueError(f"RelaxConfig.platform must be auto, CPU or CUDA, got {self.platform!r}")


@dataclasses.dataclass
class RelaxResult:
    """The relaxed protein (heavy atoms, B-factors kept) and what the relaxation did.

    Energies are kJ/mol; `rmsd` is the heavy-atom RMSD to the input in Angstrom."""

    protein: Protein
    initial_energy: float
    final_energy: float
    violations_before: int
    violations_after: int
    rmsd: float
    outer_iterations: int
    seconds: float

    def summary(self) -> dict[str, float | None]:
        """JSON-ready numbers (a non-finite energy, e.g. of coincident atoms, becomes None)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "protein"}
        return {k: (v if not isinstance(v, float) or np.isfinite(v) else None) for k, v in out.items()}


def _clean(pdb_text: str):
    """pdbfixer: standard residues, no heterogens, missing heavy atoms and hydrogens (pH 7)."""
    import pdbfixer

    fixer = pdbfixer.PDBFixer(pdbfile=io.StringIO(pdb_text))
    fixer.findNonstandardResidues()
    fixer.replaceNonstandardResidues()
    fixer.removeHeterogens(keepWater=False)
    fixer.findMissingResidues()
    fixer.missingResidues = {}  # gaps in the chain stay gaps, as in AlphaFold
    fixer.findMissingAtoms()
    fixer.addMissingAtoms(seed=0)
    fixer.addMissingHydrogens(7.0)
    return fixer.topology, fixer.positions


@functools.lru_cache(maxsize=1)
def _forcefield():
    from openmm import app

    return app.ForceField("amber99sb.xml")


def _platform(name: str):
    import openmm

    if name == "auto":
        names = [openmm.Platform.getPlatform(i).getName() for i in range(openmm.Platform.getNumPlatforms())]
        name = "CUDA" if "CUDA" in names else "CPU"
    return openmm.Platform.getPlatformByName(name)


def _heavy_atom_restraints(topology, positions, stiffness: float, excluded: set[int]):
    """Harmonic restraints (`stiffness` kcal/mol/A^2) of heavy atoms to `positions`, except residues `excluded`."""
    import openmm
    from openmm import unit

    force = openmm.CustomExternalForce("0.5 * k * ((x - x0)^2 + (y - y0)^2 + (z - z0)^2)")
    force.addGlobalParameter("k", stiffness * unit.kilocalories_per_mole / unit.angstroms**2)
    for name in ("x0", "y0", "z0"):
        force.addPerParticleParameter(name)
    for i, atom in enumerate(topology.atoms()):
        if atom.element.symbol != "H" and atom.residue.index not in excluded:
            force.addParticle(i, positions[i])
    return force


def _simulation(topology, positions, excluded: set[int], cfg: RelaxConfig):
    import openmm
    from openmm import app, unit

    system = _forcefield().createSystem(topology, constraints=app.HBonds)
    system.addForce(_heavy_atom_restraints(topology, positions, cfg.stiffness, excluded))
    integrator = openmm.LangevinIntegrator(0 * unit.kelvin, 0.01 / unit.picosecond, 0.0 * unit.picoseconds)
    sim = app.Simulation(topology, system, integrator, _platform(cfg.platform))
    sim.context.setPositions(positions)
    return sim


def _minimize(topology, positions, excluded: set[int], cfg: RelaxConfig):
    """One minimisation pass; returns (energy before, energy after, new positions), energies in kJ/mol."""
    from openmm import unit

    last_error: Exception | None = None
    rng = np.random.default_rng(0)
    start = positions
    for attempt in range(cfg.max_attempts):
        if attempt:
            # DISCREPANCY: AlphaFold retries unchanged; coincident atoms (common in predictions of untrained
            # or collapsed models) give infinite forces every time, so each retry jitters the start.
            xyz = np.asarray(start.value_in_unit(unit.nanometers))
            positions = (xyz + rng.normal(scale=0.02 * attempt, size=xyz.shape)) * unit.nanometers
        try:
            sim = _simulation(topology, positions, excluded, cfg)
            e0 = sim.context.getState(getEnergy=True).getPotentialEnergy().value_in_unit(unit.kilojoules_per_mole)
            tol = cfg.tolerance * unit.kilojoules_per_mole / unit.nanometer
            sim.minimizeEnergy(tolerance=tol, maxIterations=cfg.max_iterations)
            state = sim.context.getState(getEnergy=True, getPositions=True)
            return e0, state.getPotentialEnergy().value_in_unit(unit.kilojoules_per_mole), state.getPositions()
        except Exception as exc:  # noqa: BLE001 - OpenMM raises plain Exceptions on NaN coordinates
            logger.warning("minimisation attempt %d failed: %s", attempt + 1, exc)
            last_error = exc
    raise RuntimeError(f"relaxation failed after {cfg.max_attempts} attempts: {last_error}")


UNTANGLE_ENERGY = 1e8
"""Start energy (kJ/mol) above which overlapping atoms are first pushed apart (see `_untangle`)."""
UNTANGLE_STIFFNESS = 0.1
"""Heavy-atom restraints of the untangle pre-pass, as a fraction of `RelaxConfig.stiffness`: strong enough
that a structure with a few clashes does not drift (unrestrained, an 8-residue peptide moved 2.0-2.3 A;
at 0.1, 1.3-1.6 A; at 1.0, 1.2-1.3 A), weak enough that a collapsed prediction with coincident atoms
actually comes apart (at 1.0 the atoms were pulled back together and the Amber loop needed up to 10
passes: `suite demo`'s fold took 54 s instead of 16-22 s)."""


def _energy(topology, positions, cfg: RelaxConfig) -> float:
    from openmm import unit

    sim = _simulation(topology, positions, set(), cfg)
    return sim.context.getState(getEnergy=True).getPotentialEnergy().value_in_unit(unit.kilojoules_per_mole)


def _untangle(topology, positions, cfg: RelaxConfig):
    """Push overlapping atoms apart with a bounded repulsion (Amber's bonded terms, no Coulomb/LJ).

    DISCREPANCY: not in AlphaFold's protocol. Predictions with coincident atoms (untrained or collapsed
    models) have infinite Lennard-Jones forces, and the minimiser stalls or returns NaN; this pre-pass
    gives the Amber minimisation a finite start. Heavy atoms keep weakened restraints (UNTANGLE_STIFFNESS x
    `cfg.stiffness`), so the structure does not drift. Used only when the start energy exceeds UNTANGLE_ENERGY.
    """
    import openmm
    from openmm import app, unit

    system = _forcefield().createSystem(topology)
    for i in reversed(range(system.getNumForces())):
        if isinstance(system.getForce(i), openmm.NonbondedForce):
            system.removeForce(i)
    repulsion = openmm.CustomNonbondedForce("k_rep * step(d - r) * (d - r)^2; d = 0.3")
    repulsion.addGlobalParameter("k_rep", 2e4)
    for _ in range(system.getNumParticles()):
        repulsion.addParticle([])
    repulsion.createExclusionsFromBonds([(b[0].index, b[1].index) for b in topology.bonds()], 3)
    system.addForce(repulsion)
    # weakened heavy-atom restraints: overlapping atoms separate, the fold stays put
    system.addForce(_heavy_atom_restraints(topology, positions, UNTANGLE_STIFFNESS * cfg.stiffness, set()))
    xyz = np.asarray(positions.value_in_unit(unit.nanometers))
    xyz = xyz + np.random.default_rng(0).normal(scale=0.01, size=xyz.shape)  # breaks exact coincidences
    integrator = openmm.LangevinIntegrator(0 * unit.kelvin, 0.01 / unit.picosecond, 0.0 * unit.picoseconds)
    sim = app.Simulation(topology, system, integrator, _platform(cfg.platform))
    sim.context.setPositions(xyz * unit.nanometers)
    sim.minimizeEnergy(tolerance=cfg.tolerance * unit.kilojoules_per_mole / unit.nanometer, maxIterations=2000)
    return sim.context.getState(getPositions=True).getPositions(asNumpy=True)


def _to_atom37(topology, positions, like: Protein) -> Protein:
    """Heavy atoms of the OpenMM structure in atom37 layout, B-factors copied per residue from `like`."""
    from openmm import unit

    xyz = np.asarray(positions.value_in_unit(unit.angstroms))
    pos = np.zeros_like(like.atom_positions)
    mask = np.zeros_like(like.atom_mask)
    for residue in topology.residues():
        i = residue.index
        for atom in residue.atoms():
            if atom.element.symbol != "H" and atom.name in rc.atom_order:
                pos[i, rc.atom_order[atom.name]] = xyz[atom.index]
                mask[i, rc.atom_order[atom.name]] = 1.0
    b = np.repeat(like.b_factors.max(axis=1, keepdims=True), 37, axis=1)
    return Protein(pos, mask, like.aatype, like.residue_index, b)


def _violations(p: Protein) -> np.ndarray:
    return find_violations(p.atom_positions, p.atom_mask, p.aatype, p.residue_index)


def _rmsd(a: Protein, b: Protein) -> float:
    both = (a.atom_mask > 0.5) & (b.atom_mask > 0.5)
    diff = a.atom_positions[both] - b.atom_positions[both]
    return float(np.sqrt((diff**2).sum(-1).mean())) if len(diff) else 0.0


def relax_protein(protein: Protein, config: RelaxConfig | None = None) -> RelaxResult:
    """Relax `protein` (atom37, heavy atoms) with the violation loop; see the module docstring."""
    cfg = config or RelaxConfig()
    t0 = time.perf_counter()
    before = int(_violations(protein).sum())
    topology, positions = _clean(to_pdb(protein))
    initial_energy = _energy(topology, positions, cfg)
    if not np.isfinite(initial_energy) or initial_energy > UNTANGLE_ENERGY:
        logger.warning("start energy %.3g kJ/mol: pushing overlapping atoms apart first", initial_energy)
        positions = _untangle(topology, positions, cfg)
    excluded: set[int] = set()
    current = protein
    for outer in range(1, cfg.max_outer_iterations + 1):
        e0, e1, positions = _minimize(topology, positions, excluded, cfg)
        current = _to_atom37(topology, positions, protein)
        bad = _violations(current)
        logger.info("relax pass %d: energy %.1f -> %.1f kJ/mol, %d violating residues", outer, e0, e1, bad.sum())
        if not bad.any():
            break
        excluded |= {int(i) for i in np.nonzero(bad)[0]}
    return RelaxResult(
        protein=current, initial_energy=float(initial_energy), final_energy=float(e1),
        violations_before=before, violations_after=int(bad.sum()), rmsd=_rmsd(current, protein),
        outer_iterations=outer, seconds=time.perf_counter() - t0,
    )
