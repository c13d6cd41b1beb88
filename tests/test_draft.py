"""Both draft families on tiny random targets: building, saving/loading, exactness of the decode
loop with them, the feature head's cache bookkeeping, and one training step."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from transformers import AutoModelForCausalLM

from specstop.drafts.families import (build_compact, build_feature_head, fusion_layers,
                                      most_frequent_tokens)
from specstop.drafts.store import read_meta, save_draft
from specstop.decoder.drafter import FeatureDrafter, ModelDrafter
from specstop.common.errors import SpecstopError
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.drafts.loading import load_runtime, plain_assistant, with_draft
from specstop.drafts.corpus import Sequence, token_counts
from specstop.common.params import DraftSpec, DraftTrainConfig
from specstop.drafts.distill import (DraftDistiller, EpochBatches, collate, fit, lr_factor,
                                     read_curve, resolve_precision)
from specstop.drafts.sweep import acceptance_by_level, by_source, corpus_layers, held_out_prompts
from specstop.prompts.splits import write_split

from conftest import tiny_llama

VOCAB = 97
PRUNED = most_frequent_tokens(torch.arange(VOCAB).float().flip(0), 40, [VOCAB - 1])
EXACT = [DecodeConfig(method="sd", max_depth=4, max_new_tokens=30),
         DecodeConfig(method="mcsd", max_depth=3, mcsd_branching=(2, 2), max_new_tokens=30),
         DecodeConfig(method="ti-mcsd", max_depth=3, ti_width=3, max_new_tokens=30)]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=3)


def drafter_for(target, family: str, vocab_ids):
    if family in ("feature", "fused"):
        head = build_feature_head(target, 1, vocab_ids, fuse=family == "fused").eval()
        return FeatureDrafter(KVModel(head, vocab_size=VOCAB, vocab_ids=vocab_ids))
    draft = build_compact(target, 1, vocab_ids).eval()
    return ModelDrafter(KVModel(draft, vocab_size=VOCAB, vocab_ids=vocab_ids))


def prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (1 + 4 * i,), generator=g) for i in range(n)]


def test_most_frequent_tokens_keeps_the_forced_ids():
    counts = torch.tensor([5, 1, 9, 0, 3])
    assert most_frequent_tokens(counts, 2, [3]).tolist() == [2, 3]
    assert most_frequent_tokens(counts, 0, []).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("family", ["compact", "feature", "fused"])
@pytest.mark.parametrize("pruned", [False, True], ids=["full-vocab", "pruned-vocab"])
@pytest.mark.parametrize("config", EXACT, ids=lambda c: c.method)
def test_both_families_keep_greedy_decoding_exact(target, family, pruned, config):
    vocab_ids = PRUNED if pruned else None
    for prompt in prompts(3):
        ar = generate(KVModel(target), None, prompt, DecodeConfig(method="ar", max_new_tokens=30))
        drafter = drafter_for(target, family, vocab_ids)
        out = generate(KVModel(target), drafter, prompt, config)
        assert out.tokens == ar.tokens
        assert out.stats.draft_steps > 0


def test_pruned_draft_proposes_only_its_vocabulary(target):
    seen = []
    drafter = drafter_for(target, "compact", PRUNED)
    generate(KVModel(target), drafter, prompts(1)[0], EXACT[0],
             hook=lambda record: seen.extend(record.tokens.tolist()))
    assert seen and set(seen) <= set(PRUNED.tolist())


class RecordingFeatureDrafter(FeatureDrafter):
    """Keeps the level-0 draft logits of every round, keyed by the roots' position."""

    def __init__(self, lm: KVModel) -> None:
        super().__init__(lm)
        self.roots: dict[int, torch.Tensor] = {}

    def step(self, tree, level, ids, root_position):
        logits = super().step(tree, level, ids, root_position)
        if level == 0:
            self.roots[root_position] = (ids[0].item(), logits[0].clone())
        return logits


@pytest.mark.parametrize("fuse", [False, True], ids=["last-layer", "fused"])
def test_feature_head_cache_matches_a_fresh_pass(target, fuse):
    """After any accepted path, the head's cached view equals a fresh, uncached pass over the
    committed sequence with the target's own features (no predicted feature is ever kept)."""
    head = build_feature_head(target, 1, None, fuse=fuse).eval()
    drafter = RecordingFeatureDrafter(KVModel(head, vocab_size=VOCAB))
    prompt = prompts(3)[2]
    config = DecodeConfig(method="ti-mcsd", max_depth=3, ti_width=2, max_new_tokens=24)
    out = generate(KVModel(target), drafter, prompt, config)
    assert_roots_match_a_fresh_pass(target, head, drafter, prompt, out.tokens)


