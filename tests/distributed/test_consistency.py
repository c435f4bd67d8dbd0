"""The ranks of one model replica compute on the same batch, dropout stream and weights, whatever each process
seeded (issue 31): a plain accelerate loop that seeds as accelerate documents for multi-process runs,
``set_seed(0, device_specific=True)``, builds GPT-2 from its config and shuffles with the global generator
trains at TP=2 (and TP2 x PP2, and CP 2) exactly as one process does, with fixed-length and padded variable-length
batches; the batch broadcast itself and the loss check are tested on their own.
"""

from contextlib import nullcontext

import pytest
import torch

from mtk.testing import assert_close_rel, run_distributed

STEPS = 2


def _train(rank, world_size, tp_size, pp_size, padded, device_specific, attn_pdrop, dropout, cp_size=1):
    """Two SGD steps of tiny GPT-2 in a plain accelerate loop: the losses; the first step's full gradients of this
    stage (TP rank 0); the weights before and after (rank 0)."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from mtk import Accelerator, ParallelConfig
    from mtk.config import RunSettings
    from mtk.models import builtin_config
    from mtk.parallel.gather import iter_full_tensors
    from mtk.parallel.parameters import param_info

    settings = RunSettings(num_micro_batches=2) if pp_size > 1 else RunSettings()
    layout = ParallelConfig(tp_size=tp_size, pp_size=pp_size, cp_size=cp_size)
    accelerator = Accelerator(parallel_config=layout, run_settings=settings)
    set_seed(0, device_specific=device_specific)  # as users do: after the Accelerator, before model and data
    config = builtin_config("tiny-gpt2")
    config.attn_pdrop, config.resid_pdrop, config.embd_pdrop = attn_pdrop, dropout, dropout
    model = AutoModelForCausalLM.from_config(config)  # initialized from this process's seed
    data_gen = torch.Generator().manual_seed(1)  # the data set itself is the same everywhere
    lengths = torch.randint(4, 17, (16,), generator=data_gen) if padded else torch.full((16,), 16)
    data = [torch.randint(0, 256, (int(n),), generator=data_gen) for n in lengths]

    def collate(seqs):
        ids = torch.full((len(seqs), max(len(s) for s in seqs)), config.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate)  # shuffled by the global generator
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    before = _numpy(accelerator.get_state_dict(model))
    losses, grads = [], {}
    for batch in loader:
        num_items = (batch["labels"][:, 1:] != -100).sum()
        loss = model(**batch, num_items_in_batch=num_items).loss
        accelerator.backward(loss)
        if not losses:
            stage = accelerator.unwrap_model(model)
            for name, grad in iter_full_tensors(stage, accelerator.parallel.tp_group, grads=True):
                if not param_info(stage.get_parameter(name)).pipeline_duplicate:
                    grads[name] = grad.numpy()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == STEPS:
            break
    after = _numpy(accelerator.get_state_dict(model))
    return losses, grads if accelerator.parallel.tp_rank == 0 else None, (before, after) if rank == 0 else None


def _numpy(state):
    return {name: tensor.numpy() for name, tensor in state.items()}  # plain pickles back to the test


def _assert_trains_as(results, reference):
    ref_losses, ref_grads, (ref_before, ref_after) = reference
    for rank, (losses, _, _) in enumerate(results):
        assert_close_rel(torch.tensor(losses), torch.tensor(ref_losses), f"rank {rank} losses")
    grads = {name: grad for _, stage, _ in results if stage is not None for name, grad in stage.items()}
    assert sorted(grads) == sorted(ref_grads)
    scale = max(abs(g).max() for g in ref_grads.values())
    for name, grad in grads.items():  # near-zero gradients are judged against the model's largest
        assert_close_rel(grad, ref_grads[name], f"{name} gradient", scale_floor=1e-3 * scale)
    before, after = results[0][2]
    assert sorted(before) == sorted(ref_before)
    for name in ref_before:
        assert (before[name] == ref_before[name]).all(), f"{name}: initial weights differ from process 0's"
        assert_close_rel(after[name], ref_after[name], f"{name} after {STEPS} steps")


@pytest.mark.parametrize("padded", [False, True], ids=["fixed-length", "padded"])
def test_tp2_with_device_specific_seeds_trains_as_one_process(padded):
    # attention dropout draws from the per-TP-rank stream (Megatron's), which one process cannot reproduce;
    # the residual and embedding dropouts are the replicated regions, drawn from the shared default stream
    reference = run_distributed(_train, world_size=1, args=(1, 1, padded, True, 0.0, 0.1))[0]
    results = run_distributed(_train, world_size=2, args=(2, 1, padded, True, 0.0, 0.1))
    _assert_trains_as(results, reference)


def test_tp2_with_device_specific_seeds_draws_what_a_common_seed_draws():
    # every dropout on, the TP stream included: it derives from the source rank's seed
    common = run_distributed(_train, world_size=2, args=(2, 1, True, False, 0.1, 0.1))
    specific = run_distributed(_train, world_size=2, args=(2, 1, True, True, 0.1, 0.1))
    assert common[0][0] == specific[0][0] == specific[1][0], (common[0][0], specific[0][0])
    for name, array in common[0][2][1].items():
        assert (array == specific[0][2][1][name]).all(), name


def test_tp2_pp2_with_device_specific_seeds_trains_as_one_process():
    # no dropout: micro-batches draw their masks in another order than one whole-batch forward
    reference = run_distributed(_train, world_size=1, args=(1, 1, True, True, 0.0, 0.0))[0]
    results = run_distributed(_train, world_size=4, args=(2, 2, True, True, 0.0, 0.0))
    _assert_trains_as(results, reference)


def test_cp2_with_device_specific_seeds_trains_as_one_process():
    # the CP ranks split the rows of one batch: each process's own shuffle gave each CP rank another row, and the
    # attention mixed keys of unrelated sequences without a word (no dropout: CP's chunks draw their own masks)
    reference = run_distributed(_train, world_size=1, args=(1, 1, True, True, 0.0, 0.0))[0]
    results = run_distributed(_train, world_size=2, args=(1, 1, True, True, 0.0, 0.0, 2))
    _assert_trains_as(results, reference)


def _broadcast(rank, world_size):
    import torch.distributed as dist

    from mtk.errors import TrainingError
    from mtk.parallel.collective_count import count_collectives
    from mtk.parallel.consistency import BroadcastBatches, broadcast_batch, check_same_loss
    from mtk.parallel.state import ParallelState

    parallel = ParallelState.build(tp_size=2)
    group, src, device = parallel.batch_group, parallel.batch_src_rank, parallel.device
    batch = {
        "input_ids": torch.full((2, 3 + rank), rank),  # a different shape on each rank
        "scores": torch.rand(4) + rank,
        "mask": torch.tensor([True, rank == 0]),
        "nested": [torch.arange(rank + 1).double(), ("name", rank)],
        "meta": {"source": f"rank {rank}"},
    }
    with count_collectives() as log:
        agreed = broadcast_batch(batch, group, src, device)
    if rank == 0:
        assert agreed is batch  # the source keeps its own batch
    else:
        assert sorted(agreed) == sorted(batch)
        assert torch.equal(agreed["input_ids"], torch.zeros(2, 3, dtype=torch.long))
        assert torch.equal(agreed["mask"], torch.tensor([True, True]))
        assert torch.equal(agreed["nested"][0], torch.zeros(1, dtype=torch.float64))
        assert agreed["nested"][1] == ("name", 0) and agreed["meta"] == {"source": "rank 0"}
        assert agreed["scores"].dtype == torch.float32 and agreed["mask"].dtype == torch.bool
    # structure and non-tensors (pickled: its length, its bytes), then one buffer per dtype (4 here)
    assert log.counts() == {"broadcast": 2 + 4}, log.counts()
    scores = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(scores, agreed["scores"][:1].contiguous())
    assert scores[0] == scores[1]

    loader = [{"x": torch.tensor([rank, i])} for i in range(3)]
    assert [b["x"].tolist() for b in BroadcastBatches(loader, group, src, device)] == [[0, 0], [0, 1], [0, 2]]
    uneven = BroadcastBatches(loader[: 2 + rank], group, src, device)  # rank 1's loader has one batch more
    with pytest.raises(TrainingError, match="different number of batches") if rank == 1 else nullcontext():
        list(uneven)  # rank 0 ends after two batches; rank 1 gets its end marker in place of a third

    with count_collectives() as log:
        check_same_loss(torch.tensor(2.5), group, device)  # the same loss: no word
    assert log.counts() == {"all_reduce": 1}, log.counts()
    with pytest.raises(TrainingError, match="backpropagate different losses"):
        check_same_loss(torch.tensor(float(rank)), group, device)
    return True


def test_broadcast_batch_and_the_checks():
    assert run_distributed(_broadcast, world_size=2) == [True, True]


def _iterable(rank, world_size, tp_size):
    """A plain accelerate loop over an IterableDataset (a stream): the losses of every batch it trains on."""
    from torch.utils.data import DataLoader, IterableDataset

    from mtk import Accelerator, ParallelConfig
    from mtk.models import build_model

    class Stream(IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(1)
            for _ in range(16):
                yield torch.randint(0, 256, (16,), generator=generator)

    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=tp_size))
    model = build_model("tiny-llama", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(Stream(), batch_size=4, collate_fn=lambda rows: {"input_ids": torch.stack(rows)})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch, labels=batch["input_ids"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_an_iterable_dataset_at_tp2_trains_on_every_batch_as_one_process():
    """accelerate dispatches an iterable dataset's batches one per process; the TP peers of a replica then used
    only their source's, and half the stream was read and dropped without a word (2 of 4 steps at TP 2)."""
    reference = run_distributed(_iterable, world_size=1, args=(1,))[0]
    assert len(reference) == 4
    for losses in run_distributed(_iterable, world_size=2, args=(2,)):
        assert_close_rel(torch.tensor(losses), torch.tensor(reference), "losses")


