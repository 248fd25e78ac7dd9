"""Reporting a comparison: a rich table for people, a JSON document for tools.

The headline reads like a changelog entry, "RTF 0.0046 -> 0.0023 (peak 9.1 ->
9.4 MiB), B/A 0.50x", and the B/A ratio is the median of ratios taken pair by
pair (adjacent A and B runs of each A B B A block), not a ratio of two
medians, so drift between blocks cancels. The JSON schema is versioned
(`SCHEMA`); tests check its keys.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .harness import BenchResult

SCHEMA = "flare-bench/1"
MiB = 1024 * 1024
NOT_MEASURED = "not measured"


def _mib(n: float) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / MiB:.1f}"


def _num(v: float, digits: int = 4) -> str:
    if v is None or math.isnan(v):
        return "-"
    if v == 0:
        return "0"
    mag = math.floor(math.log10(abs(v)))
    return f"{v:.{max(0, digits - 1 - mag)}f}" if mag < digits else f"{v:.0f}"


def _ratio(r: dict[str, float]) -> str:
    """Median of the pair ratios with their range: '0.36x (pairs 0.34-0.37)'."""
    if math.isnan(r["median"]):
        return "-"
    text = f"{r['median']:.2f}x (pairs {r['min']:.2f}-{r['max']:.2f})"
    return text if r["pairs"] == r["of"] else f"{text}, {r['pairs']} of {r['of']} pairs (others divide by 0)"


def _finite(value: Any) -> Any:
    """NaN/inf -> None, recursively: JSON has no NaN (a ratio with a zero denominator is null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def headline(result: BenchResult) -> str:
    """'RTF 0.0046 -> 0.0023 (peak ledger 9.1 -> 9.4 MiB), B/A 0.50x, outputs identical'.

    Peak is the ledger's (all devices) when both sides allocate through it, else the
    process's RSS growth during the run for both (peers allocate outside the ledger)."""
    a, b = result.summaries["A"], result.summaries["B"]
    ledger_a, ledger_b = sum(a.ledger_peak_bytes.values()), sum(b.ledger_peak_bytes.values())
    if ledger_a and ledger_b:
        kind, peak_a, peak_b = "ledger", ledger_a, ledger_b
    else:
        kind, peak_a, peak_b = "RSS growth", a.rss_growth_bytes, b.rss_growth_bytes
    r = result.ratio("metric")
    return (f"{result.metric.name} {_num(a.metric)} -> {_num(b.metric)} "
            f"(peak {kind} {_mib(peak_a)} -> {_mib(peak_b)} MiB), B/A {r['median']:.2f}x, "
            f"outputs {result.outputs.verdict}")


def to_json(result: BenchResult) -> dict[str, Any]:
    """The whole result as JSON-able data (schema `SCHEMA`); undefined numbers are null."""
    return _finite({
        "schema": SCHEMA,
        "model": result.model,
        "metric": {"name": result.metric.name, "work_unit": result.metric.work_unit,
                   "lower_is_better": result.metric.lower_is_better},
        "order": [r.slot.key for r in result.runs],
        "blocks": result.blocks,
        "warmup": result.warmup,
        "requests": [{"index": q.index, "label": q.label, "work": q.work} for q in result.requests],
        "configs": {k: {**c.to_json(), "runner": result.descriptions.get(k, "")} for k, c in result.configs.items()},
        "runs": [r.to_json() for r in result.runs],
        "summary": {k: s.to_json() for k, s in result.summaries.items()},
        "pairs": [p.to_json() for p in result.pairs],
        "ratio": {"metric": result.ratio("metric"), "ledger_peak": result.ratio("ledger_peak"),
                  "rss_growth": result.ratio("rss_growth")},
        "outputs": result.outputs.to_json(),
        "ok": result.ok,
        "headline": headline(result),
        "machine": result.machine,
    })


def write_json(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=2, allow_nan=False) + "\n")
    return path