def assert_roots_match_a_fresh_pass(target, head, drafter: "RecordingFeatureDrafter",
                                    prompt: torch.Tensor, tokens: list[int]) -> None:
    """Every round's level-0 draft logits equal a fresh pass of the head over the committed
    sequence with the target's own features."""
    sequence = torch.cat([prompt, torch.tensor(tokens)])
    with torch.no_grad():
        states = target(input_ids=sequence[None], output_hidden_states=True).hidden_states
        hidden = head.project(torch.cat([states[i] for i in head.target_layers], dim=-1))
        fresh = head(input_ids=sequence[None, 1:], features=hidden[:, :-1],
                     position_ids=torch.arange(1, sequence.shape[0])[None]).logits[0]
    assert len(drafter.roots) > 3
    for position, (root, logits) in drafter.roots.items():
        assert int(sequence[position]) == root
        torch.testing.assert_close(logits, fresh[position - 1], atol=1e-4, rtol=1e-4)


def test_saved_drafts_load_through_the_runtime(tiny_model_dir: Path, tmp_path: Path):
    runtime = load_runtime(str(tiny_model_dir), None, "float32", "cpu")
    model, tokenizer = runtime.target.model, runtime.tokenizer
    counts = torch.arange(model.config.vocab_size).flip(0)
    vocab_ids = most_frequent_tokens(counts, 512, [tokenizer.eos_token_id])
    prompt = runtime.encode("def add(a, b):")
    ar = runtime.generate(prompt, DecodeConfig(method="ar", max_new_tokens=12)).tokens
    builds = [("compact", build_compact(model, 1, vocab_ids)),
              ("feature", build_feature_head(model, 1, vocab_ids)),
              ("fused", build_feature_head(model, 1, vocab_ids, fuse=True))]
    for name, draft in builds:
        folder = tmp_path / name
        family = "compact" if name == "compact" else "feature"
        save_draft(folder, draft, family, model, vocab_ids, {"name": name}, tokenizer=tokenizer)
        assert read_meta(folder)["family"] == family
        loaded = load_runtime(str(tiny_model_dir), str(folder), "float32", "cpu")
        assert loaded.draft.vocab_ids.tolist() == vocab_ids.tolist()
        assert loaded.drafter.target_layers == getattr(draft, "target_layers", ())
        config = DecodeConfig(method="sd", max_depth=3, max_new_tokens=12)
        out = loaded.generate(prompt, config)
        assert out.tokens == ar
        if family == "feature":  # the saved head drafts what the built one drafts
            fresh = FeatureDrafter(KVModel(draft.eval(), vocab_size=model.config.vocab_size,
                                           vocab_ids=vocab_ids))
            again = generate(runtime.target, fresh, prompt, config)
            assert again.stats.accepted == out.stats.accepted


def test_the_masked_assistant_has_the_compact_drafts_distribution(tiny_model_dir: Path,
                                                                  tmp_path: Path):
    """transformers' assistant (full-vocabulary logits, -inf outside the pruned vocabulary)
    gives every next token the probability specstop's pruned compact draft gives it."""
    runtime = load_runtime(str(tiny_model_dir), None, "float32", "cpu")
    model, tokenizer = runtime.target.model, runtime.tokenizer
    vocab_ids = most_frequent_tokens(torch.randperm(model.config.vocab_size), 300,
                                     [tokenizer.eos_token_id])
    draft = build_compact(model, 1, vocab_ids).eval()
    with torch.no_grad():  # a head that is not the target's rows, as after distillation
        draft.lm_head.weight.mul_(3.0).add_(0.01)
    save_draft(tmp_path / "compact", draft, "compact", model, vocab_ids, {}, tokenizer=tokenizer)
    peer = with_draft(str(tmp_path / "compact"), runtime, tmp_path)
    assistant = plain_assistant(str(tmp_path / "compact"), runtime, tmp_path)
    ids = runtime.encode("def add(a, b):")
    with torch.no_grad():
        hf = torch.softmax(assistant(input_ids=ids[None]).logits[0], dim=-1)
        peer.draft.reset()
        ours = torch.softmax(peer.draft.extend(ids, torch.arange(ids.shape[0]), None), dim=-1)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[vocab_ids] = False
    assert hf.shape == ours.shape == (ids.shape[0], model.config.vocab_size)
    assert float(hf[:, outside].max()) == 0.0
    torch.testing.assert_close(hf, ours, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # the folder as a plain LM: its untrained rows take probability
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "compact").eval()
        unmasked = torch.softmax(plain(input_ids=ids[None]).logits[0], dim=-1)
    assert float(unmasked[:, outside].sum(-1).min()) > 0.1