def _stream_rows_gathered(rank, world_size, kind, batch_size):
    """Row ids of a 10-row stream, evaluated in batches of ``batch_size`` and gathered for metrics, and how many
    losses the Trainer's evaluation keeps (it gathers each batch's loss repeated ``batch_size`` times): tp 2 x dp 2
    on 4 processes, tp 2 on 2, plain accelerate on one."""
    import datasets
    from torch.utils.data import DataLoader, IterableDataset

    from mtk import Accelerator, ParallelConfig

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(10)

    if kind == "torch":
        stream = Stream()
    else:  # 3 shards of 4, 3 and 3 rows: split by shards, one replica had 7 rows and the other 3
        stream = datasets.Dataset.from_list([{"id": i} for i in range(10)]).to_iterable_dataset(num_shards=3)
    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=min(world_size, 2)))
    collate = (
        (lambda rows: torch.tensor(rows)) if kind == "torch" else (lambda rows: torch.tensor([r["id"] for r in rows]))
    )
    loader = accelerator.prepare(DataLoader(stream, batch_size=batch_size, collate_fn=collate))
    gathered, losses = [], 0
    for batch in loader:
        gathered.append(accelerator.gather_for_metrics(batch))
        losses += len(accelerator.gather_for_metrics(torch.zeros(1).repeat(batch_size)))
    return torch.cat(gathered).tolist(), losses


