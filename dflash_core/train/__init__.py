"""Drafter training: prompts and target regeneration (data), anchors/mask/loss (recipe),
target feature cache (features) and the optimisation loop (loop)."""
