"""What mtk's trainers do with each TrainingArguments field (and TRL ``model_init_kwargs`` key) they cannot honour
as-is (no processes needed)."""

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

import mtk.trainers
from mtk.config import RunSettings
from mtk.errors import ConfigError
from mtk.models import build_model
from mtk.trainers.arguments import (
    check_training_arguments,
    clipping_report,
    jit_checkpoint_report,
    recompute_settings,
)
from mtk.trainers.model_path import local_directory, model_init, take_reference_directory


def _args(tmp_path, **fields) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"torch_compile": True}, "TrainingArguments.torch_compile=True"),
        ({"neftune_noise_alpha": 5.0}, "TrainingArguments.neftune_noise_alpha"),
        ({"save_only_model": True}, "TrainingArguments.save_only_model=True"),
        ({"save_on_each_node": True}, "TrainingArguments.save_on_each_node=True"),
        ({"per_device_train_batch_size": 0}, "TrainingArguments.per_device_train_batch_size=0: must be a positive"),
        ({"gradient_accumulation_steps": 0}, "TrainingArguments.gradient_accumulation_steps=0: must be a positive"),
        ({"learning_rate": float("nan")}, "TrainingArguments.learning_rate=nan: must be a finite number"),
        ({"weight_decay": float("nan")}, "TrainingArguments.weight_decay=nan: must be a finite number"),
        ({"max_grad_norm": float("nan")}, "TrainingArguments.max_grad_norm=nan: must be a finite number"),
        ({"adam_beta1": float("-inf")}, "TrainingArguments.adam_beta1=-inf: must be a finite number"),
        ({"adam_epsilon": float("inf")}, "TrainingArguments.adam_epsilon=inf: must be a finite number"),
    ],
)
def test_a_field_mtk_cannot_honour_is_refused_naming_it(tmp_path, fields, named):
    with pytest.raises(ConfigError, match="^" + named.replace(".", r"\.")):
        check_training_arguments(_args(tmp_path, **fields))


@pytest.mark.parametrize(
    "config, fields, named",
    [
        ("DPOConfig", {"beta": float("nan")}, "DPOConfig.beta=nan: must be a finite number"),
        ("DPOConfig", {"weight_decay": float("inf")}, "TrainingArguments.weight_decay=inf: must be a finite number"),
        ("SFTConfig", {"max_grad_norm": float("nan")}, "TrainingArguments.max_grad_norm=nan: must be a finite number"),
    ],
)
def test_every_float_of_trls_configs_must_be_finite_named_by_the_class_that_declares_it(
    tmp_path, config, fields, named
):
    """Not a field-by-field list: each float field of the dataclass (TRL's own ones by its config's name)."""
    import trl

    args = getattr(trl, config)(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)
    with pytest.raises(ConfigError, match="^" + re.escape(named) + "$"):
        check_training_arguments(args)


def test_an_output_dir_that_is_a_file_or_under_one_is_refused_naming_it(tmp_path):
    (tmp_path / "file").write_text("kept")
    for given, where in ((tmp_path / "file", "is an"), (tmp_path / "file" / "run", f"is under {tmp_path / 'file'}")):
        args = TrainingArguments(output_dir=str(given), report_to=[], use_cpu=True)
        with pytest.raises(ConfigError, match=f"^TrainingArguments.output_dir='{re.escape(str(given))}' {where}"):
            check_training_arguments(args)
    assert (tmp_path / "file").read_text() == "kept"
    check_training_arguments(TrainingArguments(output_dir=str(tmp_path / "new" / "run"), report_to=[], use_cpu=True))


def test_what_the_libraries_refuse_while_setting_up_is_one_config_error_line():
    """transformers', TRL's and torch's refusals (their exception classes for bad settings) become a ConfigError with
    their message's first line; mtk's own errors and other exceptions pass through unchanged."""
    from mtk.errors import DataError, library_refusals

    for raised in (
        ValueError("lr_scheduler_type reduce_lr_on_plateau requires an eval strategy\nmore detail"),
        ImportError("You need to install `galore_torch` in order to use GaLore optimizers."),
        FileExistsError(17, "File exists"),
    ):
        with pytest.raises(ConfigError) as refused, library_refusals():
            raise raised
        assert "\n" not in str(refused.value) and str(refused.value) == str(raised).splitlines()[0]
        assert refused.value.__cause__ is raised
    with pytest.raises(ConfigError, match=r"not used by the HfArgumentParser: \['--foo'\]; check the spelling"):
        with library_refusals():
            raise ValueError("Some specified arguments are not used by the HfArgumentParser: ['--foo']")
    for passed in (DataError("data"), RuntimeError("a bug")):
        with pytest.raises(type(passed)) as kept, library_refusals():
            raise passed
        assert kept.value is passed


