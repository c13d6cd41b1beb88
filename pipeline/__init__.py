"""The `specstop` CLI and one thin module per DVC stage: each reads its typed config and calls
the library function that does the work (the top layer)."""
