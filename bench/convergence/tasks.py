"""The tasks of bench/convergence: data (generated, or shipped with Python and scikit-learn:
nothing is downloaded), a model, an optimizer and a schedule, and the metric at the end.

Every task is deterministic given its seed: the same data, initial weights and batches for every
method, so methods differ only in how gradients cross the network. Each rank draws its own rows of
one global batch per step (seeded by the step), as a DistributedSampler would.

A task marked ``heldout`` was not looked at while the defaults were chosen; its figures are read
last (``--tasks heldout``), so that the defaults are checked on work they were not tuned on.
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.convergence import heldout_models


@dataclass(frozen=True)
class Task:
    name: str
    kind: str            # "classification" | "lm" | "regression"
    metric: str          # "accuracy" (higher is better) | "val_loss" | "test_mse" (lower is better)
    steps: int
    batch: int           # per rank
    optimizer: str       # "sgd" | "adam" | "adamw"
    lr: float
    schedule: str = "constant"   # "constant" | "cosine" | "step" | "warmup_linear"
    momentum: float = 0.9
    weight_decay: float = 0.0
    bf16: bool = False   # forward and backward under CPU autocast to bfloat16
    bucket_cap_mb: float = 0.25  # several DDP buckets for every model here
    heldout: bool = False
    evals: int = 10      # points on the curve
    seed: int = 0        # initial weights and batch order (the data stay the same)
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    @property
    def adam_family(self) -> bool:
        return self.optimizer in ("adam", "adamw")

    def lr_at(self, step: int) -> float:
        progress = step / self.steps
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1 + math.cos(math.pi * progress))
        if self.schedule == "step":
            return self.lr * (0.1 if progress >= 2 / 3 else 1.0)
        if self.schedule == "warmup_linear":
            warm = 0.05 * self.steps
            return self.lr * (step / warm if step < warm else (1 - progress) / (1 - 0.05))
        raise ValueError(self.schedule)


# ------------------------------------------------------------------------------------------------
# Data


def _clusters(seed, n, dim, classes, separation):
    """scikit-learn's make_classification: two Gaussian clusters per class on a random subspace,
    redundant and noise features, 2% flipped labels (accuracy saturates below 1)."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=n, n_features=dim, n_informative=dim // 3,
                               n_redundant=dim // 6, n_classes=classes, n_clusters_per_class=2,
                               class_sep=separation, flip_y=0.02, random_state=seed)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def _split(x, y, test):
    return {"train": (x[:-test], y[:-test]), "test": (x[-test:], y[-test:])}


