"""``attnmask serve``: an OpenAI-compatible HTTP server for a language model (:mod:`attnmask.serve`).

The process is the server's owner, so the process-wide choices are made here: torch's thread count
(``--threads``) and the signals. SIGTERM or SIGINT (Ctrl-C) stops admitting requests (new ones get
503), lets the running ones finish for up to ``--shutdown-timeout`` seconds, cancels the rest and
exits 0; a second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from attnmask.cli.common import ACTIVATIONS, check_device, check_run_dir
from attnmask.errors import UserError

DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "kv_cache_mib": 256.0,
    "max_batch_tokens": 256,
    "max_seqs": 64,
    "block_size": 16,
    "shutdown_timeout": 10.0,
}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DTYPES = ("float32", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a language model over HTTP (OpenAI-compatible API)",
        description="Serve a decoder-only model from a pretrained name (--model) or a run directory (--run) "
        "with an OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions (streaming as "
        "server-sent events; log-probabilities with the top tokens; echo scores a prompt, as evaluation "
        "harnesses ask; n and best_of; presence, frequency and repetition penalties, logit_bias, min_tokens; "
        "structured output: response_format json_object / json_schema, guided_regex, guided_choice, guided_grammar; "
        "tools and tool_choice, the calls held to their JSON form by a grammar; continue_final_message: an "
        "assistant prefill), "
        "GET /v1/models, /health and /metrics (Prometheus), POST /tokenize and /detokenize. Requests are batched "
        "continuously over a paged KV cache of --kv-cache-mib; when it is full, new requests wait. "
        "Needs the serve extra: pip install 'attnmask[serve]'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()  # one is required: checked in run(), so a mistake is one line
    src.add_argument("--model", metavar="NAME", help="a pretrained model known to attnmask.pretrained (e.g. smollm2)")
    src.add_argument("--run", metavar="DIR", help="a run directory written by `attnmask train` (task lm)")
    p.add_argument(
        "--quantized", action="store_true", help="--model: keep the GGUF file's quantized blocks (faster on CPU)"
    )
    p.add_argument(
        "--activations",
        default="float32",
        choices=ACTIVATIONS,
        help="with --quantized: float32 multiplies exactly; int8 rounds each row's activations to 8 bits per "
        "block of 32 and multiplies in integers, as llama.cpp does (faster on CPU, not exact; answers still "
        "never depend on the batch)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help="the chat template for /v1/chat/completions: a Jinja file or a built-in name (chatml, gemma), for a "
        "model whose files carry none (a base model such as gemma3) or to replace its own; none given: the "
        "model's own",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name clients use in 'model'; none given: the --model name or the run's folder name",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="answer the API only for requests that send 'Authorization: Bearer KEY' (others: 401); "
        "/health and /metrics stay open. Default: $ATTNMASK_API_KEY (safer than the command line, "
        "which other users can see), else no key",
    )
    p.add_argument("--host", default=DEFAULTS["host"], help="address to listen on")
    p.add_argument("--port", type=int, default=DEFAULTS["port"], help="port to listen on (0: any free port)")
    p.add_argument(
        "--kv-cache-mib", type=float, default=DEFAULTS["kv_cache_mib"], help="MiB of memory for the KV cache"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=DEFAULTS["max_batch_tokens"], help="tokens computed per step at most"
    )
    p.add_argument("--max-seqs", type=int, default=DEFAULTS["max_seqs"], help="requests decoded at once at most")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="positions per KV cache block")
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the KV cache blocks of computed tokens after requests end and start requests that begin "
        "the same way from them (a shared system prompt, the tools offered, few-shot examples, the turns of a "
        "chat): less to compute, the same answers bit for bit (with sliding windows, as Gemma 3's, every layer "
        "group's blocks are kept). Default: on",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding by prompt lookup: up to K draft tokens a step for each request, the tokens "
        "that followed its latest tokens where they occurred before in it (prompt included), checked in one "
        "step; the same answers bit for bit, sooner where text repeats its context (code edits, quotes, JSON); "
        "0: off",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="fcfs: first come, first served; priority: requests' 'priority' field (lower first, then first "
        "come), a higher priority preempting lower ones for cache blocks (vLLM's). Which requests run together "
        "never changes an answer",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads; none given: torch's own choice")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N (on CUDA self-attention runs FlexAttention over the paged cache; the bitwise "
        "batch invariance is the CPU's)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the weights' dtype (bfloat16: on a GPU)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULTS["shutdown_timeout"],
        help="on SIGTERM/SIGINT, seconds the running requests may take to finish before they are cancelled",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="the server's log level")
    p.set_defaults(func=run)


def check_flags(args) -> None:
    """Every flag, before anything is loaded."""
    if args.model is None and args.run is None:
        raise UserError("give the model to serve: --model NAME (e.g. smollm2) or --run DIR")
    if args.run is not None:
        check_run_dir(args.run)
        if args.quantized:
            raise UserError("--quantized applies to --model (a GGUF file's weights), not to --run")
    args.device = check_device(args.device)
    if getattr(args, "activations", "float32") != "float32" and not args.quantized:
        raise UserError(f"--activations {args.activations} is a setting of the quantized blocks; add --quantized")
    if args.quantized and (args.device != "cpu" or args.dtype != "float32"):
        raise UserError(f"--quantized runs on the CPU in float32; got --device {args.device} --dtype {args.dtype}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not 0 < args.kv_cache_mib < math.inf:
        raise UserError(f"--kv-cache-mib must be > 0, got {args.kv_cache_mib}")
    for flag in ("max_batch_tokens", "max_seqs", "block_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if args.speculative_tokens < 0:
        raise UserError(f"--speculative-tokens must be >= 0 (0: off), got {args.speculative_tokens}")
    if not args.shutdown_timeout >= 0:
        raise UserError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_key is None:  # read here, not as the flag's default: --help must not print it
        args.api_key = os.environ.get("ATTNMASK_API_KEY")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key (or $ATTNMASK_API_KEY) is empty; give a key, or unset it to serve without one")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name must not be empty")
    if args.chat_template is not None:
        from attnmask.pretrained.chat import template_source

        template_source(args.chat_template)  # a file that cannot be read, an unknown name: one line, before loading
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client") if not _importable(m)]
    if missing:
        raise UserError(f"attnmask serve needs {', '.join(missing)}: pip install 'attnmask[serve]'")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def load_model(args):
    """``(model, tokenizer, chat_template or None, served name)`` of ``--model`` or ``--run``; the chat
    template is ``--chat-template``'s when given."""
    model, tokenizer, chat_template, name = _load(args)
    if getattr(args, "chat_template", None) is not None:
        from attnmask.pretrained.chat import ChatTemplate, PretrainedTokenizer, chat_template_for, template_source

        if isinstance(tokenizer, PretrainedTokenizer):  # its turn's end token joins the stop ids
            chat_template = chat_template_for(tokenizer, args.chat_template)
        else:  # a run's own tokenizer: the template's markers are plain text to it
            chat_template = ChatTemplate(template_source(args.chat_template))
    return model, tokenizer, chat_template, name


