"""Bad input, as a new user types it, gets one line (``<prog>: error: ...``: what is wrong and what is
allowed) and exit status 2: never a traceback, never a file of the user's removed.

Every case runs the real entry point (``main`` of an example script, ``mtk``'s ``main``) in this
process, because each fails before any process group or model exists; the failures that need a
launch (layouts, damaged shards on one rank, resume) are in tests/e2e and tests/distributed.
"""

import importlib.util
import json
import os
import re
import shutil
from functools import partial
from pathlib import Path

import pytest

from mtk.checkpoint.sharded import save_checkpoint
from mtk.cli.main import main as mtk_main
from mtk.convert import parallelize
from mtk.errors import DataError
from mtk.models import ModelSpecError, build_model, causal_lm_refusal, resolve_config
from mtk.parallel import ParallelState
from mtk.training.entry import run_main
from mtk.verify.sweep import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = {name: _example(name) for name in ("finetune", "classify", "run", "generate")}

SCRIPT_CASES = [
    ("finetune", ["--batch_size", "0"], "argument --batch_size: must be a positive integer, got 0"),
    ("finetune", ["--output_dir", ""], "argument --output_dir: is empty; give a directory"),
    ("finetune", ["--output_dir", "out\udcff"], "argument --output_dir: 'out\\udcff' holds bytes that are not UTF-8"),
    # a name the file system cannot take, wherever the script first touches it (Path.is_file raises, not False)
    ("finetune", ["--data", "a" * 300 + ".jsonl"], "characters): File name too long (a name may take at most"),
    ("finetune", ["--model", "m" * 300], "characters): File name too long"),
    ("finetune", ["--resume", "r" * 300], "characters): File name too long"),
    ("classify", ["--data", "a" * 300 + ".csv"], "characters): File name too long"),
    ("classify", ["--output_dir", " "], "argument --output_dir: is empty; give a directory"),
    ("run", ["--deepspeed_config", "x.json", "--output_dir", ""], "argument --output_dir: is empty; give a directory"),
    ("finetune", ["--batch_size", "two"], "argument --batch_size: 'two' is not an integer"),
    ("finetune", ["--grad_accum", "0"], "argument --grad_accum: must be a positive integer, got 0"),
    ("finetune", ["--seq_len", "0"], "argument --seq_len: must be a positive integer, got 0"),
    ("finetune", ["--max_steps", "0"], "argument --max_steps: must be a positive integer, got 0"),
    ("finetune", ["--max_steps", "-3"], "argument --max_steps: must be a positive integer, got -3"),
    ("finetune", ["--save_every", "-1"], "argument --save_every: must be 0 or more, got -1"),
    ("finetune", ["--warmup_steps", "-1"], "argument --warmup_steps: must be 0 or more, got -1"),
    ("finetune", ["--lr", "nan"], "argument --lr: must be a finite fp32 number, got nan"),
    ("finetune", ["--lr", "inf"], "argument --lr: must be a finite fp32 number, got inf"),
    ("finetune", ["--lr", "1e39"], "argument --lr: must be a finite fp32 number, got 1e39"),
    ("finetune", ["--lr", "0"], "argument --lr: must be greater than 0, got 0"),
    ("finetune", ["--lr", "fast"], "argument --lr: 'fast' is not a number"),
    ("finetune", ["--max_grad_norm", "-1"], "argument --max_grad_norm: must be greater than 0, got -1"),
    (
        "finetune",
        ["--max_grad_norm", "nan"],
        "argument --max_grad_norm: must be a finite fp32 number, got nan",
    ),
    ("finetune", ["--pipeline_schedule", "gpipe"], "argument --pipeline_schedule: invalid choice: 'gpipe'"),
    ("finetune", ["--pipeline_layers", "a,b"], "'a,b' is not a comma-separated list of layer counts"),
    ("finetune", ["--tp", "2"], "unrecognized arguments: --tp 2"),
    ("finetune", ["--seed"], "argument --seed: expected one argument"),
    ("finetune", ["--distributed_timeout_minutes", "0"], "argument --distributed_timeout_minutes: must be greater"),
    ("finetune", ["--loss_on", "none"], "argument --loss_on: invalid choice: 'none'"),
    ("finetune", ["--eval_every", "-1"], "argument --eval_every: must be 0 or more, got -1"),
    ("run", ["--deepspeed_config", "x.json", "--loss_on", "prompt"], "argument --loss_on: invalid choice: 'prompt'"),
    ("classify", ["--distributed_timeout_minutes", "inf"], "argument --distributed_timeout_minutes: must be a finite"),
    ("classify", ["--max_grad_norm", "0"], "argument --max_grad_norm: must be greater than 0, got 0"),
    ("classify", ["--save_every", "-1"], "argument --save_every: must be 0 or more, got -1"),
    ("classify", ["--max_length", "0"], "argument --max_length: must be a positive integer, got 0"),
    ("classify", ["--batch_size", "-1"], "argument --batch_size: must be a positive integer, got -1"),
    ("classify", ["--lr", "nan"], "argument --lr: must be a finite fp32 number, got nan"),
    ("classify", ["--max_steps", "0"], "argument --max_steps: must be a positive integer, got 0"),
    ("classify", ["--grad_accum", "0"], "argument --grad_accum: must be a positive integer, got 0"),
    ("run", [], "--deepspeed_config is required (e.g. ds_configs/zero2.json)"),
    ("run", ["--deepspeed_config", "x.json", "--tp", "0"], "argument --tp: must be a positive integer, got 0"),
    ("run", ["--deepspeed_config", "x.json", "--batch_size", "0"], "argument --batch_size: must be a positive"),
    ("run", ["--deepspeed_config", "x.json", "--grad_accum", "0"], "argument --grad_accum: must be a positive"),
    (
        "run",
        ["--deepspeed_config", "x.json", "--lr", "nan"],
        "argument --lr: must be a finite fp32 number, got nan",
    ),
    ("run", ["--deepspeed_config", "x.json", "--seq_len", "0"], "argument --seq_len: must be a positive integer"),
    ("run", ["--deepspeed_config", "x.json", "--save_every", "-2"], "argument --save_every: must be 0 or more"),
    ("run", ["--deepspeed_config", "x.json", "--max_steps", "0"], "argument --max_steps: must be a positive"),
    ("run", ["--deepspeed_config", "x.json", "--skip_nonfinite"], "unrecognized arguments: --skip_nonfinite"),
]


