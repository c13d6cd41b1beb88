"""Prompt sets: sources (HumanEval, HF datasets, JSONL), de-duplicated train/val/test splits.

Imports only `common`."""
