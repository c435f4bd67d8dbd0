"""``mtk plan`` in one process: the ranked table, its JSON, the published rules it must reproduce, its
refusals, and the trace's internal consistency (what a layer keeps; parameters counted by the rules)."""

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from mtk.cli.main import main
from mtk.models import resolve_config
from mtk.pipeline.schedules import bubble_overhead
from mtk.planner.cluster import Cluster, parse_bytes
from mtk.planner.collectives import predict_expert_collectives
from mtk.planner.search import Candidate, Request, estimate, plan
from mtk.planner.shapes import local_numels
from mtk.planner.timing import model_size
from mtk.planner.trace import TraceSettings, _phases, trace_rank, with_layers

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
LLAMA_8B = str(CONFIGS / "llama-3-8b" / "config.json")
GIB = 2**30
PARAMS_8B = 8_030_261_248  # Llama-3-8B
PLAN_8B = ["plan", "--model", LLAMA_8B, "--gpus", "8", "--gpu_memory", "80GiB", "--seq_len", "4096",
           "--global_batch", "64"]  # fmt: skip


@pytest.fixture(scope="module")
def plan_8b_json():
    """Every setting of every layout of Llama-3-8B on one node of 8 x 80 GiB, as --json prints them."""
    request = Request(resolve_config(LLAMA_8B), Cluster(8), 4096, 64, every_setting=True)
    return {"estimates": [e.as_dict() for e in plan(request)]}


def test_table_is_ranked_by_predicted_step_time(capsys):
    assert main(PLAN_8B) == 0
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out and "layouts fit; fastest first" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and "|" in line]
    assert len(rows) == 10
    steps = [float(row.split("|")[-1].split()[1]) for row in rows]
    assert steps == sorted(steps)
    peaks = [float(row.split("|")[0].split()[-1]) for row in rows]
    assert max(peaks) <= 78.0, "every row fits 80 GiB less the 2 GiB reserve"


