"""Residue constants of AlphaFold2 as data: residue and atom orders, atom14/atom37 layouts, chi angles,
ideal rigid-group atom positions, and literature bond lengths and angles.

Facts from the AlphaFold2 supplementary information (section 1.8, Table 2) and the constants AlphaFold
publishes; the derived index tables (atom14 <-> atom37, rigid-group default frames) are built below.
Arrays indexed by residue type have 21 rows: the 20 in `restypes` order, then unknown (X) with nothing set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

restypes = ["A", "R", "N", "D", "C", "Q", "E", "G", "H", "I", "L", "K", "M", "F", "P", "S", "T", "W", "Y", "V"]
"""The 20 amino acids in AlphaFold's order; index 20 is unknown (X)."""

restype_1to3 = {
    "A": "ALA",
    "R": "ARG",
    "N": "ASN",
    "D": "ASP",
    "C": "CYS",
    "Q": "GLN",
    "E": "GLU",
    "G": "GLY",
    "H": "HIS",
    "I": "ILE",
    "L": "LEU",
    "K": "LYS",
    "M": "MET",
    "F": "PHE",
    "P": "PRO",
    "S": "SER",
    "T": "THR",
    "W": "TRP",
    "Y": "TYR",
    "V": "VAL",
}
"""One-letter to three-letter residue names."""

atom_types = [
    "N",
    "CA",
    "C",
    "CB",
    "O",
    "CG",
    "CG1",
    "CG2",
    "OG",
    "OG1",
    "SG",
    "CD",
    "CD1",
    "CD2",
    "ND1",
    "ND2",
    "OD1",
    "OD2",
    "SD",
    "CE",
    "CE1",
    "CE2",
    "CE3",
    "NE",
    "NE1",
    "NE2",
    "OE1",
    "OE2",
    "CH2",
    "NH1",
    "NH2",
    "OH",
    "CZ",
    "CZ2",
    "CZ3",
    "NZ",
    "OXT",
]
"""The 37 heavy-atom names of the atom37 layout, in order."""

restype_name_to_atom14_names = {
    "ALA": ["N", "CA", "C", "O", "CB", "", "", "", "", "", "", "", "", ""],
    "ARG": ["N", "CA", "C", "O", "CB", "CG", "CD", "NE", "CZ", "NH1", "NH2", "", "", ""],
    "ASN": ["N", "CA", "C", "O", "CB", "CG", "OD1", "ND2", "", "", "", "", "", ""],
    "ASP": ["N", "CA", "C", "O", "CB", "CG", "OD1", "OD2", "", "", "", "", "", ""],
    "CYS": ["N", "CA", "C", "O", "CB", "SG", "", "", "", "", "", "", "", ""],
    "GLN": ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "NE2", "", "", "", "", ""],
    "GLU": ["N", "CA", "C", "O", "CB", "CG", "CD", "OE1", "OE2", "", "", "", "", ""],
    "GLY": ["N", "CA", "C", "O", "", "", "", "", "", "", "", "", "", ""],
    "HIS": ["N", "CA", "C", "O", "CB", "CG", "ND1", "CD2", "CE1", "NE2", "", "", "", ""],
    "ILE": ["N", "CA", "C", "O", "CB", "CG1", "CG2", "CD1", "", "", "", "", "", ""],
    "LEU": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "", "", "", "", "", ""],
    "LYS": ["N", "CA", "C", "O", "CB", "CG", "CD", "CE", "NZ", "", "", "", "", ""],
    "MET": ["N", "CA", "C", "O", "CB", "CG", "SD", "CE", "", "", "", "", "", ""],
    "PHE": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "", "", ""],
    "PRO": ["N", "CA", "C", "O", "CB", "CG", "CD", "", "", "", "", "", "", ""],
    "SER": ["N", "CA", "C", "O", "CB", "OG", "", "", "", "", "", "", "", ""],
    "THR": ["N", "CA", "C", "O", "CB", "OG1", "CG2", "", "", "", "", "", "", ""],
    "TRP": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"],
    "TYR": ["N", "CA", "C", "O", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "OH", "", ""],
    "VAL": ["N", "CA", "C", "O", "CB", "CG1", "CG2", "", "", "", "", "", "", ""],
    "UNK": ["", "", "", "", "", "", "", "", "", "", "", "", "", ""],
}
"""Atom names of the compact atom14 layout per residue; empty strings pad."""

