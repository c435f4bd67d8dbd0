"""DeepSpeed's batch fields reconciled with the flags: train_batch_size = micro x accumulation x DP (DP from
mtk's topology), the missing ones derived as DeepSpeed derives them, an override one line, a refusal one line.
Also fp16 where DeepSpeed has none, and a failed ``deepspeed.initialize``: one line, no /dev/shm left behind."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mtk.config import ConfigError
from mtk.integrations.deepspeed import check_precision, deepspeed_config, initialization_cleanup
from mtk.integrations.deepspeed_batch import BatchSizes, dp_layout, reconcile_batch

pytestmark = pytest.mark.unit

TB, MB, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def sizes(config, dp=2, **flags):
    batch, note = reconcile_batch(config, dp, **flags)
    return (batch.global_batch, batch.micro_batch_size, batch.accumulation), note


def test_only_train_batch_size_accumulates_once():
    assert sizes({TB: 32}) == ((32, 16, 1), None)
    assert sizes({TB: 32}, micro_batch_size=4) == ((32, 4, 4), None)  # the flag's micro-batch, accumulation derived
    assert sizes({TB: 32}, accumulation=4) == ((32, 4, 4), None)  # the flag's accumulation, micro derived


def test_only_the_micro_batch_accumulates_once():
    assert sizes({MB: 8}) == ((16, 8, 1), None)
    assert sizes({MB: 8}, dp=4) == ((32, 8, 1), None)


def test_micro_and_accumulation_give_the_global_batch():
    assert sizes({MB: 4, GA: 4}) == ((32, 4, 4), None)


def test_train_batch_and_one_other_derive_the_third():
    assert sizes({TB: 32, MB: 8}) == ((32, 8, 2), None)
    assert sizes({TB: 32, GA: 2}) == ((32, 8, 2), None)


def test_three_that_agree_are_used():
    assert sizes({TB: 32, MB: 8, GA: 2}) == ((32, 8, 2), None)
    assert sizes({TB: 32, MB: 8, GA: 2}, micro_batch_size=8, accumulation=2) == ((32, 8, 2), None)  # flags that agree


def test_three_that_disagree_are_one_line_naming_dp():
    with pytest.raises(ConfigError) as err:
        reconcile_batch({TB: 32, MB: 8, GA: 1}, 2, where="ds.json", layout=dp_layout(4, 2))
    assert str(err.value) == (
        "ds.json: train_batch_size 32 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 1 x dp 2 = "
        "16 (dp = world 4 / tp 2); give two of the three (the third is derived), or values that agree"
    )
    with pytest.raises(ConfigError, match="train_batch_size 32 != "):  # flags do not hide a JSON at odds with itself
        reconcile_batch({TB: 32, MB: 8, GA: 1}, 2, micro_batch_size=8)


def test_a_flag_that_disagrees_overrides_in_one_line():
    (batch, note) = sizes({MB: 4, GA: 4}, accumulation=1)
    assert batch == (8, 4, 1)
    assert note == (
        "mtk: --grad_accum 1 overrides gradient_accumulation_steps 4 in the DeepSpeed JSON: "
        "global batch 8 = micro 4 x accumulation 1 x dp 2"
    )
    (batch, note) = sizes({MB: 8, GA: 1}, micro_batch_size=4, accumulation=2)
    assert batch == (16, 4, 2)
    assert note is not None and "--batch_size 4 overrides train_micro_batch_size_per_gpu 8; --grad_accum 2" in note


def test_train_batch_size_follows_the_flags_and_says_so():
    (batch, note) = sizes({TB: 32, MB: 8}, accumulation=1)
    assert batch == (16, 8, 1)
    assert note == (
        "mtk: train_batch_size 32 -> 16 (follows --grad_accum 1) in the DeepSpeed JSON: "
        "global batch 16 = micro 8 x accumulation 1 x dp 2"
    )
    (batch, note) = sizes({TB: 32, MB: 8, GA: 2}, micro_batch_size=4)
    assert batch == (16, 4, 2) and note is not None and note.count("\n") == 0
    assert "--batch_size 4 overrides train_micro_batch_size_per_gpu 8; train_batch_size 32 -> 16" in note


def test_accelerate_names_its_own_flags():
    _, note = reconcile_batch(
        {MB: "auto", GA: 4},
        2,
        micro_batch_size=1,
        accumulation=1,
        micro_flag="the DataLoader's batch_size {}",
        accumulation_flag="Accelerator(gradient_accumulation_steps={})",
        where="ds.json",
    )
    assert note == (
        "mtk: Accelerator(gradient_accumulation_steps=1) overrides gradient_accumulation_steps 4 in ds.json: "
        "global batch 2 = micro 1 x accumulation 1 x dp 2"
    )


def test_flags_fill_a_json_that_gives_none():
    assert sizes({}, micro_batch_size=4, accumulation=2) == ((16, 4, 2), None)
    assert sizes({}, micro_batch_size=4) == ((8, 4, 1), None)


def test_a_global_batch_that_does_not_divide_names_what_would():
    with pytest.raises(ConfigError) as err:
        reconcile_batch({TB: 30}, 4, where="ds.json")
    assert str(err.value).startswith("ds.json: train_batch_size 30 is not a multiple of dp 4 = 4; allowed: 4, 8, 12")
    with pytest.raises(ConfigError, match=r"train_batch_size 32 is not a multiple of --batch_size 3 x dp 2 = 6; "):
        reconcile_batch({TB: 32}, 2, micro_batch_size=3)


def test_no_batch_size_at_all_is_one_line():
    with pytest.raises(ConfigError, match="gives no batch size .* or pass --batch_size N$"):
        reconcile_batch({GA: 2}, 2)


def test_auto_is_a_value_not_given():
    auto = {TB: "auto", MB: "auto", GA: "auto"}
    assert sizes(auto, micro_batch_size=4) == ((8, 4, 1), None)
    assert sizes(auto, micro_batch_size=4, accumulation=2) == ((16, 4, 2), None)
    assert sizes({TB: 64, MB: "auto", GA: "auto"}, micro_batch_size=8) == ((64, 8, 4), None)
    with pytest.raises(ConfigError, match="gives no batch size"):
        reconcile_batch(auto, 2)


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True])
def test_a_value_that_is_no_batch_size_is_one_line(value):
    with pytest.raises(ConfigError, match=f'"{MB}": .* must be a positive integer or "auto"'):
        reconcile_batch({MB: value}, 2)


def test_dp_is_the_data_parallel_size_not_the_process_count():
    assert BatchSizes(micro_batch_size=4, accumulation=2, dp_size=2).global_batch == 16  # e.g. world 8 / (tp 2 x pp 2)
    assert dp_layout(8, 2, 2) == " (dp = world 8 / (tp 2 x pp 2))"
    assert (
        dp_layout(8, 2, cp_size=2) == " (dp = world 8 / (tp 2 x cp 2))" and dp_layout(4, 1) == " (dp = world 4 / tp 1)"
    )


def test_deepspeed_config_writes_all_three_and_keeps_train_batch_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({TB: 32, "zero_optimization": {"stage": 2}}))
    lines = []
    config, batch = deepspeed_config(path, 2, micro_batch_size=4, report=lines.append)
    assert (config[TB], config[MB], config[GA]) == (32, 4, 4) and batch.accumulation == 4 and lines == []
    config, _ = deepspeed_config(path, 2, micro_batch_size=4, grad_accum=1, report=lines.append)
    assert (config[TB], config[MB], config[GA]) == (8, 4, 1) and len(lines) == 1


def test_fp16_where_deepspeed_has_none_is_one_line_naming_what_runs():
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed runs fp16 on this machine")
    check_precision({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "ds.json")  # bf16 passes
    with pytest.raises(ConfigError) as err:
        check_precision({"fp16": {"enabled": True}}, "ds.json")
    assert re.fullmatch(
        r'ds\.json: "fp16": \{"enabled": true\} does not run under DeepSpeed on \w+ \(no fp16 there\); use '
        r'(bf16 \("bf16": \{"enabled": true\}\) or )?fp32 \(no fp16 block, or "enabled": false\)',
        str(err.value),
    ), str(err.value)
    with pytest.raises(ConfigError, match=r"mixed_precision fp16.* use bf16 \(mixed_precision bf16\) or fp32"):
        check_precision({"fp16": {"enabled": True}}, "ds.json", accelerate=True)


def test_an_optimizer_param_the_optimizer_does_not_take_is_one_line():
    """``"params": {"bogus": 1}`` reached AdamW's constructor inside deepspeed.initialize: a TypeError traceback on
    every rank. A keyword refusal is DeepSpeed's config refused; any other TypeError stays a bug's traceback."""
    with pytest.raises(
        ConfigError, match=r"^ds.json: DeepSpeed refused the config: .*unexpected keyword argument 'bogus'"
    ):
        with initialization_cleanup("ds.json"):
            raise TypeError("AdamW.__init__() got an unexpected keyword argument 'bogus'")
    with pytest.raises(TypeError, match="unsupported operand"):
        with initialization_cleanup("ds.json"):
            raise TypeError("unsupported operand type(s)")


def test_an_op_deepspeed_cannot_build_on_this_machine_is_one_line():
    """Offload to nvme needs DeepSpeed's async_io op, which it builds at initialize: on a machine without it, its
    RuntimeError was a traceback on every rank. Any other RuntimeError stays a bug's traceback."""
    unbuildable = (
        "Unable to JIT load the async_io op due to it not being compatible due to hardware/software issue. None"
    )
    with pytest.raises(
        ConfigError, match=r"^ds.json: DeepSpeed cannot build an op .*async_io.*offload to cpu instead"
    ):
        with initialization_cleanup("ds.json"):
            raise RuntimeError(unbuildable)
    with pytest.raises(RuntimeError, match="something else"):
        with initialization_cleanup("ds.json"):
            raise RuntimeError("something else")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize(
    "error", [AssertionError("Micro batch size per gpu: 0 has to be greater than 0"), OSError("x")]
)
def test_a_failed_initialize_removes_the_jobs_shm_buffers(monkeypatch, error):
    """Every local rank's buffer of this job (port), not another job's; DeepSpeed's config refusal is one line."""
    port = str(40000 + os.getpid() % 20000)
    monkeypatch.setenv("MASTER_PORT", port)
    ours = [Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}") for rank in (0, 1)]
    other = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}1_0")
    for path in [*ours, other]:
        path.write_bytes(b"")
    try:
        with pytest.raises(ConfigError if isinstance(error, AssertionError) else OSError) as raised:
            with initialization_cleanup("ds.json"):
                raise error
        assert not any(path.exists() for path in ours) and other.exists()
        if isinstance(error, AssertionError):
            assert str(raised.value) == (
                "ds.json: DeepSpeed refused the config: Micro batch size per gpu: 0 has to be greater than 0"
            )
    finally:
        for path in [*ours, other]:
            path.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_rank_the_launcher_stops_with_sigterm_removes_its_shm_buffer(tmp_path):
    """The launcher stops the other ranks of a failed job with SIGTERM: their exit handlers still run."""
    port = str(40000 + (os.getpid() + 7) % 20000)
    buffer = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_3")
    buffer.write_bytes(b"")
    script = (
        "import os, signal, time\n"
        "from mtk.integrations.deepspeed import remove_shm_buffers_at_exit\n"
        "remove_shm_buffers_at_exit()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "MASTER_PORT": port, "RANK": "3", "PYTHONPATH": root}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 128 + signal.SIGTERM, out.stderr[-2000:]
        assert not buffer.exists()
    finally:
        buffer.unlink(missing_ok=True)


def test_models_build_whole_under_accelerates_zero3_registration():
    """accelerate registers its DeepSpeed config with transformers even with zero3_init_flag false (and
    TrainingArguments(deepspeed=<ZeRO-3 JSON>) does); inside whole_parameters, and in build_model whatever the
    caller does (sft.py's starter model at TP1 x DP2 met DeepSpeed's batch-size AssertionError in zero.Init),
    transformers builds without zero.Init (mtk splits the model, DeepSpeed partitions it later)."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from mtk.models import build_model, whole_parameters

    registered = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with whole_parameters():
            assert not is_deepspeed_zero3_enabled()
            model = build_model("tiny-llama", seed=0)
        assert is_deepspeed_zero3_enabled()  # put back
        assert all(p.numel() > 0 and not hasattr(p, "ds_id") for p in model.parameters())
        built = build_model("tiny-llama", seed=0)
        assert is_deepspeed_zero3_enabled()
        assert all(p.numel() > 0 and not hasattr(p, "ds_id") for p in built.parameters())
    finally:
        del registered
        unset_hf_deepspeed_config()


def test_a_pipeline_under_deepspeed_is_one_line_naming_the_alternative():
    from mtk.config import ConfigError, ParallelConfig
    from mtk.integrations.accelerate.init import resolve_topology

    refusal = r"pipeline parallelism \(pp = 2\) does not run under DeepSpeed.*use FSDP2.*distopt"
    with pytest.raises(ConfigError, match=refusal):
        resolve_topology(ParallelConfig(tp_size=2, pp_size=2), {"zero_optimization": {"stage": 3}})


def test_the_jsons_optimizer_and_lr_flag_are_one_setting_and_its_scheduler_is_refused():
    """DeepSpeed took the JSON's optimizer and ignored --lr (lr 0.5 trained under --lr 1e-4), and preferred the
    script's schedule to the JSON's "scheduler" block: either way one of them was dropped without a word."""
    from mtk.integrations.deepspeed import optimizer_and_schedule

    said: list[str] = []
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    optimizer_and_schedule(config, "ds.json", 1e-4, said.append)
    assert config["optimizer"]["params"]["lr"] == 1e-4
    assert said == ["mtk: --lr 0.0001 overrides optimizer.params.lr 0.5 in ds.json"]
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    optimizer_and_schedule(config, "ds.json", None, said.append)
    assert config["optimizer"]["params"]["lr"] == 0.5 and len(said) == 1  # the JSON's, without a flag: no line
    config = {}
    optimizer_and_schedule(config, "ds.json", None, said.append)
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["lr"] == 3e-3
    with pytest.raises(ConfigError, match='ds.json: its "scheduler" block would be ignored'):
        optimizer_and_schedule({"scheduler": {"type": "WarmupLR"}}, "ds.json", None, said.append)


def test_a_json_optimizer_beside_the_scripts_own_is_one_line_under_accelerate():
    """accelerate raised a ValueError inside prepare on every rank (a traceback each) when the JSON and the script
    both define the optimizer or the LR scheduler."""
    from types import SimpleNamespace

    import torch

    from mtk.integrations.accelerate.deepspeed import refuse_two_optimizers

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for block, args in (("optimizer", (optimizer,)), ("scheduler", (optimizer, scheduler))):
        plugin = SimpleNamespace(deepspeed_config={block: {"type": "X"}})
        state = SimpleNamespace(deepspeed_plugin=plugin)
        accelerator = SimpleNamespace(state=state, deepspeed_batch_fields=({}, "ds.json"))
        with pytest.raises(ConfigError, match=rf'ds.json defines the {block} \(its "{block}" block\) and the script'):
            refuse_two_optimizers(accelerator, args)
    refuse_two_optimizers(accelerator, (optimizer,))  # a JSON scheduler beside the script's optimizer: no conflict


def test_what_the_deepspeed_launcher_cannot_take_from_an_accelerate_json_is_one_line():
    """run.py under the deepspeed launcher: accelerate's "auto" clipping reached DeepSpeed's comparison as a string
    (a TypeError on every rank), and an "mtk" block's TP size other than --tp was ignored without a word."""
    from types import SimpleNamespace

    from mtk.integrations.deepspeed import check_launcher_config

    run = SimpleNamespace(tp_size=1, cp_size=2, ep_size=1, etp_size=1)
    with pytest.raises(ConfigError, match='"gradient_clipping": "auto" is filled in by accelerate'):
        check_launcher_config({"gradient_clipping": "auto"}, "ds.json", run)
    with pytest.raises(ConfigError, match=r'"mtk": \{"tensor_parallel_size": 2\} but this run\'s size is 1 \(--tp'):
        check_launcher_config({"mtk": {"tensor_parallel_size": 2}}, "ds.json", run)
    with pytest.raises(ConfigError, match=r'"mtk": \{"expert_parallel_size": 2\} but this run\'s size is 1 \(--ep'):
        check_launcher_config({"mtk": {"expert_parallel_size": 2}}, "ds.json", run)
    check_launcher_config({"gradient_clipping": 1.0, "mtk": {"context_parallel_size": 2}}, "ds.json", run)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_gradient_clipping_that_turns_clipping_off_is_one_line_on_both_launch_paths(tmp_path, monkeypatch, bad):
    """DeepSpeed takes a clipping <= 0 (and NaN) as none: -1 under accelerate's DEEPSPEED turned clipping off without
    a word (the deepspeed launcher's check alone refused it)."""

    message = '"gradient_clipping": .* must be a finite number >= 0'
    _refused_on_both_launch_paths(tmp_path / "ds.json", {MB: 2, "gradient_clipping": bad}, message, monkeypatch)


def test_a_json_optimizer_reading_whole_tensors_is_one_line_next_to_tensor_parallelism(capsys):
    """DeepSpeed's "Lamb" (and 1-bit LAMB) computes a trust ratio from each tensor's norm: on TP shards it trains
    differently from one process, so at TP 2 it is one line; Adam and Lion pass; a type mtk does not know is named
    once, by rank 0; at TP 1 nothing is checked."""
    from types import SimpleNamespace

    from mtk.integrations.deepspeed import check_launcher_config

    tp2 = SimpleNamespace(tp_size=2, cp_size=1, ep_size=1, etp_size=2, rank=0)
    tp1 = SimpleNamespace(tp_size=1, cp_size=1, ep_size=1, etp_size=1, rank=0)
    for name in ("Lamb", "OneBitLamb"):
        with pytest.raises(ConfigError, match=f"{name} computes its update from statistics of each whole tensor"):
            check_launcher_config({"optimizer": {"type": name}}, "ds.json", tp2)
        check_launcher_config({"optimizer": {"type": name}}, "ds.json", tp1)
    for name in ("AdamW", "Adam", "Lion", "Adagrad"):
        check_launcher_config({"optimizer": {"type": name}}, "ds.json", tp2)
    assert capsys.readouterr().out == ""
    check_launcher_config({"optimizer": {"type": "Novel"}}, "ds.json", tp2)
    assert capsys.readouterr().out.startswith("mtk: Novel updates split parameters shard by shard")


@pytest.mark.parametrize("key, value", [("zero_optimization", "2"), ("optimizer", ["AdamW"]), ("bf16", True)])
def test_a_section_that_is_not_an_object_is_one_line_naming_it(tmp_path, monkeypatch, key, value):
    """``"zero_optimization": "2"`` reached DeepSpeed's ``**block`` (a TypeError on every rank under the deepspeed
    launcher) or accelerate's plugin (an AttributeError): both paths refuse it first, naming the key and its type."""

    path = tmp_path / "ds.json"
    kind = {str: "a string", list: "an array", bool: "a boolean"}[type(value)]
    message = f'{path}: "{key}" is {kind} ({json.dumps(value)}); it must be a JSON object'
    _refused_on_both_launch_paths(path, {MB: 2, key: value}, re.escape(message), monkeypatch)


def _refused_on_both_launch_paths(path, config: dict, message: str, monkeypatch) -> None:
    """``config`` written at ``path`` is one line matching ``message`` under the deepspeed launcher (run.py's
    reading) and under accelerate's DEEPSPEED (the file its YAML names)."""
    from mtk.integrations.accelerate.deepspeed import check_launcher_sections

    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as err:
        deepspeed_config(path, 1)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match=message):
        check_launcher_sections()


