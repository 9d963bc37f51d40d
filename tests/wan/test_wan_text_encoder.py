"""The UMT5 text encoder (dtgen/layers/t5.py, Wan's) against transformers' UMT5EncoderModel
and diffusers' WanPipeline._get_t5_prompt_embeds, on a tiny random config, CPU fp32."""
import json
import threading
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dtgen.layers.t5 import (  # noqa: E402
    EMBEDDING_KEYS, UMT5Config, UMT5Encoder, load_tokenizer, relative_position_buckets)
from models.wan.pipeline import encode_prompt_embeds  # noqa: E402
from models.wan.tiny import write_tokenizer  # noqa: E402

TINY = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=8, layer_norm_epsilon=1e-6,
            feed_forward_proj="gated-gelu", model_type="umt5", pad_token_id=0, eos_token_id=1)
SEQ = 16  # > max_distance: the last (clamped) bucket is used too


def hf_model(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.UMT5Config(**{k: v for k, v in TINY.items() if k != "model_type"})
    cfg._attn_implementation = attn
    m = transformers.UMT5EncoderModel(cfg).eval()
    with torch.no_grad():  # layer norms are initialised to 1: make them count
        for name, p in m.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m


def build(state: dict[str, torch.Tensor]) -> UMT5Encoder:
    """As the loader does: build on meta, then put real tensors into the parameter slots."""
    with torch.device("meta"):
        enc = UMT5Encoder(UMT5Config.from_dict(TINY))
    modules = dict(enc.named_modules())
    for name, key in enc.checkpoint_keys(state.keys()).items():
        owner, _, attr = name.rpartition(".")
        modules[owner]._parameters[attr] = torch.nn.Parameter(state[key], requires_grad=False)
    return enc.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, TINY["vocab_size"], (3, SEQ), generator=g)
    mask = torch.zeros(3, SEQ, dtype=torch.long)
    for row, n in enumerate((SEQ, 9, 3)):
        mask[row, :n] = 1
        ids[row, n:] = 0
    return ids, mask


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: intra-op threads only add wake-up latency (10x slower on a busy 2-core box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("embed_key", EMBEDDING_KEYS)
def test_last_hidden_state_parity(attn, embed_key):
    ref_model = hf_model(attn)
    sd = ref_model.state_dict()
    # A checkpoint holds the tied table under one key or the other: either must load.
    state = {k: v for k, v in sd.items() if k not in EMBEDDING_KEYS or k == embed_key}
    enc = build(state)
    ids, mask = inputs()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = enc(ids, mask)
        ref_nomask = ref_model(input_ids=ids).last_hidden_state
        out_nomask = enc(ids)
    assert (out - ref).abs().max() < 1e-5  # every position, padded query rows included
    assert (out_nomask - ref_nomask).abs().max() < 1e-5


def test_buckets_match_transformers(hf):
    attn = hf.encoder.block[0].layer[0].SelfAttention
    pos = torch.arange(40)
    ref = attn._relative_position_bucket(pos[None, :] - pos[:, None])
    assert torch.equal(relative_position_buckets(40, 8, 8), ref)


def test_names_and_shapes(hf):
    with torch.device("meta"):
        enc = UMT5Encoder(UMT5Config.from_dict(TINY))
    ref = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in enc.state_dict().items()}
    assert mine == ref
    # One tensor to load for the tied table; the module's embed_tokens is `shared` itself.
    assert [n for n, _ in enc.named_parameters()] == [k for k in ref if k != "encoder.embed_tokens.weight"]
    assert enc.encoder.embed_tokens is enc.shared


def test_config_from_json_and_refusals(tmp_path):
    xxl = {"architectures": ["UMT5EncoderModel"], "d_ff": 10240, "d_kv": 64, "d_model": 4096,
           "dense_act_fn": "gelu_new", "feed_forward_proj": "gated-gelu", "is_gated_act": True,
           "layer_norm_epsilon": 1e-6, "model_type": "umt5", "num_heads": 64, "num_layers": 24,
           "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
           "vocab_size": 256384, "tie_word_embeddings": False, "scalable_attention": True}
    (tmp_path / "config.json").write_text(json.dumps(xxl))
    cfg = UMT5Config.from_json(tmp_path / "config.json")
    assert (cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.num_layers, cfg.vocab_size) == (4096, 64, 10240, 24, 256384)
    for key, bad in (("feed_forward_proj", "relu"), ("model_type", "t5"), ("is_decoder", True),
                     ("relative_attention_num_buckets", 7)):
        with pytest.raises(ValueError, match=key):
            UMT5Config.from_dict({**xxl, key: bad})


# ---- tensor parallelism, simulated: two shards in two threads, all-reduce by hooks --------------