residue_atoms = {
    "ALA": ["C", "CA", "CB", "N", "O"],
    "ARG": ["C", "CA", "CB", "CG", "CD", "CZ", "N", "NE", "O", "NH1", "NH2"],
    "ASP": ["C", "CA", "CB", "CG", "N", "O", "OD1", "OD2"],
    "ASN": ["C", "CA", "CB", "CG", "N", "ND2", "O", "OD1"],
    "CYS": ["C", "CA", "CB", "N", "O", "SG"],
    "GLU": ["C", "CA", "CB", "CG", "CD", "N", "O", "OE1", "OE2"],
    "GLN": ["C", "CA", "CB", "CG", "CD", "N", "NE2", "O", "OE1"],
    "GLY": ["C", "CA", "N", "O"],
    "HIS": ["C", "CA", "CB", "CG", "CD2", "CE1", "N", "ND1", "NE2", "O"],
    "ILE": ["C", "CA", "CB", "CG1", "CG2", "CD1", "N", "O"],
    "LEU": ["C", "CA", "CB", "CG", "CD1", "CD2", "N", "O"],
    "LYS": ["C", "CA", "CB", "CG", "CD", "CE", "N", "NZ", "O"],
    "MET": ["C", "CA", "CB", "CG", "CE", "N", "O", "SD"],
    "PHE": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O"],
    "PRO": ["C", "CA", "CB", "CG", "CD", "N", "O"],
    "SER": ["C", "CA", "CB", "N", "O", "OG"],
    "THR": ["C", "CA", "CB", "CG2", "N", "O", "OG1"],
    "TRP": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE2", "CE3", "CZ2", "CZ3", "CH2", "N", "NE1", "O"],
    "TYR": ["C", "CA", "CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "N", "O", "OH"],
    "VAL": ["C", "CA", "CB", "CG1", "CG2", "N", "O"],
}
"""Heavy atoms present in each residue."""

chi_angles_atoms = {
    "ALA": [],
    "ARG": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "NE"], ["CG", "CD", "NE", "CZ"]],
    "ASN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "ASP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "CYS": [["N", "CA", "CB", "SG"]],
    "GLN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "GLU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "GLY": [],
    "HIS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "ND1"]],
    "ILE": [["N", "CA", "CB", "CG1"], ["CA", "CB", "CG1", "CD1"]],
    "LEU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "LYS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "CE"], ["CG", "CD", "CE", "NZ"]],
    "MET": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "SD"], ["CB", "CG", "SD", "CE"]],
    "PHE": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "PRO": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"]],
    "SER": [["N", "CA", "CB", "OG"]],
    "THR": [["N", "CA", "CB", "OG1"]],
    "TRP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "TYR": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "VAL": [["N", "CA", "CB", "CG1"]],
}
"""The four atoms defining each chi angle (chi1..chi4) per residue."""

chi_angles_mask = [
    [0.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 0.0, 0.0],
]
"""[20, 4]: which chi angles exist, in `restypes` order."""

chi_pi_periodic = [
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 1.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
]
"""[20, 4]: chi angles that are symmetric under a rotation by pi."""

