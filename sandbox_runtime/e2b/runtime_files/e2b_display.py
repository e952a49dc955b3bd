"""E2B's rich results in an IPython kernel: `e2b/data` (a pandas DataFrame's columns) and
`e2b/chart` (what a matplotlib figure plots), the two MIME types E2B's code interpreter adds to
IPython's display formatters, which its SDKs read as `Result.data` and `Result.chart`.

The E2B edge (sandbox_runtime/e2b/interpreter_setup.py) sends this file's text into a context's
kernel as code when the context starts; it runs there, inside the sandbox, with the user's
packages. It imports neither pandas nor matplotlib: a DataFrame or a figure can only exist once
the user's code imported them. What it makes is bounded (DATA_MAX_CHARS, POINTS_MAX), as the
host bounds every MIME value again.
"""

import json
import math
import re
import sys

DATA_MAX_CHARS = 200_000  # a larger DataFrame keeps its text and HTML, not its e2b/data
POINTS_MAX = 10_000  # points of one chart element
UNIT = re.compile(r"[\[(]([^\[\]()]+)[\])]\s*$")


def _plain(value):
    """A JSON-native value (a number, a string or None) for one cell or coordinate."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        iso = getattr(value, "isoformat", None)
        return iso() if callable(iso) else str(value)
    if isinstance(value, float) or type(value).__module__ == "numpy":
        if "datetime64" in type(value).__name__:
            return str(value)
        return None if math.isnan(number) or math.isinf(number) else number
    return number


def frame_data(frame):
    """A DataFrame as E2B's `e2b/data`: {column: [values]}, or None when too large."""
    data = {str(k): [_plain(v) for v in values] for k, values in frame.to_dict("list").items()}
    return data if len(json.dumps(data)) <= DATA_MAX_CHARS else None


def _unit(label):
    found = UNIT.search(label or "")
    return found.group(1) if found else None


def _scale(axis, scale):
    converter = getattr(axis, "get_converter", lambda: getattr(axis, "converter", None))()
    name = type(converter).__name__ if converter is not None else ""
    if "Date" in name:
        return "datetime"
    if "Category" in name:
        return "categorical"
    return scale


def _axes2d(ax):
    x_label, y_label = ax.get_xlabel(), ax.get_ylabel()
    return {
        "x_label": x_label or None,
        "y_label": y_label or None,
        "x_unit": _unit(x_label),
        "y_unit": _unit(y_label),
    }


def _ticks(ax):
    return {
        "x_ticks": [_plain(t) for t in ax.get_xticks()],
        "x_tick_labels": [t.get_text() for t in ax.get_xticklabels()],
        "x_scale": _scale(ax.xaxis, ax.get_xscale()),
        "y_ticks": [_plain(t) for t in ax.get_yticks()],
        "y_tick_labels": [t.get_text() for t in ax.get_yticklabels()],
        "y_scale": _scale(ax.yaxis, ax.get_yscale()),
    }


def _points(xs, ys):
    return [[_plain(x), _plain(y)] for x, y in list(zip(xs, ys, strict=False))[:POINTS_MAX]]


def _bars(ax):
    ticks = list(zip(ax.get_xticks(), (t.get_text() for t in ax.get_xticklabels()), strict=False))
    elements = []
    for container in ax.containers:
        group = container.get_label()
        for rect in getattr(container, "patches", [])[:POINTS_MAX]:
            center = rect.get_x() + rect.get_width() / 2
            near = min(ticks, key=lambda t: abs(t[0] - center), default=None)
            label = near[1] if near is not None and near[1] else str(_plain(center))
            elements.append({"label": label, "group": group, "value": _plain(rect.get_height())})
    return elements


def chart_of_axes(ax):
    """One axes' chart: line, scatter, bar or pie (else unknown), as E2B's SDKs read it."""
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    chart = {"title": ax.get_title() or None}
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    if any(isinstance(c, BarContainer) for c in ax.containers):
        return {"type": "bar", **chart, **_axes2d(ax), "elements": _bars(ax)}
    if wedges:
        texts = [t.get_text() for t in ax.texts]
        elements = [
            {
                "label": w.get_label() if not w.get_label().startswith("_") else
                (texts[i] if i < len(texts) else str(i)),
                "angle": _plain(w.theta2 - w.theta1),
                "radius": _plain(w.r),
            }
            for i, w in enumerate(wedges)
        ]  # fmt: skip
        return {"type": "pie", **chart, "elements": elements}
    if scatters and not ax.get_lines():
        elements = [
            {"label": c.get_label(), "points": _points(*zip(*c.get_offsets(), strict=False))}
            for c in scatters
            if len(c.get_offsets())
        ]
        return {"type": "scatter", **chart, **_axes2d(ax), **_ticks(ax), "elements": elements}
    if ax.get_lines():
        elements = [
            {"label": line.get_label(), "points": _points(line.get_xdata(), line.get_ydata())}
            for line in ax.get_lines()
        ]
        return {"type": "line", **chart, **_axes2d(ax), **_ticks(ax), "elements": elements}
    return {"type": "unknown", **chart, "elements": []}


def chart_of_figure(figure):
    """A figure's chart (a `superchart` of several axes), or None for an empty figure."""
    axes = [ax for ax in figure.get_axes() if ax.has_data()]
    if not axes:
        return None
    if len(axes) == 1:
        return chart_of_axes(axes[0])
    title = figure._suptitle.get_text() if figure._suptitle is not None else None
    return {"type": "superchart", "title": title, "elements": [chart_of_axes(a) for a in axes]}


def install(shell):
    """Add the two formatters to `shell`'s display formatter (once)."""
    formatters = shell.display_formatter.formatters
    if "e2b/chart" in formatters:
        return
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is not None and isinstance(obj, pandas.DataFrame):
                try:
                    return frame_data(obj)
                except Exception:
                    return None
            return super().__call__(obj)

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj):
            if "matplotlib" in sys.modules:
                from matplotlib.figure import Figure

                if isinstance(obj, Figure):
                    try:
                        return chart_of_figure(obj)
                    except Exception:
                        return None
            return super().__call__(obj)

    formatters["e2b/data"] = DataFormatter(parent=shell.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)
