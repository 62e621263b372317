"""The self-contained HTML dashboard: the page, its data island (#xirang-data) and the plotting
code (dashboard.js, dashboard.css: package data files, inlined so the page needs no network)."""
from __future__ import annotations

import functools
import html
import json
from importlib import resources
from typing import Any, Dict, List


@functools.lru_cache(maxsize=None)
def _asset(name: str) -> str:
    """A file of this package (dashboard.js, dashboard.css) as text."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _json_for_script(obj: Any) -> str:
    s = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    # Inside <script>: no "</script>", no "<!--"; \u003c is the same string to JSON.
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# The plots draw the analysis only; the records ride along for whoever reads the page's data.
# Beyond this many (about 0.5 kB each) they stay out: a 121 MB stats directory made a 1.38 GB page.
MAX_EMBEDDED_RECORDS = 50_000


def render_html(records: List[dict], analysis: Dict[str, Any]) -> str:
    """The dashboard page: no external resource; data in #xirang-data, drawn by inline JS.
    ``records`` are embedded when there are at most :data:`MAX_EMBEDDED_RECORDS` of them, else
    none (``records_total`` gives the count either way, and the page says they were left out)."""
    title = f"xirang communication breakdown: {analysis['run']['name']}"
    summary = "\n".join(analysis["summary"])
    n = len(records)
    if n > MAX_EMBEDDED_RECORDS:
        summary += (f"\n({n} records: more than {MAX_EMBEDDED_RECORDS}, so the page embeds the analysis only; "
                    "the records stay in the stats directory)")
    data = _json_for_script({"records": records if n <= MAX_EMBEDDED_RECORDS else [], "records_total": n,
                             "analysis": analysis})
    e = html.escape
    runs = ", ".join(analysis["run"]["runs_available"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
{_asset('dashboard.css')}</style></head><body>
<h1>{e(title)}</h1>
<div id="xirang-status" data-state="pending">rendering (needs JavaScript)...</div>
<pre id="summary">{e(summary)}</pre>
<p class="note">Runs in the input: {e(runs)}. Process groups: {e(", ".join(analysis['run']['pgs']))}.
Steps and groups are taken from process group {e(repr(analysis['run']['primary_pg']))}.</p>
<h2>Per-group phase breakdown over steps</h2>
<label>group <select id="group-select"></select></label>
<div class="chart" id="c-phases"></div>
<p class="note">queued = waiting behind earlier operations (not in total_s); unattributed = total_s minus
encode, scatter-reduce, allgather and decode.</p>
<h2>Each group's share of step time</h2>
<div class="chart" id="c-share"></div>
<table id="t-groups"></table>
<h2>Bytes: raw vs on the wire</h2>
<div class="chart" id="c-bytes"></div>
<p class="note">raw = what this algorithm would send uncompressed; on the wire = payload sent (headers excluded).</p>
<h2>Hidden vs exposed communication</h2>
<div class="chart" id="c-exposed"></div>
<p class="note">{e(analysis['exposure']['note'])}</p>
<h2>Per rank</h2>
<div class="chart" id="c-ranks"></div>
<table id="t-ranks"></table>
<p class="note">Slowest rank = largest net wait introduced: seconds its receivers waited on its data minus
seconds it waited on its senders' data. A late rank makes its successor wait, which passes the wait on;
only the late rank makes others wait without waiting itself.</p>
<h2>Per link (sender -> receiver; in a ring the receiver is the sender's successor)</h2>
<div class="chart" id="c-links"></div>
<table id="t-links"></table>
<p class="note">transfer = per operation min(sender's send time, receiver's receive time): a slow link keeps both
ends busy, a slow rank only its successor's receive. Each operation's transfers are compared with that
operation's median link; slowness = median over operations of (transfer + 50 us) / (that operation's
median link + 50 us), so one-off stalls such as connection set-up do not count.</p>
<script type="application/json" id="xirang-data">{data}</script>
<script>
{_asset('dashboard.js')}</script>
</body></html>
"""


def embedded_data(page: str) -> Dict[str, Any]:
    """The JSON of #xirang-data in a page written by render_html (used by the tests)."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.inside, self.buf = False, []

        def handle_starttag(self, tag, attrs):
            if tag == "script" and dict(attrs).get("id") == "xirang-data":
                self.inside = True

        def handle_endtag(self, tag):
            if tag == "script":
                self.inside = False

        def handle_data(self, data):
            if self.inside:
                self.buf.append(data)

    p = P()
    p.feed(page)
    p.close()
    return json.loads("".join(p.buf))