def test_fields_mtk_honours_pass(tmp_path):
    check_training_arguments(_args(tmp_path, max_grad_norm=0.5, gradient_accumulation_steps=4, weight_decay=0.1))


def test_fsdp_comes_from_parallelism_config_not_the_fsdp_field(tmp_path):
    """``parallelism_config`` is mtk's to read (tp_size -> TP, dp_shard_size -> FSDP2); ``fsdp=`` (accelerate's FSDP
    plugin over every process) is refused naming it."""
    from accelerate.parallelism_config import ParallelismConfig

    check_training_arguments(_args(tmp_path, parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2)))
    with pytest.raises(ConfigError, match=r"^TrainingArguments\.fsdp=\S+: mtk shards its TP model with FSDP2"):
        check_training_arguments(_args(tmp_path, fsdp="full_shard"))


def test_gradient_checkpointing_runs_as_mtks_recompute_and_the_launchers_wins(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True)
    settings, line = recompute_settings(args, RunSettings())
    assert settings.recompute_granularity == "full" and settings.recompute_method == "uniform"
    assert not args.gradient_checkpointing and "mtk's full recompute" in line
    args = _args(tmp_path, gradient_checkpointing=True)
    launcher = RunSettings(recompute_activations=True, recompute_granularity="selective")
    settings, line = recompute_settings(args, launcher)
    assert settings == launcher and "replaced by the accelerate config's recompute" in line
    assert recompute_settings(_args(tmp_path), RunSettings()) == (RunSettings(), None)
    # the checkpointing kwargs mtk's recompute does not take are named (TRL's selective, offload); its
    # non-reentrant checkpoint is what use_reentrant=False asks for
    args = _args(tmp_path, gradient_checkpointing=True)
    args.gradient_checkpointing_kwargs = {"selective": True, "use_reentrant": False, "offload": True}
    _, line = recompute_settings(args, RunSettings())
    assert line.endswith("; gradient_checkpointing_kwargs offload, selective not used"), line
    args = _args(tmp_path, gradient_checkpointing=True)
    args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    assert recompute_settings(args, RunSettings())[1].endswith("transformers' checkpointing is not used")


def test_jit_checkpointing_is_what_mtk_does_on_a_signal_and_is_reported(tmp_path):
    args = _args(tmp_path, enable_jit_checkpoint=True)
    check_training_arguments(args)  # (refused before: mtk saves on SIGTERM in its trainers too)
    line = jit_checkpoint_report(args)
    assert not args.enable_jit_checkpoint and "transformers' just-in-time handler is not installed" in line
    assert jit_checkpoint_report(_args(tmp_path)) is None


def test_a_batch_size_search_and_smoothing_at_pp_are_one_line():
    from types import SimpleNamespace

    from mtk.trainers.base import _refuse_for_the_layout

    searching = SimpleNamespace(auto_find_batch_size=True)
    _refuse_for_the_layout(searching, SimpleNamespace(tp_size=1, pp_size=1, cp_size=1, ep_size=1))
    layout = SimpleNamespace(tp_size=2, pp_size=2, cp_size=1, ep_size=1)
    _refuse_for_the_layout(SimpleNamespace(auto_find_batch_size=False), layout)
    with pytest.raises(ConfigError, match=r"^TrainingArguments\.auto_find_batch_size=True at tp 2, pp 2: "):
        _refuse_for_the_layout(searching, layout)
    smoothing = SimpleNamespace(label_smoothing_factor=0.1)
    _refuse_for_the_layout(smoothing, SimpleNamespace(tp_size=2, pp_size=1, cp_size=2, ep_size=1))  # (exact there)
    with pytest.raises(ConfigError, match=r"^TrainingArguments\.label_smoothing_factor=0\.1 with pp > 1: "):
        _refuse_for_the_layout(smoothing, layout)


def test_a_different_launcher_clipping_is_reported_as_unused(tmp_path):
    assert clipping_report(_args(tmp_path, max_grad_norm=1.0), RunSettings(gradient_clipping=1.0)) is None
    line = clipping_report(_args(tmp_path, max_grad_norm=0.5), RunSettings(gradient_clipping=1.0))
    assert "max_grad_norm=0.5" in line and "megatron_lm_gradient_clipping=1.0 is not used" in line


@pytest.mark.parametrize("name", sorted(mtk.trainers.NOT_PROVIDED))
def test_trls_other_trainers_are_refused_naming_why(name):
    with pytest.raises(ConfigError, match=f"mtk.trainers.{name} is not provided: "):
        getattr(mtk.trainers, name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_model("tiny-llama", dtype=torch.bfloat16).save_pretrained(directory)  # saved in bf16
    return directory


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"quantization_config": {"load_in_4bit": True}}, "model_init_kwargs['quantization_config'] "),
        ({"device_map": "auto"}, "model_init_kwargs['device_map']='auto' "),
        ({"revision": "main"}, "model_init_kwargs['revision']='main' "),
        ({"dtype": "int8"}, "model_init_kwargs['dtype']='int8': "),
        ({"use_kernels": True}, "model_init_kwargs['use_kernels'] "),
    ],
)
def test_a_model_init_kwarg_mtk_cannot_honour_is_refused_naming_it(model_dir, kwargs, named):
    with pytest.raises(ConfigError, match="^" + re.escape(named)) as refused:
        model_init(model_dir, kwargs)
    assert "\n" not in str(refused.value)


