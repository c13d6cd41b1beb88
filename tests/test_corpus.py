"""The draft corpus' batched generation on a tiny random target: the teacher's data it keeps at
every position equals a fresh teacher-forced pass, greedy rows equal `ar`, rows end at their
EOS or budget, and a batch of mixed prompt lengths and temperatures changes none of that; the
train prompts' mix of sources; the teacher-forced text corpus: the same fields and teacher
data, its shards resumed, a bad source named by its key."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specstop.common.errors import SpecstopError
from specstop.common.params import CorpusConfig, TextCorpusConfig
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.drafts.corpus import Sequence, _generate_batch, build_corpus, corpus_timing
from specstop.drafts.sweep import draft_prompts
from specstop.drafts.text_corpus import build_text_corpus, label_windows, source_files

from conftest import tiny_llama

LAYERS = (1, 2, -1)
TOP_K = 5


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=3)


def prompt_rows(temperatures: list[float]) -> list[tuple[torch.Tensor, int, float]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 97, (3 + 5 * i,), generator=g), i, t)
            for i, t in enumerate(temperatures)]


def assert_matches_a_fresh_pass(target, sequence: Sequence) -> None:
    """Hidden states of LAYERS and the top-k distribution at every position, as one unbatched
    teacher-forced pass over the sequence computes them."""
    with torch.no_grad():
        out = target(input_ids=sequence.ids[None], output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)
    torch.testing.assert_close(sequence.hidden.float(), hidden, atol=2e-2, rtol=2e-2)  # bf16
    probs = torch.softmax(out.logits[0].float(), -1)
    top = probs.topk(TOP_K)
    # top-1 always; the rest where the fresh pass does not tie
    assert torch.equal(sequence.top_ids[:, 0].long(), top.indices[:, 0])
    picked = probs.gather(1, sequence.top_ids.long())
    torch.testing.assert_close(sequence.top_probs.float(), picked, atol=2e-3, rtol=2e-3)


def test_greedy_rows_equal_ar_and_every_row_keeps_a_teacher_forced_view(target):
    rows = prompt_rows([0.0, 1.0, 0.0, 0.7])
    config = CorpusConfig(temperatures=[0.0], max_new_tokens=12, batch_size=4, top_k=TOP_K)
    made = _generate_batch(target, rows, config, LAYERS, eos=None, seed=3)
    assert [s.prompt_index for s in made] == [0, 1, 2, 3]
    for sequence, (prompt, _, temperature) in zip(made, rows):
        assert sequence.temperature == temperature and sequence.prompt_len == prompt.shape[0]
        assert sequence.ids.shape[0] == prompt.shape[0] + 12
        assert sequence.hidden.shape == (sequence.ids.shape[0], len(LAYERS), 32)
        assert_matches_a_fresh_pass(target, sequence)
        if temperature == 0:
            ar = generate(KVModel(target), None, prompt,
                          DecodeConfig(method="ar", max_new_tokens=12))
            assert sequence.ids[prompt.shape[0]:].tolist() == ar.tokens


def test_a_row_ends_after_its_eos_and_the_others_go_on(target):
    rows = prompt_rows([0.0, 0.0, 0.0])
    config = CorpusConfig(temperatures=[0.0], max_new_tokens=10, batch_size=3, top_k=TOP_K)
    free = _generate_batch(target, rows, config, LAYERS, eos=None, seed=0)
    eos = int(free[1].ids[free[1].prompt_len + 3])  # row 1's fourth response token
    ended = _generate_batch(target, rows, config, LAYERS, eos=eos, seed=0)
    for before, after in zip(free, ended):
        response = before.ids[before.prompt_len:].tolist()
        cut = response.index(eos) + 1 if eos in response else len(response)
        assert after.ids[after.prompt_len:].tolist() == response[:cut]
        assert_matches_a_fresh_pass(target, after)
    assert ended[1].ids.shape[0] - ended[1].prompt_len <= 4


def test_sampled_rows_follow_the_seed(target):
    rows = prompt_rows([1.0, 1.0])
    config = CorpusConfig(temperatures=[1.0], max_new_tokens=8, batch_size=2, top_k=TOP_K)
    first, again, other = (_generate_batch(target, rows, config, LAYERS, None, seed)
                           for seed in (5, 5, 6))
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first, again))
    assert any(not torch.equal(a.ids, b.ids) for a, b in zip(first, other))


def write_split(folder, sources: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    pq.write_table(pa.table({"prompt_id": [f"p{i}" for i in range(len(sources))],
                             "text": [f"t{i}" for i in range(len(sources))], "source": sources}),
                   folder / "draft.parquet")


def test_domains_take_their_share_of_each_source_in_split_order(tmp_path):
    write_split(tmp_path, ["code", "chat", "code", "chat", "code", "code"])
    assert draft_prompts(tmp_path, "draft", None, None)["text"] == [f"t{i}" for i in range(6)]
    assert draft_prompts(tmp_path, "draft", 3, None)["source"] == ["code", "chat", "code"]
    mixed = draft_prompts(tmp_path, "draft", 4, {"code": 0.75, "chat": 0.25})
    assert mixed == {"prompt_id": ["p0", "p1", "p2", "p4"], "text": ["t0", "t1", "t2", "t4"],
                     "source": ["code", "chat", "code", "code"]}
    with pytest.raises(SpecstopError, match="draft.domains: no draft prompts from source 'math'"):
        draft_prompts(tmp_path, "draft", 4, {"code": 0.5, "math": 0.5})


def test_a_corpus_resumes_its_shards_and_times_the_ones_it_made(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["def add(a, b):", "Name three colours.", "x = 1"]
    config = CorpusConfig(temperatures=[0.0, 1.0], max_new_tokens=6, batch_size=4, top_k=TOP_K)
    folder = tmp_path / "train"
    made = build_corpus(model, tokenizer, texts, folder, config, (-1,), 0, "test", tmp_path / "old")
    assert sorted((s.prompt_index, s.temperature) for s in made) == [
        (i, t) for i in range(3) for t in (0.0, 1.0)]
    timing = corpus_timing(folder)
    assert timing["shards"] == 2 and timing["response_tokens"] == sum(
        s.ids.shape[0] - s.prompt_len for s in made) and timing["tokens_per_s"] > 0
    (folder / "shard-00001.pt").unlink()
    again = build_corpus(model, tokenizer, texts, folder, config, (-1,), 0, "test",
                         tmp_path / "old")
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.hidden, b.hidden)
               for a, b in zip(made, again))


def test_teacher_forced_windows_hold_the_decoded_fields_and_a_plain_forwards_top_k(target):
    decoded = _generate_batch(target, prompt_rows([0.0]), CorpusConfig(
        temperatures=[0.0], max_new_tokens=4, batch_size=1, top_k=TOP_K), LAYERS, None, 0)[0]
    windows = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    made = label_windows(target, windows, ["code", "docs", "code"], LAYERS, TOP_K, first=6)
    assert [(s.source, s.prompt_index, s.prompt_len) for s in made] == [
        ("code", 6, 1), ("docs", 7, 1), ("code", 8, 1)]
    assert decoded.source == "response"
    for sequence, ids in zip(made, windows):
        assert sequence.__dict__.keys() == decoded.__dict__.keys()
        assert all(getattr(sequence, k).dtype == v.dtype and getattr(sequence, k).shape[1:]
                   == v.shape[1:] for k, v in decoded.__dict__.items() if torch.is_tensor(v))
        assert torch.equal(sequence.ids, ids)
        assert_matches_a_fresh_pass(target, sequence)


def write_sources(folder) -> None:
    folder.mkdir()
    (folder / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    (folder / "b.md").write_text("# Colours\n\nRed, green and blue are colours.\n" * 20)
    (folder / "skipped.json").write_text("{}")


def test_a_text_corpus_resumes_after_a_lost_shard(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    write_sources(tmp_path / "src")
    assert [p.name for p in source_files(str(tmp_path / "src"))] == ["a.py", "b.md"]
    config = TextCorpusConfig(tokens=80, sources={str(tmp_path / "src"): 1.0}, window=16,
                              batch_size=2)
    folder = tmp_path / "text"
    made = build_text_corpus(model, tokenizer, config, TOP_K, folder, (-1,), 0, tmp_path / "old")
    assert len(made) == 5 and all(s.ids.shape == (16,) for s in made)
    timing = corpus_timing(folder)
    assert timing["shards"] == 3 and timing["response_tokens"] == 5 * 15
    (folder / "shard-00001.pt").unlink()
    again = build_text_corpus(model, tokenizer, config, TOP_K, folder, (-1,), 0, tmp_path / "old")
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.top_probs, b.top_probs)
               for a, b in zip(made, again))
    with pytest.raises(SpecstopError, match="fewer than its share"):
        build_text_corpus(model, tokenizer, config.model_copy(update={"tokens": 10**6}),
                          TOP_K, folder, (-1,), 0, tmp_path / "old")


def test_a_bad_text_source_is_a_one_line_error_naming_the_key(tmp_path):
    with pytest.raises(SpecstopError, match=r"^draft\.corpus\.text\.sources: 'no/such' is "
                                            r"neither code nor docs nor an existing file"):
        source_files("no/such")
    (tmp_path / "data.json").write_text("{}")
    with pytest.raises(SpecstopError, match="holds no .py/.md/.rst/.txt files"):
        source_files(str(tmp_path))
    code = source_files("code")
    assert code == sorted(code) and all(p.suffix == ".py" and "site-packages" not in p.parts
                                        for p in code)
