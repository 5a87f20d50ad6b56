"""Benchmark results: a plain table on stdout and, on request, a JSON file.

Every result carries the environment it was measured in (device, jax version, date, the
command line), so a figure pasted into BENCHMARKS.md can be traced back.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys


def environment() -> dict:
    import jax

    devices = jax.devices()
    return {
        "device": devices[0].device_kind if devices else "none",
        "num_devices": len(devices),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_table(title: str, rows: list[dict], columns: list[str] | None = None, file=None) -> None:
    """Rows of dicts as an aligned text table (columns: the first row's keys by default)."""
    file = file or sys.stdout
    if not rows:
        print(f"== {title}: no rows", file=file)
        return
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"== {title}", file=file)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=file)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=file)


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=_jsonable)
        f.write("\n")


def _jsonable(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return str(obj)
