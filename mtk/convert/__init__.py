"""The one entry point that makes an HF model parallel (:func:`parallelize`), and the steps of it that need both
the rules and the pipeline cut (:mod:`mtk.convert.regions`: sequence-parallel regions and dropout streams of the
blocks a stage runs)."""

from mtk.convert.parallelize import parallelize
from mtk.parallel.record import Parallelized, parallelized

__all__ = ["Parallelized", "parallelize", "parallelized"]
