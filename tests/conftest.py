"""Shared fixtures: tiny random Llamas (ids only, or saved as model folders for the CLI) and the
embedded model (integration)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerBase)

from specstop.decoder.load import DEFAULT_CACHE, convert_embedded

ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(seed: int, layers: int = 2, vocab: int = 97, hidden: int = 32) -> LlamaForCausalLM:
    """A randomly initialised fp32 Llama small enough for exact unit tests."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees partly."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return copy


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The de-quantised embedded target (converted once, shared with the pipeline)."""
    return convert_embedded(ROOT / DEFAULT_CACHE)


TINY_CONTEXT = 96  # max_position_embeddings of the tiny CLI models: long prompts overflow it


def save_tiny_llama(tokenizer: PreTrainedTokenizerBase, folder: Path, seed: int = 0,
                    context: int = TINY_CONTEXT) -> Path:
    """A tiny random Llama over `tokenizer`'s vocabulary, saved with it as a local model folder."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the embedded tokenizer (49,152 tokens): loads in a second."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def other_tokenizer_model_dir(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `tiny_model_dir`, but its tokenizer has two extra tokens: not a valid draft for it."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    tokenizer.add_tokens(["<specstop-extra-0>", "<specstop-extra-1>"])
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("tiny-llama-other-tokenizer"))


@pytest.fixture(scope="session")
def tiny_target(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model_dir` with room for chat-templated prompts (512 positions): a target for
    stage runs."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("tiny-target"), context=512)


def write_chat_prompts(prompts: Path, target: Path, splits: dict[str, list[str]]) -> None:
    """`prompts/<split>.parquet` as stage `prompts` writes them: each request rendered through
    `target`'s chat template, with the id `p-<request>`."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts.mkdir(parents=True)
    for split, requests in splits.items():
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r}], tokenize=False,
                                               add_generation_prompt=True) for r in requests]
        pq.write_table(pa.table({"prompt_id": [f"p-{r}" for r in requests],
                                 "source": ["requests"] * len(requests), "text": texts}),
                       prompts / f"{split}.parquet")
