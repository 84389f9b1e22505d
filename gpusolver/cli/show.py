"""``python -m gpusolver show``: the picture of a plan, solved here from a mask kind or loaded from a file."""
from __future__ import annotations

import torch


def run(args) -> int:
    from gpusolver.viz import draw_plan

    if args.plan:
        from gpusolver.plan.io import load_plan, load_plan_config

        try:
            plan = load_plan(args.plan)
            config = load_plan_config(args.plan)
        except Exception as e:  # not a file Plan.save wrote: one line, not a traceback
            raise SystemExit(f"gpusolver show: error: --plan {args.plan} is not a saved plan "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if config is None:
            raise SystemExit(f"gpusolver show: {args.plan} was saved without its SolverConfig; "
                             "save it with plan.save(path, config=config)")
        title = f"plan from {args.plan}"
    else:
        import warnings

        from gpusolver.cli.args import build_mask
        from gpusolver.config import SolverConfig
        from gpusolver.solve import solve

        torch.set_num_threads(1)
        hq, hkv = args.heads
        config = SolverConfig(cp_size=args.cp_size, num_heads_q=hq, num_heads_kv=hkv, head_dim=args.head_dim,
                              dtype=args.dtype, chunk_tiles=args.tiles)
        mask = build_mask(args.mask, args.tokens_per_rank * args.cp_size, args.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the picture shows the imbalance
            plan = solve(mask, config, solver=args.solver)
        title = (f"mask '{args.mask}' (seed {args.seed}), {args.tokens_per_rank} tokens per rank, "
                 f"{args.solver} solver")
    draw_plan(plan, config, args.out, title=title)
    print(f"wrote {args.out}")
    return 0