def _one_line(err: str, prog: str, message: str) -> None:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and message in lines[0], err


@pytest.mark.parametrize("script, argv, message", SCRIPT_CASES, ids=[f"{c[0]}{' '.join(c[1])}" for c in SCRIPT_CASES])
def test_script_options(script, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: EXAMPLES[script].main(argv), f"{script}.py")
    assert exit_.value.code == 2
    _one_line(capsys.readouterr().err, f"{script}.py", message)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    parallel = ParallelState.build()
    model = parallelize(build_model("tiny-llama"), parallel)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step_1", parallel, model, [], [], step=1)


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "step_1"))


def _metadata(text: str):
    def damage(directory: Path) -> None:
        (directory / "metadata.json").write_text(text)

    return damage


def _meta_field(**fields):
    def damage(directory: Path) -> None:
        meta = json.loads((directory / "metadata.json").read_text())
        meta.update(fields)
        (directory / "metadata.json").write_text(json.dumps(meta))

    return damage


def _crafted_specs(directory: Path) -> None:
    """Shard specs without their fields, the shard's checksum rewritten to match (what an attacker can do)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from mtk.checkpoint.integrity import file_checksum

    shard = directory / "model" / "tp00-pp00.safetensors"
    tensors = load_file(shard)
    with safe_open(str(shard), "pt") as handle:
        header = handle.metadata()
    save_file(tensors, shard, metadata={**header, "mtk_specs": json.dumps({name: {} for name in tensors})})
    record = {"bytes": shard.stat().st_size, "xxh3_128": file_checksum(shard)}
    _meta_field(
        files={**json.loads((directory / "metadata.json").read_text())["files"], "model/tp00-pp00.safetensors": record}
    )(directory)


CHECKPOINT_DAMAGE = [
    (_metadata(""), "is not valid mtk checkpoint metadata"),
    (_metadata('{"format": "mtk-checkpoint/2", "st'), "is not valid mtk checkpoint metadata"),
    (_metadata("[1, 2]"), "is not valid mtk checkpoint metadata (not a JSON object)"),
    # a flipped high bit: not UTF-8 (read_text's UnicodeDecodeError was a traceback in verify, export and resume)
    (lambda d: (d / "metadata.json").write_bytes(b'{"format": "mtk-\xeda"}'), "(not text: byte 16 is not utf-8)"),
    (_metadata('{"format": "mtk-checkpoint/9"}'), "has format 'mtk-checkpoint/9', expected"),
    (_meta_field(topology={"tp": 2}), "is not valid mtk checkpoint metadata"),
    # crafted metadata of the right format but the wrong types: one line, not a reader's traceback
    (_meta_field(files=["model/tp00-pp00.safetensors"]), "(files is a list, not a mapping of paths"),
    (_meta_field(files={"scheduler.pt": 5}), "(files['scheduler.pt'] is 5, not {'bytes'"),
    (_meta_field(files={"scheduler.pt": {"xxh3_128": "0"}}), "(files['scheduler.pt'] is {'xxh3_128': '0'}, not"),
    (_meta_field(step="four"), "(step 'four' is not a count of steps)"),
    (_meta_field(data=[1]), "(data is not a JSON object)"),
    (_meta_field(engine="bogus"), "(engine 'bogus' is not an engine mtk saves for (null or 'deepspeed'))"),
    (_meta_field(run_id=[1]), "(run_id [1] is not a run's label)"),
    (lambda d: (d / "metadata.json").unlink(), "is not a complete mtk checkpoint (no metadata.json"),
    (lambda d: (d / "rng" / "rank00000.pt").unlink(), "rng/rank00000.pt is missing"),
    (lambda d: (d / "model" / "tp00-pp00.safetensors").write_bytes(b"garbage"), "has 7 bytes, the checkpoint"),
    (lambda d: (d / "stray.bin").write_bytes(b"x"), "stray.bin is not part of the checkpoint"),
    (lambda d: os.mkfifo(d / "extra.pt"), "extra.pt is no regular file (a FIFO, socket or device)"),  # (was "ok")
]


@pytest.mark.parametrize("command", ["verify-checkpoint", "export"])
@pytest.mark.parametrize("damage, message", CHECKPOINT_DAMAGE)
def test_damaged_checkpoints(checkpoint, tmp_path, capsys, command, damage, message):
    directory = _copy(checkpoint, tmp_path)
    damage(directory)
    argv = [command, str(directory)] + ([str(tmp_path / "hf")] if command == "export" else [])
    assert mtk_main(argv) == 2
    _one_line(capsys.readouterr().err, f"mtk {command}", message)
    assert not list(tmp_path.glob("hf*")), "nothing written"


def test_a_crafted_generation_config_is_one_line_in_export(checkpoint, tmp_path, capsys):
    """A generation_config.json transformers cannot load, its checksum rewritten with it: the export's reload died
    in transformers' TypeError; it is checked as a model directory's is, before anything is written."""
    from mtk.checkpoint.integrity import file_checksum

    directory = _copy(checkpoint, tmp_path)
    config = directory / "generation_config.json"
    config.write_text("[]")
    files = json.loads((directory / "metadata.json").read_text())["files"]
    _meta_field(files={**files, config.name: {"bytes": 2, "xxh3_128": file_checksum(config)}})(directory)
    assert mtk_main(["verify-checkpoint", str(directory)]) == 0  # (its checksum is right)
    assert mtk_main(["export", str(directory), str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, "mtk export", "generation_config.json holds a JSON list, not an object")
    assert not list(tmp_path.glob("hf*")), "nothing written"


def test_crafted_shard_specs_are_one_line_in_export(checkpoint, tmp_path, capsys):
    """Checksums verify (they were rewritten with the file), but the specs export merges by are malformed."""
    directory = _copy(checkpoint, tmp_path)
    _crafted_specs(directory)
    assert mtk_main(["export", str(directory), str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, "mtk export", "has malformed mtk shard specs (KeyError: 'dim')")
    assert not list(tmp_path.glob("hf*")), "nothing written"


def test_cli_options(checkpoint, tmp_path, capsys):
    from transformers import BertConfig, T5Config

    T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16).save_pretrained(tmp_path / "t5")
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "bert"
    )
    (tmp_path / "a_file").write_text("mine")
    pickled = tmp_path / "pickled"  # a pickle under the safetensors name: transformers' SafetensorError traceback
    resolve_config("tiny-llama").save_pretrained(pickled)
    (pickled / "model.safetensors").write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    theirs = tmp_path / "out.incomplete"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    cases = [
        (["topology", "--world", "6", "--tp", "4"], "mtk topology", "not divisible by tp*pp"),
        (["topology", "--world", "x"], "mtk", "argument --world: 'x' is not an integer"),
        (["verify", "--model", "nope"], "mtk verify", "is neither a built-in config"),
        (["verify", "--model", str(pickled), "--tp", "1"], "mtk verify", "transformers cannot load its weights"),
        (["verify", "--model", "tiny-llama", "--tp", "0"], "mtk", "argument --tp: must be a positive integer, got 0"),
        (["verify", "--model", "tiny-llama", "--tolerance", "nan"], "mtk", "argument --tolerance: must be a finite"),
        (["verify", "--model", "tiny-llama", "--seq", "0"], "mtk", "argument --seq: must be a positive integer"),
        (["verify", "--model", "tiny-gpt2", "--seq", "600"], "mtk verify", "--seq 600 is longer than the model's 256"),
        (["verify", "--model", "tiny-llama", "--seq", "1"], "mtk verify", "--seq 1: a causal LM's row of one token"),
        (["bench", "--model", "tiny-gpt2", "--seq", "600"], "mtk bench", "--seq 600 is longer than the model's 256"),
        (["bench", "--model", str(tmp_path / "bert")], "mtk bench", "bert is an encoder (its attention looks both"),
        (["topology", "--world", "100000000", "--tp", "2"], "mtk topology", "lists every rank of every group, up to"),
        (["bench", "--json", "/proc/nope.json"], "mtk bench", "cannot write /proc/nope.json"),
        (["bench", "--timeout", "-5"], "mtk bench", "--timeout must be a number of seconds > 0, got -5.0"),
        (["verify", "--model", "tiny-llama", "--tp", "3"], "mtk verify", "num_attention_heads = 4 is not divisible"),
        (["verify", "--dtype", "fp8", "--model", "tiny-llama"], "mtk", "argument --dtype: invalid choice: 'fp8'"),
        (["verify", "--model", str(tmp_path / "t5")], "mtk verify", "t5: mtk has no rules for this architecture"),
        (["export", str(tmp_path / "nowhere"), str(tmp_path / "o")], "mtk export", "nowhere does not exist"),
        (["export", str(checkpoint), str(tmp_path / "a_file")], "mtk export", "is a file; export into a new"),
        (["export", str(checkpoint), str(tmp_path / "o"), "--max_shard_size", "big"], "mtk export", "is not a size"),
        (["export", str(tmp_path), str(tmp_path / "o")], "mtk export", "is not a complete mtk checkpoint"),
        (["verify-checkpoint", str(tmp_path / "nowhere")], "mtk verify-checkpoint", "does not exist"),
        (["verify-checkpoint", str(tmp_path / "a_file")], "mtk verify-checkpoint", "a_file is a file, not a"),
        (["export", str(checkpoint.parent), str(tmp_path / "o")], "mtk export", f"newest checkpoint is {checkpoint}"),
        (["no-such-command"], "mtk", "invalid choice: 'no-such-command'"),
        (["bench", "--memory", "--dtype", "bf16"], "mtk bench", "--memory holds the run against mtk plan"),
        (["bench", "--dp", "2", "--tp", "2", "--compare"], "mtk bench", "over the same replicas: use --tp 1"),
        (["bench", "--pipeline_layers", "3,1"], "mtk bench", "give --pp > 1"),
        (["bench", "--fsdp"], "mtk bench", "--fsdp shards the model over data-parallel replicas: give --dp > 1"),
        (["bench", "--dp", "2", "--fsdp", "--distributed_optimizer"], "mtk bench", "drop --distributed_optimizer"),
        (["bench", "--dp", "2", "--tp", "1", "--fsdp", "--compare"], "mtk bench", "--fsdp measures mtk's own"),
        (["bench", "--pp", "2", "--pipeline_layers", "3,x"], "mtk bench", "is not a list of counts"),
        (["bench", "--pp", "2", "--pipeline_layers", "3,3"], "mtk bench", "summing to the model's 4 layers"),
        (["plan", "--model", "tiny-llama", "--gpus", "0", "--seq_len", "8", "--global_batch", "8"], "mtk", "--gpus"),
        (["export", str(checkpoint), str(tmp_path / ("o" * 300))], "mtk export", "characters): File name too long"),
        (["verify-checkpoint", "c" * 300], "mtk verify-checkpoint", "characters): File name too long"),
        (["bench", "--json", str(tmp_path)], "mtk bench", "is not a file mtk bench can write"),  # (it ran first)
        # --write checked before the sweep (hours with every architecture): a traceback after it before
        (["verify", "--all", "--types", "llama", "--write", str(tmp_path)], "mtk verify", "cannot be read as a mark"),
        (["verify", "--all", "--types", "llama", "--write", str(tmp_path / "a_file")], "mtk verify", "no <!--"),
        (["plan", "--model", "m" * 300, "--gpus", "2", "--seq_len", "8", "--global_batch", "8"], "mtk plan", "long"),
    ]
    for argv, prog, message in cases:
        assert mtk_main(argv) == 2, argv
        _one_line(capsys.readouterr().err, prog, message)
    assert (tmp_path / "a_file").read_text() == "mine" and (theirs / "keep.txt").read_text() == "mine"


def test_verify_past_the_machines_memory_is_one_line(capsys):
    """--batch 99999999999: each worker died in the allocator (at once: 12.8 TB asked for, nothing allocated) and the
    parent printed DistributedTestError with every worker's traceback nested. The workers' exceptions come back with
    the error, and an allocation that failed is bad input: one line, exit 2."""
    assert mtk_main(["verify", "--model", "tiny-llama", "--tp", "2", "--batch", "99999999999"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "mtk verify", "out of memory on rank ")
    assert "can't allocate memory: you tried to allocate" in err and "use a smaller --batch or --seq" in err


def _killed_by_the_kernel(rank: int, world_size: int) -> None:
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a process: no exception, no report


def test_a_worker_killed_by_sigkill_is_said_as_memory():
    """A worker the kernel's out-of-memory killer ends reports nothing (exit -9); the parent's error carries it as
    ``WorkerKilled``, which the commands say in one line (``mtk verify --seq 999999999`` on a machine whose memory
    runs out before the allocator refuses)."""
    from mtk.errors import allocation_failure
    from mtk.spawn import DistributedTestError, run_distributed

    with pytest.raises(DistributedTestError) as failed:
        run_distributed(_killed_by_the_kernel, world_size=2, timeout=60)
    said = str(allocation_failure(failed.value, "use less"))
    assert said == "rank 1 was killed (SIGKILL, most likely by the kernel's out-of-memory killer); use less"


def test_a_workers_bug_keeps_its_traceback():
    """Only an allocation that failed is worded as one line: any other worker error is a bug, raised as it was."""
    from mtk.errors import allocation_failure
    from mtk.spawn import DistributedTestError

    bug = DistributedTestError("verify_worker failed on ranks [0]:\n...", {0: KeyError("model.layers.0")})
    assert allocation_failure(bug, "use less") is None and allocation_failure(ValueError("x"), "use less") is None
    oom = DistributedTestError(
        "...", {1: KeyError("x"), 0: RuntimeError("DefaultCPUAllocator: can't allocate memory")}
    )
    assert str(allocation_failure(oom, "use less")) == (
        "out of memory on rank 0 (DefaultCPUAllocator: can't allocate memory); use less"
    )


def _no_benchmark(*args, **kwargs):
    raise AssertionError("the benchmark ran before its --json file was checked")


def test_bench_json_a_full_disk_cannot_take_is_refused_before_the_benchmark(tmp_path, monkeypatch, capsys):
    """--json /dev/full (or a file on a full file system) ran the whole benchmark, then ended in an OSError
    traceback from write_json. A probe file is written beside the target first (a device gets an empty write),
    so the refusal is one line before anything runs, leaving nothing behind and the user's file untouched."""
    monkeypatch.setattr("mtk.cli.bench.run_bench", _no_benchmark)
    argv = ["bench", "--model", "tiny-llama", "--tp", "1", "--steps", "1", "--json"]
    assert mtk_main([*argv, "/dev/full"]) == 2
    _one_line(capsys.readouterr().err, "mtk bench", "cannot write --json /dev/full: No space left on device")
    earlier = tmp_path / "bench.json"
    earlier.write_text("mine")

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mtk.bench.report.os.fsync", full)  # what a full file system answers the probe
    assert mtk_main([*argv, str(earlier)]) == 2
    _one_line(capsys.readouterr().err, "mtk bench", f"cannot write --json {earlier}: No space left on device")
    assert earlier.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    assert mtk_main([*argv, str(tmp_path / "new.json")]) == 2
    _one_line(capsys.readouterr().err, "mtk bench", "new.json: No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"], "no probe or empty file left behind"
    monkeypatch.undo()
    monkeypatch.setattr("mtk.cli.bench.run_bench", _no_benchmark)
    assert mtk_main([*argv, str(tmp_path / "missing" / "new.json")]) == 2  # a folder that is not there: before too
    _one_line(capsys.readouterr().err, "mtk bench", "new.json: No such file or directory")


