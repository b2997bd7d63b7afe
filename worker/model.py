"""The GPT (docs/architecture.md#the-worker): pre-norm transformer, causal self-attention, GELU MLP, learned
position embeddings, biases on, untied output head (no head bias). nanoGPT's shape, so that the
parameter iterator gives the checkpoint order of `shared.run.config.parameter_table`.

Parameters live in ONE contiguous float32 buffer (`GPT.flat`), each `nn.Parameter` a view into it
in checkpoint order; the optimizer's exp_avg / exp_avg_sq are views into two more flat buffers
(`worker/optim.py`). A checkpoint is then three contiguous copies, and a resume reads the file
straight into the three buffers.

nanoGPT readers beware: `.to()`, `.cuda()`, `.half()`... go through `GPT._apply`, which keeps
the parameters views of `flat` (a device move moves `flat`) and refuses any dtype but float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from shared.run.config import ModelShape, parameter_table


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape, dropout: float) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout = shape.n_head, shape.n_embd, dropout
        self.c_attn = nn.Linear(shape.n_embd, 3 * shape.n_embd)
        self.c_proj = nn.Linear(shape.n_embd, shape.n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(shape.n_embd, 4 * shape.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * shape.n_embd, shape.n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd)
        self.attn = CausalSelfAttention(shape, dropout)
        self.ln_2 = nn.LayerNorm(shape.n_embd)
        self.mlp = MLP(shape, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def is_view_at(t: torch.Tensor, buf: torch.Tensor, off: int) -> bool:
    """Whether `t` is a view of the flat buffer `buf`, of its dtype, at element offset `off`
    (pointers only, no data read)."""
    return (
        t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        and t.data_ptr() == buf.data_ptr() + off * buf.element_size()
        and t.dtype == buf.dtype
    )


def _meta_embedding(num: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose (num, dim) weight is on the meta device and never initialised:
    `nn.Embedding` would run `normal_` on it, which on the meta device goes through torch's
    reference implementations and imports torch._dynamo (about 1.5 s at start-up; the test
    `test_building_a_gpt_does_not_import_torch_dynamo` guards it)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, device="meta"))


class GPT(nn.Module):
    """GPT over `vocab_size` tokens with architecture `shape`.

    forward(idx: int64 (B, T)) -> logits float32 (B, T, vocab_size); T <= block_size.
    `flat`: float32 (n_params,) holding every parameter in checkpoint order. dropout: the
    residual/attention/embedding dropout probability. seed: the GPT-2 initialisation's
    generator (normal(0, 0.02), residual projections scaled by 1/sqrt(2 x layers), LayerNorm
    weight 1, biases 0; a private generator: the global RNG is untouched). init_weights=False
    leaves `flat` uninitialised for a caller that fills it at once (a resume reads the
    checkpoint straight into it): it saves the initialisation's time at start-up.
    """

    def __init__(
        self,
        shape: ModelShape,
        vocab_size: int,
        dropout: float = 0.0,
        seed: int = 0,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        self.shape, self.vocab_size = shape, vocab_size
        # Built on the meta device: no memory and no default initialisation (which the GPT-2
        # init below, or a checkpoint, would overwrite anyway); `_materialize` then makes every
        # parameter a view of `flat`.
        with torch.device("meta"):
            self.transformer = nn.ModuleDict(
                dict(
                    wte=_meta_embedding(vocab_size, shape.n_embd),
                    wpe=_meta_embedding(shape.block_size, shape.n_embd),
                    drop=nn.Dropout(dropout),
                    h=nn.ModuleList([Block(shape, dropout) for _ in range(shape.n_layer)]),
                    ln_f=nn.LayerNorm(shape.n_embd),
                )
            )
            self.lm_head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        self.table = parameter_table(shape, vocab_size)
        got = [(n, tuple(p.shape)) for n, p in self.named_parameters()]
        want = [(n, s) for n, s, _ in self.table]
        if got != want:  # a programming error: the file order would silently change
            raise RuntimeError(
                f"parameter order differs from shared.run.config.parameter_table: "
                f"{got[:3]}... vs {want[:3]}..."
            )
        self.flat = self._materialize()
        if init_weights:
            g = torch.Generator().manual_seed(seed)
            std_proj = 0.02 / math.sqrt(2 * shape.n_layer)  # GPT-2 scaled residual init
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("c_proj.weight"):
                        p.normal_(0.0, std_proj, generator=g)
                    elif p.dim() == 2:
                        p.normal_(0.0, 0.02, generator=g)
                    elif "ln_" in name and name.endswith("weight"):
                        p.fill_(1.0)
                    else:
                        p.zero_()

    def _materialize(self) -> torch.Tensor:
        """Allocate `flat` (float32, uninitialised, on the CPU) and replace every meta parameter
        with a view of it at its checkpoint offset (shared.run.config.parameter_table, whose
        order __init__ checked)."""
        flat = torch.empty(sum(math.prod(s) for _, s, _ in self.table), dtype=torch.float32)
        for (name, p), (_, _, off) in zip(list(self.named_parameters()), self.table):
            mod_name, _, attr = name.rpartition(".")
            view = nn.Parameter(flat[off : off + p.numel()].view(p.shape), p.requires_grad)
            self.get_submodule(mod_name)._parameters[attr] = view
        if any(b.is_meta for b in self.buffers()):  # none today; a new one must be materialised
            raise RuntimeError("GPT has a buffer on the meta device: materialise it in __init__")
        return flat

    def _apply(self, fn, recurse: bool = True) -> "GPT":
        """What `.to()`, `.cuda()`, `.cpu()`, `.float()`, `.half()`, `.to_empty()`... call: `fn` is
        applied to `flat` once and every parameter (and its gradient) re-pointed at its slice of
        the result, so parameters stay views of `flat` in checkpoint order. The GPT has no
        buffers, so nothing else is converted. Raises TypeError, before anything changes, when
        `fn` would change the dtype (`.half()`, `.bfloat16()`, `.double()`, `.to(dtype)`): the
        weights, AdamW's m and v and the checkpoint are float32 by the file format
        (docs/checkpoint-format.md#layout)."""
        if not hasattr(self, "flat"):  # during __init__, before _materialize(): plain nn.Module
            return super()._apply(fn, recurse)
        flat = fn(self.flat)
        if flat.dtype != torch.float32:
            raise TypeError(
                f"GPT parameters are views of one float32 buffer (GPT.flat), which the checkpoint "
                f"format stores as is; converting them to {flat.dtype} would detach them from it "
                f"and checkpoints would save stale weights. For bf16 training use autocast "
                f"(--precision bf16, worker/precision.py), not .to(dtype)/.half()/.bfloat16()"
            )
        if flat is not self.flat:
            for p, (_, _, off) in zip(self.parameters(), self.table):
                p.data = flat[off : off + p.numel()].view_as(p)
                if p.grad is not None:
                    p.grad = fn(p.grad)
            self.flat = flat
        return self

    def check_flat(self) -> None:
        """Raise RuntimeError naming the first parameter that is no longer the view of `flat` at
        its checkpoint offset (something re-allocated it: checkpoints would save stale
        weights). Cheap: compares pointers, reads no data."""
        for p, (name, shape, off) in zip(self.parameters(), self.table):
            if not is_view_at(p, self.flat, off) or tuple(p.shape) != tuple(shape):
                raise RuntimeError(
                    f"parameter {name} is no longer a view of GPT.flat at offset "
                    f"{off}: checkpoints would save stale weights"
                )

    @property
    def n_params(self) -> int:
        return self.flat.numel()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x the parameters that take part in a matmul (all but the
        token and position embeddings, which are lookups; the untied output head is a matmul)
        plus attention's 12 x layers x width x context (PaLM appendix B; nanoGPT's
        estimate_mfu, which leaves out the position embeddings and, its head being tied, counts
        the token embedding once as the head)."""
        s = self.shape
        lookups = (self.vocab_size + s.block_size) * s.n_embd
        return 6 * (self.n_params - lookups) + 12 * s.n_layer * s.n_embd * s.block_size
