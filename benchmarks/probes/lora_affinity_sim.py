"""A simulation, not a measurement: adapter loads per 1,000 requests on two workers with least-recently-used
residency, requests routed by adapter or by request id (CRC-32 over the priority's partitions, as the wire does),
adapters drawn uniformly or by a Zipf law. It shows how far routing alone can go when the fleet holds fewer
adapters than its traffic names (bench_lora_affinity.py measures the real thing).

    python -m benchmarks.probes.lora_affinity_sim
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict


def loads_per_1000(by_adapter: bool, zipf: float, num_adapters: int = 32, slots: int = 8, partitions: int = 2,
                   requests: int = 20_000, seed: int = 0) -> float:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(num_adapters)]
    residents: list[OrderedDict] = [OrderedDict(), OrderedDict()]
    loads = 0
    for i in range(requests):
        adapter = rng.choices(range(num_adapters), weights)[0]
        key = f"ft-{adapter:02d}" if by_adapter else f"req-{i}-{rng.random()}"
        worker = (zlib.crc32(key.encode()) % partitions) % 2
        resident = residents[worker]
        if adapter in resident:
            resident.move_to_end(adapter)
            continue
        loads += 1
        resident[adapter] = True
        if len(resident) > slots:
            resident.popitem(last=False)
    return 1000.0 * loads / requests


def main() -> None:
    for zipf in (0.0, 0.5, 1.0, 1.2):
        spread, routed = loads_per_1000(False, zipf), loads_per_1000(True, zipf)
        print(f"zipf {zipf}: by request id {spread:.0f}, by adapter {routed:.0f} per 1,000 ({routed / spread:.2f})")


if __name__ == "__main__":
    main()
