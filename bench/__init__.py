"""Stage `bench`'s work: every method and peer on the test prompts, and its report.

Imports drafts, decision models, evaluation and the runtime; nothing imports it but the CLI."""
