"""Developer tools that live in the repository, not in the graphddp package: ``tools.bench``.

Run from the repository root (``python -m tools.bench``); nothing in ``graphddp`` imports them
and ``pip install`` does not ship them (pyproject's package discovery includes ``graphddp*`` only).
"""