rigid_group_atom_positions = {
    "ALA": [
        ["N", 0, (-0.525, 1.363, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, -0.0, -0.0)],
        ["CB", 0, (-0.529, -0.774, -1.205)],
        ["O", 3, (0.627, 1.062, 0.0)],
    ],
    "ARG": [
        ["N", 0, (-0.524, 1.362, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, -0.0, -0.0)],
        ["CB", 0, (-0.524, -0.778, -1.209)],
        ["O", 3, (0.626, 1.062, 0.0)],
        ["CG", 4, (0.616, 1.39, -0.0)],
        ["CD", 5, (0.564, 1.414, 0.0)],
        ["NE", 6, (0.539, 1.357, -0.0)],
        ["NH1", 7, (0.206, 2.301, 0.0)],
        ["NH2", 7, (2.078, 0.978, -0.0)],
        ["CZ", 7, (0.758, 1.093, -0.0)],
    ],
    "ASN": [
        ["N", 0, (-0.536, 1.357, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, -0.0, -0.0)],
        ["CB", 0, (-0.531, -0.787, -1.2)],
        ["O", 3, (0.625, 1.062, 0.0)],
        ["CG", 4, (0.584, 1.399, 0.0)],
        ["ND2", 5, (0.593, -1.188, 0.001)],
        ["OD1", 5, (0.633, 1.059, 0.0)],
    ],
    "ASP": [
        ["N", 0, (-0.525, 1.362, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.527, 0.0, -0.0)],
        ["CB", 0, (-0.526, -0.778, -1.208)],
        ["O", 3, (0.626, 1.062, -0.0)],
        ["CG", 4, (0.593, 1.398, -0.0)],
        ["OD1", 5, (0.61, 1.091, 0.0)],
        ["OD2", 5, (0.592, -1.101, -0.003)],
    ],
    "CYS": [
        ["N", 0, (-0.522, 1.362, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.524, 0.0, 0.0)],
        ["CB", 0, (-0.519, -0.773, -1.212)],
        ["O", 3, (0.625, 1.062, -0.0)],
        ["SG", 4, (0.728, 1.653, 0.0)],
    ],
    "GLN": [
        ["N", 0, (-0.526, 1.361, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, 0.0, 0.0)],
        ["CB", 0, (-0.525, -0.779, -1.207)],
        ["O", 3, (0.626, 1.062, -0.0)],
        ["CG", 4, (0.615, 1.393, 0.0)],
        ["CD", 5, (0.587, 1.399, -0.0)],
        ["NE2", 6, (0.593, -1.189, -0.001)],
        ["OE1", 6, (0.634, 1.06, 0.0)],
    ],
    "GLU": [
        ["N", 0, (-0.528, 1.361, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, -0.0, -0.0)],
        ["CB", 0, (-0.526, -0.781, -1.207)],
        ["O", 3, (0.626, 1.062, 0.0)],
        ["CG", 4, (0.615, 1.392, 0.0)],
        ["CD", 5, (0.6, 1.397, 0.0)],
        ["OE1", 6, (0.607, 1.095, -0.0)],
        ["OE2", 6, (0.589, -1.104, -0.001)],
    ],
    "GLY": [
        ["N", 0, (-0.572, 1.337, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.517, -0.0, -0.0)],
        ["O", 3, (0.626, 1.062, -0.0)],
    ],
    "HIS": [
        ["N", 0, (-0.527, 1.36, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, 0.0, 0.0)],
        ["CB", 0, (-0.525, -0.778, -1.208)],
        ["O", 3, (0.625, 1.063, 0.0)],
        ["CG", 4, (0.6, 1.37, -0.0)],
        ["CD2", 5, (0.889, -1.021, 0.003)],
        ["ND1", 5, (0.744, 1.16, -0.0)],
        ["CE1", 5, (2.03, 0.851, 0.002)],
        ["NE2", 5, (2.145, -0.466, 0.004)],
    ],
    "ILE": [
        ["N", 0, (-0.493, 1.373, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.527, -0.0, -0.0)],
        ["CB", 0, (-0.536, -0.793, -1.213)],
        ["O", 3, (0.627, 1.062, -0.0)],
        ["CG1", 4, (0.534, 1.437, -0.0)],
        ["CG2", 4, (0.54, -0.785, -1.199)],
        ["CD1", 5, (0.619, 1.391, 0.0)],
    ],
    "LEU": [
        ["N", 0, (-0.52, 1.363, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, -0.0, -0.0)],
        ["CB", 0, (-0.522, -0.773, -1.214)],
        ["O", 3, (0.625, 1.063, -0.0)],
        ["CG", 4, (0.678, 1.371, 0.0)],
        ["CD1", 5, (0.53, 1.43, -0.0)],
        ["CD2", 5, (0.535, -0.774, 1.2)],
    ],
    "LYS": [
        ["N", 0, (-0.526, 1.362, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, 0.0, 0.0)],
        ["CB", 0, (-0.524, -0.778, -1.208)],
        ["O", 3, (0.626, 1.062, -0.0)],
        ["CG", 4, (0.619, 1.39, 0.0)],
        ["CD", 5, (0.559, 1.417, 0.0)],
        ["CE", 6, (0.56, 1.416, 0.0)],
        ["NZ", 7, (0.554, 1.387, 0.0)],
    ],
    "MET": [
        ["N", 0, (-0.521, 1.364, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, 0.0, 0.0)],
        ["CB", 0, (-0.523, -0.776, -1.21)],
        ["O", 3, (0.625, 1.062, -0.0)],
        ["CG", 4, (0.613, 1.391, -0.0)],
        ["SD", 5, (0.703, 1.695, 0.0)],
        ["CE", 6, (0.32, 1.786, -0.0)],
    ],
    "PHE": [
        ["N", 0, (-0.518, 1.363, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.524, 0.0, -0.0)],
        ["CB", 0, (-0.525, -0.776, -1.212)],
        ["O", 3, (0.626, 1.062, -0.0)],
        ["CG", 4, (0.607, 1.377, 0.0)],
        ["CD1", 5, (0.709, 1.195, -0.0)],
        ["CD2", 5, (0.706, -1.196, 0.0)],
        ["CE1", 5, (2.102, 1.198, -0.0)],
        ["CE2", 5, (2.098, -1.201, -0.0)],
        ["CZ", 5, (2.794, -0.003, -0.001)],
    ],
    "PRO": [
        ["N", 0, (-0.566, 1.351, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.527, -0.0, 0.0)],
        ["CB", 0, (-0.546, -0.611, -1.293)],
        ["O", 3, (0.621, 1.066, 0.0)],
        ["CG", 4, (0.382, 1.445, 0.0)],
        ["CD", 5, (0.477, 1.424, 0.0)],
    ],
    "SER": [
        ["N", 0, (-0.529, 1.36, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, -0.0, -0.0)],
        ["CB", 0, (-0.518, -0.777, -1.211)],
        ["O", 3, (0.626, 1.062, -0.0)],
        ["OG", 4, (0.503, 1.325, 0.0)],
    ],
    "THR": [
        ["N", 0, (-0.517, 1.364, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.526, 0.0, -0.0)],
        ["CB", 0, (-0.516, -0.793, -1.215)],
        ["O", 3, (0.626, 1.062, 0.0)],
        ["CG2", 4, (0.55, -0.718, -1.228)],
        ["OG1", 4, (0.472, 1.353, 0.0)],
    ],
    "TRP": [
        ["N", 0, (-0.521, 1.363, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.525, -0.0, 0.0)],
        ["CB", 0, (-0.523, -0.776, -1.212)],
        ["O", 3, (0.627, 1.062, 0.0)],
        ["CG", 4, (0.609, 1.37, -0.0)],
        ["CD1", 5, (0.824, 1.091, 0.0)],
        ["CD2", 5, (0.854, -1.148, -0.005)],
        ["CE2", 5, (2.186, -0.678, -0.007)],
        ["CE3", 5, (0.622, -2.53, -0.007)],
        ["NE1", 5, (2.14, 0.69, -0.004)],
        ["CH2", 5, (3.028, -2.89, -0.013)],
        ["CZ2", 5, (3.283, -1.543, -0.011)],
        ["CZ3", 5, (1.715, -3.389, -0.011)],
    ],
    "TYR": [
        ["N", 0, (-0.522, 1.362, 0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.524, -0.0, -0.0)],
        ["CB", 0, (-0.522, -0.776, -1.213)],
        ["O", 3, (0.627, 1.062, -0.0)],
        ["CG", 4, (0.607, 1.382, -0.0)],
        ["CD1", 5, (0.716, 1.195, -0.0)],
        ["CD2", 5, (0.713, -1.194, -0.001)],
        ["CE1", 5, (2.107, 1.2, -0.002)],
        ["CE2", 5, (2.104, -1.201, -0.003)],
        ["OH", 5, (4.168, -0.002, -0.005)],
        ["CZ", 5, (2.791, -0.001, -0.003)],
    ],
    "VAL": [
        ["N", 0, (-0.494, 1.373, -0.0)],
        ["CA", 0, (0.0, 0.0, 0.0)],
        ["C", 0, (1.527, -0.0, -0.0)],
        ["CB", 0, (-0.533, -0.795, -1.213)],
        ["O", 3, (0.627, 1.062, -0.0)],
        ["CG1", 4, (0.54, 1.429, -0.0)],
        ["CG2", 4, (0.533, -0.776, 1.203)],
    ],
}
"""Ideal atom positions per residue: (atom name, rigid group 0..7, position in that group's frame, Angstrom).

Groups: 0 backbone, 1 pre-omega, 2 phi, 3 psi, 4..7 chi1..chi4 (AlphaFold2 suppl. Table 2)."""

