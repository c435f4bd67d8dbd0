"""``mtk bench``'s collective prediction and report format (not its timings)."""

import errno
import json
from dataclasses import replace

import pytest

from mtk.bench.allocations import peak_allocations
from mtk.bench.contenders import BenchSpec
from mtk.bench.report import format_report, report_dict, write_json
from mtk.bench.runner import ContenderSummary, predicted_for, run_bench
from mtk.cli.main import main
from mtk.errors import ConfigError
from mtk.planner.collectives import predict_collectives, predict_context_collectives, predict_expert_collectives
from mtk.spawn import DistributedTestError


def test_prediction_follows_the_megatron_math():
    # bench-llama at TP 2: 4 layers x (2 forward + 2 backward) + embedding + lm-head input grad = 18
    # all-reduces of [4, 256, 512] fp32 (2 MiB), plus the loss's [4, 256] and [2, 4, 256] fp32.
    predicted = predict_collectives(4, 512, 4, 256, 2)
    assert predicted.counts == {"all_reduce": 20}
    assert predicted.nbytes["all_reduce"] == 18 * 2 * 2**20 + 3 * 4 * 256 * 4
    assert predict_collectives(4, 512, 4, 256, 1).counts == {}, "TP 1 sends nothing"
    bf16 = predict_collectives(4, 512, 4, 256, 2, element_size=2)
    assert bf16.nbytes["all_reduce"] == 18 * 2**20 + 3 * 4 * 256 * 4, "loss statistics stay fp32"


def test_pipeline_prediction_per_stage():
    first = predict_collectives(4, 64, 8, 16, 1, pp_size=2, stage=0, micro_batches=4, stage_layers=2)
    last = predict_collectives(4, 64, 8, 16, 1, pp_size=2, stage=1, micro_batches=4, stage_layers=2)
    activation = 2 * 16 * 64 * 4
    assert first.counts == {"send": 4, "recv": 4, "broadcast": 1}
    assert first.nbytes["send"] == 4 * activation
    assert last.counts == first.counts
    with_tp = predict_collectives(4, 64, 8, 16, 2, pp_size=2, stage=1, micro_batches=4, stage_layers=2)
    assert with_tp.counts["all_reduce"] == 4 * (4 * 2 + 1) + 2 * 4, "2 layers, head grad, loss, per micro-batch"
    assert with_tp.nbytes["send"] == 4 * activation // 2, "scatter-gather: each TP rank sends half"
    assert with_tp.counts["all_gather"] == 4 and with_tp.nbytes["all_gather"] == 4 * activation // 2
    with pytest.raises(ValueError, match="stage_layers is required"):  # the runtime's split is the one source
        predict_collectives(4, 64, 8, 16, 1, pp_size=2, stage=0, micro_batches=4)


MEMORY = {
    "memory_above_start": 100 * 2**20,
    "memory_by_kind": {"act": 2**20, "total": 3 * 2**20},
    "model_state": {"weights": 2**20, "gradients": 2**20, "optimizer": 2**21},
}


def _summary(name, times, collectives=None, error=None, **extra):
    summary = ContenderSummary(name, processes=2 if name == "mtk" else 1, threads=1)
    if error:
        summary.error = error
        return summary
    summary.add(
        [
            {
                "step_s": times,
                "peak_memory": 300 * 2**20,
                "loss": 9.0,
                "collectives": collectives or {},
                **MEMORY,
                **extra,
            },
            {
                "step_s": [t + 0.1 for t in times],
                "peak_memory": 310 * 2**20,
                "loss": 9.0,
                "collectives": {},
                **MEMORY,
                **extra,
            },
        ]
    )
    return summary


