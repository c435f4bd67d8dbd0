"""The gradient norm where DeepSpeed keeps none: its fp32 engine without ZeRO (``"stage": 0``).

DeepSpeed's ZeRO, fp16 and bf16 optimizers record the global gradient norm of each step, and
``engine.get_global_grad_norm()`` returns it. At stage 0 in fp32 the engine steps the client's own torch
optimizer: its clipping (``clip_fp32_gradients``) computes a norm and discards it, and without
``gradient_clipping`` nothing computes one, so a script can neither log nor check the norm (accelerate's
``clip_grad_norm_`` returns None, which a finite-check reads as NaN). Its clipping's norm also counts only
tensor-parallel shards across ranks: not pipeline stages or spread experts.

There mtk clips instead, once, in a step pre-hook on that optimizer, by the same ``gradient_clipping`` and with
its own global norm (:func:`~mtk.parallel.grad_norm.clip_grad_norm_tp_`: TP, PP and EP aware), and leaves the
norm where DeepSpeed reads it after the step (the optimizer's ``_global_grad_norm``).
"""

from __future__ import annotations

from typing import Any

import torch

from mtk.parallel.grad_norm import clip_grad_norm_tp_, grad_norm_tp
from mtk.parallel.state import ParallelState

__all__ = ["clip_where_deepspeed_keeps_no_norm"]


def clip_where_deepspeed_keeps_no_norm(engine: Any, parallel: ParallelState) -> bool:
    """Make ``engine`` record each step's global gradient norm if its optimizer keeps none; whether it did.

    Only the engine that steps a plain torch optimizer is changed (DeepSpeed's own optimizers all keep the
    norm). The clipping threshold is read from the engine at each step, so a resume's configured value applies.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_global_grad_norm") or not isinstance(optimizer, torch.optim.Optimizer):
        return False
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        # (fp16 autocast: the scaler skips the step, and a pre-hook's collective, on a rank that overflowed alone)
        return False
    parameters = [p for group in optimizer.param_groups for p in group["params"]]

    def clip_and_record(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        max_norm = float(engine.gradient_clipping())
        norm = (
            clip_grad_norm_tp_(parameters, max_norm, parallel)
            if max_norm > 0
            else grad_norm_tp(parameters, parallel)  # clipping off: the norm alone
        )
        stepped._global_grad_norm = norm  # type: ignore[attr-defined]  # read by the engine after the step

    optimizer.register_step_pre_hook(clip_and_record)
    engine.clip_fp32_gradients = lambda: None  # clipped once: by the hook, just before the step
    return True
