"""The differential test matrix: the same small deterministic job under every backend, precision,
accumulation, scheduler and interruption, compared with a single-process reference.

``python -m tests.matrix --all`` runs every cell; ``tests/matrix/test_matrix.py`` runs a seeded sample.
"""
