"""Every default path of a project, once: the params schema and the loaders read them here."""

from pathlib import Path

TARGET_CACHE = Path("data/models/target")  # the embedded target, converted (in a project)
PROMPTS = Path("data/prompts")
VERIFY_COSTS = Path("data/costs/verify.json")
DRAFT = Path("data/draft")
COLLECT = Path("data/collect")
TRAIN = Path("data/train")
EXPORT = Path("data/export")
METRICS = Path("metrics")
STAGE_METRICS = METRICS / "stages"  # <stage>.json: wall seconds, what it achieved, the machine
DEFAULT_DRAFT = "layers:2"  # the target's first two layers: needs no draft stage
TRUNCATED_PREFIX = "layers:"  # `layers:N`, a draft made of the target's first N layers
