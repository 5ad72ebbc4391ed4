"""What `loraplex bench serve` sends, and when: open-loop arrival times, the request mix
(lengths from ranges or a JSONL dataset, adapters, shared per-tenant prefixes)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.workload import random_token_ids
from bench.lora import zipf_choices

# Words of the text system prompts given to dataset prompts that are text.
_PREFIX_WORDS = (
    "you", "are", "a", "helpful", "assistant", "answer", "briefly", "and", "politely",
    "the", "customer", "account", "order", "policy", "always", "never", "refund", "ticket",
)


# ---------------------------------------------------------------------------- arrivals


def parse_rates(values: Sequence[str]) -> list[float]:
    """`--rate` values, each one rate or a comma list; "inf" sends a run's requests all at
    once. Raises ValueError on anything that is not a positive number or inf."""
    rates: list[float] = []
    for value in values:
        for part in value.split(","):
            part = part.strip().lower()
            if not part:
                continue
            rate = math.inf if part in ("inf", "infinity") else float(part)
            if not rate > 0:
                raise ValueError(f"a request rate must be > 0 or inf, not {part!r}")
            rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def arrival_times(
    rate: float, *, num_requests: int | None, duration_s: float | None = None,
    burstiness: float = 1.0, seed: int = 0,
) -> list[float]:
    """Seconds after the start at which each request is sent, the first at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate (scale
    1 / (rate * burstiness)): burstiness 1 is a Poisson process, below 1 the arrivals
    come in bursts, above 1 more evenly. Arrivals stop at `num_requests` or at
    `duration_s`, whichever comes first. Rate inf: `num_requests` arrivals, all at 0."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, not {burstiness}")
    if num_requests is None and duration_s is None:
        raise ValueError("give a number of requests, a duration or both")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("rate inf needs a number of requests")
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    times: list[float] = []
    t = 0.0
    while num_requests is None or len(times) < num_requests:
        if duration_s is not None and t >= duration_s:
            break
        times.append(t)
        t += rng.gammavariate(burstiness, scale)
    return times


# ---------------------------------------------------------------------------- dataset


@dataclass(frozen=True, slots=True)
class DatasetEntry:
    """One JSONL line: a prompt (text or token ids) or only its length, and the number of
    tokens to generate."""

    output_len: int
    prompt: str | list[int] | None = None
    prompt_len: int | None = None  # only when `prompt` is None: random tokens this long


def load_dataset(path: Path) -> list[DatasetEntry]:
    """Lines `{"prompt": "..." | [ids], "output_len": N}` or `{"prompt_len": M,
    "output_len": N}`; blank lines are skipped. ValueError names the first bad line."""
    entries: list[DatasetEntry] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(_entry(json.loads(line)))
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not entries:
        raise ValueError(f"{path}: no requests")
    return entries


def _entry(row: object) -> DatasetEntry:
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    output_len = _positive_int(row, "output_len")
    prompt = row.get("prompt")
    if prompt is None:
        return DatasetEntry(output_len=output_len, prompt_len=_positive_int(row, "prompt_len"))
    if isinstance(prompt, str) and prompt:
        return DatasetEntry(output_len=output_len, prompt=prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return DatasetEntry(output_len=output_len, prompt=list(prompt))
    raise ValueError('"prompt" must be a non-empty string or list of token ids')


def _positive_int(row: dict[str, object], key: str) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'needs "{key}", a positive integer (got {value!r})')
    return value


# ---------------------------------------------------------------------------- the mix


@dataclass(slots=True)
class MixOptions:
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 128)
    dataset: list[DatasetEntry] | None = None  # replaces the two ranges
    adapters: list[str] | None = None  # None or empty: every request on the base model
    adapter_dist: str = "uniform"  # uniform | zipf
    zipf_alpha: float = 1.0
    shared_prefix_fraction: float = 0.0
    shared_prefix_len: int = 256


