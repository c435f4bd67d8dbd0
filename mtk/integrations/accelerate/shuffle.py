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

__all__ = ["replay_shuffles"]


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
