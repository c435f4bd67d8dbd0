"""Context parallelism on HF models: the sequence split over CP = 2 and 4 ranks (load-balanced chunks), attention
as mtk's registered ring (p2p) or all-to-all (a2a) attention; the CP ranks' losses add up to the one-process HF
model's loss and their gradients, summed over the CP group, to its gradients, fp32 within 1e-5, on packed rows of
documents of very different lengths (no token attends across a boundary, positions restart) and on right-padded
rows; and with TP = 2 (sequence parallelism, the chunked loss) inside CP = 2."""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import DynamicCache

from mtk.convert import parallelize
from mtk.errors import ConfigError
from mtk.models import build_model
from mtk.parallel import ParallelState
from mtk.parallel.context import (
    ATTENTION,
    ContextSplit,
    SplitCallCache,
    attach_context_parallel,
    split_for_context,
    use_context_attention,
)
from mtk.parallel.gather import iter_full_tensors
from mtk.parallel.grads import sync_sequence_parallel_grads
from mtk.testing import assert_close_rel, run_distributed

SEQ = 32
PACKED = [[5, 11, 3, 13], [1, 30, 1]]  # per row: the lengths of its packed documents


def _batch(kind: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, SEQ), generator=generator)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 21:] = 0  # right padding
    if kind.startswith("packed"):
        positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in PACKED])  # [2, S]
        labels = ids.masked_fill(positions == 0, -100)  # a document's first token is not predicted from the last
        packed = {"input_ids": ids, "labels": labels, "position_ids": positions}
        # with a mask too, transformers sees one causal sequence per row (it looks for packing only without one)
        return packed if kind == "packed" else {**packed, "attention_mask": mask}
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def _context_checks(rank: int, cp: int, name: str, kind: str, comm: str) -> dict:
    group = dist.group.WORLD
    reference = build_model(name, seed=0).eval()
    reference.set_attn_implementation("eager")
    model = copy.deepcopy(reference)
    use_context_attention(model)
    batch = _batch(kind)
    ref_out = reference(**batch, use_cache=False)  # as in training: transformers masks packed documents then
    ref_out.loss.backward()

    local, count = split_for_context(batch, group, comm)
    out = model(**local, num_items_in_batch=count)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    assert_close_rel(loss, ref_out.loss, f"{name} {kind} loss")
    ref_grads = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref_grads.values())
    for param_name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        assert_close_rel(
            grad, ref_grads[param_name].grad, f"{name} {kind} grad of {param_name}", scale_floor=1e-6 * scale
        )
    return {"tokens": int(local["input_ids"].shape[1]), "loss": float(out.loss)}