def test_model_init_kwargs_as_trl_and_from_pretrained_read_them(model_dir):
    assert model_init(model_dir, {}).dtype == torch.float32  # TRL's default, whatever the checkpoint's
    assert model_init(model_dir, {"dtype": "auto", "trust_remote_code": True}).dtype == torch.bfloat16  # the saved
    options = {"dtype": torch.float16, "use_cache": False, "device_map": None, "attn_implementation": "eager"}
    init = model_init(model_dir, options)
    assert (init.dtype, init.config.use_cache, init.attn_implementation) == (torch.float16, False, "eager")


def test_a_hub_id_is_one_line_and_nothing_is_downloaded():
    with pytest.raises(ConfigError, match=r"^model='org/model' is not a local directory: .* download nothing"):
        local_directory("org/model")


def test_dpo_ref_model_given_as_a_directory_is_taken_out_of_what_trl_sees(model_dir):
    args, kwargs = ["policy"], {"ref_model": str(model_dir)}
    assert take_reference_directory(args, kwargs, None) == model_dir and kwargs["ref_model"] is None
    args = ["policy", str(model_dir)]
    assert take_reference_directory(args, {}, None) == model_dir and args[1] is None
    with pytest.raises(ConfigError, match=r"^DPOTrainer\(ref_model=<a directory>, peft_config=...\)"):
        take_reference_directory([], {"ref_model": str(model_dir)}, object())


def test_trl_rows_of_one_token_and_dpo_rows_without_a_rejected_answer_are_one_line(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from mtk.errors import DataError
    from mtk.trainers.trl import _check_preference_columns

    with pytest.raises(ConfigError, match=r"SFTConfig.max_length=1: must be at least 2 tokens"):
        check_training_arguments(SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=1))
    pairs = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    _check_preference_columns(pairs, "train_dataset")
    with pytest.raises(DataError, match="train_dataset has no 'rejected' column \\(it has prompt, chosen\\)"):
        _check_preference_columns(pairs.remove_columns("rejected"), "train_dataset")
    with pytest.raises(DataError, match="eval_dataset\\['held'\\] has no 'chosen' column"):
        _check_preference_columns({"held": pairs.remove_columns("chosen")}, "eval_dataset")


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"messages": []}, "row 0: 'messages' must be a non-empty list"),
        ({"messages": "hello"}, "row 0: 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": 5}]}, "row 0: every message needs a string 'role'"),
        ({"messages": [{"content": "x"}]}, "row 0: every message needs a string 'role'"),
        ({"messages": [{"role": "assistant", "content": None}]}, "row 0: every message .* null beside 'tool_calls'"),
        ({"prompt": [], "completion": [{"role": "assistant", "content": "x"}]}, "row 0: 'prompt' must be text or a"),
    ],
)
def test_malformed_conversations_are_one_line_naming_the_row(row, said):
    """SFT's and DPO's conversational rows, checked before TRL reads them (its own failures were an IndexError, a
    KeyError and a template's TypeError)."""
    from datasets import Dataset

    from mtk.errors import DataError
    from mtk.trainers.trl import _check_conversations

    with pytest.raises(DataError, match=f"train_dataset {said}"):
        _check_conversations(Dataset.from_list([row]), "train_dataset", ("messages", "prompt", "completion"))


def test_tool_calls_lists_of_parts_and_plain_text_are_valid_rows():
    """Not refused: an assistant turn that only calls a tool (content null), content as a list of parts, TRL's
    standard prompt/completion strings, and a dict of evaluation sets."""
    from datasets import Dataset

    from mtk.trainers.trl import _check_conversations

    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    tool = {"role": "tool", "content": "42", "tool_calls": None}
    parts = Dataset.from_list([{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}])
    sets = {"calls": Dataset.from_list([{"messages": [call, tool]}]), "parts": parts}
    sets["plain"] = Dataset.from_list([{"prompt": "2 + 2 =", "completion": " 4"}])
    _check_conversations(sets, "eval_dataset", ("messages", "prompt", "completion"))


