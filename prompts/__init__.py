"""Prompt sets: sources (HumanEval, HF datasets, JSONL, requests the target writes itself),
de-duplicated train/val/test splits.

Imports only `common`."""
