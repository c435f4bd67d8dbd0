"""Every error mtk raises for bad input (a layout, a config, a model, a checkpoint, data), in one place.

Each carries a one-line message saying what is wrong and what is allowed. Entry points catch
:class:`MtkError` and print ``<prog>: error: <message>`` with a non-zero exit, never a traceback
(:func:`mtk.training.entry.run_main` for scripts, ``mtk``'s dispatcher for its subcommands).
"""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "LayoutError",
    "ModelSpecError",
    "MtkError",
    "TrainingError",
    "UnsupportedModelError",
]


class MtkError(ValueError):
    """Bad input, explained in one line."""


class ConfigError(MtkError):
    """A parallelism or run setting with an invalid value, or two settings that disagree."""


class LayoutError(MtkError):
    """A world size that does not factor into the requested TP x PP x DP grid."""


class ModelSpecError(MtkError):
    """A ``--model`` that is neither a built-in name nor a readable local HF directory."""


class UnsupportedModelError(MtkError):
    """The model (or this TP size) cannot be converted by any rule set."""


class CheckpointError(MtkError):
    """A checkpoint (mtk's or an HF directory) that is missing, incomplete or does not match the model."""


class DataError(MtkError):
    """Training data that cannot be read or tokenized."""


class TrainingError(MtkError):
    """A run that cannot go on safely (e.g. non-finite gradients); stopped before it is saved."""
