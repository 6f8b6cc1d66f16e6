"""The report: ``soak.json`` (everything the run saw), ``soak.md`` (its figures as tables) and
``soak.png`` (RSS and fds, latency and throughput over the run).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from troupe.tools.soak.run import Soak


def build_report(soak: Soak, started: float) -> dict[str, Any]:
    """Everything the run saw, as JSON-ready data (``soak.json``)."""
    records = soak.ledger.records
    phases = []
    for p in soak.phases:
        recs = soak.ledger.of_phase(p.name)
        answered = [r.latency for r in recs if r.outcome == "complete"
                    and r.kind not in ("held_back", "corpus") and r.latency is not None]
        ttfts = [r.ttft for r in recs if r.ttft is not None]
        phases.append({
            "name": p.name, "started_s": round(p.started, 1), "ended_s": round(p.ended, 1),
            "traffic_s": round(p.seconds, 1), "requests": len(recs),
            "concurrency_max": p.concurrency_max,
            "outcomes": dict(Counter(r.outcome for r in recs)),
            "latency_s": {"p50": percentile(answered, 50), "p99": percentile(answered, 99)},
            "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
            "fault": p.fault, "checks": p.checks,
        })
    faults = []
    for p in soak.phases:
        if p.fault is not None:
            failed_here = any(f.startswith(f"{p.name}:") for f in soak.failures)
            faults.append({"phase": p.name, **p.fault,
                           "survived": p.fault["injected"] and not failed_here})
    client_faults: defaultdict[str, Counter[str | None]] = defaultdict(Counter)
    for r in records:
        if r.fault is not None and r.kind != "corpus":
            client_faults[r.fault][r.outcome] += 1
        elif r.kind == "idle":
            client_faults["idle"][r.outcome] += 1
    writers = [c["ssd_writer"] for c in soak.counters.values() if c.get("ssd_writer")]
    indexes = [c["cache_index"] for c in soak.counters.values() if c.get("cache_index")]
    skipped: Counter[str] = Counter()
    for index in indexes:
        skipped.update(index.get("skipped", {}))
    blocks = {
        "written": sum(w["persisted"] for w in writers),
        "write_failures": sum(w["failed"] for w in writers),
        "dropped_by_reason": dict(sum((Counter(w["dropped_by_reason"]) for w in writers),
                                      Counter())),
        "read_and_verified": sum(w["read_blocks"] for w in writers),
        "read_missing": sum(w["read_missing"] for w in writers),
        "dropped_corrupt_at_read": sum(w["blocks_corrupt"] for w in writers),
        "checksum_failures": sum(w["checksum_failures"] for w in writers),
        "skipped_at_start": dict(skipped),
        "corrupted_by_soak": dict(Counter(c.how for c in soak.disk.corruptions)),
        "corrupt_loaded": len(soak.loaded_seen),
        "counted_until": "each instance's last snapshot (the killed one's, just before "
                         "the kill)",
    }
    corpus = {
        "cases": len(soak.corpus),
        "replays": sum(sum(c.values()) for c in soak.corpus_seen.values()),
        "by_case": {case.name: {"expected": case.status,
                                "got": {str(k): v for k, v in
                                        sorted(soak.corpus_seen[case.name].items())}}
                    for case in soak.corpus},
    }
    rss = [s[3] for s in soak.samples]
    fds = [s[4] for s in soak.samples]
    return {
        "passed": not soak.failures,
        "failures": soak.failures,
        "command": soak.command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "minutes": soak.minutes,
        "wall_s": round(soak.clock(), 1),
        "first_start_s": round(soak.first_start_s, 1),
        "machine": {
            "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "root": os.geteuid() == 0,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "server": {"command": shlex.join(soak.server.command),
                   "instances": soak.server.instance,
                   "exit_codes": {str(k): v for k, v in soak.server.exit_codes.items()},
                   "cache_on_tmpfs": soak.disk.tmpfs,
                   "no_tmpfs_because": soak.disk.tmpfs_reason},
        "requests": {
            "total": len(records),
            "by_outcome": dict(Counter(r.outcome for r in records)),
            "by_kind": dict(Counter(r.kind for r in records)),
            "lost": sum(r.outcome == "lost" for r in records),
            "server_errors": sum(r.outcome == "server_error" for r in records),
            "bad_answers": sum(r.outcome == "bad_answer" for r in records),
            "without_outcome": sum(r.outcome is None for r in records),
        },
        "phases": phases,
        "faults": faults,
        "client_faults": {k: dict(v) for k, v in client_faults.items()},
        "bursts": soak.bursts,
        "corpus": corpus,
        "blocks": blocks,
        "resources": {
            "baseline": soak.baseline,
            "rss_start_mb": soak.rss.get("start_mb"),
            "rss_after_load_mb": soak.rss.get("after_load_mb"),
            "memory_releases_after_load": soak.rss.get("memory_releases"),
            "rss_peak_mb": max(rss, default=None), "fds_peak": max(fds, default=None),
            "samples": [list(s) for s in soak.samples],
            "sample_fields": ["t_s", "instance", "phase", "rss_mb", "fds"],
        },
        "timeline": [[round(r.ended, 2), r.phase, r.kind, r.outcome,
                      round(r.latency, 3) if r.latency is not None else None, r.tokens]
                     for r in records if r.ended is not None],
        "timeline_fields": ["ended_s", "phase", "kind", "outcome", "latency_s", "tokens"],
    }


def interpolated_percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation; None for no values (the benchmarks'
    harness uses it too)."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of seconds, rounded to ms; None for no values."""
    value = interpolated_percentile(values, q)
    return None if value is None else round(value, 3)


