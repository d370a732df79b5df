"""Entry point of the ``scaleout`` command.

Each subcommand lives in its own module under :mod:`scaleout.cli` and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` to the
handler ``handler(args) -> int`` (the process exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from scaleout import __version__

# Subcommand modules, imported lazily so that ``scaleout --help`` stays fast.
_SUBCOMMANDS = ("run", "bench", "testbed", "sim", "tune")

# The line `scaleout --help` shows for a subcommand, so that it need not import the module
# (some import torch). A subcommand missing here is imported to register its parser.
_SUMMARIES = {
    "run": "start N ranks of a script",
    "bench": "benchmarks, scaleout vs its peers side by side",
    "testbed": "emulated cluster: hosts as network namespaces on a shaped switch",
    "sim": "predict scale-out performance (simulator)",
    "tune": "tune scheduling (and codecs) for a workload and a network",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``scaleout`` parser, with ``command``'s full parser (others as summaries only).

    Args:
        command: the subcommand being run; ``None`` registers every subcommand in full.
    """
    parser = argparse.ArgumentParser(
        prog="scaleout",
        description="Scale-out PyTorch training on torch.distributed.",
        epilog="example: scaleout run -n 2 examples/train_digits.py --epochs 5",
    )
    parser.add_argument("--version", action="version", version=f"scaleout {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        if command is not None and name != command and name in _SUMMARIES:
            subparsers.add_parser(name, help=_SUMMARIES[name])
            continue
        try:
            module = importlib.import_module(f"scaleout.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"scaleout.cli.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in _SUBCOMMANDS else "")
    if argv[:1] == ["run"] and not {"-h", "--help"} & set(argv[1:2]):
        from scaleout.cli.run import split_argv

        own, target = split_argv(argv[1:])
        args = parser.parse_args(["run", *own])
        args.target = target
    else:
        args = parser.parse_args(argv)
    args.command_line = ["scaleout", *argv]  # for reports that record how they were made
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    unwritable = _unwritable_outputs(args)
    if unwritable:  # before the run, not after it
        print(f"scaleout {argv[0]}: error: {unwritable}", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


def _unwritable_outputs(args: argparse.Namespace) -> str | None:
    """Why a file the command will write (``--json``, ``--plot``, ``--chrome``, ``--output``)
    cannot be written, or None."""
    for option in ("json", "plot", "chrome", "output"):
        path = getattr(args, option, None)
        if not isinstance(path, str) or path in ("", "-"):
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"--{option} {path}: a folder, not a file"
        if not os.path.isdir(folder):
            return f"--{option} {path}: no folder {folder}"
        if not os.access(folder, os.W_OK):
            return f"--{option} {path}: the folder {folder} is not writable"
    return None


if __name__ == "__main__":
    sys.exit(main())
