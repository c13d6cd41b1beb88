"""Distillation data for a draft: the target's own responses and what it computed on them.

The target answers the training prompts once per entry of `temperatures` (0 = greedy) in
batched decoding written for this job (`_generate_batch`, through the runtime's cache code:
`KVModel.extend_rows` and `keep_rows`): the prompts of a batch are of
similar length (sorted), a prompt is prefilled once for all its temperatures, each row has its
own temperature, and a row leaves the batch (and its cache) when its response ends.  The
forwards that generate a response also give the teacher's data, so there is no second pass:
at every position the chosen layers' hidden states (what a feature-conditioned head reads) and
the top-k next-token distribution (what every draft is taught).  Shards are written
atomically, one per batch, so an interrupted run resumes at the next missing shard.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specstop.common.files import remove_temp_files, resume_or_set_aside, write_atomic, write_json
from specstop.common.params import CorpusConfig
from specstop.decoder.kv import KVModel

HEAD_CHUNK = 256  # positions per output-layer call over a prompt: bounds the [n, V] logits
TIMING = "timing.json"  # seconds and tokens per generated shard
RESPONSE = "response"  # the source of a sequence the target decoded


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] long, prompt + response
    prompt_len: int
    hidden: torch.Tensor  # [T, L, H] bf16: the target's hidden states of the corpus' layers
    top_ids: torch.Tensor  # [T, K] int32: the teacher's top-k next tokens at each position
    top_probs: torch.Tensor  # [T, K] float16
    prompt_index: int  # the prompt's index in the corpus' prompt list
    temperature: float  # the response's sampling temperature (0 = greedy)
    source: str = RESPONSE  # a target response, or the teacher-forced text source it is from


def build_corpus(model, tokenizer, prompts: list[str], folder: Path, config: CorpusConfig,
                 layers: tuple[int, ...], seed: int, desc: str,
                 stale_root: Path) -> list[Sequence]:
    """Generate (or resume) the shards for `prompts` under `folder`; return every sequence.

    `layers` are indices into the target's `hidden_states` (-1: the last, normed).  Shards
    resume only a run with the same prompts, settings, layers, seed and target
    (`recipe.json`); otherwise the old shards are moved under `stale_root` and the folder
    starts afresh."""
    recipe = {"config": config.model_dump(exclude={"text"}), "layers": list(layers), "seed": seed,
              "target": model.name_or_path,
              "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest()}
    resume_or_set_aside(folder, recipe, stale_root, f"draft corpus {folder}")
    remove_temp_files(folder)  # of shards a killed run was writing
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    jobs = sorted(((len(ids), i, t) for i, ids in enumerate(encoded)
                   for t in config.temperatures), key=lambda job: job[0])
    batches = [jobs[i:i + config.batch_size] for i in range(0, len(jobs), config.batch_size)]
    sequences: list[Sequence] = []
    tokens, timing = 0, read_timing(folder)
    progress = tqdm(batches, desc=desc, unit="batch")
    for index, batch in enumerate(progress):
        shard = folder / f"shard-{index:05d}.pt"
        if not shard.is_file():
            start = time.perf_counter()
            made = _generate_batch(model, [(torch.tensor(encoded[i]), i, t) for _, i, t in batch],
                                   config, layers, tokenizer.eos_token_id, seed * 100_003 + index)
            save_shard(shard, made, time.perf_counter() - start, timing)
        loaded = load_shard(shard)
        sequences += loaded
        tokens += sum(s.ids.shape[0] - s.prompt_len for s in loaded)
        progress.set_postfix(response_tokens=tokens)
    return sequences


@torch.inference_mode()
def _generate_batch(model, rows: list[tuple[torch.Tensor, int, float]], config: CorpusConfig,
                    layers: tuple[int, ...], eos: int | None, seed: int) -> list[Sequence]:
    """Responses to the prompts `rows` (ids, index, temperature) with the teacher's data at every
    position.  A prompt in several rows (its temperatures) is prefilled once.  A response ends
    after its EOS or `max_new_tokens` tokens; each row's last token is fed too, so its position
    has hidden states like every other."""
    device = model.device
    generator = torch.Generator(device).manual_seed(seed)
    unique = {index: prompt for prompt, index, _ in rows}
    lm = KVModel(model)  # its cache holds the batch's rows
    lm.reserve(max(p.shape[0] for p in unique.values()) + config.max_new_tokens)
    mask, logits, prompt_records = _prefill(lm, list(unique.values()), layers, config.top_k)
    position = {index: k for k, index in enumerate(unique)}  # a prompt's row in the prefill
    of_row = torch.tensor([position[index] for _, index, _ in rows], device=device)
    lm.keep_rows(of_row)
    mask, logits = mask[of_row], logits[of_row]
    records = [[prompt_records[i]] for i in of_row.tolist()]
    temperature = torch.tensor([t for _, _, t in rows], device=device)
    responses: list[list[int]] = [[] for _ in rows]
    active = torch.arange(len(rows))  # rows still answering, in cache order
    lengths = mask.sum(1)  # tokens (prompt + fed response) per cache row
    while active.numel():
        token = _next_tokens(logits, temperature, generator)
        for row, t in zip(active.tolist(), token.tolist()):
            responses[row].append(t)
        mask = torch.cat([mask, mask.new_ones(active.numel(), 1)], dim=1)
        step_logits, hidden_states = lm.extend_rows(token[:, None], lengths[:, None], mask)
        lengths = lengths + 1
        logits = step_logits[:, -1].float()
        top = _top_k(logits, config.top_k)
        step_hidden = layer_states(hidden_states, layers)[:, -1]
        for j, row in enumerate(active.tolist()):
            records[row].append((step_hidden[j:j + 1], top[0][j:j + 1], top[1][j:j + 1]))
        done = torch.tensor([responses[row][-1] == eos
                             or len(responses[row]) == config.max_new_tokens
                             for row in active.tolist()])
        if done.any():
            keep = (~done).nonzero().flatten().to(device)
            lm.keep_rows(keep)
            active, mask, lengths = active[~done], mask[keep], lengths[keep]
            logits, temperature = logits[keep], temperature[keep]
    return [_sequence(prompt, responses[i], records[i], index, t)
            for i, (prompt, index, t) in enumerate(rows)]


def _prefill(lm: KVModel, prompts: list[torch.Tensor], layers: tuple[int, ...],
             top_k: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One left-padded pass over `prompts` into `lm`'s cache (a row each): the attention mask
    [U, width], the next-token logits [U, V] and each prompt's records (`position_records`)."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding: every row's next token is last
        ids[i, width - prompt.shape[0]:] = prompt
        mask[i, width - prompt.shape[0]:] = 1
    ids, mask = ids.to(lm.device), mask.to(lm.device)
    logits, hidden_states = lm.extend_rows(ids, (mask.cumsum(1) - 1).clamp_min(0), mask,
                                           last_only=True)
    hidden, last = layer_states(hidden_states, layers), hidden_states[-1]
    head = lm.model.get_output_embeddings()
    records = [position_records(hidden[i, width - p.shape[0]:], last[i, width - p.shape[0]:],
                               head, top_k) for i, p in enumerate(prompts)]
    return mask, logits[:, -1].float(), records


def layer_states(hidden_states: tuple[torch.Tensor, ...],
                 layers: tuple[int, ...]) -> torch.Tensor:
    """[B, T, L, H]: the hidden states of `layers`."""
    return torch.stack([hidden_states[i] for i in layers], dim=2)


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k token ids and their probabilities per row of float logits [n, V]."""
    top = logits.topk(k, dim=-1)
    return top.indices, (top.values - logits.logsumexp(dim=-1, keepdim=True)).exp()


