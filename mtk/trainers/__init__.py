"""transformers' ``Trainer`` and TRL's trainers on mtk's TP x PP x DP layout: change the import, keep the script.

``from mtk.trainers import Trainer, SFTTrainer, DPOTrainer`` in place of transformers'/TRL's, then
``accelerate launch --config_file accelerate_configs/tp2.yaml script.py``. docs/trainers.md says what each option
does under mtk.
"""

import os
import sys

from mtk.trainers.base import ParallelTrainerMixin
from mtk.trainers.trainer import Trainer
from mtk.trainers.trl import DPOTrainer, SFTTrainer
from mtk.training.entry import report_mtk_errors

# A setting mtk refuses ends a user's script in one line, as it ends mtk's own scripts (not with a traceback).
report_mtk_errors(os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "mtk.trainers")

__all__ = ["DPOTrainer", "ParallelTrainerMixin", "SFTTrainer", "Trainer"]
