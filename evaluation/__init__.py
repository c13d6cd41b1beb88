"""Measuring decoding: methods timed side by side on the same prompts, HumanEval execution,
mean target log-probability; the figures and CSV plot data (plots.py) the decision models and
the bench share. Imports the runtime only (and the prompt sources)."""