def position_records(hidden: torch.Tensor, last: torch.Tensor, head: torch.nn.Module,
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [P, L, H], top ids, top probs) of a prompt's positions; the teacher's logits
    come from the output layer over the last layer's normed states `last` [P, H], a chunk at
    a time."""
    tops = [_top_k(head(last[i:i + HEAD_CHUNK]).float(), k)
            for i in range(0, last.shape[0], HEAD_CHUNK)]
    return (hidden, torch.cat([t[0] for t in tops]), torch.cat([t[1] for t in tops]))


def _next_tokens(logits: torch.Tensor, temperature: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
    """Each row's next token: the argmax where its temperature is 0, else a sample (the
    exponential race: argmax p / E with E ~ Exp(1) is distributed as p, and costs one random
    number per token where `torch.multinomial` costs far more on a CPU)."""
    greedy = logits.argmax(-1)
    warm = temperature > 0
    if not warm.any():
        return greedy
    probs = torch.softmax(logits[warm] / temperature[warm, None], dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    greedy[warm] = (probs / race).argmax(-1)
    return greedy


def _sequence(prompt: torch.Tensor, response: list[int], records: list[tuple], index: int,
              temperature: float) -> Sequence:
    hidden, top_ids, top_probs = (torch.cat(parts) for parts in zip(*records))
    return Sequence(torch.cat([prompt, torch.tensor(response, dtype=torch.long)]),
                    prompt.shape[0], hidden.to(torch.bfloat16).cpu(), top_ids.int().cpu(),
                    top_probs.half().cpu(), index, temperature)


def save_shard(shard: Path, made: list[Sequence], seconds: float, timing: dict) -> None:
    """Write a shard atomically and add its seconds and tokens to `timing` and its folder's
    `timing.json` (`response_tokens`: the positions after the prompt)."""
    write_atomic(shard, lambda tmp: torch.save([s.__dict__ for s in made], tmp))
    timing[shard.name] = {"seconds": round(seconds, 3),
                          "tokens": sum(s.ids.shape[0] for s in made),
                          "response_tokens": sum(s.ids.shape[0] - s.prompt_len for s in made)}
    write_json(shard.parent / TIMING, timing)


def load_shard(shard: Path) -> list[Sequence]:
    return [Sequence(**d) for d in torch.load(shard, weights_only=True)]


def read_timing(folder: Path) -> dict[str, dict]:
    """Seconds and tokens of each shard generated in `folder` (`timing.json`)."""
    path = Path(folder) / TIMING
    return json.loads(path.read_text()) if path.is_file() else {}


def corpus_timing(folder: Path) -> dict:
    """Responses' tokens and the generation's speed over the shards `folder` timed."""
    shards = read_timing(folder).values()
    seconds = sum(s["seconds"] for s in shards)
    tokens = sum(s["response_tokens"] for s in shards)
    return {"shards": len(shards), "seconds": round(seconds, 1), "response_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None}


def token_counts(sequences: list[Sequence], vocab: int) -> torch.Tensor:
    """The teacher's probability mass on each token summed over the responses' positions (its
    top-k at each position that predicts a response token): how often the target would emit
    the token there at temperature 1, the tail beyond its top-k aside.  For vocabulary pruning;
    teacher-forced text is not counted."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in (s for s in sequences if s.source == RESPONSE):
        taught = slice(s.prompt_len - 1, None)
        counts.index_add_(0, s.top_ids[taught].long().flatten(),
                          s.top_probs[taught].double().flatten())
    return counts