def test_a_misspelt_mixed_precision_variable_is_refused_before_anything_is_built(monkeypatch):
    """accelerate reads ACCELERATE_MIXED_PRECISION=fp17 (set by hand; its launcher checks its choices) as "no" and
    trains in fp32 without a word."""
    from mtk import Accelerator
    from mtk.errors import ConfigError

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp17")
    with pytest.raises(ConfigError, match="ACCELERATE_MIXED_PRECISION=fp17 is none of no, fp8, fp16, bf16"):
        Accelerator()


def test_bench_fork_workers_beside_an_accelerator_is_one_line(monkeypatch, capsys):
    """--fork_workers forks CPU (gloo) workers; where an accelerator is there, the run would not be what it says."""
    monkeypatch.setattr("torch.accelerator.is_available", lambda: True)
    assert mtk_main(["bench", "--fork_workers"]) == 2
    _one_line(capsys.readouterr().err, "mtk bench", "--fork_workers starts CPU workers (gloo); this machine has an")


def test_export_into_a_read_only_folder_is_one_line(checkpoint, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if (locked / "probe").exists() or _writable(locked):
            pytest.skip("running as a user who can write anywhere (root): nothing is read-only")
        assert mtk_main(["export", str(checkpoint), str(locked / "hf")]) == 2
        _one_line(capsys.readouterr().err, "mtk export", "cannot write")
    finally:
        locked.chmod(0o700)


def _writable(directory: Path) -> bool:
    try:
        (directory / "probe").write_text("")
    except OSError:
        return False
    (directory / "probe").unlink()
    return True


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty; give it at least one row"),
        ('{"text": "ok"}\n{"text": broken\n', "could not be read as json"),
    ],
    ids=["empty", "malformed-line"],
)
def test_unreadable_data_is_one_line(tmp_path, content, message):
    from mtk.data import load_data
    from mtk.errors import DataError

    (tmp_path / "data.jsonl").write_text(content)
    with pytest.raises(DataError, match=message) as err:
        load_data(tmp_path / "data.jsonl")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "labels, message",
    [
        (["pos", None, "neg"], "--data row 1 has no label"),
        (["pos", " ", "neg"], "--data row 1 has no label"),
        ([1.0, 0.0, 1.0], "--data row 0 has label 1.0; labels are names or integer ids"),
        (["pos", "pos", "pos"], "the data has one label ('pos'): nothing to classify"),
        ([1.0, 0.0, float("nan")], "--data row 2 has no label"),  # a CSV's empty cell: the column reads as floats
        (["0", "1", "pos"], "the labels mix integer ids and names ('0' and 'pos')"),
        (["pos", "Pos", "neg"], "the labels 'Pos' and 'pos' differ only in case or spaces"),
        (["pos", "neg ", "neg"], "the labels 'neg' and 'neg ' differ only in case or spaces"),
        ([0, 100_000_000, 0], "label id 100000000 would make a head of 100000001 classes for the 2 labels"),
        ([0, 40, 3], "(label ids are class indices; at most 28 classes, 4 x labels + 16); renumber the labels 0..K-1"),
    ],
    ids=[
        "empty-cell",
        "blank",
        "float",
        "one-label",
        "empty-csv-cell",
        "ids-and-names",
        "case",
        "spaces",
        "huge-id",
        "sparse",
    ],
)
def test_classification_labels_are_checked(labels, message):
    """An empty label cell is not a class named None (and is the row named), a one-label file does not train as a
    regression, and "1" beside "pos" does not train as a class of its own."""
    from datasets import Dataset

    train = Dataset.from_dict({"text": ["a", "b", "c"], "label": labels})
    with pytest.raises(DataError, match=re.escape(message)):
        EXAMPLES["classify"].check_rows(train, "--data")
        EXAMPLES["classify"].label_ids(train, train)