def test_preference_rows_whose_prompts_differ_are_one_line():
    """DPO rows without a 'prompt' take it from what 'chosen' and 'rejected' start with alike: rows starting with
    different messages leave none (TRL's IndexError), one line; rows sharing their first message pass."""
    from datasets import Dataset

    from mtk.errors import DataError
    from mtk.trainers.trl import _check_implicit_prompts

    def pair(first: str, second: str) -> dict:
        answer = [{"role": "assistant", "content": "good"}]
        chosen = [{"role": "user", "content": first}, *answer]
        return {"chosen": chosen, "rejected": [{"role": "user", "content": second}, *answer]}

    _check_implicit_prompts(Dataset.from_list([pair("a", "a")]), "train_dataset")
    with pytest.raises(DataError, match="train_dataset row 1: 'chosen' and 'rejected' start with different messages"):
        _check_implicit_prompts(Dataset.from_list([pair("a", "a"), pair("a", "b")]), "train_dataset")


def test_zero3_named_by_the_launchers_yaml_points_to_the_trainers_own_argument():
    """ZeRO-3 from accelerate's YAML on the Trainer path (its model built before the Trainer knows of ZeRO-3): one
    line naming TrainingArguments.deepspeed, the tested way."""
    from types import SimpleNamespace

    from mtk.errors import ConfigError
    from mtk.trainers.deepspeed_setup import fill_launchers_deepspeed_config

    plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(config={"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"ZeRO-3 named by accelerate's YAML .* \(TrainingArguments.deepspeed"):
        fill_launchers_deepspeed_config(SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("word", ["True", "true", "False"])
def test_resume_from_checkpoint_a_word_that_names_a_folder_says_it_was_read_as_that_folder(
    tmp_path, monkeypatch, word
):
    """``--resume_from_checkpoint True`` is the newest checkpoint, unless a folder ``True`` exists where the run
    starts: it is then that folder (transformers reads the text as a path); one that is no checkpoint is one line
    saying which folder was read, so the word's meaning is not a mystery."""
    from mtk.checkpoint.lock import unlock_output_dir
    from mtk.errors import CheckpointError
    from mtk.trainers.checkpoints import claim_output_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / word).mkdir()
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"read as the folder {re.escape(str(tmp_path / word))}, which exists"):
        claim_output_dir(str(out), word, main_process=True)
    unlock_output_dir(str(out))
    assert claim_output_dir(str(out), None, main_process=True) is None  # (no earlier checkpoint: a fresh run)
    unlock_output_dir(str(out))


def test_an_incomplete_checkpoint_n_is_called_incomplete_on_resume(tmp_path):
    """A checkpoint-N missing its metadata.json or its listed trainer_state.json was named a checkpoint of
    transformers' own Trainer (to start from weights it does not hold) or of a training script: it is incomplete."""
    from mtk.checkpoint.lock import unlock_output_dir
    from mtk.checkpoint.meta import CheckpointMeta
    from mtk.errors import CheckpointError
    from mtk.parallel.layout import Layout
    from mtk.trainers.checkpoints import claim_output_dir

    out = tmp_path / "out"
    no_metadata, no_state, transformers_own = out / "checkpoint-2", out / "checkpoint-4", out / "checkpoint-6"
    zero3_own = out / "checkpoint-8"  # transformers' Trainer under ZeRO-3: the weights in DeepSpeed's folder only
    for folder in (no_metadata, transformers_own, zero3_own):
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
    (transformers_own / "model.safetensors").write_bytes(b"")
    (zero3_own / "global_step8").mkdir()
    no_state.mkdir()
    meta = CheckpointMeta(step=4, topology=Layout(world_size=1, tp_size=1, pp_size=1))
    meta.files = {"trainer_state.json": {"bytes": 2, "xxh3_128": "0" * 32}}
    (no_state / "metadata.json").write_text(meta.to_json())
    cases = [
        (no_metadata, "checkpoint-2 is incomplete: it has trainer_state.json but no metadata.json (an interrupted"),
        (no_state, "checkpoint-4 is incomplete: the trainer_state.json its metadata.json lists is missing; resume"),
        (transformers_own, "checkpoint-6 is a checkpoint of transformers' own Trainer (no mtk metadata.json)"),
        (zero3_own, "checkpoint-8 is a checkpoint of transformers' own Trainer (no mtk metadata.json)"),
    ]
    for checkpoint, said in cases:
        with pytest.raises(CheckpointError, match=re.escape(said)):
            claim_output_dir(str(out), str(checkpoint), main_process=True)
        unlock_output_dir(str(out))


def test_dpo_choices_trl_does_not_know_are_one_line_before_training():
    """``dpo.py --loss_type bogus`` or ``--f_divergence_type bogus`` ended in TRL's ValueError traceback on every
    rank at the first step: each is checked against the values its field documents."""
    import trl

    from mtk.trainers.trl import _check_documented_choices

    config = trl.DPOConfig(output_dir="unused", loss_type=["sigmoid", "sft"], use_cpu=True, bf16=False)
    _check_documented_choices(config)
    config.loss_type = ["sigmoid", "bogus"]
    with pytest.raises(ConfigError, match=r"loss_type 'bogus' is not a loss TRL knows; use one of \['sigmoid'"):
        _check_documented_choices(config)
    config.loss_type = ["sigmoid"]
    config.f_divergence_type = "js_divergence"
    _check_documented_choices(config)
    config.f_divergence_type = "bogus"
    allowed = r"use one of \['reverse_kl', 'forward_kl', 'js_divergence', 'alpha_divergence'\]$"
    with pytest.raises(ConfigError, match=r"f_divergence_type 'bogus' is not an f-divergence TRL knows; " + allowed):
        _check_documented_choices(config)


def test_sft_rows_and_template_paths_trl_cannot_read_are_one_line_before_it_reads_them(tmp_path):
    """A ``dataset_text_field`` the rows lack (TRL: ``KeyError``), ``skip_prepare_dataset`` on rows that are not
    tokenized (TRL: a ``ValueError`` once training began), a ``chat_template_path`` that is neither a file nor a
    folder (TRL read it as a Hub repository: ``OSError``)."""
    import trl
    from datasets import Dataset

    from mtk.errors import DataError
    from mtk.trainers.trl import _check_sft_columns, _check_template_path

    config = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, dataset_text_field="body")
    text = Dataset.from_dict({"text": ["a b", "c d"]})
    with pytest.raises(DataError, match=r"train_dataset has no 'body' column \(SFTConfig.dataset_text_field\)"):
        _check_sft_columns(text, "train_dataset", config, formatted=False)
    _check_sft_columns(text, "train_dataset", config, formatted=True)  # a formatting_func makes its own text
    _check_sft_columns(Dataset.from_dict({"body": ["a"]}), "train_dataset", config, formatted=False)
    _check_sft_columns(Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}), "x", config, formatted=False)
    config.dataset_kwargs = [1, 2]
    with pytest.raises(ConfigError, match=r"SFTConfig.dataset_kwargs must be a JSON mapping"):
        _check_sft_columns(text, "train_dataset", config, formatted=False)
    config.dataset_kwargs = {"skip_prepare_dataset": True}
    with pytest.raises(DataError, match=r"skip_prepare_dataset=True needs tokenized rows \('input_ids'\)"):
        _check_sft_columns(Dataset.from_dict({"body": ["a"]}), "train_dataset", config, formatted=False)
    _check_sft_columns(Dataset.from_dict({"input_ids": [[1, 2]]}), "train_dataset", config, formatted=False)

    for missing in (str(tmp_path / "nope.jinja"), "./templates", str(tmp_path / "a" / "b")):
        config.chat_template_path = missing
        with pytest.raises(ConfigError, match="chat_template_path=.*: no such file or folder"):
            _check_template_path(config)
    for present_or_repository in (str(tmp_path), "HuggingFaceTB/SmolLM2-135M-Instruct"):
        config.chat_template_path = present_or_repository
        _check_template_path(config)


