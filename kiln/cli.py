"""`kiln generate | serve | ...`: the command line. Each subcommand lives in its own module,
which registers its parser and runs it; this file is only the table."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

from kiln import logs

# subcommand -> the module that registers and runs it, in the order --help lists them
COMMANDS = {
    "generate": "kiln.tools.generate",
    "serve": "kiln.tools.serve",
    "traffic": "kiln.tools.traffic",
    "bisect": "kiln.tools.bisect",
    "bench": "kiln.tools.bench",
    "prewarm": "kiln.tools.prewarm",
    "inspect": "kiln.tools.inspect_cmd",
    "cache": "kiln.tools.cache_cli",
}


def main(argv: list[str] | None = None) -> int:
    from kiln.compile.config import expand_compilation_flags

    if hasattr(signal, "SIGXFSZ"):
        # Past a file-size limit a write then fails with EFBIG, which the compile cache survives
        # (it is given up for the process), instead of the signal killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: an LLM inference engine whose torch.compile pipeline is the product",
                                     epilog="Compilation: -O0..-O3, -cc.<key>=<value>, "
                                            "--compilation-config '<json>', --enforce-eager")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).register(commands)
    try:
        # -cc.<key>=<value> is not argparse-shaped: it becomes -cc <key>=<value> first.
        args = parser.parse_args(expand_compilation_flags(sys.argv[1:] if argv is None else argv))
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format=logs.FORMAT,
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
