"""The model suite: real diffusers and transformers classes built from their published configs
(fewer layers, random weights, nothing downloaded), each with the inputs of one forward at the
resolution or length people run it at.

Every case builds ``(model, inputs)`` for ``model(**inputs)``. ``tiny=True`` shrinks widths,
layers and resolutions to a few hundred parameters per layer so that the same code path runs on a
CPU in seconds (tests); the shapes of the attention calls then differ, the call sites do not.
diffusers and transformers are optional extras (``pip install .[models]``): a case imports them
when it is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

Inputs = dict[str, Any]
Builder = Callable[[torch.device, torch.dtype, bool], tuple[torch.nn.Module, Inputs]]


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str            # what the row says: model, resolution or length, batch
    key: str             # short name for --models
    dtype: torch.dtype   # the dtype the model is run in (as its pipelines run it)
    build: Builder
    library: str         # "diffusers" or "transformers"


def _randn(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def _module(cls: type, device: torch.device, dtype: torch.dtype, **config: Any) -> torch.nn.Module:
    """The model with random weights, initialised on ``device`` (a 2.6B-parameter UNet inits in
    a second on a GPU, in minutes on a CPU)."""
    with torch.device(device):
        return cls(**config).to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# diffusers: UNets (AttnProcessor2_0, SDPA called positionally), DiTs (the attention dispatcher,
# SDPA called by keyword)
# ---------------------------------------------------------------------------------------------

def sd15_unet(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """stable-diffusion-v1-5's UNet, 512 px (64x64 latents), batch 2 (classifier-free guidance):
    8 heads of head_dim 40, 80, 160; cross-attention to 77 CLIP tokens."""
    from diffusers import UNet2DConditionModel

    config: dict[str, Any] = dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, cross_attention_dim=768,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    if tiny:
        config.update(block_out_channels=(32, 64, 64, 64), attention_head_dim=2, cross_attention_dim=32,
                      layers_per_block=1, norm_num_groups=8)
    model = _module(UNet2DConditionModel, device, dtype, **config)
    side = 8 if tiny else 64
    return model, dict(sample=_randn(2, 4, side, side, dtype=dtype, device=device),
                       timestep=torch.tensor(500.0, device=device),
                       encoder_hidden_states=_randn(2, 77, config["cross_attention_dim"], dtype=dtype, device=device))


def sdxl_unet(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """stable-diffusion-xl-base-1.0's UNet (all 70 transformer blocks), 1024 px (128x128
    latents), batch 2: head_dim 64; cross-attention to 77 tokens."""
    from diffusers import UNet2DConditionModel

    config: dict[str, Any] = dict(
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280), attention_head_dim=(5, 10, 20),
        transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816)
    text_dim = 1280
    if tiny:
        text_dim = 32
        config.update(block_out_channels=(32, 64, 64), attention_head_dim=(1, 2, 2),
                      transformer_layers_per_block=(1, 1, 1), cross_attention_dim=32, layers_per_block=1,
                      norm_num_groups=8, addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=text_dim + 6 * 8)
    model = _module(UNet2DConditionModel, device, dtype, **config)
    side = 8 if tiny else 128
    added = dict(text_embeds=_randn(2, text_dim, dtype=dtype, device=device),
                 time_ids=_randn(2, 6, dtype=dtype, device=device))
    return model, dict(sample=_randn(2, 4, side, side, dtype=dtype, device=device),
                       timestep=torch.tensor(500.0, device=device),
                       encoder_hidden_states=_randn(2, 77, config["cross_attention_dim"], dtype=dtype, device=device),
                       added_cond_kwargs=added)


def flux_dev(device: torch.device, dtype: torch.dtype, tiny: bool,
             pixels: int = 1024) -> tuple[torch.nn.Module, Inputs]:
    """FLUX.1-dev's transformer with 2 of its 19 double and 4 of its 38 single blocks, 1024 px:
    4096 image + 512 text tokens (2048 px: 16384 + 512), 24 heads of head_dim 128 (joint
    attention, the dispatcher)."""
    from diffusers import FluxTransformer2DModel

    config: dict[str, Any] = dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))
    if tiny:
        config.update(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    model = _module(FluxTransformer2DModel, device, dtype, **config)
    side, n_text = (4, 8) if tiny else (pixels // 16, 512)  # latents of pixels / 8 in 2x2 patches
    img_ids = torch.zeros(side * side, 3, device=device)
    img_ids[:, 1] = torch.arange(side, device=device).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side, device=device).repeat(side)
    return model, dict(hidden_states=_randn(1, side * side, 64, dtype=dtype, device=device),
                       encoder_hidden_states=_randn(1, n_text, config["joint_attention_dim"], dtype=dtype,
                                                    device=device),
                       pooled_projections=_randn(1, config["pooled_projection_dim"], dtype=dtype, device=device),
                       timestep=torch.tensor([0.5], device=device), img_ids=img_ids,
                       txt_ids=torch.zeros(n_text, 3, device=device), guidance=torch.tensor([3.5], device=device))


def cogvideox_5b(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """CogVideoX-5b's transformer with 4 of its 42 blocks, 49 frames at 480x720: 17550 video
    + 226 text tokens in one sequence, 48 heads of head_dim 64."""
    from diffusers import CogVideoXTransformer3DModel

    config: dict[str, Any] = dict(
        num_attention_heads=48, attention_head_dim=64, in_channels=16, num_layers=4, text_embed_dim=4096,
        sample_frames=49, sample_height=60, sample_width=90, use_rotary_positional_embeddings=True)
    n_text = 226
    if tiny:
        n_text = 8
        config.update(num_attention_heads=2, attention_head_dim=16, num_layers=1, text_embed_dim=32,
                      sample_frames=5, sample_height=8, sample_width=8, time_embed_dim=32)
    model = _module(CogVideoXTransformer3DModel, device, dtype, **config)
    frames = (config["sample_frames"] - 1) // 4 + 1
    return model, dict(hidden_states=_randn(1, frames, 16, config["sample_height"], config["sample_width"],
                                            dtype=dtype, device=device),
                       encoder_hidden_states=_randn(1, n_text, config["text_embed_dim"], dtype=dtype, device=device),
                       timestep=torch.tensor([500], device=device))


def wan21_1_3b(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """Wan2.1-T2V-1.3B's transformer with 4 of its 30 blocks, 81 frames at 480x832: 32760 video
    tokens, 12 heads of head_dim 128; cross-attention to 512 text tokens (the dispatcher)."""
    return _wan21(device, dtype, tiny, dict(num_attention_heads=12, ffn_dim=8960, num_layers=4),
                  (21, 60, 104))


def wan21_14b(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """Wan2.1-T2V-14B's transformer with 2 of its 40 blocks, 81 frames at 720x1280: 75600 video
    tokens, 40 heads of head_dim 128 (the context-parallel suite)."""
    return _wan21(device, dtype, tiny, dict(num_attention_heads=40, ffn_dim=13824, num_layers=2),
                  (21, 90, 160))


def _wan21(device: torch.device, dtype: torch.dtype, tiny: bool, size: dict[str, int],
           latents: tuple[int, int, int]) -> tuple[torch.nn.Module, Inputs]:
    from diffusers import WanTransformer3DModel

    config: dict[str, Any] = dict(
        patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", **size)
    if tiny:
        config.update(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16, ffn_dim=64,
                      num_layers=1)
    model = _module(WanTransformer3DModel, device, dtype, **config)
    frames, height, width, n_text = (2, 8, 8, 8) if tiny else (*latents, 512)
    return model, dict(hidden_states=_randn(1, 16, frames, height, width, dtype=dtype, device=device),
                       timestep=torch.tensor([500], device=device),
                       encoder_hidden_states=_randn(1, n_text, config["text_dim"], dtype=dtype, device=device))


def hunyuan_video(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """HunyuanVideo's transformer with 2 of its 20 double and 4 of its 40 single blocks, 61
    frames at 544x960: 32640 video + 256 text tokens, 24 heads of head_dim 128; the text comes
    with a key-padding mask (a quarter of it padding), which every attention call passes."""
    from diffusers import HunyuanVideoTransformer3DModel

    config: dict[str, Any] = dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=2,
        num_single_layers=4, num_refiner_layers=2, text_embed_dim=4096, pooled_projection_dim=768,
        rope_axes_dim=(16, 56, 56), guidance_embeds=True)
    if tiny:
        config.update(num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
                      num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
    model = _module(HunyuanVideoTransformer3DModel, device, dtype, **config)
    frames, height, width, n_text = (2, 8, 8, 8) if tiny else (16, 68, 120, 256)
    mask = torch.zeros(1, n_text, dtype=torch.bool, device=device)
    mask[:, : n_text * 3 // 4] = True
    return model, dict(hidden_states=_randn(1, 16, frames, height, width, dtype=dtype, device=device),
                       timestep=torch.tensor([500], device=device),
                       encoder_hidden_states=_randn(1, n_text, config["text_embed_dim"], dtype=dtype, device=device),
                       encoder_attention_mask=mask,
                       pooled_projections=_randn(1, config["pooled_projection_dim"], dtype=dtype, device=device),
                       guidance=torch.tensor([6000.0], device=device))


# ---------------------------------------------------------------------------------------------
# transformers: the sdpa attention implementation (K/V not expanded for GQA: enable_gqa)
# ---------------------------------------------------------------------------------------------

def llama3_8b(tokens: int) -> Builder:
    def build(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
        """Meta-Llama-3-8B with 2 of its 32 layers, a prefill of ``tokens`` tokens: 32 query and
        8 key/value heads of head_dim 128, causal."""
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, num_hidden_layers=2, vocab_size=128256,
                             max_position_embeddings=131072, rope_theta=500000.0)
        if tiny:
            config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=1, vocab_size=100)
        config._attn_implementation = "sdpa"
        model = _module(LlamaModel, device, dtype, config=config)
        ids = torch.randint(0, config.vocab_size, (1, 16 if tiny else tokens), device=device)
        return model, dict(input_ids=ids)
    return build


def bert_base(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple[torch.nn.Module, Inputs]:
    """bert-base-uncased, a padded batch of 16 sequences of 128 to 512 tokens (padded to 512):
    12 heads of head_dim 64, the padding as an attention mask."""
    from transformers import BertConfig, BertModel

    config = BertConfig() if not tiny else BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64)
    config._attn_implementation = "sdpa"
    model = _module(BertModel, device, dtype, config=config)
    batch, tokens = (2, 16) if tiny else (16, 512)
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(tokens)[None] < lengths[:, None]).long().to(device)
    return model, dict(input_ids=torch.randint(0, config.vocab_size, (batch, tokens), device=device),
                       attention_mask=mask)


CASES: tuple[ModelCase, ...] = (
    ModelCase("SD1.5 UNet, 512 px, batch 2", "sd15", torch.float16, sd15_unet, "diffusers"),
    ModelCase("SDXL UNet, 1024 px, batch 2", "sdxl", torch.float16, sdxl_unet, "diffusers"),
    ModelCase("Flux-dev (2+4 blocks), 1024 px", "flux", torch.bfloat16, flux_dev, "diffusers"),
    ModelCase("CogVideoX-5B (4 blocks), 49 x 480x720", "cogvideox", torch.bfloat16, cogvideox_5b, "diffusers"),
    ModelCase("Wan2.1-1.3B (4 blocks), 81 x 480x832", "wan", torch.bfloat16, wan21_1_3b, "diffusers"),
    ModelCase("HunyuanVideo (2+4 blocks), 61 x 544x960", "hunyuan", torch.bfloat16, hunyuan_video, "diffusers"),
    ModelCase("Llama-3-8B (2 layers), 8K prefill", "llama8k", torch.bfloat16, llama3_8b(8192), "transformers"),
    ModelCase("Llama-3-8B (2 layers), 32K prefill", "llama32k", torch.bfloat16, llama3_8b(32768), "transformers"),
    ModelCase("BERT-base, padded 16 x 512", "bert", torch.float16, bert_base, "transformers"),
)
# Sizes people run on several GPUs (bench --gpus N, ``_bench_parallel``), beside CASES' "wan".
PARALLEL_CASES: tuple[ModelCase, ...] = (
    ModelCase("Wan2.1-14B (2 blocks), 81 x 720x1280", "wan14b", torch.bfloat16, wan21_14b, "diffusers"),
    ModelCase("Flux-dev (2+4 blocks), 2048 px", "flux2k", torch.bfloat16,
              lambda device, dtype, tiny: flux_dev(device, dtype, tiny, pixels=2048), "diffusers"),
)
