"""The base of every error mtk raises for bad input (a layout, a config, a model, a checkpoint, data).

Each carries a one-line message saying what is wrong and what is allowed. Entry points catch
:class:`MtkError` and print ``<prog>: error: <message>`` with a non-zero exit, never a traceback.
"""

import os
import sys
from collections.abc import Callable

from tqdm.auto import tqdm


class MtkError(ValueError):
    """Bad input, explained in one line."""


def run_main(main: Callable[[], None], prog: str) -> None:
    """Run a script's ``main``; bad input becomes ``<prog>: error: <message>`` (from the first rank
    only, as every rank fails the same way) and exit status 2, without a traceback."""
    try:
        main()
    except MtkError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            tqdm.write(f"{prog}: error: {err}", file=sys.stderr)  # on its own line, even under a progress bar
        sys.exit(2)
