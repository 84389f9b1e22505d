"""Layer time on a cluster, simulated: the runtime's own schedule priced on a ``Topology``.

``simulate(plan, topology) -> LayerTime`` places the op lists ``dist_attn``
executes (``gpusolver.plan.schedule``); ``simulate_baseline(kind, mask,
config, topology)`` places USP, load-balanced USP, ring attention and
owner-computes on the same sequential shards. Every figure is a model's
("simulated"): it replaces no measurement on a GPU.

Shape legend: P ranks, G head groups, U units.
"""
from gpusolver.sim.baselines import BASELINES, simulate_baseline
from gpusolver.sim.engine import Interval, SimOp, run_ops
from gpusolver.sim.layer import LayerTime, PassTime, simulate

__all__ = ["simulate", "simulate_baseline", "LayerTime", "PassTime", "BASELINES", "SimOp", "Interval", "run_ops"]
