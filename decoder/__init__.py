"""The runtime: trees and masks, Proposal -> Scores -> Verdict, KV caches, stopping policies,
the decode loop, measured costs, loading models.

Imports only `features` and `common`: nothing of drafts, decision models, evaluation or the CLI
(import-linter contract)."""
