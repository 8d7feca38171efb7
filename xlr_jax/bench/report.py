"""`xlr report RESULTS.json... [--out DIR]`: the standard figures of benchmark results as
PNG, and a markdown table of every cell.

It reads `xlr bench --sweep` results (a grid of cells) and plain `xlr bench` results
(engines on one prompt). Each figure is drawn where some result has what it needs:

- roofline.png: decode points (achieved TFLOP/s against FLOP/byte) on the roofline of the
  machine the result was measured on (its read bandwidth, its compute peak);
- ttft_per_turn.png: an agent conversation's TTFT per turn, a line per cell;
- speculative_speed.png: decode tokens/s against gamma, a line per method, draft and N;
- accepted_per_pass.png: tokens kept per target pass, a bar per speculative cell;
- smc_ess.png: SMC's ESS / N before each cycle, its resamples marked;
- load.png: throughput and latency against the request rate.

Each plot has a title, units and a caption naming the config, its hash, the git sha
and the device; report.md holds the tables (median and min-max over rounds) and links
the plots.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from xlr_jax.bench.sweep import cell_name

# per measure, the figures its table shows: (key, column title, scale, format)
HEADLINES = {
    "decode": [("decode_tokens_per_s", "decode tok/s", 1, ".1f"), ("ttft_s", "TTFT ms", 1e3, ".0f"),
               ("roofline_fraction", "of roofline", 1, ".2f")],
    "agent": [("ttft_first_turn_s", "turn 1 TTFT ms", 1e3, ".0f"),
              ("ttft_later_turns_median_s", "later turns TTFT ms", 1e3, ".0f"),
              ("load_s", "load s", 1, ".1f")],
    "speculative": [("decode_tokens_per_s", "decode tok/s", 1, ".1f"),
                    ("accepted_per_pass", "tokens / pass", 1, ".2f"),
                    ("resamples", "resamples", 1, ".0f"),
                    ("smc_fallbacks", "SMC fallbacks", 1, ".0f")],
    "load": [("throughput_tokens_per_s", "throughput tok/s", 1, ".1f"),
             ("ttft_p50_s", "TTFT p50 ms", 1e3, ".0f"), ("itl_p50_s", "ITL p50 ms", 1e3, ".1f"),
             ("latency_p99_s", "latency p99 s", 1, ".2f"), ("finished", "finished", 1, ".0f")],
}


class ReportError(ValueError):
    """A results file that cannot be read or is not a benchmark result."""


def read_results(paths: list[str]) -> list[dict]:
    results = []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ReportError(f"cannot read {path}: {e}") from e
        if result.get("kind") != "sweep" and "engines" not in result:
            raise ReportError(f"{path} is neither an `xlr bench --sweep` result (cells) nor an "
                              f"`xlr bench` one (engines)")
        results.append({**result, "path": str(path)})
    return results


def caption(result: dict) -> str:
    git, env = result.get("git", {}), result.get("environment", {})
    sha = (git.get("sha") or "?")[:10] + (" (dirty)" if git.get("dirty") else "")
    config = Path(result.get("config_path", "?")).name
    digest = f", config {result['config_hash']}" if "config_hash" in result else ""
    rounds = f", {result['repeats']} round(s)" if "repeats" in result else ""
    return (f"{config}{digest}{rounds}; git {sha}; {env.get('device_kind', '?')}, "
            f"{env.get('cpu_model', '?')}; {result.get('started_utc', '')[:16]}")


def _median(cell: dict, key: str):
    figure = cell.get("summary", {}).get(key)
    return None if figure is None else figure["median"]


def _used(pairs) -> list[dict]:
    """The results (once each, in order) that (result, cell) pairs come from."""
    return list({id(r): r for r, _ in pairs}.values())


def _cells(results: list[dict], measure: str) -> list[tuple[dict, dict]]:
    return [(r, c) for r in results if r.get("measure") == measure for c in r["cells"]
            if c.get("summary")]


def markdown_table(result: dict) -> str:
    """A sweep's cells, one row each: its values and headline figures (median, min-max)."""
    heads = HEADLINES[result["measure"]]
    keys = list(dict.fromkeys(k for c in result["cells"] for k in c["values"]))
    lines = [f"| {' | '.join(keys)} | {' | '.join(h[1] for h in heads)} |",
             "|" + " --- |" * (len(keys) + len(heads))]
    for cell in result["cells"]:
        row = [str(cell["values"].get(k, "")) for k in keys]
        if not cell["summary"] and cell.get("errors"):  # every round failed: say why, once
            lines.append(f"| {' | '.join(row)} | failed: {cell['errors'][0][:160]} |"
                         + " |" * (len(heads) - 1))
            continue
        for key, _, scale, fmt in heads:
            f = cell["summary"].get(key)
            if f is None:
                row.append("")
            elif f["min"] == f["max"]:
                row.append(format(f["median"] * scale, fmt))
            else:
                row.append(f"{f['median'] * scale:{fmt}} ({f['min'] * scale:{fmt}}-"
                           f"{f['max'] * scale:{fmt}})")
        lines.append(f"| {' | '.join(row)} |")
    return "\n".join(lines)