def _load(args):
    if args.run is not None:
        from attnmask.train.rundir import load_run

        run = load_run(args.run)
        if run.task not in ("lm", "chat") or run.model.is_encoder_decoder:
            raise UserError(
                f"--run {args.run} is a {run.task!r} run; serve needs a decoder-only language model (task lm or chat)"
            )
        name = args.served_model_name or Path(args.run).resolve().name
        return run.model, run.tokenizer, getattr(run, "chat_template", None), name
    from attnmask.pretrained import load

    activations = getattr(args, "activations", "float32")
    model, tokenizer, chat_template = load(args.model, quantized=args.quantized, activations=activations)
    return model, tokenizer, chat_template, args.served_model_name or str(args.model)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts with the server); one line if it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise UserError(f"--host {host!r}: {err.strerror}") from err
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror}") from err
    return sock


def make_server(app, loop, *, log_level: str, shutdown_timeout: float):
    """A uvicorn server for a background thread (it installs no signal handlers there: the CLI's main
    thread does, see :func:`serve`)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    return uvicorn.Server(config)


def run(args) -> int:
    check_flags(args)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # the process is ours: the CLI owns its thread count
    sock = bind(args.host, args.port)  # before loading: a busy port is reported at once
    try:
        return serve(args, sock)
    finally:
        sock.close()


def serve(args, sock: socket.socket) -> int:
    from attnmask import ops
    from attnmask.engine import Engine
    from attnmask.serve import EngineLoop, create_app

    model, tokenizer, chat_template, name = load_model(args)
    if args.device != "cpu" or args.dtype != "float32":
        import torch

        model = model.to(args.device, getattr(torch, args.dtype))
    caching = args.prefix_caching is not False  # on unless --no-prefix-caching
    engine = Engine(
        model,
        kv_cache_mib=args.kv_cache_mib,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_seqs=args.max_seqs,
        eos_ids=getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,),
        tokenizer=tokenizer,  # stop strings, structured output
        prefix_caching=caching,
        speculative_tokens=args.speculative_tokens,
        scheduling=args.scheduling_policy,
    )
    ops.available()  # build the native kernels now (once, about a minute) rather than in the first request
    engine.prepare_structured_output()  # likewise llguidance's view of the tokenizer (~0.2 s)
    loop = EngineLoop(engine)  # stepped on this thread below (run_here)
    app = create_app(loop, tokenizer, chat_template, name, start_loop=False, api_key=args.api_key)
    server = make_server(app, loop, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout)
    logging.getLogger("attnmask.serve").setLevel(args.log_level.upper())
    sock.listen(2048)  # before the address is announced: a client that connects at once is queued, not refused
    host, port = sock.getsockname()[:2]
    print(
        f"attnmask serve: {name!r} on http://{host}:{port}/v1 — KV cache {engine.stats().blocks_total} blocks of "
        f"{args.block_size} positions, at most {engine.capacity} per request; prefix caching "
        f"{'on' if caching else 'off'}",
        file=sys.stderr,
        flush=True,
    )
    # The engine steps on this (the main) thread, the HTTP server runs on another: see
    # attnmask.serve.loop for why. SIGTERM/SIGINT stop admissions and start uvicorn's graceful
    # shutdown (running requests finish within --shutdown-timeout, the rest are cancelled); the
    # process then exits with 0. A second signal exits at once.
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="attnmask-http", daemon=True)

    def stop(sig, frame) -> None:
        loop.stop_admitting()
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        loop.run_here(until=lambda: not http.is_alive())
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        server.should_exit = True
        http.join(timeout=max(args.shutdown_timeout, 0) + 5)
    return 0
