"""Shared fixtures: tiny random Llamas (ids only, or saved as model folders for the CLI) and the
embedded model (integration); with pytest-xdist (`make test`), one core per worker and the
longest files first."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

# Under pytest-xdist each worker gets one core: one torch thread here and in every subprocess
# (set before torch is imported); two threads per worker would fight over two cores.  Each
# worker is also pinned to an equal share of the cores (one each on two), which its
# subprocesses inherit, so that what sizes its threads or processes by the cores it may use
# (collect's cost model: `_all_cores`) does not take the other worker's.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pin_worker(worker: str, workers: int) -> None:
    """Pin xdist worker `worker` (gw0, gw1, ...; "" in the controller: nothing) to its equal
    share of the cores this process may use; nothing where there are fewer cores than workers."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cores) // workers
    if worker and share:
        index = int(worker.removeprefix("gw"))
        os.sched_setaffinity(0, set(cores[index * share:(index + 1) * share]))


if WORKERS > 1:
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    pin_worker(os.environ.get("PYTEST_XDIST_WORKER", ""), WORKERS)

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerBase)

from specstop.decoder.load import DEFAULT_CACHE, convert_embedded

ROOT = Path(__file__).resolve().parents[1]

if WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# `make test` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: a worker takes a whole
# file (its module fixtures built once) and the files go out in collection order, so the
# longest start first and none of them is left to run alone at the end.
LONGEST_FIRST = ["test_pipeline_smoke.py", "test_kill_resume.py", "test_losslessness_mc.py",
                 "test_cli.py", "test_integration.py", "test_compiled.py", "test_faults.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in that order; the others after them, as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
    """The de-quantised embedded target (converted once, shared with the pipeline); under a
    file lock, so that of two workers one converts and the other waits for it."""
    cache = ROOT / DEFAULT_CACHE
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return convert_embedded(cache)


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
