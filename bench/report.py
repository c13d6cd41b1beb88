"""metrics/bench.json, the per-prompt CSV, the results table and the plots of stage `bench`.

bench.json (CONTRACTS.md): the greedy methods at the top level (`tokens_per_s`,
`speedup_vs_ar` with `speedup_vs_ar_ci95`, `mean_accepted`, `acceptance_rate`,
`greedy_identical_to_ar`, counts, quality, the largest divergence gap, `speedup_vs_ar_by_domain`;
where stage train replayed the method, `simulated_speedup`, `round_speedup_vs_ar` (the rounds'
seconds alone, as the replay prices them) and `measured_over_simulated`, their ratio), the
sampled ones under `sampling`; `summary` (the exported policy against the best static
method, `ar`, `sd` and transformers, `sd` against transformers on the same draft, the A/A noise
floor, `lookup`: the learned tree with the prompt-lookup branch against without it and against
the confidence tree with the same branch, `lookup` alone and transformers' prompt lookup against
`ar`, overall and per domain; `sampling`: the exported policy against the best static method
and `ar`, its tree with the lookup chain against it and that static method: each a ratio with
its paired 95% bootstrap interval over prompts); `setup`, `latency` and `targets`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from specstop.common.errors import SpecstopError
from specstop.common.files import write_atomic, write_json
from specstop.evaluation.intervals import Ratio, speed_ratio
from specstop.evaluation.side_by_side import MethodResult
from specstop.evaluation.plots import plt, write_csv

AR, AA, SD, EXPORTED = "ar", "ar-aa", "sd", "tree+stop_model"
LOOKUP, EXPORTED_LOOKUP, HF_LOOKUP = "lookup", "tree+stop_model+lookup", "hf-prompt-lookup"
CONFIDENCE_TREE, CONFIDENCE_LOOKUP = "tree+confidence", "tree+confidence+lookup"
STATIC = ("sd", "sd-compact", "mcsd", "ti-mcsd", "static-tree")  # fixed shapes, lossless
HF_ASSISTED = ("hf-assisted", "hf-assisted-static")  # transformers, the same draft as sd's row
SIMULATION_TOLERANCE = 0.10  # measured vs replayed speed of the exported policy
WINNER_MARGIN = 1.08  # the exported policy over the best static method
DECISION_SHARE = 0.03  # of the exported policy's decode time
README_START, README_END = "<!-- bench results: start -->", "<!-- bench results: end -->"
NOT_METHODS = ("sampling", "setup", "latency", "summary", "targets")  # bench.json's other keys


@dataclass(frozen=True)
class Inputs:
    """What the bench measured, and what it needs to say about it."""

    results: dict[str, list[MethodResult]]  # mode (greedy, sampling) -> methods, ar first
    prompt_ids: list[str]
    domains: list[str]  # per prompt: its source
    same_draft_sd: str | None  # the specstop row that runs the transformers peer's draft
    simulated: dict[str, dict[str, float]]  # mode -> method -> simulated speedup on val
    resamples: int
    seed: int
    winners: dict[str, str] = field(default_factory=lambda: {
        "greedy": EXPORTED, "sampling": EXPORTED})  # mode -> the method decoding the exported
    # file as it says (`tree+stop_model+lookup` where it adds the lookup branch)


def write(inputs: Inputs, setup: dict, latency: dict, path: Path, folder: Path) -> dict:
    """Write every output; return bench.json's content."""
    greedy = _mode(inputs, "greedy")
    sampling = _mode(inputs, "sampling") if "sampling" in inputs.results else {}
    summary = {**_summary(inputs, greedy), "sampling": _sampling_summary(inputs, sampling)}
    metrics = {**greedy, "sampling": sampling, "setup": setup, "latency": latency,
               "summary": summary, "targets": _targets(greedy, summary, inputs.winners["greedy"])}
    write_json(path, metrics)
    _per_prompt_csv(inputs, folder / "per_prompt.csv")
    for mode, entries in inputs.results.items():
        by_method = methods(metrics if mode == "greedy" else metrics["sampling"])
        write_csv(folder / "speedup" / f"{mode}.csv",
                  ["method", "speedup_vs_ar", "ci95_low", "ci95_high"], _speedup_rows(by_method))
        write_csv(folder / "accepted_length" / f"{mode}.csv",
                  ["method", "accepted", "fraction"], _accepted_rows(entries))
    _figures(metrics, inputs.results["greedy"], folder)
    write_atomic(folder / "results.md", lambda tmp: tmp.write_text(markdown(metrics)))
    return metrics


