"""Markdown tables of a ``results.json`` (``real_model_remedies.py --report``)."""

from __future__ import annotations

from remedies.common import (
    ITEMS,
)


def markdown(results: dict) -> str:
    """One Markdown table per item in ``results`` (what docs/long-context.md shows)."""
    out = []

    def table(head: list[str], rows: list[list]) -> None:
        out.extend(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)])
        out.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
        out.append("")

    if "blocks" in results:
        r = results["blocks"]
        table(["check", "max abs logits difference"],
              [[f"one {r['block']}-token block vs {r['block']} decode steps, {name}", f"{d:.1e}"]
               for name, d in r["block_vs_steps_max_abs_logit_diff"].items()] +
              [["KIVI 4-bit cache written from the fp cache vs prefilled in one chunk",
                f"{r['kivi4_one_chunk_vs_written_max_abs_logit_diff']:.1e}"]])
    if "kivi" in results:
        r = results["kivi"]
        table(["KV", "mean KL(fp ‖ q), nats", "top-1 agreement", "perplexity", "Δ perplexity"],
              [["fp32" if b == "16" else f"{b}-bit", f"{v['kl']:.2e}", f"{v['top1_agreement']:.4f}",
                f"{v['perplexity']:.3f}", f"{v['perplexity_delta']:+.3f}"] for b, v in r["by_bits"].items()])
    if "stream" in results:
        r = results["stream"]
        seg = r["segment"]
        count = len(next(iter(r["policies"].values()))["perplexity"])
        table(["policy", "fed in blocks of"] + [f"{i * seg // 1024}K–" if seg % 1024 == 0 else f"{i * seg}–"
                                                 for i in range(count)],
              [[name, row["block"]] + [f"{p:.2f}" for p in row["perplexity"]] for name, row in r["policies"].items()])
    if "passkey" in results:
        r = results["passkey"]
        cells = {(c["policy"], c["length"], c["depth"]): c["correct"] for c in r["cells"]}
        table(["policy"] + [f"L={length}" for length in r["lengths"]],
              [[name] + ["".join("✓" if cells[name, length, d] else "✗" for d in r["depths"]) +
                         f" ({r['accuracy'][name][str(length)]:.2f})" for length in r["lengths"]]
               for name in r["accuracy"]])
    if "speculative" in results:
        r = results["speculative"]
        rows = []
        for task in r["tasks"]:
            for mode, m in task["modes"].items():
                acceptance = f"{m['acceptance_rate']:.2f}" if "acceptance_rate" in m else "—"
                rows.append([f"{task['file']}:{task['function']} ({task['new_tokens']} tokens)", mode,
                             f"{m['min_s']:.1f} / {m['median_s']:.1f}",
                             f"x{m['speedup_min']:.2f} / x{m['speedup_median']:.2f}", acceptance,
                             f"{m['tokens_per_forward']:.2f}"])
        table(["task", "mode", "s min / median", "speed-up min / median", "acceptance", "tokens / forward"], rows)
    if "prefix" in results:
        r = results["prefix"]
        table(["time to first token", "ms min / median"],
              [[name, f"{1000 * t['min_s']:.0f} / {1000 * t['median_s']:.0f}"] for name, t in r["ttft"].items()] +
              [["speed-up (min / median)", f"x{r['speedup_min']:.1f} / x{r['speedup_median']:.1f}"],
               ["max abs logits difference", f"{r['max_abs_logit_diff']:.1e}"]])
    if "speed" in results:
        r = results["speed"]
        rows = []
        for key, what in (("prefill", f"prefill {r['prefill_tokens']}"), ("decode_batch1", f"decode @{r['context']}, "
                          "batch 1"), ("decode_batch16", f"decode @{r['context']}, batch 16")):
            for name, t in r.get(key, {}).items():
                rows.append([what, name, f"{t['min_ms']:.1f} / {t['median_ms']:.1f}",
                             f"x{t['speedup_min']:.2f} / x{t['speedup_median']:.2f}" if "speedup_min" in t else "—"])
        table(["what", "who", "ms min / median", "transformers / this (min / median)"], rows)
    times = [[item, f"{results[item]['wall_s']:.0f}", results[item]["threads"], results[item]["quick"],
              f"{results[item]['load_average_before'][0]:.1f} → {results[item]['load_average_after'][0]:.1f}"]
             for item in ITEMS if item in results]
    table(["item", "wall s", "threads", "quick", "load average (1 min) before → after"], times)
    return "\n".join(out)
