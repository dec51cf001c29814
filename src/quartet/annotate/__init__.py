"""People's feedback: `quartet annotate` serves a samples file's answers to rank in the browser (server.py, static/),
keeps every judgment in an append-only log (store.py), and exports the rankings as preference pairs (export.py) with
the agreement between people and with the AI judge (agreement.py)."""
