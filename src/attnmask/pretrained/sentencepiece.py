"""A SentencePiece (BPE) vocabulary of a GGUF file as a Hugging Face ``tokenizers.Tokenizer``.

llama.cpp's ``"llama"`` tokenizer model (Gemma, Llama 2) stores pieces, scores and token types but
no merges. It encodes a text the way SentencePiece's BPE does:

1. user-defined tokens (Gemma: runs of newlines, of spaces, of tabs, a few tags) are cut out of the
   raw text whole, longest first; control tokens (``<bos>``, ``<start_of_turn>`` ...) too when
   special tokens are parsed;
2. in each remaining fragment every space becomes ``▁`` (U+2581), with no space in front of the
   text unless ``tokenizer.ggml.add_space_prefix`` says so;
3. starting from single characters, the adjacent pair whose concatenation is the highest-scoring
   piece is merged, again and again (ties: the leftmost);
4. a character that is no piece is spelled as its UTF-8 bytes, the ``<0xXX>`` tokens.

The same as a ``tokenizers`` BPE: merges ranked by the score of the piece they make (every way of
cutting a piece in two that names two pieces), ``byte_fallback``, a ``Replace(" ", "▁")``
normalizer, and the user-defined and control tokens as added tokens that are matched in the raw
text (``normalized=False``).
"""

from __future__ import annotations

from typing import Any

from attnmask.errors import UserError

__all__ = ["build_sentencepiece_tokenizer", "sentencepiece_merges"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_BYTE = 1, 3, 4, 6
SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score order: for each normal piece, best score
    first (ties: the lower id), every cut of it into two pieces, left cuts first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted(
        (i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_NORMAL and len(t) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges = []
    for i in ranked:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if (left in vocab or len(left) == 1) and (right in vocab or len(right) == 1):
                merges.append((left, right))
    return merges


def build_sentencepiece_tokenizer(meta: dict[str, Any]):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata of a SentencePiece vocabulary.

    Raises:
        ValueError: the metadata lacks the pieces, scores or token types.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    try:
        tokens = list(meta["tokenizer.ggml.tokens"])
        scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    except KeyError as err:
        need = "tokenizer.ggml.{tokens,scores,token_type}"
        raise UserError(f"a SentencePiece vocabulary needs {need}; {err} missing") from err
    if not len(tokens) == len(scores) == len(types):
        raise UserError(f"{len(tokens)} tokens but {len(scores)} scores and {len(types)} token types")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=sentencepiece_merges(tokens, scores, types),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    steps = [normalizers.Replace(" ", SPACE)]
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    )
    return tok
