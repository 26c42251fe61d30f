"""TransformerEngine's FP8 recipes: names megatron-core subclasses or compares against; none is ever used here."""

from transformer_engine.common import recipe  # noqa: F401
