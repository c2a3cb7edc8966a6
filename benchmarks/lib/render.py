"""Turn a report's results dict (benchmarks/report.py) into Markdown tables and matplotlib plots."""

from __future__ import annotations

import math
from pathlib import Path

LATENCY_COLUMNS = [(kind, metric, q) for kind in ("short", "long") for metric in ("ttft", "e2e")
                   for q in ("p50", "p95", "p99")] + [("all", "e2e", "p99")]  # all: the static floor's p99


def _cell(stat: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """median [min–max] of one metric across repetitions."""
    if not stat or not stat.get("n") or stat.get("median") is None or math.isnan(stat["median"]):
        return "–"
    m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
    if stat["n"] == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def rate_label(rate: float | str | None) -> str:
    if isinstance(rate, str):
        return rate
    return "offline" if rate is None else f"{rate:g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(results: dict) -> str:
    out = [f"# Benchmark report ({results['environment']['date']})", ""]
    out += _setup_section(results)
    out += _throughput_section(results["points"])
    out += _kv_section(results)
    out += _overhead_section(results.get("overhead"))
    floors = results.get("floors")
    if floors:
        out += ["", "## Floors", ""]
        out += _table(["check", "rate", "measured", "floor", "pass", "note"],
                      [[f["check"], rate_label(f.get("rate")), "–" if f["value"] is None else f"{f['value']:.3g}",
                        f["floor"], "yes" if f["pass"] else "no", f.get("note", "")] for f in floors])
    if results.get("notes"):
        out += ["", "## Notes", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(out) + "\n"


def _setup_section(results: dict) -> list[str]:
    """Machine and versions, the noise note and the sweep's settings."""
    env, cfg = results["environment"], results["config"]
    out = ["## Machine and versions", ""]
    out += _table(["item", "value"], [
        ["CPU", f"{env['cpu_model']} ({env['num_cpus']} cores)"],
        ["torch threads", str(env["torch_threads"])],
        ["python / torch / transformers", f"{env['python']} / {env['torch']} / {env['transformers']}"],
        ["load average before / after (1 min)", f"{env['load_before'][0]:.2f} / {env['load_after'][0]:.2f}"],
        ["model", cfg["model"]],
    ])
    out += ["", "## Noise", "", results["noise_note"], ""]
    out += ["## Setup", ""]
    out += _table(["setting", "value"], [[k, str(v)] for k, v in cfg.items() if k != "model"])
    out += ["", "Cells are the median over repetitions, [min–max] in brackets. Latencies in seconds; "
            "rate `offline` means every request arrives at t=0 (saturation).", ""]
    return out


def _throughput_section(points: list[dict]) -> list[str]:
    out = ["## Throughput and latency", ""]
    header = ["system", "rate (req/s)", "output tok/s", "req/s"] + [f"{k} {m} {q}" for k, m, q in LATENCY_COLUMNS]
    rows = []
    for point in points:
        s = point["summary"]
        rows.append([point["system"], rate_label(point["rate"]), _cell(s["output_tokens_per_s"], digits=1),
                     _cell(s["requests_per_s"])]
                    + [_cell(s.get(f"{k}_{m}_{q}")) for k, m, q in LATENCY_COLUMNS])
    return out + _table(header, rows)


def _kv_section(results: dict) -> list[str]:
    """KV figures per point, then paged vs contiguous capacity in the engine's KV budget."""
    out = ["", "## KV cache", ""]
    rows = [[p["system"], rate_label(p["rate"]), _cell(p["summary"].get("kv_utilisation_mean")),
             _cell(p["summary"].get("kv_pool_usage_max")), _cell(p["summary"].get("max_concurrent"), digits=0)]
            for p in results["points"]]
    out += _table(["system", "rate", "KV utilisation (held/allocated, mean per step)", "KV pool usage max",
                   "max concurrent"], rows)
    cap = results.get("kv_capacity")
    if not cap:
        return out
    out += ["", "For the engine's KV budget of {:.0f} MiB ({} bytes per token):".format(
        cap["kv_budget_bytes"] / 2**20, cap["bytes_per_token"]), ""]
    return out + _table(["layout", "requests that fit", "utilisation at the trace's lengths"], [
        [f"contiguous, max_model_len {cap['max_model_len']} reserved per request",
         str(cap["contiguous_max_len_capacity"]), f"{cap['contiguous_utilisation_at_trace_lengths']:.2f}"],
        [f"paged ({results['config'].get('block_size')}-token blocks), trace lengths",
         str(cap["paged_capacity_at_trace_lengths"]), f"{cap['paged_utilisation_at_trace_lengths']:.2f}"],
        ["paged, observed max concurrent (capped by max_num_seqs {})".format(cap["max_num_seqs"]),
         str(cap["paged_observed_max_concurrent"]), "–"],
    ])


def _overhead_section(overhead: dict | None) -> list[str]:
    if not overhead:
        return []
    out = ["", "## Engine overhead", "", "Decode steps with {} requests running; time outside the model "
           "forward ÷ step time, over {} repetitions.".format(overhead["num_running"], overhead["n"]), ""]
    return out + _table(["metric", "value"], [
        ["step time (s)", _cell(overhead["step_s_median"], digits=3)],
        ["forward time (s)", _cell(overhead["forward_s_median"], digits=3)],
        ["overhead fraction", _cell(overhead["overhead_fraction"], digits=3)],
    ])


def render_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    systems = list(dict.fromkeys(p["system"] for p in results["points"]))
    by_system = {s: [p for p in results["points"] if p["system"] == s] for s in systems}
    finite = sorted({p["rate"] for p in results["points"] if p["rate"] is not None})
    has_offline = any(p["rate"] is None for p in results["points"])
    return [
        _plot_latency_vs_throughput(by_system, out_dir / "latency_vs_throughput.png"),
        _plot_short_p99_vs_rate(by_system, finite, has_offline, out_dir / "short_p99_vs_rate.png"),
        _plot_kv_utilisation(by_system, finite, has_offline, out_dir / "kv_utilisation.png"),
    ]


def _median(point: dict, key: str) -> float:
    """A point's median of `key` across repetitions; NaN where it was not measured."""
    stat = point["summary"].get(key)
    return stat["median"] if stat and stat.get("n") and stat["median"] is not None else math.nan


def _plot_latency_vs_throughput(by_system: dict[str, list[dict]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s, points in by_system.items():
        points = sorted(points, key=lambda p: _median(p, "output_tokens_per_s"))
        x = [_median(p, "output_tokens_per_s") for p in points]
        for ax, key in zip(axes, ("short_e2e_p99", "long_e2e_p99")):
            ax.plot(x, [_median(p, key) for p in points], marker="o", label=s)
    for ax, title in zip(axes, ("short requests", "long requests")):
        ax.set(xlabel="output tokens/s", ylabel="end-to-end p99 (s)", title=f"latency vs throughput: {title}")
        ax.set_yscale("log")
        ax.legend()
    return _save(fig, path)


def _plot_short_p99_vs_rate(by_system: dict[str, list[dict]], finite: list[float], has_offline: bool,
                            path: Path) -> Path:
    import matplotlib.pyplot as plt

    # The offline point (every request at t=0) sits right of the highest rate, on a tick of its own.
    offline_x = 1.25 * finite[-1] if finite else 1.0

    def x_of(rate: float | None) -> float:
        return offline_x if rate is None else rate

    fig, ax = plt.subplots(figsize=(6, 4))
    for s, points in by_system.items():
        pts = sorted(points, key=lambda p: x_of(p["rate"]))
        stats = [p["summary"].get("short_e2e_p99") for p in pts]
        ys = [st["median"] if st and st.get("n") else math.nan for st in stats]
        err = [[y - (st["min"] if st and st.get("n") else y) for y, st in zip(ys, stats)],
               [(st["max"] if st and st.get("n") else y) - y for y, st in zip(ys, stats)]]
        ax.errorbar([x_of(p["rate"]) for p in pts], ys, yerr=err, marker="o", capsize=3, label=s)
    ax.set(xlabel="arrival rate (req/s)", ylabel="short-request e2e p99 (s)", title="short p99 vs rate")
    ticks = finite + ([offline_x] if has_offline else [])
    if ticks:
        ax.set_xticks(ticks, [rate_label(r) for r in finite] + (["offline"] if has_offline else []))
        ax.set_yscale("log")
    ax.legend()
    return _save(fig, path)


def _plot_kv_utilisation(by_system: dict[str, list[dict]], finite: list[float], has_offline: bool,
                         path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [rate_label(r) for r in finite] + (["offline"] if has_offline else [])
    sampled = [s for s, points in by_system.items()
               if any(not math.isnan(_median(p, "kv_utilisation_mean")) for p in points)]
    width = 0.8 / max(1, len(sampled))
    for i, s in enumerate(sampled):
        values = {rate_label(p["rate"]): _median(p, "kv_utilisation_mean") for p in by_system[s]}
        ax.bar([j + i * width for j in range(len(labels))], [values.get(label, math.nan) for label in labels],
               width, label=s)
    ax.set_xticks([j + width * (len(sampled) - 1) / 2 for j in range(len(labels))], labels)
    ax.set(xlabel="arrival rate (req/s)", ylabel="KV tokens held / allocated", ylim=(0, 1.05),
           title="KV-cache utilisation (mean per step)")
    ax.legend(fontsize="small")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
