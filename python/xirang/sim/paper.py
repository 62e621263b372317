"""--paper: the claims of the published 175B-parameter / 128-GPU platform report, each checked for
internal consistency and against the model in two readings (literal: tp = pp = 1; sharded)."""
from __future__ import annotations

import math
from typing import Optional

from .args import build, settings
from .model import GB, Cluster, SettingsError
from .table import table
from .timeline import ALL, OPTS, Config


PUBLICATION = ("the published platform report on training a 175B-parameter model on 128 GPUs "
               "(its claims table: the figures below)")
REPRODUCE_TOL = 0.25  # a simulated figure reproduces a published one within +-25% of it
TOLERANCE_TEXT = (f"a figure is reproduced when the model, in the literal or the sharded reading, lands within "
                  f"+-{REPRODUCE_TOL:.0%} of it (relative; for a published change in %, +-{REPRODUCE_TOL:.0%} of "
                  "that change; for a pair such as 3.2 s -> 2.6 s, both ends)")
PUBLISHED = dict(params=175e9, layers=96, link_Gbps=100.0, gpus=(8, 64, 128), ar8=0.3, ar128=1.4, group_layers=8,
                 groups=24, group_GB=30.0, exposed=(1.4, 0.5), total_comm_pct=5.0, bucket_eff_pct=25.0,
                 xrack_cut_pct=60.0, step=(3.2, 2.6), thr128_pct=18.0, thr64_pct=12.0, fail_s=15.0, fail_pct=0.5)


