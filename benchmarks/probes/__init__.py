"""One-off measurements behind figures and choices in docs/benchmarks.md and benchmarks/reports/: kept so each
figure can be reproduced, not run as benchmarks (docs/benchmarks.md lists those)."""