def test_json_option(capsys):
    assert main([*PLAN_8B, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["request"]["gpus"] == 8 and printed["request"]["gpu_memory"] == 80 * GIB
    first = printed["estimates"][0]
    assert set(first) >= {"layout", "memory_bytes", "communication_bytes", "collectives", "step_s", "tokens_per_s"}


def test_json_has_every_setting_and_layout(plan_8b_json):
    estimates = plan_8b_json["estimates"]
    layouts = {(e["layout"]["tp_size"], e["layout"]["pp_size"], e["layout"]["dp_size"]) for e in estimates}
    assert (8, 1, 1) in layouts and (1, 8, 1) in layouts and (2, 2, 2) in layouts and (1, 1, 8) in layouts
    assert {e["layout"]["recompute"] for e in estimates} == {None, "selective", "full"}
    assert {e["layout"]["sharding"] for e in estimates} == {"none", "distopt", "fsdp2", "zero1", "zero2", "zero3"}
    assert not any(e["layout"]["sharding"] == "fsdp2" and e["layout"]["virtual_stages"] > 1 for e in estimates)
    assert not any(e["layout"]["engine"] == "deepspeed" and e["layout"]["pp_size"] > 1 for e in estimates)
    assert not any(e["layout"]["sequence_parallel"] and e["layout"]["engine"] == "deepspeed" for e in estimates)
    assert any(not e["fits"] for e in estimates) and any(e["fits"] for e in estimates)
    for e in estimates:
        memory = e["memory_bytes"]
        parts = ("weights", "gradients", "optimizer", "activations", "buffers")
        assert memory["peak"] <= sum(memory[k] for k in parts)
        assert len(e["memory_bytes_per_stage"]) == e["layout"]["pp_size"]


def _find(estimates, **layout):
    return next(e for e in estimates if all(e["layout"][k] == v for k, v in layout.items()))


def test_model_state_is_16_bytes_per_parameter_for_mixed_precision_adam(plan_8b_json):
    """ZeRO paper, section 3.1: 16 bytes per parameter for mixed-precision Adam (accelerate's autocast: fp32
    weights 4 + gradients 4 + moments 8), summed over the 8 stages of one replica."""
    e = _find(plan_8b_json["estimates"], tp_size=1, pp_size=8, dp_size=1, engine="accelerate", sharding="none")
    stages = e["memory_bytes_per_stage"]
    assert sum(m["weights"] + m["gradients"] + m["optimizer"] for m in stages) == 16 * PARAMS_8B


def test_zero2_model_state_is_deepspeeds_own_estimate(plan_8b_json):
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs``: 2 P + 18 P / N bytes per GPU (bf16 weights; bf16
    and fp32 gradients, fp32 master weights and moments sharded)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    e = _find(plan_8b_json["estimates"], tp_size=1, pp_size=1, dp_size=8, engine="deepspeed", sharding="zero2")
    memory = e["memory_bytes"]
    _, expected = estimate_zero2_model_states_mem_needs(PARAMS_8B, num_gpus_per_node=8, cpu_offload=False)
    assert abs(memory["weights"] + memory["gradients"] + memory["optimizer"] - expected) <= 8


def test_zero_stages_shard_what_the_paper_says(plan_8b_json):
    one_replica_each = dict(tp_size=1, pp_size=1, dp_size=8, micro_batch_size=1, recompute=None)
    zero = {s: _find(plan_8b_json["estimates"], sharding=s, **one_replica_each) for s in ("zero1", "zero2", "zero3")}
    one, two, three = (zero[s]["memory_bytes"] for s in ("zero1", "zero2", "zero3"))
    assert one["optimizer"] == two["optimizer"] == three["optimizer"]
    assert two["gradients"] * 8 >= one["gradients"] > two["gradients"] and two["weights"] == one["weights"]
    assert three["weights"] * 8 >= one["weights"] > three["weights"]


def test_zero3_gathers_the_parameters_twice_and_reduce_scatters_in_every_micro_batch(plan_8b_json):
    """ZeRO-3's DP traffic is ZeRO-2's one gradient reduction three times over (two gathers of the bf16 parameters,
    one reduce-scatter) per micro-batch: parameters are partitioned, so each forward and backward gathers them."""
    one_replica_each = dict(tp_size=1, pp_size=1, dp_size=8, micro_batch_size=1, recompute=None)
    two, three = (_find(plan_8b_json["estimates"], sharding=s, **one_replica_each) for s in ("zero2", "zero3"))
    micro_batches = three["layout"]["micro_batches"]
    assert micro_batches == 8
    reduced = two["communication_bytes"]["dp"]
    assert abs(three["communication_bytes"]["dp"] - 3 * micro_batches * reduced) <= 2 * 8 * micro_batches


def test_fsdp2_divides_the_whole_model_state_by_dp_and_moves_three_passes_per_micro_batch(plan_8b_json):
    """TP2 x FSDP2 over DP4: weights, gradients and AdamW's moments each 1/dp of the TP shard's (the plain TP2 x DP4
    row's), one layer gathered twice over plus its gradients as buffers; per micro-batch two all-gathers and a
    reduce-scatter of the shard, in place of the one all-reduce per step."""
    twin = dict(tp_size=2, pp_size=1, dp_size=4, micro_batch_size=1, recompute=None, sequence_parallel=False)
    plain = _find(plan_8b_json["estimates"], engine="accelerate", sharding="none", **twin)
    fsdp = _find(plan_8b_json["estimates"], engine="accelerate", sharding="fsdp2", **twin)
    for part in ("weights", "gradients", "optimizer"):
        assert fsdp["memory_bytes"][part] == -(-plain["memory_bytes"][part] // 4), part
    assert fsdp["memory_bytes"]["buffers"] > 0
    micro_batches = fsdp["layout"]["micro_batches"]
    gathered, scattered = fsdp["collectives"]["all_gather"], fsdp["collectives"]["reduce_scatter"]
    assert scattered["count"] == (32 + 1) * micro_batches  # 32 layers and the root
    assert gathered["count"] == (2 * 32 + 1) * micro_batches  # the root stays gathered from forward to backward
    gradients = plain["collectives"]["all_reduce"]["bytes"] - fsdp["collectives"]["all_reduce"]["bytes"]  # TP's stay
    assert scattered["bytes"] == gradients * micro_batches  # fp32 gradients; each rank gathers its fp32 pieces
    assert gathered["bytes"] == 2 * -(-gradients // 4) * micro_batches


def test_pipeline_first_stage_holds_the_most_micro_batches(plan_8b_json):
    e = _find(
        plan_8b_json["estimates"], tp_size=1, pp_size=8, dp_size=1, micro_batch_size=1, recompute=None, sharding="none"
    )
    activations = [m["activations"] for m in e["memory_bytes_per_stage"]]
    assert activations[0] > activations[3] > activations[6], "1F1B: stage s keeps min(m, p - s) micro-batches"


def test_interleaved_candidates_where_the_layers_divide_into_chunks(plan_8b_json):
    """Megatron's constraints (``p v`` chunks dividing the 32 layers, ``m`` a multiple of ``p``), accelerate only;
    each has the smaller bubble overhead ``(p - 1) / (v m)``, holds more activations on the first stage (its
    warm-up) and, on the first stage, sends ``2 v - 1`` times the P2P bytes of its 1F1B twin (every chunk sends
    forward, all but the model's first backward)."""
    estimates = plan_8b_json["estimates"]
    interleaved = [e for e in estimates if e["layout"]["virtual_stages"] > 1]
    assert {e["layout"]["virtual_stages"] for e in interleaved} >= {2, 4}
    for e in interleaved:
        layout = e["layout"]
        pp, v, m = layout["pp_size"], layout["virtual_stages"], layout["micro_batches"]
        assert 32 % (pp * v) == 0 and m % pp == 0 and layout["engine"] == "accelerate"
        assert e["step_s"]["bubble_overhead"] == pytest.approx(bubble_overhead(pp, m, v)) and f" v{v}" in e["label"]
    twin = dict(tp_size=1, pp_size=2, dp_size=4, micro_batch_size=1, recompute=None, sharding="none")
    one = _find(estimates, virtual_stages=1, **twin)
    two = _find(estimates, virtual_stages=2, **twin)
    assert two["step_s"]["bubble_overhead"] == one["step_s"]["bubble_overhead"] / 2 == 1 / 32
    assert two["memory_bytes_per_stage"][0]["activations"] > one["memory_bytes_per_stage"][0]["activations"]
    assert two["fullest_stage"] == one["fullest_stage"] == 0
    assert two["communication_bytes"]["pp"] == 3 * one["communication_bytes"]["pp"]


def test_stages_hold_the_runtimes_split_and_the_slowest_is_timed():
    """bench-llama at PP 2 runs 3 + 1 layers (its head weighs 1.45 layers): the planner's stages hold exactly
    those parameters, and the step is the first stage's 3 layers against 1 + 1.45 on the last."""
    request = Request(resolve_config("bench-llama"), Cluster(2), 256, 4, dtype="fp32", engines=("accelerate",))
    result = estimate(request, Candidate(tp_size=1, pp_size=2, dp_size=1, micro_batch_size=1, micro_batches=4))
    embedding, layer, head = 8192 * 512, 512 * 1536 + 3 * 512 * 1376 + 2 * 512, 8192 * 512
    assert [m.weights for m in result.stages] == [4 * (embedding + 3 * layer), 4 * (layer + 512 + head)]
    assert result.time.bubble_overhead == pytest.approx(1 / 4)


def test_lora_keeps_a_frozen_bf16_base_and_fp32_adapters(capsys):
    assert main(["plan", "--model", LLAMA_8B, "--gpus", "1", "--seq_len", "2048", "--global_batch", "8",
                 "--lora_r", "16", "--engine", "accelerate", "--json"]) == 0  # fmt: skip
    estimates = json.loads(capsys.readouterr().out)["estimates"]
    best = next(e for e in estimates if e["fits"])
    memory = best["memory_bytes"]
    assert 15 * GIB < memory["weights"] < 16 * GIB, "8.0 B frozen parameters at 2 bytes, adapters at 4"
    assert memory["optimizer"] == 2 * memory["gradients"] < GIB, "r=16 adapters: 42 M parameters, AdamW in fp32"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "3"], "valid tp sizes for this model: [1, 2, 4, 8"),
        (["--tp", "16"], "does not fit inside a node of 8 GPUs"),
        (["--pp", "40"], "--pp 40 is more stages than the model's 32 layers; use at most 32"),
        (["--gpu_memory", "eighty"], "is not a memory size"),
        (["--gpu_memory", "80"], "argument --gpu_memory: '80' has no unit; give one, such as 80GiB or 80GB"),
        (["--gpus", "1", "--gpu_memory", "24GiB"], "fits no layout of 1 x 24 GiB: the smallest"),
        (["--offload", "--engine", "accelerate"], "--offload is DeepSpeed's optimizer offload"),
        (["--nodes", "3"], "do not spread evenly over --nodes 3"),
        (["--seq_len", "100000"], "longer than the model's 8192 positions"),
        (["--global_batch", "3", "--tp", "2", "--pp", "1"], "no layout of 8 GPUs divides --global_batch 3"),
        (["--cp", "3"], "--cp 3 needs --seq_len a multiple of 6 (each rank takes 2 of 6 equal chunks)"),
        (["--cp", "two"], "argument --cp: 'two' is not a positive integer or 'auto'"),
        (["--peak_tflops", "inf"], "--peak_tflops must be a positive finite number, got inf"),  # (steps of 0 s)
        (["--intra_node_gbps", "0"], "--intra_node_gbps must be a positive finite number, got 0.0"),
    ],
)
def test_refusals_are_one_line(argv, message, capsys):
    base = [a for a in PLAN_8B]
    for option in argv[::2]:
        if option in base:  # replace the default with the case's value
            index = base.index(option)
            del base[index : index + 2]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and message in err, err


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512MiB") == 2**29
    assert parse_bytes("1.5G") == 3 * GIB // 2 and parse_bytes("1024") == 1024