def print_report(result: BenchResult, console: Any = None) -> None:
    """The comparison as rich tables on `console` (stdout by default)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    a, b = result.summaries["A"], result.summaries["B"]
    ca, cb = result.configs["A"], result.configs["B"]
    work = sum(q.work for q in result.requests)
    console.print(f"[bold]flare bench[/] {result.model}: {result.blocks} block(s) A B B A, "
                  f"{len(result.requests)} requests per run ({work:g} {result.metric.work_unit}), "
                  f"{result.warmup} warm-up request(s) per run", highlight=False)
    for key, cfg in (("A", ca), ("B", cb)):
        console.print(f"  {key} = {cfg.name} ({cfg.path or 'in code'}): {result.descriptions.get(key, '')}",
                      highlight=False)

    table = Table(title=headline(result), title_justify="left")
    table.add_column("")
    table.add_column(f"A: {ca.name}", justify="right")
    table.add_column(f"B: {cb.name}", justify="right")
    table.add_column("B/A", justify="right")
    better = "lower" if result.metric.lower_is_better else "higher"
    table.add_row(f"{result.metric.name} ({better} is better)", _num(a.metric), _num(b.metric),
                  _ratio(result.ratio("metric")))
    table.add_row("latency median (ms)", _num(a.latency_median_s * 1e3), _num(b.latency_median_s * 1e3),
                  _num(b.latency_median_s / a.latency_median_s, 3) + "x" if a.latency_median_s else "-")
    table.add_row("latency p90 (ms)", _num(a.latency_p90_s * 1e3), _num(b.latency_p90_s * 1e3),
                  _num(b.latency_p90_s / a.latency_p90_s, 3) + "x" if a.latency_p90_s else "-")
    def ledger(side: Any, dev: str | None) -> str:
        # a peer (onnxruntime, NumPy) allocates outside Flare's ledger: nothing was measured, not 0 bytes
        if not side.ledger_peak_bytes:
            return NOT_MEASURED
        return _mib(side.ledger_peak_bytes.get(dev, 0) if dev else sum(side.ledger_peak_bytes.values()))

    for dev in sorted(set(a.ledger_peak_bytes) | set(b.ledger_peak_bytes)):
        table.add_row(f"ledger peak {dev} (MiB)", ledger(a, dev), ledger(b, dev), "")
    if a.ledger_peak_bytes or b.ledger_peak_bytes:
        both = a.ledger_peak_bytes and b.ledger_peak_bytes
        table.add_row("ledger peak, total (MiB)", ledger(a, None), ledger(b, None),
                      _ratio(result.ratio("ledger_peak")) if both else "-")
    scope = {r.memory.rss_scope for r in result.runs}
    table.add_row(f"peak RSS (MiB, {'per run' if scope == {'run'} else 'process so far'})", _mib(a.peak_rss_bytes),
                  _mib(b.peak_rss_bytes), "")
    table.add_row("peak RSS growth in a run (MiB)", _mib(a.rss_growth_bytes), _mib(b.rss_growth_bytes),
                  _ratio(result.ratio("rss_growth")))
    if a.memory_plan or b.memory_plan:
        for label, field in (("workspace arenas (MiB)", "workspace_bytes"),
                             ("weights, state, inputs (MiB)", "persistent_bytes")):
            cells = [_mib(sum(s.memory_plan[field].values())) if s.memory_plan else "-" for s in (a, b)]
            table.add_row(label, *cells, "")
    for name in dict.fromkeys([*a.extras, *b.extras]):
        va, vb = a.extras.get(name, float("nan")), b.extras.get(name, float("nan"))
        table.add_row(f"{name} (median)", _num(va), _num(vb), f"{vb / va:.2f}x" if va and not math.isnan(va) else "-")
    table.add_row("setup (s, untimed)", _num(a.setup_median_s, 3), _num(b.setup_median_s, 3), "")
    table.add_row("deterministic", str(a.deterministic), str(b.deterministic), "")
    table.add_row("outputs A vs B", "", "", result.outputs.summary())
    console.print(table)
    console.print("B/A with pairs: the median of B/A over adjacent A and B runs (and its range); "
                  "latency B/A: the ratio of the two medians.", style="dim", highlight=False)

    pairs = Table(title="pairs (adjacent runs)", title_justify="left")
    for col in ("block", "A run", "B run", f"A {result.metric.name}", f"B {result.metric.name}", "B/A"):
        pairs.add_column(col, justify="right")
    for p in result.pairs:
        pairs.add_row(str(p.block + 1), str(p.a_run + 1), str(p.b_run + 1),
                      _num(result.runs[p.a_run].metric_value), _num(result.runs[p.b_run].metric_value),
                      f"{p.metric:.3f}x")
    console.print(pairs)
    _print_plans(result, console)


def _print_plans(result: BenchResult, console: Any) -> None:
    from rich.table import Table

    rows = []
    for key in ("A", "B"):
        plan = result.summaries[key].memory_plan
        if not plan:
            continue
        for entry, e in plan["entries"].items():
            for dev, arena in e["arena"].items():
                if not arena.get("naive"):
                    continue
                shapes = ", ".join(f"{k}{tuple(v)}" for k, v in e.get("shapes", {}).items())
                rows.append((key, entry, dev, shapes, arena["planned"], arena["lower_bound"], arena["naive"]))
    if not rows:
        return
    table = Table(title="memory plan: arena planned vs liveness lower bound vs one buffer per tensor",
                  title_justify="left")
    for col in ("", "entry", "device", "input shapes (last used)", "planned MiB", "lower bound MiB",
                "one per tensor MiB", "planned / per tensor"):
        table.add_column(col, justify="right" if "MiB" in col or "/" in col else "left")
    for key, entry, dev, shapes, planned, lower, naive in rows:
        table.add_row(key, entry, dev, shapes, _mib(planned), _mib(lower), _mib(naive), f"{planned / naive:.1%}")
    console.print(table)