residue_atom_renaming_swaps = {
    "ASP": {"OD1": "OD2"},
    "GLU": {"OE1": "OE2"},
    "PHE": {"CD1": "CD2", "CE1": "CE2"},
    "TYR": {"CD1": "CD2", "CE1": "CE2"},
}
"""Atoms exchanged by a 180-degree symmetry of the side chain."""

van_der_waals_radius = {"C": 1.7, "N": 1.55, "O": 1.52, "S": 1.8}
"""Van der Waals radius per element, Angstrom."""

HHBLITS_AA_TO_ID = {
    "A": 0,
    "B": 2,
    "C": 1,
    "D": 2,
    "E": 3,
    "F": 4,
    "G": 5,
    "H": 6,
    "I": 7,
    "J": 20,
    "K": 8,
    "L": 9,
    "M": 10,
    "N": 11,
    "O": 20,
    "P": 12,
    "Q": 13,
    "R": 14,
    "S": 15,
    "T": 16,
    "U": 1,
    "V": 17,
    "W": 18,
    "X": 20,
    "Y": 19,
    "Z": 3,
    "-": 21,
}
"""HHblits alphabet: letter to id (B->D, Z->E, U->C, J/O->X, gap 21)."""

ID_TO_HHBLITS_AA = {
    0: "A",
    1: "C",
    2: "D",
    3: "E",
    4: "F",
    5: "G",
    6: "H",
    7: "I",
    8: "K",
    9: "L",
    10: "M",
    11: "N",
    12: "P",
    13: "Q",
    14: "R",
    15: "S",
    16: "T",
    17: "V",
    18: "W",
    19: "Y",
    20: "X",
    21: "-",
}
"""HHblits id to its canonical letter."""


