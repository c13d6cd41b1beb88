"""Stage `draft`: build, distil and compare drafts for the target (`specstop.drafts.sweep`)."""

from specstop.common.params import Params
from specstop.drafts import sweep


def run(params: Params) -> dict:
    return sweep.run(params.draft, params.models, params.mlflow.store("draft"))