@pytest.mark.parametrize(
    "section, params, message",
    [
        ("optimizer", {"lr": "1e-3"}, '"optimizer.params.lr" holds the string "1e-3"; a number must be written'),
        ("optimizer", {"lr": 1e-3, "betas": ["0.9", 0.99]}, '"optimizer.params.betas" holds the string "0.9"'),
        ("scheduler", {"warmup_num_steps": "10"}, '"scheduler.params.warmup_num_steps" holds the string "10"'),
        ("optimizer", "fast", '"optimizer.params" is a string; it must be a JSON object'),
    ],
)
def test_a_number_written_as_a_string_in_params_is_one_line(tmp_path, monkeypatch, section, params, message):
    """``"lr": "1e-3"`` reached torch's optimizer as a string: a TypeError traceback on every rank. Refused first
    on both paths; settings that are strings (``"warmup_type": "log"``, accelerate's ``"auto"``) are kept."""
    from mtk.integrations.accelerate.deepspeed import check_launcher_sections

    path = tmp_path / "ds.json"
    _refused_on_both_launch_paths(
        path, {MB: 2, section: {"type": "AdamW", "params": params}}, re.escape(message), monkeypatch
    )
    kept = {"warmup_type": "log", "warmup_max_lr": "auto", "warmup_num_steps": 10}
    path.write_text(json.dumps({MB: 2, "scheduler": {"type": "WarmupLR", "params": kept}}))
    check_launcher_sections()


