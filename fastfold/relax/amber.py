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

__all__ = ["RelaxConfig", "RelaxResult", "chirality", "cis_peptides", "relax_protein"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class RelaxConfig:
    """Settings of the Amber relaxation (AlphaFold's values by default)."""

    stiffness: float = 10.0
    """Restraint spring constant on heavy atoms, kcal/mol/Angstrom^2."""
    tolerance: float = 10.0
    """Minimiser convergence: the largest force component, kJ/mol/nm (an OpenMM 8 force)."""
    max_iterations: int = 0
    """Optional cap on the minimiser's iterations per pass; 0 (AlphaFold's) runs until converged. OpenMM 8
    minimises in rounds of stiffening constraints and applies the cap to each round, so one pass may run a few
    times this many; a pass whose last round reached the cap is logged `iteration_capped`, and when it is the
    last pass the result is reported unconverged (stopped "iteration cap", or "pass limit" with the cap named)."""
    max_outer_iterations: int = 20
    """Passes of the violation loop."""
    max_attempts: int = 5
    """Tries of one pass when OpenMM raises (NaN coordinates); each retry jitters the start by 0.2 A x try."""
    platform: str = "auto"
    """OpenMM platform: "auto" (CUDA when present, else CPU), "CPU" or "CUDA"."""
    max_seconds: float | None = None
    """Time budget of the whole relaxation (pdbfixer, untangling, every pass): no new pass starts after this many
    seconds, and a minimisation still running then is stopped (the result is reported unconverged). None: passes
    only, `max_outer_iterations`."""

    def __post_init__(self) -> None:
        if self.stiffness < 0:
            raise ValueError(f"RelaxConfig.stiffness must be >= 0, got {self.stiffness}")
        if self.tolerance <= 0:
            raise ValueError(f"RelaxConfig.tolerance must be > 0, got {self.tolerance}")
        for name in ("max_iterations", "max_outer_iterations", "max_attempts"):
            if getattr(self, name) < (0 if name == "max_iterations" else 1):
                raise ValueError(f"RelaxConfig.{name} is out of range: {getattr(self, name)}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"RelaxConfig.max_seconds must be > 0, got {self.max_seconds}")
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
    stopped: str = "converged"
    """Why the violation loop ended: "converged" (no violating residue left), "pass limit", "time budget",
    "iteration cap" (no violating residue left, but the last minimisation stopped at `RelaxConfig.max_iterations`
    before reaching its tolerance), or "stalled" (a pass left every position as it was and freed no residue:
    later passes would repeat it exactly)."""
    chirality_changed: list[int] = dataclasses.field(default_factory=list)
    """Residue numbers whose CA chirality (L/D) differs from the input's: the relaxed file is not to be used."""
    cis_changed: list[int] = dataclasses.field(default_factory=list)
    """Residue numbers i whose peptide bond to i+1 turned cis <-> trans."""
    passes: list[dict] = dataclasses.field(default_factory=list)
    """Per pass: energy before/after (kJ/mol), violating residues after, minimiser iterations, seconds,
    `cut_short` (the time budget stopped the minimiser before it converged) and `iteration_capped` (its last
    round of minimisation reached `RelaxConfig.max_iterations`)."""
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds of the stages before the passes: `clean` (pdbfixer), `untangle` (0 when not needed)."""

    @property
    def converged(self) -> bool:
        """No violating residue left, and the last minimisation ran to its end (not cut by the time budget, not
        stopped at the iteration cap)."""
        return self.violations_after == 0 and self.stopped == "converged"

    @property
    def problem(self) -> str:
        """Why this relaxed structure is not to be trusted, in one line ("" when it is)."""
        if self.chirality_changed or self.cis_changed:
            parts = []
            if self.chirality_changed:
                parts.append(f"chirality changed at residue(s) {_short(self.chirality_changed)}")
            if self.cis_changed:
                parts.append(f"cis/trans peptide changed after residue(s) {_short(self.cis_changed)}")
            return "broke the structure: " + "; ".join(parts)
        if not self.converged:
            last = self.passes[-1] if self.passes else {}
            cut = (", its last minimisation cut short" if last.get("cut_short")
                   else ", its last minimisation stopped at the iteration cap" if last.get("iteration_capped") else "")
            return (f"not converged: {self.violations_after} violating residue(s) after {self.outer_iterations} "
                    f"pass(es) ({self.stopped}{cut})")
        return ""

    def summary(self) -> dict[str, float | None]:
        """JSON-ready numbers (a non-finite energy, e.g. of coincident atoms, becomes None), `converged` and
        `problem` ("" when the relaxed structure can be used)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "protein"}
        out = {k: (v if not isinstance(v, float) or np.isfinite(v) else None) for k, v in out.items()}
        return {**out, "converged": self.converged, "problem": self.problem}


def _short(numbers: list[int], limit: int = 8) -> str:
    text = ", ".join(str(n) for n in numbers[:limit])
    return text + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def chirality(p: Protein) -> np.ndarray:
    """Per residue: +1 for an L, -1 for a D amino acid, 0 where it is undefined (glycine, missing N/CA/C/CB).
    The sign of the triple product (N - CA) x (C - CA) . (CB - CA), which is positive for L (all 81 of
    PDB 4ZEY chain A)."""
    n, ca, c, cb = (rc.atom_order[a] for a in ("N", "CA", "C", "CB"))
    x = p.atom_positions
    vol = np.einsum("ij,ij->i", np.cross(x[:, n] - x[:, ca], x[:, c] - x[:, ca]), x[:, cb] - x[:, ca])
    present = (p.atom_mask[:, [n, ca, c, cb]] > 0.5).all(-1)
    return np.where(present & (np.abs(vol) > 1e-3), np.sign(vol), 0).astype(np.int64)


def cis_peptides(p: Protein) -> np.ndarray:
    """Per residue i, its peptide bond to i+1: +1 cis (omega CA-C-N-CA within 30 degrees of 0), -1 trans (within
    30 degrees of 180), 0 distorted or
    undefined (i+1 not the next residue, atoms missing, or C-N not bonded: longer than 2 Angstrom)."""
    ca, c, n = (rc.atom_order[a] for a in ("CA", "C", "N"))
    x, m = p.atom_positions, p.atom_mask > 0.5
    out = np.zeros(len(p.aatype), np.int64)
    if len(p.aatype) < 2:
        return out
    # every peptide bond i -> i+1 at once
    b0, b1, b2 = x[:-1, c] - x[:-1, ca], x[1:, n] - x[:-1, c], x[1:, ca] - x[1:, n]
    length = np.linalg.norm(b1, axis=-1)
    ok = ((np.diff(p.peptide_numbers()) == 1) & m[:-1, ca] & m[:-1, c] & m[1:, n] & m[1:, ca]
          & (length > 0.5) & (length < 2.0))
    n0, n1 = np.cross(b0, b1), np.cross(b1, b2)
    unit_b1 = b1 / np.where(length > 0, length, 1.0)[:, None]
    omega = np.degrees(np.arctan2(np.einsum("ij,ij->i", np.cross(n0, n1), unit_b1), np.einsum("ij,ij->i", n0, n1)))
    out[:-1] = np.where(ok, np.where(np.abs(omega) < 30.0, 1, np.where(np.abs(omega) > 150.0, -1, 0)), 0)
    return out


def _clean(pdb_text: str, platform: str = "CPU"):
    """pdbfixer: standard residues, no heterogens, missing heavy atoms and hydrogens (pH 7)."""
    import random

    import pdbfixer

    fixer = pdbfixer.PDBFixer(pdbfile=io.StringIO(pdb_text))
    fixer.platform = _platform(platform)
    fixer.findNonstandardResidues()
    fixer.replaceNonstandardResidues()
    fixer.removeHeterogens(keepWater=False)
    fixer.findMissingResidues()
    fixer.missingResidues = {}  # gaps in the chain stay gaps, as in AlphaFold
    fixer.findMissingAtoms()
    fixer.addMissingAtoms(seed=1)  # OpenMM takes seed 0 as "a new seed every time"
    # OpenMM's Modeller starts hydrogens at positions from Python's global `random`: seeded here (and the
    # caller's state given back), so the same input gets the same hydrogens, hence the same relaxed structure
    state = random.getstate()
    random.seed(0)
    try:
        fixer.addMissingHydrogens(7.0)
    except ValueError as exc:
        # OpenMM picks each histidine's tautomer by an H-bond test, acos(dot(u, v)) of two unit vectors, which
        # raises "math domain error" when atoms in line make the rounded dot product exceed 1 (the tiny random
        # model's predictions of tests/assets/fold/query.fasta, histidine-rich, hit it): name the tautomer
        logger.warning("pdbfixer's hydrogens failed (%s): histidines given their HIE tautomer", exc)
        _add_hydrogens_histidines_as_hie(fixer)
    finally:
        random.setstate(state)
    return fixer.topology, fixer.positions


def _add_hydrogens_histidines_as_hie(fixer) -> None:
    """pdbfixer's `addMissingHydrogens(7.0)` for standard residues with every histidine's variant named (HIE,
    the commoner tautomer at pH 7), which skips OpenMM's H-bond test."""
    from openmm import app

    modeller = app.Modeller(fixer.topology, fixer.positions)
    variants = ["HIE" if r.name == "HIS" else None for r in modeller.topology.residues()]
    modeller.addHydrogens(pH=7.0, variants=variants, platform=fixer.platform)
    fixer.topology, fixer.positions = modeller.topology, modeller.positions


@functools.lru_cache(maxsize=1)
def _forcefield():
    from openmm import app

    forcefield = app.ForceField("amber99sb.xml")
    _add_free_amino_acid_templates(forcefield)
    return forcefield


def _add_free_amino_acid_templates(forcefield) -> None:
    """A template per amino acid that is both N- and C-terminal (a one-residue chain: pdbfixer gives it H1-H3 and
    OXT), which Amber99SB lacks ("No template found ... 2 H atoms too many"). DISCREPANCY: built from the
    force field's own terminal templates, N-terminal atom types up to CA's side chain and C-terminal ones for C,
    O, OXT, so the net charge is close to, not exactly, the zwitterion's 0; the restrained minimisation of a lone
    residue needs no better."""
    from openmm import app

    templates = forcefield._templates
    for name, n_term in list(templates.items()):
        c_term = templates.get("C" + name[1:])
        if not name.startswith("N") or len(name) != 4 or c_term is None or "Z" + name[1:] in templates:
            continue
        c_types = {a.name: (a.type, a.element) for a in c_term.atoms}
        if not {"C", "O", "OXT"} <= set(c_types):
            continue
        free = app.ForceField._TemplateData("Z" + name[1:])
        for atom in n_term.atoms:
            kind, element = c_types[atom.name] if atom.name in ("C", "O") else (atom.type, atom.element)
            free.addAtom(app.ForceField._TemplateAtomData(atom.name, kind, element))
        free.addAtom(app.ForceField._TemplateAtomData("OXT", *c_types["OXT"]))
        for i, j in n_term.bonds:
            free.addBond(i, j)
        free.addBondByName("C", "OXT")
        forcefield.registerResidueTemplate(free)


def _platform(name: str):
    import openmm

    if name == "auto":
        names = [openmm.Platform.getPlatform(i).getName() for i in range(openmm.Platform.getNumPlatforms())]
        name = "CUDA" if "CUDA" in names else "CPU"
    platform = openmm.Platform.getPlatformByName(name)
    # same input, same output: force sums in a fixed order, and one CPU thread (OpenMM's CPU results depend on
    # how the atoms are split over threads: 0.01 A apart run to run on 2 threads, identical on one). Defaults
    # of the platform, so they also hold for the contexts pdbfixer and its Modeller make.
    if "DeterministicForces" in platform.getPropertyNames():
        platform.setPropertyDefaultValue("DeterministicForces", "true")
    if name == "CPU":
        platform.setPropertyDefaultValue("Threads", "1")
    return platform


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


CHIRALITY_STIFFNESS = 1e8
"""kJ/mol/nm^6 of the flat-bottom chirality term (`_chirality_force`): zero while a residue keeps its
handedness with a CA volume of at least CHIRALITY_MARGIN, about 100 kJ/mol at the planar configuration."""
CHIRALITY_MARGIN = 1e-3
"""nm^3 (1 A^3; an ideal CA tetrahedron has about 2.5 A^3)."""


def _chirality_force(topology, signs: np.ndarray | None):
    """A flat-bottom term that keeps each residue's CA handedness (`signs`: +1 L, -1 D, 0 free; per residue).

    DISCREPANCY: not in AlphaFold's protocol, whose Amber force field has no term that holds chirality (bond
    angles are mirror-symmetric). For a sound start it is zero and changes nothing; a start with coincident
    atoms (untrained or collapsed predictions) otherwise comes apart with D residues (issue 21: half of them)."""
    import openmm

    if signs is None or not np.any(signs):
        return None
    a = "ax=x1-x2; ay=y1-y2; az=z1-z2; bx=x3-x2; by=y3-y2; bz=z3-z2; cx=x4-x2; cy=y4-y2; cz=z4-z2"
    force = openmm.CustomCompoundBondForce(
        4, f"k_chir * min(0, s * v - v0)^2; v = (ay*bz - az*by)*cx + (az*bx - ax*bz)*cy + (ax*by - ay*bx)*cz; {a}")
    force.addGlobalParameter("k_chir", CHIRALITY_STIFFNESS)
    force.addGlobalParameter("v0", CHIRALITY_MARGIN)
    force.addPerBondParameter("s")
    for residue in topology.residues():
        sign = int(signs[residue.index]) if residue.index < len(signs) else 0
        atoms = {atom.name: atom.index for atom in residue.atoms()}
        if sign and all(n in atoms for n in ("N", "CA", "C", "CB")):
            force.addBond([atoms["N"], atoms["CA"], atoms["C"], atoms["CB"]], [float(sign)])
    return force if force.getNumBonds() else None


def _simulation(topology, positions, excluded: set[int], cfg: RelaxConfig, signs: np.ndarray | None = None):
    import openmm
    from openmm import app, unit

    system = _forcefield().createSystem(topology, constraints=app.HBonds)
    system.addForce(_heavy_atom_restraints(topology, positions, cfg.stiffness, excluded))
    chirality_force = _chirality_force(topology, signs)
    if chirality_force is not None:
        system.addForce(chirality_force)
    integrator = openmm.LangevinIntegrator(0 * unit.kelvin, 0.01 / unit.picosecond, 0.0 * unit.picoseconds)
    platform = _platform(cfg.platform)
    sim = app.Simulation(topology, system, integrator, platform, _deterministic(platform))
    sim.context.setPositions(positions)
    return sim


def _deterministic(platform) -> dict[str, str]:
    """Platform properties that make force sums independent of thread scheduling: same input, same output."""
    return {"DeterministicForces": "true"} if "DeterministicForces" in platform.getPropertyNames() else {}


def _budget_reporter(deadline: float | None, max_iterations: int = 0):
    """A MinimizationReporter that counts iterations and stops the minimiser once `deadline` (perf_counter) is
    past; `.iterations` (all rounds), `.cut_short`, and `.capped`: the last round of OpenMM's constraint
    stiffening (whose iteration numbers restart at 0) reached `max_iterations` (> 0)."""
    import openmm

    class _Budget(openmm.MinimizationReporter):
        def __init__(self):
            super().__init__()
            self.iterations = 0
            self.cut_short = False
            self.round_iterations = 0

        @property
        def capped(self) -> bool:
            return max_iterations > 0 and not self.cut_short and self.round_iterations >= max_iterations

        def report(self, iteration, x, grad, args):  # noqa: ARG002 - OpenMM's signature
            self.iterations += 1
            self.round_iterations = iteration + 1
            if deadline is not None and time.perf_counter() > deadline:
                self.cut_short = True
                return True
            return False

    return _Budget()


def _minimize(topology, positions, excluded: set[int], cfg: RelaxConfig, signs: np.ndarray | None = None,
              deadline: float | None = None):
    """One minimisation pass; returns (energy before, energy after, new positions, minimiser iterations, cut
    short by `deadline`, stopped at `cfg.max_iterations`), energies in kJ/mol."""
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
            sim = _simulation(topology, positions, excluded, cfg, signs)
            e0 = sim.context.getState(getEnergy=True).getPotentialEnergy().value_in_unit(unit.kilojoules_per_mole)
            tol = cfg.tolerance * unit.kilojoules_per_mole / unit.nanometer
            reporter = _budget_reporter(deadline, cfg.max_iterations)
            sim.minimizeEnergy(tolerance=tol, maxIterations=cfg.max_iterations, reporter=reporter)
            state = sim.context.getState(getEnergy=True, getPositions=True)
            return (e0, state.getPotentialEnergy().value_in_unit(unit.kilojoules_per_mole), state.getPositions(),
                    reporter.iterations, reporter.cut_short, reporter.capped)
        except Exception as exc:  # noqa: BLE001 - OpenMM raises plain Exceptions on NaN coordinates
            logger.warning("minimisation attempt %d failed: %s", attempt + 1, exc)
            last_error = exc
    raise RuntimeError(f"relaxation failed after {cfg.max_attempts} attempts: {last_error}")


UNTANGLE_ENERGY = 1e8
"""Start energy (kJ/mol) above which overlapping atoms are first pushed apart (see `_untangle`)."""
UNTANGLE_RANGE = 0.3
"""nm: the bounded repulsion of `_untangle` pushes atoms apart that are closer than this."""
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


def _untangle(topology, positions, cfg: RelaxConfig, signs: np.ndarray | None = None, deadline: float | None = None):
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
    repulsion = openmm.CustomNonbondedForce(f"k_rep * step(d - r) * (d - r)^2; d = {UNTANGLE_RANGE}")
    repulsion.addGlobalParameter("k_rep", 2e4)
    # the repulsion is zero beyond UNTANGLE_RANGE: a cutoff there changes no energy and no force, and the
    # neighbour list makes each evaluation O(N) instead of O(N^2) (214 residues: 106 s -> see docs/fold.md)
    repulsion.setNonbondedMethod(openmm.CustomNonbondedForce.CutoffNonPeriodic)
    repulsion.setCutoffDistance(UNTANGLE_RANGE)
    for _ in range(system.getNumParticles()):
        repulsion.addParticle([])
    repulsion.createExclusionsFromBonds([(b[0].index, b[1].index) for b in topology.bonds()], 3)
    system.addForce(repulsion)
    # weakened heavy-atom restraints: overlapping atoms separate, the fold stays put
    system.addForce(_heavy_atom_restraints(topology, positions, UNTANGLE_STIFFNESS * cfg.stiffness, set()))
    chirality_force = _chirality_force(topology, signs)
    if chirality_force is not None:
        system.addForce(chirality_force)
    xyz = np.asarray(positions.value_in_unit(unit.nanometers))
    xyz = xyz + np.random.default_rng(0).normal(scale=0.01, size=xyz.shape)  # breaks exact coincidences
    integrator = openmm.LangevinIntegrator(0 * unit.kelvin, 0.01 / unit.picosecond, 0.0 * unit.picoseconds)
    platform = _platform(cfg.platform)
    sim = app.Simulation(topology, system, integrator, platform, _deterministic(platform))
    sim.context.setPositions(xyz * unit.nanometers)
    sim.minimizeEnergy(tolerance=cfg.tolerance * unit.kilojoules_per_mole / unit.nanometer, maxIterations=2000,
                       reporter=_budget_reporter(deadline))
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
    return dataclasses.replace(like, atom_positions=pos, atom_mask=mask, b_factors=b)


def _violations(p: Protein) -> np.ndarray:
    # chain k's residue numbers shifted past chain k-1's: a chain break is not a broken peptide bond
    return find_violations(p.atom_positions, p.atom_mask, p.aatype, p.peptide_numbers())


def _rmsd(a: Protein, b: Protein) -> float:
    both = (a.atom_mask > 0.5) & (b.atom_mask > 0.5)
    diff = a.atom_positions[both] - b.atom_positions[both]
    return float(np.sqrt((diff**2).sum(-1).mean())) if len(diff) else 0.0


def relax_protein(protein: Protein, config: RelaxConfig | None = None) -> RelaxResult:
    """Relax `protein` (atom37, heavy atoms) with the violation loop; see the module docstring."""
    cfg = config or RelaxConfig()
    t0 = time.perf_counter()
    deadline = None if cfg.max_seconds is None else t0 + cfg.max_seconds
    before = int(_violations(protein).sum())
    topology, positions = _clean(to_pdb(protein), cfg.platform)
    signs = chirality(protein)  # kept through every pass (`_chirality_force`)
    initial_energy = _energy(topology, positions, cfg)
    stages = {"clean": round(time.perf_counter() - t0, 3), "untangle": 0.0}
    if not np.isfinite(initial_energy) or initial_energy > UNTANGLE_ENERGY:
        logger.warning("start energy %.3g kJ/mol: pushing overlapping atoms apart first", initial_energy)
        t_untangle = time.perf_counter()
        positions = _untangle(topology, positions, cfg, signs, deadline)
        stages["untangle"] = round(time.perf_counter() - t_untangle, 3)
    excluded: set[int] = set()
    current = protein
    passes: list[dict] = []
    stopped = "pass limit"
    for outer in range(1, cfg.max_outer_iterations + 1):
        t_pass = time.perf_counter()
        start = _xyz(positions)
        e0, e1, positions, iterations, cut_short, capped = _minimize(topology, positions, excluded, cfg, signs,
                                                                     deadline)
        current = _to_atom37(topology, positions, protein)
        bad = _violations(current)
        passes.append({"pass": outer, "energy_before": _finite(e0), "energy_after": _finite(e1),
                       "violating_residues": int(bad.sum()), "iterations": iterations, "cut_short": cut_short,
                       "iteration_capped": capped, "seconds": round(time.perf_counter() - t_pass, 3)})
        logger.info("relax pass %d: energy %.1f -> %.1f kJ/mol, %d violating residues, %d iterations%s, %.1f s",
                    outer, e0, e1, bad.sum(), iterations,
                    " (cut short by the time budget)" if cut_short else " (stopped at the iteration cap)" if capped
                    else "", passes[-1]["seconds"])
        if cut_short or (deadline is not None and bad.any() and time.perf_counter() > deadline):
            stopped = "time budget"
            break
        if not bad.any():
            # free of violations; "converged" only when the minimiser also reached its tolerance
            stopped = "iteration cap" if capped else "converged"
            break
        newly = {int(i) for i in np.nonzero(bad)[0]} - excluded
        if not newly and np.array_equal(_xyz(positions), start):
            # the next pass would start from the same positions with the same restraints: it, and every later
            # one, would repeat this one exactly (deterministic platform), so the pass limit's result is this one
            stopped = "stalled"
            break
        excluded |= newly
    numbers = protein.residue_index
    before_l, after_l = chirality(protein), chirality(current)
    flipped = (before_l != 0) & (after_l != 0) & (before_l != after_l)
    cis_before, cis_after = cis_peptides(protein), cis_peptides(current)
    cis = (cis_before != 0) & (cis_after != 0) & (cis_before != cis_after)
    result = RelaxResult(
        protein=current, initial_energy=float(initial_energy), final_energy=float(e1),
        violations_before=before, violations_after=int(bad.sum()), rmsd=_rmsd(current, protein),
        outer_iterations=outer, seconds=time.perf_counter() - t0, stopped=stopped,
        chirality_changed=[int(k) for k in numbers[flipped]], cis_changed=[int(k) for k in numbers[cis]],
        passes=passes, stage_seconds=stages,
    )
    if result.problem:
        logger.warning("relaxation %s", result.problem)
    return result


def _xyz(positions) -> np.ndarray:
    from openmm import unit

    return np.asarray(positions.value_in_unit(unit.nanometers), dtype=np.float64)


def _finite(x: float) -> float | None:
    return round(float(x), 3) if np.isfinite(x) else None
