"""Runs several ``pretrain.run`` configs one after another on every rank of a ``torchrun`` job (not a test).

Usage: torchrun --nproc_per_node 2 distributed_child.py SHARDS TOKENIZER JOBS_JSON

JOBS_JSON is a list of ``[config_json, output_dir]``. The gloo process group is created once here, so
the runs share it (``distributed_context`` joins an existing group and leaves it alone).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch.distributed as dist

from lmforge.config import PretrainConfig
from lmforge.train import pretrain


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    shards, tokenizer, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    for config_json, output in jobs:
        pretrain.run(PretrainConfig.model_validate_json(config_json), shards, tokenizer, output)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
