"""Plans on the topology fixtures: every worker fits its slice, slice layouts are valid MIG
combinations, dedicated tenants are alone, and what fits nowhere says why."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from app.placement import (
    MemoryModel,
    MigMode,
    Plan,
    PlanOptions,
    TenantSpec,
    Topology,
    Worker,
    WorkerShape,
    check_combination,
    load_tenants,
    load_topology,
    parse_topology,
    plan,
)
from engine.core.memory import GIB
from engine.models.loader import ModelConfig, load_model_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "placement"
TOPOLOGIES = ("a100_80gb_7x1g", "h200_mixed", "no_mig", "mig_auto", "issue_example",
              "two_nodes_7x1g")


@pytest.fixture(scope="module")
def smollm2() -> ModelConfig:
    return load_model_config(FIXTURES / "models" / "smollm2-135m")


@pytest.fixture(scope="module")
def llama8b() -> ModelConfig:
    return load_model_config(FIXTURES / "models" / "llama-3-8b")


def llama70b(tmp_path: Path) -> ModelConfig:
    config = {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model_config(tmp_path)


def topology(name: str) -> Topology:
    return load_topology(FIXTURES / f"{name}.yaml")


def make_plan(
    topo: Topology, tenants: list[TenantSpec], cfg: ModelConfig,
    options: PlanOptions | None = None,
) -> Plan:
    options = options or PlanOptions()
    result = plan(topo, tenants, cfg, options)
    assert_valid(result, topo, tenants, MemoryModel(cfg, options.shape))
    return result


def assert_valid(result: Plan, topo: Topology, tenants: list[TenantSpec],
                 memory: MemoryModel) -> None:
    """The invariants every plan keeps, whatever the inputs."""
    specs = {t.name: t for t in tenants}
    gpus = {(n.name, g.index): g for n in topo.nodes for g in n.gpus}
    max_len = memory.cfg.max_model_len
    by_gpu: dict[tuple[str, int], list[Worker]] = defaultdict(list)
    for w in result.workers:
        # The memory model fits the slice, with the KV cache it is given.
        assert w.memory == memory.breakdown(w.kv_cache_tokens, w.max_num_seqs)
        assert w.memory.total <= w.memory_gb * GIB
        assert w.kv_cache_tokens > 0 and w.kv_cache_tokens % memory.shape.block_size == 0
        assert w.tenants
        for name in w.tenants:
            t = specs[name]
            ctx = t.context_for(max_len)
            need = memory.kv_tokens_for(t.concurrency if t.dedicated else 1, ctx)
            assert w.kv_cache_tokens >= need, (w, t)
        if w.isolation == "dedicated":
            assert len(w.tenants) == 1 and specs[w.tenants[0]].dedicated
        else:
            assert not any(specs[n].dedicated for n in w.tenants)
        expected = {f"nvidia.com/mig-{w.mig_profile}": 1} if w.mig_profile else {
            "nvidia.com/gpu": 1}
        assert w.resources == expected
        by_gpu[(w.node, w.gpu)].append(w)
    for key, workers in by_gpu.items():
        gpu = gpus[key]
        if gpu.mig is MigMode.OFF:
            assert [w.mig_profile for w in workers] == [None]
        elif gpu.mig is MigMode.INSTANCES:
            used = Counter(w.mig_profile or "" for w in workers)
            existing = Counter(i.profile for i in gpu.instances)
            assert all(used[p] <= existing[p] for p in used)
        else:
            assert gpu.model is not None
            layout = [w.mig_profile or "" for w in workers]
            assert check_combination(gpu.model, layout) is None, layout
            assert all(w.setup and "-cgi" in w.setup for w in workers)
        devices = [w.env["CUDA_VISIBLE_DEVICES"] for w in workers]
        assert len(set(devices)) == len(devices)
    # Every tenant is either placed or unplaced, never both; a dedicated one on one worker.
    placed = Counter(n for w in result.workers for n in w.tenants)
    unplaced = {u.tenant for u in result.unplaced}
    assert not (set(placed) & unplaced)
    assert set(placed) | unplaced == set(specs)
    for name, count in placed.items():
        if specs[name].dedicated:
            assert count == 1
    # Shared tenants' KV demand fits in the shared workers' caches together.
    shared_kv = sum(w.kv_cache_tokens for w in result.workers if w.isolation == "shared")
    demand = sum(memory.kv_tokens_for(specs[n].concurrency, specs[n].context_for(max_len))
                 for n in placed if not specs[n].dedicated)
    assert demand <= shared_kv


def summary(result: Plan) -> list[tuple[int, str | None, str, tuple[str, ...]]]:
    return [(w.gpu, w.mig_profile, w.isolation, w.tenants) for w in result.workers]


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("model", ["smollm2", "llama8b"])
def test_every_fixture_gives_a_valid_plan(name: str, model: str, request: pytest.FixtureRequest
                                          ) -> None:
    cfg = request.getfixturevalue(model)
    tenants = load_tenants(FIXTURES / "tenants_mixed.yaml")
    first = make_plan(topology(name), tenants, cfg)
    again = make_plan(topology(name), tenants, cfg)
    assert json.dumps(first.to_dict()) == json.dumps(again.to_dict())  # deterministic


def test_a100_as_7x1g(smollm2: ModelConfig) -> None:
    result = make_plan(topology("a100_80gb_7x1g"), load_tenants(FIXTURES / "tenants_mixed.yaml"),
                       smollm2)
    shared = ("small-co", "initech")
    assert summary(result) == [
        (0, "1g.10gb", "dedicated", ("acme",)),
        (0, "1g.10gb", "dedicated", ("globex",)),
        *[(0, "1g.10gb", "shared", shared)] * 5,
    ]
    assert [w.env["CUDA_VISIBLE_DEVICES"][-2:] for w in result.workers] == [
        "01", "02", "03", "04", "05", "06", "07"
    ]
    acme = result.workers[0]
    assert acme.env == {"CUDA_VISIBLE_DEVICES": "MIG-0a6c1d2e-1f30-5a4b-8c9d-000000000001"}
    # 0.9 of the slice (gpu_memory_utilization's default) holds all of it.
    assert (acme.memory_gb, acme.max_num_seqs, acme.kv_cache_tokens) == (9.5, 32, 311360)
    assert acme.setup is None
    assert acme.args[-2:] == ("--kv-cache-tokens", "311360")
    assert acme.args[acme.args.index("--max-num-seqs") + 1] == "32"
    assert result.unplaced == ()


def test_h200_mixed_gives_dedicated_tenants_the_smallest_slice_that_fits(
    llama8b: ModelConfig,
) -> None:
    result = make_plan(topology("h200_mixed"), load_tenants(FIXTURES / "tenants_mixed.yaml"),
                       llama8b)
    # acme (35.6 GiB) needs the 3g.71gb, globex (23.1 GiB) the 2g.35gb; the 1g.18gb (16 GiB)
    # slices are too small for an 8B worker, so globex gives the 2g.35gb up to the shared
    # tenants, who would have nowhere to go.
    assert summary(result) == [
        (0, "3g.71gb", "dedicated", ("acme",)),
        (0, "2g.35gb", "shared", ("small-co", "initech")),
    ]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in result.workers] == [
        "MIG-7b2e4f10-3c5d-5e6f-9a0b-00000000a001", "MIG-7b2e4f10-3c5d-5e6f-9a0b-00000000a002"
    ]
    assert [(u.tenant, u.reason) for u in result.unplaced] == [
        ("globex", "no free GPU or MIG slice is left for a dedicated worker once one is kept "
                   "for the shared tenants (small-co, initech)"),
    ]
    # Without shared tenants the slices stay the dedicated ones', and a shared tenant
    # that fits nowhere says why.
    dedicated_only = [t for t in load_tenants(FIXTURES / "tenants_mixed.yaml") if t.dedicated]
    assert summary(make_plan(topology("h200_mixed"), dedicated_only, llama8b)) == [
        (0, "3g.71gb", "dedicated", ("acme",)),
        (0, "2g.35gb", "dedicated", ("globex",)),
    ]
    only_small = [TenantSpec("small-co", "shared", 1, None)]
    h200_small = parse_topology({"nodes": [{"name": "node-h200", "gpus": [
        {"index": 0, "model": "H200", "memory_gb": 141, "mig": ["1g.18gb", "1g.18gb"]},
    ]}]})
    [small] = make_plan(h200_small, only_small, llama8b).unplaced
    assert small.reason == (
        "a worker of this model needs at least 19.10 GiB (weights 14.96 + KV cache 0.00 for "
        "16 tokens + adapters 2.50 + activations 0.65 + CUDA context 1.00); the largest slot "
        "left for shared workers has 16.00 GiB (node-h200 GPU 0 MIG 1g.18gb)"
    )


def test_node_without_mig(smollm2: ModelConfig) -> None:
    result = make_plan(topology("no_mig"), load_tenants(FIXTURES / "tenants_mixed.yaml"), smollm2)
    # acme has the largest footprint and takes the smallest GPU that holds it (the L40S).
    assert summary(result) == [
        (0, None, "dedicated", ("globex",)),
        (1, None, "shared", ("small-co", "initech")),
        (2, None, "dedicated", ("acme",)),
    ]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in result.workers] == [
        "GPU-11111111-2222-3333-4444-555555555555", "1", "2"
    ]
    assert [w.memory_gb for w in result.workers] == [79.19, 79.19, 44.5]
    assert all(w.setup is None for w in result.workers)


def test_mig_auto_chooses_profiles(smollm2: ModelConfig, llama8b: ModelConfig) -> None:
    tenants = load_tenants(FIXTURES / "tenants_mixed.yaml")
    whole = PlanOptions(shape=WorkerShape(gpu_memory_utilization=1.0))
    small = make_plan(topology("mig_auto"), tenants, smollm2, whole)
    # SmolLM2 fits the A100-40GB's 1g.5gb: one per dedicated tenant, the rest as few
    # shared instances as possible; the H200 becomes one shared 7g instance.
    assert summary(small) == [
        (0, "7g.141gb", "shared", ("small-co", "initech")),
        (1, "1g.5gb", "dedicated", ("acme",)),
        (1, "1g.5gb", "dedicated", ("globex",)),
        (1, "4g.20gb", "shared", ("small-co", "initech")),
        (1, "1g.10gb", "shared", ("small-co", "initech")),
    ]
    a100 = small.workers[1]
    assert a100.setup == (
        "create the MIG instances on node-auto GPU 1: nvidia-smi -i 1 -mig 1; nvidia-smi mig "
        "-i 1 -cgi 4g.20gb,1g.10gb,1g.5gb,1g.5gb -C; then set CUDA_VISIBLE_DEVICES to the "
        "instance's UUID (nvidia-smi -L)"
    )
    assert a100.env == {
        "CUDA_VISIBLE_DEVICES": "MIG-<uuid of new 1g.5gb instance #0 on node-auto GPU 1>"
    }
    big = make_plan(topology("mig_auto"), tenants, llama8b, whole)
    assert summary(big) == [
        (0, "1g.35gb", "dedicated", ("globex",)),
        (0, "4g.71gb", "shared", ("small-co", "initech")),
        (0, "2g.35gb", "shared", ("small-co", "initech")),
        (1, "7g.40gb", "dedicated", ("acme",)),
    ]


def test_issue_example(smollm2: ModelConfig) -> None:
    result = make_plan(topology("issue_example"), load_tenants(FIXTURES / "tenants_example.yaml"),
                       smollm2)
    assert summary(result) == [
        (0, "3g.71gb", "shared", ("small-co",)),
        (0, "2g.35gb", "shared", ("small-co",)),
        (0, "1g.18gb", "shared", ("small-co",)),
        (0, "1g.18gb", "shared", ("small-co",)),
        (1, "1g.10gb", "dedicated", ("acme",)),
        (1, "4g.40gb", "shared", ("small-co",)),
        (1, "2g.20gb", "shared", ("small-co",)),
        (2, None, "shared", ("small-co",)),
    ]
    no_uuid = result.workers[0]
    assert no_uuid.env == {
        "CUDA_VISIBLE_DEVICES": "MIG-<uuid of 3g.71gb instance #0 on node-a GPU 0>"
    }
    assert no_uuid.setup == "look up the instance's UUID with nvidia-smi -L on node-a"


def test_a_model_that_fits_nowhere(tmp_path: Path) -> None:
    cfg = llama70b(tmp_path)
    tenants = load_tenants(FIXTURES / "tenants_example.yaml")
    result = make_plan(topology("issue_example"), tenants, cfg)
    assert result.workers == ()
    assert [u.tenant for u in result.unplaced] == ["acme", "small-co"]
    acme, small = (u.reason for u in result.unplaced)
    assert acme.startswith("needs ")
    assert "(weights 131.42 + KV cache 40.00 for 131072 tokens" in acme
    assert acme.endswith("for 32 x 4096 tokens; the largest free slot has 79.12 GiB "
                         "(node-a GPU 1 MIG 7g.80gb), of which gpu_memory_utilization 0.9 "
                         "may be used")
    assert small.startswith("a worker of this model needs at least ")
    assert small.endswith("the largest slot left for shared workers has 79.12 GiB "
                          "(node-a GPU 1 MIG 7g.80gb)")


def test_dedicated_tenants_never_share(smollm2: ModelConfig) -> None:
    tenants = [TenantSpec(f"t{i}", "dedicated", 1, 1024) for i in range(9)]
    tenants.append(TenantSpec("shared-co", "shared", 1, 1024))
    result = make_plan(topology("a100_80gb_7x1g"), tenants, smollm2)
    # The last slice is kept for the shared tenant; t6 gives it up, t7 and t8 never had one.
    assert [w.tenants for w in result.workers] == [
        *[(f"t{i}",) for i in range(6)], ("shared-co",)
    ]
    assert [(u.tenant, u.reason) for u in result.unplaced] == [
        ("t6", "no free GPU or MIG slice is left for a dedicated worker once one is kept for "
               "the shared tenants (shared-co)"),
        ("t7", "no free GPU or MIG slice is left for a dedicated worker"),
        ("t8", "no free GPU or MIG slice is left for a dedicated worker"),
    ]
    dedicated_only = make_plan(topology("a100_80gb_7x1g"), tenants[:9], smollm2)
    assert [w.tenants for w in dedicated_only.workers] == [(f"t{i}",) for i in range(7)]
    assert [u.tenant for u in dedicated_only.unplaced] == ["t7", "t8"]


def test_shared_tenants_draw_from_one_pool(smollm2: ModelConfig) -> None:
    tenants = [
        TenantSpec("flood", "shared", 1000, 8192),
        TenantSpec("huge", "shared", 1, 8192),
        TenantSpec("ok", "shared", 64, 4096),
        TenantSpec("too-long", "shared", 1, 16384),
    ]
    small = PlanOptions(shape=WorkerShape(max_num_seqs=16))
    result = make_plan(topology("a100_80gb_7x1g"), tenants, smollm2, small)
    per_worker = result.workers[0].kv_cache_tokens
    assert [w.tenants for w in result.workers] == [("huge", "ok")] * 7
    assert [(u.tenant, u.reason) for u in result.unplaced] == [
        ("flood", f"needs 8192000 KV tokens (1000 x 8192); the shared workers have "
                  f"{7 * per_worker} of {7 * per_worker} left"),
        ("too-long", "context 16384 exceeds the model's max_model_len 8192"),
    ]


def test_a_sequence_longer_than_any_shared_worker(llama8b: ModelConfig) -> None:
    tenants = [TenantSpec("long", "shared", 1, 8192), TenantSpec("short", "shared", 1, 1024)]
    # 48 GiB of adapter slots, on the whole of each device
    tight = PlanOptions(shape=WorkerShape(max_loras=154, gpu_memory_utilization=1.0))
    result = make_plan(topology("h200_mixed"), tenants, llama8b, tight)
    holds = max(w.kv_cache_tokens for w in result.workers)
    assert holds < 8192
    assert [(u.tenant, u.reason) for u in result.unplaced] == [
        ("long", f"one 8192-token sequence needs 8192 KV tokens; the largest shared worker "
                 f"holds {holds}"),
    ]
    assert {w.tenants for w in result.workers} == {("short",)}


def test_shared_tenants_keep_a_worker_when_dedicated_ones_outnumber_the_slices(
    smollm2: ModelConfig,
) -> None:
    tenants = load_tenants(FIXTURES / "tenants_crowded.yaml")
    result = make_plan(topology("two_nodes_7x1g"), tenants, smollm2)
    shared = ("s01", "s02", "s03", "s04", "s05")
    # Largest footprint first, each on the first free slice; the smallest (d14) gives up
    # the last slice to the shared tenants' worker.
    assert [(w.node, w.env["CUDA_VISIBLE_DEVICES"][-4:], w.isolation, w.tenants)
            for w in result.workers] == [
        *[("node-a", f"a00{i + 1}", "dedicated", (f"d0{i + 1}",)) for i in range(7)],
        ("node-b", "b001", "dedicated", ("d08",)),
        ("node-b", "b002", "dedicated", ("d09",)),
        ("node-b", "b003", "dedicated", ("d10",)),
        ("node-b", "b004", "dedicated", ("d11",)),
        ("node-b", "b005", "dedicated", ("d12",)),
        ("node-b", "b006", "dedicated", ("d13",)),
        ("node-b", "b007", "shared", shared),
    ]
    assert [(u.tenant, u.reason) for u in result.unplaced] == [
        ("d14", "no free GPU or MIG slice is left for a dedicated worker once one is kept "
                "for the shared tenants (s01, s02, s03, s04, s05)"),
    ]
