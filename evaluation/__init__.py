"""Measuring decoding: methods timed side by side on the same prompts, HumanEval execution,
mean target log-probability. Imports the runtime only (and the prompt sources)."""
