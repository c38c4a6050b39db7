"""Context parallelism (sageattention2.parallel) across processes: on the CPU over gloo (the exact
path: the plumbing of Ulysses, the ring and both, the LSE merge, masks, the quantized exchange
with its quantizer and kernel stood in for, and a bad input on one rank raising on every rank),
and on 2 GPUs over NCCL (the quantized path against the one-GPU call). Each rank is a process
running tests/parallel_worker.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import sageattention2

WORKER = Path(__file__).resolve().parent / "parallel_worker.py"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_ranks(world: int, backend: str, *scenarios: str, timeout: float = 600,
              path: tuple[Path, ...] = ()) -> None:
    """Start ``world`` ranks of the worker on ``scenarios``; every rank must pass all of them
    (a rank left waiting in a collective shows as the timeout). ``path``: folders put first on
    the ranks' PYTHONPATH (the drop-in's)."""
    package_root = str(Path(sageattention2.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, path), package_root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, backend,
                               *scenarios], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
             for r, log in enumerate(logs)]
    # A rank that fails leaves at once; the others then fail on the lost connection, or are
    # stopped a little later (one waiting for a dead peer would otherwise wait for the timeout).
    deadline = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        if any(rank.returncode not in (None, 0) for rank in ranks):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.1)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-4000:]}"
                       for r, (p, out) in enumerate(zip(ranks, outputs)))
    assert all(p.returncode == 0 for p in ranks), report


def test_two_ranks_on_the_cpu() -> None:
    run_ranks(2, "gloo", "ring_matches_one_process", "ring_causal_matches_one_process",
              "ulysses_matches_one_process", "ulysses_causal_matches_one_process",
              "ring_key_mask_local_and_global", "ulysses_key_mask_local",
              "bad_input_on_one_rank_raises_everywhere", "bad_input_raises_everywhere_through_gloo",
              "quantized_exchange_plumbing")


def test_ulysses_and_ring_on_four_cpu_ranks() -> None:
    run_ranks(4, "gloo", "ulysses_and_ring")


def test_diffusers_context_parallelism_on_the_cpu() -> None:
    """diffusers' own context parallelism with our backend, as users enable it (2 and 4 ranks)."""
    pytest.importorskip("diffusers")
    run_ranks(2, "gloo", "diffusers_models_as_shipped")
    run_ranks(4, "gloo", "diffusers_models_ring_and_ulysses")


def test_yunchang_usp_on_cpu_ranks(dropin: Path) -> None:
    """yunchang's USP with its SAGE attention types, reaching our code through the drop-in
    ``sageattention``: Ulysses 2, ring 2, and on 4 ranks also 2 x 2."""
    pytest.importorskip("yunchang")
    run_ranks(2, "gloo", "yunchang_usp_runs_the_dropin", path=(dropin,))
    run_ranks(4, "gloo", "yunchang_usp_runs_the_dropin", path=(dropin,))


@pytest.mark.gpu
def test_yunchang_usp_on_gpus(dropin: Path, attention_kernel: None) -> None:
    """The same on GPUs (NCCL): 2 ranks, and 4 (2 x 2 among them) where there are 4 GPUs."""
    pytest.importorskip("yunchang")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(4 if gpus >= 4 else 2, "nccl", "yunchang_usp_runs_the_dropin", path=(dropin,))


def test_one_rank_is_sageattn() -> None:
    """Without groups (or groups of one rank) the call is sageattn's."""
    from sageattention2 import sageattn
    from sageattention2.parallel import context_parallel_attention

    q, k, v = (torch.randn(1, 7, 2, 8) for _ in range(3))
    torch.testing.assert_close(context_parallel_attention(q, k, v, is_causal=True),
                               sageattn(q, k, v, is_causal=True, tensor_layout="NHD"), rtol=0, atol=0)
    with pytest.raises(TypeError, match="unexpected keyword.*bogus"):
        context_parallel_attention(q, k, v, bogus=1)
    with pytest.raises(ValueError, match="exchange must be one of"):
        context_parallel_attention(q, k, v, exchange="fp8")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype, head_dim, value_dim", [(torch.bfloat16, 128, 128),
                                                        (torch.float16, 64, 128),
                                                        (torch.float32, 5, 3)])  # (no 8-byte words)
