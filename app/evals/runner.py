"""Running an eval set on models the engine serves (adapter versions and the base model),
as a tenant of the batch tier would: its own fair-share account, the batch tier's
priority, a few sequences at a time, and one at a time while other requests are in the
engine (each eval sequence decodes in the same steps as theirs, and its prompt is
prefilled in the same steps as theirs)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.evals.dataset import ChoiceItem, EvalItem, GenerationItem
from app.tables import Tier
from engine.client import EngineClient, RouteHint
from engine.request import EngineRequest, RequestOutput, SamplingParams, TenantContext

# Scheduling: what a batch-tier tenant gets (served after every other tier's requests;
# its own fair share), and at most this many of its sequences at once.
EVAL_PRIORITY = Tier.BATCH.priority
EVAL_MAX_RUNNING = 4
EVAL_TENANT = TenantContext(tenant_id="__evals__", max_running=EVAL_MAX_RUNNING)
# With other requests running or waiting, at most this many of the eval's at once; the
# engine's counts are looked at this often while the eval holds back.
EVAL_MAX_RUNNING_BUSY = 1
YIELD_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class Target:
    label: str  # "version", "previous", "base"
    adapter: str | None  # the engine's adapter name; None: the base model


class EvalRunError(RuntimeError):
    """The engine failed an eval's request; the message says which and why."""


async def score(
    engine: EngineClient,
    items: Sequence[EvalItem],
    target: Target,
    *,
    on_item: Callable[[], None] = lambda: None,
) -> float:
    """The fraction of `items` the target gets right."""
    gate = asyncio.Semaphore(EVAL_MAX_RUNNING)
    # NOTE: the engine's counts include an eval request only once the engine took it; until
    # its first output (`unsettled`) no further one starts, so that the engine's count of
    # requests beyond the eval's own never counts one of ours.
    in_flight = unsettled = 0

    async def one(item: EvalItem) -> bool:
        nonlocal in_flight, unsettled
        async with gate:
            while in_flight >= EVAL_MAX_RUNNING_BUSY and (
                    unsettled or others_in(engine, in_flight)):
                await asyncio.sleep(YIELD_POLL_S)
            in_flight += 1
            unsettled += 1
            settled = False

            def started() -> None:
                nonlocal unsettled, settled
                if not settled:
                    settled, unsettled = True, unsettled - 1

            try:
                if isinstance(item, GenerationItem):
                    right = await _generation(engine, item, target, started)
                else:
                    right = await _choice(engine, item, target, started)
            finally:
                started()
                in_flight -= 1
        on_item()
        return right

    results = await asyncio.gather(*(one(item) for item in items))
    return sum(results) / len(results)


def others_in(engine: EngineClient, ours: int) -> bool:
    """Whether the engine runs or queues requests beyond the eval's own `ours`."""
    stats = engine.stats()
    return stats.num_running + stats.num_waiting > ours


async def _generation(engine: EngineClient, item: GenerationItem, target: Target,
                      started: Callable[[], None]) -> bool:
    prompt = await asyncio.to_thread(
        engine.apply_chat_template, [{"role": "user", "content": item.prompt}]
    )
    sampling = SamplingParams(max_tokens=item.max_tokens, temperature=0)
    outputs = await _run(engine, prompt, sampling, target, started)
    text = "".join([out.new_text for out in outputs])
    return item.passes(text)


async def _choice(engine: EngineClient, item: ChoiceItem, target: Target,
                  started: Callable[[], None]) -> bool:
    context = await asyncio.to_thread(engine.encode, item.prompt)
    totals = []
    for choice in item.choices:
        continuation = await asyncio.to_thread(engine.encode, " " + choice)
        sampling = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outputs = await _run(engine, [*context, *continuation], sampling, target, started)
        entries = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
        scored = entries[len(context):]
        if not scored or any(e is None for e in scored):
            raise EvalRunError("the engine returned no prompt logprobs for a choice")
        totals.append(sum(e.logprob for e in scored if e is not None))
    return max(range(len(totals)), key=totals.__getitem__) == item.answer


async def _run(
    engine: EngineClient, prompt: Sequence[int], sampling: SamplingParams, target: Target,
    started: Callable[[], None],
) -> list[RequestOutput]:
    request_id = f"eval-{uuid.uuid4().hex}"
    request = EngineRequest(
        request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling,
        adapter=target.adapter, salt=EVAL_TENANT.tenant_id, priority=EVAL_PRIORITY,
        tenant=EVAL_TENANT,
    )
    engine.route([request_id], RouteHint(adapter=target.adapter))
    outputs: list[RequestOutput] = []
    try:
        async for output in engine.generate(request):
            started()
            outputs.append(output)
            if output.finished:
                break
    except Exception as e:
        raise EvalRunError(f"{target.label} ({target.adapter or 'the base model'}): {e}") from e
    if not outputs or outputs[-1].finish_reason == "abort":
        raise EvalRunError(f"{target.label}: the engine aborted an eval request")
    return outputs
