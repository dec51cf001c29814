"""Every setting of a stage, read from the docstring under each field in the config dataclasses.

    quartet config ppo                                 # each field: type, default, docstring
    quartet config ppo --write ppo.yaml                # a commented starter that `quartet ppo -c ppo.yaml` loads as is
    python -m quartet.config_doc --markdown docs/config.md   # the reference page (a test fails when it is stale)

The docstrings in quartet.config (and quartet.pipeline for `quartet run`) are the one source: nothing here repeats
them, so a field documented there is documented everywhere.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from quartet.atomic import atomic_write_text
from quartet.config import (
    PPO_PRESETS,
    DPOConfig,
    LabelConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    TrackingConfig,
    from_dict,
)
from quartet.errors import ConfigError
from quartet.pipeline import PipelineConfig, wire

STAGES: dict[str, type] = {
    "sft": SFTConfig, "label": LabelConfig, "rm": RewardConfig, "ppo": PPOConfig, "grpo": PPOConfig,
    "rloo": PPOConfig, "dpo": DPOConfig, "run": PipelineConfig,
}
"""the commands that read a YAML config (`quartet <stage> -c FILE`, `quartet run FILE`) and the class it fills;
grpo and rloo are ppo with the defaults of PPO_PRESETS"""

REGENERATE = "python -m quartet.config_doc --markdown docs/config.md"

HEADER = """\
# Configuration reference

Every stage reads a YAML file into its config (`quartet <stage> -c FILE`, `quartet run FILE`), and any field can
be set on the command line as `key.sub=value` (the value is read as YAML). Unknown keys are refused with a
suggestion. `quartet config <stage>` prints the same tables in a terminal, and `quartet config <stage> --write
FILE` writes a commented starter config holding every default.

This page is generated from the docstrings under each field in `src/quartet/config/` and
`src/quartet/pipeline.py`: edit those and run `{regenerate}`, never this page.
"""


@dataclass(frozen=True)
class Setting:
    name: str
    """dotted path from the stage's root, e.g. optim.lr"""
    type: str
    """the annotation as written in the source, e.g. float | None"""
    default: Any
    """the stage's default (a preset's where the stage has one)"""
    doc: str
    """the field's docstring, whitespace collapsed to one paragraph"""
    section: bool
    """a sub-config: its own fields follow as <name>.*"""
    wired: bool
    """`quartet run` fills it from the other stages when its file leaves it out (quartet.pipeline.wire)"""


# --------------------------------------------------------------------------- reading the dataclasses
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of dataclass ``cls``: the string literal right after each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def default_config(stage: str):
    """The config `quartet <stage>` builds from an empty file (`quartet run`: before the stages are wired), before
    validation fills in the defaults that follow other settings: those show as null, as a user leaves them (a
    starter file holding 1e-5 for optim.lr would keep it when LoRA is turned on)."""
    if stage == "run":
        return PipelineConfig()
    return from_dict(STAGES[stage], PPO_PRESETS.get(stage) or {})


def settings(stage: str) -> list[Setting]:
    """Every field of ``stage``'s config, sub-configs followed by their fields, in the order of the source."""
    _check_stage(stage)
    wired = wired_fields() if stage == "run" else set()
    out: list[Setting] = []

    def walk(cfg, prefix: str) -> None:
        docs = field_docs(type(cfg))
        for f in dataclasses.fields(cfg):
            value, name = getattr(cfg, f.name), prefix + f.name
            section = dataclasses.is_dataclass(value)
            is_wired = name in wired or (section and all(
                w in wired for w in _leaves(value, name + ".")))
            out.append(Setting(name, f.type if isinstance(f.type, str) else f.type.__name__,
                               None if section else value, docs.get(f.name, ""), section, is_wired))
            if section:
                walk(value, name + ".")

    walk(default_config(stage), "")
    return out


def _leaves(cfg, prefix: str) -> list[str]:
    names = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        names += _leaves(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return names


@functools.cache
def wired_fields() -> frozenset[str]:
    """The fields `quartet run` fills from other settings when its file leaves them out, found by running
    `wire` on configs whose every setting it reads from (task, output_dir, tracking) differs from the defaults:
    a field it changes is one it fills. Written into a starter file, such a field would stop being filled."""
    probes = [
        PipelineConfig(output_dir="wired-probe"),  # the default task: its relevance judge is wired too
        PipelineConfig(output_dir="wired-probe", task="wired-probe",
                       tracking=TrackingConfig(report_to=[], project="p", experiment="p", tracking_uri="p")),
    ]
    found = set()
    for probe in probes:
        before = _flat(copy.deepcopy(probe))
        after = _flat(wire(probe, {}))
        found |= {name for name in before if before[name] != after.get(name, _SECTION)}
        # a null sub-config wire filled (rm.normalize_prompts) shows up as new dotted names below it
        found |= {next(p for p in before if name.startswith(p + ".")) for name in after.keys() - before.keys()}
    return frozenset(found)


_SECTION = object()
"""the value of a name that `wire` turned from null into a sub-config"""


def _flat(cfg, prefix: str = "") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out.update(_flat(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name: value})
    return out


def _notes(items: list[Setting]) -> list[str]:
    """Each setting's docstring, with the note that `quartet run` fills it where it does: said once, on the
    outermost setting filled whole."""
    whole = {s.name for s in items if s.section and s.wired}
    return [s.doc + (f" [{WIRED_NOTE}]" if s.wired and s.name.rpartition(".")[0] not in whole else "")
            for s in items]


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"config: unknown stage {stage!r} (stages with a config: {', '.join(STAGES)})")


def _inline(value) -> str:
    """``value`` as one line of YAML (flow style, quoted where YAML needs it)."""
    return yaml.safe_dump([value], default_flow_style=True, width=sys.maxsize).strip()[1:-1]