def test_a_missing_label_is_named_by_its_row_in_the_file_when_a_fifth_is_held_out(tmp_path, capsys):
    """Without --eval_data the labels were checked after the shuffled split: row 7 of the file was named "--data
    row 1", or "--eval_data row 0" (an option not given)."""
    rows = "".join(f"t{i},{'' if i == 7 else i % 2}\n" for i in range(10))
    (tmp_path / "rows.csv").write_text("text,label\n" + rows)
    options = ["--data", str(tmp_path / "rows.csv"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        run_main(partial(EXAMPLES["classify"].main, options), "classify.py")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "classify.py: error: --data row 7 has no label; every row needs one"
    )


def test_label_ids_with_a_few_gaps_are_classes():
    """Ids are class indices: {0, 2} is three classes (one never trained), up to 4 x labels + 16 of them."""
    from datasets import Dataset

    for labels, classes in (([0, 2, 0], 3), ([0, 1, 2, 31], 32)):
        train = Dataset.from_dict({"text": ["a"] * len(labels), "label": labels})
        assert EXAMPLES["classify"].label_ids(train, train) == {i: i for i in range(classes)}


def test_an_evaluation_label_training_never_shows_is_one_line():
    from datasets import Dataset

    train = Dataset.from_dict({"text": ["a", "b"], "label": ["pos", "neg"]})
    held = Dataset.from_dict({"text": ["c"], "label": ["neutral"]})
    with pytest.raises(DataError, match="--eval_data has label 'neutral', which no training row has"):
        EXAMPLES["classify"].label_ids(train, held)


def test_model_directories_that_need_code_or_hold_pickles_are_one_line(tmp_path):
    """mtk runs no code from a model directory and reads weights from safetensors only: a config whose model type
    needs its auto_map's code, and a directory whose weights are only pickles, are refused in one line."""
    custom = tmp_path / "custom"
    custom.mkdir()
    record = {
        **resolve_config("tiny-llama").to_dict(),
        "model_type": "evil",
        "auto_map": {"AutoConfig": "c.EvilConfig"},
    }
    (custom / "config.json").write_text(json.dumps(record))
    with pytest.raises(ModelSpecError, match="needs the custom code its auto_map names"):
        resolve_config(str(custom))
    pickled = tmp_path / "pickled"
    resolve_config("tiny-llama").save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ModelSpecError, match=r"holds its weights only as pickles \(pytorch_model.bin\)"):
        resolve_config(str(pickled))
    invalid = tmp_path / "invalid"
    invalid.mkdir()
    record = {**resolve_config("tiny-llama").to_dict(), "num_attention_heads": 3}  # 64 is not a multiple of 3
    (invalid / "config.json").write_text(json.dumps(record))
    with pytest.raises(ModelSpecError, match=r"transformers refuses its config \(The hidden size \(64\) is not a"):
        resolve_config(str(invalid))


