"""Output side of `suite fold`: PDB and mmCIF writers with pLDDT B-factors, confidence JSON and plots."""
