"""Communication latency breakdown: a self-contained HTML dashboard from xirang's operation records.

    XIRANG_STATS_DIR=/tmp/xr torchrun ... train.py          # every rank appends rank<N>.jsonl
    python -m xirang.report /tmp/xr -o report.html           # dashboard + text summary on stdout
    python -m xirang.report /tmp/xr --json                   # the analysis as JSON on stdout

The page needs no network: the plotting code (a few hundred lines of SVG drawing) is inlined and
the data travel in ``<script type="application/json" id="xirang-data">`` (``records``: every
record of the run shown, as read, up to ``html.MAX_EMBEDDED_RECORDS`` (50,000; more are left out);
``records_total``: their number; ``analysis``: what the plots show).

What is derived, and how
- Runs. Records are grouped by ``run_id``; without one, a new run starts in a rank's file when
  its sequence numbers start again (files are appended to). The last run is shown (``--run``).
- Steps. A step is one round of the hook's layer groups: on each rank, a step ends when a
  ``group_id`` comes again. Operations of other kinds between a step's first and last hook
  operation are counted in it as "other". Without hook records, each operation is one "step".
- Phases. Per operation: queued (waiting behind earlier operations; not part of ``total_s``),
  encode, scatter-reduce, allgather, decode, and "unattributed" = total_s minus those four
  (bookkeeping, copies, and in tests the XIRANG_TEST_DELAY_MS sleep). Per step and group the
  mean over ranks is plotted.
- Hottest group: the largest busy time (sum of ``total_s``, mean over ranks) over the run.
- Hidden vs exposed. A record whose ``exposed_wait_s`` is a number (how long the caller blocked
  in ``Work.wait()`` on it: synchronous collectives, ``work.wait()``) counts as measured. The
  others (null: nobody was blocked in ``Work.wait()`` when it completed, e.g. the hook's
  operations, which DDP waits on through their futures) are ESTIMATED, labelled as such on the
  page: per rank and step, exposed = how long their communication still ran after the last of
  them was enqueued (with the hook that is the last layer group's launch at the end of
  backward, after which DDP waits). Per rank and step, exposed = measured + estimated; hidden =
  busy time minus exposed. The estimate counts an async operation waited on only later as
  exposed; ``xirang.stats()`` (in memory) has its measured value once the wait has begun.
- Slowest rank: the rank with the largest NET WAIT INTRODUCED = seconds its receivers spent
  waiting on data from it (their ``peers[].recv_s`` for it) minus seconds it spent waiting on
  data from its own senders, summed over operations seen by every rank of their group. A late
  rank makes its ring successor wait, the successor then makes its own successor wait, and so
  on: every rank but the late one is both made to wait and makes the next one wait, which
  cancels, while the late one makes others wait without waiting itself (its inputs are already
  there when it starts). Raw wait alone would blame the successor, or tie along the ring.
- Slowest link: per link a -> b (a sends to b; in a ring, b is a's successor), transfer time =
  per operation min(a's ``send_s`` to b, b's ``recv_s`` from a). A slow link keeps both ends
  busy; a slow rank only one of them (its successor waits in recv, while the late rank's own
  sends go through quickly), so the min isolates the link. Each operation's transfer times are
  compared with that operation's median link (message sizes differ between operations):
  slowness = the median over operations of (time + 50 us) / (median link's time + 50 us), robust
  to one-off stalls such as the first operation's connection set-up; slowest = largest slowness.

Modules: ``records`` (fields of a record), ``load`` (files and runs), ``analyze`` (the numbers),
``text`` (the summary), ``html`` (the page; its script and style are the package's
``dashboard.js`` and ``dashboard.css``), ``cli``.
"""
from .analyze import LINK_EPS_S, analyze
from .cli import build, main
from .html import embedded_data, render_html
from .load import from_gathered, load_records, split_runs
from .records import BUSY_PHASES, PHASES, STACK, unattributed
from .text import NOISE_RATIO, summary_lines

__all__ = [
    "BUSY_PHASES", "LINK_EPS_S", "NOISE_RATIO", "PHASES", "STACK",
    "analyze", "build", "embedded_data", "from_gathered", "load_records", "main", "render_html", "split_runs",
    "summary_lines", "unattributed",
]