COLUMN = ("SelfAttention.q.weight", "SelfAttention.k.weight", "SelfAttention.v.weight",
          "DenseReluDense.wi_0.weight", "DenseReluDense.wi_1.weight")
ROW = ("SelfAttention.o.weight", "DenseReluDense.wo.weight",
       "SelfAttention.relative_attention_bias.weight")  # the bias table: its dim 1 (= last dim)
PARTIAL_SUM = ("SelfAttention.o", "DenseReluDense.wo")


def shard(state, rank, tp):
    out = {}
    for k, v in state.items():
        if k.endswith(COLUMN):
            v = v.chunk(tp, dim=0)[rank]
        elif k.endswith(ROW):
            v = v.chunk(tp, dim=-1)[rank]
        out[k] = v  # ROW pieces stay strided views, as the framework's storage hands them out
    return out


def test_simulated_tp2(hf):
    tp = 2
    full = build(hf.state_dict())
    ranks = [build(shard(hf.state_dict(), r, tp)) for r in range(tp)]
    attn = ranks[0].encoder.block[0].layer[0].SelfAttention
    assert attn.q.weight.shape[0] // attn.d_kv == TINY["num_heads"] // tp
    assert attn.relative_attention_bias.weight.shape == (TINY["relative_attention_num_buckets"], 2)

    # A thread per rank; the hook on each row-parallel module is the all-reduce: both ranks post
    # their partial output, wait for each other, and both continue with the same sum.
    barrier = threading.Barrier(tp, timeout=30)
    slots = [None] * tp
    hits = [0] * tp

    def all_reduce(rank):
        def hook(module, args, output):
            slots[rank] = output
            hits[rank] += 1
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # nobody overwrites a slot before both have read it
            return total
        return hook

    for r, model in enumerate(ranks):
        for name, module in model.named_modules():
            if name.endswith(PARTIAL_SUM):
                module.register_forward_hook(all_reduce(r))

    ids, mask = inputs()
    outs, errors = [None] * tp, []

    def run(r):
        try:
            with torch.no_grad():
                outs[r] = ranks[r](ids, mask)
        except BaseException as e:  # surface a thread's failure in the test
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert hits == [2 * TINY["num_layers"]] * tp
    with torch.no_grad():
        ref = full(ids, mask)
    for out in outs:
        assert (out - ref).abs().max() < 1e-5


# ---- tokenizer + prompt embeddings against diffusers' own code ----------------------------------

PROMPTS = ["a big red cat runs on the grass", "  dog &amp;   xyz\n", "the"]


def test_tokenizer_matches_transformers(tmp_path):
    write_tokenizer(tmp_path)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    mine = load_tokenizer(tmp_path, max_length=SEQ)
    long = " ".join(["a big red cat runs"] * 5)  # truncated: 15 pieces, then EOS
    cleaned = ["a big red cat runs on the grass", "dog & xyz", "the", long]
    ref = ref_tok(cleaned, padding="max_length", max_length=SEQ, truncation=True, add_special_tokens=True,
                  return_attention_mask=True, return_tensors="pt")
    ids, mask = mine(PROMPTS + [long])
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    assert ids[3, -1] == 1 and mask[3].all()


def test_prompt_embeds_match_diffusers_pipeline(hf, tmp_path):
    """diffusers' own `_get_t5_prompt_embeds`, called on a stand-in `self` holding only a
    tokenizer and the transformers text encoder (no pipeline built), against our tokenizer +
    encoder + encode_prompt_embeds."""
    pipeline_wan = pytest.importorskip("diffusers.pipelines.wan.pipeline_wan")
    write_tokenizer(tmp_path)
    stand_in = types.SimpleNamespace(tokenizer=transformers.AutoTokenizer.from_pretrained(str(tmp_path)),
                                     text_encoder=hf)
    with torch.no_grad():
        ref = pipeline_wan.WanPipeline._get_t5_prompt_embeds(
            stand_in, PROMPTS, max_sequence_length=SEQ, device=torch.device("cpu"), dtype=torch.float32)
        ids, mask = load_tokenizer(tmp_path, max_length=SEQ)(PROMPTS)
        out = encode_prompt_embeds(build(hf.state_dict()), ids, mask, max_len=SEQ)
    assert out.shape == ref.shape == (3, SEQ, TINY["d_model"])
    assert (out - ref).abs().max() < 1e-5
    lens = mask.sum(1)
    for row, n in enumerate(lens.tolist()):
        assert torch.all(out[row, n:] == 0) and torch.all(out[row, :n].abs().sum(-1) > 0)
    # Shorter input than max_len: zero rows appended.
    padded = encode_prompt_embeds(build(hf.state_dict()), ids, mask, max_len=SEQ + 4)
    assert padded.shape[1] == SEQ + 4 and torch.equal(padded[:, :SEQ], out) and not padded[:, SEQ:].any()
