"""``python -m lmforge.serve PATH [--host H] [--port P] [--overrides JSON]``: the serve image's entry point."""

from __future__ import annotations

import argparse
import logging

from lmforge.config.base import parse_overrides, validate_config
from lmforge.config.serve import ServeConfig


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m lmforge.serve", description=__doc__, allow_abbrev=False)
    parser.add_argument("path", help="release directory models/<name>/<version>/ or ONNX model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port")
    parser.add_argument("--model-name", default=None, help="name in the routes (default: the release's)")
    parser.add_argument(
        "--overrides", default="{}", help='JSON object of ServeConfig fields, e.g. {"max_batch_size": 4}'
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = parse_overrides(args.overrides)
    if args.model_name:
        overrides["model_name"] = args.model_name
    cfg = validate_config(ServeConfig, overrides, prefix="serve")
    from lmforge.serve.server import serve_model  # imports kserve, onnxruntime and the tokenizer stack

    serve_model(args.path, host=args.host, port=args.port, cfg=cfg)


if __name__ == "__main__":
    main()
