"""Draft models for a target: families, building, draft folders, loading a Runtime, the
distillation corpus, distillation and the draft sweep.

Beside `models` (neither imports the other); above the runtime and `evaluation`."""
