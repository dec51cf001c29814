"""`quartet annotate`: serve a samples file for people to rank, or (--export) turn their rankings into pairs.

    quartet annotate runs/label/pairs.samples.jsonl --out runs/annotate [--per-item 2] [--host H] [--port P]
    quartet annotate --out runs/annotate --export runs/annotate/prefs.jsonl

The server needs the annotate extra (fastapi, uvicorn); without it the command says how to install it rather than
failing on an import. Stop it with Ctrl-C: every judgment the page showed as saved is already on disk.
"""

from __future__ import annotations

import importlib.util
import sys

from quartet.annotate.items import load_items
from quartet.annotate.store import LOG, Store
from quartet.errors import ConfigError

MIN_TOKEN = 16


def cli(args) -> int:
    if args.export:
        from quartet.annotate import export

        return export.cli(args)
    if not args.samples:
        raise ConfigError("annotate: give the samples file to serve (quartet annotate SAMPLES.jsonl --out DIR), "
                          "or --export FILE to write the pairs of DIR")
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"annotate: the server needs {' and '.join(missing)}: pip install 'quartet[annotate]'")
    if args.token is not None and len(args.token) < MIN_TOKEN:
        raise ConfigError(f"annotate --token: at least {MIN_TOKEN} characters (or leave it out: a random one is made "
                          f"when --host is not loopback)")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"annotate --port: 0..65535 (0: any free port), got {args.port}")
    from quartet.annotate import server

    items = load_items(args.samples)
    with Store(args.out, items, per_item=args.per_item) as store:
        done = store.progress()
        print(f"annotate: {len(items)} items from {args.samples} ({sum(len(it.answers) for it in items)} answers), "
              f"{args.per_item} judgment(s) each; {done['judgments']} already in {store.path}", flush=True)

        def announce(url: str) -> None:
            print(f"annotate: open {url}  (Ctrl-C stops; every judgment the page saved is on disk)", flush=True)

        try:
            server.serve(store, args.host, args.port, args.token, announce)
        except KeyboardInterrupt:
            pass
        done = store.progress()
    print(f"annotate: stopped; {done['judgments']} judgments in {args.out}/{LOG}; next: quartet annotate --out "
          f"{args.out} --export {args.out}/prefs.jsonl", file=sys.stderr)
    return 0