def ratio(inputs: Inputs, mode: str, a: str, b: str, domain: str | None = None,
          rounds_only: bool = False) -> Ratio:
    """Method a's throughput over b's on the same prompts (those of `domain` only, if given),
    with its paired interval; `rounds_only`: over the rounds' seconds, the prefills left out
    (what the replay prices)."""
    by_name = {r.method: r for r in inputs.results[mode]}
    keep = [i for i, d in enumerate(inputs.domains) if domain in (None, d)]
    per_a = [by_name[a].per_prompt[i] for i in keep]
    per_b = [by_name[b].per_prompt[i] for i in keep]

    def seconds(stats: list) -> list[float]:
        return [s.round_seconds if rounds_only else s.seconds for s in stats]

    return speed_ratio([s.new_tokens for s in per_a], seconds(per_a),
                       [s.new_tokens for s in per_b], seconds(per_b),
                       inputs.resamples, inputs.seed)


def by_domain(inputs: Inputs, mode: str, a: str, b: str) -> dict[str, dict]:
    """a over b on every prompt (`all`) and on each domain's prompts."""
    return {"all": ratio(inputs, mode, a, b).as_dict(),
            **{d: ratio(inputs, mode, a, b, d).as_dict() for d in sorted(set(inputs.domains))}}


def _mode(inputs: Inputs, mode: str) -> dict:
    results, n = inputs.results[mode], len(inputs.prompt_ids)
    out = {}
    for r in results:
        vs_ar = ratio(inputs, mode, r.method, AR)
        out[r.method] = {**_method(r, n, mode == "greedy"), "speedup_vs_ar": vs_ar.ratio,
                         "speedup_vs_ar_ci95": vs_ar.as_dict()["ci95"],
                         "speedup_vs_ar_by_domain": {
                             d: ratio(inputs, mode, r.method, AR, d).as_dict()
                             for d in sorted(set(inputs.domains))}}
        simulated = inputs.simulated.get(mode, {}).get(r.method)
        if simulated:  # the replay prices rounds: compared with the rounds' speed
            rounds = ratio(inputs, mode, r.method, AR, rounds_only=True).ratio
            out[r.method].update(simulated_speedup=simulated, round_speedup_vs_ar=rounds,
                                 measured_over_simulated=rounds / simulated)
    return out


def _method(result: MethodResult, n: int, greedy: bool) -> dict:
    s = result.stats
    gaps = [g for g in result.divergence_gaps if g is not None]
    out = {"tokens_per_s": s.tokens_per_s, "mean_accepted": s.mean_accepted,
           "acceptance_rate": s.acceptance_rate, "target_calls": s.target_calls,
           "draft_steps": s.draft_steps, "new_tokens": s.new_tokens, "seconds": s.seconds,
           "drafted_tokens": s.drafted_tokens, "verified_tokens": s.verified_tokens,
           "decision_share": s.decision_seconds / s.seconds if s.seconds > 0 else 0.0,
           "gated_share": s.gated / max(s.target_calls - n, 1),  # rounds (prefills aside)
           "exact_match_vs_ar": result.identical_to_ar / n,
           "mean_target_logprob": result.mean_logprob(n)}
    if greedy:
        out["greedy_identical_to_ar"] = result.identical_to_ar == n
        out["max_divergence_gap"] = max(gaps) if gaps else None
    return out


def _sampling_summary(inputs: Inputs, sampling: dict) -> dict:
    """The exported policy under sampling against `ar` and the fastest static method sampled,
    its rounds against its replay (and its tree's without the lookup chain), and its tree with
    the lookup chain against it and that static method, overall and per domain (None where the
    sampling run lacks them)."""
    static = [name for name in STATIC if name in sampling]
    best = max(static, key=lambda name: sampling[name]["tokens_per_s"]) if static else None
    name = inputs.winners["sampling"]
    winner = sampling.get(name)

    def by(a: str, b: str | None) -> dict | None:
        return by_domain(inputs, "sampling", a, b) if a in sampling and b in sampling else None

    return {"winner": name if winner else None, "best_static": best,
            "winner_vs_best_static": ratio(inputs, "sampling", name, best).as_dict()
            if winner and best else None,
            "winner_vs_ar": _speedup(winner) if winner else None,
            "winner_measured_over_simulated": winner.get("measured_over_simulated")
            if winner else None,
            "tree_measured_over_simulated": sampling.get(EXPORTED, {}).get(
                "measured_over_simulated"),
            "lookup_tree_vs_winner": by(EXPORTED_LOOKUP, EXPORTED),
            "lookup_tree_vs_best_static": by(EXPORTED_LOOKUP, best),
            "lookup_tree_vs_ar": _speedup(sampling[EXPORTED_LOOKUP])
            if EXPORTED_LOOKUP in sampling else None}