@pytest.mark.parametrize(
    "name,cp,kind,comm",
    [
        ("tiny-llama", 2, "packed", "p2p"),
        ("tiny-llama", 4, "padded", "p2p"),
        ("tiny-qwen3", 2, "padded", "p2p"),
        ("tiny-qwen3", 4, "packed", "p2p"),
        ("tiny-llama", 2, "packed", "a2a"),
        ("tiny-qwen3", 4, "padded", "a2a"),
        ("tiny-llama", 2, "packed_masked", "p2p"),
    ],
)
def test_context_parallel_model_equals_hf(name, cp, kind, comm):
    results = run_distributed(_context_checks, world_size=cp, args=(name, kind, comm))
    assert [r["tokens"] for r in results] == [SEQ // cp] * cp


def _tensor_and_context_checks(rank: int, world_size: int, kind: str, comm: str) -> None:
    """TP = 2 inside CP = 2: Megatron's order puts TP fastest, so the CP groups are what ParallelState calls DP."""
    state = ParallelState.build(tp_size=2)
    cp_group = state.dp_group  # [0, 2] and [1, 3]
    reference = build_model("tiny-llama", seed=0).eval()
    model = parallelize(copy.deepcopy(reference), state, sequence_parallel=True, loss_chunk_tokens=3)
    use_context_attention(model)
    batch = _batch(kind)
    ref_out = reference(**batch, use_cache=False)
    ref_out.loss.backward()
    local, count = split_for_context(batch, cp_group, comm)
    out = model(**local, num_items_in_batch=count)
    out.loss.backward()
    sync_sequence_parallel_grads(model, state.tp_group)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    assert_close_rel(loss, ref_out.loss, f"tp2 x cp2 {kind} loss")
    for param in model.parameters():
        dist.all_reduce(param.grad, group=cp_group)
    ref_grads = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref_grads.values())
    for param_name, grad in iter_full_tensors(model, state.tp_group, grads=True):
        assert_close_rel(grad, ref_grads[param_name].grad, f"tp2 x cp2 grad of {param_name}", scale_floor=1e-6 * scale)
    # attached (the Accelerator's way) to a converted model: the split comes before SP's padding, so a row of 30
    # positions returns 30 (SP's pad was gathered back with the rest: 31 for 30), and logits_to_keep is the row's
    attached = parallelize(copy.deepcopy(reference), state, sequence_parallel=True)
    attach_context_parallel(attached, cp_group, comm, sequence_split=2)
    cut = {k: v[:, :30] for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        for kept in (0, 1, torch.tensor([[0, 29], [3, 4]])):
            logits = attached(**cut, logits_to_keep=kept).logits
            assert_close_rel(logits, reference(**cut, use_cache=False, logits_to_keep=kept).logits, f"kept {kept}")
        # every state between the blocks, whole: SP's own positions were gathered over CP as if whole rows (a
        # refusal at most lengths, other positions at the rest)
        for length in (30, 28, 25):
            part = {k: v[:, :length] for k, v in cut.items()}
            states = attached(**part, output_hidden_states=True).hidden_states
            expected = reference(**part, use_cache=False, output_hidden_states=True).hidden_states
            for layer, (mine, theirs) in enumerate(zip(states, expected, strict=True)):
                assert_close_rel(mine, theirs, f"hidden states {layer} of rows of {length}")
        chosen = attached(**cut, output_hidden_states=[1]).hidden_states  # (each rank's own positions before)
        assert chosen[0] is None
        every = reference(**cut, use_cache=False, output_hidden_states=True).hidden_states
        assert_close_rel(chosen[1], every[1], "output_hidden_states=[1]")


@pytest.mark.parametrize("kind,comm", [("packed", "p2p"), ("padded", "a2a")])
def test_tensor_parallel_with_sequence_parallel_inside_context_parallel_equals_hf(kind, comm):
    run_distributed(_tensor_and_context_checks, world_size=4, args=(kind, comm))


def _attached_checks(rank: int, cp: int) -> None:
    """attach_context_parallel: the caller passes the whole batch, the model splits it (and counts its tokens,
    unless the caller's num_items_in_batch, for the whole rows, is given); every rank returns the whole batch's
    loss, and the gradients averaged over the group are the unsplit model's (CP ranks average like DP replicas);
    logits without gradient are the whole rows'."""
    group = dist.group.WORLD
    reference = build_model("tiny-llama", seed=0).eval()
    model = copy.deepcopy(reference)
    attach_context_parallel(model, group, "a2a")
    # packed rows without a mask (TRL's padding-free batches), at a length the split pads too (30 -> 32): the mask
    # the split adds for its padding made every row one sequence, its documents attending across
    for length in (SEQ, 30):
        batch = {k: v[:, :length] for k, v in _batch("packed").items()}
        reference.zero_grad()
        ref_out = reference(**batch, use_cache=False)
        ref_out.loss.backward()
        tokens = (batch["labels"][:, 1:] != -100).sum()
        for given in (None, tokens):
            model.zero_grad()
            out = model(**batch) if given is None else model(**batch, num_items_in_batch=given)
            out.loss.backward()
            what = f"length {length}, num_items_in_batch {given}"
            assert_close_rel(out.loss.detach(), ref_out.loss, f"attached loss ({what})")
            grads = dict(reference.named_parameters())
            for param_name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=group)
                grad /= dist.get_world_size(group)
                assert_close_rel(
                    grad, grads[param_name].grad, f"attached grad of {param_name} ({what})", scale_floor=1e-6
                )
    batch = _batch("packed")
    with torch.no_grad():  # evaluation: the whole rows' logits, in order, without the split's padding (30 -> 32)
        cut = {k: v[:, :30] for k, v in _batch("padded").items()}
        assert_close_rel(model(**cut).logits, reference(**cut, use_cache=False).logits, "attached logits")
        # generate (a KV cache from its first call) runs whole, masks and all: a traceback in ring attention before;
        # rows of 7 and 4 tokens, left-padded as generate expects
        prompt = batch["input_ids"][:2, :7].clone()
        mask = torch.ones_like(prompt)
        prompt[1, :3], mask[1, :3] = 0, 0
        greedy = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        expected = reference.generate(input_ids=prompt, **greedy)
        assert torch.equal(model.generate(input_ids=prompt, **greedy), expected), "attached generate"
        assert model.config._attn_implementation == ATTENTION  # (only the decoding calls ran the model's own)
        # a compiled cache's masks are built before each call, by the model's own attention's mask function
        # (ATTENTION's builds none: the left-padded row attended to its pads)
        static = {**greedy, "cache_implementation": "static"}
        expected_static = reference.generate(input_ids=prompt, **static)
        assert torch.equal(model.generate(input_ids=prompt, **static), expected_static), "static cache"
        assert model.config._attn_implementation == ATTENTION
        # logits_to_keep (generate's without a cache) is of the whole rows: each rank returned its own last positions
        assert torch.equal(model.generate(input_ids=prompt, use_cache=False, **greedy), expected), "no cache"
        unlabelled = {k: v for k, v in cut.items() if k != "labels"}
        as_tuple = model(**unlabelled, return_dict=False)[0]  # (gathered by name: each rank's own positions before)
        assert_close_rel(as_tuple, reference(**unlabelled, use_cache=False).logits, "return_dict=False")
        for keep in (1, 3, torch.tensor([0, 5]), torch.tensor([[0, 5], [2, 29]]), cut["attention_mask"].bool()):
            kept = model(**unlabelled, logits_to_keep=keep).logits
            expected_kept = reference(**unlabelled, use_cache=False, logits_to_keep=keep).logits
            assert_close_rel(kept, expected_kept, f"logits_to_keep {keep}")
        assert_close_rel(model(**cut).logits, reference(**cut, use_cache=False).logits, "split again after generate")
        with pytest.raises(ConfigError, match="computes no attention weights"):  # (a tuple of None before)
            model(**cut, output_attentions=True)
        # a hand-written decoding loop: a prefill that asks for a cache runs whole and returns the whole rows' (the
        # split call's was none, and the loop decoded other tokens); one that leaves it to the config is split and
        # returns a stand-in holding no keys, refused if a call is given it
        cache = model(input_ids=prompt, attention_mask=mask, use_cache=True).past_key_values
        step = torch.tensor([[5], [7]])
        grown = torch.cat([mask, torch.ones_like(step)], dim=1)
        mine = model(input_ids=step, attention_mask=grown, past_key_values=cache).logits
        theirs_cache = reference(input_ids=prompt, attention_mask=mask, use_cache=True).past_key_values
        assert_close_rel(mine, reference(input_ids=step, attention_mask=grown, past_key_values=theirs_cache).logits,
                         "decoding from a prefill's cache")  # fmt: skip
        default = model(**unlabelled)
        assert isinstance(default.past_key_values, SplitCallCache)
        assert [type(v).__name__ for v in model(**unlabelled, return_dict=False)] == ["Tensor", "SplitCallCache"]
        with pytest.raises(ConfigError, match="came from a call split over the CP ranks"):
            model(input_ids=step, past_key_values=default.past_key_values)
        # positional arguments all count (the mask was dropped); [1, S] positions for every row, at a length the
        # split does not pad (a shape error in the attention before)
        positional = model(cut["input_ids"], cut["attention_mask"]).logits
        assert_close_rel(positional, reference(**unlabelled, use_cache=False).logits, "positional mask")
        shared = {"input_ids": batch["input_ids"], "position_ids": torch.arange(SEQ)[None]}
        assert_close_rel(model(**shared).logits, reference(**shared, use_cache=False).logits, "[1, S] positions")
    # in eval mode with gradients on (a decoding loop without no_grad): the whole rows' cache too (a stand-in before)
    assert not isinstance(model(input_ids=prompt, attention_mask=mask, use_cache=True).past_key_values, SplitCallCache)
    # that call runs whole, so every rank computes the whole rows' gradients: averaged over the group they are one
    # process's (the parameters' and a caller's own tensor's, after an in-place change of an output too); where the
    # CP ranks' gradients are summed (DeepSpeed's reduction: attached with average=False) it is one line (cp times
    # one process's before)
    whole = {**_batch("padded"), "use_cache": True}
    expected = reference(**whole)
    reference.zero_grad()
    (expected.loss + expected.logits.mean()).backward()
    grads = dict(reference.named_parameters())
    model.zero_grad()
    out = model(**whole)
    out.loss.div_(2)
    (2 * out.loss + out.logits.mean()).backward()
    assert_close_rel(2 * out.loss.detach(), expected.loss, "whole call's loss")
    for param_name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)
        assert_close_rel(grad, grads[param_name].grad, f"whole call's grad of {param_name}", scale_floor=1e-6)
    summed = build_model("tiny-llama", seed=0).eval()
    attach_context_parallel(summed, group, "a2a", average=False)
    with pytest.raises(ConfigError, match="which sums the CP ranks' gradients: a call that runs whole on every"):
        summed(**whole)
    with torch.no_grad():  # (decoding: nothing to pass back)
        assert_close_rel(summed(**whole).logits, expected.logits.detach(), "whole call without gradients, summed")
    model.train()  # a training call that carries a cache (a prefix's keys) would run whole with gradients
    with pytest.raises(ConfigError, match="a training call that carries a KV cache"):
        model(input_ids=prompt[:, :1], past_key_values=DynamicCache())


