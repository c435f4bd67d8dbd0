"""transformers' ``Trainer`` and TRL's trainers on mtk's TP x PP x DP layout: change the import, keep the script.

``from mtk.trainers import Trainer, SFTTrainer, DPOTrainer`` in place of transformers'/TRL's, then
``accelerate launch --config_file accelerate_configs/tp2.yaml script.py``. docs/trainers.md says what each option
does under mtk.
"""

import os
import sys

from mtk.errors import ConfigError
from mtk.trainers.base import ParallelTrainerMixin
from mtk.trainers.trainer import Trainer
from mtk.trainers.trl import DPOTrainer, SFTTrainer
from mtk.training.entry import report_mtk_errors

# A setting mtk refuses ends a user's script in one line, as it ends mtk's own scripts (not with a traceback).
report_mtk_errors(os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "mtk.trainers")

__all__ = ["DPOTrainer", "ParallelTrainerMixin", "SFTTrainer", "Trainer"]

# TRL's other trainers, and why mtk does not provide them yet (importing one is a one-line error naming why).
NOT_PROVIDED = {
    "GRPOTrainer": "it generates completions with the policy inside training, and mtk's TP/PP model has no "
    "generation path wired into TRL's trainers (nor vLLM's) yet",
    "RLOOTrainer": "it generates completions with the policy inside training, and mtk's TP/PP model has no "
    "generation path wired into TRL's trainers (nor vLLM's) yet",
    "KTOTrainer": "its KL estimate pairs completions with other examples' prompts within a batch, which mtk has not "
    "verified against TRL yet",
    "RewardTrainer": "it trains a sequence-classification head on preference pairs, a path mtk has not verified "
    "against TRL yet",
    "DistillationTrainer": "it needs the teacher's and the student's full-vocabulary distributions (a "
    "vocab-parallel divergence is not built yet)",
}


def __getattr__(name: str):
    if name in NOT_PROVIDED:
        raise ConfigError(f"mtk.trainers.{name} is not provided: {NOT_PROVIDED[name]}; use SFTTrainer or DPOTrainer")
    raise AttributeError(f"module 'mtk.trainers' has no attribute {name!r}")
