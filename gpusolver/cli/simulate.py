"""``python -m gpusolver simulate``: one mask's layer time on a cluster, simulated, next to USP and the ideal bound."""
from __future__ import annotations

import dataclasses
import os
import warnings

import torch


def rows(plan, mask, config, topology, comm: str = "a2a") -> list[tuple[str, object]]:
    """(name, LayerTime) of ours, USP and balanced USP, all simulated on ``topology``."""
    from gpusolver.areas import block_areas
    from gpusolver.sim import simulate, simulate_baseline

    areas = block_areas(mask, config.cp_size, 1, impl="torch")
    return [("ours", simulate(plan, topology, comm=comm)),
            ("USP", simulate_baseline("usp", mask, config, topology, areas=areas)),
            ("balanced USP", simulate_baseline("usp_balanced", mask, config, topology, areas=areas))]


def table(results) -> str:
    """The printed table: fwd, bwd and step ms of each scheme and of ours' ideal bound."""
    ours = results[0][1]
    lines = [f"{'simulated ms':<22}{'fwd':>9}{'bwd':>9}{'step':>9}{'step / ours':>13}{'comm hidden':>13}"]
    for name, t in results:
        lines.append(f"{name:<22}{t.fwd_ms:>9.3f}{t.bwd_ms:>9.3f}{t.step_ms:>9.3f}{t.step_ms / ours.step_ms:>13.2f}"
                     f"{100 * t.hidden_share:>12.0f}%")
    lines.append(f"{'ideal bound (ours)':<22}{ours.fwd.ideal_ms:>9.3f}{ours.bwd.ideal_ms:>9.3f}{ours.ideal_ms:>9.3f}"
                 f"{ours.ideal_ms / ours.step_ms:>13.2f}{'':>13}")
    lines.append(f"{'busiest compute (ours)':<22}{ours.fwd.compute_ms:>9.3f}{ours.bwd.compute_ms:>9.3f}"
                 f"{ours.compute_ms:>9.3f}")
    return "\n".join(lines)


def run(args) -> int:
    from gpusolver.cli.args import build_mask
    from gpusolver.config import SolverConfig
    from gpusolver.sim.timeline import draw_timeline
    from gpusolver.solve import solve
    from gpusolver.topology import Topology

    topology = Topology.preset(args.topology)
    if args.own_nic:  # what the simulation routes; the solve prices link classes either way
        topology = dataclasses.replace(topology, rail_routing=False)
    P = args.cp_size
    try:
        topology.check_group(P)
    except ValueError as e:
        raise SystemExit(f"gpusolver simulate: error: {e}") from None
    torch.set_num_threads(1)
    hq, hkv = args.heads
    config = SolverConfig(cp_size=P, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim, dtype=args.dtype,
                          chunk_tiles=args.tiles, num_stages=args.stages,
                          topology=topology)  # as README advises on a cluster: bytes priced by link
    mask = build_mask(args.mask, args.tokens_per_rank * P, args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an imbalanced plan is slower: the simulation shows by how much
        plan = solve(mask, config, solver=args.solver)
    results = rows(plan, mask, config, topology, args.comm)
    print(f"Layer time on {topology.name} (SIMULATED, not measured): P = {P} ({topology.nodes(P)} node(s) of "
          f"{topology.ranks_per_node}), mask '{args.mask}' seed {args.seed}, {args.tokens_per_rank} tokens per rank, "
          f"{hq}:{hkv} heads, D = {args.head_dim}, {str(args.dtype).replace('torch.', '')}, {args.solver} solver, "
          f"S = {config.num_stages} sub-stage(s)"
          + (" and the local tail" if plan.num_stages > config.num_stages else "") + f" over {args.comm}")
    print(f"NVLink {topology.nvlink_gbps:g} GB/s and InfiniBand {topology.ib_gbps:g} GB/s per direction per GPU / NIC, "
          f"attention {topology.attn_tflops:g} TFLOP/s forward, backward {topology.bwd_flops_ratio:g}x the FLOPs; "
          + ("inter-node sends on the destination's rail (as NCCL sends)" if topology.rail_routing else
             "inter-node sends through each GPU's own NIC"))
    print(table(results))
    if args.critical_path:
        from gpusolver.sim.critical import describe

        for name, pt in (("forward", results[0][1].fwd), ("backward", results[0][1].bwd)):
            print(f"ours, {name} ({pt.ms:.3f} ms): " + "\n".join(describe(pt.critical)))
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(folder, exist_ok=True)
        draw_timeline(results[0][1], args.out, title=f"ours on {topology.name}, P = {P}, mask '{args.mask}'")
        print(f"wrote {args.out} (simulated timeline)")
    return 0
