"""The early-stop decision models: logged rows -> fit -> replay -> tuned rules -> TorchScript,
tracked in MLflow.

Imports the runtime (`decoder`) for its rules, costs and loop records; never drafts or the CLI."""
