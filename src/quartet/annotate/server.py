"""The HTTP side of `quartet annotate`: the page (static/, plain HTML/JS/CSS, nothing from the internet) and a small
JSON API over one Store, served by uvicorn from the command itself.

    GET  /                          the page
    GET  /api/next?annotator=NAME   the item NAME judges next (held for them a few minutes) and the progress
    POST /api/judge                 {"annotator", "item", "ranking": [[0], [2, 3], [1]], "flags": {"1": "reason"}}
    POST /api/skip                  {"annotator", "item"}
    POST /api/undo                  {"annotator"}: takes back NAME's newest judgment or skip
    GET  /api/progress?annotator=   counts
    GET  /api/agreement             agreement between people (and with the samples' scores) so far

A write is answered only after it is on disk (Store), so the page moves on only when nothing can lose it. A request
the server cannot take gets a 4xx with {"error": "..."}: a body that is not the documented shape (422), an unknown
item (404), a judgment given twice (409), a body over MAX_BODY bytes (413), a missing token (401); never a traceback.

Who may call it: bound to loopback, only this machine's browsers, and the Host header must name loopback too (a web
page elsewhere cannot reach the server by pointing its own DNS name at 127.0.0.1, "DNS rebinding"); bodies must be
JSON, which a cross-site form cannot send without the browser asking first. On any other address every API call needs
the token printed in the URL (header X-Quartet-Token or ?token=), compared in constant time.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

import uvicorn
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException

from quartet.annotate import agreement
from quartet.annotate.items import Item
from quartet.annotate.store import MAX_NAME, MAX_REASON, Refused, Store
from quartet.errors import ConfigError, QuartetError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
MAX_BODY = 64 * 1024
"""bytes a request body may have: a ranking with reasons for 100 answers is a few KB"""
MAX_ANSWERS = 100
LOOPBACK_NAMES = ("localhost",)
HEADERS = {
    # the page's own files only: even an answer that reached the DOM as markup could not run a script
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token is in the page's URL
    "Cache-Control": "no-store",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    annotator: str = Field(min_length=1, max_length=MAX_NAME)


class UndoBody(_Body):
    pass


class SkipBody(_Body):
    item: str = Field(min_length=1, max_length=64)


class JudgeBody(SkipBody):
    ranking: list[list[StrictInt]] = Field(max_length=MAX_ANSWERS)
    flags: dict[str, str] = Field(default_factory=dict, max_length=MAX_ANSWERS)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_app(store: Store, token: str | None = None, loopback: bool = True) -> FastAPI:
    """The app serving `store`. `token`: every /api/ call must carry it; `loopback`: refuse a Host header that does
    not name this machine (the server is bound to loopback)."""
    app = FastAPI(title="quartet annotate", docs_url=None, redoc_url=None, openapi_url=None)
    positions = {it.id: n for n, it in enumerate(store.items, 1)}

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/api/next")
    def next_item(annotator: str = Query(min_length=1, max_length=MAX_NAME)):
        item = store.next(annotator)
        shown = None if item is None else _item(item, positions[item.id])
        return {"item": shown, "progress": store.progress(annotator)}

    @app.post("/api/judge")
    def judge(body: JudgeBody):
        j = store.judge(body.annotator, body.item, body.ranking, body.flags)
        return {"saved": j.id, "item": j.item, "progress": store.progress(body.annotator)}

    @app.post("/api/skip")
    def skip(body: SkipBody):
        j = store.skip(body.annotator, body.item)
        return {"saved": j.id, "item": j.item, "progress": store.progress(body.annotator)}

    @app.post("/api/undo")
    def undo(body: UndoBody):
        j = store.undo(body.annotator)
        undone = j.to_json()
        undone["ranking"] = [list(g) for g in j.ranking]
        undone["flags"] = {str(k): v for k, v in j.flags.items()}
        return {"undone": undone, "progress": store.progress(body.annotator)}

    @app.get("/api/progress")
    def progress(annotator: str | None = Query(default=None, max_length=MAX_NAME)):
        return store.progress(annotator)

    @app.get("/api/agreement")
    def agreement_so_far():
        return agreement.summary(store.items, store.judgments())

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(Refused)
    def refused(request, e: Refused):
        return _error(e.status, str(e))

    @app.exception_handler(QuartetError)
    def quartet_error(request, e: QuartetError):
        return _error(400, str(e))

    @app.exception_handler(RequestValidationError)
    def invalid(request, e: RequestValidationError):
        return _error(422, "; ".join(_where(err) for err in e.errors()[:5]))

    @app.exception_handler(HTTPException)
    def http_error(request, e: HTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    def crashed(request, e: Exception):
        log.exception("annotate: %s %s failed", request.method, request.url.path)
        return _error(500, f"the server failed on this request ({type(e).__name__}); see its console")

    return Guard(app, token, loopback)


class Guard:
    """ASGI wrapper run before the app: the Host check, the token, the body size cap, and the security headers."""

    def __init__(self, app, token: str | None, loopback: bool):
        self.app, self.token, self.loopback = app, token, loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback and not is_loopback(_hostname(headers.get("host", ""))):
            return await _send(send, 403, "this server answers only on 127.0.0.1 / localhost")
        if self.token and scope["path"].startswith("/api/"):
            given = headers.get("x-quartet-token") or _query_token(scope.get("query_string", b""))
            if not given or not secrets.compare_digest(given.encode(), self.token.encode()):
                return await _send(send, 401, "the access token is missing or wrong: open the URL the command "
                                              "printed (it ends with ?token=...)")
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY:
            return await _send(send, 413, f"request body over {MAX_BODY} bytes")
        body, more = b"", True
        while more:  # read whole (it is small) so a body without a length is capped too
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_BODY:
                return await _send(send, 413, f"request body over {MAX_BODY} bytes")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def with_headers(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [
                    (k.lower().encode(), v.encode()) for k, v in HEADERS.items()]
            await send(message)

        await self.app(scope, replay, with_headers)


def serve(store: Store, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          announce: Callable[[str], None] = print) -> None:
    """Bind `host:port` (0: any free port), announce the page's URL with the real port, serve until interrupted."""
    loopback = is_loopback(host)
    if not loopback and not token:
        token = secrets.token_urlsafe(24)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)  # before the URL is shown: a browser opening it at once waits in the queue, not refused
    except OSError as e:
        sock.close()
        raise ConfigError(f"annotate --host/--port: cannot listen on {host}:{port}: {e.strerror}") from None
    real_port = sock.getsockname()[1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    shown = f"[{shown}]" if ":" in shown else shown
    announce(f"http://{shown}:{real_port}/" + (f"?token={token}" if token else ""))
    config = uvicorn.Config(make_app(store, token, loopback), log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])


def _item(item: Item, position: int) -> dict:
    return {"id": item.id, "prompt": item.prompt, "answers": list(item.answers), "position": position,
            "reason_max": MAX_REASON}


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _query_token(query: bytes) -> str | None:
    values = parse_qs(query.decode("latin-1")).get("token")
    return values[0] if values else None


def _where(err: dict) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
    return f"{loc}: {err.get('msg', 'invalid')}"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _send(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *((k.lower().encode(), v.encode()) for k, v in HEADERS.items())]})
    await send({"type": "http.response.body", "body": body})
