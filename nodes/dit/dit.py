"""The ERNIE-Image DiT, written for ComfyUI (engine: no ComfyUI import; its layers come from ``operations``).

The math is diffusers' ``ErnieImageTransformer2DModel`` (the reference the parity tests hold it to) and the
state-dict keys are the released checkpoint's, so the snapshot's shards and the single files load without
renaming. What differs is how it runs:

- Layers are built from the ``operations`` ComfyUI passes (``comfy.ops``), so ComfyUI's model management can keep
  part of the weights off the GPU and cast them per layer when used (partial loading, fp8 storage), and ComfyUI's
  LoRA patches reach each weight by its key.
- The hidden states are batch-first ``[B, S, H]`` (diffusers runs ``[S, B, H]`` and permutes around attention).
- Attention is PyTorch's SDPA, the reference's own, unless ComfyUI was started with an attention switch that keeps
  the reference's results to rounding: ``--use-split-cross-attention`` and ``--use-quad-cross-attention`` run
  core's functions, ``--use-flash-attention`` puts SDPA's FlashAttention kernel first. ``--use-sage-attention`` is
  not followed: its 8-bit Q and K would move the images off the reference (``host.attention``; the log says so).
- RoPE's cosines and sines are computed once per forward, not twice in every block.
- No attention mask when every text has its full length: an all-true mask keeps SDPA off its fastest kernels.
  Text lengths are host integers, so neither the decision nor the positions wait for the GPU.
- Fewer passes over the activations where blocks run eager (uncompiled): the fp32 modulation and gates read the
  bf16 activations as they are (type promotion) and write bf16 (no fp32 copies), and RoPE folds rotate-half's sign
  into its sines and adds each half's partner in place (no rotated copy). The results are the reference's to fp32
  rounding. (The ``out=`` forms take no autograd: the DiT runs for inference, as ComfyUI's executor runs it.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .attention import SDPA, AttentionPlan


def _rope_angles(positions: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> torch.Tensor:
    """Angles ``[B, S, 1, head_dim]`` for position ids ``[B, S, 3]``: per axis, each frequency twice in a row
    (``θ0, θ0, θ1, θ1, …``), as diffusers lays them out."""
    parts = []
    for axis, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
        parts.append(positions[..., axis, None].float() * omega)  # fp32 also under autocast: ids past 256 stay exact
    angles = torch.cat(parts, dim=-1).unsqueeze(2)
    return torch.stack([angles, angles], dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' RoPE on ``[B, S, heads, head_dim]``: ``x * cos + [-x2, x1] * sin``, the minus in ``signed_sin``.
    Each half adds its partner's product in place, so the rotated copy of ``x`` is never written."""
    x1, x2 = x.chunk(2, dim=-1)
    sin1, sin2 = signed_sin.chunk(2, dim=-1)
    out = x * cos
    out1, out2 = out.chunk(2, dim=-1)
    out1.addcmul_(x2, sin1)
    out2.addcmul_(x1, sin2)
    return out


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # In fp32 as the reference: the fp32 shift and scale promote the bf16 ``x`` inside the one kernel, which
    # rounds to ``x``'s dtype as it writes (no fp32 copy of the activations).
    return torch.addcmul(shift.float(), x, 1 + scale.float(), out=torch.empty_like(x))