def test_ulysses_through_peer_memory(world: int, dtype: torch.dtype, head_dim: int,
                                     value_dim: int) -> None:
    """Ulysses' exchanges through the peers' memory, with threads standing in for the ranks
    (their buffers in one process, a threading barrier for the GPU's): every rank receives all
    tokens of its heads of q, k and v (GQA, batch 2, NHD views of HND tensors) and gets back its
    tokens of every head of the output, exactly; the buffer is the size the layout asks for."""
    import threading

    from sageattention2 import parallel

    b, n, hq, hkv = 2, 6 * world, 2 * world, world
    s = n // world
    g = torch.Generator().manual_seed(world + head_dim)
    q = torch.randn(b, hq, n, head_dim, generator=g).to(dtype).transpose(1, 2)  # NHD views
    k = torch.randn(b, hkv, n, head_dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(b, hkv, n, value_dim, generator=g).to(dtype).transpose(1, 2)
    out = torch.randn(b, n, hq, value_dim, generator=g).to(dtype)
    shards = [[t[:, r * s:(r + 1) * s] for t in (q, k, v)] for r in range(world)]
    nbytes = parallel._tokens_to_heads_layout(*shards[0], world)[1]
    buffers = [torch.full((nbytes,), 255, dtype=torch.uint8) for _ in range(world)]
    barrier = threading.Barrier(world, timeout=60)
    got: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def rank(r: int) -> None:
        memory = parallel._PeerMemory(r, buffers, barrier.wait)
        heads = [t.clone() for t in parallel._tokens_to_heads_in_peers(*shards[r], memory)]
        hp = hq // world
        got[r] = heads, parallel._heads_to_tokens_in_peers(out[:, :, r * hp:(r + 1) * hp], memory)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(world))
    for r, (heads, tokens) in got.items():
        for name, whole, part in zip("qkv", (q, k, v), heads):
            hp = whole.shape[2] // world
            assert torch.equal(part, whole[:, :, r * hp:(r + 1) * hp]), (r, name)
        assert torch.equal(tokens, out[:, r * s:(r + 1) * s]), r


@pytest.mark.gpu
def test_two_gpus(attention_kernel: None) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(2, "nccl", "ring_matches_one_process", "ulysses_matches_one_process",
              "ring_key_mask_local_and_global", "ulysses_key_mask_local",
              "bad_input_on_one_rank_raises_everywhere", "gpu_quantized_ring", "gpu_ulysses_bit_exact",
              "gpu_ulysses_through_peer_memory")


def test_bench_report_and_chart(tmp_path: Path) -> None:
    """``bench --gpus``' report of one model: the one-GPU rows, every context-parallel row with
    its speedup over the best native row, its scaling over our one GPU and its distance to our
    one-GPU output; the chart's bars are those speedups (a row that could not run has none), and
    with matplotlib they are drawn."""
    from sageattention2 import _bench_models
    from sageattention2 import _bench_parallel as bench

    ours = torch.ones(4)
    single = {"SDPA (default)": (80.0, ours * 1.5), "sageattention2": (64.0, ours)}
    rows = [("wan", 2, "ulysses", "SDPA (native)", 44.0, "0", ours),
            ("wan", 2, "ulysses", "sageattention2", 32.0, "0", ours),
            ("wan", 2, "ring", "cudnn (native)", 48.0, "0", ours),
            ("wan", 2, "ring", "sageattention2, K/V quantized", 40.0, "1000", ours * 2),
            ("wan", 2, "ring", "sageattention2, K/V bf16", float("nan"), "0", torch.empty(0))]
    lines, bars = bench.report("wan", single, rows)
    assert lines[0] == "| wan | 1 | - | SDPA (default) | 80.0 | - | - | - | 0.5000 |"
    assert lines[3] == "| wan | 2 | ulysses | sageattention2 | 32.0 | 1.38x | 2.00x | - | 0.0000 |"
    assert lines[5] == ("| wan | 2 | ring | sageattention2, K/V quantized | 40.0 | 1.10x | 1.60x | "
                        "1000 | 1.0000 |")
    assert lines[6].endswith("| - |")  # the row that could not run
    assert [b["model"] for b in bars] == [f"wan, 2 GPUs, {r[2]}: {r[3]}" for r in rows[:4]]
    assert [round(b["speedup"], 3) for b in bars] == [1.0, 1.375, 0.917, 1.1]
    if _bench_models.pyplot() is not None:
        assert _bench_models.chart(bars, tmp_path / "parallel.png", "t", "x")
        assert (tmp_path / "parallel.png").stat().st_size > 0


def test_bench_rows_of_the_authors_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --gpus`` adds the authors' package (diffusers' ``sage`` backend) to every mode where
    it is installed, never this project's drop-in of the same name, and says how our best row
    compares with theirs."""
    from importlib import metadata

    from sageattention2 import _bench_parallel as bench

    installed: list[str] = []

    def version(name: str) -> str:
        assert name == "sageattention"
        if not installed:
            raise metadata.PackageNotFoundError(name)
        return installed[-1]

    monkeypatch.setattr(metadata, "version", version)
    assert bench.authors_version() is None
    assert all(backend != "sage" for ring in (1, 2) for _, backend, _ in bench._backends(ring))
    installed.append("2.2.0+sageattention2")  # compat/: ours under their name
    assert bench.authors_version() is None
    assert all(backend != "sage" for _, backend, _ in bench._backends(1))
    installed.append("2.2.0")
    assert bench.authors_version() == "2.2.0"
    for ring in (1, 2):
        assert (bench.AUTHORS, "sage", {}) in bench._backends(ring)
    nan = float("nan")
    rows = [("wan", 2, "ulysses", "sageattention2", 36.7), ("wan", 2, "ring", "sageattention2, K/V "
            "quantized", 38.0), ("wan", 2, "ulysses", bench.AUTHORS, 41.2),
            ("wan", 2, "ring", bench.AUTHORS, nan), ("wan", 2, "ulysses", "SDPA (native)", 30.0)]
    assert bench.versus_authors(rows) == ("wan, 2 GPUs: our best 36.7 ms, the authors' best "
                                          "41.2 ms: 1.12x")
    assert bench.versus_authors(rows[:2]) is None