def _summary(inputs: Inputs, greedy: dict) -> dict:
    """The claims the stage makes, each a paired ratio with its interval."""
    def fastest(names: tuple[str, ...]) -> str | None:
        present = [name for name in names if name in greedy]
        return max(present, key=lambda name: greedy[name]["tokens_per_s"]) if present else None

    best_static, best_peer = fastest(STATIC), fastest(HF_ASSISTED)

    def vs(a: str | None, b: str | None) -> dict | None:
        if a not in greedy or b not in greedy:
            return None
        if b == AR:  # measured with the method's row
            return _speedup(greedy[a])
        return ratio(inputs, "greedy", a, b).as_dict()

    lossless = [m for name, m in greedy.items() if "lossy" not in name]
    gaps = [m["max_divergence_gap"] for m in lossless if m["max_divergence_gap"] is not None]
    winner = inputs.winners["greedy"]
    return {"winner": winner if winner in greedy else None, "best_static": best_static,
            "hf_assisted_best": best_peer,
            "prompts": len(inputs.prompt_ids), "domains": sorted(set(inputs.domains)),
            "prompts_per_domain": dict(sorted(Counter(inputs.domains).items())),
            "max_divergence_gap": max(gaps) if gaps else None,
            "winner_vs_best_static": vs(winner, best_static), "winner_vs_ar": vs(winner, AR),
            "winner_vs_sd": vs(winner, SD), "winner_vs_hf_assisted": vs(winner, best_peer),
            "winner_vs_confidence_tree": vs(winner, CONFIDENCE_TREE),
            "winner_decision_share": greedy.get(winner, {}).get("decision_share"),
            "winner_measured_over_simulated": greedy.get(winner, {}).get(
                "measured_over_simulated"),
            "sd_vs_hf_assisted_same_draft": vs(inputs.same_draft_sd, best_peer),
            "aa_noise": vs(AA, AR), "lookup": _lookup_summary(inputs, greedy)}


def _lookup_summary(inputs: Inputs, greedy: dict) -> dict:
    """Prompt lookup, overall and per domain: the learned tree with its lookup branch against
    without it and against the confidence tree with the same branch, `lookup` alone and
    transformers' prompt lookup against `ar` and each other (None where a method did not run)."""
    pairs = {"tree_with_vs_without": (EXPORTED_LOOKUP, EXPORTED),
             "tree_with_vs_confidence_tree_with": (EXPORTED_LOOKUP, CONFIDENCE_LOOKUP),
             "alone_vs_ar": (LOOKUP, AR),
             "hf_prompt_lookup_vs_ar": (HF_LOOKUP, AR),
             "alone_vs_hf_prompt_lookup": (LOOKUP, HF_LOOKUP),
             "tree_with_vs_alone": (EXPORTED_LOOKUP, LOOKUP)}
    return {key: by_domain(inputs, "greedy", a, b) if a in greedy and b in greedy else None
            for key, (a, b) in pairs.items()}


def _targets(greedy: dict, summary: dict, winner: str) -> dict:
    """Checks of the exported policy (`winner`, its greedy method) against the best static
    method and transformers, decided by the interval: true when it lies above 1, false when
    below, null when it contains 1 (or is unknown)."""
    ratio_ = greedy.get(winner, {}).get("measured_over_simulated")
    vs_static, share = summary["winner_vs_best_static"], summary["winner_decision_share"]
    return {"winner_faster_than_best_static": _above_one(vs_static),
            "winner_8pct_over_best_static": None if vs_static is None else bool(
                vs_static["ratio"] >= WINNER_MARGIN and _above_one(vs_static)),
            "winner_faster_than_hf_assisted": _above_one(summary["winner_vs_hf_assisted"]),
            "simulated_within_10pct": None if ratio_ is None
            else abs(ratio_ - 1) <= SIMULATION_TOLERANCE,
            "decision_within_3pct": None if share is None else share <= DECISION_SHARE,
            "lossless_greedy_identical": all(
                m["greedy_identical_to_ar"] for name, m in greedy.items() if "lossy" not in name)}


