"""What the int8 tier's kept calibration (engine/int8_ranges.py) saves: SmolLM2's int8 runner built twice in a fresh
directory (links to the prepared model's files, so nothing is kept there yet), the first build calibrating, the
second reading the ranges back; the two models compared to the bit.

    python -m bench.int8_calibration [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the engine's own count in a tier)")
    args = ap.parse_args()

    import torch

    from assets.model_source import DEFAULT_MODEL, prepare_model
    from engine.model_runner import ModelRunner
    from gateway.settings import Settings

    torch.set_num_threads(args.threads)
    source = prepare_model(DEFAULT_MODEL, Settings().resolved_models_dir, progress=True)  # as `tiergate serve`
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / source.name
        model_dir.mkdir()
        for f in source.iterdir():
            if f.is_file() and not f.name.startswith("tiergate-int8-ranges-"):
                (model_dir / f.name).symlink_to(f)
        runners, seconds = [], []
        for _ in range(2):
            start = time.perf_counter()
            runners.append(ModelRunner(model_dir, dtype="fp32", quantize="int8", kv_cache_bytes=1 << 24))
            seconds.append(time.perf_counter() - start)
    one, two = (r.model.state_dict() for r in runners)
    same = one.keys() == two.keys() and all(
        torch.equal(v, two[k]) for k, v in one.items() if isinstance(v, torch.Tensor))
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    print(f"first build (calibrates): {seconds[0]:.1f} s; second (reads the kept ranges): {seconds[1]:.1f} s "
          f"({seconds[0] / seconds[1]:.1f}x); the same int8 model to the bit: {same}")


if __name__ == "__main__":
    main()