@dataclass(slots=True)
class ServeRequest:
    prompt: str | list[int]
    output_len: int
    adapter: str | None  # None: the base model
    prompt_len: int | None  # None: a text prompt, counted by the server
    shared_prefix: bool = False


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a request is, before its tokens are drawn: the same at every rate."""

    entry: DatasetEntry  # without a dataset: only lengths, drawn from the ranges
    adapter: str | None
    shared_prefix: bool


def build_requests(
    count: int, mix: MixOptions, *, vocab_size: int | None, seed: int, content_seed: int
) -> list[ServeRequest]:
    """`count` requests. Lengths, adapters and which requests share a prefix follow
    `seed`; random prompt tokens follow `content_seed`.

    NOTE: a sweep keeps `seed` and changes `content_seed` per rate: every rate gets the
    same mix, but no rate's random prompts are in the prefix cache from an earlier rate;
    only the shared prefixes (one per adapter, the same at every rate) are meant to be.
    A shared prefix replaces the first `shared_prefix_len` tokens of a random prompt (at
    least one token of its own is left), so the fraction changes what can be cached, not
    the work. A dataset's prompt keeps all of its own: the prefix goes in front of it (a
    text prompt gets a text prefix of that many words)."""
    shapes = _shapes(count, mix, seed)
    if vocab_size is None and any(_needs_vocab(s) for s in shapes):
        raise ValueError("random token prompts need the model's vocabulary size")
    rng = random.Random(content_seed)
    return [_realize(shape, mix, vocab_size, rng, seed) for shape in shapes]


def _shapes(count: int, mix: MixOptions, seed: int) -> list[_Shape]:
    rng = random.Random(seed)
    adapters = _adapter_draws(count, mix, seed)
    entries = list(mix.dataset or [])
    rng.shuffle(entries)
    shapes: list[_Shape] = []
    for i in range(count):
        shared = rng.random() < mix.shared_prefix_fraction
        if entries:
            entry = entries[i % len(entries)]
        else:
            prompt_len = rng.randint(*mix.prompt_len)
            entry = DatasetEntry(rng.randint(*mix.output_len), prompt_len=prompt_len)
        shapes.append(_Shape(entry, adapters[i], shared))
    return shapes


def _needs_vocab(shape: _Shape) -> bool:
    entry = shape.entry
    return entry.prompt_len is not None or (shape.shared_prefix and isinstance(entry.prompt, list))


def _adapter_draws(count: int, mix: MixOptions, seed: int) -> list[str | None]:
    if not mix.adapters:
        return [None] * count
    if mix.adapter_dist not in ("uniform", "zipf"):
        raise ValueError(f"unknown adapter distribution {mix.adapter_dist!r}")
    alpha = mix.zipf_alpha if mix.adapter_dist == "zipf" else 0.0  # alpha 0: uniform
    return list(zipf_choices(mix.adapters, count, alpha, seed))


def _realize(
    shape: _Shape, mix: MixOptions, vocab_size: int | None, rng: random.Random, seed: int
) -> ServeRequest:
    entry, prefix_len = shape.entry, mix.shared_prefix_len if shape.shared_prefix else 0
    if entry.prompt_len is not None:
        assert vocab_size is not None
        own = random_token_ids(rng, max(entry.prompt_len - prefix_len, 1), vocab_size)
        prompt: str | list[int] = _prefix_tokens(shape.adapter, prefix_len, vocab_size, seed) + own
        prompt_len: int | None = len(prompt)
    elif isinstance(entry.prompt, str):
        prompt, prompt_len = entry.prompt, None
        if prefix_len:
            prompt = _prefix_text(shape.adapter, prefix_len, seed) + "\n\n" + prompt
    else:
        assert entry.prompt is not None
        prompt = entry.prompt
        if prefix_len:
            assert vocab_size is not None
            prompt = _prefix_tokens(shape.adapter, prefix_len, vocab_size, seed) + prompt
        prompt_len = len(prompt)
    return ServeRequest(prompt, entry.output_len, shape.adapter, prompt_len, shape.shared_prefix)


def _prefix_tokens(adapter: str | None, n: int, vocab_size: int, seed: int) -> list[int]:
    """The system prompt of one tenant (adapter), the same for all its requests."""
    if n == 0:
        return []
    return random_token_ids(random.Random(f"prefix:{seed}:{adapter}"), n, vocab_size)


def _prefix_text(adapter: str | None, n: int, seed: int) -> str:
    rng = random.Random(f"prefix:{seed}:{adapter}")
    return " ".join(rng.choice(_PREFIX_WORDS) for _ in range(n))