def test_a_deepspeed_json_that_disagrees_with_the_arguments_is_one_line_at_set_up():
    """transformers lists the disagreements as it fills the JSON's "auto"s and raised them only when training began
    (a ValueError traceback on every rank); the global batch is left to mtk's own check (it counts DP replicas),
    and only it: a disagreeing micro-batch (its line names per_device_train_batch_size) ran the arguments' one."""
    from types import SimpleNamespace

    from mtk.trainers.deepspeed_setup import refuse_deepspeed_disagreements

    listed = [
        "- ds train_batch_size=16 vs hf train_batch_size=8",
        "- ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=1",
        "- ds gradient_clipping=0.01 vs hf max_grad_norm=1.0",
        "- ds train_micro_batch_size_per_gpu=2 vs hf per_device_train_batch_size=4",  # (not the global batch's line)
    ]
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(mismatches=listed))
    said = (
        r"the DeepSpeed JSON disagrees with TrainingArguments \(ds gradient_accumulation_steps=4 vs hf "
        r"gradient_accumulation_steps=1; ds gradient_clipping=0.01 vs hf max_grad_norm=1.0; "
        r"ds train_micro_batch_size_per_gpu=2 vs hf per_device_train_batch_size=4\): give the same values"
    )
    with pytest.raises(ConfigError, match=said):
        refuse_deepspeed_disagreements(args)
    global_batch = listed[:1]  # counted over every process by transformers, over the DP replicas by mtk
    refuse_deepspeed_disagreements(SimpleNamespace(hf_deepspeed_config=SimpleNamespace(mismatches=global_batch)))
    assert global_batch == []  # (transformers raised it when training started: a valid explicit batch refused)
    refuse_deepspeed_disagreements(SimpleNamespace(hf_deepspeed_config=None))


