"""Stage `collect`: rows and labels, resume, torchrun sharding, validated reads."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specstop.decoder import costs as costs_module
from specstop.decoder.costs import CostModel, RoundWork
from specstop.decoder.drafter import ModelDrafter
from specstop.drafts.store import DRAFT_META_FILE
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.decoder.policy import FixedDepth
from specstop.decoder.sampling import Sampling
from specstop.common.errors import DataError
from specstop.collection import data
from specstop.collection.rows import (LOOKUP, RoundLogger, read_lookup_rows, read_part,
                                      read_parts, write_part)
from specstop.common.errors import SpecstopError
from specstop.common.params import validate
from specstop.pipeline import collect, prepare
from specstop.replay.lookup_chains import lookup_alone

from conftest import perturbed_copy, tiny_llama, write_chat_prompts

REQUESTS = ["add two numbers", "reverse a list", "sort words", "count vowels", "is it prime",
            "say hello", "fizz buzz"]


def make_workdir(folder: Path, target: Path) -> dict:
    """Prompts of two splits and params for a tiny collection run in `folder`."""
    prompts = folder / "data" / "prompts"
    write_chat_prompts(prompts, target, {"train": REQUESTS[:5], "val": REQUESTS[5:]})
    return {"models": {"target": str(target), "draft": "layers:1", "dtype": "float32",
                       "device": "cpu"},
            "collect": {"prompts": str(prompts), "out": str(folder / "data" / "collect"),
                        "part_size": 2, "max_new_tokens": 10, "max_depth": 4, "ti_width": 2}}


def sorted_rows(folder: Path) -> list[tuple]:
    table = read_parts(folder)
    return sorted(zip(*[table.column(c).to_pylist() for c in table.column_names]))


def test_collect_writes_labelled_rows_and_resumes(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = make_workdir(tmp_path, tiny_target)
    collect.run(validate(params))
    out = Path(params["collect"]["out"])
    parts = sorted((out / "parts").glob("*.parquet"))
    assert [p.stem for p in parts] == ["train-00000", "train-00001", "train-00002", "val-00000"]
    assert sorted(p.stem for p in (out / "parts" / LOOKUP).glob("*.parquet")) == \
        [p.stem for p in parts]  # greedy parts log their lookup chains beside them
    assert set(read_lookup_rows(out)["split"]) <= {"train", "val"}
    first = sorted_rows(out)
    table = read_parts(out)
    labels = table.column("label").to_numpy()
    assert (labels >= 0).any() and table.num_rows == len(first)
    assert set(table.column("prompt_id").to_pylist()) == {f"p-{r}" for r in REQUESTS}
    for name in ("schema.json", "costs.json"):
        assert (out / name).is_file()
    by_split = json.loads(Path("metrics/collect.json").read_text())["by_split"]
    assert {split: v["prompts"] for split, v in by_split.items()} == {"train": 5, "val": 2}
    assert all(0 <= v["first_candidate_acceptance"] <= 1 for v in by_split.values())
    # resume: a lost part is redone, finished ones are not touched, the data is the same
    stamps = {p: p.stat().st_mtime_ns for p in parts}
    parts[1].unlink()
    collect.run(validate(params))
    assert all(p.stat().st_mtime_ns == stamps[p] for p in parts if p != parts[1])
    assert sorted_rows(out) == first
    # other options: the old parts are not mixed in, the collection starts over
    params["collect"]["max_depth"] = 3
    collect.run(validate(params))
    depths = read_parts(out).column("depth").to_numpy()
    assert depths.max() == 3 and sorted_rows(out) != first


def test_the_cost_model_prices_the_target_with_the_table_the_runtime_pads_with(
        tiny_target, tmp_path, monkeypatch):
    """With stage prepare's table the cost model's target curve is that table, read as the
    loop reads it, and the draft's step is rescaled to its time; without one it is measured."""
    monkeypatch.chdir(tmp_path)
    params = make_workdir(tmp_path, tiny_target)
    params["collect"].update(max_prompts=1, splits=["val"])
    costs = Path(params["collect"]["out"]) / "costs.json"
    collect.run(validate(params))
    measured = json.loads(costs.read_text())
    assert measured["target_source"] == "measured"
    params["costs"] = {"widths": [2, 4], "context": 16, "repeats": 2}
    prepare.run(validate(params))
    table = json.loads(Path("data/costs/verify.json").read_text())
    table["seconds"] = {"1": 1000.0, "2": 1100.0, "4": 1200.0}  # a host 1000x slower than this
    Path("data/costs/verify.json").write_text(json.dumps(table))
    costs.unlink()
    def clocked(lm, name, widths, context=200, repeats=15):  # this host: a step 10 ms, draft 2
        step = 0.01 if name == "target" else 0.002
        return costs_module.VerifyCosts(name, "float32", "cpu", context,
                                        {n: step for n in {1, *widths}}, lm.kernel)
    monkeypatch.setattr(costs_module, "measure_verify_costs", clocked)
    collect.run(validate(params))  # the parts are kept: only the cost model is measured
    priced = json.loads(costs.read_text())
    assert priced["target_source"] == "runtime"
    assert priced["target"]["seconds"] == table["seconds"]
    model = CostModel.load(costs)
    assert model.target_step == 1000.0 and model.target.price(4) == pytest.approx(1.2)
    # the draft's step in the table's time: a fifth of a target step, as timed on this host
    assert list(priced["draft"]["seconds"].values()) == pytest.approx(
        [200.0] * len(priced["draft"]["seconds"]))
    assert priced["c"] == pytest.approx(0.2)