ca_ca = 3.80209737096
"""Distance between consecutive CA atoms in a trans peptide (omega = 180 degrees), Angstrom."""

between_res_bond_length_c_n = (1.329, 1.341)
"""Peptide C-N bond length, (non-proline, proline), Angstrom."""
between_res_bond_length_stddev_c_n = (0.014, 0.016)
"""Standard deviation of the peptide C-N bond length, (non-proline, proline)."""
between_res_cos_angles_c_n_ca = (-0.5203, 0.0353)
"""cos of the C-N-CA angle across the peptide bond: (mean, stddev); 121.352 +- 2.315 degrees."""
between_res_cos_angles_ca_c_n = (-0.4473, 0.0311)
"""cos of the CA-C-N angle across the peptide bond: (mean, stddev); 116.568 +- 1.995 degrees."""

restype_order = {r: i for i, r in enumerate(restypes)}
restype_num = len(restypes)
unk_restype_index = restype_num
restypes_with_x = [*restypes, "X"]
restype_order_with_x = {r: i for i, r in enumerate(restypes_with_x)}
restype_3to1 = {three: one for one, three in restype_1to3.items()}
unk_restype = "UNK"
resnames = [restype_1to3[r] for r in restypes] + [unk_restype]
resname_to_idx = {name: i for i, name in enumerate(resnames)}
atom_order = {name: i for i, name in enumerate(atom_types)}
atom_type_num = len(atom_types)
"""37: the number of atom types of the atom37 layout."""
atom14_num = 14

