"""Per-architecture tensor-parallel rules as data, how a model finds its plan, and the function that applies one."""

from mtk.plans.apply import PlanContext, materialize_, parallelize_with
from mtk.plans.base import AttrFix, HeadCounts, Plan, Rule, UnsupportedModelError
from mtk.plans.registry import PLANS, check_tp_size, find_plan, register_plan, resolve_plan

__all__ = [
    "PLANS",
    "AttrFix",
    "HeadCounts",
    "Plan",
    "PlanContext",
    "Rule",
    "UnsupportedModelError",
    "check_tp_size",
    "find_plan",
    "materialize_",
    "parallelize_with",
    "register_plan",
    "resolve_plan",
]