def _engines_table(result: dict) -> str:
    lines = ["| engine | decode tok/s | TTFT ms | of roofline |", "| --- | --- | --- | --- |"]
    for label, e in result["engines"].items():
        roof = e.get("roofline", {}).get("roofline_fraction")
        lines.append(f"| {label} | {e['decode_tokens_per_s']:.1f} | {e['ttft_s'] * 1e3:.0f} | "
                     f"{'' if roof is None else format(roof, '.2f')} |")
    return "\n".join(lines)


def _figure(title: str, results: list[dict], ncols: int = 1, size=(7.5, 4.8)):
    """A figure with its title and, at the bottom, the caption of each result it draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    fig.suptitle(title, fontsize=11)
    captions = list(dict.fromkeys(caption(r) for r in results))
    fig.text(0.01, 0.01, "\n".join(captions), fontsize=6.5, color="dimgray", va="bottom")
    return fig, list(axes[0])


def _save(fig, path: Path) -> Path:
    caption_lines = len(fig.texts[0].get_text().splitlines())  # room for _figure's caption
    fig.tight_layout(rect=(0, 0.03 + 0.025 * caption_lines, 1, 1))
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _whole_numbers(axis) -> None:
    """Ticks at whole numbers only (turns, cycles, particles)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _decode_points(results: list[dict]) -> list[dict]:
    """(label, FLOP/byte, TFLOP/s, result) of every decode measurement with its bytes."""
    from xlr_jax.planning.roofline import measured_points

    points = []
    for r, c in _cells(results, "decode"):
        flops, nbytes = _median(c, "flops_per_token"), _median(c, "bytes_per_token")
        rate = _median(c, "decode_tokens_per_s")
        if flops and nbytes and rate:
            points.append({"label": c["name"], "intensity": flops / nbytes,
                           "tflops": rate * flops / 1e12, "result": r})
    for r in results:
        points += [{**p, "result": r} for p in measured_points(r)]
    return points


def _roof_of(result: dict) -> tuple[float | None, float, str]:
    """The peak TFLOP/s (None where not recorded), read bandwidth (GB/s) and device of the
    machine a result ran on."""
    hw = result.get("hardware", {})
    if result.get("kind") == "sweep":
        bandwidths = [_median(c, "read_bandwidth_gb_per_s") for c in result["cells"]]
        bandwidth = max((b for b in bandwidths if b), default=hw.get("peak_bandwidth_gb_s", 0))
    else:
        bw = result["bandwidth"]
        bandwidth = bw[f"{bw['kind']}_bandwidth_gb_per_s"]
    return (hw.get("peak_tflops"), bandwidth,
            hw.get("device_name") or result.get("environment", {}).get("cpu_model", "?"))