def test_deepspeeds_legacy_boolean_zero_optimization_is_accepted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({MB: 2, "zero_optimization": True, "bf16": {"enabled": False}}))
    config, _ = deepspeed_config(path, 1)
    assert config["zero_optimization"] is True


def test_a_key_given_twice_is_one_line_on_both_launch_paths(tmp_path, monkeypatch):
    """``"zero_optimization"`` twice: accelerate's reader (Python's) kept the last block and finetune.py trained
    ZeRO-0 without a word, where the Trainer path and run.py refused it. The line names the key, not a position."""
    from mtk.integrations.accelerate.deepspeed import check_launcher_sections

    path = tmp_path / "ds.json"
    path.write_text(f'{{"{MB}": 2, "zero_optimization": {{"stage": 2}}, "zero_optimization": {{"stage": 0}}}}')
    with pytest.raises(ConfigError, match=r"key 'zero_optimization' is given twice") as err:
        deepspeed_config(path, 1)
    assert "line 1 column" not in str(err.value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match=rf"DeepSpeed config {re.escape(str(path))}: key 'zero_optimization' is "):
        check_launcher_sections()


@pytest.mark.parametrize("stage", ["auto", "2", 4, -1, True])
def test_a_zero_stage_that_is_not_a_number_from_0_to_3_is_one_line(tmp_path, monkeypatch, stage):
    """``"stage": "auto"`` (nothing fills it) trained as ZeRO-0 without a word: DeepSpeed reads it as 0."""
    message = f'"zero_optimization.stage" is {json.dumps(stage)}; write the number 0, 1, 2 or 3, without quotes'
    config = {MB: 2, "zero_optimization": {"stage": stage}}
    _refused_on_both_launch_paths(tmp_path / "ds.json", config, re.escape(message), monkeypatch)


