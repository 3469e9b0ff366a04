"""Shared protein constants and geometry: residue constants, rigid transforms, atom construction."""
