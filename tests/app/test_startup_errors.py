"""A server that cannot start says why in one line and exits 2 (a usage error), with no
traceback: a model directory of a family we cannot serve, a value the engine refuses
once it has read the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.utils.processes import CLI_LAUNCHER, REPO_ROOT
from tests.utils.tiny_models import make_tiny_model

SMOLLM2 = REPO_ROOT / "var" / "models" / "SmolLM2-135M-Instruct"
TOKEN = "worker-token-0123456789abcdef"
UNSUPPORTED = "unsupported model_type 'gemma2'"
SUPPORTED = "supported: llama, mistral, phi3, qwen2, qwen3"


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma-2 checkpoint's config.json as transformers writes it: what the loader reads
    first."""
    from transformers import Gemma2Config

    out = tmp_path_factory.mktemp("gemma2")
    Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 vocab_size=256).to_json_file(out / "config.json")
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), SMOLLM2)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLI_LAUNCHER, "serve", "--no-auth", "--port", "0", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def test_serve_an_unsupported_family(gemma2_dir: Path) -> None:
    result = _serve("--model", str(gemma2_dir))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = _error_lines(result.stderr)
    assert UNSUPPORTED in line and SUPPORTED in line


def test_serve_a_value_the_loaded_model_refuses(tiny_dir: Path) -> None:
    result = _serve("--model", str(tiny_dir), "--max-model-len", "100000")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = _error_lines(result.stderr)
    assert "max_model_len 100000 exceeds the model's max_position_embeddings 256" in line


def test_worker_an_unsupported_family(gemma2_dir: Path) -> None:
    env = {"REDIS_URL": "redis://127.0.0.1:6379/0", "LORAPLEX_WORKER_TOKEN": TOKEN}
    result = CliRunner().invoke(main, ["worker", "--port", "18761", "--model", str(gemma2_dir)],
                                env=env)
    assert result.exit_code == 2, result.output
    assert UNSUPPORTED in result.output and SUPPORTED in result.output


def test_gateway_an_unsupported_family(gemma2_dir: Path) -> None:
    env = {"REDIS_URL": "redis://127.0.0.1:6379/0"}
    result = CliRunner().invoke(main, ["gateway", "--no-auth", "--port", "0", "--model",
                                       str(gemma2_dir)], env=env)
    assert result.exit_code == 2, result.output
    assert UNSUPPORTED in result.output and SUPPORTED in result.output
