"""The speculative decoding runtime: drafting, tree masks, verification, KV caches, stopping."""