@pytest.mark.parametrize(
    "model, settings",
    [
        ("tiny-llama", TraceSettings(2)),
        ("tiny-llama", TraceSettings(2, sequence_parallel=True, recompute="full")),
        ("tiny-gpt2", TraceSettings(2, recompute="selective", device="cpu")),
        ("tiny-qwen3", TraceSettings(4)),  # kv heads replicated, per-head norms
    ],
)
def test_one_layer_keeps_what_a_second_layer_adds(model, settings):
    """The live bytes around the first layer's forward equal the two-layer model's minus the one-layer's."""
    config = resolve_config(model)
    trace = trace_rank(config, settings, 64, pipeline=False)
    assert _phases(with_layers(config, 2), settings, 64, 1, 0).saved - trace.whole.saved == trace.layer_saved > 0


def test_cuda_takes_the_math_path_for_fp32_grouped_query_attention():
    """On CUDA no fused kernel takes fp32 with ``enable_gqa`` (seen on an H200): each layer keeps its ``[a, s, s]``
    fp32 scores instead of the ``[a, s]`` log-sum-exp. bf16 (flash) and CPU without dropout stay fused."""
    config, seq = resolve_config("tiny-llama"), 64  # 4 heads, 2 kv heads

    def saved(**settings) -> int:
        return trace_rank(config, TraceSettings(1, **settings), seq, pipeline=False).layer_saved

    heads = config.num_attention_heads
    assert saved(device="cuda") - saved(device="cpu") == heads * seq * seq * 4 - heads * seq * 4
    assert saved(device="cuda", dtype="bf16") == saved(device="cpu", dtype="bf16")


