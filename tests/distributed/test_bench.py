"""``mtk bench`` end to end on a tiny model: mtk's measured collectives equal the prediction.

The runs fork their workers (``--fork_workers``: start-up is most of their cost; the live bytes ``--memory`` reads
are the same either way), but for one that starts fresh interpreters, ``mtk bench``'s default (and its only way on
a machine with an accelerator)."""

import json
import re

import pytest

from mtk.cli.main import main
from mtk.models import builtin_config

BENCH = ["bench", "--fork_workers"]  # (module docstring)


def _bench(tmp_path, capsys, *argv: str) -> tuple[dict, str]:
    """``mtk bench ARGV --json``: its report and what it printed (one line if it did not exit 0)."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, *argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    return json.loads(out.read_text()), text


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])  # mtk's rules, transformers' tp plan
def test_bench_counts_exactly_the_predicted_collectives(tmp_path, capsys, model):
    """One all-reduce per Column->Row pair each way (q/k/v and gate/up share one), one each for the embedding and
    the loss; Qwen3-MoE's plan: the same for attention, and its MoE block's experts take their input once."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", model, "--tp", "2", "--batch", "2", "--seq", "16", "--steps", "2",
                 "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    mtk = report["contenders"][0]
    assert mtk["name"] == "mtk" and mtk["error"] is None and mtk["steps_timed"] == 2
    assert mtk["collectives"] == report["predicted_collectives"], text
    if model == "tiny-llama":
        assert report["predicted_collectives"]["all_reduce"]["count"] == 4 * 2 + 2 + 2
    assert "DIFFERS" not in text and "[1/1] round 1 mtk" in text


