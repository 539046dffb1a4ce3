"""API-format ComfyUI prompts for the tests, built like the shared workflows (same nodes, same wiring)."""

from __future__ import annotations


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def text_to_image(
    *,
    snapshot: str,
    prompt: str,
    negative: str = "",
    width: int = 128,
    height: int = 128,
    steps: int = 4,
    cfg: float = 1.0,
    seed: int = 0,
    sampler: str = "custom",
    dit_file: str | None = None,
    prefix: str = "ernie",
    model_nodes: tuple[tuple[str, dict], ...] = (),
) -> dict:
    """The Turbo/Base graph: loader → encode ×2 → empty latent → (SamplerCustom + scheduler | KSampler) → decode → save.

    ``dit_file`` loads the DiT through ``ErnieImageDiTLoader`` instead of the snapshot's transformer.
    ``model_nodes``: MODEL→MODEL nodes ``(class_type, inputs)`` chained between the loader and the sampler, with
    node ids ``model_0``, ``model_1``, …
    """
    graph = {
        "loader": _node("ErnieImageLoader", model_name=snapshot, weight_dtype="default", quantization="none"),
        "positive": _node("ErnieImageTextEncode", text_encoder=["loader", 1], text=prompt),
        "negative": _node("ErnieImageTextEncode", text_encoder=["loader", 1], text=negative),
        "latent": _node("EmptyFlux2LatentImage", width=width, height=height, batch_size=1),
        "decode": _node("VAEDecode", samples=["sampler", 0], vae=["loader", 2]),
        "save": _node("SaveImage", images=["decode", 0], filename_prefix=prefix),
    }
    model = ["loader", 0]
    if dit_file is not None:
        graph["dit"] = _node("ErnieImageDiTLoader", model_name=dit_file, weight_dtype="default", quantization="none")
        model = ["dit", 0]
    for i, (class_type, inputs) in enumerate(model_nodes):
        graph[f"model_{i}"] = _node(class_type, model=model, **inputs)
        model = [f"model_{i}", 0]
    conditioning = dict(positive=["positive", 0], negative=["negative", 0], latent_image=["latent", 0])
    if sampler == "custom":
        graph["sigmas"] = _node("ErnieImageScheduler", model=model, steps=steps, shift=4.0)
        graph["select"] = _node("KSamplerSelect", sampler_name="euler")
        graph["sampler"] = _node("SamplerCustom", model=model, add_noise=True, noise_seed=seed, cfg=cfg,
                                 sampler=["select", 0], sigmas=["sigmas", 0], **conditioning)
    else:
        graph["sampler"] = _node("KSampler", model=model, seed=seed, steps=steps, cfg=cfg, sampler_name="euler",
                                 scheduler="simple", denoise=1.0, **conditioning)
    return graph