def test_a_model_attached_to_a_cp_group_splits_whole_batches_itself():
    run_distributed(_attached_checks, world_size=2)


def _router_checks(rank: int, cp: int) -> None:
    """An MoE model's load-balancing term over the whole rows, at a length the split pads and without a mask (the
    appended positions were counted as tokens), also where only the call asks for it; its router logits are the
    whole rows' (each rank's own tokens before)."""
    reference = build_model("tiny-qwen3-moe", seed=0).eval()
    reference.config.output_router_logits = False  # (the call asks for the term: output_router_logits=True)
    model = copy.deepcopy(reference)
    attach_context_parallel(model, dist.group.WORLD, "p2p")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    asked = {"input_ids": ids, "labels": ids, "output_router_logits": True}
    expected = reference(**asked, use_cache=False)
    expected.loss.backward()
    out = model(**asked)
    out.loss.backward()
    assert_close_rel(out.loss.detach(), expected.loss, "loss with the load-balancing term")
    for layer, (mine, theirs) in enumerate(zip(out.router_logits, expected.router_logits, strict=True)):
        assert_close_rel(mine.detach(), theirs.detach(), f"router logits of layer {layer}")
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        assert_close_rel(grad / cp, grads[name].grad, f"grad of {name}", scale_floor=1e-6)


