"""Run one stage of a pipelined HF causal LM: micro-batches, schedule, P2P, loss and gradient sync.

:class:`PipelineModel` wraps this rank's stage (an HF model cut by :func:`~mtk.convert.parallelize`).
As in accelerate's Megatron-LM integration, calling it with labels while gradients are enabled runs
the whole forward *and* backward schedule over the micro-batches and returns the loss (already
backpropagated; ``accelerator.backward`` then only finalizes gradients). Without gradients it runs
the forwards only. Every rank returns the same loss: the last stage's mean over micro-batches,
broadcast over the PP group, so logging on the main process (first stage) shows the real value.

After the last micro-batch of an optimizer step, :meth:`PipelineModel.finalize_grads` sums the
gradients of tied embedding copies over the embedding group and averages all gradients over the
data-parallel group (no DDP: a stage runs several forwards before its backwards). When the trainer says
which call ends an optimizer step (``syncs_this_call``, set by ``mtk.Accelerator``), that call's last
backward already averages the gradients bucket by bucket as they become final, overlapped with the rest
of backward (:class:`~mtk.parallel.overlap.OverlappedReduction`); ``finalize_grads`` waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from mtk.config import ConfigError, check_schedule
from mtk.data.batching import loss_tokens
from mtk.models import is_causal_lm_class
from mtk.parallel.context import SPLIT_INPUTS, ContextSplit, context_parallel_of
from mtk.parallel.expert_parallel import is_expert_parallel
from mtk.parallel.fsdp import local
from mtk.parallel.grads import all_reduce_coalesced
from mtk.parallel.overlap import OverlappedReduction
from mtk.parallel.parameters import param_info
from mtk.parallel.record import hf_model, parallelized
from mtk.parallel.router_loss import carrying, whole_router_loss
from mtk.parallel.sequence_padding import pad_batch, trim_output
from mtk.parallel.state import ParallelState
from mtk.pipeline.batches import FUSED_FIELDS, fused_output, split_micro_batches, token_mean_loss, with_ignored_rows
from mtk.pipeline.message import StageMessage
from mtk.pipeline.p2p import Posted, StageLink
from mtk.pipeline.routing import record_outputs_of_every_chunk, router_shape, stage_routing_sums
from mtk.pipeline.schedules import schedule_order, simulate
from mtk.pipeline.stages import StageInfo, swapped

__all__ = ["PipelineModel", "PipelineStats", "split_micro_batches"]

Received = tuple[torch.Tensor | None, torch.Tensor | None]  # what a pass receives: hidden states, routing sums


@dataclass
class PipelineStats:
    """What the last schedule did on this rank (for tests, benchmarks and the bubble measurement).

    Attributes:
        max_in_flight: most micro-batches whose activations were held at once (forwarded, not yet backwarded;
            with the interleaved schedule, passes of one chunk: each holds ``1/v`` of the stage's activations).
        wait_s: seconds blocked receiving from a neighbour stage; total_s: the whole schedule.
    """

    schedule: str = ""
    micro_batches: int = 0
    max_in_flight: int = 0
    wait_s: float = 0.0
    total_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """Seconds of the schedule this rank was not blocked on a neighbour."""
        return self.total_s - self.wait_s


class PipelineModel(nn.Module):
    """One pipeline stage of an HF causal LM, with the schedule that drives it.

    Args:
        module: this rank's stage (an HF model after :func:`~mtk.convert.parallelize`).
        parallel: the topology (PP group for P2P, embedding and DP groups for gradient sync).
        num_micro_batches: micro-batches each batch is cut into.
        schedule: ``1f1b``, ``afab`` or ``interleaved`` (which needs a model cut with ``virtual_stages``
            chunks per rank by :func:`~mtk.convert.parallelize`).
    """

    def __init__(
        self, module: nn.Module, parallel: ParallelState, num_micro_batches: int, schedule: str = "1f1b"
    ) -> None:
        super().__init__()
        self.module = module
        self.parallel = parallel
        record = parallelized(module)
        if record is None or record.stage is None or record.pp_size != parallel.pp_size:
            raise ConfigError(f"PipelineModel needs a model cut by mtk.parallelize for pp = {parallel.pp_size}")
        kind = type(hf_model(module)).__name__
        if not is_causal_lm_class(kind):  # (each trained on another loss, exit 0)
            raise ConfigError(
                f"{kind} at pp > 1: the pipeline trains causal language models (a ...ForCausalLM); a sequence "
                "classifier pools each row at its last token that is not padding, found from the input_ids the last "
                "stage does not receive, and a token classifier's loss is each micro-batch's mean; use pp = 1"
            )
        # an MoE loss's load-balancing term: each stage's routing sums travel with its hidden states
        whole_router_loss(hf_model(module), "pipeline parallelism")
        self._router_experts, self._router_top_k = router_shape(hf_model(module))
        self.info: StageInfo = record.stage
        self.sequence_parallel = record.sequence_parallel and parallel.tp_size > 1
        self.num_micro_batches = num_micro_batches
        self._micro_count = num_micro_batches  # this call's: fewer for a batch they do not divide
        self._reported_sizes: set[int] = set()
        self.schedule = schedule
        v = self.info.virtual_stages
        if schedule == "interleaved" and v == 1:
            raise ConfigError(
                "the interleaved schedule needs a model cut into virtual stages: pass virtual_stages to "
                "mtk.parallelize (mtk.Accelerator does, from RunSettings.virtual_stages)"
            )
        problem = check_schedule(schedule, parallel.pp_size, num_micro_batches, v)
        if problem:
            raise ConfigError(problem)  # here, not mid-step
        simulate(schedule, parallel.pp_size, num_micro_batches, v)  # every receive meets its own message
        self.link = StageLink(parallel, wrap_around=v > 1)
        # While chunk c runs: the rank's other chunks pass through, the ends only where the model's are.
        self._views = [self.info.chunk_view(hf_model(module), chunk) for chunk in range(v)]
        if v > 1 and self._router_experts:  # the router logits the chunks' routing sums come from
            record_outputs_of_every_chunk(hf_model(module))
        self._chunk_params = self._params_by_chunk() if v > 1 else [None]
        # Set by the trainer: what to backpropagate for one micro-batch's share of the loss
        # (accelerate divides by gradient-accumulation steps, fp16 multiplies by the loss scale).
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        # Set by the trainer: whether this call ends an optimizer step (its last backward then starts the
        # data-parallel reduction). None: unknown, and finalize_grads reduces after the schedule.
        self.syncs_this_call: Callable[[], bool] | None = None
        self._reduction: OverlappedReduction | None = None
        # set by mtk.Accelerator when FSDP2 shards the stage over DP: it reduces the gradients, not this engine
        self.sharded_over_data_parallel = False
        self.stats = PipelineStats()
        self._sync_tied_weights()

    @property
    def config(self):
        return self.module.config

    # ---------------------------------------------------------------------------------- forward
    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None, **kwargs):
        """Run the schedule over this batch; returns ``CausalLMOutputWithPast(loss=...)``.

        With gradients enabled and ``labels`` given, forward and backward both run (gradients
        accumulate into ``.grad`` as ``loss.backward()`` would have made them).
        """
        if kwargs.pop("use_cache", None) or kwargs.pop("past_key_values", None) is not None:
            raise ConfigError("a pipelined model trains and evaluates without a KV cache (use_cache=False)")
        # TRL's fused LM head: the last stage returns per-token statistics too, which every stage gets back
        self._fused = bool(kwargs.pop("fused_lm_head", False))
        # A loss linear in the per-token log-probabilities, sum(token_weights * log_probs) over the batch: what a
        # loss of whole sequences (DPO's) backpropagates once its weights, d loss / d log_probs, are known
        # (mtk.trainers.DPOTrainer); it needs no micro-batch to hold a whole chosen/rejected pair.
        weights = kwargs.pop("token_weights", None)
        if weights is not None and not self._fused:
            raise ConfigError(
                "a pipeline's token_weights weight the fused LM head's log_probs: pass fused_lm_head=True"
            )
        self._fused_outputs: dict[int, Any] = {}
        # HF's token-weighted loss: each call's loss is its summed token losses / num_items_in_batch. The
        # schedule averages its m micro-batch losses, so each gets 1/m of the count: the mean is then the
        # batch's summed loss / num_items_in_batch, as one call on the whole batch would return. A caller that
        # passes no count gets the batch's own (HF's token mean over the whole batch, not a mean of m means).
        num_items = kwargs.pop("num_items_in_batch", None)
        as_tuple = self._take_flags(kwargs)
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        batch = {k: v for k, v in {**batch, **kwargs}.items() if v is not None}
        if "input_ids" not in batch:
            raise ConfigError("a pipelined model takes input_ids (every stage derives shapes from them)")
        extra, whole = 0, batch["input_ids"].shape[1]
        token_mean = token_mean_loss(hf_model(self.module), batch)
        if num_items is None and weights is None and token_mean:
            num_items = loss_tokens(batch)
        # a loss any grouping of the rows leaves exact: the count is the one HF's token mean divides by (the Trainer
        # passes it to a classifier too, whose loss is a mean over rows), or weights on the log-probabilities
        weighted = weights is not None or (num_items is not None and token_mean)
        split = context_parallel_of(self.module)
        if split is not None:  # this CP rank's tokens of every row, cut before the micro-batches
            batch, num_items, extra = self._split_for_context(split, batch, num_items)
        elif self.sequence_parallel:  # a length the TP size does not divide: padded at the end, masked
            config = self.config
            pad_id, most = getattr(config, "pad_token_id", None), getattr(config, "max_position_embeddings", None)
            batch, extra = pad_batch(batch, self.parallel.tp_size, pad_id, most)
        length = whole + extra  # of the rows per-position outputs come back as
        if weights is not None:  # [b, s'] as the fused head's log_probs (s' <= s), padded as the batch was
            batch["token_weights"] = F.pad(weights, (0, extra)) if extra else weights
        group = self.parallel.pp_size if self.schedule == "interleaved" else 1
        rows = len(batch["input_ids"])
        copied = group - rows if weighted and rows < group and split is None and not self._router_experts else 0
        if copied:  # (a routing loss would count the copies; a context split's shards are not rows to copy)
            batch = with_ignored_rows(batch, copied)
        routed = self._router_experts  # (each micro-batch its own routing term: the partition is part of the loss)
        micro = split_micro_batches(
            batch, self.num_micro_batches, group, token_weighted=weighted, any_sizes=not routed
        )  # (see there)
        self._micro_count = len(micro)
        self._report_fewer_micro_batches(rows, copied)
        if num_items is not None:
            for chunk in micro:
                chunk["num_items_in_batch"] = num_items / len(micro)
        train = torch.is_grad_enabled() and labels is not None
        losses = self._run(micro, train)
        loss = self._broadcast_loss(losses)
        if self._fused:
            outputs = [self._fused_outputs.pop(i) for i in sorted(self._fused_outputs)]
            output = trim_output(fused_output(outputs, loss, self.parallel), extra, length)
            for name in FUSED_FIELDS if copied else ():  # [b + copied, s'] -> [b, s']
                if isinstance(getattr(output, name, None), torch.Tensor):
                    setattr(output, name, getattr(output, name)[:rows])
        else:
            output = CausalLMOutputWithPast(loss=loss)
        return output.to_tuple() if as_tuple else output

    def _take_flags(self, kwargs: dict[str, Any]) -> bool:
        """The call's keywords that are no per-row tensor, taken out of ``kwargs`` (each micro-batch is cut from
        tensors): whether the caller asked for a tuple (``return_dict=False``). What the pipeline cannot return is
        one line: the hidden states and attention weights stay on their stages."""
        as_tuple = kwargs.pop("return_dict", None) is False
        for name in [k for k, v in kwargs.items() if v is not None and not isinstance(v, torch.Tensor)]:
            value = kwargs.pop(name)
            if name in ("output_hidden_states", "output_attentions") and value:
                raise ConfigError(
                    f"{name}={value!r} with a pipelined model: it returns the loss (and TRL's fused head's per-token "
                    "fields); the states and attention weights stay on the stages that computed them: use pp = 1"
                )
            if name in ("output_hidden_states", "output_attentions", "logits_to_keep") and not value:
                continue  # (asks for nothing: the pipeline returns no logits to keep)
            if name == "output_router_logits" and bool(value) == bool(getattr(self.config, name, False)):
                continue  # (the config's own choice: the stages carry the load-balancing term by it)
            raise ConfigError(
                f"{name}={value!r} with a pipelined model, which cuts each call's per-row tensors into micro-batches "
                "and acts on no other keyword: leave it unset (the config's setting holds), or use pp = 1"
            )
        return as_tuple

    def _report_fewer_micro_batches(self, size: int, copied: int = 0) -> None:
        """Say once per batch size that ``num_micro_batches`` does not divide it (the schedule ran fewer), or that
        the interleaved schedule ran it with ``copied`` rows that count for nothing."""
        if self._micro_count == self.num_micro_batches or size in self._reported_sizes:
            return
        self._reported_sizes.add(size)
        if self.parallel.rank == 0:
            total = size + copied
            rows = total // self._micro_count
            each = f"{rows}" if total % self._micro_count == 0 else f"{rows} or {rows + 1}"
            copies = f", with {copied} row(s) copied and ignored (no loss, no gradient)" if copied else ""
            print(
                f"mtk: a batch of {size} sequences runs as {self._micro_count} micro-batches of {each}{copies}: "
                f"megatron_lm_num_micro_batches = {self.num_micro_batches} does not divide it (the same loss and "
                f"gradients; a multiple of {self.num_micro_batches} runs all of them)",
                flush=True,
            )

    @staticmethod
    def _split_for_context(
        split: ContextSplit, batch: dict[str, Any], num_items: Any
    ) -> tuple[dict[str, Any], Any, int]:
        """``batch`` with this CP rank's tokens (and the :class:`ContextShard` every stage's attention reads), the
        count each rank's loss divides by, and the positions padded at the end of every row. Per-position outputs
        come back as whole padded rows (the pipeline trims them as it trims sequence parallelism's padding)."""
        tensors = {k: batch.pop(k) for k in SPLIT_INPUTS if k in batch}
        length = tensors["input_ids"].shape[1]
        padded = length + (-length % split.multiple)
        local = split(tensors, num_items, row_length=padded)
        local.pop("use_cache")
        num_items = local.pop("num_items_in_batch", None)
        return {**batch, **local}, num_items, padded - length

    def _run(self, micro: list[dict[str, torch.Tensor]], train: bool) -> list[torch.Tensor]:
        info, link, m = self.info, self.link, len(micro)
        dtype, device = cast(torch.dtype, cast(Any, self.module).dtype), micro[0]["input_ids"].device
        message = StageMessage(self.config.hidden_size, dtype, self._router_experts)
        # (chunk, mb) -> what it received (hidden states, routing sums) and what it returned (the loss on the model's
        # last chunk, else the same two)
        held: dict[tuple[int, int], tuple[Received, Any]] = {}
        losses: list[torch.Tensor] = []
        stats = PipelineStats(self.schedule if train else "forward", m)
        start, wait_before = time.perf_counter(), link.wait_s
        model = hf_model(self.module)
        order = schedule_order(self.schedule, m, info.stage, info.num_stages, info.virtual_stages)
        if not train:  # the forwards alone, in the schedule's order (they depend on forwards only)
            order = [step for step in order if step.kind == "F"]
        receives = [  # the passes that receive, in order: each is posted one receive early
            k
            for k, step in enumerate(order)
            if not (info.chunk_is_first(step.chunk) if step.kind == "F" else info.chunk_is_last(step.chunk))
        ]
        next_receive = dict(zip(receives, receives[1:]))
        posted: dict[int, Posted] = {}

        def receive(k: int) -> torch.Tensor:
            """Pass ``k``'s input (activation or gradient); posts the next pass's receive before waiting."""
            if k not in posted:
                posted[k] = post(k)
            if k in next_receive:
                posted[next_receive[k]] = post(next_receive[k])
            return link.wait(posted.pop(k))

        def post(k: int) -> Posted:
            step = order[k]
            numel = message.numel(*micro[step.micro_batch]["input_ids"].shape)  # [b, s, h] (+ sums) both ways
            return link.post(step.kind == "F", (numel,), dtype, device)

        def forward(k: int, chunk: int, i: int) -> None:
            inputs = dict(micro[i])
            received: Received = (None, None)
            if not info.chunk_is_first(chunk):
                received = message.unpack(receive(k), *inputs["input_ids"].shape)
                for tensor in received:
                    if tensor is not None:
                        tensor.requires_grad_(train)
            with swapped(model, self._views[chunk]):
                output = self._stage_forward(inputs, received, info.chunk_is_last(chunk), i)
            if info.chunk_is_last(chunk):
                losses.append(output.detach())
            else:
                link.send_forward(message.pack(*output))
            if train:
                held[chunk, i] = (received, output)
                stats.max_in_flight = max(stats.max_in_flight, len(held))

        reduction = self._overlapped_reduction() if train else None

        def backward(k: int, chunk: int, i: int) -> None:
            with torch.autocast(self.parallel.device.type, enabled=False):  # (accelerate's is around the forward)
                backward_pass(k, chunk, i)

        def backward_pass(k: int, chunk: int, i: int) -> None:
            """Outside a pipeline a backward runs without autocast; here it runs inside the forward accelerate
            wraps in autocast, which would backpropagate a region the model keeps in fp32 in low precision."""
            if reduction is not None and i == m - 1:  # every schedule runs a chunk's micro-batch m - 1 last
                reduction.arm(self._chunk_params[chunk])
            (stage_input, sums_in), output = held.pop((chunk, i))
            if info.chunk_is_last(chunk):
                self.scale_loss(output / m).backward()
                if sums_in is not None and sums_in.grad is None:  # the loss left the earlier stages' sums out
                    raise ConfigError(
                        "the last pipeline stage's loss did not use the routing sums of the earlier stages (the "
                        "model's load-balancing term without transformers' load_balancing_loss_func?); set "
                        "output_router_logits to false in the model's config, or use pp = 1"
                    )
            else:
                grads = message.unpack(receive(k), *micro[i]["input_ids"].shape)
                pairs = [(t, g) for t, g in zip(output, grads) if t is not None and t.requires_grad]
                torch.autograd.backward([t for t, _ in pairs], [cast(torch.Tensor, g).to(t.dtype) for t, g in pairs])
            if not info.chunk_is_first(chunk):
                assert stage_input is not None and stage_input.grad is not None
                link.send_backward(message.pack(stage_input.grad, None if sums_in is None else sums_in.grad))

        context = torch.enable_grad() if train else torch.no_grad()
        with context:
            for k, step in enumerate(order):
                (forward if step.kind == "F" else backward)(k, step.chunk, step.micro_batch)
        link.flush()
        stats.total_s, stats.wait_s = time.perf_counter() - start, link.wait_s - wait_before
        self.stats = stats
        return losses

    def _stage_forward(self, inputs: dict[str, Any], received: Received, last: bool, index: int) -> Any:
        """HF's own forward on this chunk: the loss on the model's last chunk, elsewhere the hidden states and (for
        the router's load-balancing term) the routing sums of every MoE layer so far."""
        stage_input, sums_in = received
        if stage_input is not None:
            del inputs["input_ids"]
            inputs["inputs_embeds"] = stage_input
        weights = inputs.pop("token_weights", None)
        if last:
            with carrying(sums_in):
                outputs = self.module(**inputs, use_cache=False, **({"fused_lm_head": True} if self._fused else {}))
            if self._fused:
                self._fused_outputs[index] = outputs
            loss = outputs.loss
            if weights is not None:  # the batch's sum is the mean over the m micro-batches of m x their sums
                if weights.shape != outputs.log_probs.shape:
                    raise ConfigError(
                        f"token_weights of shape {tuple(weights.shape)} for log_probs of shape "
                        f"{tuple(outputs.log_probs.shape)}: pass one weight per log-probability the head returns"
                    )
                loss = (outputs.log_probs * weights).sum() * self._micro_count
            if loss is None:
                raise ConfigError("the last pipeline stage computed no loss; pass labels")
            return loss
        inputs.pop("labels", None)
        inputs.pop("shift_labels", None)
        inputs.pop("num_items_in_batch", None)
        decoder = cast(Any, hf_model(self.module)).base_model  # HF's, not a PeftModel's (its LoraModel)
        if not self._router_experts:
            return decoder(**inputs, use_cache=False).last_hidden_state, None  # [b, s, h]
        outputs = decoder(**inputs, use_cache=False, output_router_logits=True)
        return outputs.last_hidden_state, stage_routing_sums(
            outputs.router_logits, inputs, sums_in, self._router_experts, self._router_top_k, self.parallel.device
        )

    def _params_by_chunk(self) -> list[list[nn.Parameter] | None]:
        """The parameters each chunk's backward makes final: its blocks', the head's on the last chunk,
        everything else (the embeddings) on the first."""
        info = self.info
        chunk_of_layer = {index: c for c, layers in enumerate(info.chunks) for index in layers}
        last_modules = tuple(name + "." for name, _ in info.last_modules)
        chunks: list[list[nn.Parameter] | None] = [[] for _ in info.chunks]
        for name, param in hf_model(self.module).named_parameters():
            if name.startswith(info.layers_name + "."):
                chunk = chunk_of_layer[int(name[len(info.layers_name) + 1 :].split(".")[0])]
            else:
                chunk = info.virtual_stages - 1 if name.startswith(last_modules) else 0
            cast(list, chunks[chunk]).append(param)
        return chunks

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean micro-batch loss of the last stage, on every stage."""
        device = self.parallel.device
        loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=device)
        if self.parallel.pp_size > 1:
            loss = loss.reshape(1).to(device).contiguous()
            dist.broadcast(loss, src=self.parallel.pp_ranks[-1], group=self.parallel.pp_group)
            loss = loss[0]
        return loss

    # ---------------------------------------------------------------------------- gradient sync
    def _tied_params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if param_info(p).pipeline_tied]

    @torch.no_grad()
    def _sync_tied_weights(self) -> None:
        """Start the two copies of a tied embedding equal: the first stage's values win."""
        tied, group = self._tied_params(), self.parallel.embedding_group
        if tied and group is not None:
            for param in tied:
                dist.broadcast(param.data, src=self.parallel.embedding_ranks[0], group=group)

    def _overlapped_reduction(self) -> OverlappedReduction | None:
        """The DP reduction to start from this call's last backward, when the call ends an optimizer step."""
        if self._reduction is not None:
            raise ConfigError("a pipeline step ended without finalize_grads: call it (accelerator.backward) per step")
        if self.parallel.replica_size == 1 or self.syncs_this_call is None or not self.syncs_this_call():
            return None
        if self.sharded_over_data_parallel:
            return None
        tied = {id(p) for p in self._tied_params()}  # summed over the embedding group first, in finalize_grads
        untied = [p for p in self._replicated_params() if id(p) not in tied]
        self._reduction = OverlappedReduction(untied, self.parallel.replica_group)
        return self._reduction

    def finalize_grads(self) -> None:
        """Once per optimizer step, after the last micro-batch's backward: sum the tied copies'
        gradients over the embedding group, then average every gradient over the DP x CP replicas
        (waiting for the buckets the last backward started, if it did)."""
        tied = [local(p.grad) for p in self._tied_params() if p.grad is not None]
        if tied and self.parallel.embedding_group is not None:  # FSDP2: both copies cut alike over DP
            all_reduce_coalesced(tied, self.parallel.embedding_group)
        if self.sharded_over_data_parallel:  # FSDP2 reduce-scattered every backward already
            return
        if self._reduction is not None:
            self._reduction.finish()
            self._reduction = None
            all_reduce_coalesced(tied, self.parallel.replica_group, average=True)
            return
        grads = [p.grad for p in self._replicated_params() if p.grad is not None]
        all_reduce_coalesced(grads, self.parallel.replica_group, average=True)  # DP x CP: the same weights

    def _replicated_params(self) -> list[nn.Parameter]:
        """The trainable parameters every DP x CP replica holds alike: all but experts spread over EP, which
        ``accelerator.backward`` reduces over the ranks holding the same experts
        (:func:`~mtk.parallel.expert_parallel.reduce_expert_gradients`)."""
        return [p for p in self.module.parameters() if p.requires_grad and not is_expert_parallel(p)]
