"""The bottom layer: errors, atomic writes, default paths, the params schema, MLflow tracking.

Imports nothing of specstop's (import-linter contract)."""
