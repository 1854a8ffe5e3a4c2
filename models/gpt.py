"""A GPT language model in Flax NNX whose attention is switchable: ours, XLA or cuDNN.

Pre-norm transformer blocks (LayerNorm -> causal self-attention -> residual; LayerNorm
-> MLP -> residual), rotary or learned positions, output projection tied to the token
embedding. Byte-level by default (vocabulary 256). Parameters are float32; compute
runs in `compute_dtype` (bfloat16 by default): mixed precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_flash


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # fewer key/value heads: GQA
    d_model: int = 256
    rotary: bool = True
    compute_dtype: str = "bfloat16"


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


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, attention, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.compute_dtype)
        self.cfg, self.attention = cfg, attention
        self.n_kv = cfg.n_kv_head or cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        dense = functools.partial(nnx.Linear, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.qkv = dense(cfg.d_model, (cfg.n_head + 2 * self.n_kv) * self.head_dim)
        self.proj = dense(cfg.d_model, cfg.d_model)
        self.ln2 = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)
        self.fc = dense(cfg.d_model, 4 * cfg.d_model)
        self.out = dense(4 * cfg.d_model, cfg.d_model)

    def __call__(self, x):
        B, T, _ = x.shape
        h = self.qkv(self.ln1(x))
        nq, nkv = self.cfg.n_head * self.head_dim, self.n_kv * self.head_dim
        q = h[..., :nq].reshape(B, T, self.cfg.n_head, self.head_dim)
        k = h[..., nq : nq + nkv].reshape(B, T, self.n_kv, self.head_dim)
        v = h[..., nq + nkv :].reshape(B, T, self.n_kv, self.head_dim)
        if self.cfg.rotary:
            pos = jnp.arange(T)
            q, k = rotary(q, pos), rotary(k, pos)
        a = self.attention(q, k, v).reshape(B, T, self.cfg.d_model)
        x = x + self.proj(a)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, attention: str = "flash", *, rngs: nnx.Rngs):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
        dt = jnp.dtype(cfg.compute_dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.pos = None
        if not cfg.rotary:
            self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dt, rngs=rngs)
        self.blocks = nnx.List(
            [Block(cfg, ATTENTION[attention], rngs=rngs) for _ in range(cfg.n_layer)]
        )
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dt, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.embed.attend(x).astype(jnp.float32)  # tied output projection


def loss_fn(model: GPT, tokens):
    """Mean next-byte cross-entropy in nats; bits per byte = this / ln 2."""
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), -1)[..., 0]
    return nll.mean()


def generate(model: GPT, prompt: np.ndarray, n: int, key, temperature: float = 0.8):
    """Samples n bytes after `prompt`; one jitted step per byte over a fixed window
    (the last seq_len bytes, left-padded with newlines at the start)."""
    graphdef, state = nnx.split(model)
    L = model.cfg.seq_len

    @jax.jit
    def step(state, window, key):
        logits = nnx.merge(graphdef, state)(window[None])[0, -1] / temperature
        return jax.random.categorical(key, logits)

    tokens = list(np.asarray(prompt, np.int32))
    for i in range(n):
        window = ([10] * L + tokens)[-L:]
        tokens.append(int(step(state, jnp.asarray(window, jnp.int32), jax.random.fold_in(key, i))))
    return np.asarray(tokens, np.uint8)
