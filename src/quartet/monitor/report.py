"""`quartet report RUN_DIR`: one self-contained HTML page per run (or pipeline of runs).

The page holds, top to bottom: the doctor's findings, final numbers per stage, the eval table
(eval/eval.json), training curves per stage, and sample responses side by side. Plots are PNGs drawn
with matplotlib's Agg canvas, embedded as base64 and also kept in ``run_dir/plots/``. All text from the
run is HTML-escaped; the page loads nothing from the network.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import re
from pathlib import Path

from quartet.atomic import atomic_dir, atomic_write_text
from quartet.errors import DataError
from quartet.monitor.doctor import Finding, diagnose, kl_target_from_config
from quartet.monitor.metrics import read_metrics, stage_dirs

MAX_SAMPLES = 8

# (id, title, keys on the left axis, keys on the right axis)
CHARTS = [
    ("score", "Score (proxy reward)", ["objective/score", "objective/reward"], []),
    ("gold", "Gold judge vs proxy score", ["objective/score"], ["objective/gold"]),
    ("kl", "KL to the reference and its coefficient beta", ["objective/kl"], ["objective/kl_coef"]),
    ("length", "Response length and EOS rate", ["rollout/length_mean", "rollout/length_max"], ["rollout/eos_rate"]),
    ("entropy", "Policy entropy (nats / token)", ["policy/entropy"], []),
    ("value", "Critic: value loss and explained variance", ["value/loss"], ["value/explained_variance"]),
    ("clipfrac", "Clip fractions", ["policy/clipfrac", "value/clipfrac"], []),
    ("diversity", "Diversity and repetition", ["rollout/distinct_1", "rollout/distinct_2"], ["rollout/repetition"]),
    ("policy", "Policy loss and approximate KL per update", ["policy/loss"], ["policy/approx_kl"]),
    ("grad", "Gradient norm and learning rate", ["optim/grad_norm"], ["optim/lr"]),
    ("sft_loss", "SFT loss", ["sft/loss", "sft/eval_loss"], ["sft/eval_ppl"]),
    ("rm_loss", "Reward model loss and margin", ["rm/loss"], ["rm/margin", "rm/eval_margin"]),
    ("rm_accuracy", "Reward model accuracy", ["rm/accuracy", "rm/eval_accuracy"], []),
    ("dpo_loss", "DPO loss and implicit-reward accuracy", ["dpo/loss", "dpo/eval_loss"],
     ["rewards/accuracy", "rewards/eval_accuracy"]),
    ("dpo_rewards", "DPO implicit rewards beta log(pi / pi_ref)", ["rewards/chosen", "rewards/rejected",
                                                                  "rewards/margins"], []),
    ("dpo_logps", "Log-probs of the chosen and rejected answers", ["logps/chosen", "logps/rejected"], []),
    ("dpo_kl", "DPO: KL to the reference on sampled answers", ["dpo/kl"], []),
    ("timing", "Seconds per step", ["timing/total", "timing/generate", "timing/score", "timing/reference",
                                    "timing/update"], []),
]
# a chart that needs a key to be worth drawing (gold vs proxy only when a gold judge was logged)
REQUIRED = {"gold": "objective/gold"}

SUMMARY_KEYS = [
    "objective/score", "objective/gold", "objective/kl", "objective/kl_coef", "rollout/length_mean",
    "rollout/eos_rate", "rollout/distinct_2", "policy/entropy", "policy/clipfrac", "value/loss",
    "value/explained_variance", "sft/loss", "sft/eval_loss", "sft/eval_ppl", "rm/accuracy",
    "rm/eval_accuracy", "dpo/loss", "dpo/eval_loss", "rewards/margins", "rewards/eval_accuracy", "dpo/kl",
    "memory/peak_rss_mb",
]


# --------------------------------------------------------------------------- data
def _series(records: list[dict], key: str) -> tuple[list, list]:
    steps, values = [], []
    for rec in records:
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(rec.get("step"), (int, float)):
            steps.append(rec["step"])
            values.append(float(v) if math.isfinite(v) else math.nan)
    return steps, values


def _has(records: list[dict], key: str) -> bool:
    return any(math.isfinite(v) for v in _series(records, key)[1])


def _read_json(path: Path) -> tuple[object, str | None]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, ValueError) as e:
        return None, f"{path.name} could not be read: {e}"


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- plots
def _plot(records, chart, findings: list[Finding]) -> bytes | None:
    """One chart as PNG bytes, or None when none of its keys were logged."""
    cid, title, left, right = chart
    if cid in REQUIRED and not _has(records, REQUIRED[cid]):
        return None
    left = [k for k in left if _has(records, k)]
    right = [k for k in right if _has(records, k)]
    if not left and not right:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.3), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
    handles = []
    for i, key in enumerate(left):
        steps, values = _series(records, key)
        marker = "o" if len(steps) <= 40 else None
        handles += ax.plot(steps, values, color=colors[i % 6], lw=1.6, marker=marker, ms=3, label=key)
    if right:
        ax2 = ax.twinx() if left else ax
        for j, key in enumerate(right):
            steps, values = _series(records, key)
            marker = "s" if len(steps) <= 40 else None
            handles += ax2.plot(steps, values, color=colors[(len(left) + j) % 6], lw=1.3, ls="--",
                                marker=marker, ms=3, label=key)
        ax2.ticklabel_format(axis="y", useOffset=False)
        if "value/explained_variance" in right:  # early critics reach -100s; keep the useful range visible
            lo = min(v for v in _series(records, "value/explained_variance")[1] if math.isfinite(v))
            if lo < -1.0:
                ax2.set_ylim(bottom=-1.05, top=1.05)
        if left:
            ax2.set_ylabel(", ".join(k.split("/")[-1] for k in right), fontsize=8)
    keys = set(left) | set(right)
    for f in findings:
        if f.evidence.get("metric") in keys and isinstance(f.step, (int, float)):
            ax.axvline(f.step, color="#d62728" if f.severity == "error" else "#e6a100", lw=1, ls=":")
            ax.annotate(f.rule, (f.step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        color="#a00", rotation=90, va="top", ha="right")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    top = ax2 if right and left else ax  # the twin axis is drawn over the first: legend goes on top
    top.legend(handles=handles, fontsize=7, loc="best", framealpha=0.85)
    fig.subplots_adjust(left=0.1, right=0.88 if right and left else 0.97, top=0.9, bottom=0.15)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --------------------------------------------------------------------------- HTML pieces
E = html.escape

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1400px;
  color:#222;padding:0 16px}
h1{font-size:1.5em;margin-bottom:4px}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
.meta{color:#666;font-size:.9em}
.finding{border-left:5px solid #e6a100;background:#fff8e6;padding:8px 12px;margin:8px 0}
.finding.error{border-color:#d62728;background:#fdecec}
.finding .rule{font-weight:600}.finding dl{margin:4px 0 0;display:grid;grid-template-columns:6em 1fr;gap:2px 8px}
.finding dt{color:#666}.finding dd{margin:0}
.ok{border-left:5px solid #2ca02c;background:#edf7ed;padding:8px 12px}
table{border-collapse:collapse;font-size:.9em;margin:8px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.baseline td{background:#f7f7ff}
.samples td{white-space:pre-wrap;max-width:420px;font-size:.85em}
.charts{display:flex;flex-wrap:wrap;gap:12px}.charts img{width:640px;max-width:100%;border:1px solid #eee}
pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:.85em}
"""

