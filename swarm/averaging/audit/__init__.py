"""Checking the part owners: the arithmetic of an audit (arithmetic.py), and the audit of a flat
round (flat.py) and of a grid round's two stages (grid.py, its receipts' checks in grid_checks.py)."""
