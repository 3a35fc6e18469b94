"""``fedspear compare``: a grid of runs and its summary — the grid, its presets and how cells run (``grid``), the
statistics (``stats``), comparison.md / comparison.json (``summary``) and the plots (``plots``).
"""
