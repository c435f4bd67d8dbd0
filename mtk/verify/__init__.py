"""Is a converted model exact? ``mtk verify``'s parity check of one model (:mod:`mtk.verify.parity`) and the
sweep over transformers' architectures (:mod:`mtk.verify.sweep`)."""

from mtk.verify.parity import VERIFY_DTYPES, VerifyResult, pipeline_verify_worker, verify_worker

__all__ = ["VERIFY_DTYPES", "VerifyResult", "pipeline_verify_worker", "verify_worker"]
