#!/usr/bin/env python
"""Expert-load pictures from a routing trace (`logging.routing_trace: true`, docs/running.md).

    python tools/plot_expert_load.py runs/tiny/routing --output plots/ [--iteration N] [--first A --last B]

Writes to OUT_DIR:
  heatmap_iter<N>.png  layer x expert share of iteration N's assignments (default: the last
                       traced iteration; Pro-Prophet Fig. 3 style)
  expert_share.png     each expert's share of its layer over the traced iterations (FlexMoE
                       Fig. 3(b) style), one panel per MoE layer
"""
import argparse
import os
import sys

import numpy as np

from megatron_moe.moe.load_plots import heatmap_figure, save_png, share_figure
from megatron_moe.moe.routing_trace import load_routing_trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir", help="<run_dir>/routing")
    parser.add_argument("--output", required=True, help="directory for the PNG files")
    parser.add_argument("--iteration", type=int, help="iteration of the heatmap (default: the last traced)")
    parser.add_argument("--first", type=int, help="first iteration of the share plot")
    parser.add_argument("--last", type=int, help="last iteration of the share plot")
    args = parser.parse_args(argv)
    try:
        trace = load_routing_trace(args.trace_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    iteration = args.iteration if args.iteration is not None else int(trace.iterations[-1])
    rows = np.flatnonzero(trace.iterations == iteration)
    if rows.size == 0:
        print(f"error: iteration {iteration} is not in the trace ({trace.iterations[0]}..{trace.iterations[-1]})",
              file=sys.stderr)
        return 2
    layers = trace.header.get("moe_layer_indices")
    load = trace.expert_load()  # [I, L, E]
    window = ((trace.iterations >= (args.first or 0)) &
              (trace.iterations <= (args.last if args.last is not None else trace.iterations[-1])))
    os.makedirs(args.output, exist_ok=True)
    outputs = [(heatmap_figure(load[rows[0]], iteration, layers), f"heatmap_iter{iteration}.png"),
               (share_figure(trace.iterations[window], load[window], layers), "expert_share.png")]
    for fig, name in outputs:
        save_png(fig, os.path.join(args.output, name))
        print(os.path.join(args.output, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
