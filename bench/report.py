"""metrics/bench.json, the per-prompt CSV, the plot data and PNGs of stage `bench`.

bench.json: greedy methods at the top level (CONTRACTS.md keys: `tokens_per_s`,
`speedup_vs_ar`, `mean_accepted`, `acceptance_rate`, `greedy_identical_to_ar`, plus counts and
quality), the same under `sampling`, the exported policy (`ti-mcsd+stop_model`) with
`speedup_vs_hf_assisted`, `speedup_vs_best_static_sd` and its simulated speedup beside the
measured one; `setup`, `latency` (a draft step beside a decision) and `targets` (issue 6's
checks).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from specstop.common.files import write_atomic, write_json
from specstop.evaluation.side_by_side import MethodResult
from specstop.models.plots import plt, write_csv

EXPORTED, HF, SD = "ti-mcsd+stop_model", "hf-assisted", "sd"
HF_TARGET, SIMULATION_TOLERANCE = 1.2, 0.15
NOT_METHODS = ("sampling", "setup", "latency", "targets")  # bench.json's other entries


def write(results: dict[str, list[MethodResult]], prompt_ids: list[str], setup: dict,
          latency: dict, simulated: dict[str, float], path: Path, folder: Path) -> dict:
    """Write every output; return bench.json's content."""
    greedy = _mode(results["greedy"], len(prompt_ids), True, simulated)
    metrics = {**greedy, "sampling": _mode(results["sampling"], len(prompt_ids), False, {}),
               "setup": setup, "latency": latency, "targets": _targets(greedy)}
    write_json(path, metrics)
    _per_prompt_csv(results, prompt_ids, folder / "per_prompt.csv")
    for mode, entries in results.items():
        by_method = metrics if mode == "greedy" else metrics["sampling"]
        write_csv(folder / "speedup" / f"{mode}.csv", ["method", "speedup_vs_ar"],
                        [(r.method, by_method[r.method]["speedup_vs_ar"]) for r in entries])
        write_csv(folder / "accepted_length" / f"{mode}.csv",
                        ["method", "accepted", "fraction"], _accepted_rows(entries))
    _figures(metrics, results["greedy"], folder)
    write_atomic(folder / "results.md", lambda tmp: tmp.write_text(markdown(metrics)))
    return metrics


def _mode(results: list[MethodResult], n: int, greedy: bool, simulated: dict) -> dict:
    ar = results[0].stats.tokens_per_s
    out = {r.method: _method(r, ar, n, greedy) for r in results}
    for name, speedup in simulated.items():
        if name in out:
            out[name]["simulated_speedup"] = speedup
            out[name]["measured_over_simulated"] = out[name]["speedup_vs_ar"] / speedup
    if EXPORTED in out:
        exported = out[EXPORTED]["tokens_per_s"]
        if HF in out:
            out[EXPORTED]["speedup_vs_hf_assisted"] = exported / out[HF]["tokens_per_s"]
        out[EXPORTED]["speedup_vs_best_static_sd"] = exported / out[SD]["tokens_per_s"]
    return out


def _method(result: MethodResult, ar: float, n: int, greedy: bool) -> dict:
    s = result.stats
    out = {"tokens_per_s": s.tokens_per_s, "speedup_vs_ar": s.tokens_per_s / ar if ar else 0.0,
           "mean_accepted": s.mean_accepted, "acceptance_rate": s.acceptance_rate,
           "target_calls": s.target_calls, "draft_steps": s.draft_steps,
           "new_tokens": s.new_tokens, "seconds": s.seconds,
           "exact_match_vs_ar": result.identical_to_ar / n,
           "mean_target_logprob": result.mean_logprob(n)}
    if greedy:
        out["greedy_identical_to_ar"] = result.identical_to_ar == n
    return out


def _targets(greedy: dict) -> dict:
    """Issue 6: exported policy ≥ 1.2x transformers' assisted generation, faster than `sd` at
    its best γ, simulated and measured speedups within 15%."""
    exported = greedy.get(EXPORTED, {})
    vs_hf = exported.get("speedup_vs_hf_assisted")
    ratio = exported.get("measured_over_simulated")
    return {"vs_hf_assisted_ge_1_2": None if vs_hf is None else vs_hf >= HF_TARGET,
            "faster_than_best_static_sd": exported.get("speedup_vs_best_static_sd", 0) > 1,
            "simulated_within_15pct": None if ratio is None
            else abs(ratio - 1) <= SIMULATION_TOLERANCE,
            "lossless_greedy_identical": all(
                m["greedy_identical_to_ar"] for name, m in greedy.items()
                if "lossy" not in name and name != "ar")}


