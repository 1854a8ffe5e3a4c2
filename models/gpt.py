"""A GPT language model in Flax NNX whose attention is switchable: ours, XLA or cuDNN.

Pre-norm transformer blocks (LayerNorm -> causal self-attention -> residual; LayerNorm
-> MLP -> residual), rotary or learned positions, output projection tied to the token
embedding. The vocabulary is the dataset's: bytes (256) by default, or GPT-2's BPE
(50257), whose embedding is padded to 50304 rows (a multiple of 64, for the matmuls);
the padding rows' logits are -inf, so they are never predicted nor sampled. Parameters
are float32; compute runs in `compute_dtype` (bfloat16 by default): mixed precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import pallas_flash
from models import sharding


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # the tokenizer's (models/data.py's meta.json)
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # fewer key/value heads: GQA
    d_model: int = 256
    rotary: bool = True
    compute_dtype: str = "bfloat16"
    # Recompute each block's activations in the backward pass instead of keeping them:
    # memory per token drops from every intermediate of every block to each block's input
    # (long contexts), for about one more forward pass of compute.
    remat: bool = False

    @property
    def padded_vocab(self) -> int:
        """The embedding's rows: `vocab` rounded up to a multiple of 64."""
        return -(-self.vocab // 64) * 64


PRESETS = {
    "tiny": GPTConfig(seq_len=128, n_layer=2, n_head=4, d_model=128),  # CPU smoke / demo
    "small": GPTConfig(seq_len=1024, n_layer=6, n_head=8, d_model=512),
    "gpt2-small": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768),
}

ATTENTION = {
    "flash": lambda q, k, v: pallas_flash.flash_attention(q, k, v, is_causal=True),
    "xla": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"
    ),
    "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"
    ),
}


def rotary(x, positions):
    """Rotary position embedding on [B, T, heads, H] (H even), rotating half-pairs."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [T, half]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def dropout(x, rate: float, key):
    """Inverted dropout with an explicit key; the identity when key is None or rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def per_projection(init, widths):
    """An initializer for a fused [d, sum(widths)] kernel that gives each projection's own
    [d, w] block `init`, as if they were separate layers: a fan-based init (xavier) would
    otherwise see the fused width as one layer's fan-out."""

    def f(key, shape, dtype=jnp.float32):
        keys = jax.random.split(key, len(widths))
        return jnp.concatenate([init(k, (shape[0], w), dtype) for k, w in zip(keys, widths)], 1)

    return f


