"""The text summary: a few lines naming the hottest group, the slowest rank and link, bytes, exposure."""
from __future__ import annotations

from typing import Any, Dict, List

from .records import STACK

NOISE_RATIO = 1.5  # "slowest" is flagged as clear only when it beats the runner-up by this much


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def summary_lines(a: Dict[str, Any]) -> List[str]:
    run = a["run"]
    what = f"{a['steps']} steps of the hook's groups" if a["mode"] == "hook" else f"{a['steps']} operations (no hook records)"
    out = [f"xirang report: run {run['name']!r}, {len(run['ranks'])} ranks, {run['records']} records, "
           f"{what} on group {run['primary_pg']!r}"]
    g = next((x for x in a["groups"] if x["key"] == a["hottest_group"]), None)
    if g:
        dom = max(STACK, key=lambda p: g["phase_s"][p])
        per = g["busy_s"] / max(1, a["steps"])
        lab = f" ({g['label']})" if g["label"] else ""
        out.append(f"hottest group: {g['key']}{lab}: {100 * g['share']:.1f}% of communication time, "
                   f"{_ms(per)} per step (mean over ranks); largest phase {dom[:-2]} "
                   f"({100 * g['phase_s'][dom] / max(1e-12, sum(g['phase_s'].values())):.0f}%)")
    if a["slowest_rank"] is not None:
        rk = {d["rank"]: d for d in a["ranks"]}
        d = rk[a["slowest_rank"]]
        others = sorted((x for x in a["ranks"] if x["rank"] != d["rank"]),
                        key=lambda x: x["net_wait_introduced_s"], reverse=True)
        nxt = f"; next rank {others[0]['rank']}: {_ms(others[0]['net_wait_introduced_s'])}" if others else ""
        out.append(f"slowest rank: {d['rank']}: net wait introduced {_ms(d['net_wait_introduced_s'])} "
                   f"(its receivers waited {_ms(d['induced_s'])} on it, it waited {_ms(d['waited_s'])})"
                   f"{nxt}" + ("" if a["slowest_rank_clear"] else " [within noise]"))
    else:
        out.append("slowest rank: none stands out (no rank made others wait more than it waited)")
    if a["slowest_link"] is not None:
        s, t = a["slowest_link"]
        L = next(x for x in a["links"] if x["src"] == s and x["dst"] == t)
        thr = f"{L['throughput_Bps'] / 1e9:.3f} GB/s" if L["throughput_Bps"] else "n/a"
        ratio = a["slowest_link_ratio"]
        rtxt = f", typically {ratio:.2f}x the median link of the same operation" if ratio else ""
        noise = "" if (ratio and ratio >= NOISE_RATIO) else " [within noise]"
        out.append(f"slowest link: {s} -> {t}: {thr} ({_bytes(L['bytes'])} in {_ms(L['transfer_s'])} "
                   f"of transfer{rtxt}){noise}")
    b = a["bytes"]
    ratio = f" ({b['wire'] / b['raw']:.2f} of raw)" if b["raw"] else ""
    out.append(f"bytes: raw {_bytes(b['raw'])}, on the wire {_bytes(b['wire'])}{ratio}, "
               f"cross-host {_bytes(b['cross_host'])}, cross-rack {_bytes(b['cross_rack'])}")
    e = a["exposure"]
    te, th = sum(e["exposed_s"]), sum(e["hidden_s"])
    if te + th > 0:
        out.append(f"exposed communication ({e['source']}): {_ms(te / max(1, a['steps']))} per step, "
                   f"hidden {_ms(th / max(1, a['steps']))} per step ({100 * th / (te + th):.0f}% hidden)")
    if a["failed_ops"]:
        out.append(f"failed operations: {a['failed_ops']}")
    return out
