"""``attnmask audit --model NAME`` measures a pretrained model in float64 unless ``--dtype`` says otherwise."""

from __future__ import annotations

import argparse

import pytest
import torch

from attnmask.cli.audit import add_parser, build_subject
from attnmask.errors import UserError
from attnmask.pretrained import MODELS, locate


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["audit", *argv])


@pytest.mark.slow  # loads SmolLM2 (a few seconds from the weight cache)
def test_a_pretrained_model_is_audited_in_float64_by_default():
    try:
        locate("smollm2")
    except UserError:
        pytest.skip(f"SmolLM2 weights not installed ({MODELS['smollm2'].install})")
    default = build_subject(parse("--model", "smollm2"))
    assert default.dtype == torch.float64  # the logits, so the float64 tolerance
    asked = build_subject(parse("--model", "smollm2", "--dtype", "float32"))
    assert asked.dtype == torch.float32