# sets data-images="loaded/total" on <body> once the page has loaded, so a headless browser can check
SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) { if (imgs[i].complete && imgs[i].naturalWidth > 0) ok++; }
  document.body.setAttribute("data-images", ok + "/" + imgs.length);
});
"""


def _num(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return E(str(v))
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def _findings_html(findings: list[Finding]) -> str:
    if not findings:
        return '<div class="ok">Doctor: no findings. The logged metrics show none of the known failure modes.</div>'
    out = []
    for f in findings:
        ev = f.evidence or {}
        window = ev.get("window") or ["?", "?"]
        values = " ".join(_num(v) for v in ev.get("values", []))
        related = "".join(
            f"<br>{E(str(k))}: {' '.join(_num(v) for v in vs)}" for k, vs in (ev.get("related") or {}).items()
        )
        stage = f" [{E(f.stage)}]" if f.stage else ""
        out.append(
            f'<div class="finding {E(f.severity)}"><span class="rule">{E(f.severity.upper())}: {E(f.rule)}</span>'
            f" at step {E(str(f.step))}{stage}<dl>"
            f"<dt>symptom</dt><dd>{E(f.symptom)}</dd>"
            f"<dt>evidence</dt><dd>{E(str(ev.get('metric')))} at steps {E(str(window[0]))}..{E(str(window[-1]))}:"
            f" {values}{related}</dd>"
            f"<dt>cause</dt><dd>{E(f.cause)}</dd><dt>fix</dt><dd>{E(f.fix)}</dd></dl></div>"
        )
    return "\n".join(out)


def _summary_html(stages: list[tuple[str, list[dict]]]) -> str:
    rows = []
    for name, records in stages:
        if not records:
            continue
        steps = [r["step"] for r in records if isinstance(r.get("step"), (int, float))]
        times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
        cells = []
        for key in SUMMARY_KEYS:
            _, values = _series(records, key)
            if values:
                cells.append(f"<b>{E(key)}</b> {_num(values[-1])}")
        wall = f"{(max(times) - min(times)) / 60:.1f} min" if len(times) > 1 else "-"
        rows.append(
            f"<tr><td>{E(name)}</td><td class=num>{len(records)}</td>"
            f"<td class=num>{_num(max(steps)) if steps else '-'}</td><td class=num>{wall}</td>"
            f"<td>{' &middot; '.join(cells)}</td></tr>"
        )
    if not rows:
        return ""
    return ("<h2>Final values</h2><table><tr><th>stage</th><th>records</th><th>last step</th><th>wall time</th>"
            "<th>last logged values</th></tr>" + "".join(rows) + "</table>")


def _cell(v) -> str:
    if isinstance(v, dict):
        mean = v.get("mean")
        lo, hi = v.get("lo"), v.get("hi")
        text = _num(mean) if mean is not None else E(json.dumps(v))
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
            text += f" <small>[{_num(lo)}, {_num(hi)}]</small>"
        return f"<td class=num>{text}</td>"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"<td class=num>{_num(v)}</td>"
    return f"<td>{E('' if v is None else str(v))}</td>"


def _eval_html(data, source: str) -> str:
    if not isinstance(data, dict):
        return f"<p>{E(source)}: not an eval result (expected a JSON object)</p>"
    ckpts = data.get("checkpoints")
    out = [f"<h3>{E(source)}</h3>"]
    if isinstance(ckpts, dict) and ckpts:
        baseline = data.get("baseline")
        metrics: list[str] = []
        for m in ckpts.values():
            for k in m if isinstance(m, dict) else []:
                if k not in metrics:
                    metrics.append(k)
        out.append("<table><tr><th>checkpoint</th>" + "".join(f"<th>{E(str(k))}</th>" for k in metrics) + "</tr>")
        for name, m in ckpts.items():
            m = m if isinstance(m, dict) else {}
            cls = ' class="baseline"' if name == baseline else ""
            tag = " <small>(baseline)</small>" if name == baseline else ""
            out.append(f"<tr{cls}><td>{E(str(name))}{tag}</td>" + "".join(_cell(m.get(k)) for k in metrics) + "</tr>")
        out.append("</table><p class=meta>mean [95% bootstrap interval] where given</p>")
    else:
        out.append("<p>no checkpoint results in this file</p>")
    return "\n".join(out)


def _eval_samples_html(samples, names: list[str]) -> str:
    if not isinstance(samples, list):
        return ""
    rows = [s for s in samples if isinstance(s, dict)][:MAX_SAMPLES]
    if not rows:
        return ""
    cols = [n for n in names if any(n in r for r in rows)]
    cols += [k for r in rows for k in r if k != "prompt" and k not in cols]
    cols = list(dict.fromkeys(cols))

    def show(v):
        if isinstance(v, dict):
            text = E(str(v.get("response", "")))
            extra = " ".join(f"{E(str(k))}={_num(x)}" for k, x in v.items() if k != "response")
            return f"<td>{text}<br><small>{extra}</small></td>" if extra else f"<td>{text}</td>"
        return f"<td>{E('' if v is None else str(v))}</td>"

    head = "<tr><th>prompt</th>" + "".join(f"<th>{E(str(c))}</th>" for c in cols) + "</tr>"
    body = "".join(
        f"<tr><td>{E(str(r.get('prompt', '')))}</td>" + "".join(show(r.get(c)) for c in cols) + "</tr>" for r in rows
    )
    return f'<table class="samples">{head}{body}</table>'


def _training_samples_html(rows: list[dict], stage: str) -> str:
    """The same prompts answered early and late in training, side by side.

    Prompts come back every epoch, so each prompt's first and latest answers are paired; the prompts whose
    answers are furthest apart in training come first. Without repeated prompts, the last step's answers.
    """
    rows = [r for r in rows if "prompt" in r and "response" in r]
    if not rows:
        return ""

    def resp(r):
        extra = " ".join(f"{k} {_num(r[k])}" for k in ("score", "gold") if isinstance(r.get(k), (int, float)))
        small = f"<br><small>step {E(str(r.get('step')))} &middot; {extra}</small>"
        return f"<td>{E(str(r.get('response', '')))}{small}</td>"

    first: dict[str, dict] = {}
    latest: dict[str, dict] = {}
    for r in rows:
        key = str(r["prompt"])
        first.setdefault(key, r)
        latest[key] = r
    pairs = [(first[k], latest[k]) for k in first if latest[k].get("step") != first[k].get("step")]
    pairs.sort(key=lambda p: _step_gap(p[0], p[1]), reverse=True)
    title = f"<h3>{E(stage)}: samples during training</h3>"
    if pairs:
        head = "<tr><th>prompt</th><th>early</th><th>late</th></tr>"
        body = "".join(f"<tr><td>{E(str(a['prompt']))}</td>{resp(a)}{resp(b)}</tr>" for a, b in pairs[:MAX_SAMPLES])
    else:
        last_step = rows[-1].get("step")
        last = [r for r in rows if r.get("step") == last_step][:MAX_SAMPLES]
        head = "<tr><th>prompt</th><th>response</th></tr>"
        body = "".join(f"<tr><td>{E(str(r['prompt']))}</td>{resp(r)}</tr>" for r in last)
    return f'{title}<table class="samples">{head}{body}</table>'


def _step_gap(a: dict, b: dict) -> float:
    sa, sb = a.get("step"), b.get("step")
    return sb - sa if isinstance(sa, (int, float)) and isinstance(sb, (int, float)) else 0


# --------------------------------------------------------------------------- the page
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def write_report(run_dir) -> Path:
    """Write ``run_dir/report.html`` (and ``run_dir/plots/*.png``) and return the HTML path."""
    run_dir = Path(run_dir)
    dirs = stage_dirs(run_dir)  # DataError when run_dir does not exist
    stages = [(name, d, read_metrics(d)) for name, d in dirs]
    eval_files = [p for p in [run_dir / "eval" / "eval.json", run_dir / "eval.json"]
                  + [d / "eval" / "eval.json" for _, d in dirs if d != run_dir] if p.is_file()]
    sample_files = [(name, d / "samples.jsonl") for name, d in dirs if (d / "samples.jsonl").is_file()]
    if (run_dir / "samples.jsonl").is_file() and all(d != run_dir for _, d in dirs):
        sample_files.insert(0, (run_dir.name, run_dir / "samples.jsonl"))
    if not stages and not eval_files and not sample_files:
        raise DataError(f"{run_dir}: nothing to report (no metrics.jsonl, eval/eval.json or samples.jsonl)")

    findings: list[Finding] = []
    per_stage_findings = {}
    for name, d, records in stages:
        found = diagnose(records, kl_target=kl_target_from_config(d))
        for f in found:
            f.stage = f.stage or name
        per_stage_findings[name] = found
        findings.extend(found)

    charts_html = []
    with atomic_dir(run_dir / "plots") as tmp:
        for name, _d, records in stages:
            imgs = []
            for chart in CHARTS:
                png = _plot(records, chart, per_stage_findings[name])
                if png is None:
                    continue
                file = f"{_slug(name)}-{chart[0]}.png"
                (tmp / file).write_bytes(png)
                data = base64.b64encode(png).decode("ascii")
                imgs.append(f'<img src="data:image/png;base64,{data}" alt="{E(chart[1])}" '
                            f'title="plots/{E(file)}">')
            if imgs:
                charts_html.append(f"<h3>{E(name)}</h3><div class=\"charts\">{''.join(imgs)}</div>")

    eval_html = []
    for path in eval_files:
        data, err = _read_json(path)
        source = str(path.relative_to(run_dir))
        if err:
            eval_html.append(f"<p>{E(err)}</p>")
            continue
        eval_html.append(_eval_html(data, source))
        if isinstance(data, dict):
            ckpts = data.get("checkpoints")
            names = [data["baseline"]] if isinstance(data.get("baseline"), str) else []
            names += list(ckpts) if isinstance(ckpts, dict) else []
            table = _eval_samples_html(data.get("samples"), names)
            if table:
                eval_html.append(f"<h3>{E(source)}: samples</h3>{table}")
    samples_html = [_training_samples_html(_read_jsonl(p), name) for name, p in sample_files]

    generated = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    stage_names = ", ".join(name for name, _, _ in stages) or "none"
    configs = "".join(
        f"<details><summary>{E(name)}: config.yaml</summary><pre>{E((d / 'config.yaml').read_text(errors='replace'))}"
        "</pre></details>"
        for name, d, _ in stages if (d / "config.yaml").is_file()
    )
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Quartet report: {E(run_dir.name)}</title>",
        f"<style>{CSS}</style><script>{SCRIPT}</script></head><body>",
        f"<h1>Quartet report: {E(run_dir.name)}</h1>",
        f'<p class="meta">{E(str(run_dir))} &middot; stages: {E(stage_names)} &middot; generated {E(generated)}</p>',
        '<h2 id="findings">Doctor</h2>',
        _findings_html(findings),
        _summary_html([(name, records) for name, _, records in stages]),
    ]
    if eval_html:
        parts += ['<h2 id="eval">Evaluation</h2>', *eval_html]
    if charts_html:
        parts += ['<h2 id="curves">Training curves</h2>', *charts_html]
    if any(samples_html):
        parts += ['<h2 id="samples">Samples</h2>', *samples_html]
    if configs:
        parts += ['<h2 id="config">Configs</h2>', configs]
    parts.append("</body></html>\n")
    return atomic_write_text(run_dir / "report.html", "\n".join(parts))


def cli(args) -> int:
    """`quartet report RUN_DIR`: write the report and print its path."""
    print(write_report(args.run_dir))
    return 0
