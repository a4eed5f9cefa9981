"""Drafter training: prompts and target regeneration (data), anchors/mask/loss/schedule (recipe),
the target feature cache (features), padded multi-sequence batches (batch), a fresh drafter
(drafter_init) and the `train` command that ties them together (run)."""