def test_bench_pipeline_layout(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "1", "--pp", "2", "--batch", "4", "--seq", "16",
                 "--steps", "1", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["contenders"][0]["collectives"] == report["predicted_collectives"]
    assert [c["name"] for c in report["contenders"]] == ["mtk", "mtk-one-stage"], "the ideal's reference runs too"
    pipeline = report["pipeline"]
    assert pipeline["ideal_s"] > 0
    assert pipeline["bubble_fraction_formula"] == 1 / 5, "(p - 1) / (m + p - 1) at p 2, m 4"
    assert len(pipeline["idle_per_stage"]) == 2 and all(0 <= x < 1 for x in pipeline["idle_per_stage"])
    assert pipeline["bubble_fraction"] == min(pipeline["idle_per_stage"])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_bench_interleaved_pipeline(tmp_path, capsys, sequence_parallel):
    """Two chunks per rank: every chunk boundary sends (the ring wraps), counted equal to the prediction; with
    sequence parallelism each chunk's blocks are a region of their own."""
    config = builtin_config("tiny-llama")
    config.num_hidden_layers = 4
    model = tmp_path / "four-layer-llama.json"
    model.write_text(config.to_json_string())
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", str(model), "--tp", "2", "--pp", "2", "--batch", "4", "--seq", "16",
                 "--steps", "1", "--pipeline_schedule", "interleaved", "--virtual_stages", "2",
                 *(["--sequence_parallel"] if sequence_parallel else []), "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    collectives = report["contenders"][0]["collectives"]
    assert collectives == report["predicted_collectives"]
    assert collectives["send"]["count"] == 4 * 2 + 4, "rank 0: both chunks forward, its second chunk backward"
    pipeline = report["pipeline"]
    assert (pipeline["schedule"], pipeline["virtual_stages"]) == ("interleaved", 2)
    assert pipeline["bubble_fraction_formula"] == 1 / 9, "(p - 1) / (v m + p - 1) at p 2, m 4, v 2"


def test_bench_sequence_parallel_with_recompute(tmp_path, capsys):
    """By kind: per block an all-gather and a reduce-scatter replace the all-reduce; recompute reruns the
    forward collectives backward needs (GPT-2: a residual dropout after the MLP makes it rerun both)."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-gpt2", "--tp", "2", "--batch", "2", "--seq", "16", "--steps", "1",
                 "--sequence_parallel", "--recompute", "selective", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    mtk = report["contenders"][0]
    assert mtk["collectives"] == report["predicted_collectives"]
    assert {"all_gather", "reduce_scatter", "all_reduce"} == set(mtk["collectives"])
    assert min(mtk["memory_above_start_per_rank"]) > 0


def test_bench_data_parallel_with_the_distributed_optimizer(tmp_path, capsys):
    """TP=2 x DP=2: one coalesced gradient all-reduce over DP, then the optimizer's all-gather rounds."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "2", "--dp", "2", "--distributed_optimizer",
                 "--batch", "2", "--seq", "16", "--steps", "1", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    mtk = report["contenders"][0]
    assert mtk["processes"] == 4 and mtk["collectives"] == report["predicted_collectives"]
    assert mtk["collectives"]["all_gather"]["count"] >= 1
    assert report["contenders"][1]["name"] == "mtk-one-replica" and report["contenders"][1]["processes"] == 2
    ideal = report["data_parallel"]
    assert ideal["reduction_s"] > 0 and ideal["ideal_s"] == ideal["one_replica_s"] + ideal["reduction_s"]


def test_bench_fsdp2_counts_its_gathers_and_reduce_scatters_and_holds_the_planned_state(tmp_path, capsys):
    """--fsdp at TP=2 x DP=2: per unit (two layers, the root) an all-gather forward, another backward but for the
    root, a reduce-scatter, as predicted from the padded unit shapes; the model state each rank holds is the
    planner's fsdp2 row to the byte."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "2", "--dp", "2", "--fsdp", "--batch", "2", "--seq",
                 "16", "--steps", "1", "--memory", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    mtk = report["contenders"][0]
    assert mtk["collectives"] == report["predicted_collectives"]
    assert mtk["collectives"]["all_gather"]["count"] == 5 and mtk["collectives"]["reduce_scatter"]["count"] == 3
    assert text.count("model state exact") == 4 and "data parallel (FSDP2):" in text


def test_bench_starts_fresh_interpreters_by_default(capsys):
    code = main(["bench", "--model", "tiny-llama", "--tp", "1", "--batch", "1", "--seq", "16", "--steps", "1",
                 "--rounds", "1"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and re.search(r"^mtk +1 x 1 +\d", text, re.MULTILINE), text  # (a step time: it ran)


def test_bench_memory_against_the_plan(tmp_path, capsys):
    """--memory: each rank's peak next to mtk plan's prediction for its stage, the model state exact."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "2", "--pp", "2", "--batch", "4", "--micro_batches", "2",
                 "--seq", "32", "--steps", "1", "--memory", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    assert "peak memory per rank (mtk), measured vs mtk plan:" in text and text.count("model state exact") == 4
    planned = json.loads(out.read_text())["planned_memory_per_rank"]
    assert [p["stage"] for p in planned] == [0, 0, 1, 1] and all(p["measured_peak"] > 0 for p in planned)


def test_bench_tp1_compares_mtk_accelerator_with_plain_accelerate(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "1", "--compare", "--batch", "2", "--seq", "16",
                 "--steps", "1", "--rounds", "1", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["contenders"]]
    assert names == ["mtk", "mtk-accelerator", "accelerate", "hf-1thread", "hf-all-threads"]
    assert all(c["error"] is None for c in report["contenders"]), report["contenders"]
    assert len({round(c["loss"], 5) for c in report["contenders"]}) == 1, "same weights, batch and loop: same loss"
    assert report["accelerator_overhead"] > 0 and "mtk.Accelerator at TP=1 against plain accelerate" in text


def test_bench_data_parallel_against_deepspeed_zero(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "tiny-llama", "--tp", "1", "--dp", "2", "--compare", "--batch", "2", "--seq",
                 "16", "--steps", "1", "--rounds", "1", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["contenders"]]
    assert names == ["mtk", "mtk-one-replica", "deepspeed-zero1", "deepspeed-zero2"]
    assert all(c["error"] is None and c["processes"] == (1 if c["name"] == "mtk-one-replica" else 2)
               for c in report["contenders"]), report["contenders"]  # fmt: skip
    assert "data_parallel" in report


def test_bench_pipeline_with_an_uneven_split(tmp_path, capsys):
    """--pipeline_layers 3,1 (the last stage also runs the head and the loss): the counted collectives of
    stage 0 still equal the prediction for its three layers."""
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", "bench-llama", "--tp", "2", "--pp", "2", "--pipeline_layers", "3,1", "--batch",
                 "2", "--micro_batches", "2", "--seq", "16", "--steps", "1", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["spec"]["pipeline_layers"] == [3, 1]
    assert report["contenders"][0]["collectives"] == report["predicted_collectives"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_bench_pipeline_against_torch_pipelining(tmp_path, capsys, schedule):
    """--compare with --pp: torch.distributed.pipelining on the same model cut the same way, with the same
    schedule (Schedule1F1B, ScheduleInterleaved1F1B), is the peer; the same weights and micro-batches give
    the same loss."""
    config = builtin_config("tiny-llama")
    config.num_hidden_layers = 4
    model = tmp_path / "four-layer-llama.json"
    model.write_text(config.to_json_string())
    chunks = ["--pipeline_schedule", "interleaved", "--virtual_stages", "2"] if schedule == "interleaved" else []
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--model", str(model), "--tp", "1", "--pp", "2", "--compare", "--batch", "4", "--seq",
                 "16", "--steps", "1", "--rounds", "1", *chunks, "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    contenders = {c["name"]: c for c in json.loads(out.read_text())["contenders"]}
    assert list(contenders) == ["mtk", "mtk-one-stage", "torch-pipelining", "hf-1thread", "hf-all-threads"]
    peer = contenders["torch-pipelining"]
    assert peer["error"] is None and peer["processes"] == 2, peer
    assert abs(peer["loss"] - contenders["mtk"]["loss"]) <= 1e-5 * abs(contenders["mtk"]["loss"])


@pytest.mark.parametrize(
    "layout",
    [
        ["--tp", "1", "--cp", "2"],
        ["--tp", "2", "--cp", "2", "--cp_comm_type", "a2a", "--sequence_parallel"],
        ["--model", "tiny-qwen3-moe", "--tp", "1", "--cp", "2"],  # the load-balancing term's sums over CP
    ],
)
def test_bench_context_parallel_counts_exactly_the_predicted_collectives(tmp_path, capsys, layout):
    out = tmp_path / "bench.json"
    model = [] if "--model" in layout else ["--model", "tiny-llama"]
    code = main([*BENCH, *model, *layout, "--batch", "2", "--seq", "32", "--steps", "1",
                 "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    mtk = report["contenders"][0]
    assert mtk["error"] is None and mtk["collectives"] == report["predicted_collectives"], text
    assert "cp=2" in text and "DIFFERS" not in text


def test_bench_expert_parallel_counts_its_all_to_alls_and_holds_mtk_at_ep1(tmp_path, capsys):
    """--ep 2 inside --dp 4 with the distributed optimizer on tiny-qwen3-moe: 6 all-to-alls per MoE layer, their
    bytes (the EP group's mean) as predicted, the dense gradients over DP and the experts' over their 2 replicas,
    each domain's all-gather rounds; mtk at EP 1 on the same replicas runs beside it as the ratio's baseline."""
    report, text = _bench(tmp_path, capsys, "--model", "tiny-qwen3-moe", "--tp", "1", "--dp", "4", "--ep", "2",
                          "--distributed_optimizer", "--batch", "2", "--seq", "16", "--steps", "1")  # fmt: skip
    mtk = report["contenders"][0]
    assert mtk["processes"] == 4 and mtk["collectives"] == report["predicted_collectives"], text
    assert mtk["collectives"]["all_to_all"]["count"] == 2 * 6 and mtk["collectives"]["all_reduce"]["count"] == 2
    assert [c["name"] for c in report["contenders"]] == ["mtk", "mtk-without-ep", "mtk-one-replica"]
    assert all(c["error"] is None for c in report["contenders"]) and "dp=4 ep=2" in text


def test_bench_whole_experts_at_ep_count_what_the_prediction_says_and_hold_mtk_with_the_experts_split(
    tmp_path, capsys
):
    """--tp 2 --etp 1 inside --dp 2 --ep 2 with the distributed optimizer, 15 tokens (TP rank 0 runs 8 of them, rank 1
    7): the exchange carries each TP rank's share of the tokens, the experts' gradients are summed over TP once per
    step and reduced over their replicas, every count and byte as predicted; mtk with each expert split
    over TP runs beside it as the ratio's baseline."""
    report, text = _bench(tmp_path, capsys, "--model", "tiny-qwen3-moe", "--tp", "2", "--etp", "1", "--dp", "2",
                          "--ep", "2", "--distributed_optimizer", "--batch", "1", "--seq", "15",
                          "--steps", "1")  # fmt: skip
    mtk = report["contenders"][0]
    assert mtk["processes"] == 4 and mtk["collectives"] == report["predicted_collectives"], text
    # 2 MoE layers x 3 row gathers (the output, its gradient, the routing weights' gradient), 1 optimizer round
    assert mtk["collectives"]["all_gather"]["count"] == 2 * 3 + 1 and "dp=2 ep=2 etp=1" in text
    assert [c["name"] for c in report["contenders"]] == [
        "mtk",
        "mtk-experts-split",
        "mtk-without-ep",
        "mtk-one-replica",
    ]
    assert all(c["error"] is None for c in report["contenders"]), text


def test_bench_expert_parallel_against_deepspeed_autoep(tmp_path, capsys):
    """--ep 2 --compare: DeepSpeed AutoEP (dropless, the model's own router and load-balancing loss) over the same 2
    replicas, on the same weights and batch, ends on mtk's loss."""
    report, text = _bench(tmp_path, capsys, "--model", "tiny-qwen3-moe", "--tp", "1", "--dp", "2", "--ep", "2",
                          "--compare", "--rounds", "1", "--batch", "2", "--seq", "16", "--steps", "2")  # fmt: skip
    by_name = {c["name"]: c for c in report["contenders"]}
    assert set(by_name) == {"mtk", "mtk-without-ep", "mtk-one-replica", "deepspeed-autoep"}, text
    assert all(c["error"] is None for c in by_name.values()), text
    assert abs(by_name["deepspeed-autoep"]["loss"] - by_name["mtk"]["loss"]) < 1e-4 * by_name["mtk"]["loss"]
    assert by_name["mtk"]["loss"] == pytest.approx(by_name["mtk-without-ep"]["loss"], rel=1e-5)
