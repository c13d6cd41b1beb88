"""Teacher-forced distillation data: text the machine already holds, labelled by the target.

Decoding labels one position per target step; a forward over existing text labels every
position of it at once.  The sources are files read without a download: `code` (the Python
standard library's .py files), `docs` (the .md/.rst files of installed packages) or a path.
Each source's files, in a seeded order, are tokenised into one stream (EOS between files) until
its share of `tokens`, cut into windows of `window` tokens, and `batch_size` windows go through
the target in one forward (no padding).  Every position keeps what the response corpus keeps
(`drafts.corpus.Sequence`: the chosen layers' hidden states, the top-k next-token
probabilities), and the shards are written, resumed and timed the same way, so distillation
reads both alike.  The prompts are not a source: the response corpus already labels their
positions, and the decision models' and bench's prompts must stay unseen.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specstop.common.errors import SpecstopError
from specstop.common.files import remove_temp_files, resume_or_set_aside
from specstop.common.params import TextCorpusConfig

from .corpus import Sequence, layer_states, load_shard, position_records, read_timing, save_shard

KEY = "draft.corpus.text.sources"
# the named sources: (the folder, the file suffixes read under it)
NAMED = {"code": (sysconfig.get_paths()["stdlib"], (".py",)),
         "docs": (sysconfig.get_paths()["purelib"], (".md", ".rst"))}
PATH_SUFFIXES = (".py", ".md", ".rst", ".txt")


def build_text_corpus(model, tokenizer, config: TextCorpusConfig, top_k: int, folder: Path,
                      layers: tuple[int, ...], seed: int, stale_root: Path) -> list[Sequence]:
    """Label (or resume) the windows of `config`'s sources under `folder`; return them all.
    Shards resume only a run with the same windows, settings, layers and target."""
    windows, sources = text_windows(tokenizer, config, seed)
    recipe = {"config": config.model_dump(), "top_k": top_k, "layers": list(layers),
              "target": model.name_or_path,
              "windows": hashlib.sha256(windows.numpy().tobytes()).hexdigest()}
    resume_or_set_aside(folder, recipe, stale_root, f"draft text corpus {folder}")
    remove_temp_files(folder)
    sequences: list[Sequence] = []
    timing = read_timing(folder)
    starts = range(0, windows.shape[0], config.batch_size)
    for index, start in enumerate(tqdm(starts, desc="teacher-forced text", unit="batch")):
        shard = folder / f"shard-{index:05d}.pt"
        if not shard.is_file():
            begin = time.perf_counter()
            end = start + config.batch_size
            made = label_windows(model, windows[start:end], sources[start:end], layers, top_k,
                                 start)
            save_shard(shard, made, time.perf_counter() - begin, timing)
        sequences += load_shard(shard)
    return sequences


@torch.inference_mode()
def label_windows(model, windows: torch.Tensor, sources: list[str], layers: tuple[int, ...],
                  top_k: int, first: int) -> list[Sequence]:
    """The teacher's data at every position of `windows` [B, W] from one forward; window i
    becomes a sequence of source `sources[i]` and index `first + i`, its first token the
    'prompt' (every later position is taught)."""
    out = model(input_ids=windows.to(model.device), output_hidden_states=True, logits_to_keep=1)
    hidden, last = layer_states(out.hidden_states, layers), out.hidden_states[-1]
    head = model.get_output_embeddings()
    made = []
    for i, source in enumerate(sources):
        states, top_ids, top_probs = position_records(hidden[i], last[i], head, top_k)
        made.append(Sequence(windows[i].clone(), 1, states.to(torch.bfloat16).cpu(),
                             top_ids.int().cpu(), top_probs.half().cpu(), first + i, 0.0, source))
    return made


def text_windows(tokenizer, config: TextCorpusConfig, seed: int) -> tuple[torch.Tensor,
                                                                           list[str]]:
    """round(tokens * share / window) windows [N, window] per source, and each one's source."""
    rows, names = [], []
    for name, share in config.sources.items():
        count = round(config.tokens * share / config.window)
        if count == 0:
            continue
        need = count * config.window
        stream = _token_stream(source_files(name), tokenizer, need, seed)
        if stream.shape[0] < need:
            raise SpecstopError(f"{KEY}: {name} holds {stream.shape[0]} tokens, fewer than its "
                                f"share of draft.corpus.text.tokens ({need})")
        rows.append(stream[:need].view(count, config.window))
        names += [name] * count
    if not rows:
        return torch.zeros(0, config.window, dtype=torch.long), []
    return torch.cat(rows), names


def source_files(name: str) -> list[Path]:
    """A source's files, sorted: a named source's (`NAMED`), or a path's (the file, or the
    .py/.md/.rst/.txt files under the folder); a one-line error names the key otherwise."""
    root, suffixes = NAMED.get(name, (name, PATH_SUFFIXES))
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise SpecstopError(f"{KEY}: '{name}' is neither {' nor '.join(NAMED)} nor an existing "
                            f"file or folder")
    files = sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file()
                   and not any(map(_skipped, p.relative_to(root).parts)))
    if not files:
        raise SpecstopError(f"{KEY}: '{name}' holds no {'/'.join(suffixes)} files")
    return files


def _skipped(part: str) -> bool:
    """A folder not read: the stdlib's installed packages, a package's metadata."""
    return part == "site-packages" or part.endswith(".dist-info")


def _token_stream(files: list[Path], tokenizer, need: int, seed: int) -> torch.Tensor:
    """The files' tokens in a seeded order, EOS after each, until `need` tokens (or the end)."""
    order = files.copy()
    random.Random(seed).shuffle(order)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    parts, total = [], 0
    for path in order:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        parts.append(torch.tensor(ids, dtype=torch.long))
        total += len(ids)
        if total >= need:
            break
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