def test_an_moe_models_router_term_and_logits_are_the_whole_rows():
    run_distributed(_router_checks, world_size=2)


def _refusals(rank: int, cp: int) -> dict:
    group = dist.group.WORLD
    errors = {}
    try:
        split_for_context({"input_ids": torch.zeros(1, 30, dtype=torch.long)}, group)
    except ConfigError as error:
        errors["length"] = str(error)
    try:
        split_for_context({"input_ids": torch.zeros(1, 32, dtype=torch.long)}, group, "allgather")
    except ConfigError as error:
        errors["comm"] = str(error)
    model = build_model("tiny-llama", seed=0)
    use_context_attention(model)
    try:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    except ConfigError as error:
        errors["unsplit"] = str(error)
    attach_context_parallel(model, group)
    try:
        model(inputs_embeds=torch.zeros(1, 8, 64))
    except ConfigError as error:
        errors["embeds"] = str(error)
    try:  # a sequence-level label per row (classify.py's)
        split_for_context({"input_ids": torch.zeros(2, 32, dtype=torch.long), "labels": torch.zeros(2)}, group)
    except ConfigError as error:
        errors["row labels"] = str(error)
    try:
        attach_context_parallel(build_model("tiny-bert", seed=0), group)
    except ConfigError as error:
        errors["encoder"] = str(error)
    from transformers import LlamaForSequenceClassification

    from mtk.models import builtin_config

    try:  # (its pooled token was found in each rank's own positions: other logits, exit 0)
        attach_context_parallel(LlamaForSequenceClassification(builtin_config("tiny-llama")), group)
    except ConfigError as error:
        errors["classifier"] = str(error)
    try:  # (the caller's shapes: the padded ones, (2, 32), were quoted)
        ContextSplit(group, "p2p", 4)({"input_ids": torch.zeros(2, 30, dtype=torch.long), "labels": torch.zeros(2)})
    except ConfigError as error:
        errors["row labels, padded"] = str(error)
    return errors


