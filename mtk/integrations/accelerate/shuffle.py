"""Exact resume of a shuffled DataLoader under accelerate's default (not seedable) sampler.

With ``use_seedable_sampler=False`` (accelerate's default) a shuffled loader keeps torch's
``RandomSampler``, which draws every epoch's order from its generator; accelerate checkpoints the
global RNGs but not that generator. A resumed run builds the loader as the first run did, so its
generator starts where the first run's started: drawing the orders of the epochs already completed
brings it to where the interrupted epoch began (a torch ``DataLoader`` over the same sampler and
generator replays them, so what each epoch draws — the sampler's permutation and the loader's
worker base seed — is drawn exactly as in the first run), and ``skip_first_batches`` then continues that
epoch's order exactly. (``SeedableRandomSampler`` needs none of this: its order is a function of
seed and epoch.)
"""

from __future__ import annotations

from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["completed_passes", "replay_shuffles"]


def completed_passes(dataloader) -> int:
    """The passes over ``dataloader`` whose last batch it has yielded: accelerate's ``iteration``, and the pass in
    progress when its last batch was yielded and the loop stopped there. accelerate counts a pass only once its
    iterator runs out, which a loop that ends its epoch on the last batch (``step_windows``, a ``break`` on the
    data position) never asks for: a save there recorded one pass too few, and the resumed run drew the finished
    epoch's order again for the next one."""
    iteration = int(getattr(dataloader, "iteration", 0))
    state = getattr(dataloader, "gradient_state", None)
    in_pass = state is not None and any(ref is dataloader for ref in state.dataloader_references)
    return iteration + int(in_pass and bool(getattr(dataloader, "end_of_dataloader", False)))


def replay_shuffles(dataloader, completed_epochs: int) -> int:
    """Advance a plain shuffled sampler's generator past ``completed_epochs`` orders; returns how many.

    Does nothing (returns 0) for unshuffled loaders, seedable samplers and samplers without a generator.
    """
    sampler = _sampler_of(dataloader)
    if not isinstance(sampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler):
        return 0
    if sampler.generator is None:
        return 0
    indices = range(len(sampler.data_source))
    replay: DataLoader = DataLoader(
        indices,  # type: ignore[arg-type]  # a range is a map-style dataset: len and indexing
        sampler=sampler,
        batch_size=4096,
        collate_fn=len,
        generator=dataloader.generator,
    )
    for _ in range(completed_epochs):
        for _ in replay:  # draws what one epoch of the real loader drew; loads no data
            pass
    return completed_epochs


def _sampler_of(dataloader):
    """The index sampler under accelerate's batch-sampler wrappers (``BatchSamplerShard`` -> ``BatchSampler``)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    while batch_sampler is not None and not hasattr(batch_sampler, "sampler"):
        batch_sampler = getattr(batch_sampler, "batch_sampler", None)
    return getattr(batch_sampler, "sampler", None)