def _gated(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    # The product in fp32 rounded to x's dtype, then the residual sum: the reference's two roundings, in two kernels.
    return x + torch.mul(gate.float(), update, out=torch.empty_like(x))


def timestep_embedding(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[B, dim]`` in fp32, sine half first (diffusers' ``Timesteps(flip_sin_to_cos=False,
    downscale_freq_shift=0)``)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = timestep[:, None].float() * torch.exp(exponent)[None]
    embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    return F.pad(embedding, (0, 1)) if dim % 2 else embedding


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, qk_norm: bool, dtype, device, operations,
                 plan: AttentionPlan = SDPA):
        super().__init__()
        self.heads = heads
        self.plan = plan
        head_dim = hidden // heads
        self.to_q = operations.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)
        self.to_k = operations.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)
        self.to_v = operations.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)
        self.norm_q = operations.RMSNorm(head_dim, eps=eps, dtype=dtype, device=device) if qk_norm else None
        self.norm_k = operations.RMSNorm(head_dim, eps=eps, dtype=dtype, device=device) if qk_norm else None
        self.to_out = torch.nn.ModuleList([operations.Linear(hidden, hidden, bias=False, dtype=dtype, device=device)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = self.plan.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.to_out[0](out.transpose(1, 2).flatten(2))


class FeedForward(torch.nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, dtype, device, operations):
        super().__init__()
        self.gate_proj = operations.Linear(hidden, ffn_hidden, bias=False, dtype=dtype, device=device)
        self.up_proj = operations.Linear(hidden, ffn_hidden, bias=False, dtype=dtype, device=device)
        self.linear_fc2 = operations.Linear(ffn_hidden, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.up_proj(x) * F.gelu(self.gate_proj(x)))


class ErnieImageBlock(torch.nn.Module):
    """One block: ``block(x, rope, temb, mask) -> x`` (cache-dit's Pattern_3), ``temb`` the six shared modulation
    vectors ``[B, 1, H]``."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, eps: float, qk_norm: bool, dtype, device,
                 operations, plan: AttentionPlan = SDPA):
        super().__init__()
        self.adaLN_sa_ln = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.self_attention = Attention(hidden, heads, eps, qk_norm, dtype, device, operations, plan)
        self.adaLN_mlp_ln = operations.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.mlp = FeedForward(hidden, ffn_hidden, dtype, device, operations)

    def forward(self, x, rope, temb, mask=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = temb
        x = _gated(x, gate_msa, self.self_attention(_modulate(self.adaLN_sa_ln(x), shift_msa, scale_msa), rope, mask))
        return _gated(x, gate_mlp, self.mlp(_modulate(self.adaLN_mlp_ln(x), shift_mlp, scale_mlp)))


class TimestepEmbedding(torch.nn.Module):
    def __init__(self, hidden: int, dtype, device, operations):
        super().__init__()
        self.linear_1 = operations.Linear(hidden, hidden, dtype=dtype, device=device)
        self.linear_2 = operations.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class FinalNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float, dtype, device, operations):
        super().__init__()
        self.eps = eps
        self.linear = operations.Linear(hidden, 2 * hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(conditioning).unsqueeze(1).chunk(2, dim=-1)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale) + shift


class ErnieImageDiT(torch.nn.Module):
    """ERNIE-Image's diffusion transformer; the arguments are diffusers' config (``transformer/config.json``), and
    ``attention``: how it attends (``host.attention``: what ComfyUI's switches ask for, where it keeps
    diffusers' results to rounding).

    It applies no attention or block patches of a run's ``transformer_options`` (``patches``, ``patches_replace``,
    ``optimized_attention_override``), as ComfyUI's own ERNIE-Image applies none (comfy/ldm/ernie/model.py
    @7b30bf37 calls ``optimized_attention`` without them). The log says so once when a run carries one
    (``attention.say_unapplied_patches``)."""

    _repeated_blocks = ["ErnieImageBlock"]  # cache-dit's regional quantization finds the blocks by this

    def __init__(self, hidden_size: int = 4096, num_attention_heads: int = 32, num_layers: int = 36,
                 ffn_hidden_size: int = 12288, in_channels: int = 128, out_channels: int = 128, patch_size: int = 1,
                 text_in_dim: int = 3072, rope_theta: float = 256, rope_axes_dim: tuple[int, int, int] = (32, 48, 48),
                 eps: float = 1e-6, qk_layernorm: bool = True, dtype=None, device=None, operations=None, *,
                 attention: AttentionPlan = SDPA, **_):  # keyword-only: not one of the config's fields
        super().__init__()
        ops = dict(dtype=dtype, device=device, operations=operations)
        self.attention_plan = attention
        self.in_channels, self.out_channels, self.patch_size = in_channels, out_channels, patch_size
        self.hidden_size, self.text_in_dim = hidden_size, text_in_dim
        self.rope_theta, self.rope_axes_dim = rope_theta, tuple(rope_axes_dim)
        self.x_embedder = torch.nn.Module()  # keeps the released key x_embedder.proj.*
        self.x_embedder.proj = operations.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size,
                                                 dtype=dtype, device=device)
        self.text_proj = (operations.Linear(text_in_dim, hidden_size, bias=False, dtype=dtype, device=device)
                          if text_in_dim != hidden_size else None)
        self.time_embedding = TimestepEmbedding(hidden_size, **ops)
        self.adaLN_modulation = torch.nn.Sequential(
            torch.nn.SiLU(), operations.Linear(hidden_size, 6 * hidden_size, dtype=dtype, device=device))
        self.layers = torch.nn.ModuleList(
            ErnieImageBlock(hidden_size, num_attention_heads, ffn_hidden_size, eps, qk_layernorm, **ops, plan=attention)
            for _ in range(num_layers))
        self.final_norm = FinalNorm(hidden_size, eps, **ops)
        self.final_linear = operations.Linear(hidden_size, patch_size * patch_size * out_channels, dtype=dtype,
                                              device=device)

    def rope(self, text_lens: list[int], grid_h: int, grid_w: int, text_len: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cosines and signed sines ``[B, S, 1, head_dim]`` in ``dtype`` (see ``_rotate``): image tokens at
        (true text length, y, x), text tokens at (i, 0, 0)."""
        y, x = torch.meshgrid(torch.arange(grid_h, device=device, dtype=torch.float32),
                              torch.arange(grid_w, device=device, dtype=torch.float32), indexing="ij")
        grid = torch.stack([y, x], dim=-1).reshape(-1, 2)
        text = torch.zeros(text_len, 3, device=device)
        text[:, 0] = torch.arange(text_len, device=device, dtype=torch.float32)
        positions = torch.stack([torch.cat([F.pad(grid, (1, 0), value=float(n)), text]) for n in text_lens])
        angles = _rope_angles(positions, self.rope_axes_dim, self.rope_theta)
        sin = torch.sin(angles)
        half = sin.shape[-1] // 2
        return torch.cos(angles).to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, text_lens: list[int],
                **kwargs) -> torch.Tensor:
        """The prediction ``[B, C, H, W]`` for latents ``x`` at ``timestep``, given text embeddings ``[B, T, D]``
        zero-padded to the longest and each row's true length in ``text_lens``."""
        batch, _, height, width = x.shape
        p = self.patch_size
        grid_h, grid_w = height // p, width // p
        image_tokens = grid_h * grid_w
        dtype = x.dtype

        hidden = self.x_embedder.proj(x).flatten(2).transpose(1, 2)
        text = self.text_proj(context) if self.text_proj is not None and context.numel() > 0 else context
        text_len = text.shape[1]
        hidden = torch.cat([hidden, text.to(hidden.dtype)], dim=1)

        rope = self.rope(text_lens, grid_h, grid_w, text_len, hidden.dtype, x.device)
        mask = None
        if min(text_lens) < text_len:  # key padding: image tokens and each text's true tokens
            keys = torch.arange(image_tokens + text_len, device=x.device)
            mask = torch.stack([keys < image_tokens + n for n in text_lens])[:, None, None, :]

        # The reference hands the timestep over in the model's dtype (bf16 rounds it) and embeds it in fp32.
        conditioning = self.time_embedding(timestep_embedding(timestep.to(dtype), self.hidden_size).to(dtype))
        temb = self.adaLN_modulation(conditioning).unsqueeze(1).chunk(6, dim=-1)
        with self.attention_plan.backend(x.device):
            for layer in self.layers:  # cache-dit may have swapped this list for its cached blocks for the run
                hidden = layer(hidden, rope, temb, mask)
        hidden = self.final_norm(hidden, conditioning).type_as(hidden)
        patches = self.final_linear(hidden)[:, :image_tokens]
        return (patches.view(batch, grid_h, grid_w, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
                .reshape(batch, self.out_channels, height, width))
