"""The HTTP layer: OpenAI-compatible endpoints over an :class:`~attnmask.serve.loop.EngineLoop`.

>>> app = create_app(EngineLoop(engine), tokenizer, chat_template, "smollm2")
>>> uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize`` (a prompt, or chat
messages through the template) and ``POST /detokenize``. The app only translates: text in and out through
the tokenizer and chat template, requests to the engine loop, events to OpenAI's JSON; it never
touches a tensor. A client's mistake is a 4xx with OpenAI's error object, never a 500; a client
that goes away (streaming or not) has its request cancelled, which frees its cache blocks.

With an ``api_key``, the API (``/v1/...``, ``/tokenize``, ``/detokenize``) answers only requests that
carry ``Authorization: Bearer <key>`` (what OpenAI's clients send); others get a 401 with OpenAI's
error object. ``/health`` and ``/metrics`` stay open, for probes and scrapers, as in vLLM.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from attnmask.errors import UserError
from attnmask.serve.loop import EngineFailed, EngineLoop, RequestStream, ServerClosed
from attnmask.serve.metrics import CONTENT_TYPE, ServerMetrics
from attnmask.serve.protocol import (
    ApiError,
    Generation,
    chat_prompt,
    check_model,
    choices_of,
    parse_chat,
    parse_completions,
    with_choices,
)
from attnmask.serve.responses import Piece, Shape
from attnmask.serve.text import TextStream
from attnmask.serve.tools import ToolStream

__all__ = ["create_app"]

log = logging.getLogger("attnmask.serve")


class _EventStream(StreamingResponse):
    """Server-sent events whose requests (one a prompt) are cancelled however the response ends (the
    client gone mid-stream, or before the first byte)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], on_cancel):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams, self.on_cancel = streams, on_cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            _close(self.streams, self.on_cancel)


def _close(streams: list[RequestStream], on_cancel) -> None:
    """Stop listening to ``streams``; those not finished are cancelled (and counted)."""
    for stream in streams:
        if not stream.finished:
            on_cancel()
        stream.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _most_likely(answers: list[list[Piece]], best_of: int, n: int) -> list[list[Piece]]:
    """Of each prompt's ``best_of`` answers (consecutive in ``answers``), the ``n`` with the highest
    log-probability per generated token (OpenAI's ``best_of``), most likely first; ties: the first."""
    out = []
    for start in range(0, len(answers), best_of):
        group = answers[start : start + best_of]
        score = lambda pieces: sum(p.logprob for p in pieces) / max(1, sum(p.generated for p in pieces))  # noqa: E731
        out += sorted(group, key=lambda pieces: -score(pieces))[:n]
    return out