def _above_one(entry: dict | None) -> bool | None:
    if entry is None or entry["ci95"] is None:
        return None
    low, high = entry["ci95"]
    return True if low > 1 else False if high < 1 else None


def _per_prompt_csv(inputs: Inputs, path: Path) -> None:
    header = ["mode", "method", "prompt", "prompt_id", "domain", "new_tokens", "seconds",
              "prefill_seconds", "tokens_per_s", "target_calls", "draft_steps", "mean_accepted",
              "acceptance_rate", "identical_to_ar", "divergence_gap", "mean_target_logprob"]
    rows = []
    for mode, entries in inputs.results.items():
        for r in entries:
            gaps = r.divergence_gaps or [None] * len(r.per_prompt)
            rows += [(mode, r.method, i, inputs.prompt_ids[i], inputs.domains[i], s.new_tokens,
                      round(s.seconds, 4), round(s.prefill_seconds, 4),
                      round(s.tokens_per_s, 3), s.target_calls,
                      s.draft_steps, round(s.mean_accepted, 4), round(s.acceptance_rate, 4),
                      int(r.identical[i]), "" if gaps[i] is None else round(gaps[i], 5),
                      round(r.logprobs[i], 4))
                     for i, s in enumerate(r.per_prompt)]
    write_csv(path, header, rows)


def _speedup_rows(by_method: dict) -> list[tuple]:
    return [(name, m["speedup_vs_ar"], *(m["speedup_vs_ar_ci95"] or ("", "")))
            for name, m in by_method.items()]


def _accepted_rows(results: list[MethodResult]) -> list[tuple]:
    """(method, accepted tokens in a round, fraction of the method's rounds); methods with
    drafting whose rounds the loop records (transformers' are not)."""
    rows = []
    for r in results:
        counts = Counter(r.accepted_per_round)
        total = sum(counts.values())
        if r.stats.draft_steps and total:
            rows += [(r.method, k, counts[k] / total) for k in sorted(counts)]
    return rows


def _figures(metrics: dict, greedy: list[MethodResult], folder: Path) -> None:
    names = [r.method for r in greedy]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.5))
    for offset, label, by_method in ((-0.2, "greedy", metrics),
                                     (0.2, "sampling", metrics["sampling"])):
        rows = [(i + offset, by_method[n]) for i, n in enumerate(names) if n in by_method]
        values = [m["speedup_vs_ar"] for _, m in rows]
        low, high = zip(*(m["speedup_vs_ar_ci95"] or (v, v) for v, (_, m) in zip(values, rows))) \
            if rows else ((), ())
        errors = [[v - lo for v, lo in zip(values, low)], [hi - v for v, hi in zip(values, high)]]
        ax.barh([y for y, _ in rows], values, 0.4, xerr=errors, capsize=2, label=label)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(list(range(len(names))), names)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s relative to ar (95% paired bootstrap interval over prompts)")
    ax.legend()
    _save(fig, folder / "speedup.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, accepted, fraction in _lines(_accepted_rows(greedy)):
        ax.plot(accepted, fraction, marker="o", label=method)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("accepted drafted tokens per round (greedy)")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize="small")
    _save(fig, folder / "accepted_length.png")


def _lines(rows: list[tuple]) -> list[tuple[str, list[int], list[float]]]:
    methods_ = dict.fromkeys(r[0] for r in rows)
    return [(m, [r[1] for r in rows if r[0] == m], [r[2] for r in rows if r[0] == m])
            for m in methods_]


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)


def methods(metrics: dict) -> dict:
    """The methods of a bench.json mode (its other top-level entries are not methods)."""
    return {name: m for name, m in metrics.items() if name not in NOT_METHODS}


def _ci(entry: dict | None) -> str:
    """`1.23 [1.10, 1.35]`, or `-` where there is nothing to compare."""
    if entry is None:
        return "-"
    ci = entry["ci95"]
    return f"{entry['ratio']:.2f}" + ("" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]")


def _by_domain(entries: dict) -> str:
    """`1.10 [1.02, 1.19] (humaneval 1.25 [..], magpie ..)`: all prompts, then each domain."""
    rest = ", ".join(f"{d} {_ci(e)}" for d, e in entries.items() if d != "all")
    return f"{_ci(entries['all'])} ({rest})"


