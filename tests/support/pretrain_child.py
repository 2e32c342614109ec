"""Runs ``pretrain.run`` in a child process for the kill, DDP and DeepSpeed tests (not a test module).

Usage: python pretrain_child.py CONFIG_JSON SHARDS TOKENIZER OUTPUT [HANG_AT_STEP]

With HANG_AT_STEP the child prints ``HANG <step>`` after that optimizer step (and its checkpoint) and
then waits to be killed, so the parent kills it at an exact step without relying on timing.
"""

from __future__ import annotations

import logging
import sys
import time

from lmforge.config import PretrainConfig
from lmforge.train import pretrain


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    cfg = PretrainConfig.model_validate_json(sys.argv[1])
    shards, tokenizer, output = sys.argv[2:5]
    hang_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    train = pretrain.train

    def on_step(step: int, record: dict) -> None:
        if step == hang_at:
            print(f"HANG {step}", flush=True)
            time.sleep(3600)

    pretrain.train = lambda *args, **kwargs: train(*args, **kwargs, on_step=on_step)
    pretrain.run(cfg, shards=shards, tokenizer=tokenizer, model=output)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
