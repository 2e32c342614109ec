"""lmforge's benchmarks. Run them from the repository root as modules, e.g. ``python -m bench.data_bench``.

Each one prints its figures and writes JSON under ``bench/results/`` with the facts of the machine it ran on
(:mod:`bench.common`).
"""
