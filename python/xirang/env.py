"""Print every XIRANG_* environment knob with its default: `python -m xirang.env [--markdown]`.

The table is declared once, in csrc/core/env.cc; README.md mirrors the --markdown output (a test
checks that they agree).
"""
from __future__ import annotations

import argparse


def markdown_table() -> str:
    """The knobs as the markdown table README.md carries."""
    import xirang

    rows = ["| knob | default | type | read | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, default, help_, type_, read in xirang.env_knobs():
        shown = f"`{default}`" if default else "(unset)"
        rows.append(f"| `{name}` | {shown} | {type_} | {read} | {help_} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m xirang.env", description=__doc__)
    p.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return
    import os

    import xirang

    for name, default, help_, type_, read in xirang.env_knobs():
        cur = os.environ.get(name)
        print(f"{name:28} default={default or '(unset)':10} {type_:6} read per {read:7} {'now=' + cur if cur else ''}"
              f"\n    {help_}")


if __name__ == "__main__":
    main()
