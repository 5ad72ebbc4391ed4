"""`loraplex plan` end to end through click: JSON parsed back, the table, and bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.plan_cli import plan

FIXTURES = Path(__file__).parents[1] / "fixtures" / "placement"
SMOLLM2 = str(FIXTURES / "models" / "smollm2-135m")
WORKER_KEYS = {
    "node", "gpu", "mig_profile", "memory_gb", "isolation", "tenants", "max_loras",
    "max_num_seqs", "kv_cache_tokens", "env", "resources", "args", "setup", "memory",
}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.output


def test_json_plan_for_the_example() -> None:
    code, out = run("--topology", str(FIXTURES / "issue_example.yaml"),
                    "--tenants", str(FIXTURES / "tenants_example.yaml"),
                    "--model", SMOLLM2, "--format", "json")
    assert code == 0, out
    data = json.loads(out)
    assert set(data) == {"workers", "unplaced"}
    assert data["unplaced"] == []
    workers = data["workers"]
    assert all(set(w) == WORKER_KEYS for w in workers)
    dedicated = [w for w in workers if w["isolation"] == "dedicated"]
    assert [(w["node"], w["gpu"], w["mig_profile"], w["tenants"]) for w in dedicated] == [
        ("node-a", 1, "1g.10gb", ["acme"])
    ]
    acme = dedicated[0]
    assert acme["resources"] == {"nvidia.com/mig-1g.10gb": 1}
    assert acme["env"]["CUDA_VISIBLE_DEVICES"].startswith("MIG-<uuid of new 1g.10gb")
    assert acme["max_loras"] == 8 and acme["memory_gb"] == 9.5
    assert acme["memory"]["total_gb"] <= acme["memory_gb"]
    shared = [w for w in workers if w["isolation"] == "shared"]
    assert len(shared) == 7 and all(w["tenants"] == ["small-co"] for w in shared)
    whole = [w for w in workers if w["mig_profile"] is None]
    assert [(w["gpu"], w["env"], w["resources"]) for w in whole] == [
        (2, {"CUDA_VISIBLE_DEVICES": "2"}, {"nvidia.com/gpu": 1})
    ]


def test_flags_reach_the_workers() -> None:
    code, out = run("--topology", str(FIXTURES / "a100_80gb_7x1g.yaml"),
                    "--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", SMOLLM2,
                    "--dtype", "float32", "--max-loras", "4", "--max-lora-rank", "16")
    assert code == 0, out
    first = json.loads(out)["workers"][0]
    assert first["max_loras"] == 4
    assert first["args"][:8] == ["--model", SMOLLM2, "--dtype", "float32", "--max-loras", "4",
                                 "--max-lora-rank", "16"]
    assert first["args"][-1] == str(first["kv_cache_tokens"])


def test_a_quantized_base_fits_where_bf16_does_not() -> None:
    llama3 = str(FIXTURES / "models" / "llama-3-8b")

    def planned(*extra: str) -> dict:
        code, out = run("--topology", str(FIXTURES / "a100_80gb_7x1g.yaml"),
                        "--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", llama3,
                        "--max-loras", "2", "--max-lora-rank", "16", *extra)
        assert code == 0, out
        return json.loads(out)

    # Llama-3-8B in bf16 (14.96 GiB of weights) fits no 10 GB MIG slice...
    plain = planned()
    assert plain["workers"] == [] and "weights 14.96" in plain["unplaced"][0]["reason"]
    # ...int4 in groups of 128 (4.5 bits a decoder weight, the rest bf16) does.
    int4 = planned("--quantization", "int4", "--quantization-group-size", "128")["workers"]
    assert int4
    first = int4[0]
    assert first["memory"]["weights_gb"] == pytest.approx(5.61, abs=0.01)
    assert first["args"][-4:] == ["--quantization", "int4", "--quantization-group-size", "128"]
    assert first["memory"]["total_gb"] <= first["memory_gb"] * 0.9
    # fp8 would not fit either (8.46 GiB of weights), and an A100 has no fp8 units anyway.
    code, out = run("--topology", str(FIXTURES / "a100_80gb_7x1g.yaml"),
                    "--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", llama3,
                    "--quantization", "fp8")
    assert code == 2 and "A100-80GB" in out
    code, out = run("--topology", str(FIXTURES / "a100_80gb_7x1g.yaml"),
                    "--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", llama3,
                    "--quantization", "w8a8")
    assert code == 2 and "'w8a8' is not one of" in out


def test_fp8_is_planned_on_gpus_that_have_it_only() -> None:
    llama3 = str(FIXTURES / "models" / "llama-3-8b")
    code, out = run("--topology", str(FIXTURES / "issue_example.yaml"),
                    "--tenants", str(FIXTURES / "tenants_example.yaml"), "--model", llama3,
                    "--quantization", "fp8")
    assert code == 2
    assert "compute capability 8.9" in out and "node-a GPU 1 (A100-80GB)" in out
    assert "GPU 0" not in out  # the H200 has fp8 units
    code, out = run("--topology", str(FIXTURES / "h200_mixed.yaml"),
                    "--tenants", str(FIXTURES / "tenants_example.yaml"), "--model", llama3,
                    "--quantization", "fp8")
    assert code == 0, out
    workers = json.loads(out)["workers"]
    assert workers and all(w["args"][-2:] == ["--quantization", "fp8"] for w in workers)


def test_a_group_size_the_model_cannot_take_is_one_line() -> None:
    # SmolLM2's hidden size, 576, is not a multiple of 128.
    code, out = run("--topology", str(FIXTURES / "h200_mixed.yaml"),
                    "--tenants", str(FIXTURES / "tenants_example.yaml"), "--model", SMOLLM2,
                    "--quantization", "int4", "--quantization-group-size", "128")
    assert code == 2 and "Traceback" not in out
    assert "group size 128 does not divide 576 input features" in out


def test_table_format() -> None:
    code, out = run("--topology", str(FIXTURES / "issue_example.yaml"),
                    "--tenants", str(FIXTURES / "tenants_example.yaml"),
                    "--model", SMOLLM2, "--format", "table")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "PROFILE", "GiB", "ISOLATION", "TENANTS",
                                "LORAS", "KV", "TOKENS", "CUDA_VISIBLE_DEVICES", "RESOURCE"]
    assert lines[5].split()[:6] == ["node-a", "1", "1g.10gb", "9.50", "dedicated", "acme"]
    assert lines[5].split()[-1] == "nvidia.com/mig-1g.10gb=1"
    assert "setup:" in lines
    assert "  look up the instance's UUID with nvidia-smi -L on node-a" in lines


def test_unplaced_tenants_in_both_formats(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - {name: long, isolation: shared, context: 100000}\n")
    args = ["--topology", str(FIXTURES / "no_mig.yaml"), "--tenants", str(tenants),
            "--model", SMOLLM2]
    code, out = run(*args)
    assert code == 0
    assert json.loads(out) == {"workers": [], "unplaced": [
        {"tenant": "long", "reason": "context 100000 exceeds the model's max_model_len 8192"}
    ]}
    code, out = run(*args, "--format", "table")
    assert out.splitlines()[1:] == [
        "(no workers)", "", "unplaced:",
        "  long: context 100000 exceeds the model's max_model_len 8192",
    ]


def test_default_model_reads_the_converted_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "models" / "SmolLM2-135M-Instruct"
    cache.mkdir(parents=True)
    shutil.copy(Path(SMOLLM2) / "config.json", cache / "config.json")
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    base = ["--topology", str(FIXTURES / "h200_mixed.yaml"),
            "--tenants", str(FIXTURES / "tenants_mixed.yaml")]
    code, default_out = run(*base)
    assert code == 0, default_out
    code, path_out = run(*base, "--model", SMOLLM2)
    strip = [{**w, "args": w["args"][2:]} for w in json.loads(path_out)["workers"]]
    assert [{**w, "args": w["args"][2:]} for w in json.loads(default_out)["workers"]] == strip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "{fixtures}/missing.yaml"], "cannot read"),
        (["--topology", "{bad_topology}"], "H200-141GB has no MIG profile '1g.10gb'"),
        (["--tenants", "{bad_tenants}"], "isolation must be one of dedicated, shared"),
        (["--model", "{fixtures}/no-such-model"], "does not exist"),
        (["--model", "{fixtures}"], "has no config.json"),
    ],
)
def test_bad_inputs_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    bad_topology = tmp_path / "topo.yaml"
    bad_topology.write_text("nodes:\n  - {name: n, gpus: [{index: 0, model: H200, "
                            "mig: [1g.10gb]}]}\n")
    bad_tenants = tmp_path / "tenants.yaml"
    bad_tenants.write_text("tenants:\n  - {name: a, isolation: exclusive}\n")
    values = {"fixtures": str(FIXTURES), "bad_topology": str(bad_topology),
              "bad_tenants": str(bad_tenants)}
    given = dict(zip(args[::2], (a.format(**values) for a in args[1::2]), strict=True))
    options = {"--topology": str(FIXTURES / "h200_mixed.yaml"),
               "--tenants": str(FIXTURES / "tenants_mixed.yaml"), "--model": SMOLLM2, **given}
    code, out = run(*(x for pair in options.items() for x in pair))
    assert code == 2
    assert out.startswith("Error: ") and message in out


def test_without_topology_nvml_is_asked() -> None:
    code, out = run("--tenants", str(FIXTURES / "tenants_mixed.yaml"), "--model", SMOLLM2)
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception:
        # No GPUs here: the error says to pass a topology file.
        assert code == 2 and "pass --topology FILE" in out
    else:
        assert code == 0, out


def test_registered_on_the_main_command() -> None:
    from app.cli import main

    result = CliRunner().invoke(main, ["plan", "--help"])
    assert result.exit_code == 0
    assert "--topology" in result.output and "--max-lora-rank" in result.output
