"""Stage `prompts`: the prompt sets, rendered through the target's chat template
(`specstop.prompts.build`)."""

from specstop.common.params import Params
from specstop.decoder.load import chat_text, load_tokenizer
from specstop.prompts.build import build_prompts


def run(params: Params) -> None:
    tokenizer = load_tokenizer(params.models.target, params.models.target_cache)
    build_prompts(params.prompts, lambda request: chat_text(tokenizer, request))