def plot_roofline(results: list[dict], path: Path) -> Path | None:
    from xlr_jax.planning.roofline import draw_roof

    points = _decode_points(results)
    if not points:
        return None
    results = _used((p["result"], None) for p in points)
    fig, (ax,) = _figure("Decode on the roofline (batch 1, measured)", results)
    roofs = [_roof_of(r) for r in results]
    # from below the points to past the highest of them and every ridge
    xs = [p["intensity"] for p in points]
    xs += [peak * 1e3 / bw for peak, bw, _ in roofs if peak]
    for roof in roofs:
        draw_roof(ax, *roof, span=(min(xs) / 3, max(xs) * 3))
    for p in points:
        ax.loglog([p["intensity"]], [p["tflops"]], "x", markersize=9, label=p["label"])
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def plot_turns(results: list[dict], path: Path) -> Path | None:
    cells = _cells(results, "agent")
    if not cells:
        return None
    fig, (ax,) = _figure("Agent conversation: time to first token per turn", _used(cells))
    for _, c in cells:
        f = c["summary"]["ttft_s"]
        turns = range(1, len(f["median"]) + 1)
        line, = ax.plot(turns, [v * 1e3 for v in f["median"]], marker="o", label=c["name"])
        ax.fill_between(turns, [v * 1e3 for v in f["min"]], [v * 1e3 for v in f["max"]],
                        color=line.get_color(), alpha=0.15)
    ax.set_yscale("log")
    _whole_numbers(ax.xaxis)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms, log; band: min-max over rounds)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def _spec_label(values: dict) -> str:
    return cell_name({k: v for k, v in values.items() if k != "gamma"})