def test_a_scripts_gradient_clipping_reaches_deepspeed_or_is_one_line():
    """DeepSpeed clips inside its step by its config's ``gradient_clipping``, and accelerate's ``clip_grad_norm_``
    returns its norm: a script's ``--max_grad_norm`` was dropped unsaid (accelerate filled "auto" with 1.0). It is
    written where the config leaves the field to others, a number that differs is one line, and a run without its
    own takes the config's."""
    from mtk.config import RunSettings
    from mtk.integrations.accelerate.deepspeed import reconcile_gradient_clipping

    for given in ({"gradient_clipping": "auto"}, {}):
        config = dict(given)
        assert (
            reconcile_gradient_clipping(config, RunSettings(gradient_clipping=0.01), "ds.json").gradient_clipping
            == 0.01
        )
        assert config["gradient_clipping"] == 0.01
        untouched = dict(given)
        assert reconcile_gradient_clipping(untouched, RunSettings(), "ds.json") == RunSettings()
        assert untouched == given  # (accelerate fills its 1.0, which the scripts clip by when they have none)
    assert reconcile_gradient_clipping({"gradient_clipping": 0.5}, RunSettings(), "x").gradient_clipping == 0.5
    assert reconcile_gradient_clipping({"gradient_clipping": 0.5}, RunSettings(gradient_clipping=0.5), "x")
    with pytest.raises(ConfigError, match=r'ds.json: "gradient_clipping": 1.0 disagrees with this run\'s gradient '
                       r"clipping 0.01 \(--max_grad_norm, else megatron_lm_gradient_clipping\)"):  # fmt: skip
        reconcile_gradient_clipping({"gradient_clipping": 1.0}, RunSettings(gradient_clipping=0.01), "ds.json")


