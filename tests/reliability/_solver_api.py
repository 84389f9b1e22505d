"""The device solver's internals the reliability tests reach into, imported in one place.

The solver package is being laid out anew; when a private name moves, this
file is the one-line fix.
"""
from gpusolver.limits import balanced_load_cap
from gpusolver.solver.bundle.ref import bundle_proposals
from gpusolver.solver.core import _MU_SCALE, Tasks
from gpusolver.solver.device import (_run_persistent, _run_torch, _run_triton, default_local_search,
                                     default_strategies, run_variants, solve_device, variants)
from gpusolver.solver.state.kernel import state_triton
from gpusolver.solver.state.ref import state

__all__ = ["Tasks", "balanced_load_cap", "bundle_proposals", "default_local_search", "default_strategies",
           "run_variants", "solve_device", "state", "state_triton", "variants", "load_cap",
           "run_path"]


def load_cap(tasks: Tasks, config):
    """The largest balanced load of a solve (what ``solve_device`` passes its rounds)."""
    return balanced_load_cap(tasks.area.sum(), config.imbalance_tol, tasks.P, _MU_SCALE)


def run_path(impl: str, tasks: Tasks, cap, strategies, rounds: int, sideways: bool, restart_every: int,
             singles: bool):
    """(best_A [B, T+1], best_key [B]) of every variant on one path ("torch", "triton", "persistent")."""
    search = dict(sideways=sideways, restart_every=restart_every, singles=singles)
    if impl == "torch":
        return _run_torch(tasks, cap, strategies, rounds, None, **search)
    if impl == "triton":
        return _run_triton(tasks, cap, strategies, rounds, None, **search)
    return _run_persistent(tasks, cap, strategies, rounds, 1, None, **search)
