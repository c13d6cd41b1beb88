"""Project-wide utilities: errors, atomic writes, the params schema (imports nothing of specstop)."""
