"""`quartet report RUN_DIR`: one self-contained HTML page per run (or pipeline of runs).

The page holds, top to bottom: the doctor's findings, final numbers per stage, the eval table
(eval/eval.json) and its samples (each checkpoint beside the baseline, prompt by prompt, the largest drop in
the judge's score first), training curves per stage (with gold and proxy against sqrt(KL) for any run that
logs objective/gold and objective/kl), and the same prompts answered early and late in training. Plots
are PNGs drawn with matplotlib's Agg canvas, embedded as base64 and also kept in ``run_dir/plots/``. All text from the
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

import yaml

from quartet.atomic import atomic_dir, atomic_write_text
from quartet.errors import DataError
from quartet.monitor.doctor import diagnose, kl_target_from_config, unjudged_stages
from quartet.monitor.metrics import read_metrics, stage_dirs
from quartet.monitor.rules import Finding

MAX_SAMPLES = 8

# (id, title, keys on the left axis, keys on the right axis)
CHARTS = [
    ("score", "Score (proxy reward)", ["objective/score", "objective/reward"], []),
    ("gold", "Gold judge vs proxy score", ["objective/score"], ["objective/gold"]),
    ("relevance", "On-task relevance vs proxy score", ["objective/score"], ["rollout/relevance"]),
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
REQUIRED = {"gold": "objective/gold", "relevance": "rollout/relevance"}
OVEROPTIMIZATION_CHART = ("overoptimization", "Gold and proxy vs sqrt(KL)", [], [])
"""drawn by _plot_overoptimization for any run that logs objective/gold and objective/kl"""

SUMMARY_KEYS = [
    "objective/score", "objective/gold", "rollout/relevance", "objective/kl", "objective/kl_coef", "rollout/length_mean",
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


def overoptimization_points(records: list[dict]) -> tuple[list[float], list[float], list[float], str] | None:
    """(sqrt(KL), proxy, gold, proxy key) at every step that logged all three, in step order; None without
    objective/gold and objective/kl. KL is per sequence in nats (negative estimates count as 0)."""
    proxy_key = next((k for k in ("objective/score", "objective/reward") if _has(records, k)), None)
    if proxy_key is None or not _has(records, "objective/gold") or not _has(records, "objective/kl"):
        return None
    xs, proxy, gold = [], [], []
    for rec in sorted((r for r in records if isinstance(r.get("step"), (int, float))), key=lambda r: r["step"]):
        values = [rec.get(k) for k in ("objective/kl", proxy_key, "objective/gold")]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            xs.append(math.sqrt(max(float(values[0]), 0.0)))
            proxy.append(float(values[1]))
            gold.append(float(values[2]))
    return (xs, proxy, gold, proxy_key) if len(xs) >= 2 else None


def _plot_overoptimization(records) -> bytes | None:
    """Gold and proxy score against sqrt(KL to the reference), as Gao et al. (2022) plot over-optimisation:
    the proxy keeps rising with distance from the reference; past some distance the gold score falls.

    Each iteration is a faint point; the lines are means over k = n/10 neighbouring iterations (sqrt(KL)
    averaged too), since KL does not grow monotonically and one batch's gold score is noisy."""
    points = overoptimization_points(records)
    if points is None:
        return None
    xs, proxy, gold, proxy_key = points
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.3), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax2 = ax.twinx()  # the proxy and the gold judge have their own scales
    k = max(1, len(gold) // 10)

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[i : i + k]) / k for i in range(len(values) - k + 1)]

    sx, sproxy, sgold = smooth(xs), smooth(proxy), smooth(gold)
    blue, green = "#1f77b4", "#2ca02c"
    ax.scatter(xs, proxy, s=8, color=blue, alpha=0.3, lw=0)
    ax2.scatter(xs, gold, s=8, color=green, alpha=0.3, lw=0)
    per = f", mean of {k}" if k > 1 else ""
    handles = ax.plot(sx, sproxy, color=blue, lw=1.6, label=f"{proxy_key} (proxy){per}")
    handles += ax2.plot(sx, sgold, color=green, lw=1.6, ls="--", label=f"objective/gold{per}")
    # the gold peak, on those means so one lucky batch is not the peak
    best = max(range(len(sgold)), key=sgold.__getitem__)
    ax2.axvline(sx[best], color=green, lw=0.8, ls=":")
    ax2.annotate(f"gold peak, sqrt(KL) {sx[best]:.2f}", (sx[best], 0.03), xycoords=("data", "axes fraction"),
                 fontsize=7, color=green, rotation=90, va="bottom", ha="right")
    ax.set_title("Over-optimisation: gold and proxy vs sqrt(KL) (Gao et al. 2022)", fontsize=10)
    ax.set_xlabel("sqrt(KL to the reference), sqrt(nats)", fontsize=8)
    ax.set_ylabel("proxy", fontsize=8)
    ax2.set_ylabel("gold", fontsize=8)
    ax.tick_params(labelsize=8)
    ax2.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax2.legend(handles=handles, fontsize=7, loc="best", framealpha=0.85)
    fig.subplots_adjust(left=0.1, right=0.88, top=0.9, bottom=0.15)
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
.note{color:#555;font-size:90%}
table{border-collapse:collapse;font-size:.9em;margin:8px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.baseline td{background:#f7f7ff}
.samples td{white-space:pre-wrap;max-width:420px;font-size:.85em}
td.worse{color:#b00;font-weight:600}td.better{color:#1a7f37}
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


def _findings_html(findings: list[Finding], short: list[str] = ()) -> str:
    out = []
    if short:
        out.append('<p class="note">Too short to judge (the run logged fewer points than these rules need to fire): '
                   + E("; ".join(short)) + "</p>")
    if not findings:
        out.insert(0, '<div class="ok">Doctor: no findings. The logged metrics show none of the known failure modes'
                   + (' it could judge' if short else '') + '.</div>')
        return "\n".join(out)
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
    if isinstance(data.get("breakdown"), dict) and data["breakdown"]:
        out.append(_groups_html("By group (the gold task's levels or kinds)", data["breakdown"]))
    tasks = data.get("tasks")
    if isinstance(tasks, dict) and tasks:
        out.append("<h4>Alignment tax</h4><p class=meta>each checkpoint on other tasks, by their gold judges; the "
                   "change is the paired difference from the baseline</p>")
        out.append(_tax_html(tasks, data.get("baseline")))
        out += [_groups_html(f"{task} by group", t["breakdown"]) for task, t in tasks.items()
                if isinstance(t, dict) and isinstance(t.get("breakdown"), dict)]
    return "\n".join(out)


def _groups_html(title: str, breakdown: dict) -> str:
    """One row per group (a level, a constraint kind), one column per checkpoint: mean [95% CI]."""
    names = [n for n, g in breakdown.items() if isinstance(g, dict)]
    groups = list(dict.fromkeys(k for n in names for k in breakdown[n]))
    rows = [f"<h4>{E(title)}</h4><table><tr><th>group</th>" + "".join(f"<th>{E(_short_name(n))}</th>" for n in names)
            + "</tr>"]
    rows += [f"<tr><td>{E(str(g))}</td>" + "".join(_cell(breakdown[n].get(g)) for n in names) + "</tr>" for g in groups]
    return "\n".join([*rows, "</table>"])


def _tax_html(tasks: dict, baseline) -> str:
    """One row per extra task: each checkpoint's gold mean, each other checkpoint's change from the baseline."""
    first = next((t["checkpoints"] for t in tasks.values() if isinstance(t, dict) and isinstance(t.get("checkpoints"),
                                                                                                  dict)), {})
    names, others = list(first), [n for n in first if n != baseline]
    rows = ["<table><tr><th>task</th>" + "".join(f"<th>{E(_short_name(n))}</th>" for n in names)
            + "".join(f"<th>{E(_short_name(n))} change</th>" for n in others) + "</tr>"]
    for task, t in tasks.items():
        m = t.get("checkpoints", {}) if isinstance(t, dict) else {}
        rows.append(f"<tr><td>{E(str(task))}</td>" + "".join(_cell((m.get(n) or {}).get("gold")) for n in names)
                    + "".join(_cell((m.get(n) or {}).get("score_diff")) for n in others) + "</tr>")
    return "\n".join([*rows, "</table>"])


SAMPLE_SCORES = (("gold", "gold"), ("rm", "RM"), ("relevance", "relevance"), ("score", "score"))
"""per-response scores shown under each sample, in this order, to two decimals"""


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):  # chat messages: the last user turn
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else prompt)
    return str(prompt)


def _response_and_scores(row: dict, name: str) -> tuple[str, dict[str, float]]:
    """A checkpoint's response in an eval sample row (`name` -> text, `name/gold` -> score, ...), or the
    older form `name` -> {"response", "gold", ...}."""
    value = row.get(name)
    scores = {}
    if isinstance(value, dict):
        scores = {k: float(v) for k, v in value.items() if _is_num(v)}
        value = value.get("response", "")
    for key, _ in SAMPLE_SCORES:
        if _is_num(row.get(f"{name}/{key}")):
            scores[key] = float(row[f"{name}/{key}"])
    return ("" if value is None else str(value)), scores


def _scores_line(scores: dict[str, float]) -> str:
    shown = [f"{label} {scores[key]:.2f}" for key, label in SAMPLE_SCORES if key in scores]
    return f"<br><small>{' &middot; '.join(shown)}</small>" if shown else ""


def _short_name(name: str) -> str:
    """A checkpoint as a person names it: `runs/demo/ppo/model` -> `ppo`; other names unchanged."""
    parts = str(name).rstrip("/").split("/")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "model" and parts[-2] else str(name)


def _change_cell(delta: float | None) -> str:
    if delta is None:
        return "<td class=num>-</td>"
    cls = "worse" if delta < 0 else "better" if delta > 0 else ""
    return f'<td class="num {cls}">{delta:+.2f}</td>'


def _eval_samples_html(data: dict) -> str:
    """Each checkpoint against the baseline, prompt by prompt: both responses side by side with their scores
    (two decimals) and the change, the largest drop in the judge's score first (the cases to replay). Seeds and
    indices, needed only to replay a sample, sit in a folded table under it."""
    samples, ckpts = data.get("samples"), data.get("checkpoints")
    if not isinstance(samples, list):
        return ""
    rows = [s for s in samples if isinstance(s, dict)]
    names = list(ckpts) if isinstance(ckpts, dict) else []
    names = [n for n in names if any(n in r for r in rows)]
    if not rows or not names:
        return ""
    baseline = data.get("baseline") if data.get("baseline") in names else names[0]
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    judge = settings.get("judge")
    if judge not in ("gold", "rm"):
        found = {k for r in rows for n in names for k in _response_and_scores(r, n)[1]}
        judge = next((k for k in ("gold", "rm") if k in found), None)
    others = [n for n in names if n != baseline]
    if not others:  # one checkpoint: its answers alone
        body = "".join(
            f"<tr><td>{E(_prompt_text(r.get('prompt', '')))}</td><td>{E(text)}{_scores_line(sc)}</td></tr>"
            for r in rows[:MAX_SAMPLES] for text, sc in [_response_and_scores(r, baseline)]
        )
        return f'<table class="samples"><tr><th>prompt</th><th>{E(_short_name(baseline))}</th></tr>{body}</table>'
    blocks = []
    for other in others:
        pairs = []
        for r in rows:
            if other not in r or baseline not in r:
                continue
            (base_text, base_sc), (text, sc) = _response_and_scores(r, baseline), _response_and_scores(r, other)
            delta = sc[judge] - base_sc[judge] if judge in sc and judge in base_sc else None
            pairs.append((delta, r, base_text, base_sc, text, sc))
        pairs.sort(key=lambda p: (p[0] is None, p[0] if p[0] is not None else 0.0))  # worst change first
        shown = pairs[:MAX_SAMPLES]
        order = f"largest drop in {E(judge)} first" if judge else "in prompt order"
        head = (f"<tr><th>prompt</th><th>{E(_short_name(baseline))} <small>(baseline)</small></th>"
                f"<th>{E(_short_name(other))}</th>"
                f"<th>change{' in ' + E(judge) if judge else ''}</th></tr>")
        body = "".join(
            f"<tr><td>{E(_prompt_text(r.get('prompt', '')))}</td><td>{E(bt)}{_scores_line(bs)}</td>"
            f"<td>{E(t)}{_scores_line(sc)}</td>{_change_cell(d)}</tr>"
            for d, r, bt, bs, t, sc in shown
        )
        caption = (f'<p class=meta>{len(shown)} of {len(pairs)} prompts, {order}; every sample is in '
                   f"samples.jsonl</p>")
        blocks.append(f"{caption}<table class=\"samples\">{head}{body}</table>{_replay_html(shown)}")
    return "\n".join(blocks)


def _replay_html(shown) -> str:
    """The prompt index, sample number and seed of each row shown, folded away: what replaying a sample needs."""
    keys = [k for k in ("prompt_index", "sample", "seed") if any(k in p[1] for p in shown)]
    if not keys:
        return ""
    head = "<tr><th>row</th>" + "".join(f"<th>{E(k)}</th>" for k in keys) + "</tr>"
    body = "".join(
        f"<tr><td class=num>{i}</td>" + "".join(f"<td class=num>{_num(p[1].get(k, ''))}</td>" for k in keys) + "</tr>"
        for i, p in enumerate(shown, start=1)
    )
    return f"<details><summary>replay these samples</summary><table>{head}{body}</table></details>"


def _training_samples_html(rows: list[dict], stage: str) -> str:
    """The same prompts answered early and late in training, side by side.

    Prompts come back every epoch, so each prompt's first and latest answers are paired; the pairs whose gold
    (else proxy) score fell most come first, then those furthest apart in training. Without repeated prompts,
    the last step's answers. Scores to two decimals.
    """
    rows = [r for r in rows if "prompt" in r and "response" in r]
    if not rows:
        return ""

    def resp(r):
        extra = " &middot; ".join(f"{k} {r[k]:.2f}" for k in ("score", "gold", "relevance") if _is_num(r.get(k)))
        small = f"<br><small>step {E(str(r.get('step')))}{' &middot; ' + extra if extra else ''}</small>"
        return f"<td>{E(str(r.get('response', '')))}{small}</td>"

    def change(a, b):
        for k in ("gold", "score"):
            if _is_num(a.get(k)) and _is_num(b.get(k)):
                return b[k] - a[k]
        return None

    first: dict[str, dict] = {}
    latest: dict[str, dict] = {}
    for r in rows:
        key = str(r["prompt"])
        first.setdefault(key, r)
        latest[key] = r
    pairs = [(first[k], latest[k]) for k in first if latest[k].get("step") != first[k].get("step")]
    pairs.sort(key=lambda p: _step_gap(p[0], p[1]), reverse=True)
    pairs.sort(key=lambda p: (change(*p) is None, change(*p) or 0.0))  # stable: ties keep the gap order
    title = f"<h3>{E(stage)}: samples during training</h3>"
    if pairs:
        head = "<tr><th>prompt</th><th>early</th><th>late</th><th>change</th></tr>"
        body = "".join(
            f"<tr><td>{E(_prompt_text(a['prompt']))}</td>{resp(a)}{resp(b)}{_change_cell(change(a, b))}</tr>"
            for a, b in pairs[:MAX_SAMPLES]
        )
    else:
        last_step = rows[-1].get("step")
        last = [r for r in rows if r.get("step") == last_step][:MAX_SAMPLES]
        head = "<tr><th>prompt</th><th>response</th></tr>"
        body = "".join(f"<tr><td>{E(_prompt_text(r['prompt']))}</td>{resp(r)}</tr>" for r in last)
    return f'{title}<table class="samples">{head}{body}</table>'


def _step_gap(a: dict, b: dict) -> float:
    sa, sb = a.get("step"), b.get("step")
    return sb - sa if isinstance(sa, (int, float)) and isinstance(sb, (int, float)) else 0


# --------------------------------------------------------------------------- the page
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _stage_label(name: str, records: list[dict]) -> str:
    """A stage as the report names it: the algorithm its records say ran (a ppo stage that ran GRPO is `grpo`),
    else the stage's name; a later round's keeps its round (`ppo (round 2)` -> `grpo (round 2)`)."""
    algorithm = next((r["algorithm"] for r in records if isinstance(r.get("algorithm"), str)), None)
    stage, sep, rest = name.partition(" (round ")
    return (algorithm or stage) + sep + rest


ANNOTATED = "quartet annotate export"
"""what `quartet annotate --export` writes as `written_by` in the agreement file beside its pairs"""


def _annotators_html(dirs: list[tuple[str, Path]]) -> str:
    """People's agreement for each stage trained on pairs people ranked: the `<stem>.agreement.json` that
    `quartet annotate --export` wrote beside the pairs the stage's config names (data.path). Empty when none."""
    out = []
    for name, d in dirs:
        try:
            cfg = yaml.safe_load((d / "config.yaml").read_text(encoding="utf-8"))
            path = Path(cfg["data"]["path"])
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
        data, err = _read_json(path.with_name(f"{path.stem}.agreement.json"))
        if err or not isinstance(data, dict) or data.get("written_by") != ANNOTATED:
            continue
        people = data.get("people") or {}
        rows = [("rankings", data.get("judgments")), ("annotators", ", ".join(data.get("annotators") or [])),
                ("items ranked by 2+ people", people.get("items")),
                ("pairwise agreement", people.get("agreement")),
                (f"kappa ({people.get('kappa_kind') or '-'})", people.get("kappa"))]
        table = "".join(f"<tr><td>{E(k)}</td>{_cell(v)}</tr>" for k, v in rows)
        judge = "".join(
            f"<tr>{_cell(a.get('annotator'))}{_cell(a.get('pairs'))}{_cell(a.get('share'))}"
            f"{_cell({'mean': a.get('share'), 'lo': a.get('ci_low'), 'hi': a.get('ci_high')})}</tr>"
            for a in data.get("judge") or [])
        if judge:
            judge = ("<table><tr><th>annotator</th><th>strict pairs</th><th>agrees with the judge</th>"
                     f"<th>with its 95% CI</th></tr>{judge}</table>")
        out.append(f"<h3>{E(name)}: {E(str(path))}</h3><table>{table}</table>{judge}")
    return "".join(out)


def write_report(run_dir) -> Path:
    """Write ``run_dir/report.html`` (and ``run_dir/plots/*.png``) and return the HTML path."""
    run_dir = Path(run_dir)
    dirs = stage_dirs(run_dir)  # DataError when run_dir does not exist
    stages = [(_stage_label(name, records), d, records) for name, d in dirs for records in [read_metrics(d)]]
    dirs = [(name, d) for name, d, _ in stages]
    eval_files = [p for p in [run_dir / "eval" / "eval.json", run_dir / "eval.json"]
                  + [d / "eval" / "eval.json" for _, d in dirs if d != run_dir] if p.is_file()]
    sample_files = [(name, d / "samples.jsonl") for name, d in dirs if (d / "samples.jsonl").is_file()]
    if (run_dir / "samples.jsonl").is_file() and all(d != run_dir for _, d in dirs):
        sample_files.insert(0, (run_dir.name, run_dir / "samples.jsonl"))
    if not stages and not eval_files and not sample_files:
        raise DataError(f"{run_dir}: nothing to report (no metrics.jsonl, eval/eval.json or samples.jsonl)")

    findings: list[Finding] = []
    per_stage_findings = {}
    short = unjudged_stages([(name, records) for name, _d, records in stages])
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
            drawn = [(chart, _plot(records, chart, per_stage_findings[name])) for chart in CHARTS]
            drawn.append((OVEROPTIMIZATION_CHART, _plot_overoptimization(records)))
            for chart, png in drawn:
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
            table = _eval_samples_html(data)
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
        _findings_html(findings, short),
        _summary_html([(name, records) for name, _, records in stages]),
    ]
    annotators = _annotators_html(dirs)
    if annotators:
        parts += ['<h2 id="annotators">People\'s agreement</h2>', annotators]
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
