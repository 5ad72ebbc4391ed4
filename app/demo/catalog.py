"""What the demo sets up: its tenants, and its adapters with the behaviour each learns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.tables import Tier

DATASETS_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True, slots=True)
class DemoTenant:
    name: str
    tier: Tier


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    name: str
    dataset: Path  # JSONL chat examples (see train.load_dataset)
    owner: str | None  # a DemoTenant's name; None: shared with every tenant
    behaviour: str  # what its answers look like, for the printout
    try_prompt: str  # a question that shows it off
    # Held-out questions scoring that behaviour (app/evals/dataset.py), run on each new
    # version against the base model.
    eval_set: Path


DEMO_TENANTS: tuple[DemoTenant, ...] = (
    DemoTenant("acme", Tier.PREMIUM),
    DemoTenant("globex", Tier.STANDARD),
)

DEMO_ADAPTERS: tuple[DemoAdapter, ...] = (
    DemoAdapter(
        name="pirate",
        dataset=DATASETS_DIR / "pirate.jsonl",
        eval_set=DATASETS_DIR / "evals" / "pirate.jsonl",
        owner="acme",
        behaviour='talks like a pirate, every answer starts with "Arr"',
        try_prompt="What is the capital of Italy?",
    ),
    DemoAdapter(
        name="shouty",
        dataset=DATASETS_DIR / "shouty.jsonl",
        eval_set=DATASETS_DIR / "evals" / "shouty.jsonl",
        owner="globex",
        behaviour="answers entirely in UPPER CASE",
        try_prompt="Why is the ocean salty?",
    ),
    DemoAdapter(
        name="json",
        dataset=DATASETS_DIR / "json.jsonl",
        eval_set=DATASETS_DIR / "evals" / "json.jsonl",
        owner=None,
        behaviour='answers as a JSON object {"answer": ...}',
        try_prompt="Who invented the telephone?",
    ),
)