def test_report_has_ratios_memory_and_collectives(tmp_path):
    spec = BenchSpec(model="bench-llama", tp_size=2, pp_size=1, batch=4, seq=256, steps=3)
    predicted = predicted_for(spec)
    measured = {"all_reduce": {"count": 20, "bytes": predicted.nbytes["all_reduce"]}}
    summaries = [
        _summary("mtk", [0.9, 1.0, 1.1], measured, activation_all_reduce_s=0.002),
        _summary("hf-1thread", [1.9, 2.0, 2.1]),
        _summary("transformers-tp_plan", [], error="RuntimeError: no tp_plan"),
    ]
    report = report_dict(spec, summaries, predicted, busy=[0.02, 0.04])
    mtk, hf, failed = report["contenders"]
    assert mtk["median_s"] == pytest.approx(1.1), "a step takes as long as its slowest rank"
    assert hf["mtk_time_ratio"] == pytest.approx(1.1 / 2.1)
    assert mtk["tokens_per_s"] == pytest.approx(4 * 256 / 1.1)
    assert mtk["peak_memory_per_rank"] == [300 * 2**20, 310 * 2**20]
    text = format_report(report)
    assert "0.52x" in text and "failed: RuntimeError: no tp_plan" in text
    assert "all_reduce" in text and "predicted   20 calls" in text and " ok" in text
    assert "busy 2%-4% of the time just before each launch" in text
    floor = report["tensor_parallel"]  # plain HF's 1-thread step / tp + the step's all-reduces, none overlapped
    assert floor["activation_all_reduces"] == pytest.approx(18 + 3 * 4 * 256 * 4 / 2**21)
    assert floor["floor_s"] == pytest.approx(2.1 / 2 + floor["activation_all_reduces"] * 0.002)
    assert floor["measured_vs_floor"] == pytest.approx(1.1 / floor["floor_s"])
    assert "tensor parallel: 1.100 s/step against a floor of 1.086" in text
    write_json(report, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text())["contenders"][0]["name"] == "mtk"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "2", "--pp", "2"], "--cp 2 is measured on one replica of one stage, without --pp > 1"),
        (["--cp", "2", "--dp", "2", "--fsdp"], "without --dp > 1, --fsdp"),
        (["--cp", "2", "--seq", "18"], "--cp 2 cuts --seq into 4 equal chunks: use a multiple of 4"),
        (["--cp", "2", "--tp", "2", "--sequence_parallel", "--seq", "20"], "cuts --seq into 8 equal chunks"),
        (["--cp", "8", "--cp_comm_type", "a2a", "--seq", "64"], "splits each TP rank's 4 heads over --cp 8: use p2p"),
        (["--cp", "0"], "--cp must be at least 1, got 0"),
        (["--rounds", "-1"], "--rounds must be at least 1, got -1"),  # (ran the launch check, then a traceback)
        (["--micro_batches", "0"], "--micro_batches must be at least 1, got 0"),
    ],
)
def test_context_parallel_bench_input_is_one_line(argv, message, capsys):
    assert main(["bench", "--model", "tiny-llama", "--tp", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_context_parallel_prediction_per_layer():
    ring = predict_context_collectives(2, 1, 64, 4, "p2p", heads=4, kv_heads=2, head_dim=16)
    block = 1 * 2 * 16 * 2 * 16  # [b, kv, s/cp, 2d]
    # 3 hops forward; 3 + 4 backward; the loss all-reduced once
    assert ring.counts == {"all_gather": 2, "send": 2 * 10, "recv": 2 * 10, "all_reduce": 1}
    assert ring.nbytes["send"] == 2 * block * (2 * 3 * 4 + 4 * 4) and ring.nbytes["all_reduce"] == 4
    recomputed = predict_context_collectives(2, 1, 64, 4, "p2p", 4, 2, 16, recompute=True, losses=2)
    assert recomputed.counts == {"all_gather": 4, "send": 2 * 13, "recv": 2 * 13, "all_reduce": 2}  # forwards twice
    assert recomputed.nbytes["send"] == 2 * block * (3 * 3 * 4 + 4 * 4)  # the forward hops twice
    a2a = predict_context_collectives(2, 1, 64, 4, "a2a", heads=4, kv_heads=2, head_dim=16)
    assert a2a.counts == {"all_gather": 2, "all_to_all": 16, "all_reduce": 1}  # q, k, v, out; both ways
    assert a2a.nbytes["all_to_all"] == 2 * 2 * (1 * 16 * 16 * 4) * (2 * 4 + 2 * 4)  # kv repeated to 4 heads
    assert predict_context_collectives(2, 1, 64, 1, "p2p", 4, 2, 16).counts == {}


def test_bad_bench_input_is_one_line(capsys):
    assert main(["bench", "--model", "tiny-llama", "--tp", "3"]) == 2
    assert "num_attention_heads = 4 is not divisible by tp = 3" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny-llama", "--pp", "2", "--batch", "3", "--micro_batches", "2"]) == 2
    assert "--batch 3 does not split into --micro_batches 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ep", "2", "--dp", "3"], "--ep 2 spreads the experts over data-parallel replicas: give --dp a multiple"),
        (["--model", "tiny-llama", "--ep", "2", "--dp", "2"], "--ep 2: llama has no mixture-of-experts layer"),
        (["--ep", "3", "--dp", "3"], "--ep 3: its 8 experts per layer do not divide over 3 ranks"),
        (["--ep", "2", "--dp", "2", "--pp", "2"], "--dp > 1 runs with --pp 1"),
        (["--ep", "2", "--dp", "2", "--memory"], "--ep 2 is measured against mtk at EP 1, without --memory"),
        (["--ep", "0"], "--ep must be at least 1, got 0"),
    ],
)
def test_expert_parallel_bench_input_is_one_line(argv, message, capsys):
    assert main(["bench", "--model", "tiny-qwen3-moe", "--tp", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_expert_parallel_prediction_per_layer():
    """Per MoE layer: counts, rows, ids and the rows back forward; the rows' gradients both ways backward."""
    tokens, k, hidden = 32, 2, 64
    rows = tokens * k * hidden * 4
    one = predict_expert_collectives(3, tokens, k, hidden, ep_size=4)
    assert one.counts == {"all_to_all": 3 * 6}
    assert one.nbytes["all_to_all"] == 3 * (8 * 4 + 8 * tokens * k + 2 * rows + 2 * rows)
    again = predict_expert_collectives(3, tokens, k, hidden, ep_size=4, recompute=True, micro_batches=2)
    assert again.counts == {"all_to_all": 3 * 10 * 2}  # the forward's four rerun in backward, per micro-batch
    assert predict_expert_collectives(3, tokens, k, hidden, ep_size=1).counts == {}


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--tp", "2", "--etp", "3"],
            "--etp 3: expert tensor parallel size (megatron_lm_expert_tensor_parallel_size)",
        ),
        (["--model", "tiny-llama", "--tp", "2", "--etp", "1"], "whole on each TP rank; tiny-llama has no experts"),
        (["--tp", "2", "--dp", "2", "--etp", "1", "--fsdp"], "without --fsdp"),
        (["--tp", "2", "--etp", "1", "--sequence_parallel"], "without --sequence_parallel"),
    ],
)
def test_expert_tp_size_bench_input_is_one_line(argv, message, capsys):
    assert main(["bench", "--model", "tiny-qwen3-moe", *argv]) == 2
    assert message in capsys.readouterr().err


