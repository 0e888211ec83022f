from __future__ import annotations

import os

# No test may reach the Hugging Face Hub: huggingface_hub reads this when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.synthetic import TinyCheckpoint, build_tiny_deepseek

_counter = itertools.count()


@pytest.fixture
def make_tiny(tmp_path: Path) -> Callable[..., TinyCheckpoint]:
    """Build a tiny DeepSeek-like block-FP8 checkpoint in a fresh folder under tmp_path."""

    def build(**kwargs) -> TinyCheckpoint:
        return build_tiny_deepseek(tmp_path / f"ckpt{next(_counter)}", **kwargs)

    return build


@pytest.fixture
def tiny(make_tiny) -> TinyCheckpoint:
    return make_tiny()
