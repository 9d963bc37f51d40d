"""The released HunyuanImage-3.0 architecture as a config, for runs with random weights.

Used where the official checkpoint cannot be downloaded (benchmarks on GPU machines with no
network): `load(..., random_weights=True)` creates each rank's resident shard directly,
in its packed layout, on the device. The special-token ids of the released tokenizer
that the config does not carry (<boi>, <cfg>, ratios, ...) are stand-ins in its reserved
range; the byte tokenizer uses them.
"""
from __future__ import annotations


def full_config(layers: int = 32, distilled: bool = False) -> dict:
    """Official config.json fields of the released model (optionally fewer layers).
    `distilled`: Instruct-Distil's (cfg_distilled + use_meanflow: the guidance and the step's
    end time as tokens, one row a step)."""
    specials = {f"<img_ratio_{k}>": 128050 + k for k in range(37)}
    specials.update({"<guidance>": 128012, "<timestep_r>": 128013})
    specials.update({"<img_size_1024>": 128037, "<boi>": 128000, "<eoi>": 128001, "<img>": 128006,
                     "<cfg>": 128010, "<timestep>": 128011,
                     # the Instruct template's (image editing), stand-ins too
                     "<joint_img_sep>": 128020, "<think>": 128021, "</think>": 128022, "<recaption>": 128023,
                     "</recaption>": 128024, "<answer>": 128025, "</answer>": 128026})
    return {
        "architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
        "hidden_size": 4096, "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attention_head_dim": 128, "head_dim": 128, "vocab_size": 133120, "num_experts": 64,
        "moe_topk": [8] * layers, "moe_intermediate_size": [3072] * layers, "intermediate_size": 3072,
        "num_shared_expert": [1] * layers, "use_mixed_mlp_moe": True, "moe_layer_num_skipped": 0,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "use_qk_norm": True, "rope_type": "2d",
        "rope_theta": 10000.0, "rope_scaling": {"type": "custom", "factor": 1.0}, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 22800, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "patch_embed_hidden_dim": 1024, "patch_size": 1, "img_proj_type": "unet",
        "image_base_size": 1024, "vae_downsample_factor": [16, 16], "vae_dtype": "float32",
        "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [128, 256, 512, 1024, 1024],
                "layers_per_block": 2, "latent_channels": 32, "in_channels": 3, "out_channels": 3,
                "ffactor_spatial": 16, "ffactor_temporal": 4, "upsample_match_channel": True,
                "downsample_match_channel": True, "only_decoder": False,
                "scaling_factor": 0.562679178327931, "shift_factor": None},
        # Image editing (the Instruct checkpoints): SigLIP2 so400m patch16 naflex and its aligner.
        # The processor's patch budget is a stand-in that gives the seed's TI2I prefill (~6.3k
        # tokens with a 1024 px reference: 4096 VAE + 1024 ViT rows + the text).
        "vit": {"model_type": "siglip2_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                "num_attention_heads": 16, "num_hidden_layers": 27, "num_channels": 3, "patch_size": 16,
                "num_patches": 256, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 1152, "n_embed": 4096, "depth": 2},
        "vit_processor": {"image_processor_type": "Siglip2ImageProcessorFast", "resample": 2,
                          "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                          "patch_size": 16, "max_num_patches": 1024},
        "bos_token_id": 127958, "eos_token_id": 127957, "pad_token_id": 128009, "image_token_id": 128006,
        "cfg_distilled": distilled, "use_meanflow": distilled, "special_token_ids": specials,
    }
