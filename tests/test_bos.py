"""A base model (no chat template) sees its tokenizer's BOS before every prompt, whichever way
the prompt reaches it: `generate` (with or without --no-chat), stage `prompts`' text as the
draft corpus, `collect` and `bench` tokenize it; chat-rendered text keeps what its template
gives."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase

from specstop.decoder.load import chat_text, with_bos
from specstop.drafts.loading import load_runtime
from specstop.pipeline import prompts as prompts_stage
from specstop.pipeline.params import checked_params
from specstop.prompts.splits import SPLITS

from conftest import save_tiny_llama

REQUESTS = ["What is 2 + 2?", "def f(x):\n    return x\n", "  spaces  "]
PLAIN_TEMPLATE = ("{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}Assistant:{% endif %}")


@pytest.fixture(scope="module")
def base_model_dir(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose (Llama-style) tokenizer writes a BOS before text and has no
    chat template."""
    tokenizer = LlamaTokenizer.from_pretrained(embedded_dir, add_bos_token=True)
    tokenizer.chat_template = None
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("base-model"), context=512)


@pytest.fixture(scope="module")
def base_tokenizer(base_model_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    assert tokenizer.bos_token is not None and not tokenizer.chat_template
    return tokenizer


def ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_with_bos_adds_the_bos_once(base_tokenizer: PreTrainedTokenizerBase):
    bos = base_tokenizer.bos_token
    assert with_bos(base_tokenizer, "hi") == bos + "hi"
    assert with_bos(base_tokenizer, bos + "hi") == bos + "hi"
    base_tokenizer = base_tokenizer.__class__.from_pretrained(base_tokenizer.name_or_path)
    base_tokenizer.bos_token = None
    assert with_bos(base_tokenizer, "hi") == "hi"


def test_a_tokenizer_that_puts_no_bos_before_text_gets_none(embedded_dir: Path):
    """SmolLM2's (GPT-2 style) tokenizer names a BOS but never writes it before plain text."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    tokenizer.chat_template = None
    assert tokenizer.bos_token is not None
    assert with_bos(tokenizer, "hi") == "hi" == chat_text(tokenizer, "hi")


def test_every_runtime_path_starts_with_one_bos(base_model_dir: Path,
                                               base_tokenizer: PreTrainedTokenizerBase):
    """generate (chat or --no-chat), and stage `prompts`' text as collect and bench encode it."""
    runtime = load_runtime(str(base_model_dir), None, "float32", "cpu")
    bos = base_tokenizer.bos_token_id
    for request in REQUESTS:
        expected = [bos, *ids(base_tokenizer, request)]
        stage_text = chat_text(base_tokenizer, request)
        for encoded in (runtime.encode(request), runtime.encode(request, chat=False),
                        runtime.encode(stage_text, chat=False, special_tokens=False),
                        runtime.encode(with_bos(base_tokenizer, request), chat=False)):
            assert encoded.tolist() == expected


def test_chat_rendered_text_keeps_what_the_template_gives(base_model_dir: Path):
    runtime = load_runtime(str(base_model_dir), None, "float32", "cpu")
    runtime.tokenizer.chat_template = PLAIN_TEMPLATE  # a template that writes no BOS
    for request in REQUESTS:
        rendered = f"User: {request}\nAssistant:"
        assert runtime.encode(request).tolist() == ids(runtime.tokenizer, rendered)
        assert runtime.encode(rendered, chat=False, special_tokens=False).tolist() == \
            ids(runtime.tokenizer, rendered)


def test_the_prompts_stage_text_starts_with_the_bos(base_model_dir: Path,
                                                    base_tokenizer: PreTrainedTokenizerBase,
                                                    tmp_path: Path):
    """The draft corpus tokenizes stage `prompts`' text without special tokens."""
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps({"q": f"Question number {i}?"}) + "\n"
                              for i in range(10)))
    params = checked_params({"models": {"target": str(base_model_dir)},
                             "prompts": {"out": str(tmp_path / "prompts"),
                                         "sources": [{"path": str(source), "field": "q"}]}})
    prompts_stage.run(params)
    rows = [row for split in SPLITS
            for row in pq.read_table(tmp_path / "prompts" / f"{split}.parquet").to_pylist()]
    assert len(rows) == 10
    bos = base_tokenizer.bos_token_id
    for row in rows:
        assert ids(base_tokenizer, row["text"]) == [bos, *ids(base_tokenizer, row["request"])]
