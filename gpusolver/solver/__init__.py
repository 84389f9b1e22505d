"""The solvers: the device solver (``device.solve_device``) and the CPU reference (``reference``).

The device solver's layout is described in ``device.py``'s docstring; its
public names are re-exported here.
"""
from gpusolver.solver.core import DeviceSolveResult
from gpusolver.solver.device import coarser_tiles, run_variants, solve_device
from gpusolver.solver.strategies import DEFAULT_ROUNDS, Strategy, default_local_search, default_strategies

__all__ = ["DEFAULT_ROUNDS", "DeviceSolveResult", "Strategy", "coarser_tiles", "default_local_search",
           "default_strategies", "run_variants", "solve_device"]