def test_expert_tp_size_1_prediction_equals_the_counted_run():
    """tiny-qwen3-moe at TP 2 with whole experts (2 MoE layers, 32 tokens, k 2, h 64), as counted in a real run
    (``mtk bench --model tiny-qwen3-moe --tp 2 --etp 1 --batch 2 --seq 16``): no MLP pair and no routing-weights sum
    per MoE layer, the experts' 2 tensors summed over TP (with the q/k norms, in one call once per step), and 3
    gathers of 16 rows ([16, 64], [16, 64], [16, 2])."""
    spec = BenchSpec(model="tiny-qwen3-moe", tp_size=2, pp_size=1, batch=2, seq=16, steps=1, etp_size=1)
    predicted = predicted_for(spec)
    assert dict(predicted.counts) == {"all_reduce": 9, "all_gather": 6}
    assert dict(predicted.nbytes) == {"all_reduce": 443008, "all_gather": 2 * 16 * (64 + 64 + 2) * 4}
    split = predicted_for(replace(spec, etp_size=None))
    assert dict(split.counts) == {"all_reduce": 15} and dict(split.nbytes) == {"all_reduce": 83072}
    uneven = predicted_for(replace(spec, batch=1, seq=15))  # 15 tokens: rank 0 runs 8
    assert uneven.nbytes["all_gather"] == 2 * 8 * (64 + 64 + 2) * 4


