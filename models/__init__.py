"""The early-stop decision models: logged rows -> fit -> replay -> tuned rules -> TorchScript,
tracked in MLflow.

Imports the logged rows (`collection`), the offline replay (`replay`), the figures
(`evaluation.plots`) and the runtime (`decoder`) for its rules, costs and loop records; never
drafts or the CLI."""
