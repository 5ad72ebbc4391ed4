"""What the planner reads: MIG profile tables, topology files, NVML, tenants, model configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.placement import (
    GPU_MODELS,
    MigInstance,
    MigMode,
    PlacementInputError,
    TenantSpec,
    check_combination,
    discover_nvml,
    load_tenants,
    load_topology,
    parse_tenants,
    parse_topology,
    planning_model_config,
)
from app.placement.profiles import UnknownGpuModel, place, resolve_gpu_model
from engine.models.loader import DEFAULT_MODEL_NAME, ModelLoadError, load_model_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "placement"

# ---------------------------------------------------------------------------- profiles


def test_profile_tables() -> None:
    names = {key: model.profile_names for key, model in GPU_MODELS.items()}
    assert names == {
        "A100-40GB": ["1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        "A100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "H100-80GB": ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "H200-141GB": ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    }
    for model in GPU_MODELS.values():
        assert [p.max_instances for p in model.profiles] == [7, 4, 3, 2, 1, 1]
        assert [p.compute_slices for p in model.profiles] == [1, 1, 2, 3, 4, 7]
        assert [p.memory_slices for p in model.profiles] == [1, 2, 2, 4, 4, 8]
        usable = [p.usable_gib for p in model.profiles]
        assert usable == sorted(usable) and usable[-1] <= model.usable_gib
        # Usable memory is below the nominal size the profile name carries.
        for p in model.profiles:
            assert p.usable_gib < float(p.name.split(".")[1].removesuffix("gb"))
    assert GPU_MODELS["H200-141GB"].profile("1g.18gb").usable_gib == 16.00  # type: ignore[union-attr]
    assert GPU_MODELS["A100-80GB"].profile("3g.40gb").usable_gib == 39.25  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("model", "profiles"),
    [
        ("H200-141GB", ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]),
        ("A100-80GB", ["1g.10gb"] * 7),
        ("A100-80GB", ["1g.20gb"] * 4),
        ("A100-40GB", ["4g.20gb", "3g.20gb"]),
        ("A100-40GB", ["3g.20gb", "3g.20gb"]),
        ("H100-80GB", ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]),
        ("H100-80GB", ["4g.40gb", "2g.20gb", "1g.10gb"]),
        ("H200-141GB", ["7g.141gb"]),
    ],
)
def test_valid_combinations(model: str, profiles: list[str]) -> None:
    assert check_combination(GPU_MODELS[model], profiles) is None


@pytest.mark.parametrize(
    ("model", "profiles", "reason"),
    [
        ("H200-141GB", ["4g.71gb", "4g.71gb"],
         "4g.71gb + 4g.71gb needs 8 compute slices; a H200-141GB has 7"),
        ("A100-80GB", ["1g.10gb"] * 8, "needs 8 compute slices"),
        ("A100-40GB", ["3g.20gb", "3g.20gb", "1g.5gb"],
         "3g.20gb + 3g.20gb + 1g.5gb needs 9 memory slices; a A100-40GB has 8"),
        ("A100-80GB", ["7g.80gb", "1g.10gb"], "needs 8 compute slices"),
        ("A100-80GB", ["1g.18gb"], "A100-80GB has no MIG profile '1g.18gb'"),
    ],
)
def test_impossible_combinations(model: str, profiles: list[str], reason: str) -> None:
    assert reason in (check_combination(GPU_MODELS[model], profiles) or "")


def test_placement_of_mixed_profiles() -> None:
    h200 = GPU_MODELS["H200-141GB"]
    profiles = [h200.profile(n) for n in ("3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb")]
    # 3g must take slices 4-7 so that 2g (0-1) and the two 1g (2, 3) fit before it.
    assert place(profiles) == [4, 0, 2, 3]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "memory", "key"),
    [
        ("H200", None, "H200-141GB"),
        ("NVIDIA H200 NVL", 140.4, "H200-141GB"),
        ("NVIDIA H200 141GB HBM3e", None, "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 79.1, "A100-80GB"),
        ("A100", 80, "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", 79.6, "H100-80GB"),
        ("H100 PCIe", 79.6, "H100-80GB"),
    ],
)
def test_gpu_model_names(name: str, memory: float | None, key: str) -> None:
    assert resolve_gpu_model(name, memory).key == key


@pytest.mark.parametrize(
    ("name", "memory", "message"),
    [
        ("A100", None, "'A100' is ambiguous: say A100-40GB or A100-80GB"),
        ("H100 NVL 94GB", 94, "no MIG table for that size"),
        ("L40S", 48, "unknown GPU model 'L40S'; known models: A100-40GB, A100-80GB"),
        ("H200", 80, "'H200' with 80 GB matches none of H200-141GB"),
    ],
)
def test_unknown_gpu_models(name: str, memory: float | None, message: str) -> None:
    with pytest.raises(UnknownGpuModel, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_gpu_model(name, memory)


# ---------------------------------------------------------------------------- topology file


def test_topology_a100_7x1g() -> None:
    topo = load_topology(FIXTURES / "a100_80gb_7x1g.yaml")
    (node,) = topo.nodes
    (gpu,) = node.gpus
    assert (node.name, gpu.index, gpu.mig) == ("node-a100", 0, MigMode.INSTANCES)
    assert gpu.model is GPU_MODELS["A100-80GB"]
    assert gpu.uuid == "GPU-5a1c9f6e-0d3b-4c52-9e2f-6b7d8a9c0e11"
    assert [i.profile for i in gpu.instances] == ["1g.10gb"] * 7
    assert gpu.instances[6] == MigInstance(
        "1g.10gb", 9.50, 1, "MIG-0a6c1d2e-1f30-5a4b-8c9d-000000000007"
    )


def test_topology_issue_example() -> None:
    (node,) = load_topology(FIXTURES / "issue_example.yaml").nodes
    h200, a100, a100_40 = node.gpus
    assert [i.profile for i in h200.instances] == ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]
    assert [i.uuid for i in h200.instances] == [None] * 4
    assert (a100.mig, a100.instances, a100.model.key) == (MigMode.AUTO, (), "A100-80GB")  # type: ignore[union-attr]
    assert (a100_40.mig, a100_40.memory_gib) == (MigMode.OFF, 39.39)


def test_topology_without_mig_and_unknown_whole_gpu() -> None:
    (node,) = load_topology(FIXTURES / "no_mig.yaml").nodes
    assert [(g.index, g.mig, g.memory_gib) for g in node.gpus] == [
        (0, MigMode.OFF, 79.19), (1, MigMode.OFF, 79.19), (2, MigMode.OFF, 44.5)
    ]
    assert node.gpus[2].model is None and node.gpus[2].name == "L40S"


def _topo(gpu: dict[str, Any]) -> dict[str, Any]:
    return {"nodes": [{"name": "n", "gpus": [gpu]}]}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_topo({"index": 0, "model": "A100-80GB", "mig": ["1g.18gb"]}),
         "node n gpus[0] (GPU 0) mig[0]: A100-80GB has no MIG profile '1g.18gb'; its profiles: "
         "1g.10gb, 1g.20gb"),
        (_topo({"index": 0, "model": "H200", "mig": ["4g.71gb", "4g.71gb"]}),
         "4g.71gb + 4g.71gb needs 8 compute slices"),
        (_topo({"index": 0, "model": "L40S", "memory_gb": 48, "mig": "auto"}),
         "unknown GPU model 'L40S'"),
        (_topo({"index": 0, "model": "L40S"}), "unknown GPU model 'L40S'"),
        (_topo({"index": 0, "model": "A100-80GB", "memory_gb": 40}),
         "memory_gb 40 does not match a A100-80GB (80 GB)"),
        (_topo({"index": 0, "model": "H200", "migs": "auto"}), "unknown key(s) migs"),
        (_topo({"index": 0, "model": "H200", "mig": "yes"}),
         "'mig' must be 'auto' or a non-empty list"),
        (_topo({"index": -1, "model": "H200"}), "'index' must be an integer >= 0"),
        (_topo({"index": 0, "model": "H200", "uuid": ""}), "'uuid' must be a non-empty string"),
        ({"nodes": [{"name": "n", "gpus": [{"index": 0, "model": "H200"},
                                           {"index": 0, "model": "H200"}]}]},
         "GPU indexes repeat: [0, 0]"),
        ({"nodes": [{"name": "n", "gpus": [{"index": 0, "model": "H200"}]},
                    {"name": "n", "gpus": [{"index": 0, "model": "H200"}]}]},
         "node name 'n' appears twice"),
        ({"nodes": []}, "expected a mapping with a non-empty 'nodes' list"),
        (["not", "a", "mapping"], "expected a mapping with a non-empty 'nodes' list"),
    ],
)
def test_bad_topologies(raw: Any, message: str) -> None:
    with pytest.raises(PlacementInputError) as info:
        parse_topology(raw, source="topo.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("topo.yaml")


def test_unreadable_topology_files(tmp_path: Path) -> None:
    with pytest.raises(PlacementInputError, match=r"cannot read .*missing\.yaml"):
        load_topology(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(PlacementInputError, match=r"bad\.yaml is not valid YAML"):
        load_topology(bad)


# ---------------------------------------------------------------------------- NVML


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Just the calls discover_nvml makes, answering for three GPUs: an H200 with MIG on
    (three instances, slot 1 empty), an A100-80GB with MIG off, and an L40S without MIG."""

    NVMLError = FakeNVMLError
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, *, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.calls: list[str] = []
        gib = 1 << 30
        self.devices: dict[str, dict[str, Any]] = {
            "gpu0": {"name": b"NVIDIA H200", "uuid": "GPU-aaaa", "memory": 143771 << 20,
                     "mig": (1, 1)},
            "gpu1": {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-bbbb", "memory": 80 * gib,
                     "mig": (0, 0)},
            "gpu2": {"name": "NVIDIA L40S", "uuid": "GPU-cccc", "memory": 46068 << 20,
                     "mig": None},
            "mig0": {"name": "NVIDIA H200 MIG 3g.71gb", "uuid": "MIG-1111",
                     "memory": int(69.75 * gib)},
            "mig2": {"name": "NVIDIA H200 MIG 1g.18gb", "uuid": "MIG-3333", "memory": 16 * gib},
            "mig3": {"name": b"NVIDIA H200 MIG 1g.18gb", "uuid": b"MIG-4444", "memory": 16 * gib},
        }

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle: str) -> str | bytes:
        return self.devices[handle]["name"]

    def nvmlDeviceGetUUID(self, handle: str) -> str | bytes:
        return self.devices[handle]["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        total = self.devices[handle]["memory"]
        return SimpleNamespace(total=total, used=0, free=total)

    def nvmlDeviceGetMigMode(self, handle: str) -> tuple[int, int]:
        mode = self.devices[handle]["mig"]
        if mode is None:
            raise FakeNVMLError("Not Supported")
        return mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        assert handle == "gpu0"
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> str:
        name = f"mig{index}"
        if name not in self.devices:
            raise FakeNVMLError("Not Found")
        return name


def test_nvml_discovery() -> None:
    nvml = FakeNVML()
    topo = discover_nvml(nvml, node_name="gpu-host")
    assert nvml.calls == ["init", "shutdown"]
    (node,) = topo.nodes
    assert node.name == "gpu-host"
    h200, a100, l40s = node.gpus
    assert (h200.index, h200.name, h200.uuid, h200.mig) == (
        0, "NVIDIA H200", "GPU-aaaa", MigMode.INSTANCES
    )
    assert h200.model is GPU_MODELS["H200-141GB"]
    assert h200.instances == (
        MigInstance("3g.71gb", 69.75, 3, "MIG-1111"),
        MigInstance("1g.18gb", 16.0, 1, "MIG-3333"),
        MigInstance("1g.18gb", 16.0, 1, "MIG-4444"),
    )
    assert (a100.mig, a100.model.key, a100.memory_gib, a100.uuid) == (  # type: ignore[union-attr]
        MigMode.OFF, "A100-80GB", 80.0, "GPU-bbbb"
    )
    assert (l40s.mig, l40s.model, l40s.memory_gib) == (MigMode.OFF, None, 44.99)


def test_nvml_mig_on_without_instances_is_planned_like_auto() -> None:
    nvml = FakeNVML()
    for name in ("mig0", "mig2", "mig3"):
        del nvml.devices[name]
    h200 = discover_nvml(nvml, node_name="x").nodes[0].gpus[0]
    assert (h200.mig, h200.instances) == (MigMode.AUTO, ())


def test_nvml_unavailable() -> None:
    nvml = FakeNVML(fail_init=True)
    with pytest.raises(PlacementInputError, match=r"NVML is not available .*--topology FILE"):
        discover_nvml(nvml)
    assert nvml.calls == ["init"]


def test_real_nvml_on_this_machine() -> None:
    """The real pynvml: on a machine without GPUs the error points at --topology."""
    try:
        topo = discover_nvml()
    except PlacementInputError as e:
        assert "--topology FILE" in str(e)
    else:
        assert topo.nodes[0].gpus


# ---------------------------------------------------------------------------- tenants


def test_tenants_file() -> None:
    assert load_tenants(FIXTURES / "tenants_mixed.yaml") == [
        TenantSpec("acme", "dedicated", 32, 4096),
        TenantSpec("globex", "dedicated", 4, 8192),
        TenantSpec("small-co", "shared", 1, None),
        TenantSpec("initech", "shared", 8, 2048),
    ]
    spec = TenantSpec("small-co", "shared", 1, None)
    assert (spec.context_for(8192), spec.context_for(2048)) == (4096, 2048)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenant 'a' appears twice"),
        ({"tenants": [{"name": "a", "isolation": "private"}]},
         "isolation must be one of dedicated, shared, got 'private'"),
        ({"tenants": [{"name": "a", "concurrency": 0}]}, "'concurrency' must be an integer >= 1"),
        ({"tenants": [{"name": "a", "context": True}]}, "'context' must be an integer >= 1"),
        ({"tenants": [{"name": "a", "tier": "premium"}]}, "unknown key(s) tier"),
        ({"tenants": [{"isolation": "shared"}]}, "'name' must be a non-empty string"),
        ({"tenant": []}, "expected a mapping with a 'tenants' list"),
    ],
)
def test_bad_tenants(raw: Any, message: str) -> None:
    with pytest.raises(PlacementInputError) as info:
        parse_tenants(raw, source="tenants.yaml")
    assert message in str(info.value)


