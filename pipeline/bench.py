"""Stage `bench`: every method side by side on the held-out test prompts (`specstop.bench.run`)."""

from specstop.bench import run as bench
from specstop.common.params import Params


def run(params: Params) -> None:
    bench.run(params.bench, params.models, params.collect, params.costs)
