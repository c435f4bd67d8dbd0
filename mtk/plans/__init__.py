"""Per-architecture tensor-parallel rules and the function that applies them."""

from mtk.plans.apply import PlanContext, materialize_, parallelize_with
from mtk.plans.base import AttrFix, HeadCounts, Plan, Rule, UnsupportedModelError
from mtk.plans.registry import PLANS, check_tp_size, find_plan, parallelize, register_plan

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
    "parallelize",
    "parallelize_with",
    "register_plan",
]