def paper(a) -> dict:
    P = PUBLISHED
    a.model, a.params = "gpt3-175b", 0
    a.bwd_layer_ms, a.fwd_ms = 1.2 / 96 * 1e3, 600.0  # 3.2 s step - 1.4 s exposed comm = 1.8 s compute, bwd = 2 fwd
    readings = {"literal": (1, 1), "sharded": (a.tp if a.tp > 1 else 8, a.pp if a.pp > 1 else 4)}
    tp_s, pp_s = readings["sharded"]
    none, ovl = Config(), Config(overlap=True, group=P["group_layers"])
    ovb = Config(overlap=True, bucketing=True, group=P["group_layers"])
    res: dict = {}
    for name, (tp, pp) in readings.items():
        a.tp, a.pp = tp, pp
        # a pipeline of pp stages, one micro-batch: the modelled stage (0, with the embeddings) waits for the
        # whole forward and the later stages' backward before its own 1.2/pp s of backward; the step's
        # compute stays the published 1.8 s
        a.fwd_ms = 600.0 + 1200.0 * (pp - 1) / pp
        r = {}
        for g in P["gpus"]:
            if g % (tp * pp) or g // (tp * pp) < 2:
                r[g] = None
                continue
            try:
                s = build(a, g)
            except SettingsError as e:
                raise SettingsError(f"--paper, {g} GPUs: {e}") from None
            runs = {c.label(): s.run(c) for c in [none, ovl, Config(bucketing=True), Config(topo=True), ovb,
                                                   Config(bf16=True), Config.of(OPTS, group=P["group_layers"])]}
            r[g] = {"runs": runs, "settings": settings(s)}
        res[name] = r
    if res["sharded"][128] is None:  # every claim is about 128 GPUs
        raise SettingsError(f"--paper: tp x pp = {tp_s} x {pp_s} must divide 64, so that 128 GPUs give data "
                            "parallelism >= 2")
    a.tp, a.pp = readings["sharded"]

    def sim(reading, g, cfg, key):
        x = res[reading].get(g)
        return None if x is None else x["runs"][cfg][key]

    def pct(x, y):  # None where there is no baseline (e.g. no cross-rack traffic to cut)
        return None if x is None or y is None or x == 0 else 100 * (y / x - 1)

    def change(base, cfg, key):  # per reading: % change of a 128-GPU figure from config base to cfg
        return both(lambda k: pct(sim(k, 128, base, key), sim(k, 128, cfg, key)))

    def both(fn):
        return {k: fn(k) for k in readings}

    S = P["params"] * 4
    bw = P["link_Gbps"] * GB / 8
    n = 128
    ring_bytes = 2 * (n - 1) / n * S
    rows = [
        ("fp32 gradients, 175B params", "~700 GB", both(lambda k: f"{res[k][128]['settings']['shard_params'] * 4 / GB:.1f} GB/GPU"),
         f"175e9 x 4 B = {S / GB:.0f} GB: consistent (for the whole model; a GPU syncs only its tp x pp shard)", False),
        ("700 GB over 100 Gbit/s", "~56 s", both(lambda k: None),
         f"{S / GB:.0f} GB / {bw / GB:.1f} GB/s = {S / bw:.0f} s: consistent as one pass; but a ring allreduce sends "
         f"2(N-1)/N x S = {ring_bytes / GB:.0f} GB per rank at N=128 -> {ring_bytes / bw:.0f} s", False),
        ("allreduce, 8 GPUs in one rack", "0.3 s", both(lambda k: sim(k, 8, "none", "allreduce_s")),
         f"8 GPUs: 2x7/8 x 700 GB = {1.75 * S / GB:.0f} GB per GPU in 0.3 s = {1.75 * S / 0.3 / GB:.0f} GB/s per GPU, "
         f"above any GPU link (NVLink-class ~{Cluster().host_GBps:.0f}-450 GB/s): cannot hold for 700 GB", True),
        ("allreduce, 128 GPUs across racks", "1.4 s", both(lambda k: sim(k, 128, "none", "allreduce_s")),
         f"ring: {ring_bytes / GB:.0f} GB per rank / 1.4 s = {ring_bytes / 1.4 / GB:.0f} GB/s = "
         f"{ring_bytes * 8 / 1.4 / GB / 1000:.1f} Tbit/s per GPU vs 100 Gbit/s ({ring_bytes / 1.4 / bw:.0f}x); even two-level "
         f"(S/8 across hosts) needs {2 * 15 / 16 * S / 8 / bw:.0f} s. 1.4 s fits a per-GPU shard of "
         f"{1.4 * bw / (2 * 127 / 128) / GB:.1f} GB (1/{S / (1.4 * bw / (2 * 127 / 128)):.0f} of the model)", True),
        ("ratio 128 vs 8", "4.7x", both(lambda k: None if sim(k, 8, "none", "allreduce_s") is None
                                        else sim(k, 128, "none", "allreduce_s") / sim(k, 8, "none", "allreduce_s")),
         "1.4/0.3 = 4.67: arithmetic consistent; the ring's bandwidth term grows only (2x127/128)/(2x7/8) = 1.13x, "
         "so the rest must be a ~4x slower bottleneck link across racks", False),
        ("layer groups", "groups of 8 layers, ~24 groups of ~30 GB", both(lambda k: f"{math.ceil(96 // readings[k][1] / 8)} groups of "
         f"{res[k][128]['settings']['shard_params'] * 4 / GB / math.ceil(96 // readings[k][1] / 8):.1f} GB"),
         f"96 layers / 8 = 12 groups, not 24; 700 GB / 12 = {S / 12 / GB:.0f} GB per group; 24 x 30 GB = 720 GB "
         f"(24 groups would be 4 layers each); one 30 GB group alone takes {30e9 / bw:.1f} s at 100 Gbit/s, more than "
         "the whole 1.4 s allreduce", True),
        ("exposed comm with overlap", "1.4 s -> 0.5 s (-64%)",
         both(lambda k: None if res[k][128] is None else
              f"{sim(k, 128, 'bucketing', 'exposed_comm_s'):.3g} s -> {sim(k, 128, 'overlap+bucketing', 'exposed_comm_s'):.3g} s "
              f"({pct(sim(k, 128, 'bucketing', 'exposed_comm_s'), sim(k, 128, 'overlap+bucketing', 'exposed_comm_s')):+.0f}%)"),
         "one allreduce after backward vs one per group; (1.4-0.5)/1.4 = 64%: consistent; with 1.2 s of backward and 12 groups, exposed >= 1.47 - (1.2 - 0.1) = 0.37 s, "
         "so 0.5 s is feasible", False),
        ("total comm with overlap", "+5% (launch overhead)",
         change("bucketing", "overlap+bucketing", "total_comm_s"),
         "5% of 1.4 s = 70 ms over 11 extra collectives = 6.4 ms each, i.e. 2x127 ring steps x 25 us: plausible "
         "only as ring latency, not as a kernel launch (~10-50 us)", False),
        ("bucketing + ring, 128 GPUs", "+25% comm efficiency",
         change("bucketing", "none", "total_comm_s"),
         "baseline unstated (we take one collective per tensor vs one buffer per unit); gain = latency saved", False),
        ("topology-aware ring", "-60% cross-rack traffic",
         change("none", "topo", "xrack_GB"),
         "depends entirely on how the scheduler placed ranks (packed: 0%; random hosts: most crossings removed); "
         "the topology ring crosses racks exactly once per rack", False),
        ("BF16 + error feedback", "comm volume halved",
         change("none", "bf16", "xrack_GB"),
         "4 B -> 2 B per element: -50% bytes, consistent (plus a codec pass; the fp32 residual costs 4 B/param of memory)", False),
        ("all combined, 128 GPUs: step", "3.2 s -> 2.6 s",
         both(lambda k: None if res[k][128] is None else
              f"{sim(k, 128, 'none', 'step_s'):.3g} s -> {sim(k, 128, ALL, 'step_s'):.3g} s"),
         "3.2 - 2.6 = 0.6 s saved, but overlap alone is claimed to save 1.4 - 0.5 = 0.9 s of exposed comm: "
         "everything together cannot save less than one of its parts (with 1.8 s compute, all-on should reach <= 2.3 s)",
         True),
        ("all combined, 128 GPUs: throughput", "+18%",
         both(lambda k: pct(1 / sim(k, 128, "none", "step_s"), 1 / sim(k, 128, ALL, "step_s"))
              if res[k][128] else None),
         f"3.2 / 2.6 = {3.2 / 2.6:.3f}: throughput +{100 * (3.2 / 2.6 - 1):.0f}%, not +18% "
         f"(the step-time cut is {100 * (1 - 2.6 / 3.2):.2f}%)", True),
        ("all combined, 64 GPUs: throughput", "+12%",
         both(lambda k: pct(1 / sim(k, 64, "none", "step_s"), 1 / sim(k, 64, ALL, "step_s"))
              if res[k][64] else None),
         "no 64-GPU baseline published; simulated only", False),
        ("rank failure", "~15 s total, <0.5% of training", both(lambda k: None),
         f"15 s < 0.5% needs >= {15 / 0.005:.0f} s ({15 / 0.005 / 60:.0f} min) of training per failure; not simulated", False),
    ]
    unit = {"fp32 gradients, 175B params": "GB", "exposed comm with overlap": "%",
            "all combined, 128 GPUs: step": "s", "allreduce, 8 GPUs in one rack": "s", "allreduce, 128 GPUs across racks": "s", "ratio 128 vs 8": "x",
            "total comm with overlap": "%", "bucketing + ring, 128 GPUs": "%", "topology-aware ring": "%",
            "BF16 + error feedback": "%", "all combined, 128 GPUs: throughput": "%",
            "all combined, 64 GPUs: throughput": "%"}
    # Claims the published figures alone cannot confirm or refute (a baseline or a placement not stated).
    unchecked = {"bucketing + ring, 128 GPUs", "topology-aware ring", "all combined, 64 GPUs: throughput",
                 "rank failure"}

    def groups(k):
        return math.ceil(96 // readings[k][1] / 8)

    # claim -> (the published figure as a number, or a tuple of numbers, in the row's unit; the simulated
    # number per reading where it is not the displayed value itself). Absent: nothing simulated to compare.
    figures = {
        "fp32 gradients, 175B params": (700.0, lambda k: res[k][128]["settings"]["shard_params"] * 4 / GB),
        "allreduce, 8 GPUs in one rack": (0.3, None), "allreduce, 128 GPUs across racks": (1.4, None),
        "ratio 128 vs 8": (4.7, None),
        "layer groups": (24, groups),
        "exposed comm with overlap": (-64.0, lambda k: None if res[k][128] is None else pct(
            sim(k, 128, "bucketing", "exposed_comm_s"), sim(k, 128, "overlap+bucketing", "exposed_comm_s"))),
        "total comm with overlap": (5.0, None), "bucketing + ring, 128 GPUs": (25.0, None),
        "topology-aware ring": (-60.0, None), "BF16 + error feedback": (-50.0, None),
        "all combined, 128 GPUs: step": ((3.2, 2.6), lambda k: None if res[k][128] is None else (
            sim(k, 128, "none", "step_s"), sim(k, 128, ALL, "step_s"))),
        "all combined, 128 GPUs: throughput": (18.0, None), "all combined, 64 GPUs: throughput": (12.0, None),
    }

    def within(pub, got) -> Optional[bool]:
        if got is None:
            return None
        if isinstance(pub, tuple):
            return all(within(p_, g_) for p_, g_ in zip(pub, got))
        return abs(got - pub) <= REPRODUCE_TOL * abs(pub)

    out_rows = []
    for c, pub, simv, chk, bad in rows:
        pub_v, num = figures.get(c, (None, None))
        got = {k: (num(k) if num else (v if isinstance(v, (int, float)) else None)) for k, v in simv.items()}
        per = {k: (None if pub_v is None else within(pub_v, g)) for k, g in got.items()}
        rep = True if True in per.values() else (False if False in per.values() else None)
        out_rows.append({"claim": c, "published": pub, **{f"sim_{k}": v for k, v in simv.items()}, "unit": unit.get(c),
                         "check": chk, "consistent": None if c in unchecked else not bad, "inconsistent": bad,
                         "published_value": pub_v, "simulated_value": got, "reproduced_by": per,
                         "reproduced": rep})
    assumed = {
        "compute": "fwd 0.6 s + bwd 1.2 s for the whole model (= published 3.2 s step - 1.4 s comm, backward = "
                   "2 x forward), 12.5 ms per layer; per GPU: " + "; ".join(
                       f"{k} {c['fwd_s']:.3g} s before its own backward (forward"
                       + (" + the later pipeline stages' backward" if readings[k][1] > 1 else "")
                       + f") + bwd {c['bwd_s']:.3g} s + optimiser {c['opt_s']:.3g} s, {c['microbatches']} microbatch(es)"
                       for k, c in ((k, res[k][128]["settings"]["compute"]) for k in readings)),
        "fixed by --paper": "model gpt3-175b, 8 / 64 / 128 GPUs, groups of 8 layers, one buffer per group, compute "
                            "from the published step (--model, --params, --gpus, --group, --bucket-mb, --bwd-layer-ms, "
                            "--fwd-ms, --gpu-tflops, --mfu and --tokens-per-gpu do not apply)",
        "literal reading": "tp=1, pp=1: every GPU syncs the full 175B fp32 gradient (what 700 GB / 24 x 30 GB say); "
                           "needs 700 GB of gradients per GPU, which no GPU holds",
        "sharded reading": f"tp={tp_s} ({'in host' if tp_s <= a.gpus_per_host else 'across hosts'}), pp={pp_s}: a GPU syncs "
                           f"{res['sharded'][128]['settings']['shard_params'] / 1e9:.2f}B params (stage 0 incl. embeddings); "
                           + ", ".join(f"DP = {g // (tp_s * pp_s)} at {g}" for g in P["gpus"] if res["sharded"][g])
                           + "".join(f"; {g} GPUs cannot hold the model" for g in P["gpus"] if not res["sharded"][g]),
        "cluster": f"{a.gpus_per_host} GPUs/host, {a.hosts_per_rack} hosts/rack ({a.gpus_per_host * a.hosts_per_rack} "
                   f"GPUs/rack), a {a.rack_gbitps:g} Gbit/s NIC per GPU in the rack (published link: "
                   f"{P['link_Gbps']:g} Gbit/s), {a.host_gbyteps:g} GB/s/GPU in host, cross-rack {a.xrack_gbitps:g} "
                   f"Gbit/s per GPU at full bisection with {a.oversub:g}:1 oversubscribed uplinks",
        "latencies": f"alpha {a.host_alpha_us:g} us in host, {a.rack_alpha_us:g} us in rack, {a.xrack_alpha_us:g} us "
                     f"across racks; {a.launch_us:g} us per launch; BF16 codec {a.codec_gbyteps:g} GB/s of fp32 per "
                     "GPU, pipelined with the wire",
        "placement": f"hosts handed out {a.placement} (seed {a.seed}) by the scheduler; 'topo' sorts the ring by (rack, host)",
        "baseline": "no overlap, one collective per tensor (12 per layer + embeddings), rank-order flat ring, fp32",
        "optimisations": "overlap = groups of 8 layers; bucketing = one buffer per group (per step without overlap); "
                         "two-level = reduce-scatter in host (or rack when one DP member per host), allreduce across",
        "8-GPU case": f"{-(-8 // a.gpus_per_host)} host(s) of {a.gpus_per_host} GPUs; the published '8 GPUs in one rack'",
    }
    return {"publication": PUBLICATION, "tolerance": TOLERANCE_TEXT, "rows": out_rows, "assumed": assumed,
            "runs": {k: {str(g): (None if v is None else v["runs"]) for g, v in r.items()} for k, r in res.items()},
            "inconsistent": [r["claim"] for r in out_rows if r["inconsistent"]],
            "reproduced": [r["claim"] for r in out_rows if r["reproduced"]],
            "not_reproduced": [r["claim"] for r in out_rows if r["reproduced"] is False]}


def print_paper(d: dict):
    print(f"Checking {d['publication']}.\n"
          "Each figure gets two verdicts:\n"
          "  internally consistent: whether it agrees with physics and with the report's own other figures "
          "(the arithmetic is under 'check'); 'unchecked' where the report does not say enough;\n"
          f"  reproduced by the model: {d['tolerance']}; 'not simulated' where the model has no such number.\n"
          "Readings: literal = tp=pp=1, every GPU syncs all 175B gradients; sharded = see the assumptions below.\n")
    for r in d["rows"]:
        def f(v):
            if v is None:
                return "-"
            if isinstance(v, tuple):
                return " -> ".join(f(x) for x in v)
            if not isinstance(v, float):
                return str(v)
            return {"%": f"{v:+.1f}%", "x": f"{v:.2f}x", "s": f"{v:.3g} s", "GB": f"{v:.4g} GB"}.get(r["unit"], f"{v:.3g}")
        cons = {True: "consistent", False: "INCONSISTENT", None: "unchecked"}[r["consistent"]]
        rep = {True: "reproduced", False: "NOT REPRODUCED", None: "not simulated"}[r["reproduced"]]
        got = ", ".join(f"{k} {f(v)}" for k, v in r["simulated_value"].items())
        if r["reproduced"] is None:
            why = "not simulated: the model has no number for this figure"
        else:
            yes = [k for k, ok in r["reproduced_by"].items() if ok]
            why = (f"yes ({' and '.join(yes)} reading)" if yes else "NO") + \
                f": {got} vs published {f(r['published_value'])} (tolerance +-{REPRODUCE_TOL:.0%} of it)"
        print(f"[{cons} | {rep}] {r['claim']}\n    published: {r['published']}\n"
              f"    simulated: literal {f(r['sim_literal'])} | sharded {f(r['sim_sharded'])}\n"
              f"    internally consistent? {cons}: {r['check']}\n"
              f"    reproduced by the model? {why}")
    n_sim = sum(1 for r in d["rows"] if r["reproduced"] is not None)
    n_unchecked = sum(1 for r in d["rows"] if r["consistent"] is None)
    print(f"\nSummary: of {len(d['rows'])} figures, {len(d['inconsistent'])} are internally inconsistent "
          f"({n_unchecked} cannot be checked); the model "
          f"reproduces {len(d['reproduced'])} of the {n_sim} it simulates"
          + (f" ({', '.join(d['reproduced'])})" if d["reproduced"] else "") + ".")
    print("\nAssumed (not stated in the report):")
    for k, v in d["assumed"].items():
        print(f"  {k}: {v}")
    for k, r in d["runs"].items():
        for g, runs in r.items():
            if runs:
                print(f"\n{k}, {g} GPUs:")
                print(table(list(runs.values()), ["config", "dp", "launches", "allreduce_s", "total_comm_s",
                                                  "exposed_comm_s", "step_s", "xrack_GB"]))
