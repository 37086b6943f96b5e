"""Tables on stdout, CSV and PNG files under the results folder."""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path


def results_dir(given: str | Path | None, harness: str) -> Path:
    path = Path(given) if given else Path("results") / harness
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_out_arg(parser: argparse.ArgumentParser, name: str) -> None:
    """--out for a benchmark script: its results folder, results/NAME in the repository by
    default (wherever the script is started from)."""
    from tritonlm.paths import REPO_ROOT

    parser.add_argument("--out", default=str(REPO_ROOT / "results" / name), help=f"results folder (default results/{name})")


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    if not rows:
        return (title + "\n" if title else "") + "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]
    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    out = []
    if title:
        out.append(title)
    out.append(line(columns))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def write_csv(path: Path, rows: Sequence[dict]) -> Path:
    path = Path(path)
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend: no display needed);
    ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def optional_figure(*args, **kwargs):
    """pyplot().subplots(*args, **kwargs): (figure, axes); None where matplotlib is not
    installed, for scripts whose PNG is an extra next to their CSV."""
    try:
        plt = pyplot()
    except ImportError:
        return None
    return plt.subplots(*args, **kwargs)


def style_axes(ax, x_label: str, y_label: str, title: str = "", *, legend_size: int | None = 8) -> None:
    """Labels, title, a light grid and (legend_size not None) the legend."""
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend_size is not None:
        ax.legend(fontsize=legend_size)


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def plot_latency_vs_throughput(
    path: Path,
    series: dict[str, Sequence[dict]],
    budget_ms: float | None = None,
    title: str = "",
    percentiles: Sequence[str] = ("p50_ms", "p95_ms", "p99_ms"),
) -> Path:
    """Latency percentiles (p50 dashed, p95 dotted, p99 solid) against throughput, one colour per series."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    styles = {"p50_ms": "--", "p95_ms": ":", "p99_ms": "-"}
    for i, (name, rows) in enumerate(series.items()):
        x = [r["throughput_per_s"] for r in rows]
        for key in percentiles:
            ax.plot(x, [r[key] for r in rows], styles.get(key, "-."), marker="o", ms=3, color=f"C{i}", label=f"{name} {key[:3]}")
    if budget_ms is not None:
        ax.axhline(budget_ms, color="red", lw=1.2, label=f"p99 budget {budget_ms:g} ms")
    style_axes(ax, "throughput (inferences/s)", "latency (ms)", title, legend_size=7)
    return save_figure(fig, path)


def plot_xy(path: Path, x_label: str, y_label: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str = "") -> Path:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o", ms=3, label=name)
    style_axes(ax, x_label, y_label, title)
    return save_figure(fig, path)
