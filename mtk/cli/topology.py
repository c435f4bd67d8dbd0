"""``mtk topology``: print the Megatron rank layout for a world size, TP, CP, PP and EP degree (no processes)."""

from __future__ import annotations

import argparse
import json

from mtk.args import positive_int
from mtk.errors import MtkError
from mtk.parallel.layout import Layout

_TITLES = {
    "tp": "tensor-parallel",
    "cp": "context-parallel",
    "dp": "data-parallel",
    "replica": "replica (DP x CP: gradients and optimizer state)",
    "pp": "pipeline-parallel",
    "ep": "expert-parallel (different experts)",
    "expert_replica": "expert replica (the same experts: their gradients)",
    "mp": "model-parallel (TP x PP)",
    "embedding": "embedding (first + last stage)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "topology",
        help="print the TP/CP/DP/PP/EP/model-parallel/embedding groups of a layout",
        description="Print which global ranks form each process group (TP fastest, then CP, then DP, then PP; EP "
        "carved out of DP x CP).",
    )
    parser.add_argument("--world", type=positive_int, required=True, help="total number of processes")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree (default 1)")
    parser.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel degree, carved out of DP x CP (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print the groups as JSON")
    parser.set_defaults(run=run)


LARGEST_WORLD = 65536  # every rank of every group is listed: a larger world prints (and takes) minutes


def run(args: argparse.Namespace) -> int:
    if args.world > LARGEST_WORLD:
        raise MtkError(
            f"--world {args.world}: mtk topology lists every rank of every group, up to {LARGEST_WORLD} ranks; the "
            "groups repeat with the same degrees, so a smaller --world shows the pattern"
        )
    layout = Layout(world_size=args.world, tp_size=args.tp, pp_size=args.pp, cp_size=args.cp, ep_size=args.ep)
    hidden: tuple[str, ...] = () if layout.cp_size > 1 else ("cp", "replica")
    hidden += () if layout.ep_size > 1 else ("ep", "expert_replica")
    titles = {k: v for k, v in _TITLES.items() if k not in hidden}
    groups = {kind: layout.groups(kind) for kind in titles}
    if args.json:
        print(
            json.dumps(
                {
                    "world": layout.world_size,
                    "tp": layout.tp_size,
                    "pp": layout.pp_size,
                    "dp": layout.dp_size,
                    "cp": layout.cp_size,
                    "ep": layout.ep_size,
                    "groups": groups,
                }
            )
        )
        return 0
    cp = f" x cp {layout.cp_size}" if layout.cp_size > 1 else ""
    ep = f" (ep {layout.ep_size} inside dp x cp)" if layout.ep_size > 1 else ""
    print(f"world {layout.world_size} = tp {layout.tp_size}{cp} x dp {layout.dp_size} x pp {layout.pp_size}{ep}")
    for kind, title in titles.items():
        print(f"{title} groups ({len(groups[kind])}): " + " ".join(str(g) for g in groups[kind]))
    return 0
