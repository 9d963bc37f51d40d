"""dtgen/tiny.py: the diffusers-format folder a model's tiny default is written as, and the
tokenizer fixtures those folders hold (Wan's and Qwen-Image's tiny folders are checked against
diffusers by their own parity tests)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dtgen.tiny import (QWEN2_MERGES, QWEN2_SPECIAL_TOKENS, ensure_tiny_folder, with_overrides,
                        write_diffusers_folder, write_qwen2_tokenizer, write_t5_tokenizer)

INDEX = {"_class_name": "ToyPipeline", "transformer": ["diffusers", "ToyTransformer"],
         "text_encoder": ["transformers", "ToyEncoder"], "tokenizer": ["transformers", "T5TokenizerFast"],
         "scheduler": ["diffusers", "ToyScheduler"]}


class Toy(nn.Module):
    """Two components, their sizes from the folder's configs."""

    def __init__(self, folder):
        super().__init__()
        width = json.loads((folder / "transformer" / "config.json").read_text())["width"]
        self.text_encoder = nn.Linear(4, 8)
        self.transformer = nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width))


def _configs(width: int = 16) -> dict:
    return {"text_encoder": {"d": 8}, "transformer": {"width": width}, "scheduler": {"shift": 3.0}}


def test_the_folder_holds_the_index_configs_weights_and_tokenizer(tmp_path):
    write_diffusers_folder(tmp_path, INDEX, _configs(), Toy, write_t5_tokenizer, seed=3)
    assert json.loads((tmp_path / "model_index.json").read_text()) == INDEX
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text()) == {"shift": 3.0}
    assert json.loads((tmp_path / "transformer" / "config.json").read_text()) == {"width": 16}
    # the weights file by the library the index names, under the component's own keys
    dit = load_file(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
    encoder = load_file(str(tmp_path / "text_encoder" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in dit.items()} == {"0.weight": (16, 8), "0.bias": (16,), "1.weight": (16,),
                                                           "1.bias": (16,)}
    assert set(encoder) == {"weight", "bias"} and all(v.dtype == torch.float32 for v in encoder.values())
    assert not (tmp_path / "scheduler" / "model.safetensors").exists()
    # the same seed draws the same weights; another seed others
    again, other = tmp_path / "again", tmp_path / "other"
    write_diffusers_folder(again, INDEX, _configs(), Toy, write_t5_tokenizer, seed=3)
    write_diffusers_folder(other, INDEX, _configs(), Toy, write_t5_tokenizer, seed=4)
    same = load_file(str(again / "transformer" / "diffusion_pytorch_model.safetensors"))
    differ = load_file(str(other / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(dit[k], same[k]) for k in dit) and not torch.equal(dit["0.weight"], differ["0.weight"])


def test_overrides_replace_a_components_values_and_name_an_unknown_one():
    assert with_overrides(_configs(), {"transformer": {"width": 32}})["transformer"] == {"width": 32}
    with pytest.raises(KeyError, match="vae"):
        with_overrides(_configs(), {"vae": {"z_dim": 4}})


def test_the_tiny_folder_is_written_once(tmp_path):
    calls = []

    def write(folder):
        calls.append(folder)
        write_diffusers_folder(folder, INDEX, _configs(), Toy, write_t5_tokenizer)

    first = ensure_tiny_folder("tiny-toy-v1", write, tmp_path)
    assert ensure_tiny_folder("tiny-toy-v1", write, tmp_path) == first == tmp_path / "tiny-toy-v1"
    assert len(calls) == 1 and (first / "model_index.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-toy-v1"]   # no temporary folder left


def test_the_t5_tokenizer_keeps_its_words_whole_and_ends_with_eos(tmp_path):
    from tokenizers import Tokenizer
    write_t5_tokenizer(tmp_path, words=("fox", "snow"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("fox snow").ids == [4, 5, 1]   # pad 0, eos 1, unk 2, "▁" 3, then the words
    assert tok.encode("ox").tokens[-1] == "</s>" and len(tok.encode("ox").ids) == 4   # "▁", "o", "x", eos


def test_the_qwen2_tokenizer_numbers_bytes_merges_then_special_tokens(tmp_path):
    write_qwen2_tokenizer(tmp_path)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    # each byte its own id (GPT-2's printable stand-in: byte 0 is "Ā"), then one id per merge
    assert len(vocab) == 256 + len(QWEN2_MERGES) and vocab["!"] == 33 and vocab["Ā"] == 0 and vocab["th"] == 256
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert [t["content"] for t in config["added_tokens_decoder"].values()] == list(QWEN2_SPECIAL_TOKENS)
    assert config["pad_token"] == "<|endoftext|>" and config["eos_token"] == "<|im_end|>"
