"""The base of every error mtk raises for bad input (a layout, a config, a model, a checkpoint, data).

Each carries a one-line message saying what is wrong and what is allowed. Entry points catch
:class:`MtkError` and print ``<prog>: error: <message>`` with a non-zero exit, never a traceback.
"""


class MtkError(ValueError):
    """Bad input, explained in one line."""
