"""The `motet` command: builds its Config from the flags and the environment (once, in
cli/config.py) and composes the parts.

stdout carries only what the user asked for (answers, info); logs go to stderr.
"""

from __future__ import annotations

import logging
import os
import sys

from ..runtime.allocator import tune_malloc
from .commands import (
    cmd_chat,
    cmd_info,
    cmd_mux,
    cmd_serve,
    cmd_worker,
    in_group,
)
from .config import build_config
from .flags import build_parser

COMMANDS = {"chat": cmd_chat, "info": cmd_info, "mux": in_group(cmd_mux), "serve": in_group(cmd_serve),
            "worker": cmd_worker}


def main(argv: list[str] | None = None) -> int:
    tune_malloc(os.environ)  # before JAX starts a thread (runtime/allocator.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "quantize", None):  # one weight format passed down: --dtype's
        if args.dtype != "auto":
            parser.error(f"--quantize {args.quantize} computes in float32 from quantized weights; "
                         f"it cannot go with --dtype {args.dtype}")
        args.dtype = args.quantize
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="motet: %(message)s")
    # JAX reports each accelerator plugin it did not find; that is not news on a CPU host.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from ..model.errors import ModelError

    try:
        return COMMANDS[args.command](build_config(args, os.environ))
    except (ModelError, ValueError) as exc:
        print(f"motet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
