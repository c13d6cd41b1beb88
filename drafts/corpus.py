"""Distillation data for a draft: the target's own responses and what it computed on them.

The target samples responses to the training prompts (batched `generate`: the first sample of
each prompt greedy, the rest at a temperature), then one teacher-forced pass over every
sequence keeps its last hidden states (what a feature-conditioned head reads) and its top-k
next-token distribution (what every draft is taught).  Shards are written atomically, one per
batch, so an interrupted run resumes at the next missing shard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specstop.common.files import remove_temp_files, resume_or_set_aside, write_atomic
from specstop.common.params import CorpusConfig


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] long, prompt + response
    prompt_len: int
    hidden: torch.Tensor  # [T, H] target's last hidden state (bf16)
    top_ids: torch.Tensor  # [T, K] int32: the teacher's top-k next tokens at each position
    top_probs: torch.Tensor  # [T, K] float16


def build_corpus(model, tokenizer, prompts: list[str], folder: Path, config: CorpusConfig,
                 seed: int, desc: str, stale_root: Path) -> list[Sequence]:
    """Generate (or resume) the shards for `prompts` under `folder`; return every sequence.

    Shards resume only a run with the same prompts, settings, seed and target (`recipe.json`);
    otherwise the old shards are moved under `stale_root` and the folder starts afresh."""
    recipe = {"config": config.model_dump(), "seed": seed, "target": model.name_or_path,
              "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest()}
    resume_or_set_aside(folder, recipe, stale_root, f"draft corpus {folder}")
    remove_temp_files(folder)  # of shards a killed run was writing
    jobs = [(p, s) for p in prompts for s in range(config.samples_per_prompt)]
    batches = [jobs[i:i + config.batch_size] for i in range(0, len(jobs), config.batch_size)]
    sequences: list[Sequence] = []
    for index, batch in enumerate(tqdm(batches, desc=desc, unit="batch")):
        shard = folder / f"shard-{index:05d}.pt"
        if not shard.is_file():
            generator_seed = seed * 100_003 + index
            made = _generate_batch(model, tokenizer, batch, config, generator_seed)
            write_atomic(shard, lambda tmp: torch.save([s.__dict__ for s in made], tmp))
        sequences += [Sequence(**d) for d in torch.load(shard, weights_only=True)]
    return sequences


@torch.inference_mode()
def _generate_batch(model, tokenizer, batch: list[tuple[str, int]], config: CorpusConfig,
                    seed: int) -> list[Sequence]:
    """Responses for one batch (greedy ones and sampled ones generated separately)."""
    out: list[Sequence] = []
    greedy = [p for p, s in batch if s == 0]
    sampled = [p for p, s in batch if s > 0]
    torch.manual_seed(seed)
    for texts, do_sample in ((greedy, False), (sampled, True)):
        if texts:
            rows = _respond(model, tokenizer, texts, config, do_sample)
            out += _teacher(model, rows, config.top_k, tokenizer.eos_token_id)
    return out


def _respond(model, tokenizer, texts: list[str], config: CorpusConfig,
             do_sample: bool) -> list[tuple[torch.Tensor, int]]:
    """(prompt + response ids, prompt length) per text; the response ends at its first EOS."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    sampling = {"do_sample": True, "temperature": config.temperature, "top_p": 1.0,
                "top_k": 0} if do_sample else {"do_sample": False}
    generated = model.generate(**enc, max_new_tokens=config.max_new_tokens, pad_token_id=pad,
                               **sampling).cpu()
    width = enc["input_ids"].shape[1]
    rows = []
    for i in range(len(texts)):
        prompt = enc["input_ids"][i].cpu()[enc["attention_mask"][i].cpu().bool()]
        response = generated[i, width:]
        eos = (response == tokenizer.eos_token_id).nonzero()
        if eos.numel():
            response = response[: int(eos[0]) + 1]
        rows.append((torch.cat([prompt, response]), prompt.shape[0]))
    return rows


def _teacher(model, rows: list[tuple[torch.Tensor, int]], top_k: int,
             pad: int | None) -> list[Sequence]:
    """One right-padded teacher-forced pass: hidden states and top-k probabilities per row."""
    length = max(ids.shape[0] for ids, _ in rows)
    ids = torch.full((len(rows), length), pad or 0, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (row, _) in enumerate(rows):
        ids[i, : row.shape[0]] = row
        mask[i, : row.shape[0]] = 1
    out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                output_hidden_states=True)
    hidden = out.hidden_states[-1]
    result = []
    for i, (row, prompt_len) in enumerate(rows):  # row by row: [T, V] float logits are large
        n = row.shape[0]
        logits = out.logits[i, :n].float()
        top = logits.topk(top_k, dim=-1)
        probs = (top.values - logits.logsumexp(dim=-1, keepdim=True)).exp()
        result.append(Sequence(row, prompt_len, hidden[i, :n].to(torch.bfloat16).cpu(),
                               top.indices.int().cpu(), probs.half().cpu()))
    return result


def token_counts(sequences: list[Sequence], vocab: int) -> torch.Tensor:
    """How often the target emitted each token in the responses (for vocabulary pruning)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.ids[s.prompt_len:], minlength=vocab)[:vocab]
        counts += torch.bincount(s.top_ids[s.prompt_len - 1:, 0].long(), minlength=vocab)[:vocab]
    return counts
