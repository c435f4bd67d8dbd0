"""The collectives one training step must issue on a TP rank, from the Megatron math (docs/bench.md).

Per decoder layer the Column->Row pairs of attention and MLP each all-reduce a ``[b, s, h]``
activation forward (after the row-parallel output) and its gradient backward (before the
column-parallel input). The vocab-parallel embedding all-reduces its output forward; the LM head's
input gradient is all-reduced backward; the vocab-parallel loss all-reduces ``[b, s]`` maxima, then
``[2, b, s]`` (sum of exponentials and target logit). Nothing else: no logits are gathered.

With sequence parallelism each of those block all-reduces becomes an all-gather of the ``[b, s/tp, h]``
input plus a reduce-scatter of the ``[b, s, h]`` partial sums (the same bytes on the wire), and the
stage's blocks add one all-gather where they end (forward) and one where they begin (backward); the
gradients of the blocks' replicated parameters (norm weights, row biases) are summed over TP once per
step. Recompute reruns forwards in backward: full recompute repeats the blocks' forward collectives.
Sizes are those of the tensor each call is given (all-gather: its input; reduce-scatter: its input).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from mtk.parallel.overlap import gradient_buckets

__all__ = ["predict_context_collectives", "predict_expert_collectives", "Predicted", "predict_collectives"]


@dataclass(frozen=True)
class Predicted:
    """Collectives per step on one rank: count and bytes per kind."""

    counts: Counter
    nbytes: Counter

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: {"count": self.counts[kind], "bytes": self.nbytes[kind]} for kind in sorted(self.counts)}


def predict_collectives(
    num_layers: int,
    hidden: int,
    batch: int,
    seq: int,
    tp_size: int,
    *,
    pp_size: int = 1,
    stage: int = 0,
    micro_batches: int = 1,
    virtual_stages: int = 1,
    element_size: int = 4,
    loss_element_size: int = 4,
    sequence_parallel: bool = False,
    sequence_parallel_elements: int = 0,  # per block
    recompute: str | None = None,
    residual_dropout: bool = False,
    dp_gradient_elements: int = 0,
    expert_gradient_numels: tuple[int, ...] = (),
    all_gather_widths: tuple[int, ...] = (),
    stage_layers: int | None = None,
    tp_summed_numels: tuple[int, ...] = (),
    tp_summed_at_step_numels: tuple[int, ...] = (),
    gradient_element_size: int | None = None,
    input_gradient: bool = True,
    moe_layers: int = 0,
    top_k: int = 0,
    router_experts: int = 0,
    experts_whole: bool = False,
) -> Predicted:
    """What stage ``stage`` of a TP x PP layout sends per optimizer step (``pp = 1``: the whole model).

    ``dp_gradient_elements``: this rank's gradients, averaged over DP replicas in one call (0: one
    replica); ``expert_gradient_numels``: under expert parallelism, its experts' tensors, reduced over their
    replicas in buckets of DDP's size (:func:`~mtk.parallel.expert_parallel.reduce_expert_gradients`);
    ``all_gather_widths``: the distributed optimizer's all-gather rounds after the step (each rank's input, in
    elements).

    ``tp_summed_numels``: this stage's trainable parameters whose gradient is summed over TP in every backward
    (a TP-split linear's replicated LoRA factor; every ``tp_shared`` one under DeepSpeed), of
    ``gradient_element_size`` bytes per element (default ``element_size``);
    ``tp_summed_at_step_numels``: those summed once per step instead, in the call that sums the sequence-parallel
    gradients (``tp_shared`` under ``mtk.Accelerator``: per-head q/k norms, experts whole on each TP rank, the
    experts' LoRA factors);
    ``input_gradient``: whether the first stage's embedding output needs a gradient (not where the embedding is
    frozen, as under LoRA: then backward skips the first block's input collective, and under sequence parallelism the
    embedding's gather too); ``moe_layers`` MoE layers (this
    stage's) routing ``top_k`` experts per token add, with the experts split over TP, the routing weights'
    gradient ``[b s, k]`` summed over TP in every backward (the experts' input and output are the blocks' MLP
    pair, counted with them). With ``experts_whole`` (the experts' TP size 1, :mod:`mtk.parallel.expert_tokens`)
    an MoE layer has no such pair: each TP rank runs the experts on its share of the tokens, all-gathers their
    output ``[b s / tp, h]`` in forward and, in backward, the gradients of its rows ``[b s / tp, h]`` and of their
    routing weights ``[b s / tp, k]`` (the first ranks' shares one row more where TP does not divide the tokens:
    rank 0's counted); the experts' own gradients are ``tp_shared`` (``tp_summed_at_step_numels``).

    With PP, ``batch`` is the step's batch, cut into ``micro_batches``; this stage's layers are
    ``stage_layers`` (required at ``pp > 1``: the runtime's split, :func:`mtk.pipeline.balance.layer_counts`, is
    the one source, so no second default here), P2P moves one
    ``[b, s, h]`` tensor per micro-batch and direction at each chunk boundary (with TP, each TP rank its
    1/tp slice, all-gathered over TP by the receiver), and the loss is broadcast from the last stage. With
    ``virtual_stages`` chunks per rank (interleaved), every chunk but the model's last sends forward and every
    chunk but the model's first sends backward. With ``router_experts`` (E of an MoE model whose loss has the
    router's load-balancing term), each message carries the ``2E + 1`` fp32 routing sums too
    (:mod:`mtk.pipeline.message`).
    """
    tp, pp = tp_size, pp_size
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    first, last = stage == 0, stage == pp - 1
    if stage_layers is None and pp > 1:
        raise ValueError("stage_layers is required at pp > 1 (mtk.pipeline.balance.layer_counts gives the split)")
    layers = num_layers if stage_layers is None else stage_layers
    micro = batch // micro_batches
    activation = micro * seq * hidden * element_size  # one [b, s, h] tensor of a micro-batch
    if tp > 1:
        ends = (1 if first else 0) + (1 if last else 0)  # embedding forward, LM head input gradient
        # Recompute reruns a block's forward in backward, as far as the last activation backward needs
        # (torch stops there): the attention's and MLP's input gathers (SP) and the attention's output
        # reduction; the MLP's only when a dropout after it saved a mask (else the block's output is
        # never needed). Selective recompute reruns the same collectives: only matmul outputs are kept.
        reruns = (2 if residual_dropout else 1) * layers if recompute else 0
        skipped = 1 if first and not input_gradient else 0  # the first block's input needs no gradient
        if sequence_parallel:
            ends_of_runs = 2 * (virtual_stages if pp > 1 else 1)  # each chunk's blocks gather where they end and begin
            gathers = (4 * layers + ends_of_runs + (2 * layers if recompute else 0) - skipped) * micro_batches
            scatters = (4 * layers + reruns - skipped) * micro_batches
            counts["all_gather"] += gathers
            nbytes["all_gather"] += gathers * activation // tp
            counts["reduce_scatter"] += scatters
            nbytes["reduce_scatter"] += scatters * activation
            # + the sequence-parallel gradients, once (none to sum where they are frozen: LoRA)
            counts["all_reduce"] += ends * micro_batches + (1 if sequence_parallel_elements else 0)
            nbytes["all_reduce"] += (
                ends * micro_batches * activation + layers * sequence_parallel_elements * element_size
            )
        else:
            # whole experts: an MoE layer's pair is gathers of rows (below), as is the MLP's rerun under dropout
            unpaired = (2 + (1 if reruns and residual_dropout else 0)) * moe_layers if experts_whole else 0
            per_micro = 4 * layers + ends + reruns - skipped - unpaired
            counts["all_reduce"] += per_micro * micro_batches
            nbytes["all_reduce"] += per_micro * micro_batches * activation
        summed_size = element_size if gradient_element_size is None else gradient_element_size
        if tp_summed_numels:
            counts["all_reduce"] += len(tp_summed_numels) * micro_batches
            nbytes["all_reduce"] += sum(tp_summed_numels) * summed_size * micro_batches
        if tp_summed_at_step_numels:  # one call with the sequence-parallel gradients (counted above, if any)
            counts["all_reduce"] += 0 if sequence_parallel and sequence_parallel_elements else 1
            nbytes["all_reduce"] += sum(tp_summed_at_step_numels) * summed_size
        if moe_layers and experts_whole:
            rows = -(-micro * seq // tp)  # rank 0's share of the tokens
            outputs = 2 if reruns and residual_dropout else 1  # the forward's gather, rerun where backward needs it
            counts["all_gather"] += moe_layers * (outputs + 2) * micro_batches
            nbytes["all_gather"] += moe_layers * rows * ((outputs + 1) * hidden + top_k) * element_size * micro_batches
        elif moe_layers:
            counts["all_reduce"] += moe_layers * micro_batches
            nbytes["all_reduce"] += moe_layers * micro * seq * top_k * element_size * micro_batches
        if last:  # vocab-parallel cross-entropy: [b, s] maxima, then [2, b, s]
            counts["all_reduce"] += 2 * micro_batches
            nbytes["all_reduce"] += 3 * micro * seq * loss_element_size * micro_batches
    if pp > 1:
        v = virtual_stages  # receives: as many as sends
        sends = (v - (1 if last else 0)) * micro_batches + (v - (1 if first else 0)) * micro_batches
        sums = (2 * router_experts + 1) * max(4, element_size) if router_experts else 0  # bytes riding along
        whole = activation + sums
        scattered = tp > 1 and (whole // element_size) % tp == 0  # each TP rank sends its 1/tp slice
        message = whole // tp if scattered else whole
        counts["send"] += sends
        counts["recv"] += sends
        nbytes["send"] += sends * message
        nbytes["recv"] += sends * message
        if scattered:  # the receiving stage gathers the slices over TP
            counts["all_gather"] += sends
            nbytes["all_gather"] += sends * message
        counts["broadcast"] += 1  # the last stage's loss to every stage
        nbytes["broadcast"] += 4
    if dp_gradient_elements:
        counts["all_reduce"] += 1
        nbytes["all_reduce"] += dp_gradient_elements * element_size
    if expert_gradient_numels:
        sizes = [(n * element_size, torch.float32) for n in expert_gradient_numels]  # one dtype: one kind of bucket
        counts["all_reduce"] += len(gradient_buckets(sizes))
        nbytes["all_reduce"] += sum(expert_gradient_numels) * element_size
    for width in all_gather_widths:
        counts["all_gather"] += 1
        nbytes["all_gather"] += width * element_size
    return Predicted(counts, nbytes)


def predict_context_collectives(
    num_layers: int,
    batch: int,
    seq: int,
    cp_size: int,
    comm: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_size: int = 4,
    recompute: bool = False,
    losses: int = 1,
    router_experts: int = 0,
) -> Predicted:
    """What context-parallel attention adds per step on one rank (``heads``, ``kv_heads``: this TP rank's; ``seq``:
    the whole row): every layer all-gathers its tokens' ``[3, b, s/cp]`` int64 metadata, then

    - ``p2p`` (ring): forward passes its ``[b, kv, s/cp, 2d]`` key/value block ``cp − 1`` times; backward passes the
      blocks again and their fp32 gradients with them, plus one hop home (``2·cp − 1`` sends);
    - ``a2a`` (all-to-all): q, k, v out and the output back, forward and backward alike (k and v with one head per
      query head where the kv heads do not split over CP).

    ``recompute`` (full or selective: the attention reruns in backward either way): the forward's again. Each of
    the ``losses`` forward calls with a loss then all-reduces its fp32 value (every CP rank returns the batch's) and,
    with ``router_experts`` (E of an MoE model whose loss has the router's load-balancing term), first its ``2E + 1``
    fp32 sums (mtk.parallel.router_loss); such a call returns its router logits too, each layer's ``[b·s/cp, E]``
    all-gathered into the whole rows'.
    """
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    if cp_size == 1:
        return Predicted(counts, nbytes)
    local = seq // cp_size
    forwards = 2 if recompute else 1
    counts["all_reduce"] += losses * (2 if router_experts else 1)
    nbytes["all_reduce"] += 4 * losses + (4 * (2 * router_experts + 1) * losses if router_experts else 0)
    counts["all_gather"] += num_layers * forwards
    nbytes["all_gather"] += num_layers * forwards * 3 * batch * local * 8
    if router_experts:
        counts["all_gather"] += losses * num_layers
        nbytes["all_gather"] += losses * num_layers * batch * local * router_experts * element_size
    if comm == "p2p":
        block = batch * kv_heads * local * 2 * head_dim
        hops, back = cp_size - 1, 2 * cp_size - 1
        for kind in ("send", "recv"):
            counts[kind] += num_layers * (forwards * hops + back)
            forward_bytes, backward_bytes = hops * element_size, hops * element_size + cp_size * max(4, element_size)
            nbytes[kind] += num_layers * block * (forwards * forward_bytes + backward_bytes)
    else:
        moved_kv = kv_heads if kv_heads % cp_size == 0 else heads
        per_call = batch * local * head_dim * element_size
        counts["all_to_all"] += num_layers * 4 * (forwards + 1)
        nbytes["all_to_all"] += num_layers * (forwards + 1) * per_call * (2 * heads + 2 * moved_kv)
    return Predicted(counts, nbytes)


def predict_expert_collectives(
    moe_layers: int,
    tokens: int,
    top_k: int,
    hidden: int,
    ep_size: int,
    element_size: int = 4,
    recompute: bool = False,
    micro_batches: int = 1,
) -> Predicted:
    """The all-to-alls expert parallelism adds per step on one rank (:mod:`mtk.parallel.expert_parallel`;
    ``tokens``: a micro-batch's on this rank). Each MoE layer's forward exchanges the ``[ep]`` int64 counts, then
    sends its ``tokens · k`` rows ``[h]`` and their int64 expert ids, and returns the rows its experts took; its
    backward returns the rows' gradients and sends back the taken rows' (recompute: the forward's four again).

    Routing decides how many rows a rank's experts take, so those two calls' bytes vary by rank; over the EP group
    they add up to ``tokens · k`` rows per rank (every row goes to exactly one rank), which is what is predicted:
    the EP group's mean."""
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    if ep_size == 1 or not moe_layers:
        return Predicted(counts, nbytes)
    forwards = 2 if recompute else 1
    rows = tokens * top_k * hidden * element_size  # one rank's tokens x k rows of [h]
    forward = 8 * ep_size + 8 * tokens * top_k + 2 * rows  # counts, ids, rows out, rows back
    counts["all_to_all"] += moe_layers * (4 * forwards + 2) * micro_batches
    nbytes["all_to_all"] += moe_layers * (forwards * forward + 2 * rows) * micro_batches
    return Predicted(counts, nbytes)