def test_a_sigterm_while_the_exit_handlers_run_exits_at_once_without_a_traceback():
    """A launcher stopping the ranks of a failed job can deliver SIGTERM while a rank's exit handlers run: the
    handler's ``SystemExit`` was printed there as an ignored exception's traceback (the exit status then 0)."""
    script = (
        "import atexit, os, signal\n"
        "os.environ['RANK'] = '0'\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # (runs after mtk's, registered later)\n"
        "from mtk.integrations.deepspeed import remove_shm_buffers_at_exit\n"
        "remove_shm_buffers_at_exit()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_deepspeed_json_that_is_not_json_is_one_line_naming_it(tmp_path, monkeypatch):
    """The accelerate YAML's file and TRL scripts' --deepspeed: accelerate's and transformers' reading said only
    "'utf-8' codec can't decode byte 0xff in position 5" or "Expecting value: line 1 column 22", naming no file."""
    from mtk.integrations.accelerate.deepspeed import check_launcher_sections
    from mtk.trainers.arguments import check_deepspeed_file

    path = tmp_path / "ds.json"
    for content, said in ((b'{"\xff": 1}', "not text: byte 2 is not utf-8"), (b'{"a": auto}', "Expecting value")):
        path.write_bytes(content)
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
        with pytest.raises(ConfigError, match=rf"^DeepSpeed config {path} \(the accelerate YAML's\) .*{said}"):
            check_launcher_sections()
        for argv in (["--deepspeed", str(path)], [f"--deepspeed={path}"]):
            with pytest.raises(ConfigError, match=rf"^--deepspeed {path} is not valid JSON \(.*{said}"):
                check_deepspeed_file(argv)
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # (a Trainer script: the YAML's file, read by
        with pytest.raises(ConfigError, match=rf"^the accelerate YAML's deepspeed_config_file {path} is not valid"):
            check_deepspeed_file([])  # TrainingArguments while the arguments are made)
        monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    path.write_text('{"train_micro_batch_size_per_gpu": 2}')
    check_deepspeed_file(["--deepspeed", str(path)])
