"""``mtk.trainers.Trainer``: transformers' ``Trainer`` on mtk's layout (:mod:`mtk.trainers.base`)."""

from __future__ import annotations

import transformers

from mtk.trainers.base import ParallelTrainerMixin

__all__ = ["Trainer"]


class Trainer(ParallelTrainerMixin, transformers.Trainer):
    """transformers' ``Trainer`` with the same constructor and ``TrainingArguments``, at any TP x PP x DP layout."""