def test_the_trainers_deepspeed_json_is_checked_as_the_launchers_are(tmp_path):
    """``TrainingArguments.deepspeed`` (a file or a dict): a ZeRO stage that is not a number 0-3 (``true`` trained
    as ZeRO-1 without a word), a key DeepSpeed does not read; a section nothing acts on is said."""
    import json
    from types import SimpleNamespace

    from mtk.trainers.deepspeed_setup import check_deepspeed_json

    with pytest.raises(ConfigError, match=r'TrainingArguments.deepspeed: "zero_optimization.stage" is true; write'):
        check_deepspeed_json(SimpleNamespace(deepspeed={"zero_optimization": {"stage": True}}))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "zero_optimisation": {"stage": 3}}))
    with pytest.raises(ConfigError, match="zero_optimisation"):
        check_deepspeed_json(SimpleNamespace(deepspeed=str(path)))
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "activation_checkpointing": {"profile": True}}))
    said = check_deepspeed_json(SimpleNamespace(deepspeed=str(path)))
    assert len(said) == 1 and '"activation_checkpointing" configures deepspeed.checkpointing' in said[0]


def test_a_metric_for_best_model_no_evaluation_returns_is_one_line():
    """transformers' ``KeyError`` after the first evaluation (a traceback on every rank), as its own first sentence;
    other ``KeyError``s stay bugs."""
    from mtk.trainers.signals import _metric_refusals

    said = "The `metric_for_best_model` training argument is set to 'eval_nonsense', which is not found"
    with pytest.raises(ConfigError, match=re.escape(said)) as err, _metric_refusals():
        raise KeyError(f"{said} in the evaluation metrics. Please ensure that the `compute_metrics` function ...")
    assert "Please" not in str(err.value)
    with pytest.raises(KeyError), _metric_refusals():
        raise KeyError("input_ids")


def test_dpo_with_peft_config_at_pp_above_1_is_one_line():
    """TRL's reference pass calls the adapters' model itself with them disabled, outside mtk's pipeline: every
    worker failed in TRL's forward ('OnOtherStage' has no weight). Refused once the trainer is built."""
    from types import SimpleNamespace

    from mtk.trainers.trl import _check_dpo_pipeline

    trainer = SimpleNamespace(args=SimpleNamespace(disable_dropout=True), aux_loss_enabled=False, _peft_config=None)
    _check_dpo_pipeline(trainer)
    trainer._peft_config = object()
    with pytest.raises(ConfigError, match=r"DPOTrainer with peft_config at pp > 1: .* use pp = 1 \(TP and DP work\)"):
        _check_dpo_pipeline(trainer)


