"""The serving engine: requests in, tokens out, one packed step at a time.

>>> engine = Engine(model, kv_cache_mib=64)
>>> rid = engine.add_request([1, 2, 3], max_tokens=8)            # greedy unless sampling says otherwise
>>> for event in engine.run():                                    # steps until every request is done
...     print(event.request_id, event.token, event.finished)

``add_request`` and ``cancel`` may be called from any thread (they only queue); ``step`` runs on one
thread (a server's engine loop). Each step takes what the :class:`~attnmask.engine.scheduler.Scheduler`
decides, runs :func:`~attnmask.engine.step.packed_forward` once over the packed chunks, samples the
sequences whose chunk reached their last token, each with its own settings and its own random
generator, and returns one :class:`TokenEvent` per new token.

A request's tokens and log-probabilities are bitwise the same whether it runs alone or beside any
other requests, wherever it sits in the packed row and however its prompt is chunked or preempted:
the step computes each row independently of the others, sampling reads only the row's own logits
and the request's own generator.

Log-probabilities (``RequestParams.logprobs``) are the model's own, ``log_softmax`` of a row's logits
before penalties, biases, temperature or top-k/top-p (vLLM's default, "raw" log-probabilities);
``top_logprobs`` adds the most likely tokens' at each position; ``prompt_logprobs`` scores the prompt:
the log-probability of each prompt token after the first, given the ones before it (OpenAI's ``echo``,
what evaluation harnesses read), computed from the same rows as the prompt's prefill, so scoring costs
the head's product on those rows and nothing more.
With ``prompt_logprobs``, ``max_tokens`` may be 0: the request scores its prompt and generates nothing.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnmask.decode.grammar import Grammar, Matcher, grammar_tokenizer, mask_rows
from attnmask.decode.sampling import GREEDY, NO_PENALTIES, Penalties, Sampling, TokenHistory, penalize_rows, sample
from attnmask.engine.cache import PagedKVCache, blocks_for_memory, layer_groups
from attnmask.engine.draft import PromptLookup
from attnmask.engine.scheduler import POLICIES, Chunk, Scheduler
from attnmask.engine.scheduler import Sequence as SeqState
from attnmask.engine.step import check_servable, fused_plan, packed_forward, prepare_screen
from attnmask.errors import UserError

log = logging.getLogger("attnmask.engine")

__all__ = ["Completion", "Engine", "EngineStats", "Logprob", "RequestParams", "TokenEvent"]

TAIL_MARGIN = 8  # characters a stop-string search's window holds beyond the stop string and the newest token
DRAFT_ROWS = 5  # speculative decoding: a step's rows at most for drafts to be checked (see Engine._propose)
MAX_TOP_LOGPROBS = 20  # most likely tokens a request may ask for at each position (OpenAI's chat limit)

Top = tuple[tuple[int, float], ...]  # (token, log-probability) pairs, the most likely first


@dataclass(frozen=True)
class RequestParams:
    """What a request asks for besides its prompt.

    ``sampling``: temperature / top-k / top-p (default greedy); ``seed``: the request's own generator
    (None: drawn from the operating system, so not reproducible); ``stop_ids``: tokens that end the
    request (besides the engine's end-of-sequence ids, unless ``ignore_eos``); ``stop``: strings that
    end it (needs the engine's ``detokenize``); ``logprobs``: report each token's log-probability;
    ``top_logprobs``: and those of that many most likely tokens at its position (0 to
    :data:`MAX_TOP_LOGPROBS`); ``prompt_logprobs``: score the prompt too (each of its tokens after the
    first, with its ``top_logprobs``), delivered with the request's first event. ``max_tokens`` >= 1, or
    0 with ``prompt_logprobs`` (score the prompt only). ``penalties``: presence, frequency and repetition
    penalties and a logit bias (:class:`~attnmask.decode.sampling.Penalties`), applied before the
    choice, greedy or sampled; ``min_tokens``: the end-of-sequence and stop ids are ruled out until the
    request has generated that many tokens (vLLM's; stop strings still end it). ``grammar``: what the
    answer's text must be (:class:`~attnmask.decode.grammar.Grammar`: JSON, a JSON schema, a regex, a
    choice, a Lark grammar; needs an engine with a ``tokenizer``); the request stops when it is complete
    (an end-of-sequence token the grammar allows completes it, ``ignore_eos`` or not). ``priority``: with
    an engine of ``scheduling="priority"``, lower runs first (vLLM's); 0 otherwise."""

    max_tokens: int = 16
    sampling: Sampling = GREEDY
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    penalties: Penalties = NO_PENALTIES
    min_tokens: int = 0
    grammar: Grammar | None = None
    priority: int = 0

    def __post_init__(self):
        least = 0 if self.prompt_logprobs else 1
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < least:
            raise UserError(
                f"max_tokens must be an int >= 1 (or 0 with prompt_logprobs: score the prompt only), got "
                f"{self.max_tokens!r}"
            )
        top = self.top_logprobs
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be an int from 0 to {MAX_TOP_LOGPROBS}, got {top!r}")
        if not isinstance(self.sampling, Sampling):
            raise UserError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise UserError(f"grammar must be a Grammar or None, got {type(self.grammar).__name__}")
        if not isinstance(self.penalties, Penalties):
            raise UserError(f"penalties must be a Penalties, got {type(self.penalties).__name__}")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= max(self.max_tokens, 0):
            raise UserError(f"min_tokens must be an int from 0 to max_tokens ({self.max_tokens}), got {m!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise UserError(f"priority must be an int (lower runs first), got {self.priority!r}")


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability at one position, and the ``top`` most likely tokens' there (as many as
    the request's ``top_logprobs``)."""

    token: int
    logprob: float
    top: Top = ()


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one request. ``finish_reason``: None while it goes on, else ``"stop"`` (an
    end-of-sequence id, a stop id or a stop string), ``"length"`` (``max_tokens`` or the model's
    context) or ``"cancelled"`` (then ``token`` is None; also None when a request of ``max_tokens`` 0
    has scored its prompt). ``logprob`` and ``top``: when the request asked (``logprobs``,
    ``top_logprobs``); ``prompt_logprobs``: with a request's first event, when it asked, one
    :class:`Logprob` for each prompt token after the first."""

    request_id: str
    token: int | None
    index: int  # of the token among the request's generated tokens
    logprob: float | None = None
    finish_reason: str | None = None
    top: Top | None = None
    prompt_logprobs: tuple[Logprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A finished request: its generated tokens (a stop id included), their log-probabilities when
    asked, and why it ended."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top: list[Top] = field(default_factory=list)  # each token's most likely tokens, when asked
    prompt_logprobs: list[Logprob] | None = None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    steps: int
    tokens_in: int  # prompt tokens computed (recomputations after preemption included)
    tokens_out: int
    preemptions: int
    tokens_cached: int = 0  # prompt positions not computed: found in the prefix cache
    blocks_cached: int = 0  # blocks the prefix cache keeps that no request holds (free for the asking)
    draft_tokens: int = 0  # speculative decoding: draft tokens checked
    draft_accepted: int = 0  # of those, the ones the model chose (each a step saved)


@dataclass(eq=False)
class _Request:
    seq: SeqState
    params: RequestParams
    generator: torch.Generator
    stops: frozenset[int]
    tail: int = 0  # tokens of the last stop-string search's window (see Engine._tail_text)
    scored: list[Logprob] | None = None  # prompt_logprobs: prompt tokens 1.. scored so far (kept over preemption)
    delivered: bool = False  # an event has gone out (the prompt's scores go with the first)
    history: TokenHistory | None = None  # what the penalties read (None: the request has none)
    matcher: Matcher | None = None  # where the request is in its grammar (None: it has none)
    lookup: PromptLookup | None = None  # speculative decoding: its draft tokens come from here


class Engine:
    """Continuous batching of one decoder-only model over a paged cache.

    Args:
        model: a decoder-only :class:`attnmask.model.Transformer` (eval mode is set).
        kv_cache_mib: memory for keys and values of every layer (the cache's bound); or ``num_blocks``.
            A model whose layers have several windows (Gemma 3) keeps a block table per layer group in
            one pool whose blocks hold one group's layers (:func:`~attnmask.model.cache.layer_groups`):
            the budget is not split between groups, each sequence takes blocks of the full groups for
            all its positions and of a window group for the last ``window + max_batch_tokens`` at most.
        block_size: positions per cache block.
        max_batch_tokens: tokens computed per step at most (prefill chunks and decode tokens).
        max_seqs: requests running at once at most.
        eos_ids: tokens that end every request (a tokenizer's ``stop_ids``).
        detokenize: ids -> text, for stop strings.
        tokenizer: the model's tokenizer (an attnmask tokenizer): ``detokenize`` when that is not given, and
            what requests with a ``grammar`` need (structured output).
        speculative_tokens: speculative decoding (0: off): up to that many draft tokens a step for each
            decoding request that has no penalties or ``min_tokens``: the tokens its grammar forces next
            (a JSON schema's keys), else the tokens that followed the last occurrence of its latest 3 (or
            2) tokens (prompt lookup, :mod:`~attnmask.engine.draft`),
            checked in the same step as its next token, while the step is small (no prompt to compute,
            :data:`DRAFT_ROWS` rows at most, shared out). A draft token is kept only where the request's
            own choice at that position (greedy or drawn from its generator, in order) is that token,
            and each row's logits are the same bits in any chunk: the answers are exactly those without
            speculation, tokens and log-probabilities, and a step may give a request several tokens.
        prefix_caching: keep the cache blocks of computed tokens after their requests end, and start a
            request whose tokens begin the same way from them (:class:`~attnmask.engine.scheduler.PrefixCache`;
            the same answers, bit for bit; with windows, every layer group's blocks are kept).
        scheduling: ``"fcfs"`` (first come, first served) or ``"priority"``: requests' ``priority``, lower
            first, a higher one preempting lower ones for blocks (:class:`~attnmask.engine.scheduler.Scheduler`);
            when each request is answered changes, never what.
    """

    def __init__(
        self,
        model,
        *,
        kv_cache_mib: float = 256,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch_tokens: int = 256,
        max_seqs: int = 64,
        eos_ids: Sequence[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        prefix_caching: bool = False,
        tokenizer=None,
        speculative_tokens: int = 0,
        scheduling: str = "fcfs",
    ):
        check_servable(model)
        if model.is_encoder_decoder:  # a request is a prompt: there is no source to encode
            raise UserError("the engine serves decoder-only models; translate with attnmask.decode.translate")
        if scheduling not in POLICIES:
            raise UserError(f"scheduling must be one of {', '.join(POLICIES)}; got {scheduling!r}")
        if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
            raise UserError(f"speculative_tokens must be an int >= 0 (0: off), got {speculative_tokens!r}")
        if block_size < 1 or max_batch_tokens < 1 or max_seqs < 1:
            raise UserError(
                f"block_size, max_batch_tokens and max_seqs must be >= 1; got {block_size}, {max_batch_tokens}, "
                f"{max_seqs}"
            )
        self.model = model.eval()
        cfg = model.config
        first = next(model.parameters())
        dtype = first.dtype if first.dtype.is_floating_point else torch.float32
        groups = layer_groups(cfg, by_window=True)
        if num_blocks is None:
            num_blocks = blocks_for_memory(
                kv_cache_mib, n_layers=len(groups[0].layers), kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                block_size=block_size, dtype=dtype,
            )  # fmt: skip
        if num_blocks < 2:
            raise UserError(f"--kv-cache-mib {kv_cache_mib} holds {num_blocks} blocks of {block_size}; need >= 2")
        self.cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size, by_window=True)
        self.scheduler = Scheduler(
            self.cache.pool, block_size, windows=self.cache.windows, max_batch_tokens=max_batch_tokens,
            max_seqs=max_seqs, prefix_caching=prefix_caching, policy=scheduling,
        )  # fmt: skip
        self.plan = fused_plan(self.model)  # the whole step in one native call, where the model allows
        prepare_screen(self.model)  # greedy steps' screen of the head, made now, not in the first request
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.tokenizer = tokenizer
        self.detokenize = detokenize if detokenize is not None or tokenizer is None else tokenizer.decode
        self.max_len = cfg.max_seq_len if cfg.positions != "rotary" else None
        self._capacity = self.scheduler.paging.most_positions(max_batch_tokens)
        if self._capacity is None:  # window groups alone: the cache bounds no request, the context does
            self._capacity = cfg.max_seq_len
        self._requests: dict[str, _Request] = {}
        self._inbox: deque = deque()  # ("add", request) / ("cancel", id): from any thread
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._grammar_lock = threading.Lock()  # add_request may run on several threads
        self._llg_tokenizer = None
        self._steps = self._tokens_in = self._tokens_out = 0
        self.speculative_tokens = speculative_tokens
        self._drafted = self._accepted = 0

    # ---- requests --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Positions one request may hold at most: the whole cache (and the model's context). With window
        groups, the most positions whose blocks at their peak (every full group's, a window group's
        last ``window + max_batch_tokens``) fit the pool."""
        return self._capacity if self.max_len is None else min(self._capacity, self.max_len)

    def add_request(self, prompt: Sequence[int], params: RequestParams | None = None, *, request_id=None) -> str:
        """Queue a request; returns its id. Raises UserError for an empty prompt, ids outside the
        vocabulary, or a request that could never fit the cache or the model's context."""
        params = params or RequestParams()
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise UserError("the prompt is empty; expected at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        if len(prompt) + params.max_tokens > self.capacity:
            raise UserError(
                f"the prompt's {len(prompt)} tokens + max_tokens {params.max_tokens} exceed the {self.capacity} "
                "positions this engine can hold for one request (its cache or the model's context)"
            )
        bias = [t for t, _ in params.penalties.logit_bias]
        if bias and not 0 <= min(bias) <= max(bias) < vocab:
            raise UserError(f"logit_bias token ids must be in [0, {vocab}); got {min(bias)}..{max(bias)}")
        if params.stop and self.detokenize is None:
            raise UserError("stop strings need an engine with a detokenize function (a tokenizer)")
        if params.priority and self.scheduler.policy != "priority":
            raise UserError(f"priority {params.priority} needs priority scheduling (Engine(scheduling='priority'), "
                            "attnmask serve --scheduling-policy priority); this engine serves first come, first "
                            "served")  # fmt: skip
        matcher = None
        if params.grammar is not None:  # compiled here, on the caller's thread, not the stepping one
            if self.tokenizer is None:
                raise UserError("structured output (a grammar) needs an engine with a tokenizer")
            matcher = Matcher(params.grammar, self._grammar_tokenizer())
        with self._lock:
            rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests or any(op == "add" and r.seq.request_id == rid for op, r in self._inbox):
                raise UserError(f"request id {rid!r} is already in use")
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
            stops = frozenset(params.stop_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            seq = SeqState(rid, list(prompt), len(prompt), params.max_tokens, reuse=not params.prompt_logprobs,
                           priority=params.priority)  # fmt: skip
            scored = [] if params.prompt_logprobs else None
            history = TokenHistory(prompt) if params.penalties.active else None
            speculates = self.speculative_tokens and history is None and not params.min_tokens
            lookup = PromptLookup() if speculates else None
            request = _Request(seq, params, generator, stops, scored=scored, history=history, matcher=matcher,
                               lookup=lookup)  # fmt: skip
            self._inbox.append(("add", request))
        return rid

    def prepare_structured_output(self) -> bool:
        """Build llguidance's view of the tokenizer now (~0.2 s) rather than in the first structured
        request; False when it cannot be (no tokenizer, or llguidance missing)."""
        if self.tokenizer is None or not self.eos_ids:
            return False
        try:
            self._grammar_tokenizer()
        except UserError:
            return False
        return True

    def _grammar_tokenizer(self):
        """llguidance's view of the tokenizer, built at the first structured request (~0.2 s), then kept."""
        with self._grammar_lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = grammar_tokenizer(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
            return self._llg_tokenizer

    def cancel(self, request_id: str) -> None:
        """Stop a request (queued or running) and free its blocks at the next step; unknown ids are ignored."""
        with self._lock:  # add_request reads the inbox under the lock
            self._inbox.append(("cancel", str(request_id)))

    def has_work(self) -> bool:
        return bool(self._inbox or self.scheduler.running or self.scheduler.waiting)

    def stats(self) -> EngineStats:
        """Counts of now (running, waiting, blocks) and since the start (steps, tokens, preemptions).
        Reads the scheduler's state: call it on the thread that steps (a server snapshots it there)."""
        pool, prefix = self.cache.pool, self.scheduler.prefix
        preempted = self.scheduler.preemptions
        idle = prefix.idle() if prefix is not None else 0
        return EngineStats(
            len(self.scheduler.running), len(self.scheduler.waiting) + len(self._inbox), pool.used - idle,
            pool.capacity, self._steps, self._tokens_in, self._tokens_out, preempted,
            prefix.reused if prefix is not None else 0, idle, self._drafted, self._accepted,
        )  # fmt: skip

    # ---- the step ----------------------------------------------------------------------------
    def _drain(self) -> list[TokenEvent]:
        events = []
        while self._inbox:
            with self._lock:  # add_request reads the inbox and the requests' ids on other threads
                op, item = self._inbox.popleft()
                if op == "add":
                    self._requests[item.seq.request_id] = item
            if op == "add":
                self.scheduler.add(item.seq)
            elif (request := self._requests.pop(item, None)) is not None:
                self.scheduler.finish(request.seq)
                events.append(TokenEvent(item, None, request.seq.generated, finish_reason="cancelled"))
        return events

    def step(self) -> list[TokenEvent]:
        """Run one packed step; the new tokens (and cancellations) as events."""
        events = self._drain()
        if self.speculative_tokens:
            self._propose()
        chunks = self.scheduler.schedule()
        if not chunks:
            return events
        # (M, V): the prompt rows to score, one row a sampling chunk, then the rows that check drafts; or,
        # where no row needs more than its arg-max, each sampling chunk's token (M,)
        argmax = self._argmax_only(chunks)
        logits, scoring = self._forward(chunks, argmax)
        sampling = [c for c in chunks if c.sample]
        drafts = [list(c.seq.draft) for c in sampling]  # what each chunk checks (cleared below)
        if scoring:  # a chunk's rows in order: the scores in order
            requests = [self._requests[c.seq.request_id] for c, _ in scoring]
            next_tokens = [c.seq.tokens[position + 1] for c, position in scoring]
            ks = [r.params.top_logprobs for r in requests]
            for request, scored in zip(requests, _logprobs(logits[: len(scoring)], next_tokens, ks)):
                request.scored.append(scored)
        logits = logits[len(scoring) :]
        prefix = self.scheduler.prefix
        for c in chunks:
            c.seq.computed += c.n - c.drafted  # drafts: those kept are counted below
            c.seq.draft.clear()
            self._tokens_in += c.n if c.start < c.seq.prompt_len else 0
            if prefix is not None:  # before its window groups let blocks go: they are kept too
                prefix.keep(c.seq)  # its full blocks, for requests that begin the same way
            self.scheduler.forget(c.seq)  # window groups: blocks the next chunk will not read go back now
        if sampling and argmax:
            for c, token in zip(sampling, logits.tolist()):
                events.append(self._emit(self._requests[c.seq.request_id], None, token))
        elif sampling:
            requests = [self._requests[c.seq.request_id] for c in sampling]
            # penalties, biases, min_tokens: in place on the rows of the requests that have them, for the
            # choice only (the log-probabilities are the model's own: restored before they are read)
            changed = self._penalize(logits, requests)
            # grammars: each constrained row's disallowed tokens to -inf, from its own matcher (put back below)
            # (a request that checks a draft masks each of its rows below, position by position)
            constrained = [i for i, r in enumerate(requests) if r.matcher is not None and r.params.max_tokens
                           and not drafts[i]]  # fmt: skip
            masked = mask_rows(logits, constrained, [requests[i].matcher for i in constrained]) if constrained else None
            # every row's arg-max in one call (greedy requests take it; off the CPU, read back once rather
            # than a device sync per request). An arg-max is exact: a row's is the same alone or in the batch.
            # max's indices are argmax's (the first largest), its CPU reduction about 2.5x faster.
            most = logits.max(dim=-1)
            top, highest = most.indices.tolist(), most.values.tolist()
            # a row with no token left (a complete grammar whose end min_tokens still rules out) ends its request
            # (a request that checks a draft chooses below, position by position, in order)
            tokens = [None if d else self._choose(r, row, best) if h > -math.inf else _NOTHING
                      for r, row, best, h, d in zip(requests, logits, top, highest, drafts)]  # fmt: skip
            if masked is not None:  # the penalised values, then the model's own
                masked.restore()
            if changed is not None:
                changed.restore()
            extra = len(sampling)  # the rows that check drafts, each chunk's in order
            for request, row, token, draft, best in zip(requests, logits, tokens, drafts, top):
                if draft:
                    checks = logits[extra : extra + len(draft)]
                    events += self._speculated(request, draft, checks, top[extra : extra + len(draft)] + [best], row)
                    extra += len(draft)
                else:
                    events.append(self._emit(request, row, token))
        self._steps += 1
        return events

    def _propose(self) -> None:
        """Draft tokens for each running request that decodes and speculates (prompt lookup), while the
        step stays small: no prompt to compute, and :data:`DRAFT_ROWS` rows at most. A small step costs
        about what one row does (the weights are read once); in a large one every row costs its share,
        and a checked draft token, kept about half the time, gives less than a row of another request."""
        running = self.scheduler.running
        for seq in running:  # a draft not checked last step (its sequence had no room) is not kept over
            seq.draft.clear()
        if self.scheduler.waiting or self._inbox or any(s.computed < len(s.tokens) - 1 for s in running):
            return  # prompts to compute: the step is large already
        share = (DRAFT_ROWS - len(running)) // max(1, len(running))
        for seq in running:
            request = self._requests.get(seq.request_id)
            if request is None or request.lookup is None or seq.computed != len(seq.tokens) - 1:
                continue
            room = seq.max_tokens - seq.generated - 1  # its next token comes anyway
            if self.max_len is not None:
                room = min(room, self.max_len - len(seq.tokens) - 1)
            k = min(self.speculative_tokens, room, share)
            if k <= 0:
                continue
            forced = request.matcher.forced()[:k] if request.matcher is not None else []  # a schema's keys
            seq.draft = forced or request.lookup.propose(seq.tokens, k)

    def _speculated(self, request: _Request, draft: list[int], checks: Tensor, best: list[int], last: Tensor):
        """The events of a request whose chunk checked ``draft``: row ``checks[j]`` is the position before
        ``draft[j]``, ``last`` the one after the whole draft; ``best``: each of those rows' arg-max. The
        request chooses at each position in order, as it would without a draft (greedy, or a draw from its
        generator); a draft token it chose is kept and the next position is read, the first it did not
        choose ends the step (its choice is the step's last token)."""
        seq, events = request.seq, []
        rows = list(checks) + [last]
        for j, row in enumerate(rows):
            pick, masked = best[j], None
            if request.matcher is not None:  # its grammar's mask at this position (its state: the tokens kept)
                masked = mask_rows(row[None], [0], [request.matcher])
                most = row[None].max(dim=-1)
                if float(most.values[0]) == -math.inf:  # nothing may come next: the request ends here
                    masked.restore()
                    events.append(self._emit(request, row, _NOTHING))
                    break
                pick = int(most.indices[0])
            token = self._choose(request, row, pick)
            if masked is not None:  # the model's own logits again, for the log-probabilities
                masked.restore()
            kept = j < len(draft) and token == draft[j]
            if kept:
                seq.computed += 1  # its key and value, written by this step, are the draft token's: its own
                self._accepted += 1
            events.append(self._emit(request, row, token))
            if not kept or events[-1].finished:
                break
        self._drafted += len(draft)
        if self.scheduler.prefix is not None and seq.request_id in self._requests:
            self.scheduler.prefix.keep(seq)
        return events

    def _penalize(self, logits: Tensor, requests: list[_Request]):
        """The rows of ``requests`` with penalties or a ``min_tokens`` not reached, changed in place
        (:func:`~attnmask.decode.sampling.penalize_rows`); what restores them, or None."""
        rows, penalties, histories, banned = [], [], [], []
        for i, r in enumerate(requests):
            holding = r.seq.generated < r.params.min_tokens
            if r.history is None and not holding:
                continue
            rows.append(i)
            penalties.append(r.params.penalties)
            histories.append(r.history or _NO_HISTORY)
            banned.append(tuple(sorted(r.stops)) if holding else ())
        return penalize_rows(logits, rows, penalties, histories, banned) if rows else None

    def _argmax_only(self, chunks: list[Chunk]) -> bool:
        """Whether this step's rows need nothing but their arg-max: some chunk samples, and every such
        chunk's request is greedy, wants no log-probabilities, has no penalties, grammar or ``min_tokens``
        to apply and checks no draft; no prompt is scored. Then the step finds each token without the
        logits (:func:`~attnmask.decode.step.packed_forward`'s ``argmax``: exact, so a request's tokens
        are the same whichever kind of step it is in)."""
        some = False
        for c in chunks:
            request = self._requests[c.seq.request_id]
            params = request.params
            if request.scored is not None:
                return False
            if not c.sample:
                continue
            some = True
            if (not params.sampling.greedy or params.logprobs or params.top_logprobs or c.drafted
                    or request.history is not None or request.matcher is not None or params.max_tokens == 0
                    or c.seq.generated < params.min_tokens):  # fmt: skip
                return False
        return some

    def _forward(self, chunks: list[Chunk], argmax: bool = False) -> tuple[Tensor, list[tuple[Chunk, int]]]:
        """The step over ``chunks``: logits of the prompt rows to score (``(chunk, position)`` each, returned
        too), then of each sampling chunk's last row (``argmax``: those rows' arg-max tokens only)."""
        device = self.cache.k[0].device
        tokens, positions, row_seq, logit_rows, scoring, sample_rows, draft_rows = [], [], [], [], [], [], []
        for i, c in enumerate(chunks):
            scored = self._requests[c.seq.request_id].scored
            if scored is not None:  # prompt rows not scored yet (after a preemption, the rest only)
                for position in range(max(c.start, len(scored)), min(c.start + c.n, c.seq.prompt_len - 1)):
                    logit_rows.append(len(tokens) + position - c.start)
                    scoring.append((c, position))
            tokens += (c.seq.tokens + c.seq.draft)[c.start : c.start + c.n]
            positions += range(c.start, c.start + c.n)
            row_seq += [i] * c.n
            if c.sample:
                sample_rows.append(len(tokens) - 1)
                draft_rows += range(len(tokens) - 1 - c.drafted, len(tokens) - 1)  # the rows before each draft token
        logit_rows += sample_rows + draft_rows
        tables = []  # one (Q, W) tensor a layer group
        for g in range(len(self.cache.groups)):
            width = max(len(c.seq.tables[g]) for c in chunks)
            rows = [c.seq.tables[g] + [0] * (width - len(c.seq.tables[g])) for c in chunks]  # 0: the null block
            tables.append(torch.tensor(rows, dtype=torch.long, device=device))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        with torch.inference_mode():
            logits = packed_forward(
                self.model, self.cache, as_long(tokens), as_long(positions), as_long(row_seq), tables,
                as_long(logit_rows), self.plan, argmax=argmax,
            )  # fmt: skip
        return logits, scoring

    def _choose(self, request: _Request, row: Tensor, best: int) -> int | None:
        """The request's next token from its logits ``row (V,)`` (its penalties applied) whose arg-max is
        ``best``; None for a request that only scores its prompt."""
        if request.params.max_tokens == 0:
            return None
        s = request.params.sampling
        if s.greedy:
            return best
        # the request's generator lives on the CPU: so does the row it draws from
        draw = Sampling(s.temperature, s.top_k, s.top_p, generator=request.generator)
        return int(sample(row[None].cpu(), draw)[0])

    def _emit(self, request: _Request, row: Tensor | None, token) -> TokenEvent:
        """``token`` appended to the request, as an event (with its log-probabilities from ``row``, the
        model's own logits); the request finishes when it stops or reaches its length."""
        seq, params = request.seq, request.params
        prompt = None
        if not request.delivered:
            request.delivered = True
            prompt = tuple(request.scored) if request.scored is not None else None
        if token is None:  # the prompt scored (prompt_logprobs, max_tokens 0), nothing to generate
            self._finish(request)
            return TokenEvent(seq.request_id, None, 0, finish_reason="length", prompt_logprobs=prompt)
        if token is _NOTHING:  # nothing may come next: the request ends here
            self._finish(request)
            return TokenEvent(seq.request_id, None, seq.generated, finish_reason="stop", prompt_logprobs=prompt)
        logprob = top = None
        if params.logprobs or params.top_logprobs:
            (scored,) = _logprobs(row[None], [token], [params.top_logprobs])
            logprob, top = scored.logprob, scored.top if params.top_logprobs else None
        seq.tokens.append(token)
        if request.history is not None:
            request.history.add(token)
        complete = False  # its grammar has ended
        if request.matcher is not None:
            if not request.matcher.advance(token):  # the vocabulary cannot write what the grammar wants
                log.warning("request %s: its grammar stopped: %s", seq.request_id, request.matcher.error)
            complete = request.matcher.done or bool(request.matcher.error)
        self._tokens_out += 1
        reason = None
        if complete or token in request.stops or params.stop and _holds_any(self._tail_text(request), params.stop):
            reason = "stop"
        elif seq.generated >= params.max_tokens or (self.max_len is not None and len(seq.tokens) >= self.max_len):
            reason = "length"
        if reason is not None:
            self._finish(request)
        return TokenEvent(seq.request_id, token, seq.generated - 1, logprob, reason, top, prompt)

    def _finish(self, request: _Request) -> None:
        self.scheduler.finish(request.seq)
        del self._requests[request.seq.request_id]

    def _tail_text(self, request: _Request) -> str:
        """The text of the request's last tokens, where a stop string that the newest token completes
        lies whole, however many tokens it spans.

        Earlier tokens were searched as they came, so only an occurrence that ends in the newest
        token's text is new: it starts at most ``len(stop) - 1`` characters before that text. The
        window takes enough of the last tokens that their text is at least the longest stop string,
        the newest token's own text and :data:`TAIL_MARGIN` long (the margin covers what decoding the
        window alone may change at its start: a character split at the cut, a dropped leading space).
        Tokens may give no text (bytes of a split character, skipped special tokens), so the window
        doubles until its text is that long or it holds every generated token, and the next token's
        search starts at the size that sufficed. Each token then costs about the stop strings' length
        in detokenizing, where decoding all the generated text at every token costs O(n^2) over a
        request."""
        seq = request.seq
        generated = len(seq.tokens) - seq.prompt_len
        need = max(len(s) for s in request.params.stop) + TAIL_MARGIN + len(self.detokenize(seq.tokens[-1:]))
        n = max(request.tail, need)  # most tokens give a character or more
        while True:
            n = min(n, generated)
            text = self.detokenize(seq.tokens[len(seq.tokens) - n :])
            if len(text) >= need or n == generated:
                request.tail = n
                return text
            n *= 2

    # ---- conveniences ------------------------------------------------------------------------
    def run(self) -> Iterator[TokenEvent]:
        """Step until every request is done, yielding the events."""
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: RequestParams | None = None) -> list[Completion]:
        """Every prompt as a request with ``params``; their completions in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        done = {rid: Completion(rid) for rid in ids}
        for event in self.run():
            c = done.get(event.request_id)
            if c is None:
                continue
            if event.prompt_logprobs is not None:
                c.prompt_logprobs = list(event.prompt_logprobs)
            if event.token is not None:
                c.tokens.append(event.token)
                if event.logprob is not None:
                    c.logprobs.append(event.logprob)
                if event.top is not None:
                    c.top.append(event.top)
            if event.finished:
                c.finish_reason = event.finish_reason
        return [done[rid] for rid in ids]


def _logprobs(rows: Tensor, tokens: Sequence[int], ks: Sequence[int]) -> list[Logprob]:
    """For each logits row of ``rows (R, V)``: its token's log-probability and its ``k`` most likely tokens'
    (ties: the lower id first). ``log_softmax`` reduces each row on its own, and a selection copies
    values exactly, so a row's result is the same bits whatever rows are beside it."""
    logp = torch.log_softmax(rows.float(), dim=-1)  # (R, V)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    most, V = min(max(ks), logp.shape[1]), logp.shape[1]
    tops: list[Top] = [()] * len(tokens)
    if most:
        # one more than asked: where the extra one is as likely as the last, a tie crosses the cut
        values, ids = logp.topk(min(most + 1, V), dim=-1)  # (R, most + 1), in no particular order among ties
        values, ids = values.tolist(), ids.tolist()
        for r, k in enumerate(ks):
            if not k:
                continue
            pairs = list(zip(values[r][:most], ids[r][:most]))
            if most < V and values[r][most] == values[r][most - 1]:  # every candidate; the order decides
                where = torch.nonzero(logp[r] >= values[r][most - 1]).flatten()
                pairs = list(zip(logp[r, where].tolist(), where.tolist()))
            pairs.sort(key=lambda pair: (-pair[0], pair[1]))
            tops[r] = tuple((i, lp) for lp, i in pairs[:k])
    return [Logprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


_NO_HISTORY = TokenHistory(())  # what a request without penalties reads (nothing)
_NOTHING = object()  # no token may come next (every logit of the row is -inf)


def _holds_any(text: str, strings: tuple[str, ...]) -> bool:
    return any(s in text for s in strings)
