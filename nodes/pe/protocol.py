"""What every prompt-enhancer backend shares: the user message, sampling parameters, results, errors.

The PE expects one user message, exactly ``json.dumps({"prompt", "width", "height"}, ensure_ascii=False)``, rendered
by the PE tokenizer's chat template without a generation prompt (diffusers' ``ErnieImagePipeline`` and Baidu's
serving recipe). Plain Python: no torch, no ComfyUI.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import ErnieImageError

# Baidu's serving recipe (diffusers uses top_p 0.95).
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.8
DEFAULT_MAX_NEW_TOKENS = 2048


class EnhancerError(ErnieImageError):
    """A prompt enhancer could not produce a prompt; the message says which part failed and what to do."""


class GenerationStopped(Exception):
    """Generation was stopped on request (ComfyUI's interrupt)."""


def user_message(prompt: str, width: int, height: int) -> str:
    """The PE's user message: the prompt and the target size as one JSON object, non-ASCII kept as is."""
    return json.dumps({"prompt": prompt, "width": width, "height": height}, ensure_ascii=False)


def chat_messages(prompt: str, width: int, height: int) -> list[dict[str, str]]:
    """The chat conversation sent to the PE: a single user turn."""
    return [{"role": "user", "content": user_message(prompt, width, height)}]


@dataclass(frozen=True)
class PromptSpec:
    """One prompt to enhance and the image size it is for."""

    prompt: str
    width: int = 1024
    height: int = 1024

    def __post_init__(self) -> None:
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate, e.g. half an emoji from a broken text source
            raise EnhancerError(
                f"The prompt is not valid Unicode text ({error.reason} at character {error.start}): remove it or "
                "fix the text where it comes from."
            ) from error

    def messages(self) -> list[dict[str, str]]:
        return chat_messages(self.prompt, self.width, self.height)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy decoding. The same seed gives the same text."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.seed < 0:
            raise ValueError(f"seed must not be negative, got {self.seed}")


@dataclass(frozen=True)
class Completion:
    """An enhanced prompt; ``truncated`` when generation stopped at ``max_new_tokens`` instead of finishing."""

    text: str
    truncated: bool = False


# ``on_result(i, completion)``: prompt ``i``'s text, handed over as soon as it is ready.
ResultCallback = Callable[[int, Completion], None]


class PromptEnhancer(Protocol):
    """A backend: local weights or a remote server. ``identity`` names what produces the text (for the cache)."""

    @property
    def identity(self) -> str: ...

    def enhance(
        self, specs: Sequence[PromptSpec], params: SamplingParams, on_result: ResultCallback | None = None
    ) -> list[Completion]:
        """Enhance every prompt, in order. ``on_result`` gets each text as soon as it is ready, before an error for
        another prompt of the batch is raised, so that the finished work can be kept."""
        ...
