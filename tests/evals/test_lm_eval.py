"""lm-evaluation-harness end to end: its `local-completions` model against a live loraplex
(a tiny random model and a PEFT adapter), on the two tasks defined in tests/evals/tasks/
(a multiple-choice log-likelihood task and a `generate_until` one, local data: nothing
downloaded), against lm-eval's own `hf` model (`peft=` for the adapter) on the same
weights: the same per-item log-likelihoods within 1e-3, the same answers and scores."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_server import Served, serve_with_adapter

pytestmark = pytest.mark.slow

TASKS_DIR = REPO_ROOT / "tests" / "evals" / "tasks"
TASKS = ["loraplex_colors", "loraplex_capitals"]
LOGLIKELIHOOD_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[[str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tiny_model_factory("llama_gqa")
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("lm_eval") / "tuned", r=8,
                                alpha=32, targets=("q_proj", "v_proj", "o_proj"), seed=41)
    with serve_with_adapter(base, adapter) as served:
        yield served


def evaluate(model: str, model_args: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, batch_size=1, log_samples=True,
        # NOTE: only these tests' tasks: indexing lm-eval's thousands of built-in task
        # files takes ~10 s per TaskManager on 2 cores, and nothing here uses them.
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        random_seed=0,
        numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    assert results is not None
    return results


def through_loraplex(served: Served, model: str) -> dict[str, Any]:
    return evaluate("local-completions", ",".join([
        f"model={model}", f"base_url={served.base_url}/v1/completions",
        f"tokenizer={served.model_dir}", "tokenizer_backend=huggingface",
        "tokenized_requests=True", "num_concurrent=1", "max_retries=1",
    ]))


def per_item(results: dict[str, Any], task: str) -> dict[int, Any]:
    return {s["doc_id"]: s["filtered_resps"] for s in results["samples"][task]}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tasks' data files are relative to the repository; nothing may be downloaded.
    monkeypatch.chdir(REPO_ROOT)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_lm_eval_through_loraplex_equals_its_hf_model(
    served: Served, with_adapter: bool
) -> None:
    ours = through_loraplex(served, "tuned" if with_adapter else served.model_id)
    hf_args = f"pretrained={served.model_dir},dtype=float32,device=cpu"
    if with_adapter:
        hf_args += f",peft={served.adapter}"
    theirs = evaluate("hf", hf_args)

    ours_mc, theirs_mc = per_item(ours, "loraplex_colors"), per_item(theirs, "loraplex_colors")
    assert sorted(ours_mc) == sorted(theirs_mc) and len(ours_mc) == 8
    for doc_id, choices in theirs_mc.items():
        assert len(ours_mc[doc_id]) == len(choices) == 4
        for (ll_ours, _), (ll_theirs, _) in zip(ours_mc[doc_id], choices, strict=True):
            assert abs(float(ll_ours) - float(ll_theirs)) < LOGLIKELIHOOD_TOLERANCE, doc_id
    acc = "acc,none"
    assert ours["results"]["loraplex_colors"][acc] == theirs["results"]["loraplex_colors"][acc]

    if with_adapter:  # the adapter is what was evaluated: the base scores otherwise
        base = per_item(through_loraplex(served, served.model_id), "loraplex_colors")
        assert any(abs(float(a[0]) - float(b[0])) > 10 * LOGLIKELIHOOD_TOLERANCE
                   for doc_id in base for a, b in zip(base[doc_id], ours_mc[doc_id],
                                                      strict=True))

    # Generation: the same greedy text for every item, so the same score.
    assert per_item(ours, "loraplex_capitals") == per_item(theirs, "loraplex_capitals")
    em = "exact_match,none"
    assert ours["results"]["loraplex_capitals"][em] == \
        theirs["results"]["loraplex_capitals"][em]
