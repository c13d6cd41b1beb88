"""Stage `collect`'s logging and the logged rows: rounds decoded with the superset tree and
written as Parquet parts (collection.py, rows.py), read back as training and replay data by
split (data.py).

Imports the runtime (`decoder`) for its loop and records, and the prompt splits; never the
decision models, drafts or the CLI."""