def test_collect_logs_each_temperature_in_parts_of_its_own(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = make_workdir(tmp_path, tiny_target)
    params["collect"].update(max_prompts=2, temperatures=[0.0, 1.0])
    collect.run(validate(params))
    out = Path(params["collect"]["out"])
    assert sorted(p.stem for p in (out / "parts").glob("*.parquet")) == [
        "train-00000", "train-00000-T1", "val-00000", "val-00000-T1"]
    rows = read_parts(out).to_pandas()
    assert set(rows["temperature"]) == {0.0, 1.0}
    greedy, sampled = rows[rows["temperature"] == 0], rows[rows["temperature"] == 1]
    labelled = greedy[greedy["label"] >= 0]
    assert (labelled["accept_prob"] == labelled["label"]).all()
    assert sampled["accept_prob"].between(0, 1).all() and sampled["accept_prob"].nunique() > 2
    assert data.load(out, temperature=1.0).val.rows["temperature"].eq(1.0).all()
    chains = read_lookup_rows(out)  # sampled ones too, where the text repeats (see below)
    assert sorted(p.stem for p in (out / "parts" / LOOKUP).glob("*.parquet")) == [
        "train-00000", "train-00000-T1", "val-00000", "val-00000-T1"]
    assert (chains[chains["temperature"] == 0]["accept_after"].map(len) == 0).all()
    overhead = json.loads((out / "costs.json").read_text())["round_overhead"]
    assert set(overhead) == {"tree", "static"}
    assert all(set(by_temperature) == {"greedy", "sampled"}
               and all(set(work) == {"base", "per_level"} and np.isfinite(list(work.values())).all()
                       for work in by_temperature.values())
               for by_temperature in overhead.values())
    assert CostModel.load(out / "costs.json").overhead(True) == RoundWork(
        **overhead["tree"]["sampled"])


def test_collect_refuses_prompts_the_draft_learned_from(tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = make_workdir(tmp_path, tiny_target)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / DRAFT_META_FILE).write_text(json.dumps(
        {"family": "compact", "vocab_ids": None, "trained_on_prompts": ["p-other", "p-fizz buzz"]}))
    params["models"]["draft"] = str(draft)
    with pytest.raises(SpecstopError, match=r"^collect: the val prompts of .*: 1 of 2 prompts "
                       r"\(e.g. p-fizz buzz\) are among those the draft .* was distilled on"):
        collect.run(validate(params))
    assert not (tmp_path / "data" / "collect" / "parts").exists()  # refused before any work


def logged(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "parts").glob("*.parquet"))}


