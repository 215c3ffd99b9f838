"""Model and data: pure units, no process group."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from geotrain.config import DataConfig, ModelConfig
from geotrain.data import BatchSampler, build_rank_data, check_data, load_corpus, shard_for_rank, split_corpus
from geotrain.models import GPT, build_model, count_params


def test_model_files_know_nothing_of_distribution() -> None:
    imported = set()
    for src in (Path(__file__).resolve().parent.parent / "geotrain" / "models").glob("*.py"):
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module or "")
    assert "torch.nn" in imported  # the files were read
    assert not any("distributed" in m for m in imported), imported


def test_gpt_learns_a_repeated_sequence() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    model = GPT(cfg)
    assert count_params(model) == sum(p.numel() for p in model.parameters())
    x = torch.arange(16).repeat(4, 1)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_hf_model_from_config_without_download() -> None:
    pytest.importorskip("transformers")
    for model_type in ("gpt2", "llama"):
        cfg = ModelConfig(kind="hf", n_layer=1, n_head=2, n_embd=32, block_size=16, hf={"model_type": model_type})
        model = build_model(cfg)
        x = torch.randint(0, 256, (2, 16))
        loss = model(x, x)
        loss.backward()
        assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ~ln(256) at init


def test_default_corpus_ships_with_python_and_splits() -> None:
    raw = load_corpus(DataConfig())
    assert len(raw) > 1_000_000
    s = split_corpus(raw, 0.05)
    n_train = sum(b.numel() for b in s.train_blocks)
    assert n_train + s.eval_tokens.numel() == len(raw)
    assert 0.04 < s.eval_tokens.numel() / len(raw) < 0.06


def test_sharding_iid_and_non_iid(tmp_path: Path) -> None:
    text = "".join(f"line {i:06d} " + ("XXXX " if i < 5000 else "QQQQ ") * 5 + "\n" for i in range(10000))
    (tmp_path / "c.txt").write_text(text)
    cfg = DataConfig(corpus=str(tmp_path / "c.txt"))
    s = split_corpus(load_corpus(cfg), cfg.eval_fraction)
    iid = [shard_for_rank(s, r, [2, 2], non_iid=False) for r in range(4)]
    non = [shard_for_rank(s, r, [2, 2], non_iid=True) for r in range(4)]
    alpha, omega = ord("X"), ord("Q")
    for shard in iid:  # every rank sees both halves
        assert (shard == alpha).any() and (shard == omega).any()
    # non-IID: site A (ranks 0,1) reads the first half, site B the second
    assert not (non[0] == omega).any() and not (non[3] == alpha).any()
    # shards partition the training tokens
    total = sum(b.numel() for b in s.train_blocks)
    assert sum(x.numel() for x in iid) == total == sum(x.numel() for x in non)


def test_sampler_is_reproducible_from_its_state() -> None:
    tokens = torch.randint(0, 256, (10000,), dtype=torch.uint8)
    a = BatchSampler(tokens, 16, 4, seed=3)
    a.next()
    state = a.state()
    x1, y1 = a.next()
    b = BatchSampler(tokens, 16, 4, seed=99)
    b.set_state(state)
    x2, y2 = b.next()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_rank_data_and_too_small_corpus(tmp_path: Path) -> None:
    rd = build_rank_data(DataConfig(), rank=1, sites=[2, 2], block_size=32, batch_size=2, eval_batches_n=3, seed=0)
    x, y = rd.train.next()
    assert x.shape == (2, 32) and len(rd.eval) == 3
    (tmp_path / "tiny.txt").write_text("too small")
    with pytest.raises(ValueError, match="data.corpus"):
        check_data(DataConfig(corpus=str(tmp_path / "tiny.txt")), sites=[2, 2], block_size=64)


def test_a_directory_corpus_reads_text_files_only(tmp_path: Path) -> None:
    """Text by content, not by suffix: a LICENSE and a .c file are read, a binary and a Latin-1
    file are not, nor anything hidden."""
    from geotrain.data.corpus import read_corpus

    (tmp_path / "notes.txt").write_text("kept text\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.md").write_text("also kept\n")
    (tmp_path / "LICENSE").write_text("no suffix: kept too\n")
    (tmp_path / "main.c").write_text("int main(void) { return 0; }\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 not read")
    (tmp_path / "blob.txt").write_bytes(b"binary\0data")
    git = tmp_path / ".git" / "objects" / "ab"
    git.mkdir(parents=True)
    (git / "cdef").write_bytes(b"x\x9c\x01compressed")
    (tmp_path / ".git" / "description.txt").write_text("hidden: not read\n")
    data = read_corpus(str(tmp_path))
    assert b"kept text" in data and b"also kept" in data and b"kept too" in data and b"int main" in data
    assert b"not read" not in data and b"binary" not in data and b"compressed" not in data


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    from geotrain.config import OptimConfig
    from geotrain.run.optim import MuonAdamW, muon_split

    model = build_model(ModelConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    muon, adamw = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    # per block: attention qkv and projection, the MLP's two matrices
    assert sorted(names[id(p)] for p in muon) == sorted(
        f"blocks.{b}.{m}.weight" for b in range(2) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    )
    rest = {names[id(p)] for p in adamw}
    assert {"wte.weight", "wpe.weight"} <= rest  # embeddings (and the head tied to wte) stay on AdamW
    assert all(p.dim() == 1 for p in adamw if names[id(p)] not in ("wte.weight", "wpe.weight", "head.weight"))
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    opt = MuonAdamW(model, OptimConfig(name="muon"))
    # one set of param groups, shared with the two optimizers: a scheduler's lr reaches both
    opt.param_groups[0]["lr"] = 1e-3
    assert opt.muon.param_groups[0]["lr"] == 1e-3 and opt.adamw.param_groups[0]["lr"] != 1e-3
    assert set(opt.state_dict()) == {"muon", "adamw"}


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
def test_weight_decay_reaches_matrices_only(name: str) -> None:
    """With a zero gradient the only change is decay: matrices shrink, norm gains and biases stay."""
    from geotrain.config import OptimConfig
    from geotrain.run.optim import build_optimizer

    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    opt, _ = build_optimizer(OptimConfig(name=name, weight_decay=0.5, lr=0.1, warmup_steps=0), model, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        moved = not torch.equal(p.detach(), before[n])
        assert moved == (p.dim() >= 2), (n, moved)  # decayed iff a matrix (incl. the embeddings)
    assert any(n.endswith("ln1.weight") for n in before) and any(n.endswith("qkv.bias") for n in before)


def test_muon_orthogonalises_in_fp32_on_cpu_like_torch_does_in_bf16() -> None:
    import torch.optim._muon as torch_muon

    from geotrain.run.optim import _fp32_newton_schulz, _newton_schulz_fp32

    coeffs = (3.4445, -4.775, 2.0315)
    for shape in ((64, 192), (192, 64)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        ours = _newton_schulz_fp32(g, coeffs, 5, 1e-7)
        theirs = torch_muon._zeropower_via_newtonschulz(g, coeffs, 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        assert float((ours - theirs).norm() / theirs.norm()) < 0.03  # bf16 rounding apart
    original = torch_muon._zeropower_via_newtonschulz
    with _fp32_newton_schulz():
        assert torch_muon._zeropower_via_newtonschulz is _newton_schulz_fp32
    assert torch_muon._zeropower_via_newtonschulz is original  # restored after the step