def _speedup(m: dict) -> dict:
    return {"ratio": m["speedup_vs_ar"], "ci95": m["speedup_vs_ar_ci95"]}


def claims(metrics: dict) -> list[str]:
    """The stage's claims, each against the best static method or a peer, with its interval."""
    s = metrics["summary"]
    lines = [f"exported policy ({s['winner']}) vs the best static method ({s['best_static']}): "
             f"{_ci(s['winner_vs_best_static'])}; vs ar {_ci(s['winner_vs_ar'])}; "
             f"vs sd {_ci(s['winner_vs_sd'])}"]
    if s.get("winner_measured_over_simulated") is not None:
        lines.append(f"exported policy's rounds (the prefills left out) vs its replay on val: "
                     f"{s['winner_measured_over_simulated']:.2f}")
    if s["hf_assisted_best"] is not None:
        peers = metrics["setup"]["peers"]
        lines.append(f"vs transformers ({s['hf_assisted_best']}, draft {peers['draft']}): "
                     f"exported policy {_ci(s['winner_vs_hf_assisted'])}, specstop "
                     f"{peers['same_draft_sd']} on the same draft "
                     f"{_ci(s['sd_vs_hf_assisted_same_draft'])}")
    lookup = s.get("lookup") or {}
    if lookup.get("tree_with_vs_without") is not None:
        lines.append("prompt lookup: " + "; ".join(
            f"{label} {_by_domain(lookup[key])}" for key, label in (
                ("tree_with_vs_without", f"`{EXPORTED_LOOKUP}` vs `{EXPORTED}`"),
                ("tree_with_vs_confidence_tree_with", f"vs `{CONFIDENCE_LOOKUP}`"),
                ("alone_vs_ar", f"`{LOOKUP}` vs `ar`"),
                ("hf_prompt_lookup_vs_ar", f"`{HF_LOOKUP}` vs `ar`")) if lookup.get(key)))
    sampled = s.get("sampling") or {}
    if sampled.get("winner_vs_best_static") is not None:
        replayed, tree = (sampled.get("winner_measured_over_simulated"),
                          sampled.get("tree_measured_over_simulated"))
        replay = (f"; its rounds vs its replay {replayed:.2f}" if replayed is not None else
                  f"; `{EXPORTED}`'s rounds vs its replay {tree:.2f}" if tree is not None else "")
        lines.append(f"sampling: exported policy ({sampled.get('winner')}) vs the best static "
                     f"method sampled "
                     f"({sampled['best_static']}): {_ci(sampled['winner_vs_best_static'])}; "
                     f"vs ar {_ci(sampled['winner_vs_ar'])}{replay}")
    if sampled.get("lookup_tree_vs_winner") is not None:
        lines.append(f"sampling: `{EXPORTED_LOOKUP}` vs `{EXPORTED}` "
                     f"{_by_domain(sampled['lookup_tree_vs_winner'])}; vs the best static method "
                     f"{_by_domain(sampled['lookup_tree_vs_best_static'])}")
    gap = s["max_divergence_gap"]
    lines.append(f"A/A noise (ar timed twice): {_ci(s['aa_noise'])}; {s['prompts']} prompts "
                 f"({', '.join(f'{d} {n}' for d, n in s['prompts_per_domain'].items())}); "
                 f"largest top-1/top-2 gap where a lossless output parts from ar's: "
                 f"{'none parted' if gap is None else f'{gap:.4f}'}")
    return lines


