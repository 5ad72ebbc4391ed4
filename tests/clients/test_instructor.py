"""instructor over the `openai` client against the server: `response_model` extraction by
function calling (Mode.TOOLS) and by a JSON-schema response format (Mode.JSON_SCHEMA),
with no retries, so that the first answer is the one that has to validate."""

from __future__ import annotations

import instructor
import pytest

from tests.clients.conftest import ClientService
from tests.clients.schemas import Person

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA],
                         ids=["tools", "json_schema"])
def test_response_model_is_extracted(service: ClientService, mode: instructor.Mode) -> None:
    client = instructor.from_openai(service.openai(), mode=mode)
    person, completion = client.chat.completions.create_with_completion(
        model=service.model, response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": "Who lives here?"}],
        max_tokens=300, temperature=0,
    )
    assert isinstance(person, Person)
    message = completion.choices[0].message
    dumped = person.model_dump()
    if mode is instructor.Mode.TOOLS:
        assert completion.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls or []
        assert call.function.name == "Person"
        assert Person.model_validate_json(call.function.arguments).model_dump() == dumped
    else:
        assert completion.choices[0].finish_reason == "stop"
        assert Person.model_validate_json(message.content or "").model_dump() == dumped
