"""The machines a plan is for: GPUs, nodes, memory, peak FLOP/s and link bandwidths.

Defaults are an H100 SXM node: 80 GiB, 989 TFLOP/s dense bf16 (67 TFLOP/s fp32 without TF32, torch's
default for matmuls), NVLink 4 at 450 GB/s per direction inside a node, one 400 Gb/s InfiniBand port per
GPU (50 GB/s) between nodes. Ranks are placed node-major (rank ``r`` on node ``r // gpus_per_node``), as
``accelerate launch`` / ``torchrun`` / ``deepspeed`` number them, so a group of consecutive ranks that fits
in a node stays inside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mtk.errors import ConfigError

__all__ = ["Cluster", "parse_bytes"]

PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0}  # H100 SXM, dense
NVLINK_GBPS = 450.0  # GB/s per direction, per GPU
INFINIBAND_GBPS = 50.0  # 400 Gb/s per GPU

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30})


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``81920MiB``, ``80G`` (binary), a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a memory size; use a number with a unit such as 80GiB, 80GB or 81920MiB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Cluster:
    """``gpus`` accelerators on ``nodes`` machines of equal size."""

    gpus: int
    nodes: int = 1
    gpu_memory: int = 80 * 2**30
    peak_flops: float = PEAK_TFLOPS["bf16"] * 1e12
    intra_node_bandwidth: float = NVLINK_GBPS * 1e9  # bytes/s per direction
    inter_node_bandwidth: float = INFINIBAND_GBPS * 1e9

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nodes < 1:
            raise ConfigError(f"--gpus {self.gpus} and --nodes {self.nodes} must be at least 1")
        if self.gpus % self.nodes:
            raise ConfigError(
                f"--gpus {self.gpus} do not spread evenly over --nodes {self.nodes}; give a multiple of the node count"
            )

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def within_node(self, ranks: list[int]) -> bool:
        return len({rank // self.gpus_per_node for rank in ranks}) == 1

    def bandwidth(self, ranks: list[int]) -> float:
        """Per-direction bandwidth between the members of a group of global ranks."""
        return self.intra_node_bandwidth if self.within_node(ranks) else self.inter_node_bandwidth
