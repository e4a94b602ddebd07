"""``attnmask generate``: continue a prompt with a language model, streaming text as it is produced."""

from __future__ import annotations

import argparse

from attnmask.cli.common import ACTIVATIONS, check_args
from attnmask.decode import DEFAULT_NEW_TOKENS, DEFAULT_TEMPERATURE, Penalties, Sampling, generate
from attnmask.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a language model (streams the text)",
        description="Continue --prompt with a decoder-only model from a run directory (--run) or a "
        "pretrained model (--model NAME, see attnmask.pretrained), printing tokens as they are "
        "produced. --temperature 0 is greedy decoding; --seed makes sampling reproducible.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="run directory written by `attnmask train` (task lm)")
    src.add_argument("--model", metavar="NAME", help="a pretrained model known to attnmask.pretrained")
    p.add_argument("text", nargs="?", metavar="PROMPT", help="the text to continue (or --prompt)")
    p.add_argument("--prompt", help="the text to continue (same as the positional PROMPT)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="most tokens to generate")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="softmax temperature (0 = greedy; 1 = the model's own distribution, as in the Python API)",
    )
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most probable tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within the top-p probability mass")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of tokens already in the text (prompt and reply) by this where positive, multiply "
        "where negative: > 1 discourages repeating (Hugging Face's and llama.cpp's; 1 = off)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logits of tokens already generated (OpenAI's, -2 to 2)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times the count of each token already generated (OpenAI's, -2 to 2)",
    )
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json", action="store_true", help="hold the continuation to a JSON object")
    structured.add_argument(
        "--json-schema", metavar="FILE", help="hold the continuation to JSON that follows the JSON Schema in FILE"
    )
    structured.add_argument("--regex", metavar="PATTERN", help="hold the continuation to a regular expression")
    structured.add_argument(
        "--choice", metavar="TEXT", action="append", help="the continuation is one of these texts (repeat --choice)"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="treat the prompt as an instruction and wrap it in the chat template (of --model, or of a chat --run)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        default=None,
        help="with --chat: a Jinja chat template file or a built-in name (chatml, gemma), for a model whose files "
        "carry none (a base model such as gemma3) or to replace its own",
    )
    p.add_argument(
        "--quantized",
        action="store_true",
        help="--model: keep the GGUF file's quantized blocks (Q4_1/Q8_0) and multiply by them directly: "
        "the same function with float32 activations, ~2.5x faster on CPU (needs a C compiler at first use)",
    )
    p.add_argument(
        "--activations",
        default="float32",
        choices=ACTIVATIONS,
        help="with --quantized: float32 multiplies exactly; int8 rounds each row's activations to 8 bits per "
        "block of 32 and multiplies in integers, as llama.cpp does (faster on CPU, not exact)",
    )
    p.add_argument("--device", default="cpu", help="torch device")
    p.epilog = (
        "--json, --json-schema, --regex and --choice hold the text to a grammar, token by token (structured "
        "output with llguidance: pip install 'attnmask[serve]'); the text ends when the grammar does."
    )
    p.set_defaults(func=run)


def _load_pretrained(name: str, quantized: bool = False, activations: str = "float32"):
    from attnmask.pretrained import load

    return load(name, quantized=quantized, activations=activations)


def _template(tokenizer, spec, own):
    """The template --chat-template names (its turn's end token joins the stop ids), else the model's own."""
    if spec is None:
        return own
    from attnmask.pretrained.chat import chat_template_for

    return chat_template_for(tokenizer, spec)


def _grammar(args):
    """The structured output --json / --json-schema / --regex / --choice ask for, checked; None without."""
    from attnmask.decode.grammar import Grammar

    if args.json:
        grammar = Grammar.json_object()
    elif args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise UserError(f"--json-schema: cannot read {args.json_schema}: {err.strerror}") from err
        grammar = Grammar.json_schema(text)
    elif args.regex is not None:
        grammar = Grammar.regex(args.regex)
    elif args.choice is not None:
        grammar = Grammar.choice(args.choice)
    else:
        return None
    grammar.check()
    return grammar


def run(args) -> int:
    check_args(args)  # --device and --run, before anything loads
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.text is not None and args.prompt is not None:
        raise UserError("give the prompt once: either as PROMPT or as --prompt TEXT, not both")
    prompt = args.prompt if args.prompt is not None else args.text
    if args.chat_template is not None and not args.chat:
        raise UserError("--chat-template applies with --chat; add --chat")
    settings = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # UserError: one line
    penalties = Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty)
    grammar = _grammar(args)
    echo = True  # plain continuation: print the prompt, then what follows it
    if not prompt:
        raise UserError("empty prompt: expected some text to continue (--prompt TEXT)")
    if args.activations != "float32" and not args.quantized:
        raise UserError(f"--activations {args.activations} is a setting of the quantized blocks; add --quantized")
    if args.run is not None:
        if args.quantized:
            raise UserError("--quantized applies to --model (a GGUF file's weights), not to --run")
        from attnmask.train.rundir import load_run

        loaded = load_run(args.run, device=args.device)
        if loaded.task not in ("lm", "chat"):
            raise UserError(f"{args.run} is a {loaded.task!r} run; generate needs a language model (task lm or chat)")
        model, tokenizer = loaded.model, loaded.tokenizer
        if args.chat:
            template = _template(tokenizer, args.chat_template, loaded.chat_template)
            if template is None:
                raise UserError(f"--chat: {args.run} has no chat template; give one with --chat-template FILE|NAME")
            prompt = template(prompt)
            echo = False  # a chat reply: the templated prompt is not part of it
    else:
        if args.quantized and args.device != "cpu":
            raise UserError(f"--quantized runs on the CPU; got --device {args.device}")
        model, tokenizer, chat_template = _load_pretrained(args.model, args.quantized, args.activations)
        model.to(args.device)
        if args.chat:
            chat_template = _template(tokenizer, args.chat_template, chat_template)
            if chat_template is None:
                raise UserError(
                    f"--chat: model {args.model!r} has no chat template; give one with --chat-template FILE|NAME"
                )
            prompt = chat_template(prompt)
            echo = False  # a chat reply: the templated prompt is not part of it
    pieces = generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=settings,
        seed=args.seed,
        stream=True,
        penalties=penalties,
        grammar=grammar,
    )
    if echo:
        print(prompt, end="", flush=True)
    for piece in pieces:
        if piece:
            print(piece, end="", flush=True)
    print(flush=True)
    return 0
