"""Serving over HTTP: an OpenAI-compatible server on top of :mod:`attnmask.engine`.

The layer above the engine; it translates and never touches a tensor (the engine, in turn, knows
nothing of HTTP):

- :mod:`.loop`: :class:`EngineLoop`, the one thread that steps the engine, and the asyncio queues
  that carry each request's tokens to its handler (a client gone cancels its request);
- :mod:`.text`: :class:`TextStream`, generated ids into valid UTF-8 text pieces, cut at stop strings;
- :mod:`.protocol`: OpenAI's request bodies checked and turned into engine requests, errors as JSON;
- :mod:`.metrics`: what ``GET /metrics`` reports (Prometheus, a registry per app);
- :mod:`.app`: :func:`create_app`, the Starlette app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``).

``attnmask serve`` (:mod:`attnmask.cli.serve`) runs it with uvicorn. Needs the ``serve`` extra
(``pip install 'attnmask[serve]'``: starlette, uvicorn, prometheus-client).
"""

from attnmask.serve.app import create_app  # noqa: F401
from attnmask.serve.loop import EngineFailed, EngineLoop, RequestStream, ServerClosed  # noqa: F401
from attnmask.serve.protocol import ApiError, Generation  # noqa: F401
from attnmask.serve.text import TextStream  # noqa: F401