def test_what_sft_at_pp_above_1_cannot_compute_as_trl_does_is_one_line():
    """The pipeline backpropagates the model's own token-mean loss: another TRL loss type, a padding-free row, and an
    MoE router term (TRL divides it by the accumulation steps; the pipeline scaled it dp x accumulation times
    larger, a silently different router gradient) are each one line."""
    from types import SimpleNamespace

    from mtk.trainers.trl import _check_sft_pipeline

    fine = {"args": SimpleNamespace(loss_type="nll"), "padding_free": False, "aux_loss_enabled": False}
    _check_sft_pipeline(SimpleNamespace(**fine))
    for change, said in [
        ({"args": SimpleNamespace(loss_type="dft")}, "SFTConfig.loss_type='dft' with pp > 1"),
        ({"padding_free": True}, "SFTConfig packing (BFD) or padding_free with pp > 1"),
        ({"aux_loss_enabled": True}, "a MoE router loss (output_router_logits, router_aux_loss_coef) with SFTTrainer"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            _check_sft_pipeline(SimpleNamespace(**{**fine, **change}))


def test_dpo_at_pp_above_1_with_attention_dropout_left_on_is_one_line():
    """TRL's disable_dropout zeroes nn.Dropout modules; Llama's attention draws with its attention_dropout number,
    so the pipeline's two passes (log-probabilities, then the gradient) drew different masks: wrong weights."""
    from types import SimpleNamespace

    from mtk.models import build_model
    from mtk.trainers.trl import _check_dpo_pipeline

    model = build_model("tiny-llama", seed=0)
    trainer = SimpleNamespace(args=SimpleNamespace(disable_dropout=True), aux_loss_enabled=False, _peft_config=None)
    trainer.model = model
    _check_dpo_pipeline(trainer)  # (attention_dropout 0)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ConfigError, match=r"leaves LlamaAttention\.attention_dropout=0\.1 on .* or use pp = 1$"):
        _check_dpo_pipeline(trainer)


def test_a_resume_from_a_checkpoint_past_max_steps_is_one_line(tmp_path):
    """transformers' loop checks max_steps only after a step: a resume from checkpoint-4 with max_steps 3 trained a
    fifth step, wrote checkpoint-5, and the script's save_model replaced the final model with it, exit 0."""
    from mtk.trainers.base import _refuse_a_checkpoint_past_max_steps

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    with pytest.raises(ConfigError, match="checkpoint-4 is at step 4, past max_steps 3: nothing is left to train"):
        _refuse_a_checkpoint_past_max_steps(str(checkpoint), 3)
    _refuse_a_checkpoint_past_max_steps(str(checkpoint), 4)  # (a requeued job that finished: trains nothing)
    _refuse_a_checkpoint_past_max_steps(str(checkpoint), 6)
    _refuse_a_checkpoint_past_max_steps(str(checkpoint), -1)  # (num_train_epochs decides: its loop ends in time)
    _refuse_a_checkpoint_past_max_steps(None, 3)


def test_a_users_trainer_script_with_a_deepspeed_json_and_no_launcher_is_one_line(tmp_path):
    """``python my_trainer.py`` with ``TrainingArguments(deepspeed=...)`` on a machine without an accelerator: a
    traceback from mtk's set-up of the processes, where sft.py says the same in one line."""
    import os
    import subprocess
    import sys

    (tmp_path / "zero2.json").write_text('{"zero_optimization": {"stage": 2}}')
    script = tmp_path / "my_trainer.py"
    script.write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments\n"
        "from mtk.trainers import Trainer\n"
        "config = LlamaConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,\n"
        "                     intermediate_size=32, num_hidden_layers=1)\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, report_to=[],\n"
        f"                         deepspeed={str(tmp_path / 'zero2.json')!r})\n"
        "Trainer(model=LlamaForCausalLM(config), args=args)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("my_trainer.py: error: Default process group has not been initialized"), line
    assert "a process group was asked for without a launcher" in line


def test_a_resumed_trainer_at_its_last_step_trains_nothing_and_past_it_is_one_line(capsys):
    """transformers' loop checks max_steps only after a step: resumed at max_steps it trained one more and the
    script's save replaced the final model. At the last step no epoch runs; past it (max_steps from the epochs,
    which train() cannot check before the loop resolves them) is one line."""
    from types import SimpleNamespace

    from mtk.trainers.checkpoints import TrainerCheckpointing

    class Loop:
        def _init_training_state(self, max_steps, steps_per_epoch, epochs, checkpoint, trial):
            return 1, 2  # (transformers': epochs trained, batches to skip)

    class Resumed(TrainerCheckpointing, Loop):
        def __init__(self, step: int) -> None:
            self.state = SimpleNamespace(global_step=step)
            self.args = SimpleNamespace(num_train_epochs=2.0)
            self.accelerator = SimpleNamespace(is_main_process=True)

    assert Resumed(6)._init_training_state(8, 4, 2, "run/checkpoint-6", None) == (1, 2)
    assert Resumed(8)._init_training_state(8, 4, 2, None, None) == (1, 2)  # (a fresh run)
    assert Resumed(8)._init_training_state(8, 4, 2, "run/checkpoint-8", None) == (2, 0)
    assert "mtk: run/checkpoint-8 is at step 8, max_steps 8: nothing is left to train" in capsys.readouterr().out
    past = r"checkpoint-9 is at step 9, past this run's 8 steps \(num_train_epochs 2\)"
    with pytest.raises(ConfigError, match=past):
        Resumed(9)._init_training_state(8, 4, 2, "run/checkpoint-9", None)


def test_num_train_epochs_alone_replaces_an_example_scripts_default_step_count(tmp_path):
    """sft.py and dpo.py default max_steps to a short run; transformers lets a positive max_steps win, so
    ``--num_train_epochs 10`` trained 40 steps (sft.py: 4.4 epochs), without a word."""
    from types import SimpleNamespace

    from trl import SFTConfig, TrlParser

    from mtk.trainers.arguments import epochs_over_a_default_step_count

    parser = TrlParser((SFTConfig,))
    parser.set_defaults(max_steps=40)

    def steps(argv: list[str]) -> int:
        config = SimpleNamespace(max_steps=40)
        epochs_over_a_default_step_count(parser, config, argv)
        return config.max_steps

    yaml_epochs = tmp_path / "epochs.yaml"
    yaml_epochs.write_text("num_train_epochs: 10\n")
    yaml_both = tmp_path / "both.yaml"
    yaml_both.write_text("num_train_epochs: 10\nmax_steps: 7\n")
    assert steps([]) == 40
    assert steps(["--num_train_epochs", "10"]) == -1
    assert steps(["--num_train_epochs=10"]) == -1
    assert steps(["--num_train_epochs", "10", "--max_steps", "40"]) == 40  # (given: it wins, as transformers has it)
    assert steps(["--config", str(yaml_epochs)]) == -1
    assert steps(["--config", str(yaml_both)]) == 40
    assert steps(["--config", str(yaml_epochs), "--max_steps", "40"]) == 40
    assert steps(["--num-train-epochs", "10"]) == -1  # (the parser's other spellings)
    assert steps(["--num_train_epochs", "3", "--max-steps", "100"]) == 40
    assert steps(["--num_train_ep", "3"]) == -1


def test_a_deepspeed_value_transformers_refuses_once_training_starts_is_one_line(monkeypatch):
    """A DeepSpeed JSON's scheduler ``warmup_num_steps`` 3 beside ``warmup_steps`` 1: transformers checks the
    step-count fields in ``deepspeed_init``, from ``train()``, and its ValueError was a traceback on every rank; so
    was an evaluation before training under ZeRO-2."""
    from types import SimpleNamespace

    from transformers.integrations import deepspeed as hf_deepspeed

    from mtk.trainers.deepspeed_setup import deepspeed_init_in_one_line

    json_config = {"optimizer": {"type": "AdamW"}, "scheduler": {"params": {"total_num_steps": "auto"}}}
    plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(config=json_config))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))

    def refuses(*args, **kwargs):
        raise ValueError(
            "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
            "- ds scheduler.params.warmup_num_steps=3 vs hf warmup_steps=1\n"
            "The easiest method is to set these DeepSpeed config values to 'auto'."
        )

    monkeypatch.setattr(hf_deepspeed, "deepspeed_init", refuses)
    said = r"\(ds scheduler.params.warmup_num_steps=3 vs hf warmup_steps=1\): give the same values"
    with pytest.raises(ConfigError, match=said):
        deepspeed_init_in_one_line(trainer, num_training_steps=4)

    def zero2(*args, **kwargs):
        raise ValueError("ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your config")

    monkeypatch.setattr(hf_deepspeed, "deepspeed_init", zero2)
    with pytest.raises(ConfigError, match=r"evaluate\(\) or predict\(\) before train\(\) under DeepSpeed"):
        deepspeed_init_in_one_line(trainer, num_training_steps=0, inference=True)
    assert trainer._deepspeed_for_inference  # (the set-up changed the JSON before it refused: train() is refused)
    monkeypatch.setattr(hf_deepspeed, "deepspeed_init", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # (anything else keeps its traceback)
        deepspeed_init_in_one_line(trainer, num_training_steps=4)


def test_a_null_in_the_config_yaml_for_a_setting_that_takes_a_value_is_one_line(tmp_path):
    """``max_steps: null`` in sft.py's ``--config``: the arguments' own checks compared None with a number (a
    TypeError traceback); a field whose type takes None takes null (SFTConfig's ``max_length: null`` is no
    truncation), and a flag given beside it wins."""
    from trl import SFTConfig, TrlParser

    from mtk.trainers.arguments import refuse_null_settings

    parser = TrlParser((SFTConfig,))
    config = tmp_path / "c.yaml"
    config.write_text("num_train_epochs: 1\nmax_steps: null\neval_steps: null\n")
    with pytest.raises(ConfigError, match="--config sets max_steps to null, which takes a value"):
        refuse_null_settings(parser, ["--config", str(config)])
    config.write_text("eval_steps: null\nmax_length: null\npad_to_multiple_of: null\n")  # (None means something)
    refuse_null_settings(parser, ["--config", str(config)])
    refuse_null_settings(parser, [])
    config.write_text("max_steps: null\n")
    refuse_null_settings(parser, ["--config", str(config), "--max-steps", "5"])  # (the command line wins)


def test_a_broken_config_yaml_and_a_dangling_config_flag_are_one_line(tmp_path):
    """A YAML syntax error in sft.py's ``--config`` was yaml's traceback from mtk's reading of it."""
    from mtk.trainers.arguments import _config_file_values

    broken = tmp_path / "c.yaml"
    broken.write_text("max_steps: [3\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not valid YAML \(line 2, column 1\)"):
        _config_file_values(["--config", str(broken)])
    with pytest.raises(ConfigError, match="--config needs the path of a YAML file after it"):
        _config_file_values(["--max_steps", "3", "--config"])


def test_train_a_second_time_under_deepspeed_is_one_line():
    """A second train() under DeepSpeed died in accelerate's register_for_checkpointing on every rank."""
    from types import SimpleNamespace

    from mtk.trainers.base import ParallelTrainerMixin

    trained = SimpleNamespace(deepspeed=object(), _deepspeed_for_inference=False)
    with pytest.raises(ConfigError, match=r"train\(\) a second time under DeepSpeed"):
        ParallelTrainerMixin.train(trained)  # type: ignore[arg-type]
    evaluated = SimpleNamespace(deepspeed=object(), _deepspeed_for_inference=True)
    with pytest.raises(ConfigError, match=r"train\(\) after evaluate\(\) or predict\(\) under DeepSpeed"):
        ParallelTrainerMixin.train(evaluated)  # type: ignore[arg-type]