def test_a_typo_loses_no_row_and_other_settings_are_set_aside(tiny_target, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = make_workdir(tmp_path, tiny_target)
    collect.run(validate(params))
    out = Path(params["collect"]["out"])
    first = logged(out)
    assert len(first) == 4
    # a typo'd draft path: refused before the log is touched
    typo = copy.deepcopy(params)
    typo["models"]["draft"] = "data/draft/defualt"
    with pytest.raises(SpecstopError, match="data/draft/defualt: not found"):
        collect.run(validate(typo))
    assert logged(out) == first and not (out / "stale").exists()
    # the corrected re-run resumes: nothing is redone
    stamps = {p: p.stat().st_mtime_ns for p in (out / "parts").glob("*.parquet")}
    collect.run(validate(params))
    assert {p: p.stat().st_mtime_ns for p in (out / "parts").glob("*.parquet")} == stamps
    # other settings: the log is moved aside, never deleted
    other = copy.deepcopy(params)
    other["collect"]["max_depth"] = 3
    collect.run(validate(other))
    stale = sorted((out / "stale").glob("parts-*"))
    assert len(stale) == 1
    assert {p.name: p.read_bytes() for p in sorted(stale[0].glob("*.parquet"))} == first
    assert logged(out) != first
    # back to the first settings: that log comes back as it was, and the other is kept aside
    second = logged(out)
    collect.run(validate(params))
    assert logged(out) == first
    stale = sorted((out / "stale").glob("parts-*"))
    assert [{p.name: p.read_bytes() for p in sorted(s.glob("*.parquet"))} for s in stale] \
        == [second]


def test_two_torchrun_processes_equal_one(tiny_target, tmp_path):
    """`--launch` with `collect.processes: 2` becomes torchrun with two workers, whose shards
    are the rows of one process (`specstop collect` alone)."""
    single, double = tmp_path / "single", tmp_path / "double"
    for folder in (single, double):
        folder.mkdir()
        params = make_workdir(folder, tiny_target)
        params["collect"]["processes"] = 2
        (folder / "params.yaml").write_text(__import__("yaml").safe_dump(params))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "specstop.pipeline.cli", "collect"]
    subprocess.run(cli, cwd=single, env=env, check=True, capture_output=True)
    done = subprocess.run([*cli, "--launch"], cwd=double, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted_rows(single / "data" / "collect") == sorted_rows(double / "data" / "collect")
    assert json.loads((double / "metrics" / "collect.json").read_text())["processes"] == 2


def test_a_sampled_round_logs_its_chain_with_the_targets_acceptances():
    """Sampled rounds with the lookup chain beside the static tree (collect's) log each chain
    token the tree holds with K + 1 acceptances (K: its parent's drafted children); after no
    drafted sibling, a token's is the target's own probability of it after the text and the
    chain before it (T 1: min(1, p / 1) for a point mass)."""
    target = tiny_llama(0)
    draft = perturbed_copy(target, 0.6, seed=1)
    prompt = torch.tensor([5, 17, 3, 42, 5, 17, 9, 3, 42, 5])  # repeats: chains to look up
    config = DecodeConfig(method="mcsd", max_new_tokens=30, max_depth=3, mcsd_branching=(2, 2),
                          sampling=Sampling(1.0), lookup_branch=True, lookup_tokens=4)
    logger = RoundLogger()
    logger.start("p", "val", 1.0)
    generation = generate(KVModel(target), ModelDrafter(KVModel(draft)), prompt, config,
                          FixedDepth(3), hook=logger, generator=torch.Generator().manual_seed(0))
    chains = logger.lookup_table().to_pandas()
    assert len(chains) >= 3 and (chains["temperature"] == 1.0).all()
    rows = logger.table().to_pandas()
    text = torch.cat([prompt, torch.tensor(generation.tokens)])
    for (round_, emitted), chain in chains.groupby(["round", "emitted"]):
        assert chain["position"].tolist() == list(range(1, len(chain) + 1)) and len(chain) <= 4
        drafted = rows[rows["round"] == round_]
        tokens, at = chain["token"].tolist(), 0  # at: the chain's parent while it retraces
        for j, (token, after) in enumerate(zip(tokens, chain["accept_after"])):
            kids = drafted[drafted["parent"] == at] if at is not None else drafted.iloc[:0]
            assert len(after) == len(kids) + 1
            path = torch.cat([text[: len(prompt) + emitted],
                              torch.tensor(tokens[:j], dtype=torch.long)])
            with torch.no_grad():
                p = torch.softmax(target(path[None]).logits[0, -1].double(), -1)
            assert after[0] == pytest.approx(float(p[token]), rel=1e-4, abs=1e-7)
            same = kids[kids["token"] == token]
            at = int(same["node"].iloc[-1]) if len(same) else None


@pytest.mark.parametrize("config", [DecodeConfig(method="sd", max_new_tokens=30, max_depth=4),
                                    DecodeConfig(method="ti-mcsd", max_new_tokens=30,
                                                 max_depth=3, ti_width=3)],
                         ids=["sd", "ti-mcsd"])
def test_logged_labels_replay_to_the_verifier_decision(config):
    """Greedy: a labelled token is accepted iff it is the target's argmax after its parent."""
    target = tiny_llama(0)
    draft = perturbed_copy(target, 0.6, seed=1)
    prompt = torch.tensor([5, 17, 3, 42])
    logger = RoundLogger()
    generation = generate(KVModel(target), ModelDrafter(KVModel(draft)), prompt, config,
                          FixedDepth(config.max_depth), hook=logger)
    rows = logger.table().to_pydict()
    committed = torch.cat([prompt, torch.tensor(generation.tokens)])
    with torch.no_grad():
        logits = target(committed[None]).logits[0]
    probs = torch.softmax(logits, -1)
    # out index of each round's committed root: every round commits its root + accepted tokens
    starts, position = [], 0
    for accepted in generation.stats.accepted_per_round:
        starts.append(position)
        position += 1 + accepted
    checked = {0: 0, 1: 0}
    for i, label in enumerate(rows["label"]):
        if label < 0:
            continue
        parent_index = prompt.shape[0] + starts[rows["round"][i]] + int(rows["depth"][i]) - 1
        token = rows["token"][i]
        assert label == int(token == int(logits[parent_index].argmax()))
        assert abs(rows["p_target"][i] - float(probs[parent_index, token])) < 1e-4
        assert abs(rows["soft_label"][i] - min(1.0, rows["p_target"][i] / rows["q_draft"][i])) \
            < 1e-6
        assert rows["accept_prob"][i] == label  # greedy: the exact probability is the label
        checked[label] += 1
    assert checked[0] > 0 and checked[1] > 0


def test_reading_bad_parts_gives_clear_errors(tmp_path):
    logger = RoundLogger()
    good = tmp_path / "parts" / "a.parquet"
    write_part(logger.table(), good)
    assert read_part(good).num_rows == 0
    truncated = tmp_path / "parts" / "b.parquet"
    truncated.write_bytes(good.read_bytes()[:20])
    with pytest.raises(DataError, match="corrupt or truncated"):
        read_part(truncated)
    other = tmp_path / "c.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    with pytest.raises(DataError, match="feature schema version"):
        read_part(other)
    with pytest.raises(DataError, match="no logged parts"):
        read_parts(tmp_path / "empty")
    with pytest.raises(DataError, match="file not found"):
        read_part(tmp_path / "missing.parquet")


def logged_repeats(target: torch.nn.Module, prompts: int, seed: int
                   ) -> Iterator[tuple[torch.Tensor, list[int], RoundLogger]]:
    """(prompt, text, its logger) of `prompts` greedy `mcsd` decodes by `target` with a
    perturbed copy as the draft, each prompt a short random one said three times (so the lookup
    finds chains), logged as collect logs them (chains of 5)."""
    draft = perturbed_copy(target, 0.6, seed=1)
    config = DecodeConfig(method="mcsd", max_new_tokens=24, max_depth=3, mcsd_branching=(2,))
    g = torch.Generator().manual_seed(seed)
    for i in range(prompts):
        prompt = torch.randint(0, 97, (int(torch.randint(2, 6, (1,), generator=g)),),
                               generator=g).repeat(3)
        logger = RoundLogger()
        logger.start(f"p{i}", "train")
        text = generate(KVModel(target), ModelDrafter(KVModel(draft)), prompt, config,
                        FixedDepth(3), hook=logger).tokens
        logger.finish(prompt.tolist(), text, chain_tokens=5, ngram=config.lookup_ngram)
        yield prompt, text, logger


def test_lookup_rows_label_each_chain_by_the_targets_argmax():
    """The chain logged below each token of the text (a round's root or not) is labelled as a
    greedy pass over the chain would verify it: token j accepted iff the target's arg-max after
    the text and the chain's tokens before j is token j; -1 after a rejection or past the decoded
    text.  `lookup` alone walked along the logged chains (`replay.lookup_chains.lookup_alone`)
    accepts what the runtime's `lookup` method accepts, in as many rounds."""
    target = tiny_llama(0)
    alone = DecodeConfig(method="lookup", max_new_tokens=24, max_depth=5)
    checked = accepted = rounds_checked = 0
    for prompt, text, logger in logged_repeats(target, 5, seed=0):
        rows = logger.lookup_table().to_pandas()
        for emitted, chain in rows.groupby("emitted"):
            tokens = chain["token"].tolist()
            context = prompt.tolist() + text[:emitted]
            with torch.no_grad():
                logits = target(torch.tensor([context + tokens])).logits[0]
            argmax = logits[len(context) - 1 :].argmax(-1).tolist()
            alive = True
            for j, (token, label) in enumerate(zip(tokens, chain["label"])):
                truth = int(argmax[j] == token) if alive else -1
                if emitted + j >= len(text):  # past the decoded text: not known
                    truth = -1
                assert label == truth, (prompt.tolist(), emitted, j)
                alive = alive and argmax[j] == token
                checked += label >= 0
                accepted += label == 1
            index = logger.rounds.get(emitted, -1)
            assert (chain["round"] == index).all() and (chain["text_tokens"] == len(text)).all()
            rounds_checked += index >= 0
        run = generate(KVModel(target), None, prompt, alone, FixedDepth(5))
        walked = lookup_alone(rows, np.ones(16))  # every pass costs 1: tokens per round
        walked_rounds = round(len(text) / walked["tokens_per_call"])
        assert len(text) - walked_rounds == run.stats.accepted  # the same accepted tokens
        # the runtime's last root may fill the budget without a pass of its own
        assert walked_rounds - (run.stats.target_calls - 1) in (0, 1)
    assert checked > accepted > 0 and rounds_checked > 0


def test_drafted_rows_carry_the_logged_chain_below_their_root():
    """A drafted token's lookup features are the round's lookup chain, as collect logs it below
    the round's root: `lookup_agrees` where its branch is the chain's prefix, `lookup_disagrees`
    where the branch above it is and the chain goes on with another token, the chain's n-gram
    length and the lookup's recent accuracy beside them; zeros where nothing is looked up."""
    agreed = disagreed = 0
    for _, _, logger in logged_repeats(tiny_llama(0), 4, seed=1):
        rows, chains = logger.table().to_pandas(), logger.lookup_table().to_pandas()
        for round_, drafted in rows.groupby("round"):
            chain = chains[chains["round"] == round_].sort_values("position")
            tokens, on_chain = chain["token"].tolist(), {0: True}
            for node, parent, token, depth, agrees, disagrees, ngram, recent in zip(
                    drafted["node"], drafted["parent"], drafted["token"], drafted["depth"],
                    drafted["lookup_agrees"], drafted["lookup_disagrees"],
                    drafted["lookup_ngram"], drafted["lookup_recent"]):
                reaches = on_chain[parent] and depth <= len(tokens)
                on_chain[node] = reaches and tokens[int(depth) - 1] == token
                assert (agrees, disagrees) == (on_chain[node], reaches and not on_chain[node])
                assert ngram == (chain["ngram"].iloc[0] if tokens else 0)
                if tokens:
                    assert recent == pytest.approx(chain["recent"].iloc[0], abs=1e-6)
                agreed, disagreed = agreed + agrees, disagreed + disagrees
    assert agreed > 0 and disagreed > 0
