"""README.md mirrors the knob table declared in csrc/core/env.cc (issue #2, operability)."""
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_knob_table_matches_env_cc():
    xenv = pytest.importorskip("xirang.env", reason="xirang not importable")
    text = README.read_text()
    begin = text.index("<!-- knobs:begin")
    begin = text.index("\n", begin) + 1
    end = text.index("<!-- knobs:end -->")
    assert text[begin:end].strip() == xenv.markdown_table().strip(), (
        "README's knob table is stale: regenerate it with `python -m xirang.env --markdown`"
    )