def test_a_generation_config_transformers_cannot_read_is_one_line(tmp_path):
    """A model directory's generation_config.json that is not JSON, not an object, or a value transformers'
    validation refuses was a traceback on every rank (transformers' from_pretrained drops the first silently)."""
    from mtk.checkpoint.hf_load import empty_model

    build_model("tiny-llama").save_pretrained(tmp_path)
    cases = [
        ('{"eos_token_id": [2', r"generation_config.json is not valid JSON \(Expecting"),
        ("[1, 2]", "generation_config.json holds a JSON list, not an object of settings; fix it or remove it"),
        ('{"max_new_tokens": 0}', "generation_config.json: `max_new_tokens` must be greater than 0, but is 0; fix"),
    ]
    for text, message in cases:
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(ModelSpecError, match=message):
            empty_model(tmp_path)


def test_a_model_index_that_names_a_file_outside_its_directory_is_one_line(tmp_path):
    """A model directory's safetensors index is data: a shard name with a path (``../x.safetensors``) was read from
    wherever it pointed; HF writes shard names beside the index, and anything else is refused before a read."""
    from mtk.checkpoint.hf_load import safetensors_index
    from mtk.errors import CheckpointError

    (tmp_path / "outside.safetensors").write_bytes(b"not read")
    model = tmp_path / "model"
    model.mkdir()
    for shard in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "..", ["a"]):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        with pytest.raises(CheckpointError, match="which is not a file beside it|is not a valid safetensors index"):
            safetensors_index(model)


