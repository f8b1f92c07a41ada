"""A byte-level tokenizer for the tiny random Llama, so that tests can send text and chat to it.

The tiny model (`minikv.models.tiny_random_llama`) has a 256-token vocabulary and no tokenizer:
its text is gibberish by design. A server needs one to read a text prompt or apply a chat
template, so this builds one in memory (no file, no hub): token id = byte value, except ids 0, 1
and 2, which are the model's pad, BOS and EOS tokens (bytes 0-2 are control characters that
text never holds). It is a real `transformers` tokenizer, so `LLM(model, tokenizer=...)` and
the server decode exactly alike, invalid UTF-8 included.
"""

from __future__ import annotations

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` over bytes: 256 ids, <pad>=0, <s>=1, </s>=2, a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    as_char = bytes_to_unicode()   # GPT-2's byte -> printable character map, which ByteLevel expects
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {as_char[b]: b for b in range(3, 256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)
