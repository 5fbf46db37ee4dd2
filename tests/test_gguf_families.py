"""GGUF files of every family kiln reads, written here the way llama.cpp's converter writes them
(tiny random models saved by transformers), read by kiln and compared with the transformers
model they came from. Where transformers reads that GGUF architecture itself, its reading must
give the same logits too: a check that this writer follows llama.cpp's conventions (q/k
interleaving for llama only, Gemma's norms stored as 1 + w, stacked experts)."""

import numpy as np
import pytest
import torch

from kiln.forward_context import set_forward_context

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _byte_tokens() -> list[str]:
    # GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter permutes llama q/k rows so that each head's rotary halves interleave.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, arch: str) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list(_byte_tokens())
    w.add_token_types([1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
                 "post_attention_layernorm": "post_attention_norm" if arch == "gemma2" else "ffn_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".experts." in name:  # transformers holds them stacked: [experts, 2 * inter, hidden], [experts, hidden, inter]
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                gate, up = np.split(t, 2, axis=1)
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            else:
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(t))
            continue
        if name in names:
            out = names[name]
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            base, _, kind = rest.rpartition(".")
            out = f"blk.{layer}.{per_layer[base]}.{kind}"
        if arch == "llama" and out.endswith("attn_q.weight"):
            t = _interleave(t, cfg.num_attention_heads)
        elif arch == "llama" and out.endswith("attn_k.weight"):
            t = _interleave(t, cfg.num_key_value_heads)
        elif arch == "gemma2" and out.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    # query_pre_attn_scalar as the real 2B/9B models have it, the head dim (a GGUF file does not store it)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 8, "attn_logit_softcapping": 0.05,
                                                     "final_logit_softcapping": 0.3, "query_pre_attn_scalar": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                           "moe_intermediate_size": 32, "norm_topk_prob": True}),
}


def _hf_model(config_class, model_class, settings):
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**TINY, **settings})).eval()
    with torch.no_grad():  # move what starts at a constant (biases, norms, routers) so that mistakes show
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_family_matches_transformers(tmp_path, case):
    from kiln import LLM

    config_class, model_class, settings = CASES[case]
    hf = _hf_model(config_class, model_class, settings)
    arch = "llama" if case == "mixtral" else case
    path = tmp_path / f"{case}.gguf"
    write_gguf(hf, path, arch)
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt])).logits[0]
    # transformers' GGUF reader takes Qwen3's head_dim as 128 whatever the file says, and reads no MoE
    # of these two: the cross-check runs where it can.
    if case in ("llama", "qwen2", "gemma2"):
        reread = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        if case == "gemma2":  # transformers' GGUF reader keeps Gemma 2's default caps and scale, whatever the file says
            reread.config.final_logit_softcapping = hf.config.final_logit_softcapping
            for layer in reread.model.layers:
                layer.self_attn.attn_logit_softcapping = hf.config.attn_logit_softcapping
                layer.self_attn.scaling = hf.config.query_pre_attn_scalar**-0.5
        with torch.inference_mode():
            torch.testing.assert_close(reread(torch.tensor([prompt])).logits[0], theirs, atol=1e-5, rtol=1e-4)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    assert llm.engine.source.config.architecture == model_class
    model = llm.engine.runner.model
    with torch.inference_mode(), set_forward_context(None, {}):
        ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    from kiln.loader import load_source

    hf = _hf_model(*CASES["qwen2"])
    path = tmp_path / "qwen2.gguf"
    write_gguf(hf, path, "qwen2")
    fields = __import__("kiln.loader.gguf_header", fromlist=["read_gguf"]).read_gguf(path)[0]
    fields["tokenizer.ggml.pre"] = "deepseek-coder"
    from kiln.loader.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-coder' is not supported"):
        Tokenizer.from_gguf_fields(fields)
    assert load_source(str(path)).tokenizer is not None


SPM_TEXTS = ["the cat sings in the rain", "Hello, world!", "  two leading spaces", "tab\\tand\\nnewline",
             "日本語 🙂", "<s> a special token, then the end</s>", "theinthe"]


def _sentencepiece_gguf(path, arch: str) -> None:
    """A small SentencePiece vocabulary as llama.cpp stores one (tokenizer model 'llama'): control
    tokens, the 256 <0xNN> byte tokens, then pieces with descending scores."""
    pieces = ["▁", "t", "h", "e", "a", "i", "n", "g", "s", "r", "c", "o", "w", "l", "d", ",", "!", "H",
              "he", "▁t", "▁the", "in", "ing", "▁a", "er", "re", "on", "at", "▁c", "▁cat", "▁s", "▁sing", "▁r",
              "ai", "ain", "▁rain", "▁in", "ll", "llo", "▁w", "or", "orl", "▁wor", "▁H", "▁Hel", "el", "  ", "   "]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if arch == "gemma2" else ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3] * len(specials) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    bos, eos = (2, 1) if arch == "gemma2" else (1, 2)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(3 if arch == "gemma2" else 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path, arch):
    """Llama 2 / Mistral (and Gemma) GGUF files: kiln's tokenizer gives transformers' ids and text."""
    from kiln.loader.gguf_header import read_gguf
    from kiln.loader.tokenizer import Tokenizer

    path = tmp_path / "spm.gguf"
    _sentencepiece_gguf(path, arch)
    ours = Tokenizer.from_gguf_fields(read_gguf(path)[0], arch)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the")[0] == (2 if arch == "gemma2" else 1)  # BOS first
