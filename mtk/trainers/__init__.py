"""transformers' ``Trainer`` and TRL's trainers on mtk's TP x PP x DP layout: change the import, keep the script.

``from mtk.trainers import Trainer, SFTTrainer, DPOTrainer`` in place of transformers'/TRL's, then
``accelerate launch --config_file accelerate_configs/tp2.yaml script.py``. docs/trainers.md says what each option
does under mtk.
"""

from mtk.trainers.base import ParallelTrainerMixin
from mtk.trainers.trainer import Trainer
from mtk.trainers.trl import DPOTrainer, SFTTrainer

__all__ = ["DPOTrainer", "ParallelTrainerMixin", "SFTTrainer", "Trainer"]