def test_what_context_parallelism_cannot_take_is_one_line():
    errors = run_distributed(_refusals, world_size=2)[0]
    assert "30 tokens does not split into 2 x 2 equal chunks" in errors["length"]
    assert "carries no split batch" in errors["unsplit"]
    assert "splits input_ids along the sequence; this call passes none" in errors["embeds"]
    assert "cp_comm_type 'allgather' is unknown; use one of ('p2p', 'a2a')" in errors["comm"]
    assert "these are (2,) (one per row: a sequence-level task): use cp = 1" in errors["row labels"]
    assert "attends both ways; mtk's context-parallel attention is causal (decoders): use cp = 1" in errors["encoder"]
    assert "LlamaForSequenceClassification is not a causal language model" in errors["classifier"]
    assert "shaped as input_ids (2, 30); these are (2,)" in errors["row labels, padded"]


def _lora_generate(rank: int, cp: int) -> None:
    """LoRA (mtk.lora on the converted model) under mtk.Accelerator at CP 2: the PeftModel's generate calls the
    transformers model inside it, which is the one split (it met the split attention unsplit before: one line)."""
    from peft import LoraConfig
    from peft import get_peft_model as peft_get_peft_model

    from mtk import Accelerator, ParallelConfig
    from mtk.lora import get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    reference = peft_get_peft_model(build_model("tiny-llama", seed=0), config).eval()
    accelerator = Accelerator(parallel_config=ParallelConfig(cp_size=cp))
    model = accelerator.prepare(get_peft_model(accelerator.parallelize(build_model("tiny-llama", seed=0)), config))
    model = accelerator.unwrap_model(model).eval()
    prompt = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    greedy = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert_close_rel(model(input_ids=prompt, attention_mask=mask).logits,
                         reference(input_ids=prompt, attention_mask=mask).logits, "LoRA logits")  # fmt: skip
        expected = reference.generate(input_ids=prompt, **greedy)
        for cached in (True, False):
            assert torch.equal(model.generate(input_ids=prompt, use_cache=cached, **greedy), expected), cached


def test_a_lora_model_at_cp_generates_one_process_tokens():
    run_distributed(_lora_generate, world_size=2)


def _learned_table_checks(rank: int, cp: int) -> None:
    """GPT-2's table of 30 learned positions and a row of 30 tokens: the split pads it to 32, and the appended
    positions counted on past the table (an IndexError in torch.embedding on one rank, "a collective failed" on the
    other; one process trains it). They repeat the row's last position now; nothing real sees them."""
    from mtk.models import resolve_config

    config = resolve_config("tiny-gpt2")
    config.n_positions = 30
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    reference = build_model(config, seed=0)
    model = copy.deepcopy(reference)
    attach_context_parallel(model, dist.group.WORLD, "p2p")
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(4))
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert_close_rel(out.loss.detach(), expected.loss, "loss of rows as long as the table")
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        assert_close_rel(grad / cp, grads[name].grad, f"grad of {name}", scale_floor=1e-6)
    with torch.no_grad():
        assert_close_rel(model(input_ids=ids).logits, reference(input_ids=ids).logits, "logits")


def test_rows_as_long_as_a_table_of_learned_positions_are_split():
    run_distributed(_learned_table_checks, world_size=2)