class Block(nnx.Module):
    """Pre-norm block. `cfg` needs d_model, n_head, n_kv_head, rotary, compute_dtype;
    qkv_dim (attention width, default d_model), mlp_dim (default 4 d_model) and
    dropout_rate (on the attention output and both MLP layers, LRA's placement) serve the LRA
    classifier, and so do kernel_init (None: nnx.Linear's lecun-normal; applied per
    projection in the fused q/k/v kernel), attention_bias (False: q/k/v and the output
    projection without biases) and mlp_bias_init (None: zeros); the GPT uses the defaults."""

    def __init__(
        self,
        cfg,
        attention,
        *,
        rngs: nnx.Rngs,
        qkv_dim: int | None = None,
        mlp_dim: int | None = None,
        dropout_rate: float = 0.0,
        kernel_init=None,
        attention_bias: bool = True,
        mlp_bias_init=None,
    ):
        dt = jnp.dtype(cfg.compute_dtype)
        self.cfg, self.attention, self.dropout_rate = cfg, attention, dropout_rate
        self.n_kv = cfg.n_kv_head or cfg.n_head
        self.qkv_dim = qkv_dim or cfg.d_model
        self.head_dim = self.qkv_dim // cfg.n_head
        mlp_dim = mlp_dim or 4 * cfg.d_model
        widths = (cfg.n_head * self.head_dim, *(2 * (self.n_kv * self.head_dim,)))
        init = {} if kernel_init is None else {"kernel_init": kernel_init}
        qkv_init = (
            {} if kernel_init is None else {"kernel_init": per_projection(kernel_init, widths)}
        )
        mlp_init = init | ({} if mlp_bias_init is None else {"bias_init": mlp_bias_init})
        dense = functools.partial(nnx.Linear, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.qkv = dense(cfg.d_model, sum(widths), use_bias=attention_bias, **qkv_init)
        self.proj = dense(self.qkv_dim, cfg.d_model, use_bias=attention_bias, **init)
        self.ln2 = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.fc = dense(cfg.d_model, mlp_dim, **mlp_init)
        self.out = dense(mlp_dim, cfg.d_model, **mlp_init)

    def __call__(self, x, *, dropout_key=None, **attention_kwargs):
        """`attention_kwargs` (lengths, attention dropout) go to the attention function."""
        B, T, _ = x.shape
        h = self.qkv(self.ln1(x))
        nq, nkv = self.cfg.n_head * self.head_dim, self.n_kv * self.head_dim
        q = h[..., :nq].reshape(B, T, self.cfg.n_head, self.head_dim)
        k = h[..., nq : nq + nkv].reshape(B, T, self.n_kv, self.head_dim)
        v = h[..., nq + nkv :].reshape(B, T, self.n_kv, self.head_dim)
        if self.cfg.rotary:
            pos = jnp.arange(T)
            q, k = rotary(q, pos), rotary(k, pos)
        a = self.attention(q, k, v, **attention_kwargs).reshape(B, T, self.qkv_dim)
        keys = [None] * 3 if dropout_key is None else list(jax.random.split(dropout_key, 3))
        x = x + dropout(self.proj(a), self.dropout_rate, keys[0])
        h = dropout(jax.nn.gelu(self.fc(self.ln2(x))), self.dropout_rate, keys[1])
        return x + dropout(self.out(h), self.dropout_rate, keys[2])


class GPT(nnx.Module):
    """The GPT; with a (data, seq) `mesh` (models/sharding.py) its attention runs over the
    mesh (ring attention when seq > 1), and the rest needs nothing: it is position-wise,
    and the positions are those of the global sequence."""

    def __init__(
        self,
        cfg: GPTConfig,
        attention: str = "flash",
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
        if mesh is not None and mesh.shape[sharding.SEQ] > 1 and attention != "flash":
            raise ValueError(
                f"sequence parallelism runs ring attention over our kernels: attention must "
                f"be 'flash', got {attention!r}"
            )
        attend = (
            ATTENTION[attention] if mesh is None else sharding.attention(mesh, ATTENTION[attention])
        )
        dt = jnp.dtype(cfg.compute_dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.padded_vocab, cfg.d_model, dtype=dt, param_dtype=jnp.float32, rngs=rngs
        )
        self.pos = None
        if not cfg.rotary:
            self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dt, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attend, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = _remat_call(block, x) if self.cfg.remat else block(x)
        x = self.ln_f(x)
        logits = self.embed.attend(x).astype(jnp.float32)  # tied output projection
        if self.cfg.padded_vocab > self.cfg.vocab:  # no token: probability 0
            real = jnp.arange(self.cfg.padded_vocab) < self.cfg.vocab
            logits = jnp.where(real, logits, -jnp.inf)
        return logits


@nnx.remat
def _remat_call(block, x):
    return block(x)


def loss_fn(model: GPT, tokens):
    """Mean next-token cross-entropy in nats of windows [B, T + 1] (byte-level: bits per
    byte = this / ln 2; a BPE: this x tokens / bytes / ln 2)."""
    return next_token_loss(model, tokens[:, :-1], tokens[:, 1:])


def next_token_loss(model: GPT, inputs, targets):
    """`loss_fn` with the inputs and targets [B, T] apart (T, not T + 1: a sequence that
    splits evenly over devices)."""
    logp = jax.nn.log_softmax(model(inputs), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), -1)[..., 0]
    return nll.mean()


def generate(
    model: GPT, prompt: np.ndarray, n: int, key, temperature: float = 0.8, pad: int = 10
) -> np.ndarray:
    """Samples n tokens after `prompt`; one jitted step per token over a fixed window (the
    last seq_len tokens, left-padded with `pad`, a newline's id, at the start)."""
    graphdef, state = nnx.split(model)
    L = model.cfg.seq_len

    @jax.jit
    def step(state, window, key):
        logits = nnx.merge(graphdef, state)(window[None])[0, -1] / temperature
        return jax.random.categorical(key, logits)

    tokens = list(np.asarray(prompt, np.int32))
    for i in range(n):
        window = ([pad] * L + tokens)[-L:]
        tokens.append(int(step(state, jnp.asarray(window, jnp.int32), jax.random.fold_in(key, i))))
    return np.asarray(tokens, np.int32)