@pytest.mark.parametrize("model, tp", [("tiny-llama", 2), ("tiny-qwen2", 2), ("bench-llama", 4), ("tiny-gpt2", 2)])
def test_parameters_equal_the_rules_count(model, tp):
    """The trace's parameters per TP rank (the converted meta model) equal the rules' own count (vocabulary
    padded, kv heads replicated, tied embeddings once), for any depth."""
    config = resolve_config(model)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    trace = trace_rank(config, TraceSettings(tp), 32, pipeline=False)
    whole = trace.whole
    counted = sum(whole.before.trainable) + layers * sum(whole.layer.trainable) + sum(whole.after.trainable)
    assert counted == sum(local_numels(config, tp))


def test_every_kind_of_rules_plans(tmp_path, capsys):
    """A transformers-tp-plan MoE (no SP rules: no SP rows), an encoder classifier (no pipeline rules: no PP rows),
    tied embeddings (GPT-2): each traced and ranked."""
    from transformers import MixtralConfig

    moe = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)  # fmt: skip
    moe.save_pretrained(tmp_path / "moe")
    rows = {}
    for model in (str(tmp_path / "moe"), "tiny-bert", "tiny-gpt2"):
        assert main(["plan", "--model", model, "--gpus", "4", "--seq_len", "64", "--global_batch", "8", "--all",
                     "--json"]) == 0  # fmt: skip
        rows[model] = json.loads(capsys.readouterr().out)["estimates"]
        assert rows[model] and all(e["memory_bytes"]["peak"] > e["memory_bytes"]["weights"] > 0 for e in rows[model])
    assert not any(e["layout"]["sequence_parallel"] for e in rows[str(tmp_path / "moe")])
    assert any(e["layout"]["tp_size"] == 2 for e in rows[str(tmp_path / "moe")]), "experts split over TP"
    assert not any(e["layout"]["pp_size"] > 1 for e in rows["tiny-bert"])
    assert any(e["layout"]["sequence_parallel"] and e["layout"]["pp_size"] == 2 for e in rows["tiny-gpt2"])