def _command(stage: str) -> str:
    return "quartet run FILE" if stage == "run" else f"quartet {stage} -c FILE"


WIRED_NOTE = "`quartet run` fills it (from task, output_dir, tracking or an earlier stage) unless set here"


# --------------------------------------------------------------------------- the three outputs
def describe(stage: str, width: int = 100) -> str:
    """The text `quartet config <stage>` prints: each field with its type, default and docstring."""
    lines = [f"{_command(stage)} reads these settings; `key.sub=value` after it sets any of them.",
             f"`quartet config {stage} --write FILE` writes them as a commented starter file.", ""]
    items = settings(stage)
    for s, doc in zip(items, _notes(items)):
        head = f"{s.name}: {s.type}" + ("" if s.section else f" = {_inline(s.default)}")
        lines.append(head)
        lines += textwrap.wrap(doc, width, initial_indent="    ", subsequent_indent="    ") if doc else []
    return "\n".join(lines) + "\n"


def starter_yaml(stage: str, width: int = 100) -> str:
    """A config file holding every field at its default, each under its docstring as a comment; `quartet <stage>
    -c` (or `quartet run`) loads it as the defaults. For `quartet run` the fields it wires from the other stages
    are left commented out, so they stay wired."""
    lines = [f"# quartet {stage}: every setting at its default (written by `quartet config {stage} --write`).",
             f"# Load it with `{_command(stage)}`; delete what you do not change.", ""]
    items = settings(stage)
    for s, doc in zip(items, _notes(items)):
        depth = s.name.count(".")
        indent, key = "  " * depth, s.name.rsplit(".", 1)[-1]
        if depth == 0 and len(lines) > 3:
            lines.append("")
        lines += textwrap.wrap(doc, width - len(indent), initial_indent=f"{indent}# ",
                               subsequent_indent=f"{indent}# ") if doc else []
        off = "# " if s.wired else ""
        lines.append(f"{indent}{off}{key}:" if s.section else f"{indent}{off}{key}: {_inline(s.default)}")
    return "\n".join(lines) + "\n"


def write_starter(stage: str, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``starter_yaml(stage)`` to ``path``; an existing file is kept unless ``overwrite``."""
    text = starter_yaml(stage)  # built first: a failure leaves no file
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; name a file to write the {stage} config to")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise ConfigError(f"{path}: already exists; pass --overwrite to replace it, or name another file")
    return atomic_write_text(path, text)


def markdown() -> str:
    """docs/config.md: one table per stage config; grpo and rloo as their presets over ppo, `quartet run` by its
    own fields and a pointer to each stage's table."""
    out = [HEADER.format(regenerate=REGENERATE)]
    for stage in STAGES:
        if stage in PPO_PRESETS and stage != "ppo":
            continue
        out += [f"## `{stage}`", "", f"`{_command(stage)}`; a starter file: `quartet config {stage} --write FILE`."]
        if stage == "ppo":
            out.append("`quartet grpo` and `quartet rloo` take the same settings with the defaults below this table.")
        out += ["", "| setting | type | default | description |", "|---|---|---|---|"]
        items = settings(stage)
        stage_sections = {s.name for s in items if stage == "run" and s.name in STAGES}
        for s, doc in zip(items, _notes(items)):
            if s.name.split(".")[0] in stage_sections and s.name not in stage_sections:
                continue  # documented in that stage's own table
            if s.name in stage_sections:
                inner = [i.name.split(".", 1)[1] for i, note in zip(items, _notes(items))
                         if i.name.startswith(s.name + ".") and note.endswith(f"[{WIRED_NOTE}]")]
                doc = (f"{s.doc}. Its fields are those of [`quartet {s.name}`](#{s.name}); `quartet run` fills these "
                       f"unless set here: " + ", ".join(f"`{w}`" for w in inner))
            name = f"**`{s.name}`**" if s.section else f"`{s.name}`"
            default = "" if s.section else f"`{_cell(_inline(s.default))}`"
            out.append(f"| {name} | `{_cell(s.type)}` | {default} | {_cell(doc)} |")
        out.append("")
        if stage == "ppo":
            out += _presets_table()
    return "\n".join(out)


def _presets_table() -> list[str]:
    docs = field_docs(PPOConfig)
    out = []
    for name, preset in PPO_PRESETS.items():
        if not preset:
            continue
        out += [f"### `{name}`", "", f"`quartet {name}`: `quartet ppo` with these defaults (a file or override "
                f"still sets any of them). A starter file: `quartet config {name} --write FILE`.", "",
                "| setting | default | description |", "|---|---|---|"]
        out += [f"| `{key}` | `{_cell(_inline(value))}` | {_cell(docs.get(key, ''))} |" for key, value in preset.items()]
        out.append("")
    return out


def _cell(text: str) -> str:
    """``text`` for a table cell: pipes escaped, and `<name>` outside code spans kept from reading as HTML."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part.replace("<", "&lt;") if i % 2 == 0 else part for i, part in enumerate(parts))


# --------------------------------------------------------------------------- entry points
def cli(args) -> int:
    if args.write:
        path = write_starter(args.stage, args.write, overwrite=args.overwrite)
        print(f"wrote {path}: every {args.stage} setting at its default; load it with "
              f"`{_command(args.stage).replace('FILE', str(path))}`")
    else:
        print(describe(args.stage), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quartet.config_doc", description="write docs/config.md")
    parser.add_argument("--markdown", nargs="?", const="-", required=True, metavar="FILE",
                        help="write the configuration reference to FILE (default: standard output)")
    args = parser.parse_args(argv)
    text = markdown()
    if args.markdown == "-":
        sys.stdout.write(text)
    else:
        atomic_write_text(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