class _RequireKey:
    """ASGI middleware: the API's paths need ``Authorization: Bearer <key>``; a 401 otherwise."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str, on_reject):
        self.app, self.key, self.on_reject = app, key.encode(), on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "no API key given: send 'Authorization: Bearer <key>'" if not given else "the API key is not valid"
        err = ApiError(401, message, code="invalid_api_key")
        self.on_reject(err)
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Service:
    """The endpoints' shared state: the loop, the tokenizer, the metrics, the model's name."""

    def __init__(self, loop: EngineLoop, tokenizer, chat_template, model_name: str):
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        has_template = chat_template is not None and getattr(chat_template, "source", "") is not None
        self.render = chat_template if has_template else None
        self.metrics = ServerMetrics(loop)
        self.created = int(time.time())

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            check_model({"model": request.path_params["model"]}, self.model_name)
        except ApiError as err:
            return self._reject(err)
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        if self.loop.alive and self.loop.admitting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` (rendered as a chat request
        is, with its ``tools``, ``add_generation_prompt``, ``continue_final_message``) -> ``{"tokens", "count",
        "max_model_len"}``."""
        try:
            body = await self._json(request)
            check_model(body, self.model_name)
            if "messages" in body:
                if self.render is None:
                    raise ApiError(400, "this model has no chat template; tokenize a 'prompt'", param="messages")
                text, _ = chat_prompt(body, self.render)
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise ApiError(400, "expected 'prompt' (a string) or 'messages' (a list of messages)", param="prompt")
            tokens = self.tokenizer.encode(text)
        except ApiError as err:
            return self._reject(err)
        except UserError as err:
            return self._reject(ApiError(400, str(err)))
        capacity = self.loop.engine.capacity
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": capacity})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        try:
            body = await self._json(request)
            check_model(body, self.model_name)
            tokens, vocab = body.get("tokens"), self.loop.engine.model.config.vocab_size
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
            ):
                raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab}); got {tokens!r}"[:300],
                               param="tokens")  # fmt: skip
        except ApiError as err:
            return self._reject(err)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "attnmask"}

    # ---- generation --------------------------------------------------------------------------
    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._json(request)
            check_model(body, self.model_name)
            capacity = self.loop.engine.capacity
            if chat:
                gens = [parse_chat(body, encode=self.tokenizer.encode, render=self.render, capacity=capacity)]
            else:
                gens = parse_completions(body, encode=self.tokenizer.encode, capacity=capacity)
            gens = with_choices(gens, body, chat=chat)
            streams = self._submit(gens)
        except ApiError as err:
            return self._reject(err)
        except UserError as err:  # the engine's own checks (token ids, what can never fit)
            return self._reject(ApiError(400, str(err)))
        except ServerClosed as err:
            return self._reject(ApiError(503, str(err), type="server_unavailable"))
        gen = gens[0]  # the fields besides the prompt are every prompt's
        shape = Shape(
            chat=chat, model=self.model_name, logprobs=gen.logprobs, top_logprobs=gen.top_logprobs, tools=gen.tools
        )
        if gen.stream:
            return _EventStream(self._sse(streams, gens, shape), streams, self._count_cancelled)
        try:
            answers = asyncio.gather(*(self._collect(s, g) for s, g in zip(streams, gens)))
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({answers, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                answers.cancel()
            if not answers.done() or answers.cancelled():  # the client went away: nobody to answer
                return Response(status_code=499)
            try:
                collected = answers.result()
            except EngineFailed as err:
                return JSONResponse(ApiError(500, str(err), type="server_error").body(), status_code=500)
        finally:
            _close(streams, self._count_cancelled)
        prompt_tokens = sum(len(g.prompt) for g in gens if g.copy == 0)  # a prompt counts once, whatever n
        completion_tokens = sum(p.generated for pieces in collected for p in pieces)  # best_of's all count
        if gen.best_of > (n := choices_of(body)):
            collected = _most_likely(collected, gen.best_of, n)
        return JSONResponse(shape.response(collected, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))

    def _submit(self, gens: list[Generation]) -> list[RequestStream]:
        """Every prompt to the engine, or none (a refused one cancels those already queued)."""
        streams: list[RequestStream] = []
        try:
            for gen in gens:
                streams.append(self.loop.submit(gen.prompt, gen.params))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _json(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ApiError(400, f"the request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}")
        return body

    def _count_cancelled(self) -> None:
        self.metrics.finished.labels("cancelled").inc()

    def _reject(self, err: ApiError) -> JSONResponse:
        self.metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    async def _pieces(self, stream: RequestStream, gen: Generation) -> AsyncIterator[Piece]:
        """The request's answer, one :class:`Piece` per engine event (with ``echo``, the prompt's before
        the first); latencies observed."""
        text = TextStream(self.tokenizer.decode, gen.params.stop)
        last, echo, base = None, gen.echo, 0  # base: characters before the completion's (the echoed prompt)
        async for timed in stream:
            event = timed.event
            if echo:  # the first event brings the prompt's scores
                echo, prompt = False, self._echo(gen, event.prompt_logprobs)
                base = len(prompt.text)
                yield prompt
            if event.token is not None:
                latency = self.metrics.ttft if last is None else self.metrics.itl
                latency.observe(timed.time - (stream.created if last is None else last))
                last = timed.time
            piece = Piece("", generated=int(event.token is not None))
            if event.token is not None:
                piece.logprob = event.logprob or 0.0  # asked for, or for best_of's ranking
                offset = base + len(text.text)
                piece.text = text.push(event.token)
                if gen.logprobs:
                    top = self._top_texts(event.top)
                    piece.tokens.append((self._token_text(event.token), event.logprob, offset, top))
            if event.finished:
                piece.text += text.finish()
                piece.finish_reason = "stop" if text.stopped else event.finish_reason
                self.metrics.finished.labels(piece.finish_reason).inc()
            yield piece

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    def _top_texts(self, top) -> list[tuple[str, float]] | None:
        return None if top is None else [(self._token_text(t), lp) for t, lp in top]

    def _echo(self, gen: Generation, scores) -> Piece:
        """The prompt as the answer's start: its text (as sent, or its ids decoded) and, with logprobs, its
        tokens (the first unscored), their offsets those of the tokens' own texts."""
        piece = Piece(gen.prompt_text if gen.prompt_text is not None else self.tokenizer.decode(gen.prompt))
        if gen.logprobs:
            offset, scores = 0, list(scores or ())
            for i, token in enumerate(gen.prompt):
                s = scores[i - 1] if 0 < i <= len(scores) else None
                token_text = self._token_text(token)
                top = self._top_texts(s.top) if s is not None and gen.top_logprobs else None
                piece.tokens.append((token_text, None if s is None else s.logprob, offset, top))
                offset += len(token_text)
        return piece

    async def _collect(self, stream: RequestStream, gen: Generation) -> list[Piece]:
        return [piece async for piece in self._pieces(stream, gen)]

    async def _merged(self, streams: list[RequestStream], gens: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
        """The pieces of every prompt's answer as they come, each with its choice's index."""
        if len(streams) == 1:
            async for piece in self._pieces(streams[0], gens[0]):
                yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for piece in self._pieces(streams[i], gens[i]):
                    queue.put_nowait((i, piece, None))
            except Exception as err:  # EngineFailed: the consumer raises it
                queue.put_nowait((i, None, err))
                return
            queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            left = len(tasks)
            while left:
                i, piece, err = await queue.get()
                if err is not None:
                    raise err
                if piece is None:
                    left -= 1
                else:
                    yield i, piece
        finally:
            for task in tasks:
                task.cancel()

    async def _sse(self, streams: list[RequestStream], gens: list[Generation], shape: Shape) -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            if shape.chat:
                yield _sse(shape.chunk(Piece(""), role=True))
            answers: dict[int, ToolStream] = {}  # with tools: each answer's JSON, read as it comes
            async for index, piece in self._merged(streams, gens):
                completion_tokens += piece.generated
                if shape.tools is not None:
                    answer = answers.setdefault(index, ToolStream(shape.tools))
                    end, piece.finish_reason = piece.finish_reason, None
                    piece.text, calls = answer.push(piece.text)
                    if piece.text or piece.tokens or calls:
                        yield _sse(shape.chunk(piece, index=index, tool_calls=calls))
                    if end:
                        yield _sse(shape.tool_end(*answers.pop(index).finish(end), index=index))
                elif piece.text or piece.tokens or piece.finish_reason:
                    yield _sse(shape.chunk(piece, index=index))
        except EngineFailed as err:
            self.metrics.finished.labels("error").inc()
            yield _sse(ApiError(500, str(err), type="server_error").body())
        if gens[0].include_usage:
            yield _sse(shape.usage_chunk(sum(len(g.prompt) for g in gens if g.copy == 0), completion_tokens))
        yield "data: [DONE]\n\n"


def create_app(
    engine_loop: EngineLoop,
    tokenizer,
    chat_template,
    model_name: str,
    *,
    start_loop: bool = True,
    api_key: str | None = None,
) -> Starlette:
    """An ASGI app serving ``engine_loop``'s model under ``model_name``.

    Args:
        engine_loop: the :class:`EngineLoop`; with ``start_loop`` the app starts its thread at startup
            (if it is not running); without, the caller steps it (``EngineLoop.run_here``, what
            ``attnmask serve`` does). Its owner shuts it down.
        tokenizer: ``encode(text) -> ids`` and ``decode(ids, skip_special=True) -> text``.
        chat_template: ``chat_template(messages, add_generation_prompt=True) -> str``, or None when the
            model has none (chat requests are then answered 400).
        model_name: the name clients put in ``model``; others are answered 404.
        api_key: when given, the API's requests must carry it as ``Authorization: Bearer <key>``.
    """
    if api_key is not None and not api_key:
        raise UserError("the API key is empty; give a non-empty key or none")
    service = _Service(engine_loop, tokenizer, chat_template, model_name)

    @asynccontextmanager
    async def lifespan(app):
        if start_loop:
            engine_loop.start()
        yield

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            ApiError(exc.status_code, str(exc.detail), type=kind).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
        body = ApiError(500, "internal server error (a bug in attnmask; see the server's log)", type="server_error")
        return JSONResponse(body.body(), status_code=500)

    routes = [
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/chat/completions", service.chat, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/tokenize", service.tokenize, methods=["POST"]),
        Route("/detokenize", service.detokenize, methods=["POST"]),
        Route("/metrics", service.prometheus, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: internal_error}
    )
    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key, on_reject=lambda err: service.metrics.rejected.labels("401").inc())
    app.state.service = service
    return app