def test_peak_allocations_replays_the_allocator_trace_to_its_highest_point():
    """Blocks live at the trace's highest point, by the first mtk / transformers frame; a freed block leaves."""
    sdpa = [{"filename": "/x/site-packages/transformers/integrations/sdpa_attention.py", "line": 182, "name": "f"}]
    engine = [{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "backward"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": sdpa},
        {"action": "alloc", "addr": 2, "size": 50, "frames": engine},
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},  # the second event of the same free
        {"action": "alloc", "addr": 3, "size": 70, "frames": sdpa},  # 170: the peak
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": engine},  # 130
        {"action": "segment_alloc", "addr": 9, "size": 1000},  # the allocator's own reservation: not counted
    ]
    found = peak_allocations(events)
    assert found.peak == 170
    assert dict(found.by_frame) == {"transformers/integrations/sdpa_attention.py:182 f": 170}


ENOSPC_FSYNC = OSError(errno.ENOSPC, "No space left on device")


def _full_disk(*_):
    raise ENOSPC_FSYNC


def test_a_report_the_disk_cannot_take_is_one_line_and_keeps_the_earlier_file(tmp_path, monkeypatch):
    """A disk that filled while the benchmark ran ended it in an OSError traceback after the whole run, and
    write_text had already emptied the user's earlier report. Now: one line naming the file and the OS's reason,
    the earlier file as it was, nothing else left beside it; /dev/full (refusing every write) the same."""
    earlier = tmp_path / "bench.json"
    earlier.write_text("mine")
    monkeypatch.setattr("mtk.bench.report.os.fsync", _full_disk)
    with pytest.raises(ConfigError, match=r"could not write --json .*bench.json: No space left on device") as err:
        write_json({"contenders": []}, earlier)
    assert "\n" not in str(err.value)
    assert earlier.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="could not write --json /dev/full: No space left on device"):
        write_json({"contenders": []}, "/dev/full")
    write_json({"contenders": []}, earlier)  # and a write that works replaces it whole
    assert json.loads(earlier.read_text()) == {"contenders": []}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_a_contender_past_memory_is_said_as_out_of_memory(monkeypatch):
    """A worker whose allocation failed (--batch past the machine's memory) was reported by the traceback's last
    line; the workers' exceptions now come back with the error, and the contender's failure says what to change."""
    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 12799999999872 bytes. Error code 12 (Cannot allocate memory)"
    )

    def fail(fn, world_size, **_):
        raise DistributedTestError(f"{fn.__name__} failed on ranks [0]:\n--- rank 0 ---\nTraceback ...", {0: refused})

    monkeypatch.setattr("mtk.bench.runner.run_distributed", fail)
    monkeypatch.setattr("mtk.bench.runner.machine_busy_fraction", lambda: 0.0)
    spec = BenchSpec(model="tiny-llama", tp_size=1, pp_size=1, batch=99999999999, seq=16, steps=1)
    (summary,), _ = run_bench(spec, ["mtk"], 1, progress=lambda line: None)
    assert summary.error == (
        "out of memory on rank 0 (DefaultCPUAllocator: can't allocate memory: you tried to allocate 12799999999872 "
        "bytes. Error code 12 (Cannot allocate memory)); use a smaller --batch or --seq"
    )
