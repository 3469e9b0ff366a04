"""One target's database searches as a list of jobs: what `run_alignment_tools` runs one after another and the
feature workflow (`fastfold.run.workflow`) runs as parallel Ray tasks, so both paths run the same commands and write
the same files.

Jobs (AlphaFold's monomer pipeline, plus the UniProt search of a complex's chains): jackhmmer on UniRef90 ->
`uniref90_hits.sto`, jackhmmer on MGnify -> `mgnify_hits.sto`, HHblits on BFD + UniRef30 ->
`bfd_uniref_hits.a3m`, jackhmmer on UniProt -> `uniprot_hits.sto`; then HHsearch on PDB70 ->
`pdb70_hits.hhr`, whose input is the UniRef90 result (`SearchJob.after`). A job whose result file exists is
not listed (the cache: a result is reused as long as the run's fingerprint, which names every database, is the
same; a changed fingerprint makes `suite fold` forget the target's folder first).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .alignment_files import UNIPROT_HITS

__all__ = ["SearchJob", "search_jobs", "tool_cpus"]


@dataclasses.dataclass(frozen=True)
class SearchJob:
    """One tool run of one target, writing one result file atomically."""

    tool: str
    """"jackhmmer", "hhblits" or "hhsearch"."""
    binary: str
    """The executable as configured (resolved with `tools.find_binary` where the job runs)."""
    sequence: str
    """The query."""
    databases: tuple[str, ...]
    """Database paths (FASTA for jackhmmer, ffindex prefixes for HH-suite)."""
    output: str
    """The result file."""
    after: str | None = None
    """File name of the job whose result is this job's input (HHsearch reads the UniRef90 alignment)."""

    @property
    def name(self) -> str:
        return Path(self.output).name

    def run(self, cpus: int) -> str:
        """Run the tool with `cpus` threads; returns the result file."""
        from . import tools

        binary = tools.find_binary(self.binary, self.tool)
        if self.tool == "jackhmmer":
            tools.run_jackhmmer(binary, self.sequence, self.databases[0], self.output, cpus)
        elif self.tool == "hhblits":
            tools.run_hhblits(binary, self.sequence, list(self.databases), self.output, cpus)
        elif self.tool == "hhsearch":
            from .alignment_files import MAX_HITS, read_msa

            source = Path(self.output).with_name(self.after or "")
            a3m = tools.msa_to_a3m(read_msa(source).truncate(MAX_HITS[source.name]))
            tools.run_hhsearch(binary, a3m, self.databases[0], self.output)
        else:
            raise ValueError(f"SearchJob.tool: unknown tool {self.tool!r}")
        return self.output


def search_jobs(sequence: str, cfg, folder: str | Path) -> list[SearchJob]:
    """The searches `cfg` (an `AlignmentConfig`) asks for whose result is not in `folder` yet, independent ones
    first; HHsearch is listed when its input exists or is among the jobs."""
    folder = Path(folder)
    jobs = []

    def add(tool, binary, dbs, name, after=None):
        if dbs and all(dbs) and not (folder / name).exists():
            jobs.append(SearchJob(tool, binary, sequence, tuple(dbs), str(folder / name), after))

    add("jackhmmer", cfg.jackhmmer_binary_path, [cfg.uniref90_database_path], "uniref90_hits.sto")
    add("jackhmmer", cfg.jackhmmer_binary_path, [cfg.mgnify_database_path], "mgnify_hits.sto")
    if cfg.bfd_database_path:
        dbs = [d for d in (cfg.bfd_database_path, cfg.uniref30_database_path) if d]
        add("hhblits", cfg.hhblits_binary_path, dbs, "bfd_uniref_hits.a3m")
    add("jackhmmer", cfg.jackhmmer_binary_path, [cfg.uniprot_database_path], UNIPROT_HITS)
    uniref = folder / "uniref90_hits.sto"
    if uniref.exists() or any(j.name == uniref.name for j in jobs):
        add("hhsearch", cfg.hhsearch_binary_path, [cfg.pdb70_database_path], "pdb70_hits.hhr", uniref.name)
    return jobs


def tool_cpus(cpus: int, concurrent: int) -> int:
    """Threads of each of `concurrent` tools sharing a target's `cpus` (at least one each)."""
    return max(1, cpus // max(1, concurrent))