# ---------------------------------------------------------------------------- model config


def test_model_from_a_directory_or_its_config(tmp_path: Path) -> None:
    cfg, source = planning_model_config(str(FIXTURES / "models" / "llama-3-8b"), tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (4096, 32, 8)
    assert source == str(FIXTURES / "models" / "llama-3-8b" / "config.json")
    same, _ = planning_model_config(source, tmp_path)
    assert same == cfg
    with pytest.raises(ModelLoadError, match="does not exist"):
        planning_model_config(str(tmp_path / "nope"), tmp_path)


def test_default_model_from_the_converted_cache(tmp_path: Path) -> None:
    cache = tmp_path / "models" / DEFAULT_MODEL_NAME
    cache.mkdir(parents=True)
    shutil.copy(FIXTURES / "models" / "smollm2-135m" / "config.json", cache / "config.json")
    cfg, source = planning_model_config("default", tmp_path)
    assert source == str(cache / "config.json")
    assert cfg == load_model_config(FIXTURES / "models" / "smollm2-135m")


def test_default_model_from_the_gguf_header(tmp_path: Path) -> None:
    """No converted cache: the bundled GGUF's metadata gives the same dimensions."""
    cfg, source = planning_model_config("default", tmp_path)
    assert source.endswith(".gguf")
    expected = load_model_config(FIXTURES / "models" / "smollm2-135m")
    dims = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
            "max_position_embeddings", "max_model_len", "rope_theta")
    assert {d: getattr(cfg, d) for d in dims} == {d: getattr(expected, d) for d in dims}
    assert json.dumps(cfg.rms_norm_eps) == json.dumps(expected.rms_norm_eps)
