"""`quartet` command line: one subcommand per pipeline stage plus the tools that watch them.

Every stage takes `-c CONFIG.yaml` and any number of `key.sub=value` overrides. User errors are printed
as one line (`error: ...`) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import re
import signal
import sys

from quartet.allocator import retain_freed_memory
from quartet.atomic import write_failure
from quartet.errors import QuartetError
from quartet.quiet import quiet_third_party

STAGES = {
    # name: (module:function, help)
    "sft": ("quartet.trainers.sft:cli", "stage 1: supervised fine-tuning on demonstrations (the Reference)"),
    "label": ("quartet.trainers.label:cli", "stage 2: AI feedback: sample K answers, a judge picks chosen/rejected"),
    "rm": ("quartet.trainers.reward:cli", "stage 3: train a Bradley-Terry reward model on preference pairs"),
    "ppo": ("quartet.trainers.ppo:cli", "stage 4: PPO with Actor, Critic, Reference and Reward"),
    "grpo": ("quartet.trainers.ppo:cli", "stage 4 with GRPO's defaults: group-normalised advantages, no critic"),
    "rloo": ("quartet.trainers.ppo:cli", "stage 4 with RLOO's defaults: leave-one-out baseline, no critic"),
    "dpo": ("quartet.trainers.dpo:cli", "stages 3+4 offline: DPO (or IPO, SLiC, SimPO) on preference pairs"),
    "run": ("quartet.pipeline:cli", "run a whole pipeline config: sft -> label -> rm -> ppo -> eval -> report"),
    "eval": ("quartet.eval.evaluate:cli", "evaluate checkpoints: gold/RM score, KL, length, diversity, win rate"),
    "report": ("quartet.monitor.report:cli", "write a self-contained HTML report for a run directory"),
    "doctor": ("quartet.monitor.doctor:cli", "diagnose a run from its metrics: symptoms, causes, fixes"),
    "annotate": ("quartet.annotate.command:cli", "people rank a samples file's answers in the browser; --export: "
                 "their rankings as preference pairs"),
    "tasks": ("quartet.tasks:cli", "list the built-in tasks"),
    "config": ("quartet.config_doc:cli", "every setting of a stage with its default and docstring; --write FILE: a "
               "commented starter config"),
}

TRAINING_STAGES = ("sft", "label", "rm", "ppo", "grpo", "rloo", "dpo")
OVERWRITE_HELP = ("write into an output folder that holds other files, beside them (refused if one is at a path the "
                  "stage writes: a file Quartet did not write is never replaced)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quartet",
        description="RLHF the InstructGPT way, visible on a laptop CPU: SFT -> preferences -> reward model -> PPO.",
    )
    parser.add_argument("--version", action="version", version=f"quartet {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log debug details, and show the warnings and progress bars of the libraries underneath "
                             "(transformers, peft, accelerate, torch)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in TRAINING_STAGES:
            p.add_argument("-c", "--config", help="YAML config file")
            p.add_argument("overrides", nargs="*", metavar="key=value", help="override any config field")
            p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
            if name in ("ppo", "grpo", "rloo"):
                p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
        elif name == "run":
            p.add_argument("config", help="pipeline YAML (see configs/demo.yaml)")
            p.add_argument("overrides", nargs="*", metavar="key=value", help="override any pipeline field")
            p.add_argument("--force", action="store_true", help="re-run stages whose output already exists")
        elif name == "eval":
            p.add_argument("checkpoints", nargs="+", help="model names or directories to evaluate")
            p.add_argument("--baseline", help="checkpoint the others are compared with (default: the first)")
            p.add_argument("--prompts", default="task:positive-review/eval", help="prompt set")
            p.add_argument("--task", help="task whose gold judge scores responses (default: from --prompts)")
            p.add_argument("--reward-model", help="reward model dir for the RM score")
            p.add_argument("--relevance", default="auto",
                           help="on-task judge spec for the relevance score (default auto: the task's, else "
                                "judge:relevance; none: not measured)")
            p.add_argument("--reference", help="reference model for KL (default: the baseline)")
            p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
            p.add_argument("--max-new-tokens", type=int, default=48)
            p.add_argument("--temperature", type=float, default=0.7)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--batch-size", type=int, default=16, metavar="N",
                           help="prompts decoded together (default 16; the results do not depend on it)")
            p.add_argument("--samples-per-prompt", type=int, default=1, metavar="N",
                           help="responses sampled per prompt (default 1); for a right/wrong gold judge, pass@k for "
                                "k up to N")
            p.add_argument("--kl-samples-per-prompt", type=int, default=None, metavar="N",
                           help="measure the KL to the reference on each prompt's first N samples only (default: "
                                "all; its float32 forwards cost ~2.5x the sampling)")
            p.add_argument("--extra-tasks", type=_names, default=None, metavar="TASK,TASK",
                           help="built-in tasks each checkpoint is also evaluated on, with their eval split and gold "
                                "judge (the alignment tax), e.g. constraints,arithmetic")
            p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                           help="what samples the responses: hf (exact, replayable here) or vllm (the vllm extra: "
                                "one engine for all checkpoints, which must share one architecture)")
            p.add_argument("--judge-timeout", type=_seconds_or_none, default=argparse.SUPPRESS,
                           help="seconds one call of a module:function judge may take (default 600; none: no bound)")
            p.add_argument("--bad-cases", type=int, default=argparse.SUPPRESS, metavar="N",
                           help="prompts written to OUT/bad_cases.jsonl for the next round of feedback (default 32; "
                                "0: none)")
            p.add_argument("--judge", metavar="llm:MODEL", default=None,
                           help="a language model judging each checkpoint's responses against the baseline's, both "
                                "orders: judge win rate, position bias, ties (a model dir, .gguf, "
                                "smollm2-135m-instruct; with --judge-base-url, the server's model name)")
            p.add_argument("--judge-rubric", default=None,
                           help="the judge's principles: text, or a .txt/.md file of one per line (default: the "
                                "task's, else a generic one)")
            p.add_argument("--judge-mode", choices=("pairwise", "pointwise"), default="pairwise",
                           help="pairwise: A or B? (default); pointwise: each response rated 1-9 alone")
            p.add_argument("--judge-orders", choices=("agree", "average"), default="agree",
                           help="a pair's two orders: agree = a win only when both orders pick it (default); "
                                "average = their mean log-odds decides (for a judge with a strong position bias)")
            p.add_argument("--judge-base-url", default=None,
                           help="an OpenAI-compatible server's API root for the judge, e.g. http://127.0.0.1:8000/v1")
            p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY",
                           help="environment variable holding that server's key (default OPENAI_API_KEY)")
            p.add_argument("--out", required=True, help="output directory (eval/eval.json, samples)")
            p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
        elif name == "config":
            p.add_argument("stage", choices=(*TRAINING_STAGES, "run"), help="the command whose settings to show")
            p.add_argument("--write", metavar="FILE", help="write a starter YAML: every setting at its default, "
                                                           "under its docstring")
            p.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
        elif name == "annotate":
            p.add_argument("samples", nargs="?", help="samples file to rank (what `quartet label` writes beside its "
                                                      "pairs: <stem>.samples.jsonl); not needed with --export")
            p.add_argument("--out", required=True, help="folder of the judgments (judgments.jsonl, items.jsonl); "
                                                        "created, and resumed when it exists")
            p.add_argument("--per-item", type=int, default=1, metavar="N",
                           help="people who rank each item (2+: agreement between them; default 1)")
            p.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1; any other needs the printed token)")
            p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
            p.add_argument("--token", default=None,
                           help="access token every request must carry (default: none on loopback, a random one "
                                "printed in the URL otherwise)")
            p.add_argument("--export", metavar="FILE", default=None,
                           help="write the rankings in --out as preference pairs to FILE (for quartet rm / dpo) "
                                "instead of serving")
            p.add_argument("--judge", metavar="SPEC", default=None,
                           help="with --export: each person's agreement with this judge (a reward spec such as "
                                "task:positive-review, or a reward-model dir); default: the samples' score column")
            p.add_argument("--judge-timeout", type=_seconds_or_none, default=argparse.SUPPRESS,
                           help="seconds one call of a module:function judge may take (default 600; none: no bound)")
            p.add_argument("--majority", action="store_true",
                           help="with --export: one pair per answer pair, in the order most of the item's people "
                                "gave (default: every person's pairs)")
        elif name in ("report", "doctor"):
            p.add_argument("run_dir", help="a run directory (or a pipeline directory of runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may also follow a flag (`quartet ppo -c x.yaml --resume iterations=40`)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
        "=" in x and not x.startswith("-") for x in extra
    ):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.command:
        parser.print_help()
        return 0
    target, _ = STAGES[args.command]
    module_name, func_name = target.split(":")
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        # every stage: freed memory is kept for the next step, not faulted in again; and tensors of 2 MB and more on
        # huge pages, which needs torch's first allocation to come after it: before the stage's modules load (peft
        # allocates tensors when it is imported)
        retain_freed_memory()
        # every stage's module ships with the package: an ImportError here is a bug to see whole, not a message
        func = getattr(importlib.import_module(module_name), func_name)
        quiet_third_party(args.verbose)  # after the import: the stage's modules are loaded, so this costs nothing
        return int(func(args) or 0)
    except QuartetError as e:
        print(f"error: {capped(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk met outside quartet.atomic's writers (which name their output themselves)
        reason = write_failure(e)
        if reason is None:
            raise
        print(f"error: cannot write {e.filename or 'an output'}: {reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial output was kept; a PPO run resumes with --resume", file=sys.stderr)
        return 130
    except RuntimeError as e:  # torch.distributed's errors are RuntimeErrors
        lost = lost_peer(e)
        if lost is None:
            raise
        print(f"error: {capped(lost)}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        leave_process_group()


MAX_ERROR_CHARS = 2000
"""an error line longer than this is cut: a message quoting a hostile value (a huge override, a long row) must
not flood the terminal, and the place it names comes first"""


def capped(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message``, or its first ``limit`` characters and a note of how many were cut."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]} ... [{len(message) - limit} more characters cut]"


def leave_process_group() -> None:
    """End this process's part in a multi-process run (`accelerate launch`): the stages of one command share the
    process group, so it is left once, when the command ends. A process that exited still in it could abort in
    the group's destructor ("terminate called without an active exception", seen once in a 2-process test)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def lost_peer(e: BaseException) -> str | None:
    """What to say when a multi-process run lost a peer: `e` came from the network under the process group (a
    connection a peer's kernel closed when its process died, or a collective that waited QUARTET_DIST_TIMEOUT for a
    silent one). None for anything else, a bug to see whole. Names the peer by rank (2 processes: the other one) and
    by the address the transport reports."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    text = str(e)
    if not (isinstance(e, getattr(dist, "DistNetworkError", ())) or "/gloo/transport/" in text):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    address = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", text)
    waited = re.search(r"Timed out waiting (\d+)ms", text)
    peer = f"rank {1 - rank}" if world == 2 else "a peer"
    if address:
        peer += f" (at {address.group(1)})"
    elif world == 2 and rank == 1 and os.environ.get("MASTER_ADDR"):
        peer += f" (at {os.environ['MASTER_ADDR']})"
    if waited:
        why = (f"it did not answer within {int(waited.group(1)) / 1000:g} s (QUARTET_DIST_TIMEOUT): its host is "
               f"silent or its process stuck")
    else:
        first = re.sub(r"^\[[^\]]*\] ", "", text.strip().splitlines()[0]).split(". ")[0]  # gloo: "[pair.cc:537] ..."
        why = f"its connection failed ({first}): its process or host is gone"
    return (f"lost {peer} of this {world}-process run: {why}. Rank {rank} stops too; what was saved is intact: "
            f"start the run again on every host (ppo, grpo, rloo: with --resume, from the newest checkpoint)")


def _names(value: str) -> list[str]:
    """--extra-tasks: comma-separated names."""
    return [name.strip() for name in value.split(",") if name.strip()]


def _seconds_or_none(text: str) -> float | None:
    """--judge-timeout: a number of seconds, or "none" for no bound (the range is checked with the other settings)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds or none, got {text!r}") from None


def _terminate(signum, frame):
    """SIGTERM unwinds like Ctrl-C, so every atomic writer removes its temporary files on the way out."""
    raise KeyboardInterrupt


def _version() -> str:
    return importlib.metadata.version("quartet")  # the installed distribution's (pyproject.toml)


if __name__ == "__main__":
    sys.exit(main())
