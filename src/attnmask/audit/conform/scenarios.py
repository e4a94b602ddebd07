"""The scenarios of :func:`~attnmask.audit.conform.runner.conform`, run by :class:`Suite` under one
implementation at a time (see :mod:`attnmask.audit.conform.runner` for what each one checks, and its
tolerances).

Shared by all scenarios: two random base sequences of T tokens (never the pad id), the leak audit's
perturbation check for dependency matrices (:meth:`Suite.dependency_of`), and for failures whose
measurement is not a dependency matrix (cache, batched greedy), the dependency matrix of the path
that failed, so every failure can be drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnmask import masks
from attnmask.audit.checks import audit
from attnmask.audit.conform.models import layer_windows, reach, reference_model
from attnmask.audit.conform.reach import layer_reach
from attnmask.audit.conform.report import ConformResult
from attnmask.audit.subjects import from_callable, from_hf, positions_from_mask
from attnmask.audit.tolerance import Tolerance
from attnmask.errors import UserError

__all__ = ["Suite", "SCENARIOS", "N_PADS", "N_NEW_TOKENS"]

SCENARIOS = (
    "causality",
    "sliding window",
    "layer reach",
    "left padding",
    "right padding",
    "source padding",
    "fully padded rows",
    "packed (no mask)",
    "packed (all-ones mask)",
    "cache parity",
    "batched greedy",
    "implementations agree",
    "float64 reference",
)
_DECODER_ONLY = {"sliding window", "layer reach", "left padding", "packed (no mask)", "packed (all-ones mask)"}
_DECODER_ONLY |= {"cache parity", "batched greedy"}
N_PADS = 3
N_NEW_TOKENS = 6


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------
def _causal(T: int) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()  # (T, T): j <= i


def _first_over(ratio: Tensor) -> int | None:
    """Index of the first entry > 1 of a 1-D ratio tensor, or None."""
    over = (ratio > 1).nonzero().flatten()
    return int(over[0]) if len(over) else None


def _crashed(scenario: str, impl: str, err: Exception) -> ConformResult:
    """A scenario whose implementation raised: failed, with the error's first line as the detail."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return ConformResult(scenario, impl, False, detail=f"the implementation raised {type(err).__name__}: {first}",
                         max_deviation=float("inf"), error=True)  # fmt: skip