def test_generate_on_a_directory_it_cannot_use_is_one_line(checkpoint, tmp_path, capsys):
    """generate.py ran transformers directly: a training checkpoint, a directory without a tokenizer or one that is
    not there ended in AutoTokenizer's traceback, and a tokenizer with custom code made transformers ask whether to
    run it (sft.py and dpo.py load theirs through the same mtk.data.tokenizers.directory_tokenizer)."""
    from transformers import BertConfig

    no_tokenizer, custom = tmp_path / "hf", tmp_path / "custom"
    resolve_config("tiny-llama").save_pretrained(no_tokenizer)
    resolve_config("tiny-llama").save_pretrained(custom)
    (custom / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.Mine", None]}}))
    encoder, base = tmp_path / "bert", tmp_path / "base"  # transformers generated from a random head, exit 0
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(encoder)
    base_config = resolve_config("tiny-llama")
    base_config.architectures = ["LlamaModel"]
    base_config.save_pretrained(base)
    broken = tmp_path / "broken"  # transformers dropped a malformed generation config: generated with its defaults
    resolve_config("tiny-llama").save_pretrained(broken)
    (broken / "generation_config.json").write_text('{"eos_token_id": [2, 5],}')
    truncated = tmp_path / "truncated"  # a model whose weights file was cut short (a copy interrupted)
    from mtk.testing import train_chat_tokenizer

    build_model("tiny-llama", seed=0).save_pretrained(truncated)
    train_chat_tokenizer(["a river runs by the mill"] * 20).save_pretrained(truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    capsys.readouterr()  # (the save's progress bar)
    cases = [
        (broken, "generation_config.json is not valid JSON (Expecting property name enclosed in double quotes"),
        (checkpoint, "is an mtk training checkpoint; export it first: mtk export"),
        (encoder, "bert is an encoder (its attention looks both ways); give the directory of a causal language"),
        (base, "its config names LlamaModel, which has no causal language-model head; give the directory of a"),
        (no_tokenizer, "has no tokenizer (tokenizer.json or tokenizer_config.json)"),
        (tmp_path / "nowhere", "is not a model directory (no config.json there)"),
        ("tiny-llama", "'tiny-llama' is not a model directory"),  # (a built-in config: no weights, no tokenizer)
        (truncated, "model.safetensors is not a readable safetensors file"),  # (safetensors' traceback before)
        (custom, "its tokenizer needs the custom code its auto_map names"),  # transformers asked, and ran it on 'y'
    ]
    for directory, message in cases:
        with pytest.raises(SystemExit) as exit_:
            run_main(partial(EXAMPLES["generate"].main, [str(directory), "--prompt", "hi"]), "generate.py")
        assert exit_.value.code == 2
        _one_line(capsys.readouterr().err, "generate.py", message)
    gemma3 = resolve_config("tiny-llama")  # transformers' causal-LM mapping names Gemma 3's multimodal class
    gemma3.architectures = ["Gemma3ForConditionalGeneration"]
    assert causal_lm_refusal(gemma3) is None


def test_generate_with_text_that_is_not_utf8_is_one_line(capsys):
    """A prompt holding bytes that are not UTF-8 (Python keeps them as surrogates) was the tokenizer's traceback."""
    for flag in ("--prompt", "--system"):
        argv = ["tiny-llama", "--prompt", "hi", flag, "caf\udce9"]
        with pytest.raises(SystemExit) as exit_:
            run_main(partial(EXAMPLES["generate"].main, argv), "generate.py")
        assert exit_.value.code == 2
        said = f"argument {flag}: 'caf\\udce9' holds bytes that are not UTF-8"
        _one_line(capsys.readouterr().err, "generate.py", said)


def test_generate_with_a_chat_template_that_leaves_the_sandbox_is_one_line(tmp_path, capsys, monkeypatch):
    """transformers renders the template in Jinja's sandbox, which refuses ``__class__``: it was its traceback."""
    import transformers.utils.logging as tqdm_logging

    from mtk.testing import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(["a river runs by the mill"] * 20)
    tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    model = build_model("tiny-llama", seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capsys.readouterr()  # (the save's progress bar)
    monkeypatch.setattr(tqdm_logging, "_tqdm_active", False)  # (the load's)
    with pytest.raises(SystemExit) as exit_:
        run_main(partial(EXAMPLES["generate"].main, [str(tmp_path), "--prompt", "hi"]), "generate.py")
    assert exit_.value.code == 2
    _one_line(capsys.readouterr().err, "generate.py", "the tokenizer's chat template refuses a conversation")


def test_output_into_a_closed_pipe_ends_quietly():
    """``mtk topology ... | head -1``: the reader closes the pipe; the command ends with the shell's SIGPIPE status
    and no BrokenPipeError traceback."""
    import subprocess
    import sys

    command = f"{sys.executable} -m mtk.cli.main topology --world 4096 --tp 2 | head -1"
    out = subprocess.run(["bash", "-c", f"{command}; echo status ${{PIPESTATUS[0]}}"], capture_output=True, text=True)
    assert "Traceback" not in out.stderr and out.stdout.strip().endswith("status 141"), (out.stdout, out.stderr)


def test_a_symbolic_link_loop_as_a_path_is_one_line(tmp_path, capsys):
    """pathlib's resolve() raises RuntimeError("Symlink loop ...") (Python 3.11; OSError ELOOP from 3.13) wherever a
    script or command first resolves the path."""
    (tmp_path / "loop").symlink_to("loop")
    for script in ("finetune", "classify"):
        with pytest.raises(SystemExit) as exit_:
            run_main(partial(EXAMPLES[script].main, ["--output_dir", str(tmp_path / "loop" / "sub")]), f"{script}.py")
        assert exit_.value.code == 2
        err = capsys.readouterr().err  # (classify.py's data preparation draws its progress bars first)
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"{script}.py: error: ")
        assert "give a path without the loop" in err.strip().splitlines()[-1], err


def test_rank_set_by_hand_on_a_process_alone_still_reports(monkeypatch, capsys):
    """RANK exported by hand before plain python: the reporter took "rank 0 reports for all" from it and said nothing
    (RANK=1), or raised itself (RANK=abc)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for rank in ("1", "abc"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            run_main(partial(EXAMPLES["finetune"].main, ["--data", "/nonexistent.jsonl"]), "finetune.py")
        assert exit_.value.code == 2
        assert "--data /nonexistent.jsonl does not exist" in capsys.readouterr().err


def test_generate_past_the_models_positions_is_one_line(tmp_path, capsys, monkeypatch):
    """transformers only warns when generation goes past max_position_embeddings, and generated until stopped."""
    import transformers.utils.logging as tqdm_logging

    from mtk.testing import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(["a river runs by the mill"] * 20)
    model = build_model("tiny-llama", seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capsys.readouterr()  # (the save's progress bar)
    monkeypatch.setattr(tqdm_logging, "_tqdm_active", False)  # (the load's)
    positions = model.config.max_position_embeddings
    long_prompt = " ".join(["a river runs by the mill"] * positions)  # (its tokens alone fill every position)
    for prompt, advice in [("hi", "; use --max_new_tokens"), (long_prompt, "; give a shorter prompt (or --system)")]:
        argv = [str(tmp_path), "--prompt", prompt, "--max_new_tokens", "100000"]
        with pytest.raises(SystemExit) as exit_:
            run_main(partial(EXAMPLES["generate"].main, argv), "generate.py")
        assert exit_.value.code == 2
        said = f"goes past the model's {positions} positions (max_position_embeddings){advice}"
        _one_line(capsys.readouterr().err, "generate.py", said)


def test_weights_for_more_layers_than_the_config_builds_are_one_line(tmp_path):
    """A config that says 2 layers beside weights for 8 trained a 2-layer model without a word (the rest ignored)."""
    from safetensors.torch import save_file

    from mtk.checkpoint.hf_load import load_pretrained_tp
    from mtk.errors import CheckpointError

    model = build_model("tiny-llama")
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["model.layers.7.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].clone()
    model.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds weights for 8 layers but its config builds 2"):
        load_pretrained_tp(tmp_path, ParallelState.build())


def test_json_nested_too_deeply_to_parse_is_each_readers_one_line(tmp_path):
    """Python's parser recurses once per nesting level: 100,000 nested brackets raised RecursionError past every
    handler (checkpoint metadata, a model directory's index, a DeepSpeed config). mtk.jsonio makes it malformed JSON,
    which each reader names in one line."""
    from mtk.checkpoint.hf_load import safetensors_index
    from mtk.checkpoint.meta import CheckpointMeta
    from mtk.errors import CheckpointError, ConfigError
    from mtk.integrations.deepspeed import deepspeed_config

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(CheckpointError, match="is not valid mtk checkpoint metadata .*nested too deeply"):
        CheckpointMeta.from_json(deep, tmp_path / "metadata.json")
    (tmp_path / "model.safetensors.index.json").write_text(deep)
    with pytest.raises(CheckpointError, match="is not a valid safetensors index .*nested too deeply"):
        safetensors_index(tmp_path)
    (tmp_path / "ds.json").write_text(deep)
    with pytest.raises(ConfigError, match="is not valid JSON .*nested too deeply"):
        deepspeed_config(tmp_path / "ds.json", 1)


LLAMA_3_8B = json.loads((ROOT / "examples" / "configs" / "llama-3-8b" / "config.json").read_text())
GPT2 = resolve_config("tiny-gpt2").to_dict()
QWEN3_MOE = {**tiny_config("qwen3_moe").to_dict(), "num_experts": 8}
CONFIG_VALUES = [
    (LLAMA_3_8B, "num_attention_heads", 0, "num_attention_heads is 0; it must be a positive whole number"),
    (LLAMA_3_8B, "vocab_size", -5, "vocab_size is -5; it must be a positive whole number"),
    (LLAMA_3_8B, "hidden_size", 4096.5, "hidden_size is 4096.5; it must be a positive whole number"),
    (LLAMA_3_8B, "intermediate_size", [14336, 0], "intermediate_size is [14336, 0]; it must be a positive whole"),
    (LLAMA_3_8B, "num_key_value_heads", "8", 'num_key_value_heads is "8"; it must be a positive whole number'),
    (LLAMA_3_8B, "head_dim", True, "head_dim is true; it must be a positive whole number"),
    (LLAMA_3_8B, "head_dim", 0, "head_dim is 0; it must be a positive whole number"),  # 0 is GLM-5-Next's default
    (LLAMA_3_8B, "rms_norm_eps", float("nan"), "rms_norm_eps is NaN; it must be a finite number"),
    (LLAMA_3_8B, "rope_theta", float("inf"), "rope_theta is Infinity; it must be a finite number"),
    (
        LLAMA_3_8B,
        "num_hidden_layers",
        10**9,
        "num_hidden_layers is 1000000000; mtk builds and plans models of at most",
    ),
    (GPT2, "n_head", 0, "n_head is 0; it must be a positive whole number"),
    (GPT2, "n_layer", 2_000, "n_layer is 2000; mtk builds and plans models of at most 1,000 layers"),
    (LLAMA_3_8B, "hidden_act", "bogus", "transformers cannot build a model from this config (KeyError: 'bogus')"),
    (LLAMA_3_8B, "pad_token_id", 10**6, "transformers cannot build a model from this config (AssertionError: Pad"),
    (LLAMA_3_8B, "attention_dropout", 1.5, "attention_dropout is 1.5; a dropout is in [0, 1]"),
    (QWEN3_MOE, "num_experts_per_tok", 11, "num_experts_per_tok is 11 of 8 experts; each token is routed to 1 to 8"),
    (QWEN3_MOE, "num_experts_per_tok", 0, "num_experts_per_tok is 0 of 8 experts"),
    (LLAMA_3_8B, "num_key_value_heads", None, None),  # null: a field the config leaves to its default is not checked
    (GPT2, "n_inner", None, None),  # (GPT-2's n_inner: 4 x n_embd)
]


def test_every_config_transformers_ships_passes_the_value_check():
    """The check refuses impossible values, never a config transformers itself builds: per-layer widths (Gemma-3n's
    lists), ``head_dim`` 0 ("derived", GLM's), a whole number written as a float, vision models' per-stage tuples."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from mtk.models import check_config_values

    checked = 0
    for model_type, config_class in CONFIG_MAPPING.items():
        try:
            config = config_class()
        except Exception:  # noqa: BLE001 (a config that needs arguments: nothing to check)
            continue
        check_config_values({**vars(config), "model_type": config.model_type}, model_type)
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("base, field, value, message", CONFIG_VALUES, ids=[f"{c[1]}={c[2]}" for c in CONFIG_VALUES])
def test_model_config_values_are_checked_where_a_config_is_read(tmp_path, base, field, value, message):
    """A head count of 0 divided by zero in transformers' config, a vocabulary of -5 built a tensor of negative size,
    a NaN epsilon failed in the planner and 10^9 layers planned without end: each config file, and each directory's
    config.json, is one line naming the field and the file."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, field: value}))
    if message is None:
        resolve_config(str(path))
        return
    for spec in (path, tmp_path):  # a config file alone, and a model directory
        with pytest.raises(ModelSpecError, match=re.escape(f"--model {path}: {message}")) as err:
            resolve_config(str(spec))
        assert "\n" not in str(err.value)


def test_a_model_config_with_bad_values_is_one_line_in_plan_and_verify(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_3_8B, "num_attention_heads": 0}))
    plan = ["--gpus", "8", "--gpu_memory", "80GiB", "--seq_len", "4096", "--global_batch", "64"]
    for argv, prog in (
        (["plan", "--model", str(tmp_path / "config.json"), *plan], "mtk plan"),
        (["verify", "--model", str(tmp_path), "--tp", "2"], "mtk verify"),
    ):
        assert mtk_main(argv) == 2, argv
        _one_line(capsys.readouterr().err, prog, "num_attention_heads is 0; it must be a positive whole number")