def test_a_head_for_another_target_is_refused(tiny_model_dir: Path, tmp_path: Path):
    other = tiny_llama(1)
    save_draft(tmp_path / "head", build_feature_head(other, 1, None), "feature", other, None, {})
    with pytest.raises(SpecstopError, match="built for a target with vocabulary 97"):
        load_runtime(str(tiny_model_dir), str(tmp_path / "head"), "float32", "cpu")


LAYERS = (1, 2, -1)  # the corpus layers of a sweep with a fused head on the 3-layer target


def fake_corpus(target, n: int, seed: int) -> list[Sequence]:
    """Sequences labelled by the target itself (teacher-forced hidden states and top-k)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (int(torch.randint(8, 20, (1,), generator=g)),), generator=g)
        with torch.no_grad():
            result = target(input_ids=ids[None], output_hidden_states=True)
        probs = torch.softmax(result.logits[0], -1).topk(8)
        hidden = torch.stack([result.hidden_states[j][0] for j in LAYERS], dim=1)
        out.append(Sequence(ids, 4, hidden.bfloat16(), probs.indices.int(), probs.values.half(),
                            i, 0.0))
    return out


def test_corpus_layers_hold_what_the_sweep_reads():
    feature = DraftSpec(family="feature", layers=1)
    assert fusion_layers(30) == (2, 15, 27)  # EAGLE-3's low, middle and high layers
    assert corpus_layers([feature], 30) == (-1,)
    fused = feature.model_copy(update={"fuse": True})
    assert corpus_layers([feature, fused], 30) == (2, 15, 27, -1)
    assert corpus_layers([], 3) == (-1,) and fusion_layers(3) == (1, 2)


@pytest.mark.parametrize("family", ["compact", "feature", "fused"])
def test_one_training_step_lowers_the_loss(target, family):
    torch.manual_seed(0)
    if family == "compact":
        draft = build_compact(target, 1, PRUNED)
    else:
        draft = build_feature_head(target, 1, PRUNED, fuse=family == "fused")
        assert set(draft.target_layers) <= set(LAYERS)
    draft = draft.float().train()
    config = DraftTrainConfig(lr=3e-3, warmup_steps=1, feature_noise=0.0, unroll=2)
    module = DraftDistiller(draft, "compact" if family == "compact" else "feature", PRUNED,
                            VOCAB, config, LAYERS)
    batch = collate(fake_corpus(target, 6, seed=1))
    optimizer = module.configure_optimizers()
    before, _, _ = module(batch)
    before.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after, _, _ = module(batch)
    assert float(after) < float(before.detach())


@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_lm_head_keeps_the_targets_rows_while_the_rest_learns(target, frozen):
    torch.manual_seed(0)
    draft = build_feature_head(target, 1, PRUNED).float().train()
    rows = target.get_output_embeddings().weight[PRUNED].detach().clone()
    assert torch.equal(draft.lm_head.weight.detach(), rows)
    config = DraftTrainConfig(lr=3e-3, warmup_steps=1, unroll=2, frozen_lm_head=frozen)
    module = DraftDistiller(draft, "feature", PRUNED, VOCAB, config, LAYERS)
    body = draft.fc.weight.detach().clone()
    optimizer = module.configure_optimizers()
    module(collate(fake_corpus(target, 6, seed=1)))[0].backward()
    optimizer.step()
    assert torch.equal(draft.lm_head.weight.detach(), rows) == frozen
    assert not torch.equal(draft.fc.weight.detach(), body)


def test_token_counts_are_the_teachers_mass_over_the_responses(target):
    corpus = fake_corpus(target, 3, seed=2)
    counts = token_counts(corpus, VOCAB)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    for s in corpus:
        for position in range(s.prompt_len - 1, s.ids.shape[0]):  # the prompt's last predicts
            for token, p in zip(s.top_ids[position].tolist(), s.top_probs[position].tolist()):
                expected[token] += p
    assert torch.allclose(counts, expected)
    assert (counts > 0).sum() > len({t for s in corpus for t in s.top_ids[:, 0].tolist()})
    text = [Sequence(**{**s.__dict__, "source": "code"}) for s in fake_corpus(target, 2, 3)]
    assert torch.equal(token_counts(corpus + text, VOCAB), counts)  # responses only


def test_training_resumes_from_its_last_checkpoint(target, tmp_path: Path):
    """A second `fit` on the same folder continues from last.ckpt (steps and curve carry on,
    tokens seen counted in all and in teacher-forced text)."""
    corpus = [Sequence(**{**s.__dict__, "source": "code"}) if i % 3 == 0 else s
              for i, s in enumerate(fake_corpus(target, 8, seed=3))]

    def run(epochs: int) -> dict:
        torch.manual_seed(0)
        draft = build_compact(target, 1, PRUNED).float().train()
        config = DraftTrainConfig(max_epochs=epochs, batch_size=4, val_every_steps=1,
                             precision="32-true", patience=100)
        module = DraftDistiller(draft, "compact", PRUNED, VOCAB, config, LAYERS)
        fit(module, corpus, corpus[:2], tmp_path, None)
        return torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)

    assert run(1)["global_step"] == 2
    resumed = run(2)
    assert resumed["global_step"] == 4 and resumed["epoch"] == 1
    curve = read_curve(tmp_path / "curve.csv")
    assert [int(row["step"]) for row in curve] == [1, 2, 3, 4]  # one validation per step
    batches = [batch for epoch in (0, 1) for batch in _epoch_batches(corpus, 4, epoch)]
    taught = [sum(s.ids.shape[0] - 1 for s in batch) for batch in batches]
    assert [int(row["tokens_seen"]) for row in curve] == list(itertools.accumulate(taught))
    text = [sum(s.ids.shape[0] - 1 for s in batch if s.source == "code") for batch in batches]
    assert [int(row["text_tokens_seen"]) for row in curve] == list(itertools.accumulate(text))


def test_the_learning_rate_warms_up_then_decays_to_final_lr_where_the_budget_ends():
    config = DraftTrainConfig(warmup_steps=4, final_lr=0.1)
    assert [lr_factor(config, s, 0.0) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(config, 10, 0.5) == pytest.approx(0.55)
    assert lr_factor(config, 10, 1.0) == pytest.approx(0.1)
    assert lr_factor(config, 10, 2.0) == pytest.approx(0.1)  # past the budget: held
    flat = config.model_copy(update={"schedule": "constant"})
    assert lr_factor(flat, 1, 0.9) == 0.5 and lr_factor(flat, 10, 0.9) == 1.0


@pytest.mark.parametrize("elapsed_share", [0.0, 0.9])
def test_the_decay_follows_whichever_budget_ends_the_run(target, tmp_path: Path, monkeypatch,
                                                         elapsed_share):
    """The last step's learning rate is set from the larger of the steps' share of max_epochs
    (3 of 4) and the training time's share of max_minutes (the Timer's clock, here fixed)."""
    config = DraftTrainConfig(max_epochs=2, max_minutes=10.0, batch_size=4, val_every_steps=1,
                              warmup_steps=1, lr=2e-3, precision="32-true", patience=100)
    monkeypatch.setattr(pl.callbacks.Timer, "time_elapsed",
                        lambda self, stage="train": elapsed_share * 600.0)
    torch.manual_seed(0)
    module = DraftDistiller(build_compact(target, 1, PRUNED).float().train(), "compact", PRUNED,
                            VOCAB, config, LAYERS)
    fit(module, fake_corpus(target, 8, seed=3), fake_corpus(target, 2, seed=4), tmp_path, None)
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 4
    lr = state["optimizer_states"][0]["param_groups"][0]["lr"]
    assert lr == pytest.approx(2e-3 * lr_factor(config, 3, max(0.75, elapsed_share)))
    assert lr < 2e-3 * (0.25 if elapsed_share else 0.3)


def _epoch_batches(corpus: list[Sequence], size: int, epoch: int) -> list[list[Sequence]]:
    """The batches `fit` trains on in `epoch` (grouped by length, the default)."""
    sampler = EpochBatches(len(corpus), size, seed=0, lengths=[s.ids.shape[0] for s in corpus])
    sampler.epoch = epoch
    return [[corpus[i] for i in batch] for batch in sampler]


def test_length_grouped_batches_pad_less_and_resume_alike():
    """Grouped by length, an epoch is still a permutation of its own (drawn from seed and epoch
    alone, so a resumed run continues it), and its batches pad far less than random ones."""
    lengths = torch.randint(20, 400, (203,), generator=torch.Generator().manual_seed(0)).tolist()

    def epoch(grouped: bool, number: int, trained: int = 0) -> list[list[int]]:
        sampler = EpochBatches(len(lengths), 8, seed=1, lengths=lengths if grouped else None)
        sampler.epoch, sampler.trained = number, trained
        return list(sampler)

    def padded(batches: list[list[int]]) -> float:
        return sum(max(lengths[i] for i in b) * len(b) for b in batches) / sum(lengths)

    grouped = [epoch(True, number) for number in range(3)]
    assert all(sorted(sum(batches, [])) == list(range(len(lengths))) for batches in grouped)
    assert sorted(map(len, grouped[0])) == [3] + [8] * 25
    assert len({str(batches) for batches in grouped}) == 3
    assert epoch(True, 2, trained=5) == grouped[2][5:]
    assert padded(grouped[0]) < 1.25 < 1.5 < padded(epoch(False, 0))


def test_held_out_responses_are_grouped_by_source_and_absent_without_the_split(tmp_path: Path):
    assert held_out_prompts(tmp_path) == {"text": [], "source": []}  # an older prompts folder
    write_split([{"prompt_id": str(i), "source": name, "request": f"r{i}", "text": f"t{i}",
                  "split": "heldout"} for i, name in enumerate(["tasks", "quiz", "tasks"])],
                tmp_path / "heldout.parquet")
    held = held_out_prompts(tmp_path)
    assert held == {"text": ["t0", "t1", "t2"], "source": ["tasks", "quiz", "tasks"]}
    sequences = [Sequence(torch.zeros(3, dtype=torch.long), 1, torch.zeros(3, 1, 2),
                          torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1), i, 0.0)
                 for i in (2, 0, 1)]
    groups = by_source(sequences, held["source"])
    assert list(groups) == ["quiz", "tasks"]
    assert [s.prompt_index for s in groups["tasks"]] == [2, 0]
    assert [s.prompt_index for s in groups["quiz"]] == [1]
    assert by_source([], []) == {}


def test_acceptance_by_level_is_conditional_on_the_level_above():
    assert acceptance_by_level([0, 1, 2, 2, 3], 3) == [4 / 5, 3 / 4, 1 / 3]
    assert acceptance_by_level([0, 0], 2) == [0.0, None]


@pytest.mark.parametrize("flags, native", [("fpu sse avx2 fma", False),
                                           ("avx2 avx512f avx512_bf16", True),
                                           ("avx2 amx_bf16 amx_tile", True)])
def test_auto_precision_and_dtype_follow_the_cpu_flags(tmp_path, monkeypatch, flags, native):
    from specstop.decoder import load as models

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(models, "CPUINFO", cpuinfo)
    models.cpu_has_bf16.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert resolve_precision("auto", cpu) == ("bf16-mixed" if native else "32-true")
        assert models.resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
        assert resolve_precision("32-true", cpu) == "32-true"  # an explicit choice is kept
    finally:
        models.cpu_has_bf16.cache_clear()


def test_a_draft_slower_than_ar_is_named_with_its_likely_cause(monkeypatch):
    from specstop.drafts import sweep as draft
    from specstop.drafts.sweep import _useless_draft_warning

    monkeypatch.setattr(draft, "cpu_has_bf16", lambda: False)

    best = {"name": "feature-l1-v4096", "measured_speedup": 0.94, "alpha": 0.2, "c": 0.05,
            "dtype": "float32"}
    warning = _useless_draft_warning(best, "32-true")
    assert "feature-l1-v4096" in warning and "0.94x" in warning
    assert "too little training" in warning and "without native bf16" in warning
    assert "fp32 verification" in _useless_draft_warning({**best, "alpha": 0.6}, "32-true")
    assert _useless_draft_warning({**best, "measured_speedup": 1.2}, "32-true") is None