def plot_speculative_speed(results: list[dict], path: Path) -> Path | None:
    cells = _cells(results, "speculative")
    if not cells:
        return None
    fig, (ax,) = _figure("Speculative decoding: decode speed against gamma", _used(cells))
    lines: dict[str, list] = {}
    for _, c in cells:
        if c["values"].get("method", "off") == "off":
            ax.axhline(_median(c, "decode_tokens_per_s"), color="black", linestyle="--",
                       label=f"no speculation ({c['name']})")
        else:
            lines.setdefault(_spec_label(c["values"]), []).append(
                (c["values"].get("gamma", 4), _median(c, "decode_tokens_per_s")))
    for label, xy in lines.items():
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=label)
    ax.set_xlabel("gamma (draft tokens per pass)")
    ax.set_ylabel("decode tokens/s (median over rounds)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_accepted(results: list[dict], path: Path) -> Path | None:
    cells = [(r, c) for r, c in _cells(results, "speculative")
             if _median(c, "accepted_per_pass") is not None]
    if not cells:
        return None
    fig, (ax,) = _figure("Speculative decoding: tokens kept per target pass", _used(cells),
                         size=(8, 4.8))
    names = [c["name"] for _, c in cells]
    ax.barh(range(len(cells)), [_median(c, "accepted_per_pass") for _, c in cells])
    ax.set_yticks(range(len(cells)), names, fontsize=7)
    ax.set_xlabel("tokens kept per target pass (median over rounds)")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def plot_ess(results: list[dict], path: Path) -> Path | None:
    cells = [(r, c) for r, c in _cells(results, "speculative")
             if c["values"].get("method") == "smc" and c["rounds"]
             and "ess_before" in c["rounds"][0].get("figures", {})]
    if not cells:
        return None
    fig, (ax, ax_n) = _figure("SMC-SD: effective sample size and resampling per cycle",
                              _used(cells), ncols=2, size=(12, 4.8))
    for _, c in cells:
        f = c["rounds"][0]["figures"]  # one population, cycle by cycle (the first round)
        cycles = range(1, len(f["ess_before"]) + 1)
        line, = ax.plot(cycles, f["ess_before"], label=c["name"])
        hits = [i + 1 for i, x in enumerate(f["resampled"]) if x]
        ax.plot(hits, [f["ess_before"][i - 1] for i in hits], "x", color=line.get_color(),
                markersize=8)
        ax_n.step(cycles, f["particles"], where="post", color=line.get_color(), label=c["name"])
    threshold = cells[0][0]["config"]["engine"].get("ess_threshold", 0.5)
    ax.axhline(threshold, color="grey", linestyle=":", label=f"resample below {threshold:g}")
    ax.set_xlabel("cycle (target pass)")
    ax.set_ylabel("ESS / N before the cycle (x: resampled)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax_n.set_xlabel("cycle (target pass)")
    ax_n.set_ylabel("particles N (1: probation or fallback)")
    _whole_numbers(ax_n.yaxis)
    ax_n.legend(fontsize=7)
    for a in (ax, ax_n):
        a.grid(True, alpha=0.3)
        _whole_numbers(a.xaxis)
    return _save(fig, path)


def plot_load(results: list[dict], path: Path) -> Path | None:
    cells = sorted(_cells(results, "load"), key=lambda rc: rc[1]["values"].get("rate", 0))
    if not cells:
        return None
    fig, (ax_t, ax_l) = _figure("Online engine: throughput and latency against request rate",
                                _used(cells), ncols=2, size=(12, 4.8))
    groups: dict[str, list] = {}
    for _, c in cells:
        rest = {k: v for k, v in c["values"].items() if k != "rate"}
        groups.setdefault(cell_name(rest), []).append(c)
    for label, group in groups.items():
        rates = [c["values"]["rate"] for c in group]
        ax_t.plot(rates, [_median(c, "throughput_tokens_per_s") for c in group], marker="o",
                  label=label or "engine")
        for key, style in (("ttft_p50_s", "-"), ("ttft_p99_s", "--"), ("latency_p50_s", "-."),
                           ("latency_p99_s", ":")):
            ax_l.plot(rates, [_median(c, key) for c in group], style, marker="o",
                      label=f"{label + ' ' if label else ''}{key[:-2].replace('_', ' ')}")
    ax_t.set_xlabel("request rate (requests/s)")
    ax_t.set_ylabel("throughput (completion tokens/s)")
    ax_l.set_xlabel("request rate (requests/s)")
    ax_l.set_ylabel("seconds (log)")
    ax_l.set_yscale("log")
    for a in (ax_t, ax_l):
        a.legend(fontsize=7)
        a.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


PLOTS = {"roofline.png": plot_roofline, "ttft_per_turn.png": plot_turns,
         "speculative_speed.png": plot_speculative_speed,
         "accepted_per_pass.png": plot_accepted, "smc_ess.png": plot_ess, "load.png": plot_load}


def write_report(paths: list[str], out_dir: str | None = None) -> dict:
    """Draw every figure the results have data for and write report.md; returns paths."""
    results = read_results(paths)
    out = Path(out_dir) if out_dir else Path(paths[0]).with_name(Path(paths[0]).stem + "-report")
    out.mkdir(parents=True, exist_ok=True)
    drawn = {name: fn(results, out / name) for name, fn in PLOTS.items()}
    drawn = {name: p for name, p in drawn.items() if p is not None}
    lines = ["# Benchmark report", ""]
    for r in results:
        lines += [f"## {Path(r['path']).name}", "", f"{caption(r)}", ""]
        if r.get("kind") == "sweep":
            failed = f"; {r['failed_cells']} cell(s) failed" if r["failed_cells"] else ""
            lines += [f"Measure: {r['measure']}; {len(r['cells'])} cells x {r['repeats']} "
                      f"round(s), each cell in a process of its own{failed}.", "",
                      markdown_table(r), ""]
        else:
            lines += [_engines_table(r), ""]
    lines += ["## Figures", ""] + [f"![{name}]({name})" for name in drawn]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return {"out": str(out), "report": str(out / "report.md"),
            "figures": [str(p) for p in drawn.values()]}


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="figures (PNG) and a markdown table from benchmark results",
        description="Draw the standard figures of `xlr bench` and `xlr bench --sweep` "
                    "results (roofline, TTFT per turn, speculative speed and tokens per "
                    "pass, SMC's ESS per cycle, load curves: each where the results have "
                    "its data) and write report.md with every cell's figures.")
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="result files")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the PNGs and report.md (default: <first result>-report/)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        done = write_report(args.results, args.out)
    except ReportError as e:
        print(f"xlr report: {e}", file=sys.stderr)
        return 2
    for path in done["figures"]:
        print(path)
    print(done["report"])
    return 0