class Suite:
    def __init__(self, model, *, length: int, seed: int):
        self.m = model
        cfg = model.config
        self.enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
        self.reach = None if self.enc_dec else reach(cfg)
        self.windows = layer_windows(cfg)
        longest = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        T = length if self.reach is None else max(length, self.reach + 4)
        if longest is not None and longest < T:
            raise UserError(f"conform length {T} exceeds the model's {longest} positions")
        self.T, self.seed = T, seed
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.tol = Tolerance.for_dtype(self.dtype)  # a perturbation that must change nothing
        self.agree = Tolerance.for_dtype(self.dtype, purpose="agreement")  # two computations of the same logits
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.vocab = text.vocab_size
        pad = getattr(cfg, "pad_token_id", None)
        self.pad = 0 if pad is None else int(pad)
        self.special = (self.pad,)
        gen = torch.Generator().manual_seed(seed)
        allowed = torch.tensor([i for i in range(self.vocab) if i not in self.special])
        self.ids = allowed[torch.randint(len(allowed), (2, T), generator=gen)].to(self.device)  # (2, T)
        self.src = allowed[torch.randint(len(allowed), (2, T), generator=gen)].to(self.device)  # (2, S=T)
        self.baseline: Tensor | None = None  # the first implementation's logits for "implementations agree"
        self.baseline_impl = ""
        self.reference, self.ref_why = (None, "")
        self.ref_logits: Tensor | None = None
        self.dependency: dict[str, tuple[Tensor, Tensor]] = {}  # impl -> (intended, measured) of causality

    # -- plumbing --------------------------------------------------------------------------------
    @torch.no_grad()
    def lm(self, ids: Tensor, keep: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Decoder-only logits ``(B, T, V)`` of one forward without a cache."""
        return self.m(input_ids=ids, attention_mask=keep, position_ids=positions, use_cache=False).logits

    def padded(self, side: str, p: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(ids (2, T), keep (2, T) long, real index (T - p,))``: the base tokens' first ``T - p``, padded."""
        T = self.T
        keep = torch.ones(T, dtype=torch.long, device=self.device)
        if side == "left":
            keep[:p], real = 0, torch.arange(p, T)
        else:
            keep[T - p :], real = 0, torch.arange(T - p)
        ids = torch.full_like(self.ids, self.pad)
        ids[:, real] = self.ids[:, : T - p]
        return ids, keep.expand(2, T), real

    def dependency_of(self, fn: Callable[[Tensor], Tensor], intended: Tensor, label: str):
        """The leak audit's perturbation check of ``fn(ids (M, T)) -> logits`` against ``intended``."""
        subject = from_callable(
            lambda ids, _mask: fn(ids), vocab_size=self.vocab, name=label, special_ids=self.special, dtype=self.dtype
        )
        rep = audit(
            subject,
            length=self.T,
            seed=self.seed,
            n_sequences=2,
            n_replacements=2,
            checks=("causality",),
            intended=intended,
        )
        return rep.dependency, rep.check("causality").leaks

    def result_from_leaks(self, scenario, impl, leaks, dep, intended, what: str, **kw) -> ConformResult:
        blocked = ~intended
        worst = float(dep[blocked].max()) if blocked.any() else 0.0
        first = {"query": leaks[0].i, "key": leaks[0].j} if leaks else None
        detail = (
            f"{len(leaks)} (query, key) pairs where {what}" if leaks else f"no output depends on {what.split()[-1]}"
        )
        return ConformResult(
            scenario,
            impl,
            passed=not leaks,
            detail=detail,
            max_deviation=worst,
            tolerance=str(self.tol),
            first=first,
            intended=intended,
            dependency=dep,
            offending=[(lk.i, lk.j) for lk in leaks],
            **kw,
        )

    # -- run -------------------------------------------------------------------------------------
    def run(self, impl: str, wanted: list[str]) -> list[ConformResult]:
        out = []
        for scenario in wanted:
            if (scenario == "source padding" and not self.enc_dec) or (self.enc_dec and scenario in _DECODER_ONLY):
                continue  # not this architecture's scenario
            try:
                out += self.seq2seq(scenario, impl) if self.enc_dec else self.decoder(scenario, impl, wanted)
            except Exception as err:  # the implementation itself failed: a verdict, not a crash of the suite
                out.append(_crashed(scenario, impl, err))
        return out

    def decoder(self, scenario: str, impl: str, wanted: list[str]) -> list[ConformResult]:
        if scenario == "causality":
            return self.causality(impl, with_window="sliding window" in wanted)
        if scenario == "sliding window":
            if "causality" in wanted:
                return []  # reported with causality: one measurement
            return [r for r in self.causality(impl, with_window=True) if r.scenario == scenario]
        if scenario == "layer reach":
            return [layer_reach(self.m, impl, self.windows, vocab=self.vocab, seed=self.seed, dtype=self.dtype)]
        if scenario in ("left padding", "right padding"):
            return [self.padding(scenario.split()[0], impl)]
        if scenario == "fully padded rows":
            return [self.fully_padded(impl)]
        if scenario.startswith("packed"):
            return [self.packed(impl, with_mask="all-ones" in scenario)]
        if scenario == "cache parity":
            return [self.cache(impl)]
        if scenario == "batched greedy":
            return [self.greedy(impl)]
        if scenario == "implementations agree":
            return [self.agreement(impl)]
        return [self.against_reference(impl)]

    # -- decoder-only scenarios ------------------------------------------------------------------
    def causality(self, impl: str, *, with_window: bool) -> list[ConformResult]:
        T, R = self.T, self.reach
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        band = (i - j <= R) if R is not None else torch.ones(T, T, dtype=torch.bool)  # (T, T)
        intended = _causal(T) & band
        dep, leaks = self.dependency_of(self.lm, intended, f"{impl} forward")
        self.dependency[impl] = (intended, dep)
        future = [lk for lk in leaks if lk.j > lk.i]
        out = [
            self.result_from_leaks("causality", impl, future, dep, _causal(T), "the output depends on a later token")
        ]
        if not with_window:
            return out
        if R is None:
            why = "no sliding window" if all(w is None for w in self.windows) else "a layer attends to every key"
            return out + [ConformResult("sliding window", impl, True, skipped=why)]
        old = [lk for lk in leaks if lk.j <= lk.i]
        unused = (band & _causal(T) & (dep == 0)).nonzero().tolist()
        outside = ~band & _causal(T)
        res = ConformResult(
            "sliding window",
            impl,
            passed=not old and not unused,
            max_deviation=float(dep[outside].max()) if outside.any() else 0.0,
            tolerance=f"{self.tol}; every key within the reach must have an effect",
            intended=intended,
            dependency=dep,
            offending=[(lk.i, lk.j) for lk in old] + [tuple(p) for p in unused],
        )
        windows = sorted({w for w in self.windows if w is not None})
        if old:
            res.first = {"query": old[0].i, "key": old[0].j}
            res.detail = f"{len(old)} outputs depend on a token more than {R} back (window {windows}, reach {R})"
        elif unused:
            res.first = {"query": unused[0][0], "key": unused[0][1]}
            res.detail = f"{len(unused)} keys within the reach {R} have no effect: the window is too narrow"
        else:
            res.detail = f"every output reaches exactly {R} tokens back (window {windows})"
        return out + [res]

    def padding(self, side: str, impl: str) -> ConformResult:
        T, p = self.T, N_PADS
        _, keep, real = self.padded(side, p)
        k1 = keep[:1]  # (1, T)
        pos = positions_from_mask(k1)  # (1, T)
        is_real = k1[0].bool().cpu()  # (T,)
        intended = (_causal(T) & is_real[None, :]) | ~is_real[:, None]  # pad rows: never read

        def fn(ids):
            return self.lm(ids, k1.expand(len(ids), T), pos.expand(len(ids), T))

        dep, leaks = self.dependency_of(fn, intended, f"{impl} {side}-padded")
        res = self.result_from_leaks(f"{side} padding", impl, leaks, dep, intended, "a real output depends on a pad")
        ids, keep, real = self.padded(side, p)
        alone = self.lm(self.ids[:, : T - p]).double()  # (2, T - p, V)
        got = self.lm(ids, keep, positions_from_mask(keep))[:, real].double()  # (2, T - p, V)
        delta = (got - alone).abs()
        ratio = self.agree.ratio(delta, alone).amax(dim=(0, 2))  # (T - p,)
        bad = _first_over(ratio)
        res.max_deviation = max(res.max_deviation, float(delta.max()))
        if bad is not None:
            res.passed = False
            res.first = res.first or {"position": int(real[bad])}
            res.detail = (
                f"real outputs differ from the unpadded sequence's (max |Δ| {float(delta.max()):.3g}, "
                f"{self.agree}); " + res.detail
            )
        return res

    def fully_padded(self, impl: str) -> ConformResult:
        rep = audit(from_hf(self.m), length=self.T, seed=self.seed, checks=("fully padded rows",))
        c = rep.check("fully padded rows")
        detail = c.problems[0] if c.problems else "an all-pad row gives finite logits and leaves its neighbour alone"
        return ConformResult("fully padded rows", impl, c.passed, detail, c.max_deviation, c.tolerance)

    def packed(self, impl: str, *, with_mask: bool) -> ConformResult:
        T = self.T
        lens = (T - T // 3 - T // 4, T // 3, T // 4)
        seg = torch.cat([torch.full((n,), k) for k, n in enumerate(lens)])  # (T,)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)[None]  # (1, T)
        intended = _causal(T) & (seg[:, None] == seg[None, :])  # (T, T)
        scenario = f"packed ({'all-ones' if with_mask else 'no'} mask)"

        def fn(ids):
            keep = torch.ones_like(ids) if with_mask else None
            return self.lm(ids, keep, pos.expand(len(ids), T))

        dep, leaks = self.dependency_of(fn, intended, f"{impl} packed")
        res = self.result_from_leaks(scenario, impl, leaks, dep, intended, "an output depends on another sample")
        got = fn(self.ids).double()  # (2, T, V)
        bounds = torch.cumsum(torch.tensor((0, *lens)), 0).tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            alone = self.lm(self.ids[:, a:b]).double()  # (2, n, V)
            delta = (got[:, a:b] - alone).abs()
            res.max_deviation = max(res.max_deviation, float(delta.max()))
            bad = _first_over(self.agree.ratio(delta, alone).amax(dim=(0, 2)))
            if bad is not None and res.passed:
                res.passed = False
                res.first = {"position": a + bad}
                res.detail = f"a sample's outputs differ from those it gets alone (max |Δ| {float(delta.max()):.3g})"
        return res

    def cache(self, impl: str) -> ConformResult:
        subject = from_hf(self.m)
        worst, first, where = 0.0, None, ""
        variants = [
            ("no padding", self.ids, torch.ones_like(self.ids)),
            ("left padding", *self.padded("left", N_PADS)[:2]),
        ]
        for label, ids, keep in variants:
            with torch.no_grad():
                full = subject.forward(ids, keep).double()  # (2, T, V)
                cached = subject.cached_forward(ids, keep).double()  # (2, T, V)
            real = keep.bool()  # (2, T)
            delta = (cached - full).abs() * real[..., None]
            worst = max(worst, float(delta.max()))
            bad = _first_over(self.agree.ratio(delta, full).amax(dim=(0, 2)))
            if bad is not None and first is None:
                first, where = {"position": bad}, label
        res = ConformResult("cache parity", impl, first is None, max_deviation=worst, tolerance=str(self.agree))
        if first is None:
            res.detail = (
                "token-by-token decoding with past_key_values equals the full forward (no padding, left padding)"
            )
            return res
        res.first, res.detail = first, f"cached logits differ from the full forward ({where}, max |Δ| {worst:.3g})"
        T = self.T
        dep, leaks = self.dependency_of(
            lambda ids: subject.cached_forward(ids, torch.ones_like(ids)), _causal(T), f"{impl} cached"
        )
        res.intended, res.dependency, res.offending = _causal(T), dep, [(lk.i, lk.j) for lk in leaks]
        return res

    @torch.no_grad()
    def generate(self, prompts: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Greedy: ``(tokens (B, N_NEW_TOKENS), logits (B, N_NEW_TOKENS, V))``, prompts left-padded."""
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad, dtype=torch.long, device=self.device)
        keep = torch.zeros(B, L, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, L - len(p) :], keep[b, L - len(p) :] = p, 1
        pos = positions_from_mask(keep)  # (B, L)
        out = self.m(input_ids=ids, attention_mask=keep, position_ids=pos, use_cache=True)
        tokens, logits = [], [out.logits[:, -1]]
        for _ in range(N_NEW_TOKENS):
            nxt = logits[-1].argmax(-1, keepdim=True)  # (B, 1)
            tokens.append(nxt)
            if len(tokens) == N_NEW_TOKENS:
                break
            keep = torch.cat([keep, torch.ones_like(nxt)], 1)
            pos = pos[:, -1:] + 1  # (B, 1)
            out = self.m(
                input_ids=nxt,
                attention_mask=keep,
                position_ids=pos,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
        return torch.cat(tokens, 1), torch.stack(logits, 1).double()

    def greedy(self, impl: str) -> ConformResult:
        T = self.T
        prompts = [self.ids[0], self.ids[1, : T - 3], self.ids[0, 2 : T - 5]]
        tokens, logits = self.generate(prompts)
        worst, first, detail = 0.0, None, ""
        for b, p in enumerate(prompts):
            t1, l1 = self.generate([p])
            same = (tokens[b] == t1[0]).tolist()
            upto = same.index(False) + 1 if False in same else N_NEW_TOKENS  # logits compared up to the first split
            delta = (logits[b, :upto] - l1[0, :upto]).abs()
            worst = max(worst, float(delta.max()))
            bad = _first_over(self.agree.ratio(delta, l1[0, :upto]).amax(-1))
            step = upto - 1 if False in same else bad
            if step is not None and first is None:
                first = {"position": len(p) + step, "prompt": b}
                detail = (
                    f"prompt {b} (length {len(p)}) batched with left padding: "
                    + (f"greedy token {step} differs" if False in same else f"logits at step {step} differ")
                    + f" from decoding it alone (max |Δ| {worst:.3g})"
                )
        res = ConformResult("batched greedy", impl, first is None, detail, worst, str(self.agree), first)
        if first is None:
            res.detail = f"3 prompts, {N_NEW_TOKENS} greedy tokens each: batched = one at a time"
            return res
        subject = from_hf(self.m)
        _, keep, _ = self.padded("left", N_PADS)
        is_real = keep[0].bool().cpu()
        intended = (_causal(T) & is_real[None, :]) | ~is_real[:, None]
        dep, leaks = self.dependency_of(
            lambda ids: subject.cached_forward(ids, keep[:1].expand(len(ids), T)), intended, f"{impl} cached, padded"
        )
        res.intended, res.dependency, res.offending = intended, dep, [(lk.i, lk.j) for lk in leaks]
        return res

    def comparison_batch(self) -> tuple[Tensor, Tensor]:
        """Row 0 unpadded, row 1 left-padded: ``(ids (2, T), keep (2, T))``."""
        ids, keep, _ = self.padded("left", N_PADS)
        return torch.stack([self.ids[0], ids[1]]), torch.stack([torch.ones_like(keep[0]), keep[1]])

    def compare(self, scenario: str, impl: str, got: Tensor, ref: Tensor, keep: Tensor, against: str):
        real = keep.bool()
        delta = (got - ref).abs() * real[..., None]
        ratio = self.agree.ratio(delta, ref).amax(dim=(0, 2))  # (T,)
        bad = _first_over(ratio)
        res = ConformResult(scenario, impl, bad is None, max_deviation=float(delta.max()), tolerance=str(self.agree))
        res.detail = (
            f"logits {'differ from' if bad is not None else 'match'} {against} (max |Δ| {float(delta.max()):.3g})"
        )
        if bad is not None:
            res.first = {"position": bad}
            if impl in self.dependency:
                res.intended, res.dependency = self.dependency[impl]
        return res

    def logits_for_comparison(self) -> tuple[Tensor, Tensor]:
        if self.enc_dec:
            src, skeep, tgt = self.seq2seq_batch()
            with torch.no_grad():
                out = self.m(input_ids=src, attention_mask=skeep, decoder_input_ids=tgt).logits.double()
            return out, torch.ones_like(tgt)
        ids, keep = self.comparison_batch()
        return self.lm(ids, keep, positions_from_mask(keep)).double(), keep

    def agreement(self, impl: str) -> ConformResult:
        got, keep = self.logits_for_comparison()
        if self.baseline is None:
            self.baseline, self.baseline_impl = got, impl
            return ConformResult("implementations agree", impl, True, skipped="the baseline the others are compared to")
        return self.compare("implementations agree", impl, got, self.baseline, keep, self.baseline_impl)

    @torch.no_grad()
    def against_reference(self, impl: str) -> ConformResult:
        if self.ref_logits is None and not self.ref_why:
            ref, self.ref_why = reference_model(self.m)
            if ref is not None:
                ref = ref.to(self.device)
                if self.enc_dec:
                    src, skeep, tgt = self.seq2seq_batch()
                    smask = masks.padding(keep=skeep.bool())
                    memory = ref.encode(src, smask)
                    self.ref_logits = ref.decode(tgt, memory, memory_mask=smask, mask=masks.causal())
                else:
                    ids, keep = self.comparison_batch()
                    window = self.windows[0] if self.windows else None
                    if ref.config.sliding_window:  # the reference applies its own per-layer windows
                        window = None
                    shape = masks.causal() if window is None else masks.sliding_window(window)
                    mask = shape & masks.padding(keep=keep.bool())
                    self.ref_logits = ref.decode(ids, mask=mask, positions=positions_from_mask(keep))
                del ref
        if self.ref_logits is None:
            return ConformResult("float64 reference", impl, True, skipped=self.ref_why)
        got, keep = self.logits_for_comparison()
        return self.compare(
            "float64 reference", impl, got, self.ref_logits.double(), keep, "attnmask's float64 reference"
        )

    # -- encoder-decoder -------------------------------------------------------------------------
    def seq2seq_batch(self) -> tuple[Tensor, Tensor, Tensor]:
        """Source (2, S) with row 1 right-padded by N_PADS, its keep mask, and the target (2, T)."""
        src, skeep = self.src.clone(), torch.ones_like(self.src)
        src[1, -N_PADS:], skeep[1, -N_PADS:] = self.pad, 0
        return src, skeep, self.ids

    def seq2seq(self, scenario: str, impl: str) -> list[ConformResult]:
        if scenario in ("implementations agree",):
            return [self.agreement(impl)]
        if scenario == "float64 reference":
            return [self.against_reference(impl)]
        check = {"causality": "causality", "right padding": "padding"}.get(scenario, scenario)
        rep = audit(from_hf(self.m), length=self.T, src_length=self.T, seed=self.seed, checks=(check,))
        c = rep.check(check)
        if c.skipped:
            return [ConformResult(scenario, impl, True, skipped=c.skipped)]
        first = c.first_leak
        res = ConformResult(scenario, impl, c.passed, max_deviation=c.max_deviation, tolerance=c.tolerance)
        if first is not None:
            res.first = {"query": first.i, "key": first.j} if first.j is not None else {"position": first.i}
            res.detail = first.describe()
        else:
            res.detail = c.problems[0] if c.problems else "; ".join(c.details)
        if check == "causality":
            res.intended, res.dependency = rep.intended, rep.dependency
            res.offending = [(lk.i, lk.j) for lk in c.leaks]
        return [res]