restypes_with_x_and_gap = [*restypes, "X", "-"]
MAP_HHBLITS_AATYPE_TO_OUR_AATYPE = tuple(
    restypes_with_x_and_gap.index(ID_TO_HHBLITS_AA[i]) for i in range(len(restypes_with_x_and_gap))
)
"""HHblits id (0..21) to our id: 0..19 amino acids in `restypes` order, 20 unknown, 21 gap."""


def sequence_to_onehot(sequence: str, mapping: dict[str, int], map_unknown_to_x: bool = False) -> np.ndarray:
    """One-hot `[len(sequence), max(mapping)+1]` encoding; unknown letters raise unless mapped to X."""
    num = max(mapping.values()) + 1
    onehot = np.zeros((len(sequence), num), dtype=np.int32)
    for i, letter in enumerate(sequence):
        if letter not in mapping:
            if not map_unknown_to_x:
                raise ValueError(f"sequence position {i}: residue {letter!r} not in the alphabet")
            letter = "X"
        onehot[i, mapping[letter]] = 1
    return onehot


def aatype_to_str_sequence(aatype: np.ndarray) -> str:
    """Residue-type indices `[N]` (0..20) to a one-letter string."""
    return "".join(restypes_with_x[int(i)] for i in aatype)


# ---------------------------------------------------------------------------------------------------
# atom14 <-> atom37 index tables.


def _atom14_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    to37 = np.zeros((21, 14), dtype=np.int64)
    to14 = np.zeros((21, 37), dtype=np.int64)
    mask14 = np.zeros((21, 14), dtype=np.float32)
    mask37 = np.zeros((21, 37), dtype=np.float32)
    for r, one in enumerate(restypes):
        for j, name in enumerate(restype_name_to_atom14_names[restype_1to3[one]]):
            if name:
                to37[r, j] = atom_order[name]
                to14[r, atom_order[name]] = j
                mask14[r, j] = 1.0
                mask37[r, atom_order[name]] = 1.0
    return to37, to14, mask14, mask37


restype_atom14_to_atom37, restype_atom37_to_atom14, restype_atom14_mask, restype_atom37_mask = _atom14_tables()
"""[21, 14] atom37 index of each atom14 slot; [21, 37] atom14 slot of each atom37 atom (0 where absent);
[21, 14] and [21, 37] masks of the atoms each residue type has (the unknown type has none)."""
STANDARD_ATOM_MASK = restype_atom37_mask.astype(np.int32)


def _chi_atom_indices() -> np.ndarray:
    out = np.zeros((21, 4, 4), dtype=np.int64)
    for r, one in enumerate(restypes):
        for c, atoms in enumerate(chi_angles_atoms[restype_1to3[one]]):
            out[r, c] = [atom_order[a] for a in atoms]
    return out


chi_angles_atom_indices = _chi_atom_indices()
"""[21, 4, 4] atom37 indices of the four atoms of each chi angle (zeros where the angle does not exist)."""
chi_angles_mask_with_unk = np.concatenate([np.asarray(chi_angles_mask, np.float32), np.zeros((1, 4), np.float32)])
"""[21, 4] `chi_angles_mask` with a row of zeros for the unknown type."""


# ---------------------------------------------------------------------------------------------------
# Rigid groups (AlphaFold2 suppl. 1.8, Table 2): default frames and literature positions.