def markdown(metrics: dict) -> str:
    """The README's results table: every method against `ar`, with intervals, and where stage
    train replayed it on val, its rounds' speed (the prefills left out) beside the replayed
    (both vs `ar`), then the claims."""
    setup, sampling = metrics["setup"], metrics["sampling"]
    rows = [f"{setup['prompts']} held-out prompts ({', '.join(metrics['summary']['domains'])}), "
            f"{setup['max_new_tokens']} new tokens, "
            f"{str(setup['dtype']).removeprefix('torch.')} on {setup['device']} "
            f"({setup['threads']} threads); sampling at T={setup['temperature']}; 95% paired "
            "bootstrap intervals over prompts.",
            "",
            "| method | tok/s | vs `ar` (greedy) | by domain | rounds alone / replayed on val | "
            "accepted per target call | acceptance | identical to `ar` | vs `ar` (sampling) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, m in methods(metrics).items():
        sampled = _ci(_speedup(sampling[name])) if name in sampling else "-"
        domains = ", ".join(f"{d} {e['ratio']:.2f}"
                            for d, e in m.get("speedup_vs_ar_by_domain", {}).items())
        replayed = f"{m['round_speedup_vs_ar']:.2f} / {m['simulated_speedup']:.2f}" \
            if "simulated_speedup" in m else "-"
        rows.append(f"| `{name}` | {m['tokens_per_s']:.2f} | {_ci(_speedup(m))} | {domains} | "
                    f"{replayed} | {m['mean_accepted']:.2f} | {m['acceptance_rate']:.3f} | "
                    f"{m['exact_match_vs_ar']:.0%} | {sampled} |")
    return "\n".join(rows + [""] + [f"- {line}" for line in claims(metrics)]) + "\n"


def table(metrics: dict) -> str:
    """Greedy and sampling side by side, one line per method, then the claims."""
    rows = [f"{'method':28}{'tok/s':>8}  {'vs ar [95% CI]':<20}{'acc/call':>9}{'accept':>8}"
            f"{'=ar':>5}{'sim.':>7}  | sampling vs ar [95% CI]"]
    sampling = metrics["sampling"]
    for name, m in methods(metrics).items():
        sim = f"{m['simulated_speedup']:.2f}" if "simulated_speedup" in m else "-"
        sampled = _ci(_speedup(sampling[name])) if name in sampling else "-"
        rows.append(f"{name:28}{m['tokens_per_s']:>8.2f}  {_ci(_speedup(m)):<20}"
                    f"{m['mean_accepted']:>9.2f}{m['acceptance_rate']:>8.3f}"
                    f"{'yes' if m['greedy_identical_to_ar'] else 'no':>5}{sim:>7}  | {sampled}")
    latency, nan = metrics["latency"], float("nan")
    rows += claims(metrics)
    share = metrics["summary"].get("winner_decision_share")
    gated = metrics.get(metrics["summary"]["winner"] or EXPORTED, {}).get("gated_share")
    rows.append(f"exported policy's decisions: {100 * (share if share is not None else nan):.2f}% "
                f"of its decode time ({latency['draft_step_ms'].get('1', nan):.3f} ms per draft "
                f"step), {100 * (gated if gated is not None else nan):.1f}% of its rounds not "
                f"drafted (round gate); targets: {metrics['targets']}")
    return "\n".join(rows)


def stages_markdown(records: dict[str, dict]) -> str:
    """Minutes per stage of the run that wrote `records` (metrics/stages/*.json), what each
    achieved and the machine, for the README: figures from other CPUs are never mixed in."""
    if not records:
        return ""
    machines = {json.dumps(r["machine"], sort_keys=True) for r in records.values()}
    first = next(iter(records.values()))["machine"]
    total = sum(r["seconds"] for r in records.values()) / 60
    rows = ["", f"Stage times of this run: {first['cpu']}, {first['cores']} cores, CPU flags "
            f"{', '.join(first['cpu_flags']) or 'none of avx2/avx512'}"
            + (f", GPU {first['gpu']}" if first["gpu"] else "")
            + ("" if len(machines) == 1 else " (the stages ran on more than one machine)")
            + f"; {total:.1f} minutes in all (the venv install aside).", "",
            "| stage | minutes | achieved |", "|---|---|---|"]
    for name, r in records.items():
        done = ", ".join(f"{k} {_short(v)}" for k, v in r["achieved"].items())
        if r.get("sizes", {}).get("scale", 1) < 1:
            done += (f" (sizes x{r['sizes']['scale']:g}: the target's step "
                     f"{r['sizes']['step_ms']:g} ms)")
        rows.append(f"| {name} | {r['seconds'] / 60:.1f} | {done} |")
    return "\n".join(rows) + "\n"


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def update_readme(readme: Path, metrics: dict, stages: dict[str, dict] | None = None) -> None:
    """Replace the README's results section (between README_START and README_END) with the
    table of `metrics` (bench.json) and the stage times `stages` (metrics/stages/*.json)."""
    text = readme.read_text()
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise SpecstopError(f"{readme}: expected one '{README_START}' and one '{README_END}' line")
    head, rest = text.split(README_START)
    _, tail = rest.split(README_END)
    body = f"{README_START}\n{markdown(metrics)}{stages_markdown(stages or {})}{README_END}"
    write_atomic(readme, lambda tmp: tmp.write_text(head + body + tail))