def test_a_model_the_meta_device_cannot_run_is_one_line(monkeypatch, capsys):
    """A forward that reads its data (``.item()`` on meta) ends in one line naming the fallback, not a traceback."""
    import mtk.planner.trace as trace

    def reads_data(*args, **kwargs):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    monkeypatch.setattr(trace, "_phases", reads_data)
    trace._cached_phases.cache_clear()
    try:
        assert main(["plan", "--model", "tiny-mistral", "--gpus", "2", "--seq_len", "32", "--global_batch", "4"]) == 2
    finally:
        trace._cached_phases.cache_clear()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "cannot trace this model on the meta device" in err and "mtk bench --memory" in err


def test_context_parallelism_divides_what_a_rank_keeps_and_adds_its_traffic():
    """CP = 4 at 16k tokens: each rank traces a quarter of every sequence, keeps the ring's two fp32 score blocks
    of its heads, holds the whole model state (sharded over DP x CP only by FSDP2 or the distributed optimizer)
    and sends the key/value blocks round the ring (a CP column in the table)."""
    config = resolve_config("bench-llama")
    # the fused attention without CP (on CUDA fp32 with GQA is torch's math path: an [a, s, s] tensor per layer)
    request = Request(
        config, Cluster(4, gpu_memory=8 * GIB), 16384, 4, dtype="fp32", reserve=0, cp_sizes=(1, 4), device="cpu"
    )
    by_label = {e.candidate.label: e for e in plan(request)}
    whole, split = by_label["tp1 pp1 dp4 1x1"], by_label["tp1 cp4 pp1 dp1 1x4"]
    blocks = 8 * 4096 * 4096 * 2 * 4 + 4096 * 4096  # [h, s/cp, s/cp] fp32 twice, and the block's mask
    assert split.memory.activations - blocks < whole.memory.activations / 4 * 1.05
    assert split.memory.weights == whole.memory.weights and split.memory.optimizer == whole.memory.optimizer
    assert by_label["tp1 cp4 pp1 dp1 1x4 fsdp2"].memory.weights * 4 <= whole.memory.weights * 1.01
    assert split.traffic.cp_bytes > 0 and whole.traffic.cp_bytes == 0
    assert split.collectives["send"]["count"] == 4 * 4 * (3 + 7)  # micro-batches x layers x (3 hops + 7 back)
    assert split.collectives["all_reduce"]["count"] == 1 + 4  # the gradients; each micro-batch's loss
    a2a = estimate(replace(request, cp_comm="a2a"), split.candidate)
    assert "all_to_all" in a2a.collectives and "send" not in a2a.collectives


def test_context_parallelism_is_weighed_only_where_the_attention_can_take_it(capsys):
    assert main(["plan", "--model", "tiny-bert", "--gpus", "2", "--seq_len", "64", "--global_batch", "2",
                 "--cp", "2"]) == 2  # fmt: skip
    assert "--cp 2: bert is not a decoder mtk cuts" in capsys.readouterr().err
    auto = ["plan", "--model", "bench-llama", "--gpus", "4", "--seq_len", "4096", "--global_batch", "4", "--cp",
            "auto", "--tp", "1", "--top", "60"]  # fmt: skip
    assert main(auto) == 0
    out = capsys.readouterr().out
    assert "tp1 cp4 pp1 dp1" in out and "tp1 cp2 pp1 dp2" in out and " CP " in out
    assert "tp1 cp2 pp1 dp2 1x2 zero3" in out and "tp1 cp4 pp1 dp1 1x4 zero3" in out  # ZeRO over DP x CP


