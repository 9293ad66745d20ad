#!/usr/bin/env python3
"""Writes docs/cli.md from the `dllm-serve` commands' --help (tests/test_docs.py checks it is current)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def render() -> str:
    import click
    from common.cli import main
    out = ["# Command-line reference\n", "Generated from `--help` by `scripts/gen_cli_docs.py`; "
           "`tests/test_docs.py` fails when it is out of date.\n"]
    for name in sorted(main.commands):
        cmd = main.commands[name]
        with click.Context(cmd, info_name=f"dllm-serve {name}", terminal_width=110, max_content_width=110) as ctx:
            out.append(f"\n## dllm-serve {name}\n\n```\n{cmd.get_help(ctx)}\n```\n")
    return "".join(out)


if __name__ == "__main__":
    (ROOT / "docs" / "cli.md").write_text(render())
