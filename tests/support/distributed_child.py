"""Runs several training stages one after another on every rank of a ``torchrun`` job (not a test).

Usage: torchrun --nproc_per_node 2 distributed_child.py SHARDS TOKENIZER JOBS_JSON

JOBS_JSON is a list of ``[config_json, output_dir]`` (``pretrain.run`` on SHARDS and TOKENIZER) or of
``{"stage": name, "config": config_json, "io": {name: path}}`` (any training stage through
``lmforge.stages.run_stage``). The gloo process group is created once here, so the runs share it
(``distributed_context`` joins an existing group and leaves it alone).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from lmforge.config import DistillConfig, LoraConfig, PretrainConfig
from lmforge.stages import run_stage
from lmforge.train import pretrain

CONFIGS = {"pretrain": PretrainConfig, "finetune_lora": LoraConfig, "distill": DistillConfig}


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    shards, tokenizer, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    for job in jobs:
        if isinstance(job, dict):
            run_stage(job["stage"], CONFIGS[job["stage"]].model_validate_json(job["config"]), job["io"])
        else:
            config_json, output = job
            pretrain.run(
                PretrainConfig.model_validate_json(config_json), shards=shards, tokenizer=tokenizer, model=output
            )
        dist.barrier()
    dist.destroy_process_group()


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 540) -> None:
    """Run ``script args`` under ``torchrun --standalone`` with ``nproc`` gloo CPU ranks (one thread each).

    Raises:
        AssertionError: torchrun failed; the message holds the first traceback of its output.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
        str(script), *args,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    first_error = proc.stderr.find("Traceback")
    assert proc.returncode == 0, proc.stderr[first_error : first_error + 4000]


def launch(jobs: list, *, shards: str = "", tokenizer: str = "", nproc: int = 2, timeout: float = 540) -> None:
    """Run ``jobs`` (see the module docstring) on every rank of a :func:`torchrun` job of ``nproc`` ranks."""
    torchrun(Path(__file__), shards, tokenizer, json.dumps(jobs), nproc=nproc, timeout=timeout)


if __name__ == "__main__":
    main()
