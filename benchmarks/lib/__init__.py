"""What the benchmarks share: settings, traces, statistics, reports, baselines and helpers."""