def make_rigid_transformation_4x4(ex: np.ndarray, ey: np.ndarray, translation: np.ndarray) -> np.ndarray:
    """4x4 frame whose x axis is along `ex`, y axis in the (ex, ey) plane (Gram-Schmidt), origin `translation`."""
    e0 = ex / np.linalg.norm(ex)
    e1 = ey - np.dot(ey, e0) * e0
    e1 = e1 / np.linalg.norm(e1)
    e2 = np.cross(e0, e1)
    frame = np.eye(4)
    frame[:3, :3] = np.stack([e0, e1, e2], axis=-1)
    frame[:3, 3] = translation
    return frame


@dataclass(frozen=True)
class _RigidGroupTables:
    atom37_to_group: np.ndarray
    atom37_positions: np.ndarray
    atom14_to_group: np.ndarray
    atom14_positions: np.ndarray
    default_frames: np.ndarray


def _default_frames(positions: dict[str, np.ndarray], resname: str) -> np.ndarray:
    """[8, 4, 4] frames of the rigid groups of one residue relative to their parent group."""
    frames = np.zeros((8, 4, 4))
    frames[0] = frames[1] = np.eye(4)  # backbone and pre-omega groups sit on the backbone frame
    n, ca, c = positions["N"], positions["CA"], positions["C"]
    frames[2] = make_rigid_transformation_4x4(n - ca, np.array([1.0, 0.0, 0.0]), n)  # phi
    frames[3] = make_rigid_transformation_4x4(c - ca, ca - n, c)  # psi
    chis = chi_angles_atoms[resname]
    if chis:  # chi1 lives in the backbone frame
        a0, a1, a2 = (positions[a] for a in chis[0][:3])
        frames[4] = make_rigid_transformation_4x4(a2 - a1, a0 - a1, a2)
    for k in range(1, len(chis)):  # chi2..chi4: axis along the x axis of the previous chi frame
        axis_end = positions[chis[k][2]]
        frames[4 + k] = make_rigid_transformation_4x4(axis_end, np.array([-1.0, 0.0, 0.0]), axis_end)
    return frames


def _rigid_group_tables() -> _RigidGroupTables:
    t = _RigidGroupTables(
        atom37_to_group=np.zeros((21, 37), dtype=np.int64),
        atom37_positions=np.zeros((21, 37, 3)),
        atom14_to_group=np.zeros((21, 14), dtype=np.int64),
        atom14_positions=np.zeros((21, 14, 3)),
        default_frames=np.zeros((21, 8, 4, 4)),
    )
    for r, one in enumerate(restypes):
        resname = restype_1to3[one]
        names14 = restype_name_to_atom14_names[resname]
        positions = {}
        for name, group, pos in rigid_group_atom_positions[resname]:
            positions[name] = np.asarray(pos, dtype=np.float64)
            t.atom37_to_group[r, atom_order[name]] = group
            t.atom37_positions[r, atom_order[name]] = pos
            t.atom14_to_group[r, names14.index(name)] = group
            t.atom14_positions[r, names14.index(name)] = pos
        t.default_frames[r] = _default_frames(positions, resname)
    return t


_RIGID = _rigid_group_tables()
# Stored in float32, as AlphaFold tabulates them: outputs then agree with AlphaFold to float64 rounding.
restype_atom37_to_rigid_group = _RIGID.atom37_to_group
"""[21, 37] rigid group (0..7) each atom37 atom belongs to."""
restype_atom37_rigid_group_positions = _RIGID.atom37_positions.astype(np.float32)
"""[21, 37, 3] literature position of each atom in its rigid group's frame, Angstrom."""
restype_atom14_to_rigid_group = _RIGID.atom14_to_group
"""[21, 14] rigid group (0..7) each atom14 atom belongs to."""
restype_atom14_rigid_group_positions = _RIGID.atom14_positions.astype(np.float32)
"""[21, 14, 3] literature position of each atom14 atom in its rigid group's frame, Angstrom."""
restype_rigid_group_default_frame = _RIGID.default_frames.astype(np.float32)
"""[21, 8, 4, 4] default frame of each rigid group relative to its parent (backbone for 1..4, chi k-1 for chi k);
zero for groups a residue does not have, as AlphaFold tabulates them."""