def _per_prompt_csv(results: dict[str, list[MethodResult]], prompt_ids: list[str],
                    path: Path) -> None:
    header = ["mode", "method", "prompt", "prompt_id", "new_tokens", "seconds", "tokens_per_s",
              "target_calls", "draft_steps", "mean_accepted", "acceptance_rate",
              "identical_to_ar", "mean_target_logprob"]
    rows = [(mode, r.method, i, prompt_ids[i], s.new_tokens, round(s.seconds, 4),
             round(s.tokens_per_s, 3), s.target_calls, s.draft_steps,
             round(s.mean_accepted, 4), round(s.acceptance_rate, 4), int(r.identical[i]),
             round(r.logprobs[i], 4))
            for mode, entries in results.items() for r in entries
            for i, s in enumerate(r.per_prompt)]
    write_csv(path, header, rows)


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
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    y = range(len(names))
    ax.barh([i - 0.2 for i in y], [metrics[n]["speedup_vs_ar"] for n in names], 0.4,
            label="greedy")
    ax.barh([i + 0.2 for i in y], [metrics["sampling"][n]["speedup_vs_ar"] for n in names], 0.4,
            label="sampling")
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s relative to ar")
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
    methods = dict.fromkeys(r[0] for r in rows)
    return [(m, [r[1] for r in rows if r[0] == m], [r[2] for r in rows if r[0] == m])
            for m in methods]


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120,
                                                     bbox_inches="tight"))
    plt.close(fig)


def methods(metrics: dict) -> dict:
    """The greedy methods of bench.json (its other top-level entries are not methods)."""
    return {name: m for name, m in metrics.items() if name not in NOT_METHODS}


def markdown(metrics: dict) -> str:
    """The README's results table: greedy and sampling speed of every method vs `ar`."""
    setup, sampling = metrics["setup"], metrics["sampling"]
    rows = [f"{setup['prompts']} held-out prompts, {setup['max_new_tokens']} new tokens, "
            f"{str(setup['dtype']).removeprefix('torch.')} on {setup['device']}; sampling at T={setup['temperature']}.",
            "",
            "| method | tok/s | vs `ar` | accepted per target call | acceptance | identical "
            "to `ar` | sampling: vs `ar` |",
            "|---|---|---|---|---|---|---|"]
    for name, m in methods(metrics).items():
        sampled = f"{sampling[name]['speedup_vs_ar']:.2f}" if name in sampling else "-"
        rows.append(f"| `{name}` | {m['tokens_per_s']:.2f} | {m['speedup_vs_ar']:.2f} | "
                    f"{m['mean_accepted']:.2f} | {m['acceptance_rate']:.3f} | "
                    f"{m['exact_match_vs_ar']:.0%} | {sampled} |")
    return "\n".join(rows) + "\n"


def table(metrics: dict) -> str:
    """Greedy and sampling side by side, one line per method."""
    rows = [f"{'method':26}{'tok/s':>8}{'vs ar':>7}{'acc/call':>9}{'accept':>8}{'=ar':>5}"
            f"{'logp':>7}{'sim.':>7}  | sampling {'tok/s':>7}{'vs ar':>7}{'acc/call':>9}"]
    sampling = metrics["sampling"]
    for name, m in methods(metrics).items():
        s = sampling.get(name, {})
        sim = f"{m['simulated_speedup']:.2f}" if "simulated_speedup" in m else "-"
        rows.append(f"{name:26}{m['tokens_per_s']:>8.2f}{m['speedup_vs_ar']:>7.2f}"
                    f"{m['mean_accepted']:>9.2f}{m['acceptance_rate']:>8.3f}"
                    f"{'yes' if m['greedy_identical_to_ar'] else 'no':>5}"
                    f"{m['mean_target_logprob']:>7.2f}{sim:>7}  |          "
                    f"{s.get('tokens_per_s', 0):>7.2f}{s.get('speedup_vs_ar', 0):>7.2f}"
                    f"{s.get('mean_accepted', 0):>9.2f}")
    exported, latency, nan = metrics.get(EXPORTED, {}), metrics["latency"], float("nan")
    rows.append(f"exported policy: {exported.get('speedup_vs_hf_assisted', nan):.2f}x "
                f"transformers' assisted generation, "
                f"{exported.get('speedup_vs_best_static_sd', nan):.2f}x sd at its best γ; "
                f"{latency['decision_ms'].get('stop_model', nan):.3f} ms per decision "
                f"vs {latency['draft_step_ms'].get('1', nan):.3f} ms per draft step")
    rows.append(f"targets: {metrics['targets']}")
    return "\n".join(rows)
