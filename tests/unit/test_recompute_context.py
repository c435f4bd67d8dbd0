"""mtk's recompute keeps its own checkpoint context (which restores the tensor-parallel dropout stream) when a
wrapper set on the model's instance would replace it: TRL's SFTTrainer wraps ``gradient_checkpointing_enable``
for its selective checkpointing (``gradient_checkpointing_kwargs={"selective": True}``), and transformers routes
``activation_checkpointing_enable`` through such a wrapper."""

from trl.models.selective_activation_checkpointing import enable_selective_activation_checkpointing

from mtk.config import RunSettings
from mtk.models import build_model
from mtk.parallel import recompute


def test_recompute_keeps_its_context_past_trls_selective_checkpointing():
    model = build_model("tiny-llama", seed=0)
    enable_selective_activation_checkpointing(model)  # (what SFTTrainer does before the Trainer is built)
    recompute.enable_recompute(model, RunSettings(recompute_activations=True, recompute_granularity="full"))
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    context = layer._gradient_checkpointing_func.keywords["context_fn"]
    assert context.func is recompute._contexts  # (TRL's policy, and mtk's context was never called, before)