def _shapes_images(seed, n, size=16, classes=10):
    """Images of one of ten random smooth templates, shifted by up to 3 pixels, with noise."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 1, size, size, generator=gen)
    templates = F.avg_pool2d(F.pad(templates, (2, 2, 2, 2), mode="circular"), 5, stride=1)
    templates = templates / templates.flatten(1).std(1).view(-1, 1, 1, 1)
    y = torch.randint(0, classes, (n,), generator=gen)
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    x = templates[y].clone()
    for i in range(n):  # circular shifts: position carries no class information
        x[i] = torch.roll(x[i], (int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
    x += 1.6 * torch.randn(x.shape, generator=gen)
    return x, y


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    x = (x - x[:1297].mean(0)) / (x[:1297].std(0) + 1e-3)
    return {"train": (x[:1297], y[:1297]), "test": (x[1297:], y[1297:])}


_TEXT_FILES = ("argparse.py", "textwrap.py", "difflib.py", "calendar.py", "fractions.py",
               "statistics.py", "heapq.py", "bisect.py", "shlex.py", "string.py", "glob.py")


def _text(context: int):
    """Characters of a few standard-library modules (they ship with every Python): a char-level
    language-modelling corpus, 90% train, 10% validation."""
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in _TEXT_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                chunks.append(f.read())
    text = "\n".join(chunks)
    text = "".join(c if ord(c) < 128 else "?" for c in text)
    data = torch.tensor([ord(c) for c in text], dtype=torch.int64)
    cut = int(len(data) * 0.9)
    return {"train": data[:cut], "test": data[cut:], "vocab": 128, "context": context}


def _teacher_regression(seed, n, dim, out, test):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, 128, generator=gen) / math.sqrt(dim)
    w2 = torch.randn(128, out, generator=gen) / math.sqrt(128)
    x = torch.randn(n, dim, generator=gen)
    y = torch.tanh(x @ w1 * 1.5) @ w2 + 0.05 * torch.randn(n, out, generator=gen)
    return _split(x, y, test)


# ------------------------------------------------------------------------------------------------
# Models


def _mlp(sizes, residual_depth=0):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ResidualMLP(nn.Module):
    def __init__(self, dim_in, width, depth, classes):
        super().__init__()
        self.inp = nn.Linear(dim_in, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _cnn(width=16):
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * width * 16, 128), nn.ReLU(), nn.Linear(128, 10))


class CharTransformer(nn.Module):
    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.body(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


# ------------------------------------------------------------------------------------------------
# The suite


TASKS = {
    "mlp_sgd_constant": Task(
        "mlp_sgd_constant", "classification", "accuracy", steps=600, batch=32, optimizer="sgd",
        lr=0.05, note="MLP 120-512-512-10 (330K), SGD momentum 0.9, constant lr 0.05, fp32",
        extra={"data": ("clusters", 1, 120, 10, 1.7), "sizes": (120, 512, 512, 10)}),
    "cnn_sgd_cosine": Task(
        "cnn_sgd_cosine", "classification", "accuracy", steps=300, batch=16, optimizer="sgd",
        lr=0.05, schedule="cosine", note="CNN (3 conv + 2 linear, 160K), SGD momentum 0.9, "
        "cosine lr, fp32", extra={"data": ("shapes", 2)}),
    "charlm_adamw": Task(
        "charlm_adamw", "lm", "val_loss", steps=400, batch=8, optimizer="adamw", lr=3e-3,
        weight_decay=0.01, note="char transformer LM (2 layers, d=96, 240K), AdamW 3e-3, fp32",
        extra={"data": ("text", 64), "d": 96, "layers": 2}),
    # a CNN under Adam: dead-then-revived ReLU units make unbounded 1-bit optimizer directions
    # diverge (docs/onebit_adam.md)
    "cnn_adam_step": Task(
        "cnn_adam_step", "classification", "accuracy", steps=300, batch=16, optimizer="adam",
        lr=1e-3, schedule="step", note="CNN (3 conv + 2 linear, 160K), Adam 1e-3, step lr, fp32",
        extra={"data": ("shapes", 2)}),
    "regression_adam": Task(
        "regression_adam", "regression", "test_mse", steps=800, batch=32, optimizer="adam",
        lr=2e-3, note="MLP 64-256-256-16 regression (86K), Adam 2e-3, fp32",
        extra={"data": ("regression", 3, 64, 16), "sizes": (64, 256, 256, 16)}),
    "wide_mlp_bf16_step": Task(
        "wide_mlp_bf16_step", "classification", "accuracy", steps=300, batch=32,
        optimizer="sgd", lr=0.02, schedule="step", bf16=True, bucket_cap_mb=2.0,
        note="MLP 256-1536-1536-10 (2.8M), SGD momentum 0.9, step lr 0.02, bf16 autocast",
        extra={"data": ("clusters", 4, 256, 10, 2.0), "sizes": (256, 1536, 1536, 10)}),
    "digits_adam_bf16": Task(
        "digits_adam_bf16", "classification", "accuracy", steps=300, batch=16, optimizer="adam",
        lr=1e-3, bf16=True, bucket_cap_mb=0.05,
        note="MLP 64-256-256-10 on scikit-learn's digits (85K), Adam 1e-3, bf16 autocast",
        extra={"data": ("digits",), "sizes": (64, 256, 256, 10)}),
    # held out: not looked at while the defaults were chosen
    "resmlp_sgd_warmup": Task(
        "resmlp_sgd_warmup", "classification", "accuracy", steps=400, batch=32, optimizer="sgd",
        lr=0.05, schedule="warmup_linear", heldout=True,
        note="residual MLP with LayerNorm (6 blocks, width 256, 440K), SGD momentum 0.9, "
        "warm-up + linear decay, fp32",
        extra={"data": ("clusters", 5, 96, 10, 1.5), "width": 256, "depth": 6}),
    "charlm_adam_bf16": Task(
        "charlm_adam_bf16", "lm", "val_loss", steps=300, batch=8, optimizer="adam", lr=2e-3,
        bf16=True, heldout=True,
        note="char transformer LM (3 layers, d=128, 620K), Adam 2e-3, bf16 autocast",
        extra={"data": ("text", 64), "d": 128, "layers": 3}),
    # held out from PowerSGD's adaptive_rank choice (the two above were looked at for it)
    "cnn_adamw_cosine_bf16": Task(
        "cnn_adamw_cosine_bf16", "classification", "accuracy", steps=300, batch=16,
        optimizer="adamw", lr=2e-3, schedule="cosine", weight_decay=0.05, bf16=True,
        heldout=True, note="CNN (3 conv + 2 linear, 160K) on other templates, AdamW 2e-3 with "
        "weight decay 0.05, cosine lr, bf16 autocast", extra={"data": ("shapes", 6)}),
    "charlm_adamw_wide_cosine": Task(
        "charlm_adamw_wide_cosine", "lm", "val_loss", steps=300, batch=16, optimizer="adamw",
        lr=1.5e-3, schedule="cosine", weight_decay=0.01, heldout=True,
        note="char transformer LM (1 layer, d=192, context 32, 500K), AdamW 1.5e-3, cosine lr, "
        "fp32", extra={"data": ("text", 32), "d": 192, "layers": 1}),
    # held out: PowerSGD's stacked-expert rule was decided on parameter shapes, not on this task
    "moe_lm_adamw_bf16": Task(
        "moe_lm_adamw_bf16", "lm", "val_loss", steps=300, batch=8, optimizer="adamw", lr=2e-3,
        schedule="cosine", weight_decay=0.01, bf16=True, heldout=True,
        note="DeepSeek-V3-style MoE char LM (1 layer, d=256, latent attention, 8 routed experts "
        "fused as [8, 256, 512] and [8, 512, 256], top-2, a shared expert; 2.6M), AdamW 2e-3, "
        "cosine lr, bf16 autocast",
        extra={"data": ("text", 64), "d": 256, "layers": 1, "experts": 8, "hidden": 512,
               "top_k": 2}),
    # held out, kinds the suite lacked: batch norm under AdamW and bf16, a recurrent model, a
    # wider regression (whose Adam also runs the 1-bit optimizers)
    "bncnn_adamw_bf16": Task(
        "bncnn_adamw_bf16", "classification", "accuracy", steps=300, batch=16,
        optimizer="adamw", lr=3e-3, schedule="warmup_linear", weight_decay=0.05, bf16=True,
        heldout=True, note="convnet with batch norm (4 conv, width 24, 74K) on other templates, "
        "AdamW 3e-3, warm-up + linear decay, bf16 autocast",
        extra={"data": ("shapes", 11), "model": "bn_cnn"}),
    "gru_lm_adam_step": Task(
        "gru_lm_adam_step", "lm", "val_loss", steps=300, batch=8, optimizer="adam", lr=4e-3,
        schedule="step", heldout=True, note="char GRU LM (embedding 64, 1 layer of 256, 290K), "
        "Adam 4e-3, step lr, fp32", extra={"data": ("text", 48), "model": "gru", "d": 64,
                                            "hidden": 256, "layers": 1}),
    "regression_adamw_wide_cosine": Task(
        "regression_adamw_wide_cosine", "regression", "test_mse", steps=600, batch=32,
        optimizer="adamw", lr=1e-3, schedule="cosine", weight_decay=0.01, heldout=True,
        note="MLP 48-768-768-8 regression (640K) on another teacher, AdamW 1e-3, cosine lr, fp32",
        extra={"data": ("regression", 17, 48, 8), "sizes": (48, 768, 768, 8)}),
}


def load_data(task: Task):
    kind = task.extra["data"]
    if kind[0] == "clusters":
        x, y = _clusters(kind[1], 24_000, kind[2], kind[3], kind[4])
        return _split(x, y, 4000)
    if kind[0] == "shapes":
        x, y = _shapes_images(kind[1], 12_000)
        return _split(x, y, 2000)
    if kind[0] == "digits":
        return _digits()
    if kind[0] == "text":
        return _text(kind[1])
    if kind[0] == "regression":
        return _teacher_regression(kind[1], 12_000, kind[2], kind[3], 2000)
    raise ValueError(kind)


def build_model(task: Task, seed: int | None = None) -> nn.Module:
    torch.manual_seed(task.seed if seed is None else seed)
    if task.extra.get("model") == "bn_cnn":
        return heldout_models.bn_cnn()
    if task.extra.get("model") == "gru":
        e = task.extra
        return heldout_models.GRULanguageModel(128, e["d"], e["hidden"], e["layers"])
    if "sizes" in task.extra:
        return _mlp(task.extra["sizes"])
    if task.name.startswith("cnn"):
        return _cnn()
    if "depth" in task.extra:
        return ResidualMLP(task.extra["data"][2], task.extra["width"], task.extra["depth"], 10)
    if "experts" in task.extra:
        from bench.convergence.moe import MoELM

        e = task.extra
        return MoELM(128, e["d"], e["layers"], 4, e["data"][1], e["experts"], e["hidden"],
                     e["top_k"])
    if task.kind == "lm":
        d = task.extra["d"]
        return CharTransformer(128, d, task.extra["layers"], 4, task.extra["data"][1])
    raise ValueError(task.name)


def batch(task: Task, data, step: int, rank: int, world: int):
    """This rank's rows of the step's global batch."""
    gen = torch.Generator().manual_seed(1_000_003 * (step + 1) + 7919 * task.seed)
    if task.kind == "lm":
        text, context = data["train"], data["context"]
        starts = torch.randint(0, len(text) - context - 1, (task.batch * world,), generator=gen)
        mine = starts[rank::world]
        x = torch.stack([text[s:s + context] for s in mine.tolist()])
        y = torch.stack([text[s + 1:s + 1 + context] for s in mine.tolist()])
        return x, y
    x, y = data["train"]
    index = torch.randint(0, len(y), (task.batch * world,), generator=gen)[rank::world]
    return x[index], y[index]


def loss_fn(task: Task, output, target):
    if task.kind == "regression":
        return F.mse_loss(output.float(), target)
    if task.kind == "lm":
        return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output.float(), target)


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, data) -> float:
    model.eval()
    try:
        if task.kind == "lm":
            text, context = data["test"], data["context"]
            starts = torch.arange(0, len(text) - context - 1, context)[:256]
            x = torch.stack([text[s:s + context] for s in starts.tolist()])
            y = torch.stack([text[s + 1:s + 1 + context] for s in starts.tolist()])
            return float(loss_fn(task, model(x), y))
        x, y = data["test"]
        out = model(x)
        if task.kind == "regression":
            return float(F.mse_loss(out, y))
        return float((out.argmax(1) == y).float().mean())
    finally:
        model.train()