# --- writing the report ----------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _evidence(fault: dict[str, Any]) -> str:
    if fault["skipped"]:
        return f"skipped: {fault['skipped']}"
    shown = {k: v for k, v in fault["evidence"].items() if k not in ("bursts",)}
    return ", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in shown.items())


def markdown(report: dict[str, Any]) -> str:
    """``soak.md``: the report's figures as tables."""
    req = report["requests"]
    lines = [
        "# troupe soak",
        "",
        f"`{report['command']}`: {'**passed**' if report['passed'] else '**FAILED**'} in "
        f"{report['wall_s']:.0f} s ({report['minutes']:g}-minute budget, after a "
        f"{report['first_start_s']:.0f} s first start), {report['started']}, "
        f"{report['machine']['cpus']} CPUs, load average at the end "
        f"{report['machine']['loadavg_at_end']}.",
        "",
    ]
    if report["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in report["failures"]] + [""]
    lines += [
        "## Requests", "",
        f"{req['total']} requests: {req['lost']} lost, {req['server_errors']} server errors, "
        f"{req['bad_answers']} bad answers, {req['without_outcome']} without an outcome.", "",
        "| outcome | requests |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(req["by_outcome"].items(),
                                              key=lambda kv: -kv[1])),
        "",
        "## Phases", "",
        "Latency: complete answers of the traffic (not the corpus or the held-back probes); "
        "TTFT: streams.", "",
        "| phase | s | requests | in flight, most | complete | 429 | latency p50 / p99 ms | "
        "TTFT p50 / p99 ms | RSS MB | fds | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["phases"]:
        c = p["checks"]
        ok = c.get("health") and c.get("greedy_identical") and not c.get("failed") \
            and not c.get("corrupt_loaded") and c.get("resources_within_bounds") \
            and not c.get("server_5xx")
        lines.append(
            f"| {p['name']} | {p['ended_s'] - p['started_s']:.0f} | {p['requests']} | "
            f"{p['concurrency_max']} | {p['outcomes'].get('complete', 0)} | "
            f"{p['outcomes'].get('rate_limited', 0)} | "
            f"{_ms(p['latency_s']['p50'])} / {_ms(p['latency_s']['p99'])} | "
            f"{_ms(p['ttft_s']['p50'])} / {_ms(p['ttft_s']['p99'])} | {c.get('rss_mb')} | "
            f"{c.get('fds')} | {'ok' if ok else 'FAILED'} |")
    lines += ["", "## Faults", "", "| phase | fault | survived | evidence |", "|---|---|---|---|"]
    for f in report["faults"]:
        survived = "skipped" if f["skipped"] else ("yes" if f["survived"] else "NO")
        lines.append(f"| {f['phase']} | {f['name']} | {survived} | {_evidence(f)} |")
    lines += ["", "Client faults (outcomes):", ""]
    for name, outcomes in sorted(report["client_faults"].items()):
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    for b in report["bursts"]:
        lines.append(f"- burst of {b['size']}: " + ", ".join(
            f"{k} {v}" for k, v in sorted(b["outcomes"].items()))
            + (f"; Retry-After {b['retry_after_s'][0]}-{b['retry_after_s'][1]} s"
               if b["retry_after_s"] else ""))
    corpus = report["corpus"]
    wrong = [name for name, c in corpus["by_case"].items()
             if any(int(s) not in (c["expected"], 429, 503) for s in c["got"])]
    unsent = [name for name, c in corpus["by_case"].items() if not c["got"]]
    blocks = report["blocks"]
    res = report["resources"]
    base = res["baseline"] or {}
    lines += [
        "", "## Bad input", "",
        f"{corpus['cases']} cases, replayed {corpus['replays']} times: "
        f"{len(wrong)} answered otherwise than expected{': ' + ', '.join(wrong) if wrong else ''}"
        f"; {len(unsent)} never sent{': ' + ', '.join(unsent) if unsent else ''}.",
        "", "## Blocks", "",
        f"- written {blocks['written']}, write failures {blocks['write_failures']}, dropped "
        f"{blocks['dropped_by_reason']}",
        f"- read back and verified {blocks['read_and_verified']}, missing "
        f"{blocks['read_missing']}, corrupt dropped at read {blocks['dropped_corrupt_at_read']} "
        f"({blocks['checksum_failures']} by checksum), skipped at start "
        f"{blocks['skipped_at_start']}",
        f"- corrupted by the soak {blocks['corrupted_by_soak']}; corrupt blocks loaded: "
        f"**{blocks['corrupt_loaded']}**",
        "", "## Resources", "",
        f"Warm baseline {base.get('rss_mb', 0):.0f} MB RSS, {base.get('fds')} fds; bounds "
        f"{base.get('rss_bound_mb', 0):.0f} MB and {base.get('fd_bound')} fds at each "
        f"checkpoint; peaks over the run {res['rss_peak_mb']} MB and {res['fds_peak']} fds "
        "(sampled every second).",
        "",
        f"RSS at the first start {res['rss_start_mb']} MB; after the load, once the idle "
        f"engine gave memory back ({res['memory_releases_after_load']} releases so far), "
        f"{res['rss_after_load_mb']} MB.",
        "", "![RSS, latency and throughput over time](soak.png)", "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """``soak.png``: RSS and fds, latency, and throughput over the run, phases marked."""
    import matplotlib  # lazy: only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_lat, ax_tput) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    samples = report["resources"]["samples"]
    if samples:
        t = [s[0] for s in samples]
        ax_mem.plot(t, [s[3] for s in samples], color="tab:blue", lw=1)
        fds = ax_mem.twinx()
        fds.plot(t, [s[4] for s in samples], color="tab:orange", lw=1)
        fds.set_ylabel("open fds", color="tab:orange")
    ax_mem.set_ylabel("RSS (MB)", color="tab:blue")
    timeline = report["timeline"]
    done = [(e[0], e[4]) for e in timeline if e[3] == "complete" and e[4] is not None
            and e[2] not in ("corpus", "held_back")]
    refused = [(e[0], e[4]) for e in timeline if e[3] == "rate_limited" and e[4] is not None]
    if done:
        ax_lat.scatter(*zip(*done, strict=True), s=4, alpha=0.5, label="complete")
    if refused:
        ax_lat.scatter(*zip(*refused, strict=True), s=4, alpha=0.5, color="tab:red",
                       label="429")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (s)")
    ax_lat.legend(loc="upper left", fontsize=8)
    end = max((e[0] for e in timeline), default=0.0)
    bin_s = max(5.0, end / 120)
    bins = int(end // bin_s) + 1
    tokens, answers = [0.0] * bins, [0.0] * bins
    for e in timeline:
        if e[3] == "complete":
            tokens[int(e[0] // bin_s)] += e[5] / bin_s
            answers[int(e[0] // bin_s)] += 1 / bin_s
    x = [i * bin_s for i in range(bins)]
    ax_tput.step(x, tokens, where="post", label="tokens/s")
    ax_tput.step(x, answers, where="post", label="answers/s")
    ax_tput.set_ylabel(f"throughput ({bin_s:.0f} s bins)")
    ax_tput.set_xlabel("seconds")
    ax_tput.legend(loc="upper left", fontsize=8)
    for p in report["phases"]:
        for ax in (ax_mem, ax_lat, ax_tput):
            ax.axvline(p["started_s"], color="grey", lw=0.5, ls="--")
        ax_mem.annotate(p["name"], (p["started_s"], 1.0), xycoords=("data", "axes fraction"),
                        fontsize=7, rotation=90, va="top")
    fig.suptitle(f"troupe soak: {'passed' if report['passed'] else 'FAILED'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(markdown(report))
    plot(report, out / "soak.png")
