"""``trl_script.py --trainer mtk``, recording how each rank got its weights (``tests/e2e/test_trl.py``).

Before training, each rank writes ``<output_dir>/loading-rank<R>.json``: how often transformers' ``from_pretrained``
ran (TRL's own loading of ``model=`` a path), the bytes it read from ``.safetensors`` files with ``os.preadv`` (how
mtk's slice reader reads tensor data), and the bytes of the parameters its policy and reference models hold.
"""

import json
import os
from pathlib import Path

import transformers

import mtk.trainers

counts = {"from_pretrained": 0, "safetensors_bytes": 0}

_preadv = os.preadv
_from_pretrained = transformers.PreTrainedModel.from_pretrained.__func__


def _counting_preadv(fd, buffers, offset, *rest):
    done = _preadv(fd, buffers, offset, *rest)
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
        counts["safetensors_bytes"] += done
    return done


def _counting_from_pretrained(cls, *args, **kwargs):
    counts["from_pretrained"] += 1
    return _from_pretrained(cls, *args, **kwargs)


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0


def _recording(train):
    def recorded(self, *args, **kwargs):
        params = list(self.model.parameters())
        record = {
            **counts,
            "model_bytes": _bytes(self.model),
            "reference_bytes": _bytes(getattr(self, "ref_model", None)),
            "on_meta": sum(p.is_meta for p in params),
        }
        rank = self.accelerator.process_index
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(self.args.output_dir, f"loading-rank{rank}.json").write_text(json.dumps(record))
        return train(self, *args, **kwargs)

    return recorded


os.preadv = _counting_preadv
transformers.PreTrainedModel.from_pretrained = classmethod(_counting_from_pretrained)
for trainer in (mtk.trainers.SFTTrainer, mtk.trainers.DPOTrainer):
    trainer.train = _recording(trainer.train)


if __name__ == "__main__":
    from trl_script import main  # (this folder is the script's: first on sys.path)

    from mtk.training.entry import run_main

    run_main(main, "trl_slices_probe.py")
