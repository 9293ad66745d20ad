#!/usr/bin/env python3
"""Writes docs/cli.md from the `dllm-serve` commands' --help (tests/test_docs.py checks it is current)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _venv  # noqa: E402,F401  (re-runs this script with the project's .venv)


def render() -> str:
    import click
    from dllm_serve.cli import main
    out = ["# Command-line reference\n", "Generated from `--help` by `scripts/gen_cli_docs.py`; "
           "`tests/test_docs.py` fails when it is out of date.\n"]
    # a child of the group's context, as at run time (the group's settings, e.g. -h, apply)
    parent = click.Context(main, info_name="dllm-serve", terminal_width=110, max_content_width=110)
    for name in sorted(main.commands):
        cmd = main.commands[name]
        with click.Context(cmd, parent=parent, info_name=name, terminal_width=110, max_content_width=110) as ctx:
            out.append(f"\n## dllm-serve {name}\n\n```\n{cmd.get_help(ctx)}\n```\n")
    return "".join(out)


if __name__ == "__main__":
    if "--stdout" in sys.argv:
        sys.stdout.write(render())
    else:
        (ROOT / "docs" / "cli.md").write_text(render())
