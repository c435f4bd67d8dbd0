"""``push_to_hub`` on the Trainer path: what transformers' Trainer pushes, from mtk's checkpoints and saves.

transformers pushes at three moments: ``save_model`` (``push_to_hub=True``) uploads the output directory; each
checkpoint save (``hub_strategy`` other than ``"end"``) copies the model's files out of ``checkpoint-N`` into the
output directory and uploads that, plus the checkpoint folder itself for ``"checkpoint"`` and ``"all_checkpoints"``.
Under mtk ``checkpoint-N`` holds sharded pieces, not the model's files, and mtk's ``save_model`` and
``_save_checkpoint`` replace the Trainer's: so nothing was pushed at all, and the run said nothing. Here each push
happens where transformers' does, a checkpoint's push with the merged model written into the output directory first
(gathered over TP and PP, what the copy out of an HF checkpoint gives); the uploads leave out the files that
belong to the run, not the model (the lock, a staging folder); and a Hub that cannot be reached (no network, no
token) is one line naming what failed, not an HTTP library's traceback. A background push of a checkpoint that
failed (transformers never looks) is said when the next push starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import transformers.trainer as hf_trainer
from transformers.trainer_utils import HubStrategy

from mtk.checkpoint.lock import LOCK_NAME
from mtk.errors import ConfigError

__all__ = ["RUN_FILES", "TrainerHub", "hub_failure"]

# What an output directory holds for the run rather than for the model: the lock and save_model's staging folder.
RUN_FILES = (LOCK_NAME, ".mtk-*", "*.incomplete")

# The libraries whose errors mean the Hub was not reached or refused the request (huggingface_hub's own, its HTTP
# clients'); an error of any other kind keeps its traceback.
_NETWORK_LIBRARIES = ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3")


def hub_failure(err: BaseException) -> str | None:
    """``err``'s first line where it came from reaching the Hub (a refused or failed request, no connection, a
    timeout); ``None`` for anything else."""
    network = isinstance(err, (ConnectionError, TimeoutError)) or any(
        cls.__module__.split(".")[0] in _NETWORK_LIBRARIES for cls in type(err).__mro__
    )
    if not network:
        return None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


class _UploadsWithoutRunFiles:
    """transformers' shared ``HfApi`` whose ``upload_folder`` leaves out :data:`RUN_FILES`."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def upload_folder(self, *args: Any, ignore_patterns: Any = None, **kwargs: Any) -> Any:
        given = [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
        return self._api.upload_folder(*args, ignore_patterns=[*given, *RUN_FILES], **kwargs)


@contextlib.contextmanager
def _reaching_the_hub(what: str, hint: str) -> Iterator[None]:
    """For the block: the trainer module's ``hf_api`` uploads without the run's files, and a failure to reach the
    Hub is one line saying ``what`` failed and ``hint``."""
    original = hf_trainer.hf_api
    hf_trainer.hf_api = lambda: cast(Any, _UploadsWithoutRunFiles(original()))
    try:
        yield
    except Exception as err:
        failure = hub_failure(err)
        if failure is None:
            raise
        raise ConfigError(f"push_to_hub: {what} failed ({failure}); {hint}") from err
    finally:
        hf_trainer.hf_api = original


class TrainerHub:
    """The Hub hooks of :class:`~mtk.trainers.base.ParallelTrainerMixin` (a mixin of the Trainer)."""

    args: Any
    hub_model_id: Any
    push_in_progress: Any
    accelerator: Any

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """transformers' (the repository made once, on the main process), one line if the Hub cannot be reached."""
        repo = self.args.hub_model_id or "named after output_dir"
        hint = "check the network and HF_TOKEN (hub_token), or leave push_to_hub unset and upload the model later"
        with _reaching_the_hub(f"creating the Hub repository {repo}", hint):
            super().init_hf_repo(token=token, private=private)  # type: ignore[misc]

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' (``save_model`` into the output directory on every rank, the upload on the main process),
        without the run's files; one line if the upload fails (the saved model stays in the output directory).
        The checkpoints' background pushes are waited for first (as transformers does next), so a last one that
        failed is said too."""
        cast(Any, self)._finish_current_push()
        self._say_failed_pushes()
        hint = f"the model is saved in {self.args.output_dir}: upload it later (hf upload REPO {self.args.output_dir})"
        with _reaching_the_hub(f"uploading {self.args.output_dir}", hint):
            return super().push_to_hub(*args, **kwargs)  # type: ignore[misc]

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """A checkpoint's push, as transformers': the model it holds (written merged into the output directory
        first: collective, every rank is here) and, for ``hub_strategy`` ``"checkpoint"``/``"all_checkpoints"``,
        the checkpoint folder (mtk's sharded checkpoint, which mtk's Trainer resumes at any layout)."""
        if self.args.hub_strategy == HubStrategy.END:  # transformers pushes nothing then
            return
        self.save_model(self.args.output_dir, _internal_call=True)  # type: ignore[attr-defined]
        self._say_failed_pushes()
        hint = f"the checkpoint is saved in {checkpoint_folder}"
        with _reaching_the_hub(f"pushing {checkpoint_folder}", hint):
            super()._push_from_checkpoint(checkpoint_folder)  # type: ignore[misc]

    def _say_failed_pushes(self) -> None:
        """One line for each background push (a checkpoint's, started earlier) that failed since the last look:
        transformers waits for them but never reads their result."""
        jobs = getattr(getattr(self, "push_in_progress", None), "jobs", None) or []
        said = self.__dict__.setdefault("_mtk_said_pushes", set())
        for job in jobs:
            if id(job) in said or not job.done() or job.exception() is None:
                continue
            said.add(id(job))
            error = job.exception()
            failure = hub_failure(error) or f"{type(error).__name__}: {error}"
            self.accelerator.print(f"mtk: a push to the Hub failed ({failure}); the checkpoint is saved locally")
