"""A tiny random-weight Qwen2 text model with a locally built tokenizer: a plain vLLM model.

It stands for "an existing vLLM deployment" in the test that installing our plugin changes
nothing for `vllm serve MODEL` without --stage-config. Nothing in it is ours: a stock
architecture vLLM knows, a byte-level BPE tokenizer, head_dim 32 for vLLM's CPU attention.
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, byte_level_bpe

EOS = "<|endoftext|>"


def build_tiny_text_model(out_dir: Path, seed: int = 0, max_positions: int = 512) -> Path:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    vocab[EOS] = len(vocab)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(vocab, [], [EOS]), eos_token=EOS, pad_token=EOS
    )
    tokenizer.save_pretrained(out_dir)

    config = Qwen2Config(
        vocab_size=320,  # > len(vocab): room like real checkpoints have
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        eos_token_id=vocab[EOS],
        bos_token_id=vocab[EOS],
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return out_dir
