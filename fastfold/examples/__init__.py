"""Bundled example inputs for `suite fold` (package data)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLE_FASTA"]

EXAMPLE_FASTA = Path(__file__).with_name("example.fasta")
"""A small single-record FASTA (the villin headpiece subdomain HP35, PDB 1YRF), folded by `suite fold` with no input."""
