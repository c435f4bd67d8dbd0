"""``mtk verify-checkpoint step_N``: check a checkpoint's files against its checksums, without training."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from safetensors import safe_open

from mtk.checkpoint.counts import check_saved_counts
from mtk.checkpoint.export import check_against_config
from mtk.checkpoint.integrity import ALGORITHM, read_verified
from mtk.checkpoint.meta import CheckpointMeta
from mtk.checkpoint.optimizer import check_listed_parameters, check_settings_agree
from mtk.checkpoint.paths import CheckpointPaths, reading
from mtk.checkpoint.reader import ShardedCheckpointReader
from mtk.checkpoint.resume import rescaled_position
from mtk.checkpoint.rng import check_restorable
from mtk.errors import CheckpointError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "verify-checkpoint",
        help="check every file of a training checkpoint against the checksums in its metadata",
        description=(
            "Read metadata.json of a checkpoint written by mtk (save_state, examples/*.py) and check that "
            "every file it lists is there with its recorded size and checksum, and nothing else is; then, from the "
            "weights and optimizer files' headers, that every tensor rebuilds whole from its shards and pieces, "
            "and that the optimizer's steps, the schedulers' positions and the data position are the ones recorded. "
            "Exit 0 if it is complete and intact; otherwise print the first problem and exit 2."
        ),
    )
    parser.add_argument("checkpoint", help="checkpoint directory, e.g. ckpts/step_150")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    meta = read_verified(args.checkpoint)
    layout = meta.topology
    cp = f" cp={layout.cp_size}" if layout.cp_size > 1 else ""
    ep = f" ep={layout.ep_size}" if layout.ep_size > 1 else ""
    ep += f" etp={layout.etp_size}" if layout.etp_size != layout.tp_size else ""
    where = f"step {meta.step}, tp={layout.tp_size}{cp} pp={layout.pp_size} dp={layout.dp_size}{ep}"
    if not meta.files:
        print(f"{args.checkpoint}: {meta.format} has no checksums; only its metadata was read ({where})")
        return 0
    optimizer = any(name.startswith("optimizer/") and name.endswith(".safetensors") for name in meta.files)
    match = re.fullmatch(r"step_(\d+)", Path(args.checkpoint).name)
    if match and int(match[1]) != meta.step:  # (resume refuses it: --resume auto would take it for the newest)
        raise CheckpointError(
            f"{args.checkpoint} records step {meta.step}, not {match[1]}: a copy or a renamed checkpoint"
        )
    with ShardedCheckpointReader(args.checkpoint, meta) as reader:
        reader.check_complete(optimizer=optimizer)
        reader.check_replicas_agree(optimizer=optimizer)  # files of one save: what TP ranks hold whole is one tensor
        if meta.base_model is None and meta.model.get("config"):  # full weights: what export checks of them
            check_against_config(args.checkpoint, meta, reader)
    if optimizer and meta.engine is None:  # each TP rank's optimizer settings are the others'
        groups = [name for name in meta.files if name.startswith("optimizer/tp00-pp00") and name.endswith(".json")]
        check_settings_agree(CheckpointPaths(args.checkpoint), layout.tp_size, layout.pp_size, len(groups))
        listing = sorted(name for name in meta.files if name.startswith("optimizer/") and name.endswith(".json"))
        check_listed_parameters(CheckpointPaths(args.checkpoint), listing, _weights_held(Path(args.checkpoint), meta))
    check_saved_counts(args.checkpoint, meta)  # the optimizer's steps and the schedulers' positions
    for name in meta.files:
        if re.fullmatch(r"rng/rank\d+\.pt", name):
            check_restorable(Path(args.checkpoint) / name)  # each rank's RNG states set as resume sets them
    rescaled_position(meta.data, None)  # the data position's counts, and that they agree
    size = sum(record["bytes"] for record in meta.files.values())
    print(
        f"{args.checkpoint}: ok, {len(meta.files)} files ({size / 2**20:.1f} MiB) match their {ALGORITHM}; "
        f"{where}, run {meta.run_id}"
    )
    return 0


def _weights_held(root: Path, meta: CheckpointMeta) -> dict[str, set[str]]:
    """The tensor names each ``tpXX-ppYY`` rank's weights file holds (its pieces' together), from the headers."""
    held: dict[str, set[str]] = {}
    for name in meta.files:
        match = re.fullmatch(r"model/(tp\d+-pp\d+)(?:-piece\d+)?\.safetensors", name)
        if match:
            with reading(root / name), safe_open(str(root / name), framework="pt") as file:
                held.setdefault(match[1], set()).update(file.keys())
    return held
