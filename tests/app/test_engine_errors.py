"""What a client gets for an engine request that raised: app.api.engine_errors.api_error_of."""

from __future__ import annotations

import pytest

from app.api.engine_errors import api_error_of
from engine.errors import EngineDeadError, EngineStepError, RequestRejected, WorkerLost


def _status(exc: BaseException, *, draining: bool) -> tuple[int, str | None]:
    error = api_error_of(exc, model="m", request_id="req-1", draining=draining,
                         retry_after_s=3)
    return error.status_code, error.code


@pytest.mark.parametrize("draining", [False, True])
def test_a_step_that_failed_on_the_request_is_a_500_even_once_the_drain_began(
    draining: bool,
) -> None:
    # The engine fails for good on its third failed step in a row; the drain that starts
    # then must not turn the third request's own failure into a retryable "shutting down".
    assert _status(EngineStepError("the engine step running this request failed"),
                   draining=draining)[0] == 500


def test_a_request_cut_off_by_the_drain_is_a_503() -> None:
    assert _status(EngineDeadError("engine shut down"), draining=True) == (503, "overloaded")
    assert _status(EngineDeadError("engine shut down"), draining=False)[0] == 500


@pytest.mark.parametrize("draining", [False, True])
def test_a_request_the_failed_engine_ended_is_a_500_even_once_the_drain_began(
    draining: bool,
) -> None:
    # The engine process was killed: the server drains because of it, and whether the
    # stream hears of the failure before or after the drain began must not matter.
    dead = EngineDeadError.failed("the engine process exited (exit code -9)")
    assert str(dead) == "engine failed: the engine process exited (exit code -9)"
    assert _status(dead, draining=draining) == (500, None)


def test_refusals_and_lost_workers_keep_their_status_while_draining() -> None:
    rejected = RequestRejected("too long", param="max_tokens", code="context_length_exceeded")
    assert _status(rejected, draining=True)[0] == 400
    assert _status(WorkerLost("gone"), draining=True)[0] == 502
