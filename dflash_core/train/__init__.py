"""Drafter training: prompts and the target's replies (prompt, prompt_sources, code_prompts,
math_prompts, shards, data, answers), the recipe (recipe, batch, features, drafter_init), and the
`train` command (run, with args, samples, state, loop and evaluate)."""
