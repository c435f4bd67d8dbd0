"""Expert parallelism against one process: each rank its own batch (EP is carved out of DP), the experts spread over
the EP group, tokens dispatched by all-to-all. Logits, the loss with its load-balancing term, and every gradient
(dense ones averaged over DP, expert ones summed over the expert-data-parallel ranks and divided by DP) equal the
one-process model's on the same batches (fp32, 1e-5)."""

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from mtk.parallel.expert_parallel import expert_placement, is_expert_parallel, spread_experts
from mtk.parallel.parameters import is_tensor_parallel, param_info
from mtk.testing import assert_close_rel, run_distributed
from mtk.verify.sweep import tiny_config

ROWS, SEQ = 2, 12  # per rank


def _config(model_type: str, experts: int):
    config = tiny_config(model_type)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hasattr(config, name):
            setattr(config, name, experts)
    config.router_aux_loss_coef = 0.1  # a load-balancing term large enough to show in the loss and the router
    return config


def _groups(world: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """EP groups of consecutive ranks, and the expert-data-parallel groups across them (every rank joins all)."""
    ep_group = edp_group = None
    for start in range(0, world, ep):
        group = dist.new_group(list(range(start, start + ep)))
        if start <= dist.get_rank() < start + ep:
            ep_group = group
    for offset in range(ep):
        group = dist.new_group(list(range(offset, world, ep)))
        if dist.get_rank() % ep == offset:
            edp_group = group
    return ep_group, edp_group


def _ep_worker(
    rank: int, world: int, model_type: str, ep: int, experts: int, skewed: bool, only_experts: bool = False
) -> dict:
    torch.manual_seed(0)
    config = _config(model_type, experts)
    if only_experts:  # eager experts give an output without a gradient to a rank that received no token
        config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float()
    if only_experts:  # everything else frozen: the first MoE layer's input needs no gradient
        for name, param in model.named_parameters():
            param.requires_grad_("experts" in name)
    if skewed:  # the last EP rank's experts are never chosen: the router sends their picks to the experts before
        blocked = experts - experts // ep
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.register_forward_hook(
                    lambda m, args, out: (*out[:2], torch.where(out[2] >= blocked, out[2] - experts // ep, out[2]))
                )
    reference = copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (world * ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * ROWS : (rank + 1) * ROWS]

    # one process: every rank's batch, the losses averaged as DP averages them
    losses, logits = [], None
    for r in range(world):
        part = ids[r * ROWS : (r + 1) * ROWS]
        out = reference(input_ids=part, labels=part, use_cache=False)
        losses.append(out.loss)
        if r == rank:
            logits = out.logits.detach()
    torch.stack(losses).mean().backward()

    ep_group, edp_group = _groups(world, ep)
    assert spread_experts(model, ep_group) > 0
    spread = [p for p in map(expert_placement, model.modules()) if p is not None]
    assert all(p.local == experts // ep for p in spread)
    routed: list[torch.Tensor] = []  # each MoE layer's expert choices of this rank's tokens, [T, k]
    for module in model.modules():
        if expert_placement(module) is not None:
            module.register_forward_pre_hook(lambda m, args: routed.append(args[1].detach().clone()))
    out = model(input_ids=mine, labels=mine, use_cache=False)
    out.loss.backward()
    assert_close_rel(out.logits.detach(), logits, "logits")
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert_close_rel(loss / world, torch.stack(losses).mean().detach(), "loss with the load-balancing term")

    expected = dict(reference.named_parameters())
    compared = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        placement = expert_placement(owner)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=edp_group if placement is not None else None)
        grad /= world
        want = expected[name].grad
        if placement is not None:
            want = want[placement.first : placement.first + placement.local]
        assert_close_rel(grad, want, f"gradient of {name}")
        compared += 1
    taken = []  # per layer, how many (token, choice) pairs of the whole EP group this rank's experts took
    for choices, placement in zip(routed, spread):
        every = [torch.empty_like(choices) for _ in range(ep)]
        dist.all_gather(every, choices, group=ep_group)
        hits = torch.cat(every).flatten()
        taken.append(int(((hits >= placement.first) & (hits < placement.first + placement.local)).sum()))
    return {"compared": compared, "fewest_taken": min(taken)}


@pytest.mark.parametrize(
    ("model_type", "world", "ep", "experts"),
    [("qwen3_moe", 2, 2, 4), ("mixtral", 4, 4, 8), ("olmoe", 4, 2, 4), ("qwen2_moe", 2, 2, 4)],
)
def test_expert_parallel_equals_one_process(model_type, world, ep, experts):
    """EP = DP (each rank all of its EP group's batches' tokens for its experts) and EP < DP (experts replicated
    over the expert-data-parallel ranks); Qwen2-MoE's shared expert stays dense."""
    results = run_distributed(_ep_worker, world_size=world, args=(model_type, ep, experts, False), timeout=600)
    assert all(r["compared"] > 0 for r in results)


def test_experts_that_get_no_token_on_a_rank_still_exchange_in_backward():
    """8 experts at EP 4, the router never choosing the last rank's two: that rank's experts receive no token (their
    gradients stay empty), and the backward all-to-alls still pair up on every rank, also where only the experts
    train and eager experts give that rank an output without a gradient."""
    for only_experts in (False, True):  # True: only the experts train, so the exchange alone carries the gradient
        results = run_distributed(_ep_worker, world_size=4, args=("qwen3_moe", 4, 8, True, only_experts), timeout=600)
        assert all(r["compared"] > 0 for r in results)
        assert min(r["fewest_taken"] for r in results) == 0, results  # a rank whose experts got nothing in a layer


@pytest.mark.parametrize(("model_type", "world", "ep"), [("qwen3_moe", 2, 1), ("mixtral", 4, 2), ("qwen2_moe", 4, 2)])
def test_experts_whole_on_each_tp_rank_equal_one_process(model_type, world, ep):
    """The experts' TP size 1 at TP 2: every expert whole on each TP rank, each running them on its share of the
    tokens (13 of them: shares of 7 and 6), alone and inside EP 2 (Mixtral; Qwen2-MoE with its shared expert, which
    stays TP-split as a dense MLP): logits, the loss with its load-balancing term and every gradient against one
    process (fp32; ``mtk verify --etp 1``, in fp64 about 1e-15)."""
    from mtk.verify import verify_worker

    args = (_config(model_type, 4), "fp32", 1, 13, 0, False, ep, 1)
    for result in run_distributed(verify_worker, world_size=world, args=args, timeout=600):
        assert not result.error and result.num_params > 0, result
        assert max(result.logits, result.loss, result.grads) < 1e-5, result


def _accelerator_worker(
    rank: int,
    world: int,
    tp: int,
    ep: int,
    sharded: bool,
    cp: int = 1,
    pp: int = 1,
    shard: int = 1,
    etp: int | None = None,
) -> list[tuple[float, float]]:
    """Three optimizer steps through ``mtk.Accelerator`` at EP (DDP ignores the experts, which backward() reduces over
    their replicas; clipping by the norm that counts each expert once) against one process on the global batch.
    ``sharded``: with the distributed optimizer (dense state over DP, the experts' over their replicas); ``shard``
    > 1: FSDP2 over ``shard`` DP ranks (HSDP where they are fewer than DP), the experts left whole."""
    from accelerate.parallelism_config import ParallelismConfig

    from mtk import Accelerator, ParallelConfig, RunSettings

    dp = world // (tp * cp * pp)
    fsdp = dict(parallelism_config=ParallelismConfig(dp_shard_size=shard, dp_replicate_size=dp // shard))
    accelerator = Accelerator(
        **(fsdp if shard > 1 else {}),
        parallel_config=ParallelConfig(tp_size=tp, ep_size=ep, cp_size=cp, pp_size=pp, etp_size=etp),
        run_settings=RunSettings(
            use_distributed_optimizer=sharded,
            num_micro_batches=2,
            # the 4-rank pipeline interleaved (two chunks of one layer per stage: every chunk's experts exchange)
            pipeline_schedule="interleaved" if pp > 1 and world == 4 else "1f1b",
            virtual_stages=2 if pp > 1 and world == 4 else 1,
        ),
    )
    parallel = accelerator.parallel
    torch.manual_seed(0)
    config = _config("qwen3_moe", 4)  # the load-balancing term: summed over CP, carried through a pipeline's stages
    model = AutoModelForCausalLM.from_config(config).float()
    reference = copy.deepcopy(model)
    # SGD with momentum: linear in the gradients, so the weights compare at the bar (Adam's first steps divide tiny
    # gradients by their own size, and turn rounding into sign flips of whole updates)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if tp > 1:  # the q/k norms (and whole experts) are summed over TP once per step, by backward(), not in backward
        shared = {name for name, p in model.named_parameters() if param_info(p).tp_shared}
        assert shared and all(param_info(p).tp_summed_at_step for n, p in model.named_parameters() if n in shared)
        assert any(".experts." in name for name in shared) == (etp == 1), shared
    if sharded:  # each parameter updated by one rank of the group holding it alike
        kept = [p for group in optimizer.param_groups for p in group["params"]]
        for experts in (True, False):
            held = sum(p.numel() for p in kept if is_expert_parallel(p) == experts)
            group = parallel.expert_replica_group if experts else parallel.replica_group
            every = sum(
                p.numel() for p in accelerator.unwrap_model(model).parameters() if is_expert_parallel(p) == experts
            )
            total = torch.tensor(held)
            dist.all_reduce(total, group=group)
            assert int(total) == every and (held < every or dist.get_world_size(group) == 1), (experts, held, every)
    if shard > 1:  # the dense parameters split over DP by FSDP2, the spread experts left whole
        held = list(accelerator.unwrap_model(model).parameters())
        assert all(isinstance(p, DTensor) != is_expert_parallel(p) for p in held)
    expected = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, 256, (parallel.dp_size * ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if pp > 1:  # padding the loss and the load-balancing term leave out: the first row of each micro-batch pair
        mask[::2, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    rows = slice(parallel.dp_rank * ROWS, (parallel.dp_rank + 1) * ROWS)
    logged = []
    for _ in range(3):
        out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False)
        accelerator.backward(out.loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        loss = accelerator.reduce(out.loss.detach(), reduction="mean")  # over DP: each rank's batch once

        whole = torch.stack([_reference_loss(reference, ids, mask, labels, r, pp) for r in range(parallel.dp_size)])
        whole = whole.mean()
        whole.backward()
        whole_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        expected.step()
        expected.zero_grad()
        assert_close_rel(loss, whole.detach(), "loss")
        assert_close_rel(norm, whole_norm, "gradient norm")
        logged.append((float(loss), float(norm)))
    if tp == 1 or etp == 1:  # every weight a rank holds whole after three steps; the experts its EP share
        wanted = dict(reference.named_parameters())
        trained = accelerator.unwrap_model(model)
        for name, param in trained.named_parameters():
            if is_tensor_parallel(param):  # (split over TP: compared by the norms above)
                continue
            placement = expert_placement(trained.get_submodule(name.rsplit(".", 1)[0]))
            want = wanted[name].detach()
            param = param.full_tensor() if isinstance(param, DTensor) else param  # FSDP2's: gathered over DP
            if placement is not None:
                want = want[placement.first : placement.first + placement.local]
            assert_close_rel(param.detach(), want, f"{name} after 3 steps")
    return logged


def _reference_loss(reference, ids, mask, labels, rank: int, pp: int) -> torch.Tensor:
    """DP rank ``rank``'s loss on one process: under a pipeline, the mean of its 2 micro-batches' losses (each its
    own load-balancing term, the tokens' losses over the whole batch's count), as one process accumulating them."""
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    if pp == 1:
        return reference(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False).loss
    count = (labels[rows, 1:] != -100).sum()
    losses = [
        reference(
            input_ids=ids[[row]], attention_mask=mask[[row]], labels=labels[[row]], num_items_in_batch=count / 2
        ).loss
        for row in range(rows.start, rows.stop)
    ]
    return torch.stack(losses).mean()


@pytest.mark.parametrize(
    ("world", "tp", "ep", "sharded", "cp", "pp", "shard", "etp"),
    [
        (2, 1, 2, False, 1, 1, 1, None),
        (4, 2, 2, False, 1, 1, 1, None),
        (4, 2, 2, True, 1, 1, 1, 1),
        (4, 2, 1, False, 1, 1, 2, 1),
        (4, 2, 1, False, 1, 2, 1, 1),
        (4, 1, 2, True, 1, 1, 1, None),
        (4, 1, 2, False, 2, 1, 1, None),
        (8, 2, 2, True, 2, 1, 1, None),
        (4, 1, 1, False, 2, 1, 1, None),
        (4, 1, 2, False, 1, 2, 1, None),
        (8, 2, 2, True, 1, 2, 1, None),
        (4, 1, 2, False, 2, 2, 1, None),
        (4, 1, 2, False, 1, 1, 4, None),
        (8, 2, 2, False, 1, 1, 2, None),
    ],
)
def test_accelerator_trains_at_expert_parallelism_as_one_process(world, tp, ep, sharded, cp, pp, shard, etp):
    """EP 2 over DP 2; EP 2 with the experts split over TP 2 (Megatron's expert-tensor parallelism = TP); EP 2 inside
    DP 4 with the distributed optimizer (the experts' state sharded over their 2 replicas, the dense over 4); EP 2
    over a CP 2 x DP 2 replica set (the EP group is the CP pair: its ranks dispatch different parts of one row); EP 2
    inside DP 2 x CP 2 with TP 2 and the distributed optimizer; EP 2 over the DP pairs of an interleaved PP 2 (each
    stage's chunks exchange with their counterparts; the pipeline's DP reduction leaves the experts alone); EP 2 x
    TP 2 x PP 2 (1F1B) with the distributed optimizer; EP 2 inside FSDP2 over DP 4; EP 2 x TP 2 inside HSDP (2
    replicas of dp_shard 2); CP 2 x DP 2 without EP: losses, clipped gradient norms and (at TP 1) every weight a rank
    holds after 3 steps equal one process's; EP 2 over CP 2 inside an interleaved PP 2. The loss includes the
    load-balancing term (mtk.parallel.router_loss: at CP summed over the group; under a pipeline each micro-batch's
    routing sums carried through the stages, with padding the term and the loss leave out). With the experts' TP
    size 1 (each expert whole on every TP rank, each rank its share of the tokens): EP 2 x TP 2 with the distributed
    optimizer, TP 2 inside FSDP2 over DP 2 without EP (the experts sharded by FSDP2, their gradients summed over TP
    after backward) and TP 2 x PP 2 (1F1B, padded rows), every expert weight compared too."""
    args = (tp, ep, sharded, cp, pp, shard, etp)
    logged = run_distributed(_accelerator_worker, world_size=world, args=args, timeout=600)
    assert all(run == logged[0] for run in logged)


@contextlib.contextmanager
def _recording_reads():
    """Every safetensors slicer the checkpoint reader opens (``bytes_read`` counts what it read from disk)."""
    import mtk.checkpoint.safetensors_slices as slices

    opened: list = []

    class Recording(slices.SafetensorsFile):
        def get_slice(self, name):
            slicer = super().get_slice(name)
            opened.append(slicer)
            return slicer

    original = slices.SafetensorsFile
    slices.SafetensorsFile = Recording  # type: ignore[misc]  # what open_safetensors constructs
    try:
        yield opened
    finally:
        slices.SafetensorsFile = original  # type: ignore[misc]


def _checkpoint_worker(rank: int, world: int, directory: str, fsdp: bool) -> dict:
    """One AdamW step at EP 2 inside DP 4 with the distributed optimizer (or FSDP2 over the 4), a checkpoint, then
    the weights and moments scrambled and the checkpoint loaded back."""
    from accelerate.parallelism_config import ParallelismConfig
    from safetensors import safe_open

    from mtk import Accelerator, ParallelConfig, RunSettings
    from mtk.parallel.collective_count import count_collectives
    from mtk.parallel.fsdp import local

    sharding = dict(parallelism_config=ParallelismConfig(dp_shard_size=world)) if fsdp else {}
    accelerator = Accelerator(
        **sharding,
        parallel_config=ParallelConfig(ep_size=2),
        run_settings=RunSettings(use_distributed_optimizer=not fsdp),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("qwen3_moe", 4)).float()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
    optimizer.step()
    optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    expert_numel = max(p.numel() for p in trained.parameters() if is_expert_parallel(p))
    with count_collectives() as log:
        accelerator.save_state(directory)
    gathered = max((e.nbytes for e in log.of("all_gather")), default=0)
    assert gathered < expert_numel * 4, f"a save gathered {gathered} bytes: an experts tensor is {expert_numel * 4}"
    saved = {n: local(p).detach().clone() for n, p in trained.named_parameters()}
    moments = {id(p): {k: local(v).clone() for k, v in s.items()} for p, s in optimizer.optimizer.state.items()}
    with torch.no_grad():
        for param in trained.parameters():
            local(param).fill_(0.5)
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if value.dim():
                local(value).fill_(0.5)
    with _recording_reads() as slicers:
        accelerator.load_state(directory)
    read_experts = sum(  # AdamW's step scalars aside
        s.bytes_read // s.dtype.itemsize for s in slicers if ".mlp.experts." in s.name and s.get_shape()
    )
    own_experts = sum(p.numel() for p in trained.parameters() if is_expert_parallel(p))
    assert read_experts == 3 * own_experts, f"read {read_experts} expert elements, holds 3 x {own_experts}"
    for name, param in trained.named_parameters():
        assert torch.equal(local(param).detach(), saved[name]), f"{name} after load"
    for param, state in optimizer.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(local(value), moments[id(param)][key]), f"moment {key} after load"
    files = {}
    if rank == 0:
        for stem in [f"piece{i:02d}" for i in range(4 if fsdp else 2)]:
            with safe_open(f"{directory}/model/tp00-pp00-{stem}.safetensors", "pt") as handle:
                files[stem] = sorted(handle.keys())
    return files


@pytest.mark.parametrize("fsdp", [False, True], ids=["distributed-optimizer", "fsdp2"])
def test_a_checkpoint_at_expert_parallelism_is_written_in_pieces_and_reads_back_exactly(tmp_path, fsdp):
    """Each rank of the first EP group writes its own experts (piece ``ep_rank``; piece 0 also the dense tensors):
    no rank gathers an experts tensor (at Qwen3-30B-A3B's EP 8 gathering them all took 8x each rank's experts and
    their moments). Under FSDP2 (over DP 4) the pieces are FSDP2's, each rank's holding its part of every dense
    tensor and, on the first holders (ranks 0 and 1), their experts. Its weights and AdamW moments (the distributed
    optimizer's gathered from their owners) load back exactly at the same layout, each rank reading its own experts'
    rows of the weights and moments only; tests/e2e/test_expert_parallel.py resumes such checkpoints at EP 1."""
    results = run_distributed(_checkpoint_worker, world_size=4, args=(str(tmp_path / "step"), fsdp), timeout=600)
    files = results[0]
    experts = {stem: [n for n in names if ".mlp.experts." in n] for stem, names in files.items()}
    assert experts["piece00"] and sorted(experts["piece01"]) == sorted(experts["piece00"])
    assert all(not experts[stem] for stem in files if stem not in ("piece00", "piece01")), experts
    assert "lm_head.weight" in files["piece00"] and (files["piece01"] == experts["piece01"]) != fsdp
    meta = json.loads((tmp_path / "step" / "metadata.json").read_text())
    assert meta["pieces"] == (4 if fsdp else 2) and meta["topology"] == {
        "world": 4,
        "tp": 1,
        "pp": 1,
        "dp": 4,
        "ep": 2,
    }


def _lora_checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    """LoRA on the expert tensors at EP 2 inside DP 4 with the distributed optimizer: one AdamW step, a checkpoint,
    the factors and moments scrambled and the checkpoint loaded back. Each rank holds its experts' part of every
    factor; ``lora_A``'s part is a run of its rows (each EP rank writes its own), ``lora_B``'s interleaves the
    experts (the expert index fastest), so its EP rank 0 writes it whole."""
    from peft import LoraConfig
    from safetensors import safe_open

    from mtk import Accelerator, ParallelConfig, RunSettings
    from mtk.lora import get_peft_model

    accelerator = Accelerator(
        parallel_config=ParallelConfig(ep_size=2), run_settings=RunSettings(use_distributed_optimizer=True)
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config("qwen3_moe", 4)).float()
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=experts, init_lora_weights=False)
    model = get_peft_model(accelerator.parallelize(base), lora, report=lambda *_: None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trainable, lr=1e-2))
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
    optimizer.step()
    optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    factors = {n: p for n, p in trained.named_parameters() if p.requires_grad and is_expert_parallel(p)}
    assert factors and all(".experts." in n and ".lora_" in n for n in factors), sorted(factors)
    accelerator.save_state(directory)
    saved = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.optimizer.state.items()}
    with torch.no_grad():
        for param in trained.parameters():
            if param.requires_grad:
                param.fill_(0.5)
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if value.dim():
                value.fill_(0.5)
    with _recording_reads() as slicers:
        accelerator.load_state(directory)
    read_a = sum(s.bytes_read // s.dtype.itemsize for s in slicers if _experts_factor(s.name, "A") and s.get_shape())
    own_a = sum(p.numel() for n, p in factors.items() if _experts_factor(n, "A"))
    assert read_a == 3 * own_a, f"read {read_a} elements of lora_A, holds 3 x {own_a}"  # its own rows only
    for name, param in trained.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach(), saved[name]), f"{name} after load"
    for param, state in optimizer.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, moments[id(param)][key]), f"moment {key} after load"
    files = {}
    if rank == 0:
        for stem in ("piece00", "piece01"):
            with safe_open(f"{directory}/model/tp00-pp00-{stem}.safetensors", "pt") as handle:
                files[stem] = {n: list(handle.get_slice(n).get_shape()) for n in handle.keys()}
    return files


def _experts_factor(name: str, which: str) -> bool:
    """``name`` is a LoRA factor (``lora_A`` or ``lora_B``) of an experts tensor (at any PEFT wrapping)."""
    return ".mlp.experts." in name and f".lora_{which}." in name


def test_lora_factors_of_spread_experts_are_saved_by_expert_and_read_back_exactly(tmp_path):
    """The experts' LoRA factors spread with their experts (``1/ep`` on each rank) are checkpointed by global
    index: ``lora_A``'s rows of each EP rank in its piece, ``lora_B`` (its columns interleave the experts) gathered
    and written whole by EP rank 0; factors and AdamW moments (the distributed optimizer's) load back exactly, each
    rank reading its own rows of ``lora_A``. tests/e2e/test_expert_parallel.py resumes such checkpoints at EP 1 and
    an EP 1 one at EP 2."""
    files = run_distributed(_lora_checkpoint_worker, world_size=4, args=(str(tmp_path / "step"),), timeout=600)[0]
    a_names = [n for n in files["piece00"] if _experts_factor(n, "A")]
    b_names = [n for n in files["piece00"] if _experts_factor(n, "B")]
    assert a_names and sorted(a_names) == sorted(n for n in files["piece01"] if _experts_factor(n, "A"))
    assert b_names and not any(_experts_factor(n, "B") for n in files["piece01"])  # whole, in EP rank 0's piece
    assert all(len(files["piece00"][n]) == 1 for n in a_names + b_names)  # flat runs


def _two_optimizers(rank: int, world: int) -> str:
    from mtk import Accelerator, ParallelConfig
    from mtk.errors import ConfigError

    accelerator = Accelerator(parallel_config=ParallelConfig(ep_size=2))
    model = accelerator.prepare(AutoModelForCausalLM.from_config(_config("qwen3_moe", 4)).float())
    experts = [p for p in model.parameters() if is_expert_parallel(p)]
    dense = [p for p in model.parameters() if not is_expert_parallel(p)]
    accelerator.prepare(torch.optim.SGD(dense, lr=0.1))
    try:
        accelerator.prepare(torch.optim.SGD(experts, lr=0.1))
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_a_second_optimizer_at_expert_parallelism_is_one_line_when_prepared():
    """Checkpoints of spread experts are pieces, read back for one optimizer: a second optimizer is refused when it
    is prepared, before any training, not at the first save."""
    messages = run_distributed(_two_optimizers, world_size=2)
    assert all("expert parallelism (ep = 2) with 2 optimizers" in m for m in messages), messages


def _dense_stage_worker(rank: int, world: int, directory: str) -> list[str]:
    from mtk import Accelerator, ParallelConfig, RunSettings

    accelerator = Accelerator(
        parallel_config=ParallelConfig(pp_size=2, ep_size=2), run_settings=RunSettings(num_micro_batches=2)
    )
    config = _config("qwen3_moe", 4)
    config.mlp_only_layers = [0, 1]  # stage 0: dense layers only
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids, use_cache=False).loss)
    optimizer.step()
    optimizer.zero_grad()
    trained = accelerator.unwrap_model(model)
    saved = {n: p.detach().clone() for n, p in trained.named_parameters()}
    accelerator.save_state(directory)
    with torch.no_grad():
        for param in trained.parameters():
            param.fill_(0.5)
    accelerator.load_state(directory)
    for name, param in trained.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    return sorted(p.name for p in Path(directory, "model").iterdir())


def test_a_pipeline_stage_of_dense_layers_at_expert_parallelism_saves_as_the_others(tmp_path):
    """Qwen3-MoE whose first two layers are dense (mlp_only_layers) at PP 2 x EP 2: stage 0 has no experts to
    spread, and still writes its tensors in the pieces every stage writes (the choice is the whole model's), so the
    checkpoint reads back exactly on both stages."""
    files = run_distributed(_dense_stage_worker, world_size=4, args=(str(tmp_path / "step"),), timeout=600)[0]
    assert files == [f"tp00-pp0{s}-piece0{p}.safetensors" for s in (0, 1) for p in (0, 1)], files


def _lora_on_experts_worker(
    rank: int, world: int, sharded: bool, shard: int = 1, tp: int = 1, etp: int | None = None
) -> list[tuple[float, float]]:
    """PEFT's LoRA on the 3D expert tensors (target_parameters) and on q_proj, the experts spread over EP 2: the
    factors start as PEFT draws them on one process (replayed, bit for bit) and train as PEFT does on one process on
    the global batch (SGD with momentum, clipping)."""
    import peft
    from accelerate.parallelism_config import ParallelismConfig
    from peft import LoraConfig

    from mtk import Accelerator, ParallelConfig, RunSettings
    from mtk.lora import get_peft_model, load_full_adapters, peft_initial_adapters
    from mtk.lora.experts import LocalExpertsLora

    fsdp = dict(parallelism_config=ParallelismConfig(dp_shard_size=shard, dp_replicate_size=world // shard))
    accelerator = Accelerator(
        **(fsdp if shard > 1 else {}),
        parallel_config=ParallelConfig(tp_size=tp, ep_size=2, etp_size=etp),
        run_settings=RunSettings(use_distributed_optimizer=sharded),
    )
    parallel = accelerator.parallel
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config("qwen3_moe", 4)).float()
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=experts, init_lora_weights=False)
    torch.manual_seed(3)
    reference = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    model = get_peft_model(accelerator.parallelize(base), lora, report=lambda *_: None)
    layers = base.config.num_hidden_layers  # every one an MoE layer
    assert sum(isinstance(m, LocalExpertsLora) for m in model.modules()) == 2 * layers  # 2 tensors in each
    spread = [param for name, param in model.named_parameters() if is_expert_parallel(param) and "lora_" in name]
    assert len(spread) == 4 * layers  # each expert tensor's two factors hold this rank's experts only
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in spread)  # (no view of more)
    load_full_adapters(model, peft_initial_adapters(model, lora, seed=3))
    wanted = dict(reference.named_parameters())
    adapters = [(name, param) for name, param in model.named_parameters() if "lora_" in name]
    full = [(name, _whole(model, name, param, parallel)) for name, param in adapters]
    assert all(torch.equal(value, wanted[name]) for name, value in full)  # PEFT's draws, bit for bit
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    expected = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    ids = torch.randint(0, 256, (parallel.dp_size * ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids[parallel.dp_rank * ROWS : (parallel.dp_rank + 1) * ROWS]
    logged = []
    for step in range(3):
        out = model(input_ids=mine, labels=mine, use_cache=False)
        accelerator.backward(out.loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        loss = accelerator.reduce(out.loss.detach(), reduction="mean")
        parts = [ids[r * ROWS : (r + 1) * ROWS] for r in range(parallel.dp_size)]
        whole = torch.stack([reference(input_ids=p, labels=p, use_cache=False).loss for p in parts]).mean()
        whole.backward()
        whole_norm = torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.5)
        expected.step()
        expected.zero_grad()
        assert_close_rel(loss, whole.detach(), f"loss at step {step + 1}")
        assert_close_rel(norm, whole_norm, f"gradient norm at step {step + 1}")
        logged.append((float(loss), float(norm)))
    trained = [(n, p) for n, p in accelerator.unwrap_model(model).named_parameters() if "lora_" in n]
    assert len(trained) == len(adapters)
    for name, param in trained:  # every factor after 3 steps (FSDP2's gathered over DP, TP's over TP)
        param = param.full_tensor() if isinstance(param, DTensor) else param
        whole = _whole(accelerator.unwrap_model(model), name, param, parallel)
        assert_close_rel(whole, wanted[name].detach(), f"{name} after 3 steps")
    if world == 2 and shard == 1:  # an adapter PEFT's add_adapter draws at this rank's experts: one line
        from mtk.errors import ConfigError

        unwrapped = accelerator.unwrap_model(model)
        unwrapped.add_adapter("other", LoraConfig(r=2, target_modules=[], target_parameters=experts))
        unwrapped.set_adapter("other")
        with pytest.raises(ConfigError, match="'other' on (gate_up|down)_proj was not added through mtk.lora"):
            unwrapped(input_ids=mine, use_cache=False)
    return logged


def _whole(model, name: str, param: torch.Tensor, parallel) -> torch.Tensor:
    """A LoRA factor whole: the experts' factors gathered over EP (each rank holds its experts' part, ``1/ep`` of
    them), a TP-split linear's over TP."""
    from mtk.parallel.expert_parallel import spread_layout
    from mtk.parallel.gather import full_shape_and_spec, gather_full_tensor

    shape, spec = full_shape_and_spec(model, name)
    layout = spread_layout(model, name)
    if layout is not None:
        whole = layout.gather(param.detach())
        assert whole.numel() == param.numel() * parallel.ep_size, name  # spread with the experts, not replicated
        return whole
    return gather_full_tensor(param.detach(), spec, shape, parallel.tp_group)


@pytest.mark.parametrize(
    ("world", "sharded", "shard", "tp", "etp"),
    [
        (2, False, 1, 1, None),
        (4, True, 1, 1, None),
        (2, False, 2, 1, None),
        (4, False, 1, 2, None),
        (4, True, 1, 2, 1),
    ],
)
def test_lora_on_spread_experts_trains_as_peft_on_one_process(world, sharded, shard, tp, etp):
    """LoRA on the expert tensors at EP 2 over DP 2, at EP 2 inside DP 4 with the distributed optimizer (two
    replicas of each expert), at EP 2 inside FSDP2 over DP 2 (the factors sharded as any replicated parameter, the
    spread experts left whole) and at EP 2 x TP 2 (each expert's intermediate width split too: each rank applies its
    slice of the factors, their gradients summed over TP), and at EP 2 x TP 2 with the experts whole on each TP rank
    (each rank its share of the tokens) and the distributed optimizer: every expert's factors whole on every rank,
    each rank applying its own experts' part; losses (with the load-balancing term), clipped gradient norms and every
    factor after 3 steps equal PEFT's on one process."""
    args = (sharded, shard, tp, etp)
    logged = run_distributed(_lora_on_experts_worker, world_size=world, args=args, timeout=600)
    assert all(run == logged[0] for run in logged)


def _dense_layers_in_a_pipeline_worker(rank: int, world: int) -> int:
    """Qwen3-MoE with dense layers 0 and 2 (mlp_only_layers) in an interleaved PP 2 of one layer per chunk: the first
    chunk routes nothing and sends zero sums, the third passes the second's on; the last adds its own. Loss and every
    gradient against one process accumulating the same 2 micro-batches (a padded row among them)."""
    from mtk.convert import parallelize
    from mtk.parallel.state import ParallelState
    from mtk.pipeline.engine import PipelineModel

    config = _config("qwen3_moe", 4)
    config.mlp_only_layers = [0, 2]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).float()
    state = ParallelState.build(pp_size=2)
    model = parallelize(copy.deepcopy(reference), state, pipeline_layers=(1, 1, 1, 1), virtual_stages=2)
    pipe = PipelineModel(model, state, num_micro_batches=2, schedule="interleaved")
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    loss = pipe(input_ids=ids, attention_mask=mask, labels=labels).loss
    pipe.finalize_grads()
    count = (labels[:, 1:] != -100).sum()
    rows = [reference(input_ids=ids[[r]], attention_mask=mask[[r]], labels=labels[[r]], num_items_in_batch=count / 2)
            for r in range(2)]  # fmt: skip
    expected = torch.stack([r.loss for r in rows]).mean()
    expected.backward()
    assert_close_rel(loss, expected.detach(), "loss")
    wanted = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in wanted.values() if p.grad is not None)
    compared = 0
    for name, param in model.named_parameters():
        assert_close_rel(param.grad, wanted[name].grad, f"{name} grad", scale_floor=1e-3 * scale)
        compared += name.endswith("mlp.gate.weight")  # this stage's routers (the term reaches them)
    return compared


def test_a_pipeline_carries_the_routing_sums_past_dense_layers():
    assert run_distributed(_dense_layers_in_a_pipeline_worker, world_size=2) == [0, 2]  # routers on rank 1 only