def test_expert_parallelism_divides_the_experts_and_adds_its_all_to_alls():
    """EP = 4 inside DP 4 on bench-qwen3-moe: each rank holds a quarter of every expert tensor (and of their
    gradients and moments), the dense weights whole; the exchange's six all-to-alls per MoE layer and micro-batch
    (an EP column in the table); a token's FLOPs count k of the E experts."""
    config = resolve_config("bench-qwen3-moe")
    request = Request(config, Cluster(4, gpu_memory=8 * GIB), 1024, 4, dtype="fp32", reserve=0, ep_sizes=(1, 2, 4))
    layouts = by_label = {e.candidate.label: e for e in plan(request)}  # (by_label is rebound below)
    whole, spread = by_label["tp1 pp1 dp4 1x1"], by_label["tp1 pp1 dp4 ep4 1x1"]
    experts = 4 * 3 * 8 * 512 * 768  # layers x (gate, up, down) x E x h x I
    assert whole.memory.weights - spread.memory.weights == experts * 3 // 4 * 4  # fp32
    assert whole.memory.optimizer - spread.memory.optimizer == experts * 3 // 4 * 8
    assert spread.collectives["all_to_all"]["count"] == 4 * 6 and "all_to_all" not in whole.collectives
    assert spread.traffic.ep_bytes > 0 and whole.traffic.ep_bytes == 0
    sharded = by_label["tp1 pp1 dp4 ep2 1x1 distopt"]  # the experts' moments over their 2 replicas
    # the dense gradients in one call, then the experts' in 25 MiB buckets: a layer's half of its 8 experts (18 MiB)
    assert sharded.collectives["all_reduce"]["count"] == 1 + 4
    assert model_size(config).matmul_parameters < model_size(config).parameters - experts * 3 // 4 + 1
    # under DeepSpeed at ZeRO 1 and 2 (not 3, which refuses MoE parameters): its MoE parameter groups hold the
    # experts' state over their 2 replicas, its own reduction not among mtk's collectives (held against runs:
    # tests/e2e/test_expert_parallel.py)
    stages = {
        e.candidate.sharding
        for e in by_label.values()
        if e.candidate.ep_size > 1 and e.candidate.engine != "accelerate"
    }
    assert stages == {"zero1", "zero2"}
    zero1 = by_label["tp1 pp1 dp4 ep2 1x1 zero1"]
    dense = model_size(config).parameters - experts
    assert zero1.memory.gradients == (dense + experts // 2) * 4  # ZeRO-1: every gradient of the rank's experts
    assert zero1.memory.optimizer == -(-dense * 8 // 4) + experts // 2 * 8 // 2
    assert "all_reduce" not in zero1.collectives and zero1.collectives["all_to_all"]["count"] == 4 * 6
    # at CP 2 (without the load-balancing term CP refuses) EP is carved out of the DP x CP replicas, and a CP rank
    # dispatches its half of each row: micro-batches of 2 rows move what 1 row does at CP 1
    unbalanced = copy.deepcopy(config)
    unbalanced.output_router_logits = False
    at_cp = Request(unbalanced, Cluster(4, gpu_memory=8 * GIB), 1024, 4, dtype="fp32", reserve=0, ep_sizes=(4,),
                    cp_sizes=(2,))  # fmt: skip
    by_label = {e.candidate.label: e for e in plan(at_cp)}
    split = by_label["tp1 cp2 pp1 dp2 ep4 2x1"]
    assert split.collectives["all_to_all"] == spread.collectives["all_to_all"]
    assert split.memory.weights == spread.memory.weights
    # at PP 2 (the load-balancing term off) a stage exchanges for its own 2 MoE layers, per pipeline micro-batch
    piped = {e.candidate.label: e for e in plan(replace(at_cp, cp_sizes=(1,), ep_sizes=(2,), pp_size=2))}
    assert piped["tp1 pp2 dp2 ep2 1x2"].collectives["all_to_all"]["count"] == 2 * 2 * 6
    # FSDP2 shards the dense parameters over DP 4 and leaves the spread experts whole
    sharded_ep, sharded = layouts["tp1 pp1 dp4 ep2 1x1 fsdp2"], layouts["tp1 pp1 dp4 1x1 fsdp2"]
    dense = sharded.memory.weights * 4 - experts * 4  # fp32 bytes of the dense weights (4 ranks' quarters)
    assert abs(sharded_ep.memory.weights - (dense // 4 + experts // 2 * 4)) <= 4 * 4
    # LoRA on the linears keeps the experts frozen: spread, without gradients or moments
    adapted = {e.candidate.label: e for e in plan(replace(request, lora_r=8, ep_sizes=(1, 2), dtype="bf16"))}
    frozen = adapted["tp1 pp1 dp4 1x1"].memory.weights - adapted["tp1 pp1 dp4 ep2 1x1"].memory.weights
    assert frozen == experts // 2 * 2  # half the experts, bf16
    # and under FSDP2: the frozen dense base and the adapters sharded over DP 4, the frozen experts whole at 1/2
    sharded, sharded_ep = adapted["tp1 pp1 dp4 1x1 fsdp2"], adapted["tp1 pp1 dp4 ep2 1x1 fsdp2"]
    assert abs(sharded_ep.memory.weights - sharded.memory.weights - experts * 2 * (1 / 2 - 1 / 4)) <= 16
    assert sharded_ep.memory.gradients == sharded.memory.gradients > 0  # the adapters' alone
    assert sharded_ep.collectives["all_gather"]["bytes"] < sharded.collectives["all_gather"]["bytes"]


def test_whole_experts_hold_every_expert_on_each_tp_rank_and_send_each_token_once_per_tp_group():
    """The experts' TP size 1 at TP 2 on bench-qwen3-moe: each TP rank holds every expert whole (twice the split
    layout's expert weights, gradients and moments), runs them on half the tokens (EP's exchange moves half the
    rows), gathers their output and its gradients over TP (no MLP pair, no routing-weights sum), and sums the
    experts' gradients over TP in every backward; never with sequence parallelism (not modelled)."""
    config = resolve_config("bench-qwen3-moe")
    request = Request(config, Cluster(4, gpu_memory=8 * GIB), 1024, 4, dtype="fp32", reserve=0, ep_sizes=(2,),
                      etp_sizes=(None, 1), tp_size=2, engines=("accelerate",), every_setting=True)  # fmt: skip
    by_label = {e.candidate.label: e for e in plan(request)}
    split, whole = by_label["tp2 pp1 dp2 ep2 1x2"], by_label["tp2 pp1 dp2 ep2 etp1 1x2"]
    experts = 4 * 3 * 8 * 512 * 768 // 2  # layers x (gate, up, down) x E x h x I, half of them at EP 2
    assert whole.memory.weights - split.memory.weights == experts // 2 * 4  # whole, not halved by TP (fp32)
    assert whole.memory.optimizer - split.memory.optimizer == experts // 2 * 8
    k, hidden = config.num_experts_per_tok, config.hidden_size
    for estimate_, tokens in ((split, 1024), (whole, 512)):  # a micro-batch's tokens a rank dispatches
        exchange = predict_expert_collectives(4, tokens, k, hidden, 2, 4, micro_batches=2)
        assert estimate_.collectives["all_to_all"] == {"count": 4 * 6 * 2, "bytes": exchange.nbytes["all_to_all"]}
    gathers = 4 * 3 * 2  # MoE layers x (output, its gradient, the routing weights' gradient) x micro-batches
    assert whole.collectives["all_gather"]["count"] == gathers and "all_gather" not in split.collectives
    assert whole.traffic.ep_bytes < split.traffic.ep_bytes and whole.traffic.tp_bytes > split.traffic.tp_bytes
    assert not any(e.candidate.etp_size == 1 and e.candidate.sequence_parallel for e in by_label.values())
    assert whole.as_dict()["layout"]["etp_size"] == 1 and split.as_dict()["layout"]["etp_size"] == 2


def test_what_mtk_cannot_run_on_an_moe_model_is_one_line(capsys):
    assert main(["plan", "--model", "bench-llama", "--gpus", "4", "--seq_len", "1024", "--global_batch", "4",
                 "--ep", "2"]) == 2  # fmt: skip
    assert "--ep 2: llama has no mixture-of-experts layer" in capsys.readouterr().err
    moe = ["plan", "--model", "tiny-qwen3-moe", "--gpus", "6", "--seq_len", "64", "--global_batch", "6"]
    assert main([*moe, "--ep", "3"]) == 2
    assert "--ep 3: its 8 experts per layer do not divide over 3 ranks" in capsys.readouterr().err
    assert main([*moe, "--ep", "2", "--engine", "deepspeed", "--lora_r", "4"]) == 2
    assert (
        "--ep 2 under DeepSpeed trains the experts or their LoRA factors: with --lora_r add" in capsys.readouterr().err
    )
    assert main([*moe, "--ep", "2", "--engine", "deepspeed", "--cp", "2", "--gpus", "4"]) == 2
    assert "--ep 2 under DeepSpeed runs without context parallelism: use --cp 1" in capsys.readouterr().err
    assert main(["plan", "--model", "bench-llama", "--gpus", "4", "--seq_len", "1024", "--global_batch", "4",
                 "--etp", "1"]) == 2  # fmt: skip
    assert "--etp 1 keeps an MoE model's experts whole on each TP rank; llama has none" in capsys.readouterr().err


def test_a_pipeline_for_a_router_loss_carries_its_routing_sums_between_stages():
    """An MoE model whose loss has the load-balancing term pipelines (each message carries the stages' 2E + 1 fp32
    routing sums with the hidden states); without the term the messages are the hidden states alone."""
    config = resolve_config("tiny-qwen3-moe")
    request = Request(config, Cluster(4, gpu_memory=8 * GIB), 64, 4, dtype="fp32", reserve=0, pp_size=2)
    with_term = {e.candidate.label: e for e in plan(request)}
    without = copy.deepcopy(config)
    without.output_router_logits = False
    plain = {e.candidate.label: e for e in plan(replace(request, config=without))}
    piped = [label for label in with_term if label.startswith("tp1 pp2")]
    assert piped and set(piped) <= set(plain)
    for label in piped:
        sends = with_term[label].collectives["send"]
        assert sends["bytes"] - plain[label].collectives["send"]["bytes"] == sends["count"] * (2 * 8 + 1) * 4


def test_lora_on_the_expert_tensors_plans_their_factors_spread_with_the_experts():
    """--lora_target_parameters: the experts' factors (r E (in + out) per tensor) spread with their experts, 1/ep on
    each rank, trainable next to the linears' adapters; reduced over the expert replicas (one all-reduce of the
    rank's part) and, with the distributed optimizer, their moments sharded over those replicas."""
    config = resolve_config("tiny-qwen3-moe")  # 2 MoE layers of 8 experts, hidden 64, expert width 32
    request = Request(config, Cluster(4, gpu_memory=8 * GIB), 64, 4, dtype="fp32", reserve=0, lora_r=4, ep_sizes=(2,))
    experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    linears = {e.candidate.label: e for e in plan(request)}
    both = {e.candidate.label: e for e in plan(replace(request, lora_target_parameters=experts))}
    factors = 2 * 4 * 8 * ((64 + 2 * 32) + (32 + 64))  # layers x r E x (in + out) of gate_up_proj and down_proj
    for label, replicas in (("tp1 pp1 dp4 ep2 1x1", 1), ("tp1 pp1 dp4 ep2 1x1 distopt", 2)):
        mine = both[label]
        assert mine.memory.gradients - linears[label].memory.gradients == factors // 2 * 4
        assert mine.memory.optimizer - linears[label].memory.optimizer == factors // 2 * 2 * 4 // replicas
        reduced = mine.collectives["all_reduce"]  # the rank's part, over the 2 ranks holding the same experts
        assert reduced["count"] - linears[label].collectives["all_reduce"]["count"] == 1
        assert reduced["bytes"] - linears[label].collectives["all_reduce"]["bytes"] == factors // 2 * 4
        gathered = mine.collectives.get("all_gather", {"bytes": 0})["bytes"]
        assert gathered - linears[label].collectives.get("all_gather", {"bytes": 0})["bytes"] == (
            factors // 2 * 4 // 2 if replicas == 2 else 0  # the distributed optimizer's: its half of the part
        )


def test_tp_summed_gradients_are_counted_from_the_trace():
    """Gradients summed over TP, read off the traced model (``tp_shared`` and trainable): at TP 2 and EP 2 the
    factors of experts split over TP, spread with their experts (half of them on each rank), are summed over TP once
    per step, after the last micro-batch (fp32: they train in fp32), in one all-reduce; at DP 2 each rank holds the
    only copy of its experts' factors, so no reduction over expert replicas. Against the counted collectives of real
    runs: tests/distributed/test_plan_check.py."""
    config = resolve_config("tiny-qwen3-moe")
    request = Request(config, Cluster(4, gpu_memory=8 * GIB), 64, 4, dtype="fp32", reserve=0, lora_r=4, ep_sizes=(2,))
    experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    linears, both = (
        {e.candidate.label: e.collectives.get("all_reduce") for e in plan(changed)}
        for changed in (request, replace(request, lora_target_parameters=experts))
    )
    factors = 2 * 4 * 8 * ((64 + 2 * 32) + (32 + 64))  # layers x r E x (in + out), as above
    for label in ("tp2 pp1 dp2 ep2 2x1", "tp2 pp1 dp2 ep2 1x2", "tp2 pp1 dp2 ep2 1x2 fsdp2"):
        assert both[label]["count"] - linears[label]["count"] == 1  # once per step, every factor in one
        assert both[label]["bytes"] - linears[label]["bytes"] == factors // 2 * 4
