"""Pieces for tiny tokenizers built locally with the `tokenizers` library (no downloads).

The family builders hand these vocabularies and merges to the transformers class the real
checkpoint names (Qwen2Tokenizer, CLIPTokenizer, T5TokenizerFast build their own pipelines from
them; GLM-Image's processor tokenizer wraps `byte_level_bpe`), and that class's
`save_pretrained` writes the files, so the folders load through the same code as the hub ones.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2 style byte-level BPE uses for raw bytes, in byte order."""
    return sorted(ByteLevel.alphabet(), key=_byte_of)


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable latin-1 maps to itself, the rest was
    # shifted to 256 + n in byte order.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def byte_level_bpe(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    special_tokens: list[str],
) -> Tokenizer:
    """A GPT-2 style byte-level BPE (what GLM and Qwen use), with `special_tokens` matched whole.

    `vocab` must hold every byte stand-in, every merge result and every special token.
    """
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def small_merges(words: list[str] | list[list[str]]) -> list[tuple[str, str]]:
    """Left-to-right merges that make each word (a string, or its list of initial pieces) one token.

    A handful of merges is enough to exercise real BPE merging in tiny tokenizers.
    """
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = list(word)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in merges:
                merges.append(pair)
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
    return merges
