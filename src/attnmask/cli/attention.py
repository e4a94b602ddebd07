"""``attnmask attention``: pictures of a trained model's attention for one sentence.

The sentence is translated (or continued, for a language model) greedily; then the decoder input
that produced the output is run once more with the weights recorded, and every layer and head is
drawn with token labels, the mask beside it: encoder self-attention, decoder self-attention and
cross-attention, one PNG each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor

from attnmask.cli.common import check_args
from attnmask.data.tokenizer import SOS_ID
from attnmask.decode import default_max_new_tokens, greedy, source_ids
from attnmask.errors import UserError

DEFAULT_OUT = "attention"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "attention",
        help="draw a trained model's attention weights per layer and head for a sentence (PNG)",
        description="Greedily translate SENTENCE (or continue it, for a language model) with a trained run, "
        "then draw the attention weights of every layer and head with token labels and the attention mask "
        "beside them: encoder self-attention, decoder self-attention and cross-attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("sentence", help="the source sentence (translation) or the prompt (language model)")
    p.add_argument("--run", required=True, metavar="DIR", help="a run directory written by `attnmask train`")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the PNG files go (default: attention/ in the current directory)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest output (default: 1.5 x source + 10 for translation, 20 for a language model)",
    )
    p.add_argument("--max-heads", type=int, default=None, help="draw at most this many heads per layer")
    p.set_defaults(func=run)


@torch.no_grad()
def _label(tokenizer, token_id: int) -> str:
    # byte-level BPE spells a leading space "Ġ"; a bare space would be an invisible tick label
    text = tokenizer.id_to_token(token_id).replace("Ġ", "␣").replace(" ", "␣")
    return text if len(text) <= 12 else text[:11] + "…"


def _grid(mask, B: int, Tq: int, Tk: int) -> Tensor:
    if mask is None:  # no pad id: nothing masked
        return torch.ones(Tq, Tk, dtype=torch.bool)
    return mask.to_bool(B, Tq, Tk)[0, 0]  # (Tq, Tk)


def run(args) -> int:
    from attnmask.train.rundir import load_run
    from attnmask.viz import record_attention, save_attention_png

    check_args(args)
    args.out_given = args.out is not None
    args.out = args.out if args.out_given else DEFAULT_OUT
    if args.max_heads is not None and args.max_heads < 1:
        raise UserError(f"--max-heads must be >= 1, got {args.max_heads}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    loaded = load_run(args.run)
    model, tok = loaded.model, loaded.tokenizer
    enc_dec = model.is_encoder_decoder
    if not args.sentence.strip():
        raise UserError("the sentence is empty; expected some text")
    if enc_dec:
        src_ids = source_ids(loaded.src_tokenizer, [args.sentence])[0]  # as in training
        # the decoder input <sos> + out is re-run below, so out stays within max_seq_len - 1
        limit = min(
            args.max_new_tokens or default_max_new_tokens(len(src_ids), model.config.max_seq_len),
            model.config.max_seq_len - 1,
        )
        out = greedy(model, src=[src_ids], max_new_tokens=limit)[0]
        dec_ids = [SOS_ID] + out
        print(f"translation: {tok.decode(out)}")
    else:
        src_ids = tok.encode(args.sentence)
        if len(src_ids) >= model.config.max_seq_len:
            raise UserError(f"the prompt has {len(src_ids)} tokens; the model takes at most {model.config.max_seq_len}")
        limit = min(args.max_new_tokens or 20, model.config.max_seq_len - len(src_ids))  # prompt + out re-run below
        out = greedy(model, prompts=[src_ids], max_new_tokens=limit)[0]
        dec_ids = src_ids + out
        print(f"continuation: {tok.decode(out)}")

    dec = torch.tensor([dec_ids])  # (1, T)
    with torch.no_grad(), record_attention(model) as rec:
        if enc_dec:
            src = torch.tensor([src_ids])  # (1, S)
            memory_mask = model.source_mask(src)
            model.decode(dec, model.encode(src, memory_mask), memory_mask=memory_mask)
        else:
            model.decode(dec)
    T = dec.shape[1]
    dec_labels = [_label(tok, i) for i in dec_ids]
    figures = [
        ("decoder_self", "decoder self-attention", rec["decoder"], dec_labels, dec_labels, model.target_mask(dec))
    ]
    if enc_dec:
        src_labels = [_label(loaded.src_tokenizer, i) for i in src_ids]
        smask = model.source_mask(src)
        figures = [
            ("encoder_self", "encoder self-attention", rec["encoder"], src_labels, src_labels, smask),
            figures[0],
            ("cross", "cross-attention (decoder queries, encoder keys)", rec["cross"], dec_labels, src_labels, smask),
        ]
    out_dir = Path(args.out)
    # said before writing: the default --out is a folder in the current directory
    print(
        f"writing {len(figures)} picture(s) to {out_dir.resolve()}"
        + ("" if args.out_given else " (set with --out DIR)")
    )
    for name, title, weights, q_labels, k_labels, mask in figures:
        grid = _grid(mask, 1, len(q_labels), len(k_labels))
        path = save_attention_png(
            out_dir / f"{name}.png",
            [w[0] for w in weights],  # one (H, Tq, Tk) per layer
            q_labels,
            k_labels,
            mask=grid,
            title=f"{title}: {len(weights)} layers x {weights[0].shape[1]} heads, T={T}",
            max_heads=args.max_heads,
        )
        print(f"wrote {path}")
    return 0