@pytest.mark.parametrize("kind", ["torch", "datasets"])
def test_a_stream_evaluated_where_a_replica_spans_ranks_gathers_each_row_once(kind):
    """A stream's last batch is evened out with repeats of its first rows, which gather_for_metrics kept (mtk reads
    streams without accelerate's dispatching where a replica spans ranks: a 10-row evaluation scored 12 rows); a
    ``datasets`` stream of 3 shards was split by its shards, the replicas drawing 4 and 2 batches; at tp 2 alone the
    last, short batch's loss counted as a full batch's. Each row once, in plain accelerate's order."""
    for batch_size in (2, 3):
        (reference,) = run_distributed(_stream_rows_gathered, world_size=1, args=(kind, batch_size))
        assert reference == (list(range(10)), 10)
        for world_size in (2, 4):  # tp 2, tp 2 x dp 2
            for result in run_distributed(_stream_rows_gathered, world_size=world_size, args=(kind, batch_size)):
                assert result == reference, (world_size, batch_size)


def _per_rank_batches(rank, world_size):
    """A loop that feeds each TP rank its own batch (not from a prepared loader): the message, if any."""
    from mtk import Accelerator, ParallelConfig
    from mtk.errors import TrainingError
    from mtk.models import build_model

    accelerator = Accelerator(parallel_config=ParallelConfig(tp_size=2))
    model = accelerator.prepare(build_model("tiny-llama", seed=0))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids)  # the same batch on both ranks: no complaint
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    try:
        model(input_ids=ids, labels=ids)
    except TrainingError as err:
        return str(err)
    return None


def test_per_rank_inputs_at_tp2_are_one_line_not_a_mixed_loss():
    """Token ids that differ per TP rank used to train silently: the vocab-parallel embedding and loss all-reduce,
    so both ranks shared one loss of their mixed inputs and the loss check saw nothing."""
    for message in run_distributed(_per_rank_batches, world_size=2):
        assert message and "call the model on different inputs" in message
