"""What is trained and how: model, data, the training loop, the inner optimizer, checkpoints, the run."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from geotrain.config.base import Section, existing_path

HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")  # the families geotrain maps its sizes onto (models.hf)


class ModelConfig(Section):
    kind: Literal["gpt", "hf"] = Field(
        default="gpt",
        description="'gpt': geotrain's GPT decoder; 'hf': a Hugging Face causal LM built from a config (needs the 'hf' extra).",
    )
    n_layer: int = Field(default=4, ge=1, le=256, description="Transformer blocks.")
    n_head: int = Field(default=4, ge=1, le=256, description="Attention heads.")
    n_embd: int = Field(default=128, ge=8, le=65536, description="Hidden size; must be divisible by n_head.")
    block_size: int = Field(default=64, ge=4, le=65536, description="Sequence length (context) in tokens.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability.")
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each block's activations in the backward pass instead of keeping them."
    )
    pretrained: str | None = Field(
        default=None,
        description="A local directory to start from: a Hugging Face model (kind=hf; from_pretrained, never downloaded; "
        "its config sets the sizes) or a geotrain GPT export (kind=gpt; its sizes must equal these). "
        "Its vocabulary must hold the data's.",
    )
    hf: dict[str, Any] = Field(
        default_factory=lambda: {"model_type": "gpt2"},
        description="For kind=hf: keyword arguments for transformers.AutoConfig.for_model (model_type plus sizes). "
        "Sizes not given are taken from n_layer/n_head/n_embd/block_size; the vocabulary follows the data (256 bytes, or the token shards' tokenizer).",
    )

    _pretrained_exists = field_validator("pretrained")(existing_path)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        family = self.hf.get("model_type", "gpt2")
        if self.kind == "hf" and family not in HF_FAMILIES:
            raise ValueError(f"hf.model_type: must be one of {', '.join(HF_FAMILIES)} (got {family!r})")
        return self


class DataConfig(Section):
    corpus: str | None = Field(
        default=None,
        description="A text file or directory of text files to train on (bytes as tokens), or a directory made by "
        "geotrain data prepare (token shards read window by window, never whole; the model's vocabulary follows their tokenizer). "
        "Default (null): text that ships with CPython (pydoc topics and standard-library sources), so nothing is downloaded.",
    )
    eval_fraction: float = Field(default=0.05, gt=0, lt=0.5, description="Share of the corpus held out for evaluation.")
    non_iid: bool = Field(
        default=False,
        description="Give each site its own contiguous slice of the corpus (sites as organisations with their own data).",
    )

    _corpus_exists = field_validator("corpus")(existing_path)


class TrainConfig(Section):
    steps: int = Field(default=300, ge=1, le=10_000_000, description="Inner (local) optimizer steps per worker.")
    batch_size: int = Field(default=8, ge=1, le=65536, description="Sequences per worker per micro-batch.")
    grad_accum: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Micro-batches per step: their gradients are averaged before the (synchronised) step, "
        "so the batch of a step is batch_size x grad_accum sequences per worker.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="bf16: forward and backward under torch.autocast(bfloat16); parameters, gradients, inner and "
        "outer optimizer state stay fp32 (master weights), and evaluation runs in fp32.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the training model in place (parameter names, checkpoints and sync unchanged; "
        "the first step pays the compilation, tens of seconds on a CPU). Evaluation stays eager.",
    )
    seed: int = Field(default=1234, ge=0, description="Seed for model init and data sampling.")
    max_seconds: float = Field(
        default=0,
        ge=0,
        description="Stop at the first outer round boundary after this many seconds of training (every site agrees at the "
        "boundary; evaluations excluded; with sync.region_every, the first world round); 0 = no time limit. DiLoCo only.",
    )
    eval_every: int = Field(
        default=0, ge=0, description="Evaluate every N steps; 0 = every sync round (H) for diloco, every 25 steps for ddp."
    )
    eval_batches: int = Field(
        default=8, ge=1, le=10000, description="Held-out batches (of batch_size) per evaluation, split over all ranks."
    )
    log_every: int = Field(default=25, ge=1, description="Print a log line every N steps (local rank 0 of each site).")
    read_every: int = Field(
        default=0,
        ge=0,
        le=100_000,
        description="Read the loss and wait for the device every N steps, not at each (a GPU runs ahead of the host); "
        "the steps between get the window's mean step time; 0 = log_every on a GPU, 1 on a CPU.",
    )
    threads: int = Field(
        default=0, ge=0, le=1024, description="torch threads per rank; 0 = CPU cores / ranks on this machine (at least 1)."
    )
    save_final: bool = Field(
        default=True,
        description="Write the final global model to OUT/final_model.pt and OUT/final_model/: a Hugging Face model with its "
        "tokenizer (geotrain's GPT as a GPT-2), which transformers and model.pretrained load.",
    )
    timeline: bool = Field(
        default=False, description="Record per-rank compute and network intervals to OUT/timeline/rank{r}.json (for plots)."
    )


class OptimConfig(Section):
    name: Literal["adamw", "sgd", "muon"] = Field(
        default="adamw",
        description="Inner optimizer; 'muon': torch.optim.Muon for the hidden weight matrices and AdamW for embeddings, "
        "head, norms and biases (MuLoCo).",
    )
    lr: float = Field(default=4e-4, gt=0, le=10, description="Inner learning rate (DiLoCo paper: 4e-4).")
    weight_decay: float = Field(
        default=0.1, ge=0, le=1, description="Weight decay on matrices (DiLoCo paper: 0.1); norms and biases are never decayed."
    )
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], description="AdamW betas (DiLoCo paper: 0.9, 0.95).")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="Momentum for name=sgd.")
    muon_momentum: float = Field(default=0.95, ge=0, lt=1, description="Muon's Nesterov momentum (name=muon).")
    warmup_steps: int = Field(default=20, ge=0, description="Linear learning-rate warm-up steps.")
    schedule: Literal["constant", "cosine"] = Field(
        default="cosine", description="Learning rate after warm-up: constant, or cosine decay to 10% at the last step."
    )
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the (averaged) gradient norm to this value; 0 disables.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError("must be two numbers in [0, 1)")
        return v

    @model_validator(mode="after")
    def _momentum(self) -> OptimConfig:
        if self.momentum and self.name != "sgd":
            raise ValueError(
                f"momentum: applies to name=sgd only (name={self.name}"
                + ("; Muon's is optim.muon_momentum)" if self.name == "muon" else ")")
            )
        return self


class CheckpointConfig(Section):
    every: int = Field(default=0, ge=0, description="Write a checkpoint every N inner steps (0: never).")
    dir: str | None = Field(
        default=None,
        description="Where checkpoints go; default OUT/checkpoints. '{site}' in it becomes each rank's site name (a folder "
        "per site, as on machines with disks of their own); no disk is assumed shared across sites.",
    )
    keep: int = Field(default=3, ge=1, le=1000, description="Keep the newest N checkpoints.")
    resume: str | None = Field(
        default=None,
        description="Resume from 'auto' (the newest checkpoint under dir that every rank holds and verifies) or from this "
        "checkpoint (a step-N directory; '{site}' as in dir); a truncated or tampered one is refused.",
    )
    allow_foreign: bool = Field(
        default=False,
        description="In a run with a secret, also load a checkpoint whose manifest another run (another secret, "
        "or none) sealed; its file hashes are still checked.",
    )

    @field_validator("dir", "resume")
    @classmethod
    def _site_placeholder(cls, v: str | None) -> str | None:
        if v is not None and ("{" in v.replace("{site}", "") or "}" in v.replace("{site}", "")):
            raise ValueError("the only placeholder is {site}")
        return v


class RunConfig(Section):
    baseline: Literal["ddp", "diloco", "streaming", "none"] = Field(
        default="ddp", description="Also train this algorithm on the same tokens and compare; 'none' to skip."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend; auto = nccl with CUDA, else gloo."
    )


class ReportConfig(Section):
    """What a run reports beyond its own files: the HTML page, an experiment tracker."""

    html: bool = Field(
        default=True, description="Write OUT/report.html at the end of geotrain train (geotrain report makes one for any runs)."
    )
    plot: bool = Field(
        default=True,
        description="Write OUT/loss.png at the end of geotrain train (off: no matplotlib work, for scripted runs that read "
        "summary.json only).",
    )
    tracker: Literal["none", "mlflow", "wandb"] = Field(
        default="none",
        description="Log per-step metrics, the config and the final summary from each site's first rank to an experiment "
        "tracker. mlflow: a local SQLite store (OUT/mlflow.db) unless tracker_uri names another; wandb: offline, under OUT "
        "(upload later with wandb sync). The package must be installed (refused in one line otherwise).",
    )
    tracker_uri: str | None = Field(
        default=None,
        description="mlflow: a tracking URI (sqlite:///PATH, http://HOST:PORT); default OUT/mlflow.db. wandb: ignored.",
    )
    experiment: str = Field(
        default="geotrain", min_length=1, max_length=200, description="The tracker's experiment/project name."
    )
