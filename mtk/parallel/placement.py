"""Which node each rank runs on, and whether every TP group stays inside one (what ``mtk plan`` assumes).

TP all-reduces activations in every layer, so a TP group belongs on one node's NVLink; the launchers number
ranks node by node (``accelerate launch`` / ``torchrun``: node ``GROUP_RANK`` holds ranks ``GROUP_RANK *
LOCAL_WORLD_SIZE ...``; ``deepspeed``: ``CROSS_RANK``), and mtk lays ranks out TP fastest, so TP groups stay
inside a node whenever TP divides the processes per node. This module checks it on the running job: each rank
says which node it is on (the launcher's node rank, else the host name) and the answers are gathered once.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from mtk.parallel.state import ParallelState

__all__ = ["Placement", "node_of_this_process", "placement"]


def node_of_this_process(env: Mapping[str, str] | None = None) -> str:
    """``node 1`` from the launcher's node rank (torchrun's ``GROUP_RANK``, DeepSpeed's ``CROSS_RANK``), else
    the host name."""
    env = os.environ if env is None else env
    for key in ("GROUP_RANK", "CROSS_RANK"):
        if key in env:
            return f"node {env[key]}"
    return socket.gethostname()


@dataclass(frozen=True)
class Placement:
    """Global ranks per node, and the TP groups that span more than one node."""

    ranks_by_node: dict[str, list[int]]
    split_tp_groups: list[list[int]]

    def describe(self) -> str:
        nodes = "; ".join(f"{node} = ranks {ranks}" for node, ranks in self.ranks_by_node.items())
        if not self.split_tp_groups:
            return f"mtk: {len(self.ranks_by_node)} node(s): {nodes}; every TP group inside one node"
        return (
            f"mtk: {len(self.ranks_by_node)} node(s): {nodes}; TP groups {self.split_tp_groups} span nodes: TP "
            f"all-reduces every layer, keep it inside a node (a TP size dividing the processes per node)"
        )


def placement(parallel: ParallelState) -> Placement:
    """Gather every rank's node (one collective over the world; a single process: its own node)."""
    mine = node_of_this_process()
    nodes = [mine] * parallel.world_size
    if dist.is_initialized() and parallel.world_size > 1:
        gathered: list = [None] * parallel.world_size
        dist.all_gather_object(gathered, mine)
        nodes = [str(node) for node in gathered]
    ranks_by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks_by_node.setdefault(node, []).append(rank)
    split = [group for group in parallel.layout.groups("tp") if len({nodes[r] for r in group}) > 1]
    return Placement(ranks_by_node, split)