restype_rigidgroup_mask = np.zeros((21, 8), dtype=np.float32)
"""[21, 8] which rigid groups exist: backbone and psi always, chi groups per `chi_angles_mask`."""
restype_rigidgroup_mask[:, 0] = 1
restype_rigidgroup_mask[:, 3] = 1
restype_rigidgroup_mask[:20, 4:] = chi_angles_mask


# ---------------------------------------------------------------------------------------------------
# Literature bond lengths and angles (Engh & Huber), as AlphaFold tabulates them.


@dataclass(frozen=True)
class Bond:
    """A bond between two atoms: mean length and standard deviation in Angstrom."""

    atom1_name: str
    atom2_name: str
    length: float
    stddev: float


@dataclass(frozen=True)
class BondAngle:
    """The angle atom1-atom2-atom3 (atom2 at the vertex): mean and standard deviation in radians."""

    atom1_name: str
    atom2_name: str
    atom3name: str
    angle_rad: float
    stddev: float


def _read_sections(text: str) -> list[list[list[str]]]:
    sections, rows = [], []
    for line in text.splitlines()[1:]:
        if line.strip() == "-":
            sections.append(rows)
            rows = []
        elif line.strip() and not line.startswith(("Angle", "Non-bonded")):
            rows.append(line.split())
    return sections


@functools.cache
def load_stereo_chemical_props() -> tuple[dict[str, list[Bond]], dict[str, list[Bond]], dict[str, list[BondAngle]]]:
    """Bonds, virtual bonds (the third edge of each bond angle's triangle) and bond angles per residue name.

    Read from `stereo_chemical_props.txt` beside this file.
    """
    text = (Path(__file__).with_name("stereo_chemical_props.txt")).read_text()
    bond_rows, angle_rows = _read_sections(text)[:2]
    bonds: dict[str, list[Bond]] = {}
    for name, resname, length, stddev in bond_rows:
        a1, a2 = name.split("-")
        bonds.setdefault(resname, []).append(Bond(a1, a2, float(length), float(stddev)))
    bonds["UNK"] = []
    angles: dict[str, list[BondAngle]] = {}
    for name, resname, mean, stddev in angle_rows:
        a1, a2, a3 = name.split("-")
        angles.setdefault(resname, []).append(BondAngle(a1, a2, a3, np.radians(float(mean)), np.radians(float(stddev))))
    angles["UNK"] = []
    return bonds, _virtual_bonds(bonds, angles), angles


def _virtual_bonds(bonds: dict[str, list[Bond]], angles: dict[str, list[BondAngle]]) -> dict[str, list[Bond]]:
    """Law of cosines: the distance atom1-atom3 of each angle, with the stddev propagated to first order."""
    out: dict[str, list[Bond]] = {}
    for resname, res_angles in angles.items():
        length = {frozenset((b.atom1_name, b.atom2_name)): b for b in bonds[resname]}
        out[resname] = []
        for ang in res_angles:
            b1 = length[frozenset((ang.atom1_name, ang.atom2_name))]
            b2 = length[frozenset((ang.atom2_name, ang.atom3name))]
            d = np.sqrt(b1.length**2 + b2.length**2 - 2 * b1.length * b2.length * np.cos(ang.angle_rad))
            dl1 = (b1.length - b2.length * np.cos(ang.angle_rad)) / d
            dl2 = (b2.length - b1.length * np.cos(ang.angle_rad)) / d
            dl3 = b1.length * b2.length * np.sin(ang.angle_rad) / d
            std = np.sqrt((dl1 * b1.stddev) ** 2 + (dl2 * b2.stddev) ** 2 + (dl3 * ang.stddev) ** 2)
            out[resname].append(Bond(ang.atom1_name, ang.atom3name, float(d), float(std)))
    return out
