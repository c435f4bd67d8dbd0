"""Per-architecture tensor-parallel rules as data, how a model finds its rules, and the function that applies one."""

from mtk.rules.apply import RuleContext, materialize_, parallelize_with
from mtk.rules.base import AttrFix, HeadCounts, Rule, RuleSet, UnsupportedModelError
from mtk.rules.fused_head import add_vocab_parallel_fused_head, replace_trl_fused_head
from mtk.rules.registry import RULE_SETS, check_tp_size, find_rules, register_rules, resolve_rules
from mtk.rules.styles import ParallelStyle, register_style

__all__ = [
    "RULE_SETS",
    "AttrFix",
    "HeadCounts",
    "ParallelStyle",
    "RuleSet",
    "RuleContext",
    "add_vocab_parallel_fused_head",
    "Rule",
    "UnsupportedModelError",
    "check_tp_size",
    "find_rules",
    "materialize_",
    "parallelize_with",
    "register_rules",
    "register_style",
    "replace_trl_fused_head",
    "resolve_rules",
]
