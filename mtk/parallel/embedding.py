"""Vocabulary-parallel embedding (Megatron-LM, section 3: input embedding split along the vocab)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtk.parallel.comm import Group, reduce_from_tp, reduce_scatter_to_sequence
from mtk.parallel.layers import ShardedModule
from mtk.parallel.parameters import mark_tensor_parallel
from mtk.parallel.sharding import ShardSpec

__all__ = ["VocabParallelEmbedding", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, tp_size: int, pad_to_multiple_of: int = 1) -> int:
    """``vocab_size`` rounded up so that every TP rank holds the same number of rows."""
    multiple = tp_size * max(pad_to_multiple_of, 1)
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(ShardedModule):
    """Embedding table ``E [V, h]`` split along the vocabulary: rank r owns rows ``[start_r, end_r)``.

    Each rank looks up the tokens it owns, writes zeros for the others, and one all-reduce sums the
    per-rank results: exactly one rank contributes a non-zero row per token, so the sum is the full
    lookup. ``V`` is padded up to a multiple of ``tp * pad_to_multiple_of``; padded rows are zero, are
    never looked up by a real token id, and never leave the layer (``num_embeddings`` stays the real
    vocabulary size). ``embed_scale`` multiplies the lookup, as the scaled embeddings of Gemma and BART do
    (the scale cast to the weight's dtype first, as theirs).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        tp_group: Group,
        pad_to_multiple_of: int = 1,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        embed_scale: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(tp_group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.embed_scale = embed_scale
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, self.tp_size, pad_to_multiple_of)
        self.vocab_per_rank = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.padding_idx = padding_idx
        in_range = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = padding_idx - self.vocab_start if in_range and padding_idx is not None else None
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, embedding_dim, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, partition_dim=0)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def shard_spec(self, name: str) -> ShardSpec:
        stop = min(self.vocab_end, self.num_embeddings)
        return ShardSpec(
            dim=0, ranges=((self.vocab_start, max(self.vocab_start, stop)),), local_size=self.vocab_per_rank
        )

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        self.weight.copy_(self.shard(full))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(input_ids)
        if self.embed_scale is None:
            return out
        return out * torch.tensor(self.embed_scale, device=out.device).to(self.weight.dtype)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [b, s] global token ids
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight, self.padding_idx)  # [b, s, h]
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)  # [b, s]
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)  # [b, s]
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)  # [b, s, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # zero rows this rank does not own
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group, self.sequence_dim)  # [b, s/tp, h]
        return reduce_from_tp(out, self.tp_group)  # [b, s, h]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.num_embeddings_padded}, local [{self.vocab_start}, "
            f"{self.vocab_end})), {self.embedding_dim}, tp_rank={self.tp_rank}/{self.tp_size}"
            + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
        )
