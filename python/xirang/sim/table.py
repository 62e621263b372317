"""Plain-text tables of result rows."""
from __future__ import annotations


def table(rows: list, cols: list) -> str:
    def f(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)
    cells = [[f(r.get(c)) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)] if cells else [len(c) for c in cols]
    line = lambda xs: "  ".join(x.ljust(w[i]) for i, x in enumerate(xs))  # noqa: E731
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(x) for x in cells])
