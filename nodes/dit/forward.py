"""The pack's forward of diffusers' ``ErnieImageTransformer2DModel``: the same math, quicker to run (engine).

It runs the model's own submodules and blocks in diffusers' order, so the result is diffusers' up to rounding, and
cache-dit's adapter, the compile node and LoRA patches see the blocks they expect. Two things differ:

- No attention mask when every text in the batch has its full length (one prompt; cond and uncond of one length).
  diffusers always builds a key mask, and an all-true mask keeps SDPA off its fastest kernels (Flash and cuDNN
  attention take none). Text lengths arrive as host integers, so neither deciding nor building positions and
  mask waits for the GPU (a copy of the lengths to the GPU would, at every step).
- Attention runs on the kernel ``attention.py`` chooses; the six AdaLN modulation vectors stay ``[1, B, H]`` and
  broadcast over the sequence instead of being copied to ``[S, B, H]`` (the same values).
"""

from __future__ import annotations

import torch

from .attention import attention_backend


def _positions(text_lens: list[int], grid_h: int, grid_w: int, text_len: int, device: torch.device) -> torch.Tensor:
    """RoPE position ids ``[B, image + text, 3]``: image tokens at (true text length, y, x), text at (i, 0, 0).
    Built from host integers: no copy to the GPU, so no wait for it."""
    y, x = torch.meshgrid(torch.arange(grid_h, device=device, dtype=torch.float32),
                          torch.arange(grid_w, device=device, dtype=torch.float32), indexing="ij")
    grid = torch.stack([y, x], dim=-1).reshape(-1, 2)
    text = torch.zeros(text_len, 3, device=device)
    text[:, 0] = torch.arange(text_len, device=device, dtype=torch.float32)
    return torch.stack([torch.cat([torch.cat([grid.new_full((grid.shape[0], 1), float(n)), grid], dim=-1), text])
                        for n in text_lens])


def _key_mask(text_lens: list[int], image_tokens: int, text_len: int, device: torch.device) -> torch.Tensor:
    """diffusers' mask ``[B, 1, 1, S]``: True for image tokens and each text's true tokens, False for padding."""
    positions = torch.arange(image_tokens + text_len, device=device)
    return torch.stack([positions < image_tokens + n for n in text_lens])[:, None, None, :]


def ernie_forward(
    model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, text_lens: list[int]
) -> torch.Tensor:
    """The DiT's prediction ``[B, C, H, W]`` for ``latents`` at ``timestep`` (in the model's dtype), given text
    embeddings ``[B, T, D]`` zero-padded to the longest and each row's true length in ``text_lens``."""
    device, dtype = latents.device, latents.dtype
    batch, _, height, width = latents.shape
    p = model.patch_size
    grid_h, grid_w = height // p, width // p
    image_tokens = grid_h * grid_w

    image_seq = model.x_embedder(latents).transpose(0, 1).contiguous()  # the blocks run [S, B, H]
    if model.text_proj is not None and text.numel() > 0:
        text = model.text_proj(text)
    text_len = text.shape[1]
    x = torch.cat([image_seq, text.transpose(0, 1).contiguous()], dim=0)

    rotary = model.pos_embed(_positions(text_lens, grid_h, grid_w, text_len, device))
    mask = None if min(text_lens) == text_len else _key_mask(text_lens, image_tokens, text_len, device)

    conditioning = model.time_embedding(model.time_proj(timestep).to(dtype))
    temb = [t.unsqueeze(0) for t in model.adaLN_modulation(conditioning).chunk(6, dim=-1)]
    with attention_backend(device):
        for layer in model.layers:  # cache-dit may have swapped this list for its cached blocks for the run
            x = layer(x, rotary, temb, mask)
    x = model.final_norm(x, conditioning).type_as(x)
    patches = model.final_linear(x)[:image_tokens].transpose(0, 1).contiguous()
    out = model.out_channels
    return (patches.view(batch, grid_h, grid_w, p, p, out).permute(0, 5, 1, 3, 2, 4).contiguous()
            .view(batch, out, height, width))
